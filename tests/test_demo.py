"""``posteriorzoo demo``: trains, verifies, round-trips, resumes, and records provenance."""

from __future__ import annotations

import json

from posteriorzoo.cli import main
from posteriorzoo.zoo import open_zoo, verify_manifest


def test_demo_runs_and_resumes(tmp_path, capsys, monkeypatch):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--checkpoints", "2", "--epochs", "1",
                 "--n-images", "300", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "bit-identical" in text and "[3] trained 2 checkpoint(s)" in text
    assert "CORRUPT" not in text
    assert "[1] reference target: 1000 x optunet on fashion-mnist" in text
    # the report on the whole shipped zoo (its test split ships with the package): every
    # method, its page, Table 1 printed
    report = json.loads((out / "demo-summary.json").read_text())["report"]
    assert [row["name"] for row in report["table1"]] == [
        "DE", "Dropout", "BBB", "BBB (trained-variance)", "SWAG", "Laplace", "Laplace (kfac)",
        "Laplace (diag)", "Laplace (last-layer-kfac)", "SGHMC", "IVON", "cSGLD", "cSGHMC",
        "EMP", "ECMP", "Rank-1", "MM-Dropout", "MM-BBB", "MM-BBB (trained-variance)",
        "MM-SWAG", "MM-Laplace", "MM-Laplace (kfac)", "MM-Laplace (diag)", "MM-IVON", "SVGD"]
    assert f"[2] report on the reference zoo (OOD: {report['ood']}): " \
           f"{out / 'report' / 'report.html'}" in text
    assert "| MM-Laplace | multi-mode | 100 |" in text
    assert (out / "report" / "report.html").is_file()
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
    monkeypatch.setattr("posteriorzoo.cli.demo.report_step", lambda *a, **k: None)
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
    assert not (out / "report").exists()  # the old folder was replaced, not merged
    # --json: the summary alone on stdout, the step lines on stderr
    capsys.readouterr()
    assert main(["demo", "--out", str(out), "--checkpoints", "2", "--epochs", "1",
                 "--no-progress", "--overwrite", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["kind"] == "demo" and "[3] trained" in captured.err
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]  # no temporary left behind
