"""Collections and checkpoints holding numbers of a foreign dtype, and the other findings
of the hostile probe on the shipped DE collection's kind of file.

Each case is crafted with h5py (the crafts of ``fuzz_cases.py``, whose ``foreign dtype``
class the fuzz suite runs through every command) on a small collection, then every
command that used to give a traceback on it is run: exit code 2, one line on stderr,
the input byte-identical, nothing left behind; through the API, a PosteriorZooError.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from fuzz_cases import foreign_dtype_cases
from safetensors.torch import save_file
from zoo_helpers import assert_one_line_error, checkpoint, run

from posteriorzoo.collection import (
    describe,
    export_all,
    export_checkpoint,
    import_checkpoints,
    min_mass,
    verify,
)
from posteriorzoo.errors import PosteriorZooError, ZooFormatError, ZooSchemaError
from posteriorzoo.results import strict_json
from posteriorzoo.zoo import create_zoo, open_zoo

COUNT = 6


def _snapshot(folder: Path) -> dict[str, str]:
    """SHA-256 of every file under ``folder`` (hidden temporaries included)."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """An intact optunet collection on the bundled digits (no system data needed)."""
    path = tmp_path_factory.mktemp("pristine") / "zoo.h5"
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=checkpoint(0)) as zoo:
        zoo.append_many([checkpoint(seed) for seed in range(COUNT)],
                        [{"seed": seed, "mode_id": seed, "sample_id": 0,
                          "test_accuracy": 0.5 + seed / 100} for seed in range(COUNT)])
    return path


def crafted(pristine: Path, folder: Path, case: str) -> Path:
    """A copy of ``pristine`` in ``folder/in`` damaged as the fuzz case ``case``."""
    (folder / "in").mkdir()
    path = folder / "in" / "zoo.h5"
    shutil.copyfile(pristine, path)
    foreign_dtype_cases()[case](path, folder)
    return path


def refused_cleanly(capsys, tmp_path: Path, argv: list, *fragments: str) -> None:
    """Run the CLI: exit 2, one line on stderr holding ``fragments``, every file under
    ``tmp_path`` unchanged and none added."""
    before = _snapshot(tmp_path)
    code, _, err = run(capsys, *argv)
    assert_one_line_error(code, err, *fragments)
    assert _snapshot(tmp_path) == before


# ---------------------------------------------------------------------- 1 byte order
@pytest.mark.parametrize("command", ["info", "verify", "upload"])
def test_big_endian_tensor_is_one_line(pristine, tmp_path, capsys, command):
    path = crafted(pristine, tmp_path, "big-endian-float")
    with h5py.File(path, "r") as handle:  # the digests still hold: they are byte-order free
        assert handle["state/fc.weight"].dtype == np.dtype(">f4")
    argv = {"info": ["info", path], "verify": ["verify", path, "--no-progress"],
            "upload": ["upload", "someone/zoo", path, "--dry-run"]}[command]
    refused_cleanly(capsys, tmp_path, argv, "'fc.weight'", ">f4", "big-endian")
    with pytest.raises(ZooFormatError, match=r"'fc.weight' has dtype >f4"):
        open_zoo(path)
    with pytest.raises(PosteriorZooError):
        describe(path)


def test_a_big_endian_template_creates_nothing(tmp_path):
    template = {key: value.numpy().astype(">f4") for key, value in checkpoint(0).items()}
    with pytest.raises(ZooSchemaError, match="big-endian"):
        create_zoo(tmp_path / "zoo.h5", architecture="optunet", dataset="digits",
                   method="de", template=template)
    with pytest.raises(ZooSchemaError, match="'fc.bias' has dtype bool"):
        create_zoo(tmp_path / "zoo.h5", architecture="my-own-net", dataset="digits",
                   method="de", template={"fc.bias": np.zeros(3, bool)}, validate=False)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------- 2 num_classes
@pytest.mark.parametrize("value", [2**62, 0, 100_001])
@pytest.mark.parametrize("command", ["info", "verify"])
def test_num_classes_out_of_range_is_one_line(pristine, tmp_path, capsys, value, command):
    path = tmp_path / "zoo.h5"
    shutil.copyfile(pristine, path)
    with h5py.File(path, "r+") as handle:
        handle.attrs["num_classes"] = np.int64(value)
    argv = ["info", path] if command == "info" else ["verify", path, "--no-progress"]
    refused_cleanly(capsys, tmp_path, argv, "num_classes", str(value), "1 to 100000")
    with pytest.raises(ZooFormatError, match="num_classes"):
        open_zoo(path)


# ---------------------------------------------------------------------- 3 bool and int
@pytest.mark.parametrize(("case", "key", "dtype"), [
    ("bool-tensor", "fc.bias", "bool"), ("int32-weights", "fc.bias", "int32"),
    ("int64-weights", "conv1.weight", "int64"), ("complex-tensor", "fc.bias", "complex64")])
@pytest.mark.parametrize("command", ["info", "verify", "canonicalize", "mmd"])
def test_non_floating_weights_are_refused(pristine, tmp_path, capsys, case, key, dtype,
                                          command):
    path = crafted(pristine, tmp_path, case)
    out = tmp_path / "out"
    argv = {"info": ["info", path], "verify": ["verify", path, "--no-progress"],
            "canonicalize": ["canonicalize", path, "--out", out, "--no-progress"],
            "mmd": ["mmd", path, pristine, "--out", out, "--no-progress"]}[command]
    refused_cleanly(capsys, tmp_path, argv, repr(key), dtype)
    assert not out.exists()
    with pytest.raises(PosteriorZooError, match=dtype):
        describe(path)


@pytest.mark.parametrize(("dtype", "name"), [(torch.bool, "BOOL"), (torch.int32, "int32"),
                                             (torch.int64, "int64")])
def test_import_refuses_non_floating_weights(pristine, tmp_path, capsys, dtype, name):
    state = checkpoint(7)
    state["fc.bias"] = (state["fc.bias"] * 100).to(dtype)
    foreign = tmp_path / "foreign.safetensors"
    save_file(state, str(foreign))
    existing = tmp_path / "existing.h5"
    shutil.copyfile(pristine, existing)
    # a new collection (checked against the architecture) and an existing one
    new = ["import", foreign, "--out", tmp_path / "new.h5", "--architecture", "optunet",
           "--dataset", "digits", "--method", "de", "--no-progress"]
    refused_cleanly(capsys, tmp_path, new, "'fc.bias'", name)
    refused_cleanly(capsys, tmp_path, ["import", foreign, "--out", existing, "--no-progress"],
                    "fc.bias", name)
    with pytest.raises(PosteriorZooError, match="fc.bias"):
        import_checkpoints(tmp_path / "api.h5", [foreign], architecture="optunet",
                           dataset="digits", method="de")
    assert not (tmp_path / "new.h5").exists() and not (tmp_path / "api.h5").exists()


def test_integer_buffers_of_the_model_are_still_stored(tmp_path):
    """BatchNorm's num_batches_tracked is an integer the model has: kept, not refused."""
    options = {"widths": [4, 3, 2]}
    state = checkpoint(0, "mlp-bn", **options)
    assert any(not value.is_floating_point() for value in state.values())
    path = tmp_path / "bn.h5"
    with create_zoo(path, architecture="mlp-bn", dataset="d", method="de",
                    model_options=options, template=state) as zoo:
        zoo.append(state)
    assert verify(path).ok
    with open_zoo(path) as zoo:
        assert any(dtype.kind == "i" for dtype in zoo.dtypes.values())


