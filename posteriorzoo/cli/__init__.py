"""The ``posteriorzoo`` command: one console script with subcommands.

Each subcommand lives in a small module of this package that exposes
``register(subparsers)``; the module adds its parser and sets ``func``, a callable that
takes the parsed arguments and returns an exit code. Errors a user can cause derive from
:class:`posteriorzoo.errors.PosteriorZooError` and are printed as one line on stderr
with exit code 2; so are I/O errors, and a full disk (``no space left on device: FOLDER
needs about N MB``) whichever library met it. Progress bars are drawn only when stderr
is a terminal; in a log or a pipe long work reports one line a minute (count, rate, time
left) once it has run 10 s, and a last line (:mod:`posteriorzoo.progress`), so a short
command or a refusal is still one line. ``--no-progress`` turns both off.

Models of your own: the global option ``--models MODULE`` and the environment variable
``POSTERIORZOO_MODELS`` name plugin modules that register them; they are imported before
the command runs (:mod:`posteriorzoo.models.plugins`).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn

from posteriorzoo import __version__
from posteriorzoo.errors import CanonicalOverflowError, PosteriorZooError

EXIT_BAD_INPUT = 2
#: posteriorzoo.models.plugins.ENVIRONMENT_VARIABLE, named here because importing that
#: module imports torch, which a command that needs no model should not wait for.
MODELS_VARIABLE = "POSTERIORZOO_MODELS"

_SUBCOMMAND_MODULES = (
    "posteriorzoo.cli.zoo_commands",
    "posteriorzoo.cli.reorder_command",
    "posteriorzoo.cli.annotate_command",
    "posteriorzoo.cli.hub_commands",
    "posteriorzoo.cli.train_command",
    "posteriorzoo.cli.canonicalize_command",
    "posteriorzoo.cli.mmd_command",
    "posteriorzoo.cli.diagnose_command",
    "posteriorzoo.cli.overhead_command",
    "posteriorzoo.cli.report_command",
    "posteriorzoo.cli.plot_command",
    "posteriorzoo.cli.study_command",
    "posteriorzoo.cli.demo",
)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every subcommand registered."""
    import importlib

    parser = _Parser(
        prog="posteriorzoo",
        description=(
            "Study Bayesian neural network posteriors through collections of trained "
            "checkpoints (zoos) stored in HDF5."
        ),
    )
    parser.add_argument("--version", action="version", version=f"posteriorzoo {__version__}")
    parser.add_argument(
        "--models", action="append", metavar="MODULE",
        help="a module of your own that registers models (posteriorzoo.models.register), "
             "imported before the command runs: a module name (my_models, found in the "
             "current folder or on PYTHONPATH) or module:function; repeat the option or "
             "separate names with commas. POSTERIORZOO_MODELS=MODULE[,MODULE] does the same; "
             "installed packages declare entry points in the group posteriorzoo.models")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in _SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed, recorded in every output file for provenance."""
    words = list(sys.argv if argv is None else ["posteriorzoo", *argv])
    import shlex

    return shlex.join(words)


def _no_space_line(error: BaseException) -> str:
    """One line for a full disk met outside the writers that know the output's size."""
    import os

    from posteriorzoo.errors import NoSpaceError

    filename = getattr(error, "filename", None)
    if filename:
        folder = os.path.dirname(os.path.abspath(os.fspath(filename)))
    else:
        folder = "the output's folder"
    return str(NoSpaceError(folder))


def _load_model_plugins(modules: Sequence[str] | None) -> None:
    """Import the plugin modules of ``--models`` and ``POSTERIORZOO_MODELS``.

    Nothing is imported when neither names one, so commands stay light. The current
    folder is searched too (last), as a console script, unlike ``python -m``, does not
    put it on Python's path.
    """
    import os

    if not modules and not os.environ.get(MODELS_VARIABLE, "").strip(", "):
        return
    from posteriorzoo.models.plugins import load_models

    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
    load_models(modules or (), environment=True, label="--models")




def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (0 ok, 2 bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = command_line(argv)

    def show_warning(message, category, *_: object, **__: object) -> None:
        # Library warnings (symmetries a canonicalizer could not remove, collections
        # compared across datasets, ...) as one plain line each.
        print(f"posteriorzoo {args.command}: warning: {message}", file=sys.stderr)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.showwarning = show_warning
            _load_model_plugins(args.models)
            return int(args.func(args) or 0)
    except PosteriorZooError as error:
        # an error that names a Python argument says the command's option instead
        message = (error.command_line_message(args)
                   if isinstance(error, CanonicalOverflowError) else error)
        print(f"posteriorzoo {args.command}: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # output piped into e.g. `head`
        sys.stderr.close()
        return 0
    except (OSError, RuntimeError) as error:
        # unreadable files, permissions, I/O errors inside HDF5; a full disk that a writer
        # did not turn into NoSpaceError itself (RuntimeError: HDF5's "file write failed")
        from posteriorzoo.outputs import is_no_space

        if is_no_space(error):
            print(f"posteriorzoo {args.command}: error: {_no_space_line(error)}",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
        if isinstance(error, RuntimeError):
            raise
        print(f"posteriorzoo {args.command}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"posteriorzoo {args.command}: interrupted", file=sys.stderr)
        return 130


def run() -> NoReturn:
    """The console script: :func:`main`, then exit with its code.

    Python's shutdown collects the garbage of every object still alive, several times
    over, and torch, numba and SciPy leave hundreds of thousands of them: 0.3 s after
    ``import torch``, 0.9 s after a report. Every command has closed its files and
    removed its temporary outputs by then (context managers; ``atexit`` handlers such as
    Ray's still run), so the survivors are frozen (:func:`gc.freeze`) instead of scanned.
    """
    code = main()
    import gc

    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    run()
