"""Download a published zoo (a Hub dataset repository) and verify it.

The transfer itself is :func:`huggingface_hub.snapshot_download`: files land in the
standard Hugging Face cache (``HF_HUB_CACHE``, shared with every other tool) unless a
``local_dir`` is given, downloads into the cache resume, and with ``HF_HUB_OFFLINE=1``
only the cache is used, without any network access.

A ``local_dir`` follows :mod:`posteriorzoo.outputs`: the files are fetched into a
temporary folder next to it, verified there against the ``SHA256SUMS`` manifests, and
only then published into ``local_dir`` (the manifests last). A file already there is
kept when it is identical, refused when it differs (unless ``overwrite``): checked
against the repository's file list before anything is transferred when the Hub can be
asked, and against the fetched bytes before anything is published in any case.

:func:`plan_download` says what a download would fetch (files, sizes, the commit its
revision resolves to) from the repository's file list alone, fetching no file.
"""

from __future__ import annotations

import dataclasses
import filecmp
import hashlib
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath

from huggingface_hub import HfApi, constants, snapshot_download, try_to_load_from_cache

from posteriorzoo._api import public
from posteriorzoo.errors import HubError, InvalidOptionError, OutputExistsError
from posteriorzoo.hashing import sha256_file
from posteriorzoo.hub._errors import handled_errors, is_offline, to_hub_error
from posteriorzoo.hub.plan import (
    CACHED,
    FROM_CACHE,
    IDENTICAL,
    REFUSED,
    REPLACED,
    TRANSFER,
    PlannedFile,
    TransferPlan,
)
from posteriorzoo.hub.verify import (
    MANIFEST_PATTERNS,
    VerificationReport,
    check_snapshot,
    is_safe_name,
    matching,
    normalize_patterns,
    snapshot_files,
    verify_snapshot,
)
from posteriorzoo.outputs import new_partial, publish
from posteriorzoo.zoo.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES

REPO_TYPES = ("dataset", "model")
#: Seconds to wait for the Hub's answer about each file (huggingface_hub's, env-configurable).
ETAG_TIMEOUT = float(getattr(constants, "HF_HUB_ETAG_TIMEOUT", 10))
#: huggingface_hub's bookkeeping inside a ``local_dir``; never published.
_BOOKKEEPING = ".cache"


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
    overwrite: bool = False,
) -> Path:
    """Download (or find in the cache) a snapshot of ``repo_id`` and return its folder.

    Args:
        repo_id: ``"owner/name"`` of the Hub repository.
        revision: branch, tag or commit hash to pin (default: the main branch).
        include: glob pattern(s) of the files to fetch, e.g. ``"mlp/*.h5"`` (default: all).
            The ``SHA256SUMS`` manifests are always fetched too.
        local_dir: put the files into this folder instead of the Hugging Face cache. It
            may exist (other files in it are left alone); if not, its parent folder must.
            The files are fetched and verified under a temporary name next to it first,
            so nothing that fails verification appears in it.
        cache_dir: Hugging Face cache to use (default: ``HF_HUB_CACHE``); with
            ``local_dir`` it is only read, when offline.
        repo_type: ``"dataset"`` (zoos are published as datasets) or ``"model"``.
        token: Hugging Face token (default: ``HF_TOKEN`` or the saved login).
        verify: check the fetched files listed in the manifests against their SHA-256
            digests; a snapshot without any manifest is then an error.
        overwrite: replace files of ``local_dir`` that differ from the repository's
            (identical ones are kept in any case).

    Raises:
        HubError: the repository, revision or network is unavailable, the repository
            lists an unusable file name, or no file matches ``include`` (the message
            says what to do); or its file list, when asked for it before the transfer
            (into a ``local_dir`` holding files), lists a ``SHA256SUMS`` larger than a
            manifest may be (:data:`~posteriorzoo.zoo.manifest.MAX_MANIFEST_BYTES`).
        ChecksumError: a file is corrupt, missing, or there is no manifest.
        ZooFormatError: a fetched manifest is malformed, or larger than a manifest may be
            (refused without being read whole).
        OutputExistsError: a file of ``local_dir`` differs from the repository's and
            ``overwrite`` is False.
        InvalidOptionError: ``local_dir`` is a file, or its parent folder is missing.
    """
    path, _ = fetch(repo_id, revision, include, local_dir, cache_dir, repo_type, token,
                    verify, overwrite)
    return path


