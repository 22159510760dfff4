"""One method registry (train_zoo.methods.registry): every method is one object in one
module, and everything that needs the list of methods or their options reads it."""

from __future__ import annotations

import ast
import contextlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from posteriorzoo.cli import main
from posteriorzoo.errors import InvalidOptionError, UnknownNameError
from posteriorzoo.options import check_integer
from train_zoo import load_spec, make_spec
from train_zoo.data import load_training_data
from train_zoo.job import resolve_engine
from train_zoo.method_options import METHODS, describe_options, option_table
from train_zoo.methods import registry
from train_zoo.methods.base import Method, MethodOption, ModeRun, Posterior, constant, with_context
from train_zoo.programs import produce_mode

ROOT = Path(__file__).resolve().parent.parent


def test_the_registry_names_every_method_once_and_each_lives_in_its_own_module():
    assert METHODS == tuple(registry.REGISTRY) == registry.METHODS
    classes: dict[str, type] = {}
    for name, method in registry.REGISTRY.items():
        assert isinstance(method, Method) and method.name == name and method.summary
        assert all(isinstance(option, MethodOption) for option in method.option_table())
        module = type(method).__module__
        assert module.startswith("train_zoo.methods.")
        # a module holds one method class (EMP and ECMP are two objects of one class)
        assert classes.setdefault(module, type(method)) is type(method)


def test_the_listing_and_the_validation_read_the_registry():
    rows = describe_options()
    expected = [(name, option.name) for name, method in registry.REGISTRY.items()
                for option in method.option_table()]
    assert [(row["method"], row["option"]) for row in rows] == expected
    for name, method in registry.REGISTRY.items():
        assert option_table(name) is method.option_table()
    with pytest.raises(UnknownNameError, match="unknown method 'svgd-x'.*de, mc-dropout"):
        option_table("svgd-x")


def test_no_method_is_named_outside_its_module_and_the_registry():
    """No ``if method == "swag"`` chains: outside train_zoo/methods no comparison, dict
    key or set/tuple member in train_zoo is a method's name (docstrings may name them)."""
    offences = []
    for path in (ROOT / "train_zoo").rglob("*.py"):
        if "methods" in path.relative_to(ROOT / "train_zoo").parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                parts = [node.left, *node.comparators]
            elif isinstance(node, ast.Dict):
                parts = [key for key in node.keys if key is not None]
            elif isinstance(node, ast.Tuple | ast.Set | ast.List):
                parts = node.elts
            else:
                continue
            offences += [f"{path.name}:{part.lineno} {part.value!r}" for part in parts
                         if isinstance(part, ast.Constant) and part.value in METHODS]
    assert not offences, offences


def test_the_checker_sees_a_method_chain(tmp_path):
    """The scan above finds what it looks for: a comparison with a method's name."""
    tree = ast.parse('if spec.method == "swag":\n    pass\n')
    compare = next(node for node in ast.walk(tree) if isinstance(node, ast.Compare))
    assert compare.comparators[0].value in METHODS


def test_train_help_lists_the_registry_and_the_data_card_the_shipped_methods():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(out.getvalue().split())
    # "Methods: de (...), mc-dropout, swag, laplace, sghmc and bbb (...); the spec ..."
    listed = re.sub(r"\([^)]*\)", "", re.search(r"Methods: ([^;]*);", text).group(1))
    names = [name.strip() for name in listed.replace(" and ", ",").split(",")]
    assert sorted(names) == sorted(METHODS)
    # The data card names the methods of the shipped collections: those of specs/.
    card = (ROOT / "data_card.md").read_text(encoding="utf-8")
    named = re.search(r"names the method \(([^)]*)\)", " ".join(card.split())).group(1)
    shipped = {load_spec(path).method for path in (ROOT / "specs").glob("*.toml")}
    assert set(re.findall(r"`([^`]+)`", named)) == shipped <= set(METHODS)


