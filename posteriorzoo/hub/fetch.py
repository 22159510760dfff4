"""Download a published zoo (a Hub dataset repository) and verify it.

The transfer itself is :func:`huggingface_hub.snapshot_download`: files land in the
standard Hugging Face cache (``HF_HUB_CACHE``, shared with every other tool) unless a
``local_dir`` is given, downloads resume, and with ``HF_HUB_OFFLINE=1`` only the cache is
used, without any network access.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from huggingface_hub import constants, snapshot_download

from posteriorzoo._api import public
from posteriorzoo.errors import HubError
from posteriorzoo.hub._errors import handled_errors, is_offline, to_hub_error
from posteriorzoo.hub.verify import (
    MANIFEST_PATTERNS,
    matching,
    normalize_patterns,
    snapshot_files,
    verify_snapshot,
)

REPO_TYPES = ("dataset", "model")
#: Seconds to wait for the Hub's answer about each file (huggingface_hub's, env-configurable).
ETAG_TIMEOUT = float(getattr(constants, "HF_HUB_ETAG_TIMEOUT", 10))


def allow_patterns(include: str | Iterable[str] | None) -> list[str] | None:
    """The ``allow_patterns`` for ``include``: the patterns plus every ``SHA256SUMS``.

    ``None`` (download everything) stays ``None``.
    """
    patterns = normalize_patterns(include)
    if patterns is None:
        return None
    return patterns + [pattern for pattern in MANIFEST_PATTERNS if pattern not in patterns]


@public
def download(
    repo_id: str,
    revision: str | None = None,
    include: str | Iterable[str] | None = None,
    local_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    repo_type: str = "dataset",
    token: str | bool | None = None,
    verify: bool = True,
) -> Path:
    """Download (or find in the cache) a snapshot of ``repo_id`` and return its folder.

    Args:
        repo_id: ``"owner/name"`` of the Hub repository.
        revision: branch, tag or commit hash to pin (default: the main branch).
        include: glob pattern(s) of the files to fetch, e.g. ``"mlp/*.h5"`` (default: all).
            The ``SHA256SUMS`` manifests are always fetched too.
        local_dir: copy the files into this folder instead of the Hugging Face cache.
        cache_dir: Hugging Face cache to use (default: ``HF_HUB_CACHE``).
        repo_type: ``"dataset"`` (zoos are published as datasets) or ``"model"``.
        token: Hugging Face token (default: ``HF_TOKEN`` or the saved login).
        verify: check the fetched files listed in the manifests against their SHA-256
            digests; a snapshot without any manifest is then an error.

    Raises:
        HubError: the repository, revision or network is unavailable (the message says
            what to do), or no file matches ``include``.
        ChecksumError: a file is corrupt, missing, or there is no manifest.
    """
    if repo_type not in REPO_TYPES:
        raise HubError(f"repo_type must be one of {', '.join(REPO_TYPES)}, not {repo_type!r}")
    patterns = normalize_patterns(include)
    try:
        folder = snapshot_download(
            repo_id=repo_id,
            repo_type=repo_type,
            revision=revision,
            cache_dir=cache_dir,
            local_dir=local_dir,
            token=token,
            allow_patterns=allow_patterns(patterns),
            local_files_only=is_offline(),
            etag_timeout=ETAG_TIMEOUT,
        )
    except handled_errors() as error:
        raise to_hub_error(
            error, repo_id=repo_id, revision=revision, repo_type=repo_type
        ) from error
    path = Path(folder)
    if patterns is not None and not matching(snapshot_files(path), patterns):
        raise HubError(
            f"no file of {repo_type} '{repo_id}' matches {' '.join(patterns)}: "
            "check the include patterns against the repository's file list"
        )
    if verify:
        verify_snapshot(path, patterns)
    return path
