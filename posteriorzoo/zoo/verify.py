"""Integrity checks of a collection: structure, architecture, per-checkpoint digests."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from posteriorzoo.errors import ChecksumError, PosteriorZooError, ZooFormatError
from posteriorzoo.zoo.lifecycle import check_architecture, open_zoo
from posteriorzoo.zoo.manifest import MANIFEST_NAME, read_manifest, sha256_file
from posteriorzoo.zoo.schema import checkpoint_digest
from posteriorzoo.zoo.store import Zoo

#: Checkpoints read at once while verifying, so memory stays bounded for large models.
_BYTES_PER_BLOCK = 1 << 28


@dataclass
class VerifyReport:
    """What :func:`verify_zoo` found. ``ok`` is True when ``problems`` is empty."""

    path: Path
    checkpoints: int = 0
    digest_mismatches: list[int] = field(default_factory=list)
    nonfinite_unflagged: list[int] = field(default_factory=list)
    manifest: str = "absent"
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """One line: the verdict and the counts behind it."""
        if self.ok:
            return (f"{self.path}: OK, {self.checkpoints} checkpoints verified "
                    f"(digests match; manifest {self.manifest})")
        return f"{self.path}: CORRUPT: " + "; ".join(self.problems)


def _block_rows(zoo: Zoo) -> int:
    per_checkpoint = sum(int(np.prod(s)) * zoo.dtypes[k].itemsize for k, s in zoo.shapes.items())
    return max(1, _BYTES_PER_BLOCK // max(1, per_checkpoint))


def verify_zoo(path: str | Path, progress: bool = False) -> VerifyReport:
    """Check a collection file end to end.

    Checks that it opens as a collection, that its tensors fit its architecture (when
    the architecture is registered), that each checkpoint's SHA-256 equals the digest
    stored when it was written, that non-finite weights only occur in checkpoints flagged
    ``diverged``, and, if a ``SHA256SUMS`` next to the file lists it, the whole file's
    digest. Never raises for corruption it can describe: see ``VerifyReport.problems``.
    Raises :class:`ZooFormatError` when the file cannot be opened as a collection at all.
    """
    path = Path(path)
    report = VerifyReport(path=path)
    with open_zoo(path) as zoo:
        report.checkpoints = len(zoo)
        if zoo._file.attrs.get("validated", True):
            try:
                spec = zoo.spec
                check_architecture(zoo.architecture, spec, zoo.num_classes, zoo.model_options)
            except PosteriorZooError as error:
                report.problems.append(f"does not fit architecture {zoo.architecture}: {error}")
        _check_digests(zoo, report, progress)
    _check_manifest(path, report)
    return report


def _check_digests(zoo: Zoo, report: VerifyReport, progress: bool) -> None:
    from tqdm.auto import tqdm

    metadata = zoo.metadata
    keys = zoo.state_keys
    rows = _block_rows(zoo)
    count = len(zoo)
    bar = tqdm(total=count, desc="verify", unit="ckpt", disable=not progress)
    try:
        for start in range(0, count, rows):
            stop = min(count, start + rows)
            try:
                block = {key: zoo.dataset_handle(key)[start:stop] for key in keys}
            except OSError as error:
                report.problems.append(f"checkpoints {start}..{stop - 1} unreadable: {error}")
                bar.update(stop - start)
                continue
            for offset in range(stop - start):
                index = start + offset
                arrays = {key: block[key][offset] for key in keys}
                stored = bytes(metadata["sha256"][index]).decode()
                if checkpoint_digest(arrays, keys) != stored:
                    report.digest_mismatches.append(index)
                finite = all(np.isfinite(a).all() for a in arrays.values() if a.dtype.kind == "f")
                if not finite and not metadata["diverged"][index]:
                    report.nonfinite_unflagged.append(index)
            bar.update(stop - start)
    finally:
        bar.close()
    if report.digest_mismatches:
        shown = report.digest_mismatches[:5]
        report.problems.append(
            f"{len(report.digest_mismatches)} checkpoint(s) differ from their stored SHA-256 "
            f"(first: {shown})")
    if report.nonfinite_unflagged:
        report.problems.append(
            f"{len(report.nonfinite_unflagged)} checkpoint(s) hold NaN/inf without the "
            f"diverged flag (first: {report.nonfinite_unflagged[:5]})")


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
