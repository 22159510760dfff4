"""Exceptions raised by posteriorzoo.

Every error a user can cause with bad input derives from :class:`PosteriorZooError`;
the command-line interface turns these into one line on stderr and exit code 2.
"""

from __future__ import annotations


class PosteriorZooError(Exception):
    """Base class of every error posteriorzoo raises on bad input."""


class UnknownNameError(PosteriorZooError, KeyError):
    """A model, dataset, recipe or method name that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DataNotFoundError(PosteriorZooError, FileNotFoundError):
    """Dataset files are missing and could not be downloaded; the message says what to do."""


class ChecksumError(PosteriorZooError):
    """A file's SHA-256 digest differs from the expected one."""


class ZooFormatError(PosteriorZooError):
    """A file is missing, is not HDF5, is truncated or corrupt, or is not a zoo collection."""


class ZooSchemaError(PosteriorZooError, ValueError):
    """A checkpoint's keys, shapes or dtypes do not match the collection or architecture."""


class NonFiniteWeightsError(PosteriorZooError, ValueError):
    """A checkpoint contains NaN or infinite values where finite ones are required."""


class CanonicalOverflowError(NonFiniteWeightsError):
    """A checkpoint whose weights are finite, but whose canonical form is too large for
    the collection's dtype (rescaling moved the scale of a layer into the next one).

    ``str(error)`` is the library's message: it names the Python argument that avoids
    the overflow, if one does. A command line names its own option instead, or none
    where the command has no such option (:meth:`command_line_message`). ``way_out``:
    ``(argument as typed, the option's argparse dest, the option as typed, what it does)``.
    """

    def __init__(self, problem: str,
                 way_out: tuple[str, str, str, str] | None = None) -> None:
        self.problem = problem
        self.way_out = way_out
        super().__init__(problem if way_out is None else
                         f"{problem}; with {way_out[0]} {way_out[3]}")

    def command_line_message(self, options: object) -> str:
        """The message for a command whose parsed options are ``options``: it names the
        way out only where the command has that option."""
        if self.way_out is None or not hasattr(options, self.way_out[1]):
            return self.problem
        return f"{self.problem}; with {self.way_out[2]} {self.way_out[3]}"


class ModelBuildError(PosteriorZooError):
    """A registered model's factory raised an error, or returned something that is not a
    ``torch.nn.Module``; the message names the model and the plugin that registered it."""


class ZooBusyError(PosteriorZooError):
    """Another process holds the collection open for writing."""


class HubError(PosteriorZooError):
    """A Hugging Face Hub transfer failed (no network, unknown repository, bad revision)."""


class DataFormatError(PosteriorZooError, ValueError):
    """A dataset file is corrupt or not in the expected format (e.g. a bad IDX header)."""


class InvalidOptionError(PosteriorZooError, ValueError):
    """An option value out of its valid range (e.g. a dropout probability of 1.5)."""


class SampleSizeError(PosteriorZooError, ValueError):
    """Too few samples for a statistic (an unbiased MMD needs at least 2 per sample)."""


class ShapeMismatchError(PosteriorZooError, ValueError):
    """Samples or collections whose feature dimensions or layers do not correspond."""


class OutputExistsError(PosteriorZooError, FileExistsError):
    """An output already exists and overwriting was not asked for."""


class NoSpaceError(PosteriorZooError):
    """The file system of an output is full (or the user's quota is used up).

    Nothing is left behind: the temporary output is removed, and a collection being
    appended to keeps its committed checkpoints. ``needed`` is the space the output needs
    in bytes: an estimate, or with ``at_least`` what it held when the disk filled (None:
    unknown). The message: ``no space left on device: FOLDER needs about N MB``.
    """

    def __init__(self, folder: object, needed: int | None = None, *,
                 at_least: bool = False) -> None:
        self.folder = str(folder)
        self.needed = needed
        if needed is None:
            amount = "more space"
        else:
            megabytes = needed / 1e6
            size = (f"{megabytes:,.0f} MB" if megabytes >= 10 else
                    f"{megabytes:.1f} MB" if megabytes >= 0.1 else
                    f"{max(1, round(needed / 1e3))} kB")
            amount = f"{'more than' if at_least else 'about'} {size}"
        super().__init__(f"no space left on device: {folder} needs {amount}")
