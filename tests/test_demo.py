"""``posteriorzoo demo``: trains, verifies, round-trips, resumes, and records provenance."""

from __future__ import annotations

import json
from pathlib import Path

from posteriorzoo.cli import main
from posteriorzoo.zoo import open_zoo, verify_manifest


def test_demo_runs_and_resumes(tmp_path, capsys, monkeypatch):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--checkpoints", "2", "--epochs", "1",
                 "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "bit-identical" in text and "[3] trained 2 checkpoint(s)" in text
    assert "CORRUPT" not in text
    assert "[1] reference target: 1000 x optunet on fashion-mnist" in text
    assert "[5] canonical Deep Ensemble de-canonical.h5: 100 checkpoints, 10 checked" in text
    assert (out / "mmd-report" / "mmd_report.md").read_text().count("| DE |") >= 1
    if Path("/usr/share/datasets/fashion-mnist").is_dir():
        ensemble = json.loads((out / "demo-summary.json").read_text())["ensemble"]
        assert ensemble["members"] == 100
        # averaging members' probabilities beats the average member
        assert ensemble["ensemble_nll"] < ensemble["member_nll_mean"]
    summary = json.loads((out / "demo-summary.json").read_text())
    provenance = summary["provenance"]
    assert summary["kind"] == "demo" and provenance["command"].startswith("posteriorzoo demo")
    assert provenance["seeds"] == {"base_seed": 0}
    assert summary["recipe"]["dataset"] == "digits"
    assert "torch" in provenance["versions"]
    with open_zoo(out / "optunet-digits-de.h5") as zoo:
        first = [str(d) for d in zoo.metadata["sha256"]]
        assert zoo.created_by["command"] == provenance["command"]
    verify_manifest(out)
    # The reference steps were checked above; the checks below do not need them.
    monkeypatch.setattr("posteriorzoo.cli.demo.reference_step", lambda progress: {})
    monkeypatch.setattr("posteriorzoo.cli.demo.ensemble_step", lambda: None)
    monkeypatch.setattr("posteriorzoo.cli.demo.symmetry_step", lambda out, command: {})
    monkeypatch.setattr("posteriorzoo.cli.demo.mmd_step", lambda out, command, progress: {})
    # An existing output folder is refused and left as it was ...
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert main(["demo", "--out", str(out), "--checkpoints", "2", "--epochs", "1",
                 "--no-progress"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    # ... unless overwriting is asked for: the same seeds give the same checkpoints.
    assert main(["demo", "--out", str(out), "--checkpoints", "3", "--epochs", "1",
                 "--no-progress", "--overwrite"]) == 0
    with open_zoo(out / "optunet-digits-de.h5") as zoo:
        assert len(zoo) == 3
        assert [str(d) for d in zoo.metadata["sha256"][:2]] == first
        assert list(zoo.metadata["mode_id"]) == [0, 1, 2]
    assert not (out / "mmd-report").exists()  # the old folder was replaced, not merged
    # --json: the summary alone on stdout, the step lines on stderr
    capsys.readouterr()
    assert main(["demo", "--out", str(out), "--checkpoints", "2", "--epochs", "1",
                 "--no-progress", "--overwrite", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["kind"] == "demo" and "[3] trained" in captured.err
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]  # no temporary left behind
