"""Bad option values, generated: every numeric option of every subcommand.

Each bad value must give exit code 2, exactly one line on stderr, no traceback, and
leave every file as it was (no output created). The values come from Hypothesis:
numbers below and above the option's range (read from its parser: every numeric option
has one, shown in its --help), huge literals (the audit's ``--bins 1e14`` and
``--checkpoints 1e15`` kind), non-numbers, NaN and infinities, fractions where integers
are expected, overflowing literals.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zoo_helpers import assert_one_line_error, checkpoint, run

from posteriorzoo.zoo import create_zoo

NOT_NUMBERS = st.sampled_from(["abc", "", "1,5", "0x10", "one", "1_0_", "2 3"])
NON_FINITE = st.sampled_from(["nan", "NaN", "inf", "-inf", "1e400", "-1e400"])


def _parser_of(words: list[str], option: str) -> argparse.Action:
    """The argparse action of ``option`` in the subcommand ``words`` start with."""
    from posteriorzoo.cli import build_parser

    parser = build_parser()
    for word in words[:2]:
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not nested or word not in nested[0].choices:
            break
        parser = nested[0].choices[word]
    return next(a for a in parser._actions if option in a.option_strings)


def bad_values(kind) -> st.SearchStrategy[str]:
    """Values outside the option's range (``kind`` is its parser, from _types), and text
    that is no number of that kind."""
    low, high = kind.low, kind.high
    if kind.integer:
        return st.one_of(st.integers(max_value=low - 1).map(str),
                         st.integers(min_value=high + 1).map(str),
                         st.integers(min_value=high + 1, max_value=10**30).map(str),
                         st.sampled_from([str(10**15), "1e14", "1.5", "2.0", "nan", "inf",
                                          "-0.1"]),
                         NOT_NUMBERS)
    return st.one_of(st.floats(max_value=low, exclude_max=not kind.open_low,
                               allow_nan=False).map(repr),
                     st.floats(min_value=high, exclude_min=not kind.open_high,
                               allow_nan=False).map(repr),
                     st.sampled_from(["1e308", "-1e308", "1e-320"] if low > 0 else ["1e308"]),
                     NOT_NUMBERS, NON_FINITE)


def _options(files: dict[str, Path]) -> list[tuple[list[str], str]]:
    """(command words before the option, option) for every numeric option."""
    zoo, out, spec = str(files["zoo"]), str(files["out"]), str(files["spec"])
    canonicalize = ["canonicalize", zoo, "--out", out + "/c.h5"]
    mmd = ["mmd", zoo, zoo, "--out", out + "/r"]
    train = ["train", spec, "--out", out + "/t.h5"]
    demo = ["demo", "--out", out + "/d"]
    report = ["report", zoo, zoo, "--out", out + "/p"]
    collapse = ["plot", "collapse", zoo, "--ood-data", "digits", "--out", out + "/f"]
    toy = ["study", "toy", "--out", out + "/s"]
    stability = ["study", "permutation-stability", "--out", out + "/s"]
    byov = ["study", "byov", "--out", out + "/s"]
    importer = ["import", "--out", out + "/i.h5", zoo]
    return [
        *[(canonicalize, o) for o in ("--checkpoints-per-batch", "--n-verify", "--seed")],
        (["min-mass", zoo, "--out", out + "/m"], "--checkpoints-per-batch"),
        *[(mmd, o) for o in ("--bandwidths", "--scale", "--alpha", "--b1", "--b2", "--b3",
                             "--seed", "--block-mb", "--tile-rows", "--num-gpus")],
        *[(train, o) for o in ("--workers", "--group-size", "--checkpoints",
                               "--num-gpus")],
        *[(demo, o) for o in ("--checkpoints", "--epochs", "--seed", "--n-images")],
        *[(report, o) for o in ("--bins", "--n-images", "--splits", "--n-pairs", "--seed")],
        (["plot", "marginals", zoo, "--out", out + "/f"], "--units"),
        *[(collapse, o) for o in ("--n-images", "--n-pairs", "--seed")],
        *[(["plot", "mmd", zoo, zoo, "--out", out + "/f"], o)
          for o in ("--noise-splits", "--seed")],
        *[(toy, o) for o in ("--networks", "--norm", "--points", "--seed")],
        *[(stability, o) for o in ("--runs", "--epochs", "--every", "--seed")],
        *[(byov, o) for o in ("--train-images", "--test-images", "--epochs", "--batch-size",
                              "--samples", "--noise-std", "--seed")],
        *[(importer, o) for o in ("--checkpoints-per-batch", "--num-classes")],
        *[(["overhead", "optunet"], o)
          for o in ("--num-classes", "--emp-components", "--rank1-components")],
    ]


#: The audit's values, each once a traceback after minutes of work (or NaN results).
AUDIT = [(["report", "ZOO", "ZOO"], "--bins", str(10**14)),
         (["study", "toy"], "--networks", str(10**12)),
         (["study", "toy"], "--points", str(10**11)),
         (["study", "toy"], "--norm", "1e308"),
         (["train", "SPEC"], "--checkpoints", str(10**15)),
         (["mmd", "ZOO", "ZOO"], "--bandwidths", str(10**9))]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    zoo = root / "zoo.h5"
    with create_zoo(zoo, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=checkpoint(0)) as collection:
        collection.append_many([checkpoint(s) for s in range(3)])
    spec = root / "spec.toml"
    spec.write_text('recipe = "optunet-mnist"\ndataset = "digits"\ncheckpoints = 1\n')
    (root / "out").mkdir()
    return {"zoo": zoo, "spec": spec, "out": root / "out", "root": root}


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


def _log(command: str, ok: bool) -> None:
    path = os.environ.get("POSTERIORZOO_PROBE_LOG")
    if path:
        with open(path, "a") as log:
            log.write(json.dumps({"suite": "options", "command": command,
                                  "class": "bad option", "refused": True, "ok": ok}) + "\n")


@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bad_option_values_are_refused_before_anything_runs(files, capsys, data):
    words, option = data.draw(st.sampled_from(_options(files)), label="option")
    value = data.draw(bad_values(_parser_of(words, option).type), label="value")
    before = _snapshot(files["root"])
    ok = False
    try:
        code, _, err = run(capsys, *words, f"{option}={value}", "--no-progress")
        assert_one_line_error(code, err, option)
        assert _snapshot(files["root"]) == before
        ok = True
    finally:
        _log(words[0], ok)


@pytest.mark.parametrize("words, option, value", AUDIT,
                         ids=[f"{w[0]}-{o}" for w, o, _ in AUDIT])
def test_the_audits_values_are_refused_when_parsed(files, capsys, words, option, value):
    words = [str(files["zoo"]) if w == "ZOO" else str(files["spec"]) if w == "SPEC" else w
             for w in words]
    before = _snapshot(files["root"])
    ok = False
    try:
        code, _, err = run(capsys, *words, "--out", str(files["out"] / "audit"), option, value)
        assert_one_line_error(code, err, option, "out of range")
        assert _snapshot(files["root"]) == before
        ok = True
    finally:
        _log(words[0], ok)


def test_every_numeric_option_is_covered_and_shows_its_range(files):
    """The table above names every option whose value is a number (read from --help); each
    has a finite range, which its help text shows."""
    from posteriorzoo.cli import build_parser

    covered = {(" ".join(words[:2]) if words[0] in ("plot", "study") else words[0], option)
               for words, option in _options(files)}
    parser = build_parser()
    subcommands = dict(parser._subparsers._group_actions[0].choices)
    for name, sub in list(subcommands.items()):     # and the subcommands' own, e.g. plot mmd
        nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
        for action in nested:
            subcommands.update({f"{name} {n}": p for n, p in action.choices.items()})
    seen = 0
    for name, sub in subcommands.items():
        for action in sub._actions:
            numeric = getattr(action.type, "__module__", "") == "posteriorzoo.cli._types"
            if numeric and action.option_strings:
                seen += 1
                assert (name, action.option_strings[0]) in covered, (name, action)
                kind = action.type
                assert hasattr(kind, "range_text"), (name, action.option_strings)
                assert kind.low > -1e300 and kind.high < 1e300
                assert kind.range_text in " ".join(action.help.split()), \
                    (name, action.option_strings, action.help)
    assert seen == len(covered)
