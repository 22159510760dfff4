"""A note, in the user's cache, that a collection file was verified: opening it again
costs a ``stat`` and a read of its metadata table instead of hashing every checkpoint.

Hashing every checkpoint on every open (``info``, ``mmd``, ``report``, ...) costs minutes
for a thousand ResNet-18 checkpoints. So when a full check of every committed checkpoint
passes (:meth:`posteriorzoo.zoo.Zoo.verify_all`, ``posteriorzoo verify``), the file's
identity is noted in ``<cache root>/verified/`` (``$POSTERIORZOO_CACHE``, else
``$XDG_CACHE_HOME/posteriorzoo``, else ``~/.cache/posteriorzoo``; never next to the
collection, which stays as it is):

- the file's device, inode, size, modification and status-change times (nanoseconds);
- its committed count and the SHA-256 of its metadata table and row digests (the table
  holds every checkpoint's SHA-256).

A later open that finds all of these unchanged trusts the committed checkpoints without
hashing them; anything different (any write to the file changes its times; ``touch``
or ``os.utime`` putting the modification time back still changes the status-change
time) means a full check, as before.

What the cheap check does not see: a change that leaves both times as they were, which
takes changing the system clock (root) or writing to the disk device beneath the file
system, or the disk's own silent corruption (bit rot) of a file no one wrote to; and a
forged note (anyone who can write your cache can write one). ``posteriorzoo verify``
always hashes everything, and so does an open with ``$POSTERIORZOO_VERIFY_RECORDS=0``,
which also writes no notes.

A note is written only when the file's last change is :data:`RACY_SECONDS` older than the
moment the check started: a file system stores times at a coarse granularity, so a write
right after a check could leave the times it noted unchanged (git's "racy" entries).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

#: Set to ``0`` to neither trust nor write notes (every open then hashes everything).
RECORDS_VARIABLE = "POSTERIORZOO_VERIFY_RECORDS"
#: A file changed less than this long before its check started is not noted.
RACY_SECONDS = 2.0
#: Notes kept; writing one more removes the oldest (each is about 400 bytes).
MAX_NOTES = 2000
_VERSION = 1
_FIELDS = ("st_dev", "st_ino", "st_size", "st_mtime_ns", "st_ctime_ns")


def enabled() -> bool:
    """Whether notes are used (``$POSTERIORZOO_VERIFY_RECORDS`` is not ``0``)."""
    return os.environ.get(RECORDS_VARIABLE, "").strip() != "0"


def records_folder() -> Path:
    """Where the notes are kept: ``<cache root>/verified``."""
    from posteriorzoo.data.download import cache_root

    return cache_root() / "verified"


def identity(path: Path) -> dict[str, int] | None:
    """What any write to the file changes: device, inode, size and both times."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return {name: int(getattr(status, name)) for name in _FIELDS}


def snapshot(path: Path) -> tuple[dict[str, int] | None, int]:
    """The file's :func:`identity` and the time it was taken, before a check starts."""
    return identity(path), time.time_ns()


def content_digest(metadata: np.ndarray, row_digests: np.ndarray | None) -> str:
    """SHA-256 of the committed metadata rows (which hold the checkpoints' digests) and
    their row digests, as stored."""
    digest = hashlib.sha256(f"{len(metadata)}\0".encode())
    digest.update(np.ascontiguousarray(metadata).tobytes())
    if row_digests is not None:
        digest.update(np.ascontiguousarray(row_digests).tobytes())
    return digest.hexdigest()


def _note_path(path: Path) -> Path:
    key = hashlib.sha256(os.fsencode(os.path.realpath(path))).hexdigest()[:40]
    return records_folder() / f"{key}.json"


def _note(path: Path, seen: dict[str, int], rows: int, digest: str) -> dict[str, Any]:
    return {"version": _VERSION, "path": os.fsdecode(os.path.realpath(path)),
            "identity": seen, "rows": rows, "content_sha256": digest}


def recorded(path: Path, seen: dict[str, int] | None, rows: int, digest: str) -> bool:
    """Whether a note says the file, as ``seen`` now with ``rows`` committed rows whose
    metadata hash to ``digest``, was verified."""
    if seen is None or not enabled():
        return False
    try:
        text = _note_path(path).read_text(encoding="utf-8")
        note = json.loads(text)
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return note == _note(path, seen, rows, digest)


def remember(path: Path, seen: tuple[dict[str, int] | None, int], rows: int,
             digest: str) -> bool:
    """Note that the file, as :func:`snapshot` ``seen`` it when its check started, was
    verified through ``rows`` rows whose metadata hash to ``digest``; only when it has
    not changed since, nor just before (:data:`RACY_SECONDS`). Returns whether a note was
    written. A cache that cannot be written is no error: the next open checks all."""
    status, started = seen
    if status is None or not enabled() or identity(path) != status:
        return False
    if started - max(status["st_mtime_ns"], status["st_ctime_ns"]) < RACY_SECONDS * 1e9:
        return False
    target = _note_path(path)
    text = json.dumps(_note(path, status, rows, digest), sort_keys=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, target)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink()
        return False
    _evict(target.parent)
    return True


def _evict(folder: Path) -> None:
    """Keep the newest :data:`MAX_NOTES` notes (another process may remove some meanwhile)."""
    notes = []
    for note in folder.glob("*.json"):
        with contextlib.suppress(OSError):
            notes.append((note.stat().st_mtime_ns, note))
    for _, note in sorted(notes)[:max(0, len(notes) - MAX_NOTES)]:
        with contextlib.suppress(OSError):
            note.unlink()


def forget(path: Path) -> None:
    """Remove the note of a file found damaged (it could only be a stale or forged one)."""
    if enabled():
        with contextlib.suppress(OSError):
            _note_path(path).unlink()
