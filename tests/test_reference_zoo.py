"""The shipped reference zoo: complete, verified, made by its spec, and reproducible."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from posteriorzoo.collection import verify
from posteriorzoo.errors import UnknownNameError, ZooFormatError
from posteriorzoo.reference import COLLECTIONS, SPECS, open_reference, reference_path
from posteriorzoo.zoo import verify_manifest
from train_zoo import checkpoint_seeds, load_spec, train_checkpoints

ROOT = Path(__file__).resolve().parent.parent
FASHION = Path("/usr/share/datasets/fashion-mnist")


def _shipped(name: str) -> bool:
    try:
        reference_path(name)
    except ZooFormatError:
        return False
    return True


needs_reference = pytest.mark.skipif(
    not all(_shipped(name) for name in COLLECTIONS),
    reason="the reference zoo is not in this checkout (train it: see data_card.md)")


def test_unknown_reference_name():
    with pytest.raises(UnknownNameError, match="target"):
        reference_path("resnet-18")


@needs_reference
@pytest.mark.parametrize("name", sorted(COLLECTIONS))
def test_reference_collection_is_complete_and_made_by_its_spec(name):
    spec = load_spec(ROOT / SPECS[name])
    report = verify(reference_path(name))
    assert report.ok, report.summary()
    with open_reference(name) as zoo:
        assert len(zoo) == spec.checkpoints
        assert zoo.recipe == spec.collection_recipe()
        assert (zoo.architecture, zoo.dataset, zoo.method) == ("optunet", "fashion-mnist", "de")
        rows = zoo.metadata
        assert sorted(rows["mode_id"]) == list(range(spec.checkpoints))
        for row in rows[:5]:
            seeds = checkpoint_seeds(spec.base_seed, int(row["mode_id"]))
            assert (row["seed"], row["data_seed"]) == (seeds.init, seeds.data)
        assert (rows["epoch"] == spec.recipe.epochs).all()
        assert (np.asarray(rows["test_accuracy"])[~rows["diverged"]] > 0.5).all()


@needs_reference
def test_reference_manifest_matches():
    assert sorted(verify_manifest(reference_path("target").parent)) == sorted(
        COLLECTIONS.values())


@needs_reference
def test_target_and_ensemble_share_no_checkpoint():
    with open_reference("target") as target, open_reference("de") as ensemble:
        assert not set(target.metadata["sha256"]) & set(ensemble.metadata["sha256"])


@needs_reference
@pytest.mark.skipif(not FASHION.is_dir(), reason="Fashion-MNIST is not installed "
                    "(apt-get install dataset-fashion-mnist)")
def test_a_shipped_checkpoint_is_reproduced_by_the_trainer():
    spec = load_spec(ROOT / SPECS["de"])
    with open_reference("de") as zoo:
        row = int(np.flatnonzero(zoo.metadata["mode_id"] == 3)[0])
        stored = zoo.arrays(row)
        source = zoo.metadata_dict(row)["source"]
        accuracy = zoo.metadata_dict(row)["test_accuracy"]
    engine = source.rsplit("engine ", 1)[1]
    result = train_checkpoints(spec, [3], engine=engine)[0]
    for key, value in stored.items():
        scale = float(np.abs(value).max())
        np.testing.assert_allclose(result.state[key], value, rtol=0, atol=1e-5 * scale)
    assert result.metrics["test_accuracy"] == pytest.approx(accuracy, abs=2e-3)