# ---------------------------------------------------------------------- 4 validated=False
def test_unvalidated_wrong_shape_is_reported_by_info_and_verify(pristine, tmp_path, capsys):
    path = crafted(pristine, tmp_path, "unvalidated-wrong-shape")
    before = _snapshot(tmp_path)
    code, out, err = run(capsys, "info", path)
    assert code == 0 and err == ""
    assert "fits model    NO" in out and "'fc.weight' has shape (7, 10)" in out
    code, out, _ = run(capsys, "info", path, "--json")
    assert code == 0 and json.loads(out)["fits_architecture"] is False
    code, out, _ = run(capsys, "verify", path, "--no-progress")
    assert code == 0 and "do not fit architecture 'optunet'" in out
    report = verify(path)
    assert report.ok and report.fits_architecture is False
    assert describe(path).fits_architecture is False
    assert _snapshot(tmp_path) == before
    assert describe(pristine).fits_architecture is True


@pytest.mark.parametrize("command", ["min-mass", "plot-mass", "diagnose", "canonicalize"])
def test_commands_that_build_the_network_refuse_a_wrong_shape(pristine, tmp_path, capsys,
                                                              command):
    path = crafted(pristine, tmp_path, "unvalidated-wrong-shape")
    out = tmp_path / "out"
    argv = {"min-mass": ["min-mass", path, "--out", out, "--no-progress"],
            "plot-mass": ["plot", "mass", path, "--out", out],
            "diagnose": ["diagnose", path],
            "canonicalize": ["canonicalize", path, "--out", out, "--no-progress"]}[command]
    refused_cleanly(capsys, tmp_path, argv, "does not fit architecture optunet",
                    "'fc.weight' has shape (7, 10)")
    assert not list(tmp_path.glob("out*"))
    with pytest.raises(ZooFormatError, match="does not fit architecture"):
        min_mass(path)