def fetch(
    repo_id: str,
    revision: str | None = None,
    include: str | Iterable[str] | None = None,
    local_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    repo_type: str = "dataset",
    token: str | bool | None = None,
    verify: bool = True,
    overwrite: bool = False,
) -> tuple[Path, VerificationReport | None]:
    """:func:`download`, also returning what was verified (``None`` without ``verify``)."""
    if repo_type not in REPO_TYPES:
        raise HubError(f"repo_type must be one of {', '.join(REPO_TYPES)}, not {repo_type!r}")
    patterns = normalize_patterns(include)
    if local_dir is not None:
        return _fetch_into(Path(local_dir), repo_id, revision, patterns, cache_dir, repo_type,
                           token, verify, overwrite)
    path = _snapshot(repo_id, revision, patterns, repo_type, token, cache_dir=cache_dir)
    _require_match(path, patterns, repo_id, repo_type)
    return path, verify_snapshot(path, patterns) if verify else None


def _snapshot(repo_id: str, revision: str | None, patterns: list[str] | None, repo_type: str,
              token: str | bool | None, *, cache_dir: str | Path | None = None,
              local_dir: Path | None = None, offline: bool | None = None) -> Path:
    """huggingface_hub's snapshot download, its errors as one-line HubErrors."""
    try:
        folder = snapshot_download(
            repo_id=repo_id,
            repo_type=repo_type,
            revision=revision,
            cache_dir=cache_dir,
            local_dir=local_dir,
            token=token,
            allow_patterns=allow_patterns(patterns),
            local_files_only=is_offline() if offline is None else offline,
            etag_timeout=ETAG_TIMEOUT,
        )
    except handled_errors() as error:
        raise to_hub_error(
            error, repo_id=repo_id, revision=revision, repo_type=repo_type
        ) from error
    return Path(folder)


def _require_match(path: Path, patterns: list[str] | None, repo_id: str,
                   repo_type: str) -> None:
    if patterns is not None and not matching(snapshot_files(path), patterns):
        raise HubError(
            f"no file of {repo_type} '{repo_id}' matches {' '.join(patterns)}: "
            "check the include patterns against the repository's file list"
        )


# ---------------------------------------------------------------------- dry run
@public
def plan_download(
    repo_id: str,
    revision: str | None = None,
    include: str | Iterable[str] | None = None,
    local_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    repo_type: str = "dataset",
    token: str | bool | None = None,
    overwrite: bool = False,
) -> TransferPlan:
    """What :func:`download` would fetch, fetching no file.

    The Hub is asked for the commit ``revision`` resolves to and the repository's file
    list (sizes included); each selected file (the ``SHA256SUMS`` manifests always are)
    is marked ``transfer``, ``cached`` (already in the Hugging Face cache), or, with
    ``local_dir``, ``identical``, ``replace`` (``overwrite``) or ``refused`` (a different
    file is there). With ``HF_HUB_OFFLINE=1`` the cached snapshot is listed instead
    (``from cache`` into a folder, else ``cached``), with no network access.

    Raises the errors :func:`download` raises before its transfer (HubError for an
    unknown repository or revision, no network, no matching file; InvalidOptionError for
    a bad ``local_dir``); a file of ``local_dir`` that differs is a ``refused`` entry,
    not an error.
    """
    if repo_type not in REPO_TYPES:
        raise HubError(f"repo_type must be one of {', '.join(REPO_TYPES)}, not {repo_type!r}")
    patterns = normalize_patterns(include)
    out = Path(local_dir) if local_dir is not None else None
    if out is not None:
        _check_folder(out)
    if is_offline():
        sizes, commit = _cached_files(repo_id, revision, patterns, cache_dir, repo_type, token)
        fresh = FROM_CACHE if out is not None else CACHED
    else:
        sizes, commit = _listed_files(repo_id, revision, patterns, repo_type, token)
        fresh = TRANSFER
    files = []
    for name, (size, entry) in sizes.items():
        action = fresh
        target = out / name if out is not None else None
        if target is not None and target.is_file():
            if isinstance(entry, Path):  # offline: compare with the cached copy's bytes
                same = filecmp.cmp(entry, target, shallow=False)
            else:
                same = _same_as_listed(target, entry)
            action = IDENTICAL if same else REPLACED if overwrite else REFUSED
        elif target is None and fresh == TRANSFER and isinstance(try_to_load_from_cache(
                repo_id, name, cache_dir=cache_dir, revision=commit, repo_type=repo_type),
                str):
            action = CACHED
        files.append(PlannedFile(name, size, action))
    destination = str(out) if out is not None else \
        f"the Hugging Face cache ({cache_dir or constants.HF_HUB_CACHE})"
    notes = []
    if any(item.action == REFUSED for item in files):
        notes.append(f"files marked refused differ from the repository's: {out} keeps them "
                     "and the download stops, unless --overwrite")
    return TransferPlan("download", repo_id, repo_type, revision or "main", commit,
                        destination, files, notes)