# ---------------------------------------------------------------- a new method: one object
@dataclass(frozen=True)
class _Trained:
    model: torch.nn.Module


class _Repeat(Method):
    """A method defined here only: every sample is the trained base network."""

    name = "repeat"
    summary = "the trained base network, repeated"
    options = (MethodOption("tag", with_context(check_integer, 0, 10), constant(0), "0",
                            "a number recorded with the mode, 0 to 10"),)

    def fit(self, run: ModeRun) -> Posterior:
        model, steps = run.engine.train_base()
        return Posterior(_Trained(model), steps, run.engine.name,
                         {"method": self.name, "tag": run.spec.method_options["tag"]})

    def sample(self, state: _Trained, generator: torch.Generator, count: int) -> list[dict]:
        return [dict(state.model.state_dict()) for _ in range(count)]


def test_a_new_method_is_one_object_plus_one_registry_entry(monkeypatch):
    monkeypatch.setitem(registry.REGISTRY, "repeat", _Repeat())
    spec = make_spec("optunet-mnist", dataset="digits", method="repeat", modes=1,
                     samples_per_mode=2, base_seed=3, recipe_overrides={"epochs": 1},
                     method_options={"tag": 2})
    assert spec.method_options == {"tag": 2}
    assert spec.collection_recipe()["method_options"] == {"tag": 2}
    with pytest.raises(InvalidOptionError, match="repeat option 'tag'"):
        spec.replace(method_options={"tag": 11})
    with pytest.raises(UnknownNameError, match="unknown repeat option"):
        spec.replace(method_options={"scale": 1})
    data = load_training_data("digits")
    results = produce_mode(spec, 0, data, "torch")
    member = produce_mode(spec.replace(method="de", method_options={}, samples_per_mode=1,
                                       checkpoints=None), 0, data, "torch")[0]
    assert [r.sample for r in results] == [0, 1]
    assert results[0].record == {"method": "repeat", "tag": 2}
    for result in results:  # mode 0's base network is DE member 0
        assert result.state.keys() == member.state.keys()
        assert all((result.state[k] == member.state[k]).all() for k in result.state)


# ---------------------------------------------------------------- EMP: one file, one line
def test_emp_is_wired_by_its_module_and_one_registry_line():
    from train_zoo.methods import emp

    assert registry.REGISTRY["emp"] is emp.METHOD
    assert registry.REGISTRY["ecmp"] is emp.ECMP
    for name in ("emp", "ecmp"):  # the method's name fixes the variant
        assert [row["option"] for row in describe_options(name)] == [
            option for option in emp.OPTION_HELP if option != "variant"]
    spec = load_spec(ROOT / "examples" / "optunet-digits-emp.toml")
    defaults = {k: v for k, v in emp.resolve_options({}).items() if k != "variant"}
    assert spec.method_options == {**defaults, "patch": "in+out"}
    with pytest.raises(UnknownNameError, match="variant"):
        spec.replace(method_options={"variant": "ecmp"})
    with pytest.raises(InvalidOptionError, match="emp option 'components'"):
        spec.replace(method_options={"components": 0})
    short = spec.replace(samples_per_mode=4)
    assert resolve_engine(short, "auto") == "fast"  # the kernels' gradient at the draw
    data = load_training_data("digits")
    results = produce_mode(short, 1, data, "torch")
    assert [r.sample for r in results] == [0, 1, 2, 3] and results[0].engine == "torch"
    assert results[0].record["patched"] == ["conv1.weight", "fc.bias", "fc.weight"]
    first, second = results[0].state, results[1].state
    assert all((first[k] == second[k]).all() for k in first if not k.startswith(("conv1", "fc")))
    assert any((first[k] != second[k]).any() for k in first if k.startswith(("conv1", "fc")))
    again = produce_mode(short, 1, data, "torch")  # a mode depends only on its seeds
    assert all((again[0].state[k] == first[k]).all() for k in first)
