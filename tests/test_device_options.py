"""--device and --precision on mmd: what reaches the computation, what is recorded, and
the one-line refusal of a device this torch lacks (the GPU paths themselves run on CPU in
tests/test_training_device.py, tests/test_mmd_distances_fast.py and benchmarks/gpu_check.py
--quick)."""

from __future__ import annotations

import json

import pytest
import torch
from zoo_helpers import checkpoint, run

from posteriorzoo.zoo import create_zoo


@pytest.fixture(scope="module")
def collections(tmp_path_factory):
    folder = tmp_path_factory.mktemp("devices")
    paths = {}
    for name, seeds in (("target", range(8)), ("method", range(10, 14))):
        states = [checkpoint(seed) for seed in seeds]
        with create_zoo(folder / f"{name}.h5", architecture="optunet", dataset="digits",
                        method="de", num_classes=10, template=states[0]) as zoo:
            for state in states:
                zoo.append(state)
        paths[name] = folder / f"{name}.h5"
    return paths


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_mmd_records_the_precision_and_device_it_computed_with(collections, tmp_path,
                                                                 capsys, precision):
    code, printed, err = run(capsys, "mmd", collections["target"], collections["method"],
                             "--symmetries", "keep", "--precision", precision,
                             "--out", tmp_path / "r", "--no-progress", "--json")
    assert code == 0, err
    options = json.loads(printed)["provenance"]["options"]
    assert options["precision"] == precision and options["device"] == "cpu"


def test_mmd_defaults_to_exact_on_cpu_and_refuses_cuda_without_a_gpu(collections, tmp_path,
                                                                      capsys):
    code, printed, err = run(capsys, "mmd", collections["target"], collections["method"],
                             "--symmetries", "keep", "--out", tmp_path / "r",
                             "--no-progress", "--json")
    assert code == 0, err
    assert json.loads(printed)["provenance"]["options"]["precision"] == "exact"
    if torch.cuda.is_available():
        return
    code, _, err = run(capsys, "mmd", collections["target"], collections["method"],
                       "--device", "cuda", "--out", tmp_path / "g", "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "sees no CUDA GPU" in err
    assert not (tmp_path / "g").exists()
