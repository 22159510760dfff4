"""What a download or an upload would transfer: the answer of ``--dry-run``.

:func:`posteriorzoo.hub.plan_download` and :func:`posteriorzoo.hub.plan_upload` make every
check the transfer would make first and return a :class:`TransferPlan` (the files, their
sizes, the revision) without transferring any file: a download plan asks the Hub only for
the repository's file list, an upload plan makes no network call at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: What would happen to one file.
TRANSFER = "transfer"      # sent or fetched
CACHED = "cached"          # a download: already in the Hugging Face cache, not fetched
IDENTICAL = "identical"    # a download into a folder: already there, the same bytes
REPLACED = "replace"       # a download into a folder with --overwrite: different, replaced
REFUSED = "refused"        # a download into a folder: different, refused without --overwrite
FROM_CACHE = "from cache"  # offline: copied from the Hugging Face cache, no network


@dataclass(frozen=True)
class PlannedFile:
    """One file of a plan: its path in the repository, size in bytes (None: the Hub did
    not say) and what would happen to it (one of the constants of this module)."""

    name: str
    size: int | None
    action: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "action": self.action}


@dataclass
class TransferPlan:
    """What ``download`` or ``upload`` would do; nothing was transferred.

    Attributes
    ----------
    action : str
        ``"download"`` or ``"upload"``.
    repo_id, repo_type : str
    revision : str
        The branch, tag or commit asked for (``main`` when none was).
    commit : str or None
        The commit that revision resolves to (a download; None for an upload, whose
        commit does not exist yet).
    destination : str
        Where the files would go: a folder, the Hugging Face cache, or the repository
        (and its folder).
    files : list of PlannedFile
    notes : list of str
        What the transfer itself would also need or say (a missing token, offline mode).
    """

    action: str
    repo_id: str
    repo_type: str
    revision: str
    commit: str | None
    destination: str
    files: list[PlannedFile] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def moved(self) -> list[PlannedFile]:
        """The files that would cross the network."""
        return [item for item in self.files if item.action in (TRANSFER, REPLACED)]

    @property
    def bytes_to_transfer(self) -> int:
        return sum(item.size or 0 for item in self.moved)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.action, "dry_run": True, "repo_id": self.repo_id,
                "repo_type": self.repo_type, "revision": self.revision,
                "commit": self.commit, "destination": self.destination,
                "files": [item.to_dict() for item in self.files],
                "bytes_to_transfer": self.bytes_to_transfer, "notes": list(self.notes)}

    def lines(self) -> list[str]:
        """The plan as text: a heading, one line per file, the notes."""
        at = f"revision {self.revision}" + (f" (commit {self.commit})"
                                             if self.commit and self.commit != self.revision
                                             else "")
        verb = "download from" if self.action == "download" else "upload to"
        lines = [f"dry run, nothing transferred: would {verb} {self.repo_type} "
                 f"'{self.repo_id}' at {at}, {len(self.moved)} of {len(self.files)} "
                 f"file(s), {self.bytes_to_transfer:,} bytes, "
                 f"{'into' if self.action == 'download' else 'in'} {self.destination}"]
        width = max((len(item.name) for item in self.files), default=0)
        for item in self.files:
            size = "?" if item.size is None else f"{item.size:,}"
            lines.append(f"  {item.action:<10} {item.name:<{width}}  {size:>15} bytes")
        lines += [f"note: {note}" for note in self.notes]
        return lines
