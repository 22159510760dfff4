"""The shipped reference zoo: complete, verified, made by its spec, and reproducible."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rounding_bounds import U32, evaluation_bounds, model_at

from posteriorzoo.collection import verify
from posteriorzoo.errors import UnknownNameError, ZooFormatError
from posteriorzoo.reference import (
    COLLECTIONS,
    METHOD_COLLECTIONS,
    SPECS,
    open_reference,
    reference_path,
)
from posteriorzoo.zoo import verify_manifest
from train_zoo import checkpoint_seeds, load_spec, train_checkpoints
from train_zoo.data import load_training_data

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


def test_every_method_and_its_multi_mode_version_is_shipped():
    single = {"mc-dropout", "bbb", "bbb-trained-variance", "swag", "laplace", "laplace-kfac",
              "laplace-diag", "laplace-last-layer", "sghmc", "ivon"}
    # the seeds' variants: single-mode, as the papers train them
    variants = {"emp", "ecmp", "rank-1"}
    # one run through several modes (its cycles): no multi-mode version
    cyclical = {"csgld", "csghmc"}
    # one run whose samples were measured to sit in many modes (annotated multi-mode)
    measured = set(MEASURED_MULTI_MODE)
    assert set(METHOD_COLLECTIONS) == single | variants | cyclical | measured | {
        f"{method}-multi-mode" for method in single - {"sghmc", "laplace-last-layer"}}
    assert set(COLLECTIONS) == {"target", "de", *METHOD_COLLECTIONS}
    for name in COLLECTIONS:
        assert (ROOT / SPECS[name]).is_file(), SPECS[name]


@needs_reference
@pytest.mark.parametrize("name", sorted(COLLECTIONS))
def test_reference_collection_is_complete_and_made_by_its_spec(name):
    spec = load_spec(ROOT / SPECS[name])
    report = verify(reference_path(name))
    assert report.ok, report.summary()
    with open_reference(name) as zoo:
        assert len(zoo) == spec.checkpoints == spec.modes * spec.samples_per_mode
        assert zoo.recipe == spec.collection_recipe(num_data=60_000)   # BBB: kl_weight 1/N
        assert (zoo.architecture, zoo.dataset) == ("optunet", "fashion-mnist")
        # a collection is named by its method, then its variant (preset, structure)
        assert zoo.method == spec.method and name.replace("target", "de").startswith(
            spec.method)
        if name.startswith("bbb"):   # the preset tells the two BBB versions apart
            preset = zoo.recipe["method_options"].get("preset", "paper")
            assert preset == ("trained-variance" if "trained-variance" in name else "paper")
        if name.startswith("laplace"):   # and the structure the Laplace ones
            structure = name.removesuffix("-multi-mode").removeprefix("laplace").lstrip("-")
            assert zoo.recipe["method_options"]["structure"] == {
                "": "full", "last-layer": "last-layer-kfac"}.get(structure, structure)
        assert zoo.model_options == {}          # every sample is a plain OptuNet
        if spec.method != "de":
            assert zoo.annotations["posterior"] == (
                "multi-mode" if name.endswith("-multi-mode") or name in MEASURED_MULTI_MODE
                else "single-mode")
            if name in MEASURED_MULTI_MODE:   # the trainer said single-mode; the reason
                decided = zoo.annotations["posterior_set"]
                assert decided["from"] == "single-mode" and "modes" in decided["reason"]
            assert (zoo.annotations["modes"], zoo.annotations["samples_per_mode"]) == (
                spec.modes, spec.samples_per_mode)
        rows = zoo.metadata
        pairs = sorted(zip(rows["mode_id"].tolist(), rows["sample_id"].tolist(), strict=True))
        assert pairs == [(mode, sample) for mode in range(spec.modes)
                         for sample in range(spec.samples_per_mode)]
        for row in rows[::max(1, len(rows) // 7)]:
            seeds = checkpoint_seeds(spec.base_seed, int(row["mode_id"]))
            assert (row["seed"], row["data_seed"]) == (seeds.init, seeds.data)
        assert (rows["epoch"] == spec.recipe.epochs).all() and spec.recipe.epochs == 60
        assert not rows["diverged"].any()
        # one dropout mask or one posterior draw can be a weak network on its own; every
        # sample is still far above chance (0.1), and trained networks typically above 0.5
        accuracy = np.asarray(rows["test_accuracy"])
        assert (accuracy > 0.3).all() and np.median(accuracy) > 0.55


#: Collections of one run whose samples were measured to sit in many modes, annotated
#: multi-mode after training (``posteriorzoo annotate``; data_card.md gives the measure).
MEASURED_MULTI_MODE = ("svgd",)


# Collections that share a base network on purpose, so that their rows differ only by
# the method: the Laplace structures' ladder at the full Laplace collections' networks.
SHARED_BASE = {"laplace-kfac": "laplace", "laplace-diag": "laplace",
               "laplace-last-layer": "laplace", "laplace-kfac-multi-mode": "laplace-multi-mode",
               "laplace-diag-multi-mode": "laplace-multi-mode"}


@needs_reference
def test_every_collection_has_its_own_base_networks():
    """The specs' base seeds differ, so no two collections share a base network, except
    those of SHARED_BASE, which share exactly their partner's."""
    seeds = {name: load_spec(ROOT / SPECS[name]).base_seed for name in COLLECTIONS}
    own = {name: seed for name, seed in seeds.items() if name not in SHARED_BASE}
    assert len(set(own.values())) == len(own)
    init = {}
    for name in COLLECTIONS:
        with open_reference(name) as zoo:
            init[name] = set(zoo.metadata["seed"].tolist())
    for name, partner in SHARED_BASE.items():
        assert seeds[name] == seeds[partner] and init[name] == init[partner], name
    for first in own:
        for second in own:
            if first < second:
                assert not init[first] & init[second], (first, second)


