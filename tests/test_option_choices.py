"""Every named choice of the command line is the vocabulary's, and so is every library check.

:mod:`posteriorzoo.vocabulary` defines each named choice once (issue 32). The command line's
``choices`` must be those very objects (not copies that could drift), every choice option
of every subcommand must be in the table below (a new hard-coded list fails here), and
the library's checks must accept exactly the vocabulary's words: each one, and nothing
else, with a refusal that names them.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from posteriorzoo import vocabulary
from posteriorzoo.errors import PosteriorZooError

#: (subcommand, option) -> the vocabulary's name of its choices.
FROM_VOCABULARY = {
    ("import", "--dtype"): "STORAGE_DTYPES",
    ("annotate", "--posterior"): "POSTERIOR_GROUPS",
    ("train", "--backend"): "BACKENDS",
    ("train", "--engine"): "ENGINES",
    ("canonicalize", "--permutation"): "PERMUTATION_KEYS",
    ("canonicalize", "--scaling"): "SCALINGS",
    ("canonicalize", "--solver"): "MINMASS_SOLVERS",
    ("canonicalize", "--dtype"): "STORAGE_DTYPES",
    ("min-mass", "--solver"): "MINMASS_SOLVERS",
    ("mmd", "--symmetries"): "SYMMETRY_CHOICES",
    ("mmd", "--permutation"): "PERMUTATION_KEYS",
    ("mmd", "--scaling"): "SCALINGS",
    ("mmd", "--group"): "LAYER_GROUPS",
    ("mmd", "--precision"): "DISTANCE_PRECISIONS",
    ("report", "--ood-score"): "OOD_SCORES",
    ("report", "--precision"): "DISTANCE_PRECISIONS",
    ("plot marginals", "--symmetries"): "SYMMETRY_CHOICES",
    ("plot marginals", "--permutation"): "PERMUTATION_KEYS",
    ("plot marginals", "--scaling"): "SCALINGS",
    ("plot mass", "--solver"): "MINMASS_SOLVERS",
    ("plot mmd", "--symmetries"): "SYMMETRIES",
    ("plot mmd", "--permutation"): "PERMUTATION_KEYS",
    ("plot mmd", "--scaling"): "SCALINGS",
    ("plot mmd", "--statistic"): "KERNEL_STATISTICS",
    ("plot pca", "--symmetries"): "SYMMETRY_CHOICES",
    ("plot pca", "--permutation"): "PERMUTATION_KEYS",
    ("plot pca", "--scaling"): "SCALINGS",
    ("study permutation-stability", "--key"): "SORT_KEYS",
}
#: Choices the study offers from a part of a vocabulary entry: (command, option) -> the
#: entry they are drawn from.
SUBSETS = {
    ("study permutation-stability", "--scaling"): "SCALINGS",
    ("study permutation-stability", "--engine"): "ENGINES",
}
#: Choices that are no shared vocabulary: BYOV's priors and datasets (the study's own).
OWN = {("study byov", "--priors"), ("study byov", "--dataset")}


def _choice_options() -> dict[tuple[str, str], argparse.Action]:
    """Every option with ``choices`` of every subcommand (nested ones: ``plot mmd``)."""
    from posteriorzoo.cli import build_parser

    found = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for word, sub in action.choices.items():
                    walk(sub, f"{name} {word}".strip())
            elif action.choices is not None and action.option_strings:
                found[(name, action.option_strings[0])] = action

    walk(build_parser(), "")
    return found


OPTIONS = _choice_options()


def test_every_choice_option_is_accounted_for():
    """A choice option outside the tables (a list typed into the parser) fails here."""
    assert set(OPTIONS) == set(FROM_VOCABULARY) | set(SUBSETS) | OWN


@pytest.mark.parametrize("where", sorted(FROM_VOCABULARY), ids=" ".join)
def test_the_command_lines_choices_are_the_vocabularys_object(where):
    assert OPTIONS[where].choices is getattr(vocabulary, FROM_VOCABULARY[where])


@pytest.mark.parametrize("where", sorted(SUBSETS), ids=" ".join)
def test_the_studys_choices_are_drawn_from_the_vocabulary(where):
    choices = OPTIONS[where].choices
    entry = getattr(vocabulary, SUBSETS[where])
    assert choices and set(choices) < set(entry)
    assert list(choices) == [word for word in entry if word in choices]  # its order


def test_the_vocabulary_is_words():
    for name in ("PERMUTATION_KEYS", "SORT_KEYS", "SCALINGS", "MINMASS_SOLVERS",
                 "DISTANCE_PRECISIONS", "LAYER_GROUPS", "KERNEL_STATISTICS", "OOD_SCORES",
                 "STORAGE_DTYPES", "BACKENDS", "ENGINES", "SYMMETRY_CHOICES",
                 "POSTERIOR_GROUPS"):
        words = getattr(vocabulary, name)
        assert isinstance(words, tuple) and words, name
        assert all(isinstance(w, str) and w for w in words), name
        assert len(set(words)) == len(words), name
    assert (*vocabulary.SYMMETRIES, "both") == vocabulary.SYMMETRY_CHOICES
    assert all(key == setting.word for key, setting in vocabulary.SYMMETRIES.items())


def test_the_librarys_names_are_the_vocabularys_objects():
    """Old public names stay, as the vocabulary's objects (not copies)."""
    import train_zoo
    from posteriorzoo import metrics
    from posteriorzoo.mmd import comparison
    from train_zoo import backends

    assert metrics.OOD_SCORES is vocabulary.OOD_SCORES
    assert train_zoo.ENGINES is vocabulary.ENGINES
    assert backends.BACKENDS is vocabulary.BACKENDS
    assert tuple(vocabulary.SYMMETRIES) == comparison.SYMMETRY_SETTINGS


