"""``download --dry-run`` and ``upload --dry-run`` (nothing transferred), and an upload
without a token (one line, before any network call).

Real huggingface_hub talks to the fake Hub of tests/fake_hub.py on 127.0.0.1 (or reads a
cache built in a temporary folder); the fixtures are those of tests/test_hub.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_hub
from fake_hub import COMMIT
from test_hub import REPO, build_hf_cache, transfers

from posteriorzoo.hub import plan_download, plan_upload
from posteriorzoo.hub._errors import login_command
from posteriorzoo.zoo.manifest import MANIFEST_NAME

# The fixtures of tests/test_hub.py, under the names the tests ask for (the first two
# apply to every test: loopback only, a private offline cache and no token).
loopback_only = test_hub.loopback_only
isolated_hub = test_hub.isolated_hub
repo_source = test_hub.repo_source
hub = test_hub.hub
collections = test_hub.collections
run_cli = test_hub.run_cli


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too) and its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------- download
def test_download_dry_run_lists_files_sizes_and_commit_and_fetches_nothing(
        run_cli, hub, isolated_hub, tmp_path):
    code, out, err = run_cli("download", REPO, "--include", "*.h5", "--dry-run")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"dry run, nothing transferred: would download from dataset "
                               f"'{REPO}' at revision main (commit {COMMIT}), 3 of 3 file(s)")
    sizes = {name: len(data) for name, data in hub.files.items()}
    for name in ("a.h5", "sub/b.h5", MANIFEST_NAME):
        assert any(line.split()[:2] == ["transfer", name]
                   and line.split()[2] == f"{sizes[name]:,}" for line in lines), name
    assert "README.md" not in out                      # not selected by --include
    assert transfers(hub) == []                        # no file was fetched
    assert tree(isolated_hub) == {}                    # and nothing was cached
    code, out, err = run_cli("download", REPO, "--dry-run", "--json")
    plan = json.loads(out)
    assert plan["dry_run"] and plan["commit"] == COMMIT and plan["revision"] == "main"
    assert {f["name"]: f["size"] for f in plan["files"]} == sizes
    assert plan["bytes_to_transfer"] == sum(sizes.values())
    assert transfers(hub) == [] and tree(isolated_hub) == {}


def test_download_dry_run_into_a_folder_says_what_would_be_kept_or_refused(
        run_cli, hub, tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "a.h5").write_bytes(hub.files["a.h5"])      # identical
    (target / "README.md").write_text("# my own notes\n")  # differs from the repository's
    before = tree(target)
    code, out, err = run_cli("download", REPO, "--out", str(target), "--dry-run", "--json")
    assert code == 0, err
    actions = {f["name"]: f["action"] for f in json.loads(out)["files"]}
    assert actions == {"a.h5": "identical", "README.md": "refused", "sub/b.h5": "transfer",
                       MANIFEST_NAME: "transfer"}
    code, out, _ = run_cli("download", REPO, "--out", str(target), "--dry-run", "--overwrite")
    assert code == 0 and " replace " in out and "README.md" in out
    assert tree(target) == before and transfers(hub) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf-cache", "mine", "repo"]


def test_download_dry_run_errors_are_one_line(run_cli, hub, tmp_path):
    code, out, err = run_cli("download", REPO, "--include", "*.csv", "--dry-run")
    assert code == 2 and out == "" and len(err) == 1 and "matches *.csv" in err[0]
    hub.fail["info"] = (404, b"{}", {"X-Error-Code": "RepoNotFound"})
    code, out, err = run_cli("download", REPO, "--dry-run")
    assert code == 2 and out == "" and len(err) == 1 and "not found" in err[0], err


def test_offline_dry_run_lists_the_cached_snapshot(run_cli, repo_source, isolated_hub,
                                                   tmp_path):
    build_hf_cache(isolated_hub, repo_source)
    plan = plan_download(REPO, include="*.h5")
    assert plan.commit == COMMIT and plan.moved == []
    assert {f.name: (f.size, f.action) for f in plan.files} == {
        name: ((repo_source / name).stat().st_size, "cached")
        for name in ("a.h5", "sub/b.h5", MANIFEST_NAME)}
    out = tmp_path / "copy"
    assert {f.action for f in plan_download(REPO, local_dir=out).files} == {"from cache"}
    assert not out.exists()
    code, _, err = run_cli("download", "org/absent", "--dry-run")
    assert code == 2 and len(err) == 1 and "HF_HUB_OFFLINE" in err[0]


# ---------------------------------------------------------------------- upload
def test_upload_dry_run_lists_what_would_be_sent_and_contacts_nobody(run_cli, hub,
                                                                     collections):
    card = collections / "card.md"
    card.write_text("# card\n")
    code, out, err = run_cli("upload", REPO, str(collections), "--path-in-repo", "runs",
                             "--revision", "dev", "--card", str(card), "--dry-run")
    assert code == 0, err
    assert out.startswith(f"dry run, nothing transferred: would upload to dataset '{REPO}' "
                          "at revision dev, 4 of 4 file(s)")
    for name, local in (("runs/a.h5", collections / "a.h5"),
                        ("runs/deep/b.h5", collections / "deep" / "b.h5"),
                        ("README.md", card)):
        assert f"{local.stat().st_size:,} bytes" in next(
            line for line in out.splitlines() if f" {name} " in line)
    assert f"runs/{MANIFEST_NAME}" in out and "note:" not in out  # the fixture has a token
    assert hub.requests == [] and hub.commits == []


def test_upload_dry_run_makes_the_upload_s_checks_and_notes_a_missing_token(
        monkeypatch, collections, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    plan = plan_upload(REPO, collections, token=False)
    assert [f.name for f in plan.files] == ["a.h5", "deep/b.h5", MANIFEST_NAME]
    assert any("no Hugging Face token" in note for note in plan.notes)
    assert any("HF_HUB_OFFLINE" in note for note in plan.notes)  # the tests run offline
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not a collection")
    from posteriorzoo.errors import ZooFormatError

    with pytest.raises(ZooFormatError, match="not an HDF5 file"):
        plan_upload(REPO, bad)


def test_upload_without_a_token_is_one_line(hub, collections, tmp_path):
    """A real process with HF_TOKEN unset and HF_HOME an empty folder: the upload says
    there is no token, on one line, before contacting the Hub."""
    home = tmp_path / "empty-hf-home"
    home.mkdir()
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith(("HF_", "HUGGING_FACE_HUB_"))}
    environment.update(HF_HOME=str(home), HF_ENDPOINT=hub.endpoint, HF_HUB_DISABLE_TELEMETRY="1")
    finished = subprocess.run(
        [sys.executable, "-m", "posteriorzoo", "upload", REPO, str(collections)],
        capture_output=True, text=True, env=environment, timeout=300)
    assert finished.returncode == 2, finished.stderr
    assert finished.stdout == ""
    assert finished.stderr.splitlines() == [
        f"posteriorzoo upload: error: no Hugging Face token: run `{login_command()}` or "
        "set HF_TOKEN"]
    assert hub.requests == [] and hub.commits == []
    assert list(home.iterdir()) == []


def test_login_command_follows_the_installed_huggingface_hub(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "__version__", "0.36.0")
    assert login_command() == "huggingface-cli login"
    monkeypatch.setattr(huggingface_hub, "__version__", "1.2.0")
    assert login_command() == "hf auth login"
