"""Nothing changes in what is produced: the trainer after the method registry makes the
checkpoints the trainer before it made, to the bit.

- Each shipped spec's first two modes retrained give the shipped checkpoints
  (``posteriorzoo/reference``) exactly (slow: minutes per spec on Fashion-MNIST, about
  85 for the SGHMC spec's adapted chains).
- Every method on a tiny digits spec, on the torch and the auto engine, gives the
  digests, steps, engines and training records of the code at the branch point of the
  registry (:data:`BRANCH_POINT`, extracted from git), SGHMC included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from posteriorzoo.errors import ZooFormatError
from posteriorzoo.reference import reference_path
from posteriorzoo.zoo import open_zoo
from train_zoo import load_spec, train_checkpoints

ROOT = Path(__file__).resolve().parent.parent
FASHION = Path("/usr/share/datasets/fashion-mnist")
DRIVER = Path(__file__).resolve().parent / "registry_equivalence_driver.py"
#: The trainer before the redesign: main where the method registry was merged into it.
BRANCH_POINT = "eb63f4acb588d4b1c7e32344e88eba087122a5cf"
#: Modes retrained per shipped spec.
MODES = 2
SPECS = sorted(path.stem for path in (ROOT / "specs").glob("*.toml"))


def _reference(stem: str) -> Path | None:
    try:
        return reference_path(stem.removeprefix("optunet-fashion-mnist-"))
    except ZooFormatError:
        return None


@pytest.mark.slow
@pytest.mark.skipif(not FASHION.is_dir(), reason="Fashion-MNIST is not installed "
                    "(apt-get install dataset-fashion-mnist)")
@pytest.mark.parametrize("stem", SPECS)
def test_the_first_modes_of_a_shipped_spec_are_retrained_to_the_bit(stem):
    path = _reference(stem)
    if path is None:
        pytest.skip(f"{stem} is not in this checkout")
    spec = load_spec(ROOT / "specs" / f"{stem}.toml")
    modes = list(range(min(MODES, spec.modes)))
    with open_zoo(path) as zoo:
        metadata = zoo.metadata
        stored = {(int(metadata["mode_id"][row]), int(metadata["sample_id"][row])):
                  zoo.arrays(int(row)) for row in np.flatnonzero(np.isin(metadata["mode_id"],
                                                                         modes))}
        engine = zoo.metadata_dict(0)["source"].rsplit("engine ", 1)[1]
    results = train_checkpoints(spec, modes, engine=engine)
    assert sorted((r.index, r.sample) for r in results) == sorted(stored)
    for result in results:
        shipped = stored[(result.index, result.sample)]
        assert result.state.keys() == shipped.keys()
        for key, value in shipped.items():
            assert result.state[key].dtype == value.dtype
            assert np.array_equal(result.state[key], value), (result.index, result.sample, key)


def _driver(pythonpath: Path, names: list[str]) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(DRIVER), *names], capture_output=True,
                          text=True, env=env, cwd=pythonpath, timeout=3000, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def branch_point(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The code of :data:`BRANCH_POINT`, extracted from this repository's git history."""
    folder = tmp_path_factory.mktemp("branch-point")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", BRANCH_POINT],
                             capture_output=True, timeout=300)
    if archive.returncode:
        pytest.skip(f"git cannot extract {BRANCH_POINT[:8]} here")
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("names", [["de", "mc-dropout", "swag", "laplace"],
                                   ["sghmc", "sghmc-plain"], ["bbb", "bbb-tv"]],
                         ids=lambda names: "+".join(names))
def test_every_method_trains_as_before_the_registry(branch_point, names):
    before = _driver(branch_point, names)
    after = _driver(ROOT, names)
    assert sorted(before) == sorted(after) == sorted(f"{name}/{engine}" for name in names
                                                     for engine in ("torch", "auto"))
    for key in before:
        assert after[key] == before[key], key