def _listed_files(repo_id: str, revision: str | None, patterns: list[str] | None,
                  repo_type: str, token: str | bool | None
                  ) -> tuple[dict[str, tuple[int | None, object]], str | None]:
    """``({name: (size, tree entry)}, commit)`` of the selected files, from the Hub's
    repository information and file list (no file is fetched)."""
    api = HfApi(token=token)
    try:
        commit = getattr(api.repo_info(repo_id, revision=revision or constants.DEFAULT_REVISION,
                                       repo_type=repo_type), "sha", None)
        entries = {entry.path: entry for entry in api.list_repo_tree(
            repo_id, recursive=True, revision=commit or revision, repo_type=repo_type)
            if hasattr(entry, "blob_id")}
    except handled_errors() as error:
        raise to_hub_error(error, repo_id=repo_id, revision=revision,
                           repo_type=repo_type) from error
    selected = matching(entries, allow_patterns(patterns))
    unsafe = [name for name in selected if not is_safe_name(name)]
    if unsafe:
        raise HubError(f"{repo_type} '{repo_id}' lists a file outside its folder, "
                       f"{unsafe[0]!r}: ask the repository owner to rename it")
    if patterns is not None and not matching(selected, patterns):
        raise HubError(f"no file of {repo_type} '{repo_id}' matches {' '.join(patterns)}: "
                       "check the include patterns against the repository's file list")
    sizes = {name: _listed_size(entries[name]) for name in selected}
    _check_manifest_sizes(sizes, repo_id, repo_type)
    return {name: (sizes[name], entries[name]) for name in selected}, commit


def _listed_size(entry: object) -> int | None:
    """The size in bytes the Hub's tree ``entry`` gives its file (None: none given)."""
    lfs = getattr(entry, "lfs", None)
    value = getattr(lfs, "size", None) if lfs is not None else getattr(entry, "size", None)
    return value if isinstance(value, int) else None


def _check_manifest_sizes(sizes: Mapping[str, int | None], repo_id: str,
                          repo_type: str) -> None:
    """Refuse, before it is fetched, a ``SHA256SUMS`` the Hub lists as larger than a
    manifest may be (:data:`~posteriorzoo.zoo.manifest.MAX_MANIFEST_BYTES`: reading it
    would refuse it anyway, after the transfer)."""
    for name, size in sizes.items():
        if PurePosixPath(name).name == MANIFEST_NAME and size is not None \
                and size > MAX_MANIFEST_BYTES:
            raise HubError(f"{repo_type} '{repo_id}' lists {name} of {size:,} bytes, over "
                           f"the limit of {MAX_MANIFEST_BYTES:,} for a manifest (one short "
                           "line per file), so it is not fetched: ask the repository owner "
                           "to check it")


def _cached_files(repo_id: str, revision: str | None, patterns: list[str] | None,
                  cache_dir: str | Path | None, repo_type: str, token: str | bool | None
                  ) -> tuple[dict[str, tuple[int | None, object]], str | None]:
    """Offline: ``({name: (size, cached copy)}, commit)`` of the selected files of the
    cached snapshot."""
    cached = _snapshot(repo_id, revision, patterns, repo_type, token, cache_dir=cache_dir,
                       offline=True)
    _require_match(cached, patterns, repo_id, repo_type)
    names = matching(snapshot_files(cached), allow_patterns(patterns))
    return {name: ((cached / name).stat().st_size, cached / name) for name in names}, \
        cached.name


# ---------------------------------------------------------------------- into a folder
def _check_folder(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise InvalidOptionError(f"{out} is a file; the download needs a folder")
    if not out.exists() and not out.parent.is_dir():
        raise InvalidOptionError(f"{out}: the folder {out.parent} does not exist")


def _git_blob_id(path: Path) -> str:
    """The git object id of ``path``'s bytes (what the Hub lists for a non-LFS file)."""
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size, usedforsecurity=False)
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _same_as_listed(path: Path, entry: object) -> bool:
    """Whether the local file ``path`` has the bytes of the Hub's tree ``entry``: the
    SHA-256 of an LFS file, the git blob id of any other."""
    size = path.stat().st_size
    lfs = getattr(entry, "lfs", None)
    if lfs is not None:
        return size == lfs.size and sha256_file(path) == lfs.sha256
    return size == getattr(entry, "size", None) and \
        _git_blob_id(path) == getattr(entry, "blob_id", None)


