"""Bad option values, generated: every numeric option of every subcommand.

Each bad value must give exit code 2, exactly one line on stderr, no traceback, and
leave every file as it was (no output created). The values come from Hypothesis:
integers out of range, non-numbers, NaN and infinities, fractions where integers are
expected, overflowing literals.
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

# option kind -> values that must be refused
NOT_NUMBERS = st.sampled_from(["abc", "", "1,5", "0x10", "one", "1_0_", "2 3"])
NON_FINITE = st.sampled_from(["nan", "NaN", "inf", "-inf", "1e400", "-1e400"])
BAD = {
    "positive_int": st.one_of(st.integers(max_value=0).map(str), NOT_NUMBERS,
                              st.sampled_from(["1.5", "2.0", "1e3", "nan", "inf"])),
    "nonnegative_int": st.one_of(st.integers(max_value=-1).map(str), NOT_NUMBERS,
                                 st.sampled_from(["0.5", "nan", "-0.1"])),
    "positive_float": st.one_of(st.floats(max_value=0, allow_nan=False).map(repr),
                                NOT_NUMBERS, NON_FINITE),
    "unit_interval": st.one_of(st.floats(min_value=1, allow_nan=False).map(repr),
                               st.floats(max_value=0, allow_nan=False).map(repr),
                               NOT_NUMBERS, NON_FINITE),
}


def _options(files: dict[str, Path]) -> list[tuple[list[str], str, str]]:
    """(command words before the option, option, kind) for every numeric option."""
    zoo, out = str(files["zoo"]), str(files["out"])
    return [
        (["canonicalize", zoo, "--out", out + "/c.h5"], "--checkpoints-per-batch", "positive_int"),
        (["canonicalize", zoo, "--out", out + "/c.h5"], "--n-verify", "nonnegative_int"),
        (["canonicalize", zoo, "--out", out + "/c.h5"], "--seed", "nonnegative_int"),
        (["min-mass", zoo, "--out", out + "/m"], "--checkpoints-per-batch", "positive_int"),
        (["mmd", zoo, zoo, "--out", out + "/r"], "--bandwidths", "positive_int"),
        (["mmd", zoo, zoo, "--out", out + "/r"], "--scale", "positive_float"),
        (["mmd", zoo, zoo, "--out", out + "/r"], "--alpha", "unit_interval"),
        (["mmd", zoo, zoo, "--out", out + "/r"], "--b1", "positive_int"),
        (["mmd", zoo, zoo, "--out", out + "/r"], "--b2", "positive_int"),
        (["mmd", zoo, zoo, "--out", out + "/r"], "--b3", "positive_int"),
        (["mmd", zoo, zoo, "--out", out + "/r"], "--seed", "nonnegative_int"),
        (["mmd", zoo, zoo, "--out", out + "/r"], "--block-mb", "positive_float"),
        (["train", str(files["spec"]), "--out", out + "/t.h5"], "--workers", "positive_int"),
        (["train", str(files["spec"]), "--out", out + "/t.h5"], "--group-size",
         "positive_int"),
        (["train", str(files["spec"]), "--out", out + "/t.h5"], "--checkpoints",
         "positive_int"),
        (["demo", "--out", out + "/d"], "--checkpoints", "positive_int"),
        (["demo", "--out", out + "/d"], "--epochs", "positive_int"),
        (["demo", "--out", out + "/d"], "--seed", "nonnegative_int"),
        (["demo", "--out", out + "/d"], "--n-images", "positive_int"),
        (["report", zoo, zoo, "--out", out + "/p"], "--bins", "positive_int"),
        (["report", zoo, zoo, "--out", out + "/p"], "--n-images", "positive_int"),
        (["report", zoo, zoo, "--out", out + "/p"], "--splits", "positive_int"),
        (["report", zoo, zoo, "--out", out + "/p"], "--n-pairs", "nonnegative_int"),
        (["report", zoo, zoo, "--out", out + "/p"], "--seed", "nonnegative_int"),
        (["plot", "marginals", zoo, "--out", out + "/f"], "--units", "positive_int"),
        (["plot", "collapse", zoo, "--ood-data", "digits", "--out", out + "/f"],
         "--n-images", "positive_int"),
        (["plot", "collapse", zoo, "--ood-data", "digits", "--out", out + "/f"],
         "--n-pairs", "positive_int"),
        (["plot", "collapse", zoo, "--ood-data", "digits", "--out", out + "/f"], "--seed",
         "nonnegative_int"),
        (["plot", "mmd", zoo, zoo, "--out", out + "/f"], "--noise-splits", "nonnegative_int"),
        (["plot", "mmd", zoo, zoo, "--out", out + "/f"], "--seed", "nonnegative_int"),
        (["study", "toy", "--out", out + "/s"], "--networks", "positive_int"),
        (["study", "toy", "--out", out + "/s"], "--norm", "positive_float"),
        (["study", "toy", "--out", out + "/s"], "--points", "positive_int"),
        (["study", "toy", "--out", out + "/s"], "--seed", "nonnegative_int"),
        (["study", "permutation-stability", "--out", out + "/s"], "--runs", "positive_int"),
        (["study", "permutation-stability", "--out", out + "/s"], "--epochs", "positive_int"),
        (["study", "permutation-stability", "--out", out + "/s"], "--every", "positive_int"),
        (["study", "permutation-stability", "--out", out + "/s"], "--seed",
         "nonnegative_int"),
        (["import", "--out", out + "/i.h5", str(files["zoo"])], "--checkpoints-per-batch",
         "positive_int"),
        (["import", "--out", out + "/i.h5", str(files["zoo"])], "--num-classes", "positive_int"),
    ]


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


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bad_option_values_are_refused_before_anything_runs(files, capsys, data):
    words, option, kind = data.draw(st.sampled_from(_options(files)), label="option")
    value = data.draw(BAD[kind], label="value")
    before = _snapshot(files["root"])
    ok = False
    try:
        code, _, err = run(capsys, *words, f"{option}={value}", "--no-progress")
        assert_one_line_error(code, err, option)
        assert _snapshot(files["root"]) == before
        ok = True
    finally:
        _log(words[0], ok)


def test_every_numeric_option_is_covered(files):
    """The table above names every option whose value is a number (read from --help)."""
    from posteriorzoo.cli import build_parser

    covered = {(" ".join(words[:2]) if words[0] in ("plot", "study") else words[0], option)
               for words, option, _ in _options(files)}
    parser = build_parser()
    subcommands = dict(parser._subparsers._group_actions[0].choices)
    for name, sub in list(subcommands.items()):     # and the subcommands' own, e.g. plot mmd
        nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
        for action in nested:
            subcommands.update({f"{name} {n}": p for n, p in action.choices.items()})
    for name, sub in subcommands.items():
        for action in sub._actions:
            numeric = getattr(action.type, "__module__", "") == "posteriorzoo.cli._types"
            if numeric and action.option_strings:
                assert (name, action.option_strings[0]) in covered, (name, action)
