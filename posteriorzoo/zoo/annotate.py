"""A collection's posterior group, set after training from a measurement.

The trainer writes the group a collection's samples belong to (the ``annotations``
attribute's ``posterior``: one of :data:`~posteriorzoo.vocabulary.POSTERIOR_GROUPS`)
from its spec: one mode, or several. For some methods that is only a guess until the
samples are looked at: SVGD's particles train together as one "mode" but may end in as
many modes of the posterior as there are particles. :func:`annotate_collection`
(``posteriorzoo annotate``) sets the group afterwards and records why: a copy of the file
whose only change is the ``annotations`` attribute, which gains::

    "posterior": "multi-mode",
    "posterior_set": {"from": "single-mode", "reason": "...", "provenance": {...},
                      "earlier": [...]}

``from`` is the group before (None when none was recorded), ``reason`` one line saying
what measurement decided it, ``provenance`` the command, library versions and the
input file's SHA-256 (:func:`posteriorzoo.provenance.record`), and ``earlier`` (only when
the group was set this way before) the earlier ``posterior_set`` records, oldest first,
so that no decision is lost. Checkpoints, metadata, training records, digests, chunking
and schema are those of the input, byte for byte.

The input's digests are checked first; the copy is built under a temporary name and
renamed into place (over the input only with ``in_place``), so a refused or killed call
leaves the input, and any earlier output, as they were. The copy is written within the
HDF5 format bounds of :data:`~posteriorzoo.zoo.schema.HDF5_FORMAT`, so HDF5 1.10 reads it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posteriorzoo._api import public
from posteriorzoo.errors import ChecksumError, InvalidOptionError
from posteriorzoo.provenance import describe_input, record
from posteriorzoo.results import CollectionResult
from posteriorzoo.vocabulary import POSTERIOR_GROUPS, method_info
from posteriorzoo.zoo.rewrite import copy_to_edit, open_copy, rewrite_target, writer_lock
from posteriorzoo.zoo.schema import canonical_json
from posteriorzoo.zoo.store import Zoo, open_h5

__all__ = ["MAX_REASON_CHARACTERS", "AnnotateResult", "annotate_collection"]

#: The longest reason, in characters: a sentence or two naming the measurement (what
#: was measured, on what, the number and the threshold), not a report.
MAX_REASON_CHARACTERS = 500
#: The attribute this module changes, and nothing else.
ANNOTATIONS = "annotations"


@dataclass
class AnnotateResult(CollectionResult):
    """What :func:`annotate_collection` did.

    Attributes
    ----------
    path : Path
        The input collection.
    out : Path
        The collection written (``path`` itself when rewritten in place).
    method : str
        The collection's method.
    checkpoints : int
        Its committed checkpoints (all checked against their digests).
    posterior : str
        The group now recorded (one of :data:`~posteriorzoo.vocabulary.POSTERIOR_GROUPS`).
    previous : str or None
        The group recorded before (None: none was).
    reason : str
        The measurement that decided it, as recorded.
    in_place : bool
        Whether the input was replaced by its annotated copy.
    """

    kind = "annotate"
    path: Path
    out: Path
    method: str = ""
    checkpoints: int = 0
    posterior: str = ""
    previous: str | None = None
    reason: str = ""
    in_place: bool = False

    def payload(self) -> dict[str, Any]:
        return {"path": str(self.path), "out": str(self.out), "method": self.method,
                "checkpoints": self.checkpoints, "posterior": self.posterior,
                "previous": self.previous, "reason": self.reason, "in_place": self.in_place}

    def summary(self) -> str:
        """One line: the group before and now, why, and where the result is."""
        before = self.previous or "not recorded"
        target = "rewritten in place" if self.in_place else f"written to {self.out}"
        return (f"{self.path}: posterior {before} -> {self.posterior} ({self.reason}); "
                f"{target}, every checkpoint's digest checked, nothing else changed")


def check_posterior(posterior: object) -> str:
    """``posterior`` if it is one of :data:`~posteriorzoo.vocabulary.POSTERIOR_GROUPS`,
    else :class:`InvalidOptionError`."""
    if posterior not in POSTERIOR_GROUPS:
        raise InvalidOptionError(f"posterior must be one of {', '.join(POSTERIOR_GROUPS)}, "
                                 f"not {posterior!r}")
    return str(posterior)


def check_reason(reason: object) -> str:
    """``reason`` without surrounding spaces, if it is one printable line of 1 to
    :data:`MAX_REASON_CHARACTERS` characters, else :class:`InvalidOptionError`: it is
    shown on one line (``posteriorzoo info``, the report) and kept in the file."""
    if not isinstance(reason, str):
        raise InvalidOptionError(f"reason must be text, not {type(reason).__name__}")
    text = reason.strip()
    if not text:
        raise InvalidOptionError("reason is empty: say what measurement decided the group "
                                 "(e.g. 'pairwise barrier test: 87 of 100 particles in "
                                 "distinct modes')")
    if len(text) > MAX_REASON_CHARACTERS:
        raise InvalidOptionError(f"reason has {len(text):,} characters; at most "
                                 f"{MAX_REASON_CHARACTERS} (one line naming the "
                                 "measurement)")
    if not text.isprintable():
        raise InvalidOptionError("reason must be one line of printable characters (no "
                                 "line breaks, tabs or control characters)")
    return text


def _refuse_one_sample_per_mode(zoo: Zoo) -> None:
    """A method whose every sample is its own independently trained network (DE) has its
    group by construction, not by measurement: it is never changed."""
    info = method_info(zoo.method)
    if info is not None and info.one_sample_per_mode:
        raise InvalidOptionError(
            f"{zoo.path}: a {info.label} collection holds one independently trained network "
            "per mode, so its group is fixed by the method, not measured; it is not "
            "annotated")


def _check_input(zoo: Zoo) -> int:
    """Check every committed checkpoint, metadata row and training record of ``zoo``
    against its digests (:class:`ChecksumError` on the first damage); returns the
    number of checkpoints."""
    zoo.verify_all()
    zoo.stored_metadata()  # the rows against their digests, where verify_all trusted a note
    problems = zoo.check_records()
    if problems:
        mode, problem = problems[0]
        raise ChecksumError(f"{zoo.path}: the training record of mode {mode} is damaged "
                            f"({problem}): nothing was written; 'posteriorzoo verify' "
                            "reports all damage")
    return len(zoo)


def _annotations(previous: dict[str, Any], posterior: str, reason: str,
                 provenance: dict[str, Any]) -> dict[str, Any]:
    """The new ``annotations``: the old ones, the group, and why it was set."""
    setting: dict[str, Any] = {"from": previous.get("posterior"), "reason": reason,
                               "provenance": provenance}
    earlier = previous.get("posterior_set")
    if isinstance(earlier, dict):
        older = earlier.get("earlier")
        history = [*(older if isinstance(older, list) else []),
                   {key: value for key, value in earlier.items() if key != "earlier"}]
        setting["earlier"] = history
    return {**previous, "posterior": posterior, "posterior_set": setting}


def _write_annotations(copy: Path, path: Path, text: str) -> None:
    """Replace the ``annotations`` attribute of the byte copy ``copy`` by ``text``,
    within the format bounds of HDF5 1.10 (:func:`~posteriorzoo.zoo.rewrite.open_copy`),
    and nothing else."""
    with open_copy(copy, path, "annotate") as handle:
        handle.attrs[ANNOTATIONS] = text


def _check_copy(copy: Path, expected: dict[str, Any], checkpoints: int,
                content: str) -> None:
    """The copy opens as a collection with the new annotations, the same committed
    checkpoints and the same metadata rows and row digests as the input."""
    with Zoo(copy, open_h5(copy, "r")) as zoo:
        if zoo.annotations != expected or len(zoo) != checkpoints \
                or zoo._content_digest(checkpoints) != content:
            raise ChecksumError(f"{copy}: the annotated copy does not read back as written; "
                                "nothing was put in place")


@public
def annotate_collection(source: str | os.PathLike, out: str | os.PathLike | None = None, *,
                        posterior: str, reason: str, in_place: bool = False,
                        overwrite: bool = False, command: str | None = None
                        ) -> AnnotateResult:
    """Set a collection's posterior group from a measurement, recording why.

    The report groups Table 1 by the ``annotations`` attribute's ``posterior``. The
    trainer sets it from the spec (one mode or several); where only the trained samples
    can tell (SVGD's particles, trained as one mode, may sit in many), this records the
    measured group, the group before, the reason and the provenance (module docstring).
    Only that attribute changes: every checkpoint, metadata row, digest, training record
    and the file's other attributes, chunking and schema are the input's. The input's
    digests are checked first; the copy is built under a temporary name next to the
    output and renamed into place, so a refused or killed call leaves the input and any
    earlier output as they were.

    Parameters
    ----------
    source : path-like
        The collection.
    out : path-like, optional
        The annotated collection: a new file (an existing one is replaced only with
        ``overwrite``), never the input. Required unless ``in_place``.
    posterior : str
        The group: one of :data:`~posteriorzoo.vocabulary.POSTERIOR_GROUPS`
        (``"single-mode"``, ``"multi-mode"``).
    reason : str
        What measurement decided it: one printable line of at most
        :data:`MAX_REASON_CHARACTERS` characters (surrounding spaces are dropped).
    in_place : bool
        Replace ``source`` by its annotated copy (no ``out``). A ``SHA256SUMS`` listing
        it must then be updated.
    overwrite : bool
        Replace an existing ``out``.
    command : str, optional
        Recorded in the provenance.

    Returns
    -------
    AnnotateResult
        Its provenance is the one stored in the file's ``posterior_set``.

    Raises
    ------
    InvalidOptionError
        ``posterior`` or ``reason`` is not valid; both or neither of ``out`` and
        ``in_place``; ``out`` is the input or its folder is missing; the collection's
        method has one independently trained network per mode (DE), whose group is
        fixed by the method.
    OutputExistsError
        ``out`` exists and ``overwrite`` is False.
    ZooBusyError
        A writer is appending to the collection.
    ZooFormatError
        ``source`` is missing or not a collection (or was left open by a killed writer).
    ChecksumError
        A checkpoint, metadata row or training record of ``source`` is damaged; nothing
        is written.
    """
    posterior = check_posterior(posterior)
    reason = check_reason(reason)
    path = Path(source)
    target = rewrite_target(path, out, in_place=in_place, overwrite=overwrite)
    with writer_lock(path, in_place, "annotate"):
        with Zoo(path, open_h5(path, "r"), verify=True) as zoo:
            _refuse_one_sample_per_mode(zoo)
            checkpoints = _check_input(zoo)
            content = zoo._content_digest(checkpoints)
            previous, method = dict(zoo.annotations), zoo.method
        provenance = record("posteriorzoo annotate", command=command,
                            inputs={"collection": describe_input(path)},
                            options={"posterior": posterior, "reason": reason,
                                     "out": None if in_place else str(target),
                                     "overwrite": overwrite, "in_place": in_place})
        annotations = _annotations(previous, posterior, reason, provenance)
        text = canonical_json(annotations)
        with copy_to_edit(path, target, in_place=in_place, overwrite=overwrite) as partial:
            _write_annotations(partial, path, text)
            _check_copy(partial, json.loads(text), checkpoints, content)
    result = AnnotateResult(path, target, method=method, checkpoints=checkpoints,
                            posterior=posterior, previous=previous.get("posterior"),
                            reason=reason, in_place=in_place)
    result.provenance = provenance
    return result
