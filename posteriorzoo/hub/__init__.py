"""Hugging Face Hub transfer of zoos: published as *dataset* repositories of ``*.h5`` files.

- :func:`download`: fetch a snapshot (or a subset) into the Hugging Face cache, pinned to
  a revision, works offline from the cache (``HF_HUB_OFFLINE=1``), verified against the
  repository's ``SHA256SUMS``.
- :func:`upload`: publish collection files in one commit, with a fresh ``SHA256SUMS``
  and optionally a dataset card.
- :func:`verify_snapshot`: check a downloaded folder against its manifests.
- :func:`plan_download`, :func:`plan_upload`: what a transfer would move (files, sizes,
  revision), moving nothing (``--dry-run``).

Every failure is a :class:`~posteriorzoo.errors.PosteriorZooError` (``HubError``,
``ChecksumError``, ``ZooFormatError``) whose message says what to do.
"""

from posteriorzoo.hub.fetch import download, plan_download
from posteriorzoo.hub.plan import PlannedFile, TransferPlan
from posteriorzoo.hub.publish import collect_collection_files, plan_upload, upload
from posteriorzoo.hub.verify import VerificationReport, verify_snapshot

__all__ = [
    "PlannedFile",
    "TransferPlan",
    "VerificationReport",
    "collect_collection_files",
    "download",
    "plan_download",
    "plan_upload",
    "upload",
    "verify_snapshot",
]
