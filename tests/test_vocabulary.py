"""The vocabulary (``posteriorzoo.vocabulary``) is the one source of the methods: the
trainer's registry, ``diagnose``, labels and styles read it, and a method described there
is picked up by all of them with no other change (issue 32: a new method is its module,
its entry, its spec and its tests)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from posteriorzoo import vocabulary
from posteriorzoo.vocabulary import FAMILIES, METHODS, MethodInfo

ROOT = Path(__file__).resolve().parents[1]


def test_the_vocabulary_imports_the_standard_library_only():
    """``--help``, labels and styles read it without numpy or torch."""
    code = ("import sys; import posteriorzoo.vocabulary; "
            "print(sorted(m for m in ('numpy', 'torch', 'h5py', 'train_zoo') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    assert json.loads(done.stdout.replace("'", '"')) == []


def test_the_registry_is_the_vocabulary_loaded():
    from train_zoo.methods.registry import METHODS as TRAINER_METHODS
    from train_zoo.methods.registry import REGISTRY

    assert tuple(METHODS) == TRAINER_METHODS
    for name, method in REGISTRY.items():
        assert method.name == name


def test_labels_and_styles_read_the_vocabulary():
    from analysis.figures.styles import method_style
    from analysis.labels import METHOD_LABELS

    assert {name: info.label for name, info in METHODS.items()} == METHOD_LABELS
    colours = set()
    for name, info in METHODS.items():
        style = method_style(info.label)
        assert style.colour == info.colour == method_style(f"optunet-cifar10-{name}").colour
        assert style.marker == ("D" if info.family == "ensemble" else "o")
        assert method_style(f"MM-{info.label}").marker == (
            "D" if info.family == "ensemble" else "s")
        colours.add(info.colour)
    assert len(colours) == len(METHODS), "two methods share a colour"


def test_an_entry_is_checked():
    with pytest.raises(ValueError, match="unknown family"):
        MethodInfo("x", "X", "bayesian", (), "#000000", "m:X", "x")
    with pytest.raises(ValueError, match="unknown records"):
        MethodInfo("x", "X", "chain", ("weights",), "#000000", "m:X", "x")
    assert set(vocabulary.methods_in("chain")) == {
        name for name, info in METHODS.items() if info.family == "chain"}
    assert all(info.family in FAMILIES for info in METHODS.values())


def _chain_collection(path: Path, method: str) -> Path:
    """8 draws of a random walk of OptuNet weights in 2 chains, recorded as ``method``."""
    from zoo_helpers import checkpoint

    from posteriorzoo.zoo import create_zoo

    rng = np.random.default_rng(0)
    state = {k: v.numpy().copy() for k, v in checkpoint(0).items()}
    draws = []
    for _ in range(8):
        state = {k: (v + 0.01 * rng.standard_normal(v.shape).astype(v.dtype)
                     if v.dtype.kind == "f" else v) for k, v in state.items()}
        draws.append(state)
    with create_zoo(path, architecture="optunet", dataset="digits", method=method,
                    num_classes=10, template=checkpoint(0),
                    recipe={"method_options": {"chains": 2}}) as zoo:
        zoo.append_many(draws, [{"seed": 0, "mode_id": 0, "sample_id": i} for i in range(8)])
    return path


def test_a_new_chain_method_gets_chain_statistics_from_its_entry(tmp_path, monkeypatch):
    """A method the vocabulary does not know gets no chain statistics; the same file
    with the method described as a chain (one entry, nothing else) gets them."""
    from posteriorzoo.collection import diagnose

    path = _chain_collection(tmp_path / "sgld.h5", "sgld-test")
    assert diagnose(path, predictions=False).chains is None
    entry = MethodInfo("sgld-test", "SGLD", "chain", ("chains",), "#000001",
                       "train_zoo.methods.sgld:METHOD", "a test chain")
    monkeypatch.setitem(METHODS, "sgld-test", entry)
    result = diagnose(path, predictions=False)
    assert result.chains and (result.chains[0]["chains"], result.chains[0]["draws"]) == (2, 4)
    # it records chains, so their absence from this file is reported as unknown
    assert any("not recorded" in line for line in result.unknown)
    monkeypatch.setitem(METHODS, "sgld-test", dataclasses.replace(entry, family="ensemble"))
    assert diagnose(path, predictions=False).chains is None


def test_a_methods_variant_gets_its_own_label():
    """The vocabulary's ``variant`` option names a version of a method: another value
    than the paper's gives the collection a label (a Table 1 row, a figure style) of its
    own; the paper's value, or none recorded, keeps the method's label."""
    from types import SimpleNamespace

    from analysis.labels import collection_label

    def zoo(method, options, posterior="single-mode"):
        return SimpleNamespace(method=method, annotations={"posterior": posterior},
                               recipe={"method_options": options})

    assert collection_label(zoo("laplace", {"structure": "kfac"})) == "Laplace (kfac)"
    assert collection_label(zoo("laplace", {"structure": "diag"}, "multi-mode")) == \
        "MM-Laplace (diag)"
    assert collection_label(zoo("laplace", {"structure": "full"})) == "Laplace"
    assert collection_label(zoo("laplace", {})) == "Laplace"
    assert collection_label(zoo("bbb", {"preset": "trained-variance"})) == \
        "BBB (trained-variance)"
    # an option that names no variant of its method changes nothing
    assert collection_label(zoo("swag", {"structure": "kfac"})) == "SWAG"
    with pytest.raises(ValueError, match="variant option"):
        dataclasses.replace(METHODS["laplace"], variant=("no-such-option", "x"))
