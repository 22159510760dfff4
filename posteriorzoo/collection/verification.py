"""Integrity checks of a collection: structure, architecture, per-checkpoint digests."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import h5py

from posteriorzoo._api import public
from posteriorzoo.errors import ChecksumError, ZooFormatError
from posteriorzoo.zoo.lifecycle import open_zoo
from posteriorzoo.zoo.manifest import MANIFEST_NAME, read_manifest, sha256_file
from posteriorzoo.zoo.store import Zoo


@dataclass
class VerifyReport:
    """What :func:`verify_zoo` found. ``ok`` is True when ``problems`` is empty."""

    path: Path
    checkpoints: int = 0
    digest_mismatches: list[int] = field(default_factory=list)
    nonfinite_unflagged: list[int] = field(default_factory=list)
    metadata_mismatches: list[int] = field(default_factory=list)
    manifest: str = "absent"
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """One line: the verdict and the counts behind it."""
        if self.ok:
            return (f"{self.path}: OK, {self.checkpoints} checkpoints verified "
                    f"(digests match; manifest {self.manifest})")
        return f"{self.path}: CORRUPT: " + "; ".join(self.problems)


@public
def verify_zoo(path: str | Path, progress: bool = False) -> VerifyReport:
    """Check a collection file end to end.

    Checks that it opens as a collection (its layout, :mod:`posteriorzoo.zoo.layout`,
    and that its tensors fit its architecture when it is registered); that every HDF5
    object and attribute can be read (HDF5's own header checksums catch damage to the
    file's structure); that each checkpoint's tensors and metadata row equal the SHA-256
    digests stored when they were written; that non-finite weights only occur in
    checkpoints flagged ``diverged``; and, if a ``SHA256SUMS`` next to the file lists it,
    the whole file's digest. Never raises for corruption it can describe: see
    ``VerifyReport.problems``. Raises :class:`ZooFormatError` when the file cannot be
    opened as a collection at all.
    """
    path = Path(path)
    report = VerifyReport(path=path)
    with open_zoo(path) as zoo:
        report.checkpoints = len(zoo)
        _check_objects(zoo, report)
        if not zoo.has_row_digests:
            report.notes.append("metadata rows are not covered by digests (schema 1 file)")
        _check_digests(zoo, report, progress)
    _check_manifest(path, report)
    return report


def _check_objects(zoo: Zoo, report: VerifyReport) -> None:
    """Read every attribute and every non-state dataset in full."""
    handle = zoo._file

    def visit(name: str, item: object) -> None:
        try:
            for attribute in item.attrs:
                item.attrs[attribute]
            if isinstance(item, h5py.Dataset) and not name.startswith("state/"):
                item[()]
        except (OSError, RuntimeError, KeyError, ValueError, TypeError) as error:
            report.problems.append(f"/{name} unreadable: {error}")

    try:
        for attribute in handle.attrs:
            handle.attrs[attribute]
        handle.visititems(visit)
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as error:
        report.problems.append(f"the file's structure is unreadable: {error}")


def _check_digests(zoo: Zoo, report: VerifyReport, progress: bool) -> None:
    from tqdm.auto import tqdm

    rows = zoo.block_rows()
    count = len(zoo)
    with tqdm(total=count, desc="verify", unit="ckpt", disable=not progress) as bar:
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


def _check_manifest(path: Path, report: VerifyReport) -> None:
    manifest = path.parent / MANIFEST_NAME
    if not manifest.is_file():
        return
    try:
        entries = read_manifest(manifest)
    except ZooFormatError as error:
        report.manifest = "unreadable"
        report.problems.append(str(error))
        return
    if path.name not in entries:
        report.manifest = "does not list this file"
        return
    if sha256_file(path) == entries[path.name]:
        report.manifest = "matches"
    else:
        report.manifest = "MISMATCH"
        report.problems.append(f"file SHA-256 differs from {manifest}")


def require_ok(report: VerifyReport) -> VerifyReport:
    """Raise :class:`ChecksumError` with the report's summary unless it is OK."""
    if not report.ok:
        raise ChecksumError(report.summary())
    return report