@needs_reference
def test_reference_manifest_matches():
    assert sorted(verify_manifest(reference_path("target").parent)) == sorted(
        COLLECTIONS.values())


@needs_reference
def test_target_and_ensemble_share_no_checkpoint():
    with open_reference("target") as target, open_reference("de") as ensemble:
        assert not set(target.metadata["sha256"]) & set(ensemble.metadata["sha256"])


def _fast_engine_bits_reason() -> str | None:
    """Why the fast engine may give other bits here than on the machine that trained the
    shipped zoo, or None where it gives the same.

    The fast engine is numba kernels of IEEE-754 float32 operations in a fixed order,
    compiled without fast-math (LLVM neither reassociates nor contracts them; a vector
    lane computes what the scalar code would), its fused multiply-adds through
    ``llvm.fma`` (correctly rounded on every CPU: an instruction, or libm's ``fmaf``),
    its exponentials and logarithms from the C library's ``expf``/``logf``; the data
    pipeline is integer indexing and one table lookup per pixel, the initial weights
    torch's serial uniform draws. Each of those is the same function of its inputs on
    every x86-64 CPU with FMA (every AVX2 and AVX-512 CPU: glibc picks its FMA variants
    of ``expf``/``logf`` there) as long as numba does not call Intel's SVML vector math,
    whose results depend on the instruction set. Measured: the same bits with AVX-512
    and under ``make test-avx2``'s AVX2 settings.
    """
    import platform

    import llvmlite.binding as llvm
    import numba

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"a {platform.machine()} CPU, not x86-64"
    if platform.libc_ver()[0] != "glibc":
        return f"another C library ({platform.libc_ver()[0] or 'unknown'}) than glibc"
    if not llvm.get_host_cpu_features().get("fma", False):
        return "a CPU without FMA (glibc's expf/logf take their other variants)"
    if numba.config.USING_SVML:
        return "numba uses SVML, whose vector math differs between instruction sets"
    return None


@needs_reference
@pytest.mark.skipif(not FASHION.is_dir(), reason="Fashion-MNIST is not installed "
                    "(apt-get install dataset-fashion-mnist)")
