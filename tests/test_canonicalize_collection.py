"""Canonicalizing whole collections, through the API and the CLI."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rounding_bounds import U32, U64, forward_terms, gamma, optunet_forward_bounds

from posteriorzoo.cli import main
from posteriorzoo.collection import canonicalize as canonicalize_file
from posteriorzoo.collection import verify
from posteriorzoo.models import build
from posteriorzoo.symmetry import random_symmetry, symmetry_structure
from posteriorzoo.zoo import create_zoo, open_zoo


def _zoo(path, states):
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=states[0]) as zoo:
        for seed, state in enumerate(states):
            zoo.append(state, seed=seed, test_accuracy=0.5)


@pytest.fixture
def twin_collections(tmp_path):
    states = []
    for seed in range(4):
        torch.manual_seed(seed)
        states.append(build("optunet").state_dict())
    moved = [random_symmetry("optunet", state, seed=10 + i) for i, state in enumerate(states)]
    _zoo(tmp_path / "a.h5", states)
    _zoo(tmp_path / "b.h5", moved)
    return tmp_path


def _roundings(state) -> int:
    """An upper bound on the roundings along one float64 canonicalization of ``state``
    (test_canonicalize_batch.canonical_roundings: each scale variable's rows, k entries,
    k + 4; the softmax shift K + 1): the variables' rows are disjoint entries, so all the
    parameters plus 4 per variable."""
    structure = symmetry_structure("optunet", state)
    output = state[structure.output_bias].numel()
    return (sum(value.numel() for value in state.values()) + 4 * len(structure.scalable())
            + output + 1)


def _largest_change_bound(original, canonical, seed: int) -> float:
    """A bound on ``logit_change`` (the centred float64 logits of the original and the
    stored canonical weights on 16 float64 normal inputs drawn with ``seed``, relative to
    the original's largest): the canonical form is exact up to 2 gamma(R, u64) of each
    entry and its float32 storage rounds by u32, carried through the network
    (optunet_forward_bounds with that ``delta`` and no float32 pass); each float64 pass
    rounds within gamma(F, u64) of the absolute network (F: forward_terms); centring
    doubles a row's largest error."""
    models = []
    for state in (original, canonical):
        model = build("optunet").double().eval()
        model.load_state_dict({key: torch.as_tensor(value) for key, value in state.items()})
        models.append(model)
    inputs = torch.randn(16, 1, 28, 28, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(seed))
    relative = U32 + 2 * gamma(_roundings(canonical), U64)
    delta = {key: relative * torch.as_tensor(value).double().abs()
             for key, value in canonical.items()}
    stored = optunet_forward_bounds(models[1], inputs, delta, implementations=0)
    before = optunet_forward_bounds(models[0], inputs, implementations=0)
    passes = gamma(forward_terms(models[0], inputs), U64) * (before.absolute
                                                               + stored.absolute)
    error = float((stored.error + passes).max())
    centred = before.logits - before.logits.mean(1, keepdim=True)
    return 2 * error / float(centred.abs().max())


def test_symmetric_collections_canonicalize_to_the_same_weights(twin_collections):
    folder = twin_collections
    first = canonicalize_file(folder / "a.h5", folder / "ca.h5", n_verify=4)
    canonicalize_file(folder / "b.h5", folder / "cb.h5")
    assert first.checkpoints == 4 and first.verified == [0, 1, 2, 3]
    with open_zoo(folder / "a.h5") as a, open_zoo(folder / "ca.h5") as ca, \
            open_zoo(folder / "b.h5") as b:
        originals = [{key: torch.from_numpy(a.layer(key)[i]) for key in a.state_keys}
                     for i in range(4)]
        canonicals = [{key: torch.from_numpy(ca.layer(key)[i]) for key in ca.state_keys}
                      for i in range(4)]
        moved_bias = np.abs(b.layer("fc.bias")).max(axis=1)
    # float32 storage of a float64 computation (_largest_change_bound): bounds 5.2e-6 to
    # 1.5e-5 for the 4 checkpoints; measured 4.1e-8 (float64 draws and operations: the
    # same on the host and under the AVX2 settings). Another function moves logits O(1).
    assert first.largest_change <= max(_largest_change_bound(originals[i], canonicals[i], i)
                                       for i in range(4))
    # b holds float32 symmetric copies of a (each entry rounded at most 3 u: the factor's
    # power and two products; the output biases' shift once, u of |b + shift|, which the
    # canonical centring makes 2 u of moved's largest bias, absolute). Canonicalization
    # carries an entry error e to (2 L + 1) e (L scale variables) and adds 2 gamma(R, u64)
    # on each side; both results are stored in float32 (u each). Of each tensor's largest
    # entry 1.0e-6 (L = 2, R = 411), plus the shift's term; measured at most 0.16 of the
    # bound (fc.bias, 4.6 u of its largest entry). A copy whose canonical form kept its
    # permutation or scales is O(1) away.
    layers = len(symmetry_structure("optunet", originals[0]).scalable())
    rtol = (2 * U32 + 3 * (2 * layers + 1) * U32
            + 4 * gamma(_roundings(originals[0]), U64))
    with open_zoo(folder / "ca.h5") as a, open_zoo(folder / "cb.h5") as b:
        for key in a.state_keys:
            first_form, second_form = a.layer(key), b.layer(key)
            for index in range(4):
                difference = np.abs(first_form[index].astype(np.float64)
                                    - second_form[index]).max()
                scale = np.abs(first_form[index]).max()
                assert difference <= rtol * scale + 2 * U32 * moved_bias[index], (key, index)
        assert list(a.metadata["seed"]) == [0, 1, 2, 3]
        assert a.annotations["permutation"] == "first" and a.annotations["scaling"] == "norm"
        assert a.annotations["canonicalized_from"] == "a.h5"
    with open_zoo(folder / "a.h5") as original, open_zoo(folder / "ca.h5") as canonical:
        # rescaled to unit norms: entries move by O(1), far past allclose's 1e-5 defaults
        assert not np.allclose(original.layer("conv1.weight"), canonical.layer("conv1.weight"))
    assert verify(folder / "ca.h5").ok


def test_cli_canonicalize(twin_collections, capsys):
    folder = twin_collections
    code = main(["canonicalize", str(folder / "a.h5"), "--out", str(folder / "c.h5"),
                 "--n-verify", "2", "--scaling", "std", "--permutation", "max", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and "4 canonical checkpoints" in out and "2 verified" in out
    with open_zoo(folder / "c.h5") as zoo:
        assert zoo.annotations["scaling"] == "std"
        assert zoo.created_by["command"].startswith("posteriorzoo canonicalize")
    for argv, fragment in ((["canonicalize", str(folder / "absent.h5"), "--out",
                             str(folder / "x.h5")],
                            "no such file"),
                           (["canonicalize", str(folder / "a.h5"), "--out", str(folder / "c.h5")],
                            "already exists")):
        assert main(argv + ["--no-progress"]) == 2
        err = capsys.readouterr().err
        assert fragment in err and len(err.strip().splitlines()) == 1


def test_unsupported_operations_are_warned_about_and_annotated(twin_collections, monkeypatch):
    import posteriorzoo.collection.canonicalization as collection
    from posteriorzoo.symmetry import SymmetryCoverageWarning

    gap = "norm (LayerNorm) is not supported, so the units of conv2 are neither permuted, " \
          "scaled nor sign-flipped"
    real = collection.trace_structure

    def with_gap(model, shape):
        structure = real(model, shape)
        structure.notes.append(gap)
        structure.gaps.append(gap)
        return structure

    monkeypatch.setattr(collection, "trace_structure", with_gap)
    with pytest.warns(SymmetryCoverageWarning, match="units of conv2"):
        canonicalize_file(twin_collections / "a.h5", twin_collections / "c.h5")
    with open_zoo(twin_collections / "c.h5") as zoo:
        assert zoo.annotations["not_removed"] == [gap]
        assert zoo.annotations["flipped_variables"] == 0 and zoo.annotations["sign_rule"] is None


@pytest.fixture
def huge_weights(tmp_path):
    """A collection whose checkpoint 2 has finite weights of 3e38, near float32's largest
    value: its canonical form (each unit's norm moved into the next layer, here 1e40 into
    fc) overflows."""
    states = []
    for seed in range(4):
        torch.manual_seed(seed)
        states.append(build("optunet").state_dict())
    states[2]["conv1.weight"].fill_(3e38)
    states[2]["conv2.weight"].fill_(1.0)
    assert all(torch.isfinite(value).all() for value in states[2].values())
    _zoo(tmp_path / "huge.h5", states)
    return tmp_path / "huge.h5"


def test_finite_weights_that_overflow_when_canonicalized_are_one_true_line(huge_weights,
                                                                         capsys):
    from posteriorzoo.hashing import sha256_file

    folder, digest = huge_weights.parent, sha256_file(huge_weights)
    code = main(["canonicalize", str(huge_weights), "--out", str(folder / "c.h5"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    [line] = err.strip().splitlines()
    for fragment in ("huge.h5: checkpoint 2", "finite but too large to canonicalize in "
                     "float32", "overflows", "--scaling none"):
        assert fragment in line
    assert "NaN" not in line and "diverged" not in line and "scaling='none'" not in line
    assert sha256_file(huge_weights) == digest
    assert sorted(path.name for path in folder.iterdir()) == ["huge.h5"]
    # the way out the message names does canonicalize it
    assert main(["canonicalize", str(huge_weights), "--out", str(folder / "c.h5"),
                 "--scaling", "none", "--no-progress"]) == 0


def test_api_overflow_error_names_the_python_argument(huge_weights):
    import argparse

    from posteriorzoo.errors import CanonicalOverflowError, NonFiniteWeightsError

    with pytest.raises(CanonicalOverflowError) as caught:
        canonicalize_file(huge_weights, huge_weights.parent / "c.h5")
    message = str(caught.value)
    assert isinstance(caught.value, NonFiniteWeightsError)
    assert "checkpoint 2: its weights are finite but too large" in message
    assert "with scaling='none' the weights keep their scale" in message
    assert "--" not in message and "diverged" not in message
    # a command without a --scaling option (report) names no way out
    assert caught.value.command_line_message(argparse.Namespace()) == caught.value.problem
    assert sorted(path.name for path in huge_weights.parent.iterdir()) == ["huge.h5"]


def _no_work(*_, **__):
    raise AssertionError("the output should have been refused before any work")


def test_canonicalize_refuses_an_existing_folder_before_any_work(twin_collections, capsys,
                                                                 monkeypatch):
    """--overwrite replaces a file by a file: an existing folder OUT is refused up front
    (it used to fail after all the work, with a raw '[Errno 21] Is a directory')."""
    import posteriorzoo.collection.canonicalization as collection
    from posteriorzoo.errors import InvalidOptionError
    from posteriorzoo.hashing import sha256_file

    folder = twin_collections
    existing = folder / "out.h5"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    digest = sha256_file(folder / "a.h5")
    before = sorted(path.name for path in folder.iterdir())
    monkeypatch.setattr(collection, "canonicalize_batch", _no_work)
    for extra in (["--overwrite"], []):
        code = main(["canonicalize", str(folder / "a.h5"), "--out", str(existing),
                     "--no-progress", *extra])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err and "Errno" not in err
        [line] = err.strip().splitlines()
        assert f"{existing} is a folder; it cannot be replaced by a file" in line
    with pytest.raises(InvalidOptionError, match="is a folder"):
        canonicalize_file(folder / "a.h5", existing, overwrite=True)
    assert sorted(path.name for path in folder.iterdir()) == before  # no partial left
    assert [p.name for p in existing.iterdir()] == ["notes.txt"]
    assert (existing / "notes.txt").read_text() == "mine"
    assert sha256_file(folder / "a.h5") == digest


def test_min_mass_refuses_an_existing_file_as_its_folder_before_any_work(twin_collections,
                                                                          capsys,
                                                                          monkeypatch):
    import posteriorzoo.collection.canonicalization as collection

    folder = twin_collections
    existing = folder / "table"
    existing.write_text("mine")
    before = sorted(path.name for path in folder.iterdir())
    monkeypatch.setattr(collection, "solve_min_mass_batch", _no_work)
    code = main(["min-mass", str(folder / "a.h5"), "--out", str(existing), "--overwrite",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    [line] = err.strip().splitlines()
    assert f"{existing} is a file; it cannot be replaced by a folder" in line
    assert sorted(path.name for path in folder.iterdir()) == before
    assert existing.read_text() == "mine"


def test_a_float16_collection_is_canonicalized_in_float32_and_its_storage_reported(
        tmp_path, capsys):
    """A float16 collection (the release's dtype): the canonical form is computed in
    float32 whatever the storage, and --n-verify holds it to VERIFY_TOLERANCE as computed.
    Stored back in float16 each weight rounds once more (2^-11 relative), which moves
    the logits by 3.3e-4 here: reported, and warned about naming float16 and the fix,
    not refused. --dtype float32 stores the computed form as it is."""
    from posteriorzoo.collection.canonicalization import VERIFY_TOLERANCE

    states = []
    for seed in range(3):
        torch.manual_seed(seed)
        states.append({k: v.half() for k, v in build("optunet").state_dict().items()})
    _zoo(tmp_path / "half.h5", states)
    with pytest.warns(UserWarning, match=r"stored in float16, the canonical weights' "
                      r"rounding moves the logits by up to .*dtype float32 keeps it"):
        half = canonicalize_file(tmp_path / "half.h5", tmp_path / "half-c.h5", n_verify=3)
    # The float32 canonical form: float16 values are exact in float32; each weight then
    # rounds at most 3 times (its unit's scale, the scale pushed in from its input unit;
    # a bias also the softmax shift's subtraction), so it is the float16 weight times
    # (1 + d), |d| <= gamma(3). Through the 3 layers (the logits evaluated in float64),
    # on the result's scale as in rounding_bounds.deep_rtol: gamma(3 * 3) (measured
    # 7.6e-8, margin 7; a unit left unnormalised or a row exchanged moves them by O(1)).
    # The float16 copy: its rounding (3.3e-4), above the tolerance.
    assert half.exact_change < gamma(3 * 3) and half.largest_change > VERIFY_TOLERANCE
    with open_zoo(tmp_path / "half-c.h5") as zoo:
        assert {np.dtype(d) for d in zoo.dtypes.values()} == {np.dtype(np.float16)}
    wide = canonicalize_file(tmp_path / "half.h5", tmp_path / "wide-c.h5", n_verify=3,
                             dtype=torch.float32)
    assert wide.dtype == "float32" and wide.exact_change == half.exact_change
    # float32 storage of the float32 form: the computed form itself
    assert wide.largest_change == wide.exact_change
    with open_zoo(tmp_path / "wide-c.h5") as zoo:
        assert {np.dtype(d) for d in zoo.dtypes.values()} == {np.dtype(np.float32)}
    assert main(["canonicalize", str(tmp_path / "half.h5"), "--out", str(tmp_path / "cli-c.h5"),
                 "--dtype", "float32", "--n-verify", "2", "--no-progress"]) == 0
    assert "as computed" in capsys.readouterr().out


def test_a_device_this_torch_lacks_is_refused_in_one_line_and_cpu_is_the_default(
        tmp_path, capsys):
    """--device moves each batch to the device and back (the same torch code: here cpu,
    whose result is the default's bit for bit); cuda without a CUDA torch is one line,
    exit 2, before anything is written."""
    states = []
    for seed in range(2):
        torch.manual_seed(seed)
        states.append(build("optunet").state_dict())
    _zoo(tmp_path / "a.h5", states)
    default = canonicalize_file(tmp_path / "a.h5", tmp_path / "d.h5")
    explicit = canonicalize_file(tmp_path / "a.h5", tmp_path / "e.h5", device="cpu")
    with open_zoo(default.path) as first, open_zoo(explicit.path) as second:
        assert first.digests == second.digests
    if torch.cuda.is_available():
        return
    code = main(["canonicalize", str(tmp_path / "a.h5"), "--out", str(tmp_path / "g.h5"),
                 "--device", "cuda", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "sees no CUDA GPU" in err
    assert not (tmp_path / "g.h5").exists()
