"""The CLI on collection files: info, verify, export, import, and bad input (exit code 2)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from zoo_helpers import assert_one_line_error, checkpoint, flip_byte_in_chunk, run

from posteriorzoo.cli import main
from posteriorzoo.zoo import create_zoo, open_zoo, write_manifest


@pytest.fixture
def zoo_file(tmp_path):
    path = tmp_path / "zoo.h5"
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=checkpoint(0), recipe={"epochs": 3}) as zoo:
        for seed in range(5):
            zoo.append(checkpoint(seed), seed=seed, test_accuracy=0.6 + seed / 10)
    return path




def test_help_lists_subcommands():
    result = subprocess.run([sys.executable, "-m", "posteriorzoo", "--help"],
                            capture_output=True, text=True, check=True)
    for command in ("info", "verify", "export", "import", "download", "upload", "demo"):
        assert command in result.stdout


def test_info(capsys, zoo_file):
    code, out, _ = run(capsys, "info", zoo_file)
    assert code == 0
    assert "optunet" in out and "checkpoints   5" in out
    assert "conv2.weight" in out and "10x1x5x5" in out and "250" in out
    code, out, _ = run(capsys, "info", zoo_file, "--json")
    info = json.loads(out)
    assert info["checkpoints"] == 5
    assert info["values_per_checkpoint"] == 392
    assert sum(t["count"] for t in info["tensors"]) == 392
    assert info["metadata"]["test_accuracy"]["max"] == 1.0  # 0.6 + 0.4 rounds to 1 exactly
    assert info["metadata"]["distinct_seeds"] == 5


def test_verify_detects_bit_rot(capsys, tmp_path, zoo_file):
    code, out, _ = run(capsys, "verify", "--no-progress", zoo_file)
    assert code == 0 and "OK, 5 checkpoints" in out
    damaged = tmp_path / "damaged.h5"
    shutil.copy(zoo_file, damaged)
    flip_byte_in_chunk(damaged, "conv2.weight", offset=4 * 250 * 2 + 1)  # inside checkpoint 2
    code, _, err = run(capsys, "verify", "--no-progress", damaged)
    assert_one_line_error(code, err, "CORRUPT", "[2]")


def test_verify_checks_the_manifest(capsys, tmp_path, zoo_file):
    write_manifest(tmp_path)
    code, out, _ = run(capsys, "verify", "--no-progress", zoo_file)
    assert code == 0 and "manifest matches" in out
    # an edit that keeps every checkpoint intact but changes the file
    with open_zoo(zoo_file, mode="r+") as zoo:
        zoo.append(checkpoint(9), seed=9)
    code, _, err = run(capsys, "verify", "--no-progress", zoo_file)
    assert_one_line_error(code, err, "SHA256SUMS")


@pytest.mark.parametrize("content", ["missing", "text", "truncated"])
def test_bad_files_exit_2_with_one_line(capsys, tmp_path, zoo_file, content):
    target = tmp_path / f"{content}.h5"
    if content == "text":
        target.write_text("hello")
    elif content == "truncated":
        data = zoo_file.read_bytes()
        target.write_bytes(data[: len(data) // 2])
    for command in (["info"], ["verify", "--no-progress"], ["export"]):
        extra = [0, "--out", tmp_path / "x.safetensors"] if command == ["export"] else []
        code, _, err = run(capsys, *command, target, *extra)
        assert_one_line_error(code, err, str(target))


def test_export_import_round_trip(capsys, tmp_path, zoo_file):
    code, out, _ = run(capsys, "export", zoo_file, 3, "--out", tmp_path / "c3.safetensors")
    assert code == 0
    code, out, _ = run(capsys, "export", zoo_file, "--all", "--out", tmp_path / "all")
    assert code == 0 and "exported 5" in out
    files = sorted((tmp_path / "all").glob("*.safetensors"))
    code, out, _ = run(capsys, "import", "--no-progress", "--out", tmp_path / "copy.h5", *files)
    assert code == 0 and "created" in out
    with open_zoo(zoo_file) as original, open_zoo(tmp_path / "copy.h5") as copy:
        assert len(copy) == 5
        assert (copy.metadata["sha256"] == original.metadata["sha256"]).all()
        for index in range(5):
            assert all(torch.equal(copy.state_dict(index)[k], original.state_dict(index)[k])
                       for k in original.state_keys)
    code, _, err = run(capsys, "export", zoo_file, 7, "--out", tmp_path / "x.safetensors")
    assert_one_line_error(code, err, "out of range")


def test_import_rejects_bad_checkpoints_and_keeps_the_collection(capsys, tmp_path, zoo_file):
    before = zoo_file.read_bytes()
    nan = checkpoint(1)
    nan["conv1.weight"][0, 0, 0, 0] = float("nan")
    save_file(nan, str(tmp_path / "nan.safetensors"))
    save_file({**checkpoint(1), "fc.weight": torch.zeros(3, 10)},
              str(tmp_path / "shape.safetensors"))
    save_file(checkpoint(0, "mlp", widths=(2, 4, 10)), str(tmp_path / "mlp.safetensors"))
    for name, fragment in (("nan", "NaN"), ("shape", "shape"), ("mlp", "keys")):
        code, _, err = run(capsys, "import", "--no-progress", "--out", zoo_file,
                           tmp_path / f"{name}.safetensors")
        assert_one_line_error(code, err, fragment)
    assert zoo_file.read_bytes() == before
    # a new collection whose inputs do not fit the named architecture
    code, _, err = run(capsys, "import", "--no-progress", "--out", tmp_path / "new.h5",
                       tmp_path / "mlp.safetensors", "--architecture", "optunet",
                       "--dataset", "digits", "--method", "de")
    assert_one_line_error(code, err, "optunet")
    code, _, err = run(capsys, "import", "--no-progress", "--out", tmp_path / "new.h5",
                       tmp_path / "mlp.safetensors", "--architecture", "no-such-net",
                       "--dataset", "digits", "--method", "de")
    assert_one_line_error(code, err, "no-such-net")
    assert not (tmp_path / "new.h5").exists()


def test_import_with_model_options(capsys, tmp_path):
    state = checkpoint(0, "mlp", widths=(2, 4, 3))
    save_file(state, str(tmp_path / "mlp.safetensors"))
    code, _, err = run(capsys, "import", "--no-progress", "--out", tmp_path / "mlp.h5",
                       tmp_path / "mlp.safetensors", "--architecture", "mlp",
                       "--dataset", "blobs", "--method", "de", "--model-option", "widths=[2,4,3]")
    assert code == 0, err
    with open_zoo(tmp_path / "mlp.h5") as zoo:
        assert zoo.model_options == {"widths": [2, 4, 3]}


@pytest.mark.parametrize("argv", [["info"], ["frobnicate"], ["export", "z.h5", "x", "--out"],
                                  ["train", "spec.toml", "--workers", "0"]])
def test_usage_errors_are_one_line_with_exit_2(capsys, argv):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--help" in err


def test_verify_json_reports_every_file(capsys, tmp_path, zoo_file):
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"not hdf5")
    code, out, err = run(capsys, "verify", zoo_file, bad, "--json", "--no-progress")
    reports = json.loads(out)
    assert code == 2 and [r["ok"] for r in reports] == [True, False]
    assert reports[0]["checkpoints"] == 5 and "not an HDF5 file" in reports[1]["problems"][0]
    assert [r["kind"] for r in reports] == ["verify", "verify"]
    assert reports[0]["provenance"]["inputs"]["collection"]["path"] == str(zoo_file)
    assert err.count("\n") == 1  # the bad file's one error line


def test_export_and_import_json_print_the_results(capsys, tmp_path, zoo_file):
    code, out, _ = run(capsys, "export", zoo_file, "--all", "--out", tmp_path / "all", "--json")
    exported = json.loads(out)
    assert code == 0 and exported["kind"] == "export" and exported["checkpoints"] == 5
    assert [f["index"] for f in exported["exported"]] == list(range(5))
    assert exported["provenance"]["command"].startswith("posteriorzoo export")
    code, out, _ = run(capsys, "export", zoo_file, 1, "--out", tmp_path / "c1.safetensors",
                       "--json")
    assert json.loads(out)["exported"][0]["name"] == "c1.safetensors"
    files = sorted((tmp_path / "all").glob("*.safetensors"))
    code, out, _ = run(capsys, "import", "--no-progress", "--json", "--out",
                       tmp_path / "copy.h5", *files)
    imported = json.loads(out)
    assert code == 0 and imported["kind"] == "import" and imported["created"]
    assert imported["added"] == list(range(5)) and imported["inputs"] == 5
    assert len(imported["provenance"]["inputs"]) == 5


def test_train_without_out_is_a_usage_error_before_the_spec_is_read(capsys):
    # --out is needed unless --dry-run: said in one line, even for a spec that does not exist
    assert main(["train", "no-such-spec.toml"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out" in err[0] and "--dry-run" in err[0]