# ---------------------------------------------------------------------- 5 non-UTF-8 text
def test_export_of_non_utf8_metadata_is_one_line(pristine, tmp_path, capsys):
    path = crafted(pristine, tmp_path, "non-utf8-metadata")
    out = tmp_path / "out"
    refused_cleanly(capsys, tmp_path, ["export", path, "0", "--out", out], "'source'",
                    "not UTF-8")
    refused_cleanly(capsys, tmp_path, ["export", path, "--all", "--out", out], "'source'")
    with pytest.raises(ZooFormatError, match="checkpoint 0's metadata 'source'"):
        export_checkpoint(path, 0, out)
    with pytest.raises(ZooFormatError, match="not UTF-8"):
        export_all(path, out)
    assert not out.exists()
    export_checkpoint(path, 1, out)  # the other rows are text: exported as they are
    assert out.is_file()


def test_export_from_a_file_name_that_is_not_utf8(pristine, tmp_path):
    """A file name's bytes need not be UTF-8; the header's label is made text."""
    path = tmp_path / os.fsdecode(b"\xff.h5")
    shutil.copyfile(pristine, path)
    export_checkpoint(path, 0, tmp_path / "one.safetensors")
    assert (tmp_path / "one.safetensors").is_file()


# ---------------------------------------------------------------------- 6 strict JSON
def _strict(text: str) -> object:
    def refuse(constant: str) -> None:
        raise AssertionError(f"not strict JSON: bare {constant}")
    return json.loads(text, parse_constant=refuse)


def test_info_json_is_strict_with_a_nan_recipe(pristine, tmp_path, capsys):
    path = tmp_path / "zoo.h5"
    shutil.copyfile(pristine, path)
    with h5py.File(path, "r+") as handle:
        handle.attrs["recipe"] = '{"lr": NaN, "clip": Infinity, "decay": -Infinity}'
    code, out, err = run(capsys, "info", path, "--json")
    assert code == 0 and err == ""
    assert _strict(out)["recipe"] == {"lr": None, "clip": None, "decay": None}
    code, out, _ = run(capsys, "info", path)
    assert "lr     NaN" in out  # the text keeps what is stored
    code, out, _ = run(capsys, "verify", path, "--json", "--no-progress")
    assert code == 0 and _strict(out)[0]["ok"] is True
    assert _strict(describe(path).to_json())["recipe"]["lr"] is None


def test_strict_json_keeps_finite_numbers():
    value = {"a": [1.5, math.nan, (math.inf, 2)], "b": {"c": -math.inf}, "d": True, "e": 3}
    assert _strict(strict_json(value)) == {"a": [1.5, None, [None, 2]], "b": {"c": None},
                                           "d": True, "e": 3}
