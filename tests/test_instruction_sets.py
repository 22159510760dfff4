"""What the trainer promises across CPU instruction sets (README: "bit-identical weights
with the same engine, thread count and CPU instruction set").

The same small training (``isa_driver.py``: OptuNet on digits, 169 SGD steps, both
engines, one thread) runs in subprocesses twice under the host's CPU features and twice
under ``isa_driver.avx2_environment()`` (torch, oneDNN, MKL, numba, OpenBLAS and numpy
restricted to AVX2, as on a Haswell CPU; numba with a cache of its own):

* within one instruction set, two runs give bit-identical weights, losses and metrics;
* across instruction sets they may legitimately differ bit for bit (each library picks
  its kernels, and so its summation order, from the CPU): measured, torch's weights
  differ by 1 ulp after the first steps, 9e-8 after 169; the numba kernels (no fast-math,
  explicit lanes) gave the same bits. They must agree within the analysed bound, step
  by step (``rounding_bounds.compare_runs``: each step's loss within the forward pass's
  rounding bound, each step's change within the gradient's ``gamma(k)``, unless the
  step's batch has a decision within rounding of switching, where chaotic training may
  part).

On a CPU without AVX-512 both settings are the same instruction set, and the runs are
then bit-identical across them as well (checked where torch reports AVX2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import isa_driver
import numpy as np
import pytest
import torch
from rounding_bounds import compare_runs

DRIVER = Path(__file__).with_name("isa_driver.py")

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="the comparison needs a CPU with AVX2 (torch reports "
           f"{torch.backends.cpu.get_cpu_capability()})")


def _run(out: Path, environment: dict[str, str]) -> dict[str, np.ndarray]:
    done = subprocess.run([sys.executable, str(DRIVER), str(out)], env=environment,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out) as arrays:
        return {key: arrays[key] for key in arrays.files}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict[str, np.ndarray]]]:
    folder = tmp_path_factory.mktemp("isa")
    avx2 = isa_driver.avx2_environment()
    host = {key: value for key, value in os.environ.items() if key not in avx2}
    restricted = {**host, **avx2, "NUMBA_CACHE_DIR": str(folder / "numba-avx2")}
    return {name: [_run(folder / f"{name}-{i}.npz", environment) for i in range(2)]
            for name, environment in (("host", host), ("avx2", restricted))}


def _machine(arrays: dict[str, np.ndarray]) -> dict[str, str]:
    return json.loads(str(arrays["machine"]))


def test_the_settings_select_the_instruction_sets(runs):
    assert {_machine(run)["aten"] for run in runs["avx2"]} == {"AVX2"}
    assert {_machine(run)["numba"] for run in runs["avx2"]} == {"haswell"}
    assert _machine(runs["host"][0])["aten"] in ("AVX2", "AVX512")


@pytest.mark.parametrize("setting", ["host", "avx2"])
def test_one_instruction_set_gives_bit_identical_runs(runs, setting):
    first, second = runs[setting]
    assert first.keys() == second.keys()
    for key in first:
        assert np.array_equal(first[key], second[key]), key


def _steps(arrays: dict[str, np.ndarray], engine: str) -> tuple[list[dict], list[tuple]]:
    prefix = f"{engine}/steps/"
    keys = [key.removeprefix(prefix) for key in arrays if key.startswith(prefix)]
    count = len(arrays[f"{engine}/info"])
    weights = [{key: arrays[prefix + key][step] for key in keys} for step in range(count)]
    info = [(int(i), int(e), int(s), lr, loss) for i, e, s, lr, loss in arrays[f"{engine}/info"]]
    return weights, info


@pytest.mark.parametrize("engine", isa_driver.ENGINES)
def test_instruction_sets_agree_within_the_rounding_bound(runs, engine):
    from train_zoo.data import load_training_data

    host, avx2 = runs["host"][0], runs["avx2"][0]
    if _machine(host)["aten"] == "AVX2" and engine == "torch":
        # the host has no AVX-512: the same kernels, hence the same bits
        assert all(np.array_equal(host[key], avx2[key]) for key in host if key != "machine")
    weights_h, info_h = _steps(host, engine)
    weights_a, info_a = _steps(avx2, engine)
    assert len(info_h) == 169
    compare_runs(isa_driver.spec(), 0, load_training_data("digits"), weights_a, info_a,
                 weights_h, info_h)
