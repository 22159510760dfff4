"""Every method option is declared once, as data, in the vocabulary (issue 32), and the
library checks exactly what is declared.

The cases are generated from :data:`posteriorzoo.vocabulary.METHODS`: for each declared
option, values just outside each :class:`Interval` (and NaN, infinity, a word, a bool, a
fraction of an integer), a word outside each :class:`Choices`, a number where a word or a
flag is wanted, are refused by the library's check
(:func:`train_zoo.method_options.resolve_method_options` on OptuNet); the bounds
themselves, every choice and both flags are accepted. A new option, or a changed bound,
is covered without editing this file.

Also: the trainer's records are made from the declarations (names, defaults, help), a
literal default is what an empty ``[method_options]`` resolves to, the records refuse a
derived default without its rule, and ``posteriorzoo train --list-options`` reads the
declarations without importing the trainer or torch.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.options import check_constraints
from posteriorzoo.vocabulary import (
    BOOLEAN,
    DERIVED,
    METHODS,
    NAMES,
    Choices,
    Interval,
    OptionInfo,
    describe_options,
)
from train_zoo.method_options import (
    explain_method_options,
    option_table,
    resolve_method_options,
)
from train_zoo.methods.base import declared_options
from train_zoo.recipes import get_recipe

RECIPE = get_recipe("optunet-mnist")
ARCHITECTURE = "optunet"

OPTIONS = [(method, option) for method, info in METHODS.items() for option in info.options]
IDS = [f"{method}-{option.name}" for method, option in OPTIONS]


def _resolve(method: str, options: dict) -> dict:
    return resolve_method_options(method, options, ARCHITECTURE, RECIPE)


def _bounds(method: str, interval: Interval) -> tuple[float, float | None]:
    """The interval's bounds, a named bound read from the method's defaults."""
    return interval.bounds(_resolve(method, {}))


def _outside(method: str, interval: Interval) -> list[object]:
    """Values just outside ``interval``, and values of the wrong kind."""
    low, high = _bounds(method, interval)
    values: list[object] = ["1", True]
    if interval.kind == "integer":
        first = low if interval.closed_low else low + 1
        values += [first - 1, first + 0.5]
        if high is not None:
            values.append((high if interval.closed_high else high - 1) + 1)
        return values
    values += [low if not interval.closed_low else math.nextafter(low, -math.inf),
               math.nan, -math.inf, math.inf]
    if high is not None:
        values.append(high if not interval.closed_high else math.nextafter(high, math.inf))
    return values


def _inside(method: str, interval: Interval) -> list[object]:
    """The bounds themselves (or the nearest number inside an open one)."""
    low, high = _bounds(method, interval)
    if interval.kind == "integer":
        values = [int(low if interval.closed_low else low + 1)]
        if high is not None:
            values.append(int(high if interval.closed_high else high - 1))
        return values
    values = [low if interval.closed_low else math.nextafter(low, math.inf)]
    values.append(1e300 if high is None else
                  high if interval.closed_high else math.nextafter(high, -math.inf))
    return values


def _refused(method: str, option: OptionInfo, value: object) -> None:
    with pytest.raises(InvalidOptionError) as info:
        _resolve(method, {option.name: value})
    message = str(info.value)
    assert option.name in message and "\n" not in message, (value, message)


def _accepted(method: str, option: OptionInfo, value: object) -> None:
    """Accepted, or refused only by a check that relates the option to another one
    (SWAG's iterates against the window from collect_from to epochs): its message names
    that other option."""
    try:
        explained = explain_method_options(method, {option.name: value}, ARCHITECTURE,
                                           RECIPE)
    except InvalidOptionError as error:
        others = [other.name for other in METHODS[method].options if other.name != option.name]
        assert any(f"'{other}'" in str(error) or f"{other}=" in str(error)
                   for other in others), (value, str(error))
        return
    resolved = explained.values
    # What a collection records is what was given (unless the check completed it: "auto").
    if option.name in resolved and explained.sources[option.name] == "given":
        assert resolved[option.name] == value, value


def _refusals(method: str, option: OptionInfo) -> list[object]:
    """Values no constraint of ``option`` accepts."""
    values: list[object] = []
    for constraint in option.constraints:
        if isinstance(constraint, Interval):
            values += _outside(method, constraint)
        elif isinstance(constraint, Choices):
            values += ["not-a-choice", 1, ""]
        elif constraint is BOOLEAN:
            values += [1, 0, "true"]
        elif constraint is NAMES:
            values += ["fc", [], ["fc", "fc"], [""], [1]]
    # An any-of accepts what any of its constraints does (a word where a number is wanted).
    if len(option.constraints) > 1:
        values = [value for value in values if not _accepts(option, value)]
    return values


def _accepts(option: OptionInfo, value: object) -> bool:
    """Whether one of the declared constraints admits ``value``, as the declarations
    mean it (written here independently of the library's check)."""
    for constraint in option.constraints:
        if isinstance(constraint, Choices):
            if isinstance(value, str) and value in constraint.values:
                return True
        elif isinstance(constraint, Interval):
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if constraint.kind == "integer":
                number = number and isinstance(value, int)
            # Only an any-of needs this, and none has a named bound.
            if number and math.isfinite(value) and not isinstance(constraint.high, str):
                low, high = constraint.low, constraint.high
                if ((value >= low if constraint.closed_low else value > low)
                        and (high is None or (value <= high if constraint.closed_high
                                              else value < high))):
                    return True
    return False


@pytest.mark.parametrize(("method", "option"), OPTIONS, ids=IDS)
def test_values_outside_the_declaration_are_refused(method, option):
    refusals = _refusals(method, option)
    assert refusals, "no value to refuse was generated"
    for value in refusals:
        _refused(method, option, value)


@pytest.mark.parametrize(("method", "option"), OPTIONS, ids=IDS)
def test_the_declared_bounds_and_choices_are_accepted(method, option):
    accepted: list[object] = []
    for constraint in option.constraints:
        if isinstance(constraint, Interval):
            accepted += _inside(method, constraint)
        elif isinstance(constraint, Choices):
            accepted += list(constraint.values)
        elif constraint is BOOLEAN:
            accepted += [True, False]
        elif constraint is NAMES:
            accepted += [["conv1"], ["conv1", "fc"]]
    assert accepted
    for value in accepted:
        _accepted(method, option, value)


@pytest.mark.parametrize("method", list(METHODS))
def test_the_records_are_made_from_the_declarations(method):
    declared = METHODS[method].options
    records = option_table(method)
    assert [(o.name, o.default_text, o.help) for o in records] == [
        (o.name, o.default_text, o.help) for o in declared]
    assert [(row["option"], row["default"], row["help"]) for row in describe_options(method)] \
        == [(o.name, o.default_text, o.help) for o in declared]
    explained = explain_method_options(method, {}, ARCHITECTURE, RECIPE)
    for option in declared:
        if option.default is DERIVED or option.name not in explained.values:
            continue
        if explained.sources[option.name] == "default":  # not completed ("auto")
            assert explained.values[option.name] == option.default, option.name


def test_an_option_declared_twice_is_refused():
    interval = Interval("integer", 1, 10)
    option = OptionInfo("k", (interval,), 1, "", "k")
    info = METHODS["swag"]
    with pytest.raises(ValueError, match="declared twice"):
        type(info)(**{**info.__dict__, "options": (option, option)})
    with pytest.raises(ValueError, match="derived or unset default"):
        OptionInfo("k", (interval,), DERIVED, "", "k")


def test_the_records_refuse_rules_that_do_not_match_the_declarations():
    """A derived default needs its rule, a literal one takes none, and a rule names a
    declared option (the method's module would fail at import)."""
    rule = {"lr": lambda context: None}
    with pytest.raises(RuntimeError, match="'lr': a derived default needs its rule"):
        declared_options("swag", defaults={key: rule["lr"] for key in ("epochs", "ramp_epochs",
                                                                          "iterates", "rank")})
    with pytest.raises(RuntimeError, match="'scale': its default is declared"):
        declared_options("swag", defaults={name: rule["lr"] for name in (
            "lr", "epochs", "ramp_epochs", "iterates", "rank", "scale")})
    with pytest.raises(RuntimeError, match="undeclared options \\['alpha'\\]"):
        declared_options("sgld", checks={"alpha": lambda what, value, context: value},
                         defaults={})


def test_an_any_of_is_one_line_naming_every_alternative():
    option = next(o for o in METHODS["laplace"].options if o.name == "prior_precision")
    with pytest.raises(InvalidOptionError) as info:
        _resolve("laplace", {"prior_precision": "evidence"})
    assert str(info.value) == ("laplace option 'prior_precision' must be 'marglik', "
                               "'training' or a finite number in [1e-08, 1e+08], not "
                               "'evidence'")
    assert check_constraints("p", 1e-8, option.constraints) == 1e-8


def test_list_options_reads_the_vocabulary_without_the_trainer():
    heavy = ("torch", "numpy", "train_zoo")
    code = ("import contextlib, io, json, sys\n"
            "from posteriorzoo.cli import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            "    main(['train', '--list-options', '--json'])\n"
            f"print(json.dumps([sorted(m for m in {heavy!r} if m in sys.modules), "
            "json.loads(out.getvalue())]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    loaded, rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded == []
    assert [(row["method"], row["option"]) for row in rows] == [
        (method, option.name) for method, option in OPTIONS]
    assert all(row["allowed"] for row in rows)
