"""Every public entry point answers bad input with a PosteriorZooError, and nothing else.

The test walks every function of the packages' ``__all__``: each is checked by
``posteriorzoo._api.public``, refuses an unknown keyword, and refuses an argument of the
wrong type, with one line that names the function.
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest

from posteriorzoo.errors import InvalidOptionError, PosteriorZooError
from posteriorzoo.models import build

PACKAGES = ["posteriorzoo.collection", "posteriorzoo.symmetry", "posteriorzoo.mmd",
            "posteriorzoo.metrics", "posteriorzoo.data", "posteriorzoo.models",
            "posteriorzoo.zoo", "posteriorzoo.hub", "posteriorzoo.reference"]


def _functions():
    found = {}
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isfunction(value):
                found[f"{package}.{name}"] = value
    return found


FUNCTIONS = _functions()


class Unexpected:
    """A value no public parameter is annotated to take."""

    def __repr__(self) -> str:
        return "<Unexpected>"


def test_the_walk_covers_the_api():
    assert len(FUNCTIONS) > 60
    assert "posteriorzoo.collection.compare" in FUNCTIONS


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_every_entry_point_is_checked(name):
    assert getattr(FUNCTIONS[name], "__posteriorzoo_public__", False), name


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_an_unknown_keyword_is_refused(name):
    function = FUNCTIONS[name]
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        pytest.skip("takes model options as keywords: see the misspelling test")
    with pytest.raises(InvalidOptionError, match="no_such_option"):
        function(no_such_option=1)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_an_argument_of_the_wrong_type_is_refused(name):
    function = FUNCTIONS[name]
    required = [p for p in inspect.signature(function).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                       p.POSITIONAL_OR_KEYWORD)]
    if not required:
        pytest.skip("no required positional parameter")
    with pytest.raises(PosteriorZooError) as caught:
        function(*[Unexpected() for _ in required])
    assert "\n" not in str(caught.value) and function.__name__ in str(caught.value)


def test_a_misspelled_keyword_names_itself_and_the_valid_ones():
    from posteriorzoo.symmetry import canonicalize

    state = build("optunet").state_dict()
    with pytest.raises(PosteriorZooError, match="scalling") as caught:
        canonicalize("optunet", state, scalling="norm")
    message = str(caught.value)
    assert "scaling" in message.replace("scalling", "") and "dropout" in message


def test_numpy_scalars_are_the_numbers_they_are():
    from posteriorzoo.symmetry import random_symmetry

    state = build("optunet").state_dict()
    a = random_symmetry("optunet", state, seed=np.int64(3))
    b = random_symmetry("optunet", state, seed=3)
    assert all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)