def _conflict(out: Path, name: str) -> OutputExistsError:
    return OutputExistsError(
        f"{out / name} already exists and differs from the repository's {name}; "
        "it is replaced only when overwriting is asked for (--overwrite)")


def _precheck(out: Path, repo_id: str, revision: str | None, patterns: list[str] | None,
              repo_type: str, token: str | bool | None, overwrite: bool) -> None:
    """Refuse, before any transfer, a file of ``out`` that differs from the repository's,
    and a manifest the file list says is too large to be read.

    Asks the Hub for the repository's file list; when that fails, the download itself
    reports why, the fetched bytes are compared before anything is published, and a
    manifest is bounded when it is read.
    """
    if overwrite or is_offline() or not out.is_dir() or not any(out.iterdir()):
        return
    try:
        entries = {entry.path: entry for entry in HfApi(token=token).list_repo_tree(
            repo_id, recursive=True, revision=revision, repo_type=repo_type)
            if hasattr(entry, "blob_id")}
    except handled_errors():
        return
    selected = matching(entries, allow_patterns(patterns))
    _check_manifest_sizes({name: _listed_size(entries[name]) for name in selected}, repo_id,
                          repo_type)
    for name in selected:
        if not is_safe_name(name):
            raise HubError(f"{repo_type} '{repo_id}' lists a file outside its folder, "
                           f"{name!r}: ask the repository owner to rename it")
        target = out / name
        if target.is_file() and not _same_as_listed(target, entries[name]):
            raise _conflict(out, name)


def _copy_from_cache(staging: Path, repo_id: str, revision: str | None,
                     patterns: list[str] | None, cache_dir: str | Path | None, repo_type: str,
                     token: str | bool | None) -> None:
    """Offline: the selected files of the cached snapshot, copied into ``staging``."""
    cached = _snapshot(repo_id, revision, patterns, repo_type, token, cache_dir=cache_dir,
                       offline=True)
    for name in matching(snapshot_files(cached), allow_patterns(patterns)):
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(cached / name, staging / name)


def _publish_order(names: list[str]) -> list[str]:
    """Data files first, the manifests that vouch for them last."""
    return sorted(names, key=lambda name: (PurePosixPath(name).name == MANIFEST_NAME, name))


def _fetch_into(out: Path, repo_id: str, revision: str | None, patterns: list[str] | None,
                cache_dir: str | Path | None, repo_type: str, token: str | bool | None,
                verify: bool, overwrite: bool) -> tuple[Path, VerificationReport | None]:
    """Fetch into a temporary folder next to ``out``, verify, then publish into ``out``."""
    _check_folder(out)
    _precheck(out, repo_id, revision, patterns, repo_type, token, overwrite)
    staging, lock = new_partial(out, directory=True)
    try:
        if is_offline():
            _copy_from_cache(staging, repo_id, revision, patterns, cache_dir, repo_type, token)
        else:
            _snapshot(repo_id, revision, patterns, repo_type, token, local_dir=staging,
                      offline=False)
        shutil.rmtree(staging / _BOOKKEEPING, ignore_errors=True)
        _require_match(staging, patterns, repo_id, repo_type)
        report = check_snapshot(staging, patterns, shown_as=out) if verify else None
        names = snapshot_files(staging)
        fresh: list[str] = []
        for name in names:
            target = out / name
            if target.is_dir() or any(parent.is_file() for parent in target.parents
                                      if parent.is_relative_to(out) and parent != out):
                raise InvalidOptionError(f"{target}: a folder or file of that name is in the "
                                         f"way of the repository's {name}")
            if target.exists() and filecmp.cmp(staging / name, target, shallow=False):
                continue  # already there, identical
            if target.exists() and not overwrite:
                raise _conflict(out, name)
            fresh.append(name)
        if not out.exists():
            publish(staging, out, overwrite=False)
        else:
            for name in _publish_order(fresh):
                (out / name).parent.mkdir(parents=True, exist_ok=True)
                publish(staging / name, out / name, overwrite=overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        os.close(lock)
    if report is not None:
        report = dataclasses.replace(report, directory=out)
    return out, report