def test_a_shipped_checkpoint_is_reproduced_by_the_trainer():
    """Checkpoint 3 of the Deep Ensemble, retrained by the fast engine that made it
    (60 epochs of Fashion-MNIST: 56,250 SGD steps), gives the stored weights bit for bit
    wherever the fast engine computes the same bits (:func:`_fast_engine_bits_reason`).

    Nothing weaker can be promised elsewhere: training is chaotic where a ReLU input or a
    max-pool arg-max lies within rounding of switching (tests/test_fast_engine.py: 3 runs
    in 20 of 338 steps meet such a step), so two runs that differ by one rounding part
    somewhere in 56,250 steps, and no final-weight tolerance follows from an error
    analysis. There the test is skipped, saying why; that another instruction set
    follows the same run step by step within the analysed bound is
    tests/test_instruction_sets.py's check."""
    reason = _fast_engine_bits_reason()
    if reason is not None:
        pytest.skip(f"the fast engine may legitimately give other bits here: {reason}")
    spec = load_spec(ROOT / SPECS["de"])
    with open_reference("de") as zoo:
        row = int(np.flatnonzero(zoo.metadata["mode_id"] == 3)[0])
        stored = zoo.arrays(row)
        metadata = zoo.metadata_dict(row)
    engine = metadata["source"].rsplit("engine ", 1)[1]
    assert engine == "fast"
    data = load_training_data(spec.dataset, spec.data_dir)
    result = train_checkpoints(spec, [3], data, engine=engine)[0]
    assert result.state.keys() == stored.keys()
    for key, value in stored.items():
        assert np.array_equal(result.state[key], value), key
    # The stored metrics came from the evaluation of the day the zoo was made, today's
    # from train_zoo.fast.evaluate: on the same weights the loss within the two
    # implementations' bound (the forward pass's rounding carried by the cross-entropy,
    # plus the float32 storage of the stored value: u of it), the number of correct
    # examples within the count of those whose two largest logits lie within that bound.
    # Measured: accuracy equal, loss 2.7e-8 apart (AVX-512 and AVX2).
    model = model_at(spec, 3, result.state)
    loss_bound, flips = evaluation_bounds(model, data.test)
    assert abs(result.metrics["test_loss"] - metadata["test_loss"]) <= (
        loss_bound + U32 * metadata["test_loss"])
    assert abs(result.metrics["test_accuracy"] - metadata["test_accuracy"]) * len(
        data.test) <= flips + 1e-9


@pytest.mark.slow
@needs_reference
@pytest.mark.skipif(not FASHION.is_dir(), reason="Fashion-MNIST is not installed "
                    "(apt-get install dataset-fashion-mnist)")
@pytest.mark.parametrize("name", ["mc-dropout", "bbb", "swag", "laplace", "sghmc"])
def test_a_shipped_method_collection_is_reproduced_by_the_trainer(name):
    """Mode 0 of each single-mode collection, retrained by today's trainer from its spec
    with the engine that made it, gives the stored samples bit for bit (minutes per
    method, about 85 for SGHMC's adapted chains: run with ``-m slow``).

    Bit-identity is the only promise: training is chaotic (a decision within rounding of
    switching parts two runs, see :func:`test_a_shipped_checkpoint_is_reproduced_by_the_
    trainer`), so no final-weight tolerance follows from an error analysis. It holds with
    the same engine, thread count and instruction set (the README's promise). Beyond the
    fast engine's kernels these methods use torch's float32 normals (BBB's noise), BLAS
    (Laplace's GGN) and torch's own kernels (MC dropout's torch engine), whose bits
    depend on the instruction set, and the collections do not record the one that made
    them: on another CPU this test may fail with no defect, and its message says which
    instruction set torch used."""
    import torch

    spec = load_spec(ROOT / SPECS[name])
    with open_reference(name) as zoo:
        rows = np.flatnonzero(zoo.metadata["mode_id"] == 0)
        stored = {int(zoo.metadata["sample_id"][row]): zoo.arrays(int(row)) for row in rows}
        engine = zoo.metadata_dict(int(rows[0]))["source"].rsplit("engine ", 1)[1]
    results = train_checkpoints(spec, [0], engine=engine)
    assert len(results) == spec.samples_per_mode == len(stored)
    capability = torch.backends.cpu.get_cpu_capability()
    for result in results[:: max(1, len(results) // 5)]:
        for key, value in stored[result.sample].items():
            assert np.array_equal(result.state[key], value), (
                f"{name} sample {result.sample} {key}: other bits (engine {engine}, torch "
                f"on {capability}; bit-identity holds only on the instruction set that "
                "made the collection)")
