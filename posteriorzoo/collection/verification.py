"""Verify a collection: structure, architecture, per-checkpoint and per-record digests,
manifest, and whether its rows are in mode order.

:func:`verify` checks a collection file end to end and returns a :class:`VerifyResult`
(what ``posteriorzoo verify`` prints); :func:`require_ok` turns a failed verification
into a :class:`~posteriorzoo.errors.ChecksumError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py

from posteriorzoo._api import public
from posteriorzoo.collection._open import Source, architecture_fit, opened, source_path
from posteriorzoo.errors import ChecksumError, PosteriorZooError, ZooFormatError
from posteriorzoo.provenance import describe_input, record
from posteriorzoo.results import CollectionResult, csv_text
from posteriorzoo.zoo import verified
from posteriorzoo.zoo.manifest import MANIFEST_NAME, read_manifest, sha256_file
from posteriorzoo.zoo.reorder import collection_row_order
from posteriorzoo.zoo.schema import HDF5_FORMAT, HDF5_FORMAT_ATTRIBUTE
from posteriorzoo.zoo.store import Zoo

__all__ = ["VerifyResult", "require_ok", "verify"]


@dataclass
class VerifyResult(CollectionResult):
    """What :func:`verify` found. ``ok`` is True when ``problems`` is empty.

    Attributes
    ----------
    path : Path
        The collection file.
    checkpoints : int
    digest_mismatches : list of int
        Checkpoints whose tensors differ from their stored SHA-256.
    nonfinite_unflagged : list of int
        Checkpoints holding NaN/inf without the ``diverged`` flag.
    metadata_mismatches : list of int
        Checkpoints whose metadata rows differ from their stored SHA-256.
    records : int
        Training records of committed modes (schema 3; 0 for older files).
    record_mismatches : list of int
        Modes whose training records differ from their stored SHA-256 or are not JSON
        objects.
    manifest : str
        ``"absent"``, ``"matches"``, ``"MISMATCH"``, ``"unreadable"`` or ``"does not list
        this file"``: what a ``SHA256SUMS`` next to the file says of it.
    rows_out_of_order : int
        Rows not where mode order puts them (ascending ``mode_id``, then ``sample_id``;
        rows without a ``mode_id`` are not ordered). Not damage: the checkpoints are
        intact, but row i no longer holds mode i (``posteriorzoo reorder`` fixes it).
    first_out_of_order : int or None
        The first such row.
    fits_architecture : bool or None
        Whether the stored keys, shapes and dtypes fit the registered architecture; None
        when it is not registered here. Not damage when they do not (a collection
        created with ``validate=False``), but a finding: the commands that build the
        network (canonicalize, min-mass, mmd, diagnose, evaluation) refuse it.
    problems : list of str
        Everything wrong, one line each (empty when the collection is OK).
    findings : list of str
        What is not damage but worth knowing: rows out of mode order.
    notes : list of str
        What was not checked, and why.
    """

    kind = "verify"
    path: Path
    checkpoints: int = 0
    digest_mismatches: list[int] = field(default_factory=list)
    nonfinite_unflagged: list[int] = field(default_factory=list)
    metadata_mismatches: list[int] = field(default_factory=list)
    records: int = 0
    record_mismatches: list[int] = field(default_factory=list)
    manifest: str = "absent"
    rows_out_of_order: int = 0
    first_out_of_order: int | None = None
    fits_architecture: bool | None = None
    problems: list[str] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """One line: the verdict and the counts behind it, then any finding."""
        findings = "".join(f"; {finding}" for finding in self.findings)
        if self.ok:
            records = f" and {self.records} training records" if self.records else ""
            fits = "; tensors fit the architecture" if self.fits_architecture else ""
            return (f"{self.path}: OK, {self.checkpoints} checkpoints{records} verified "
                    f"(digests match{fits}; manifest {self.manifest}){findings}")
        return f"{self.path}: CORRUPT: " + "; ".join(self.problems) + findings

    def payload(self) -> dict[str, Any]:
        return {"path": str(self.path), "ok": self.ok, "checkpoints": self.checkpoints,
                "digest_mismatches": self.digest_mismatches,
                "nonfinite_unflagged": self.nonfinite_unflagged,
                "metadata_mismatches": self.metadata_mismatches,
                "records": self.records, "record_mismatches": self.record_mismatches,
                "manifest": self.manifest, "rows_out_of_order": self.rows_out_of_order,
                "first_out_of_order": self.first_out_of_order,
                "fits_architecture": self.fits_architecture, "problems": self.problems,
                "findings": self.findings, "notes": self.notes}

    def tables(self) -> dict[str, str]:
        """``bad_checkpoints.csv``: one row per damaged checkpoint and what is wrong."""
        rows = sorted([(index, what) for indices, what in (
            (self.digest_mismatches, "tensors differ from their SHA-256"),
            (self.metadata_mismatches, "metadata row differs from its SHA-256"),
            (self.nonfinite_unflagged, "NaN/inf without the diverged flag"))
            for index in indices])
        return {"bad_checkpoints.csv": csv_text(["checkpoint", "problem"], rows)}


@public
def verify(source: Source, *, progress: bool = False, command: str | None = None
           ) -> VerifyResult:
    """Check a collection file end to end.

    Checks that it opens as a collection (its layout, :mod:`posteriorzoo.zoo.layout`,
    and that its tensors fit its architecture when it is registered); that every HDF5
    object and attribute can be read (HDF5's own header checksums catch damage to the
    file's structure); that each checkpoint's tensors and metadata row, and each committed
    mode's training record, equal the SHA-256 digests stored when they were written (and
    that the records are JSON objects); that non-finite weights only occur in
    checkpoints flagged ``diverged``; and, if a ``SHA256SUMS`` next to the file lists it,
    the whole file's digest. Rows out of mode order (row i not holding mode i's samples,
    see :func:`posteriorzoo.zoo.row_order`) are a finding, not a problem: the result
    stays OK.

    Parameters
    ----------
    source : path or Zoo
        The collection file, or an open collection (checked as it is, left open).
    progress : bool, default False
        Show a progress bar.
    command : str, optional
        Recorded in the provenance.

    Returns
    -------
    VerifyResult
        Never raised for corruption it can describe: see ``VerifyResult.problems`` and
        ``VerifyResult.ok``. The provenance records the file's SHA-256.

    Raises
    ------
    ZooFormatError
        The file cannot be opened as a collection at all.
    """
    path = source_path(source)
    result = VerifyResult(path=path)
    seen = verified.snapshot(path)  # how the file looked before the checks
    with opened(source, verify=False) as zoo:
        result.checkpoints = len(zoo)
        _check_objects(zoo, result)
        if not zoo.has_row_digests:
            result.notes.append("metadata rows are not covered by digests (schema 1 file)")
        if zoo._file.attrs.get(HDF5_FORMAT_ATTRIBUTE) != HDF5_FORMAT[1]:
            result.notes.append(
                f"written with HDF5 formats newer than {HDF5_FORMAT[1]}'s (by an earlier "
                "posteriorzoo): HDF5 1.10 and 1.14 may not read it; the next append, or "
                "posteriorzoo.zoo.upgrade_zoo, rewrites it within them")
        _check_digests(zoo, result, progress)
        _check_records(zoo, result)
        _check_row_order(zoo, result)
        _check_architecture(zoo, result)
        content = zoo._content_digest(result.checkpoints)
    digest = _check_manifest(path, result)
    # Later opens trust what was just checked while the file stays as it is (the note
    # is in the user's cache; the collection is not touched), and distrust it otherwise.
    if result.ok and result.checkpoints:
        verified.remember(path, seen, result.checkpoints, content)
    elif not result.ok:
        verified.forget(path)
    result.provenance = record("posteriorzoo verify", command=command,
                               inputs={"collection": describe_input(path, digest)})
    return result


#: Rows of a non-state dataset read at once while checking it is readable (the metadata
#: table: about 1 MB; the training records: about 17 MB).
_OBJECT_BLOCK_ROWS = 1024


def _check_objects(zoo: Zoo, report: VerifyResult) -> None:
    """Read every attribute, and every non-state dataset up to the committed count (rows
    past it are never read: a file may declare far more than it holds), in blocks."""
    handle = zoo._file
    committed = len(zoo)

    def visit(name: str, item: object) -> None:
        try:
            for attribute in item.attrs:
                item.attrs[attribute]
            if isinstance(item, h5py.Dataset) and not name.startswith("state/"):
                if item.ndim == 0 or name == "committed":
                    item[()]
                    return
                for start in range(0, min(item.shape[0], committed), _OBJECT_BLOCK_ROWS):
                    item[start:min(committed, start + _OBJECT_BLOCK_ROWS)]
        except (OSError, RuntimeError, KeyError, ValueError, TypeError) as error:
            report.problems.append(f"/{name} unreadable: {error}")

    try:
        for attribute in handle.attrs:
            handle.attrs[attribute]
        handle.visititems(visit)
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as error:
        report.problems.append(f"the file's structure is unreadable: {error}")


def _check_digests(zoo: Zoo, report: VerifyResult, progress: bool) -> None:
    from posteriorzoo.progress import progress as progress_bar

    rows = zoo.block_rows()
    count = len(zoo)
    with progress_bar(total=count, desc="verify", unit="ckpt", enabled=progress) as bar:
        for start in range(0, count, rows):
            stop = min(count, start + rows)
            try:
                problems = zoo.check_checkpoints(start, stop)
            except ZooFormatError as error:
                report.problems.append(f"checkpoints {start}..{stop - 1} unreadable: {error}")
                bar.update(stop - start)
                continue
            for index, problem in problems:
                if "tensors" in problem:
                    report.digest_mismatches.append(index)
                elif "metadata row" in problem:
                    report.metadata_mismatches.append(index)
                else:
                    report.nonfinite_unflagged.append(index)
            bar.update(stop - start)
    for indices, what in ((report.digest_mismatches, "whose tensors differ from their stored "
                                                     "SHA-256"),
                          (report.metadata_mismatches, "whose metadata rows differ from their "
                                                       "stored SHA-256"),
                          (report.nonfinite_unflagged, "that hold NaN/inf without the diverged "
                                                       "flag")):
        if indices:
            report.problems.append(f"{len(indices)} checkpoint(s) {what} (first: {indices[:5]})")


def _check_records(zoo: Zoo, report: VerifyResult) -> None:
    """Each committed mode's training record against its digest (schema 3 files)."""
    if not zoo.has_training_records:
        report.notes.append("the file stores no training records (schema 1 or 2 file)")
        return
    try:
        report.records = len(zoo.record_rows())
        problems = zoo.check_records()
    except PosteriorZooError as error:
        report.problems.append(f"training records unreadable: {error}")
        return
    report.record_mismatches = [mode for mode, _ in problems]
    if problems:
        mode, problem = problems[0]
        report.problems.append(f"{len(problems)} training record(s) damaged (modes "
                               f"{report.record_mismatches[:5]}; mode {mode}: {problem})")


