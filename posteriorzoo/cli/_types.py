"""Argument types shared by the subcommands: numbers are checked when they are parsed.

Each returns the converted value or raises ``argparse.ArgumentTypeError``, which the
parser turns into one usage line on stderr and exit code 2. Every numeric option of the
command line has a range (:func:`integer_in`, :func:`number_in`): the parser carries it
as ``range_text``, which the option's --help shows next to the reason for the bound
(memory, time, the format), so a value that could only fail after minutes of work is
refused before any.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from pathlib import Path


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0 (counts, seeds)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def finite_float(text: str) -> float:
    """Any finite number."""
    return _number(text)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def open_unit_interval(text: str) -> float:
    """A finite number strictly between 0 and 1 (levels, probabilities)."""
    value = _number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not strictly between 0 and 1")
    return value


def _shown(value: float) -> str:
    """A bound as --help shows it: 1e6 rather than 1e+06."""
    text = f"{value:g}"
    return text.replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


#: The largest seed: numpy's legacy generators and most tools take 32-bit seeds, and a
#: larger one adds no randomness (every seed is expanded by numpy's SeedSequence).
MAX_SEED = 2**32 - 1


def integer_in(low: int, high: int) -> Callable[[str], int]:
    """An integer in ``[low, high]``; the parser's ``range_text`` says so in --help."""
    range_text = f"{low:,} to {high:,}"

    def parse(text: str) -> int:
        value = _integer(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range ({range_text})")
        return value

    parse.__name__ = f"integer from {range_text}"  # argparse names the type in its errors
    parse.range_text = range_text                  # type: ignore[attr-defined]
    parse.low, parse.high = low, high              # type: ignore[attr-defined]
    parse.integer, parse.open_low, parse.open_high = True, False, False  # type: ignore
    return parse


def number_in(low: float, high: float, *, open_low: bool = False,
              open_high: bool = False) -> Callable[[str], float]:
    """A finite number between ``low`` and ``high`` (excluded with ``open_low`` /
    ``open_high``); the parser's ``range_text`` is the interval, e.g. ``(0, 1e6]``."""
    range_text = (f"{'(' if open_low else '['}{_shown(low)}, {_shown(high)}"
                  f"{')' if open_high else ']'}")

    def parse(text: str) -> float:
        value = _number(text)
        above = value > low if open_low else value >= low
        below = value < high if open_high else value <= high
        if not (above and below):
            raise argparse.ArgumentTypeError(f"{_shown(value)} is out of range {range_text}")
        return value

    parse.__name__ = f"number in {range_text}"
    parse.range_text = range_text                  # type: ignore[attr-defined]
    parse.low, parse.high = low, high              # type: ignore[attr-defined]
    parse.integer, parse.open_low, parse.open_high = False, open_low, open_high  # type: ignore
    return parse


def seed_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--seed``: ``what`` it seeds; 0 to :data:`MAX_SEED`."""
    parser.add_argument("--seed", type=integer_in(0, MAX_SEED), default=0,
                        help=f"{what}; 0 to {MAX_SEED:,} (32 bits: larger seeds add no "
                             "randomness) (default: %(default)s)")


def add_overwrite_option(parser: argparse.ArgumentParser) -> None:
    """``--overwrite``: the one way to let a command replace an existing output."""
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the output if it exists (default: refuse); the output "
                             "is never one of the inputs, and a file replaces only a file, "
                             "a folder only a folder")


def add_rewrite_options(parser: argparse.ArgumentParser, in_place_help: str) -> None:
    """``--out OUT`` or ``--in-place``, and ``--overwrite``: where a command that rewrites a
    collection as a copy (``reorder``, ``annotate``: :mod:`posteriorzoo.zoo.rewrite`)
    puts it. :func:`check_rewrite_options` refuses ``--overwrite`` with ``--in-place``."""
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", dest="target", type=Path, metavar="OUT",
                       help="new collection file (.h5)")
    where.add_argument("--in-place", action="store_true", help=in_place_help)
    add_overwrite_option(parser)


def check_rewrite_options(args: argparse.Namespace) -> None:
    """``--overwrite`` names an output to replace: not with ``--in-place``."""
    from posteriorzoo.errors import InvalidOptionError

    if args.in_place and args.overwrite:
        raise InvalidOptionError("--overwrite applies to --out OUT; --in-place replaces IN "
                                 "itself")


def add_no_verify_option(parser: argparse.ArgumentParser) -> None:
    """``--no-verify``: for commands that read checkpoints."""
    parser.add_argument("--no-verify", action="store_true",
                        help="do not check each checkpoint's SHA-256 as it is read "
                             "(default: check, and refuse a corrupt input)")


def add_device_option(parser: argparse.ArgumentParser, where: str) -> None:
    """``--device``: ``where`` says what runs there (torch's device names; default cpu)."""
    from posteriorzoo.devices import device_name

    parser.add_argument("--device", type=device_name, default="cpu", metavar="DEVICE",
                        help=f"{where}: cpu, cuda or cuda:N (a CUDA build of torch and a "
                             "GPU) (default: %(default)s)")


def add_json_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--json``: print ``what`` (the command's result as JSON) instead of the text."""
    parser.add_argument("--json", action="store_true", help=f"print {what}")


def named_paths(arguments: Sequence[str]) -> list[tuple[str | None, Path]]:
    """``NAME=PATH`` or ``PATH`` arguments as (name, or None when not given, path).

    An argument that is an existing file is a path even if it contains ``=``.
    """
    from posteriorzoo.errors import InvalidOptionError

    named: list[tuple[str | None, Path]] = []
    for argument in arguments:
        if "=" in argument and not Path(argument).exists():
            name, _, path = argument.partition("=")
            if not name or not path:
                raise InvalidOptionError(f"expected NAME=PATH or PATH, got {argument!r}")
            if any(name == other for other, _ in named):
                raise InvalidOptionError(f"the name {name!r} is given twice")
            named.append((name, Path(path)))
        else:
            named.append((None, Path(argument)))
    return named


def file_stem_names(arguments: Sequence[str]) -> dict[str, Path]:
    """:func:`named_paths` with unnamed files named by their stems (made unique)."""
    from posteriorzoo.collection.comparison import display_name

    pairs = named_paths(arguments)
    taken = {name for name, _ in pairs if name is not None}
    return {name if name is not None else display_name(path, taken): path
            for name, path in pairs}
