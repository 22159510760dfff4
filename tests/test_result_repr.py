"""Python results read well: a one-line repr for every result class of the collection
layer, ``to_frame()`` with the values of ``to_dict()``, and ``summary()`` defaulting to the
symmetry setting a comparison holds."""

from __future__ import annotations

import importlib
import math
import pkgutil

import numpy as np
import pandas
import pytest
from zoo_helpers import checkpoint

import posteriorzoo.collection
from posteriorzoo.collection import (
    canonicalize,
    compare,
    describe,
    diagnose,
    evaluate,
    export_checkpoint,
    import_checkpoints,
    min_mass,
    verify,
)
from posteriorzoo.errors import InvalidOptionError, PosteriorZooError, UnknownNameError
from posteriorzoo.mmd import compare_arrays
from posteriorzoo.results import CollectionResult
from posteriorzoo.zoo import create_zoo

# a user's file name: long, with a newline and a tab
ODD_NAME = "a" * 150 + "\nb\tc.h5"


def _collection(path, seeds):
    states = [checkpoint(seed) for seed in seeds]
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=states[0]) as zoo:
        zoo.append_many(states, [{"seed": seed} for seed in seeds])
    return path


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One result of every operation of the collection layer, on 8- and 5-checkpoint
    collections (the target's file name is a hostile one)."""
    folder = tmp_path_factory.mktemp("results")
    target = _collection(folder / ODD_NAME, range(8))
    method = _collection(folder / "method.h5", range(100, 105))
    exported = export_checkpoint(target, 0, folder / "one.safetensors")
    return {
        "compare": compare(target, {"DE": method}, symmetries="both"),
        "describe": describe(target),
        "diagnose": diagnose(target, predictions=False),
        "verify": verify(target),
        "canonicalize": canonicalize(target, folder / "canonical.h5"),
        "min_mass": min_mass(target),
        "evaluate": evaluate(target, n_images=20),
        "export": exported,
        "import": import_checkpoints(folder / "imported.h5", [folder / "one.safetensors"]),
    }


def _result_classes() -> set[type]:
    """Every CollectionResult subclass the collection layer defines."""
    package = posteriorzoo.collection
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    found, stack = set(), [CollectionResult]
    while stack:
        for subclass in stack.pop().__subclasses__():
            stack.append(subclass)
            if subclass.__module__.startswith(package.__name__):
                found.add(subclass)
    return found


def _flat(record, prefix=""):
    """The test's own flattening of a record: nested mappings to ``outer.inner``."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _same(cell, value) -> bool:
    if value is None:
        return cell is None or (isinstance(cell, float) and math.isnan(cell))
    if isinstance(value, list):
        return list(cell) == value
    return cell == value


def test_every_result_class_is_exercised(results):
    assert {type(result) for result in results.values()} == _result_classes()


def test_repr_is_one_short_line(results):
    for name, result in results.items():
        text = repr(result)
        assert len(text) < 200 and "\n" not in text, (name, text)
        assert text.startswith(f"<{type(result).__name__}") and ".to_frame()" in text
        assert str(result) == text                       # print() shows the same line
    assert repr(results["compare"]) == ("<CompareResult: 1 method x 2 symmetry settings x "
                                        "4 layers; .to_frame() for the table>")
    assert "8 checkpoints, 4 tensors" in repr(results["describe"])
    assert "8 members" in repr(results["evaluate"])
    assert "1 added" in repr(results["import"])
    # the hostile file name is cut and shown with its escapes, on one line
    assert "\\n" not in repr(results["describe"]) and "..." in repr(results["describe"])


def test_comparison_of_arrays_has_a_short_repr():
    rng = np.random.default_rng(0)
    target = {"w": rng.normal(size=(10, 300)), "b": rng.normal(size=(10, 3))}
    methods = {f"m{i}": {k: v[:4] + i for k, v in target.items()} for i in range(3)}
    comparison = compare_arrays(target, methods)
    text = repr(comparison)
    assert text.startswith("<Comparison: 3 methods x 1 symmetry setting x 2 layers")
    assert len(text) < 200 and "\n" not in text


def test_to_frame_holds_the_values_of_to_dict(results):
    for name, result in results.items():
        frame = result.to_frame()
        assert isinstance(frame, pandas.DataFrame)
        data = result.to_dict()
        payload = {k: v for k, v in data.items() if k not in ("kind", "provenance")}
        tables = [key for key, value in payload.items()
                  if isinstance(value, list) and value and isinstance(value[0], dict)]
        chosen = (type(result).frame_tables or tables)[:1] if tables else []
        records = [_flat(row) for row in payload[chosen[0]]] if chosen else [_flat(payload)]
        columns = list(dict.fromkeys(key for record in records for key in record))
        assert list(frame.columns) == columns, name
        assert len(frame) == len(records), name
        for index, record in enumerate(records):
            for key in columns:
                cell = frame.iloc[index][key]
                assert _same(cell, record.get(key)), (name, index, key, cell, record.get(key))


def test_to_frame_of_a_comparison(results):
    comparison = results["compare"]
    layers = comparison.to_frame()
    assert len(layers) == 2 * 4                               # settings x layers
    assert list(layers["median"]) == [r.median for r in comparison.results]
    summary = comparison.to_frame("summary")
    assert list(summary["symmetries"]) == ["keep", "remove"]
    assert summary["median"].iloc[1] == comparison.summary("DE", "remove").median
    with pytest.raises(UnknownNameError, match="summary, layers"):
        comparison.to_frame("nothing")


def test_summary_defaults_to_the_setting_computed(tmp_path):
    target = _collection(tmp_path / "target.h5", range(8))
    method = _collection(tmp_path / "method.h5", range(100, 104))
    removed = compare(target, {"B": method}, symmetries="remove")
    assert removed.summary("B").symmetries == "remove"
    assert removed.summary("B") == removed.summary("B", "remove")
    with pytest.raises(InvalidOptionError, match="'keep' was not computed.*has 'remove'"):
        removed.summary("B", "keep")
    with pytest.raises(UnknownNameError, match="no method 'C'.*'B'"):
        removed.summary("C")
    both = compare(target, {"B": method}, symmetries="keep")
    assert both.summary("B").symmetries == "keep"
    with pytest.raises(PosteriorZooError, match="'remove' was not computed"):
        both.summary("B", "remove")
    with pytest.raises(InvalidOptionError, match="symmetries"):
        both.summary("B", "sideways")


def test_summary_of_arrays_compared_without_symmetries():
    rng = np.random.default_rng(1)
    target = {"w": rng.normal(size=(12, 5))}
    comparison = compare_arrays(target, {"B": {"w": rng.normal(size=(6, 5))}},
                                symmetries="remove")
    assert comparison.summary("B").symmetries == "remove"
    with pytest.raises(InvalidOptionError, match="has 'remove'"):
        comparison.summary("B", "keep")