def _check_row_order(zoo: Zoo, report: VerifyResult) -> None:
    """Whether row i holds mode i's samples: rows in ascending (mode_id, sample_id)."""
    try:
        ordering = collection_row_order(zoo)
    except PosteriorZooError:
        return  # an unreadable metadata table is reported by the digest checks
    report.rows_out_of_order = ordering.out_of_place
    report.first_out_of_order = ordering.first
    if not ordering.in_order:
        report.findings.append(f"{ordering.describe(report.checkpoints)}; `posteriorzoo "
                               "reorder` writes them in order, digests unchanged")
    if ordering.unknown:
        report.notes.append(f"{ordering.unknown} row(s) have no mode_id: their order is "
                            "not checked")


def _check_architecture(zoo: Zoo, report: VerifyResult) -> None:
    """Whether the stored tensors fit the registered architecture (a collection created
    with ``validate=False`` was not checked when it opened)."""
    report.fits_architecture, why = architecture_fit(zoo)
    if report.fits_architecture is None:
        report.notes.append(f"whether the tensors fit architecture {zoo.architecture!r} is "
                            f"not checked: {why}")
    elif not report.fits_architecture:
        report.findings.append(f"the tensors do not fit architecture {zoo.architecture!r} "
                               f"({why}): commands that build the network refuse it")


def _check_manifest(path: Path, report: VerifyResult) -> str | None:
    """Compare the file with a ``SHA256SUMS`` next to it; returns the file's SHA-256 when
    it was computed (so the provenance does not hash the file twice)."""
    manifest = path.parent / MANIFEST_NAME
    if not manifest.is_file():
        return None
    try:
        entries = read_manifest(manifest)
    except ZooFormatError as error:
        report.manifest = "unreadable"
        report.problems.append(str(error))
        return None
    if path.name not in entries:
        report.manifest = "does not list this file"
        return None
    digest = sha256_file(path)
    if digest == entries[path.name]:
        report.manifest = "matches"
    else:
        report.manifest = "MISMATCH"
        report.problems.append(f"file SHA-256 differs from {manifest}")
    return digest


@public
def require_ok(report: VerifyResult) -> VerifyResult:
    """Raise :class:`ChecksumError` with the report's summary unless it is OK."""
    if not report.ok:
        raise ChecksumError(report.summary())
    return report
