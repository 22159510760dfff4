"""Writing figures: PNG and PDF side by side, atomically; PNG as base64 for HTML pages.

:func:`save_figure` follows the project's output policy (:mod:`posteriorzoo.outputs`):
both paths are checked before anything is written (an existing file is refused unless
``overwrite``, an input is never an output, a missing parent folder is an error), and a
figure's files are published together (:func:`posteriorzoo.outputs.atomic_files`): both
are rendered under temporary names in the same folder and moved into place only when
both are complete. A failure leaves neither; a kill while they are moved into place may
leave one, which the next run writing that figure recognises and replaces, so a rerun
always succeeds and leaves both.
"""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Iterable
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.outputs import atomic_files

__all__ = ["FORMATS", "figure_paths", "png_base64", "save_figure"]

#: The formats :func:`save_figure` writes, in order.
FORMATS = ("png", "pdf")
#: Resolution of the PNG files, in dots per inch.
DPI = 150


def figure_paths(path: str | os.PathLike) -> dict[str, Path]:
    """The PNG and PDF paths of ``path``: given without a suffix, or ending in .png or
    .pdf (replaced). ``"out/fig"`` -> ``{"png": out/fig.png, "pdf": out/fig.pdf}``."""
    path = Path(path)
    if path.suffix.lower() in (".png", ".pdf"):
        path = path.with_suffix("")
    if not path.name:
        raise InvalidOptionError(f"{path!s}: a figure path needs a file name")
    return {kind: path.with_name(f"{path.name}.{kind}") for kind in FORMATS}


def _canvas(figure: Figure) -> Figure:
    if not isinstance(figure.canvas, FigureCanvasAgg):
        FigureCanvasAgg(figure)
    return figure


def save_figure(figure: Figure, path: str | os.PathLike, *, overwrite: bool = False,
                inputs: Iterable[str | os.PathLike] = (), dpi: int = DPI) -> dict[str, Path]:
    """Write ``figure`` as PNG and PDF next to each other.

    Parameters
    ----------
    figure : Figure
    path : path-like
        Without a suffix, or with .png or .pdf (see :func:`figure_paths`).
    overwrite : bool
        Replace existing files (default: refuse them).
    inputs : iterable of path-like
        Files the figure was drawn from: never replaced.
    dpi : int
        Resolution of the PNG (the PDF is vector graphics).

    Returns
    -------
    dict
        ``{"png": Path, "pdf": Path}``, the files written (both, or an error and neither).

    Raises
    ------
    posteriorzoo.errors.OutputExistsError
        A file exists and ``overwrite`` is False (nothing is written). The file a killed
        run left of an unfinished figure is not refused: it is replaced.
    posteriorzoo.errors.InvalidOptionError
        A file would replace an input, or its folder does not exist (nothing is written).
    posteriorzoo.errors.NoSpaceError
        The disk filled while the figure was written (nothing is left).
    """
    paths = figure_paths(path)
    _canvas(figure)
    # both checked before either is written, both published together
    with atomic_files(list(paths.values()), overwrite=overwrite, inputs=inputs) as partials:
        for kind, partial in zip(paths, partials, strict=True):
            figure.savefig(partial, format=kind, dpi=dpi)
    return paths


def png_bytes(figure: Figure, dpi: int = DPI) -> bytes:
    """The figure as PNG file content."""
    buffer = io.BytesIO()
    _canvas(figure).savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def png_base64(figure: Figure, dpi: int = DPI) -> str:
    """The figure as a base64 PNG, for ``<img src="data:image/png;base64,...">``.

    Returns
    -------
    str
        ASCII base64 of the PNG bytes, without the ``data:`` prefix.
    """
    return base64.b64encode(png_bytes(figure, dpi)).decode("ascii")