def _canonical_options(word: str, which: str) -> None:
    from posteriorzoo.symmetry.canonical import check_options

    check_options(**{"permutation": "first", "scaling": "norm", "solver": "fast",
                     which: word})


def _precision(word: str) -> None:
    from posteriorzoo.mmd.distances import check_precision

    assert check_precision(word, "cpu") == word


def _group(word: str) -> None:
    from posteriorzoo.mmd.sources import group_layers

    assert group_layers(["a.weight", "a.bias"], {"a.weight": (2, 2), "a.bias": (2,)}, word)


def _ood(word: str) -> None:
    from posteriorzoo.metrics import ood_scores

    probabilities = np.full((2, 3, 4), 0.25)
    assert ood_scores(probabilities, score=word).shape == (3,)


def _statistic(word: str) -> None:
    from analysis.figures.sources import mmd_values

    class Empty:
        methods: list[str] = []
        results: list[object] = []

    assert mmd_values(Empty(), statistic=word) == {}


def _engine(word: str) -> None:
    from train_zoo import make_spec, resolve_engine

    spec = make_spec("optunet-mnist", name="choice", dataset="digits", checkpoints=1)
    assert resolve_engine(spec, word) in vocabulary.ENGINES   # a Deep Ensemble: all four


#: (vocabulary name, the library's check of one word)
CHECKS = [
    ("PERMUTATION_KEYS", lambda w: _canonical_options(w, "permutation")),
    ("SCALINGS", lambda w: _canonical_options(w, "scaling")),
    ("MINMASS_SOLVERS", lambda w: _canonical_options(w, "solver")),
    ("DISTANCE_PRECISIONS", _precision),
    ("LAYER_GROUPS", _group),
    ("OOD_SCORES", _ood),
    ("KERNEL_STATISTICS", _statistic),
    ("ENGINES", _engine),
]


@pytest.mark.parametrize("name, check", CHECKS, ids=[name for name, _ in CHECKS])
def test_the_librarys_check_accepts_exactly_the_vocabulary(name, check):
    for word in getattr(vocabulary, name):
        check(word)
    with pytest.raises(PosteriorZooError) as refused:
        check("not-a-" + name.lower())
    message = str(refused.value)
    assert all(word in message for word in getattr(vocabulary, name)), message


def test_the_backends_check_refuses_what_the_vocabulary_lacks():
    from train_zoo.backends import make_backend

    with pytest.raises(PosteriorZooError) as refused:
        make_backend("cluster")
    assert all(word in str(refused.value) for word in vocabulary.BACKENDS)
    for word in ("serial", "local"):
        assert make_backend(word, workers=1) is not None
