"""Publish collection files to a Hub dataset repository in one commit.

Everything that can be checked locally (paths exist, files are HDF5, names do not
collide, the repository id is well formed, a token is there) is checked before the first
network call. The commit always carries a fresh ``SHA256SUMS`` for the uploaded
collections, built in memory: the user's folders are never written to.
:func:`plan_upload` makes the same checks and says what would be sent, sending nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import h5py
from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.utils import validate_repo_id

from posteriorzoo._api import public
from posteriorzoo.errors import HubError, ZooFormatError
from posteriorzoo.hub._errors import (
    find_token,
    handled_errors,
    is_offline,
    no_token_message,
    to_hub_error,
)
from posteriorzoo.hub.plan import TRANSFER, PlannedFile, TransferPlan
from posteriorzoo.zoo.manifest import MANIFEST_NAME, manifest_text, sha256_file

CARD_NAME = "README.md"
COLLECTION_PATTERN = "*.h5"
_OFFLINE_UPLOAD = ("HF_HUB_OFFLINE=1 forbids network access, which an upload needs: "
                   "set HF_HUB_OFFLINE=0 and try again")


@dataclass(frozen=True)
class CollectionFile:
    """A local collection file and its path relative to the upload folder in the repo."""

    local: Path
    name: str


def _checked(path: Path, name: str) -> CollectionFile:
    if not h5py.is_hdf5(path):
        raise ZooFormatError(f"not an HDF5 file (bad signature), refusing to upload: {path}")
    return CollectionFile(local=path, name=name)


@public
def collect_collection_files(paths: Iterable[str | Path]) -> list[CollectionFile]:
    """Expand ``paths`` (files, or folders searched recursively for ``*.h5``).

    A file is stored under its own name, a folder's collections under their paths
    relative to the folder. Raises :class:`ZooFormatError` for a missing path, a folder
    without collections, a file that is not HDF5, or two files with the same name.
    """
    found: list[CollectionFile] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            members = sorted(p for p in path.rglob(COLLECTION_PATTERN) if p.is_file())
            if not members:
                raise ZooFormatError(f"no {COLLECTION_PATTERN} collection files in folder {path}")
            found += [_checked(p, p.relative_to(path).as_posix()) for p in members]
        elif path.is_file():
            found.append(_checked(path, path.name))
        else:
            raise ZooFormatError(f"no such file or folder: {path}")
    if not found:
        raise ZooFormatError("nothing to upload: give at least one collection file or folder")
    names: dict[str, Path] = {}
    for item in found:
        if item.name in (MANIFEST_NAME, CARD_NAME):
            raise ZooFormatError(f"{item.local}: the name {item.name} is reserved in the repo")
        if item.name in names and names[item.name].resolve() != item.local.resolve():
            raise ZooFormatError(
                f"two files would be uploaded as {item.name}: {names[item.name]} and {item.local}"
            )
        names[item.name] = item.local
    return sorted({item.name: item for item in found}.values(), key=lambda item: item.name)


def _folder_in_repo(path_in_repo: str) -> str:
    folder = PurePosixPath(path_in_repo.replace("\\", "/").strip("/"))
    if folder.is_absolute() or ".." in folder.parts:
        raise HubError(f"path_in_repo must be a relative folder without '..': {path_in_repo!r}")
    return "" if str(folder) == "." else f"{folder.as_posix()}/"


def _checked_locally(repo_id: str, paths: str | Path | Iterable[str | Path],
                     revision: str | None, card: str | Path | None, path_in_repo: str,
                     verify: bool) -> tuple[list[CollectionFile], Path | None, str]:
    """Every check of an upload that needs no network: the files (and, with ``verify``,
    their content as collections), the card, the folder and the repository id. Returns
    the files, the card and the repository folder (``""`` or ``"FOLDER/"``)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = collect_collection_files(paths)
    card_path = Path(card) if card is not None else None
    if card_path is not None and not card_path.is_file():
        raise ZooFormatError(f"dataset card not found: {card_path}")
    folder = _folder_in_repo(path_in_repo)
    if verify:
        from posteriorzoo.collection import require_ok
        from posteriorzoo.collection import verify as verify_collection

        for item in files:
            require_ok(verify_collection(item.local))
    try:
        validate_repo_id(repo_id)
    except handled_errors() as error:
        raise to_hub_error(error, repo_id=repo_id, revision=revision, action="upload") from error
    return files, card_path, folder


def _manifest_bytes(files: list[CollectionFile]) -> bytes:
    """The ``SHA256SUMS`` uploaded next to ``files``."""
    return manifest_text({f.name: sha256_file(f.local) for f in files}).encode("utf-8")


@public
def plan_upload(
    repo_id: str,
    paths: str | Path | Iterable[str | Path],
    revision: str | None = None,
    token: str | bool | None = None,
    card: str | Path | None = None,
    path_in_repo: str = "",
    verify: bool = True,
) -> TransferPlan:
    """What :func:`upload` would send, sending nothing and making no network call.

    Makes the upload's local checks (the same errors) and lists the files with their
    paths in the repository and sizes: the collections, their ``SHA256SUMS`` and the
    card. A missing token or ``HF_HUB_OFFLINE=1``, which the upload would refuse, are
    notes of the plan.
    """
    files, card_path, folder = _checked_locally(repo_id, paths, revision, card, path_in_repo,
                                                verify)
    planned = [PlannedFile(folder + f.name, f.local.stat().st_size, TRANSFER) for f in files]
    planned.append(PlannedFile(folder + MANIFEST_NAME, len(_manifest_bytes(files)), TRANSFER))
    if card_path is not None:
        planned.append(PlannedFile(CARD_NAME, card_path.stat().st_size, TRANSFER))
    notes = []
    if is_offline():
        notes.append(_OFFLINE_UPLOAD)
    if not find_token(token):
        notes.append(no_token_message())
    return TransferPlan("upload", repo_id, "dataset", revision or "main", None,
                        f"dataset '{repo_id}'" + (f", folder {folder.rstrip('/')}"
                                                 if folder else ""),
                        planned, notes)


@public
def upload(
    repo_id: str,
    paths: str | Path | Iterable[str | Path],
    revision: str | None = None,
    commit_message: str | None = None,
    private: bool | None = None,
    create_repo: bool = True,
    token: str | bool | None = None,
    card: str | Path | None = None,
    path_in_repo: str = "",
    verify: bool = True,
) -> str:
    """Upload collection files to the dataset repository ``repo_id`` in one commit.

    Args:
        repo_id: ``"owner/name"`` of the dataset repository.
        paths: collection files, or folders whose ``*.h5`` files are uploaded.
        revision: branch to commit to (created from ``main`` if missing; default ``main``).
        commit_message: default ``"Upload N collection file(s) with posteriorzoo"``.
        private: visibility of a newly created repository (``None``: the Hub's default).
        create_repo: create the repository if it does not exist.
        token: Hugging Face token with write access (default: ``HF_TOKEN`` or saved login).
        card: a Markdown file uploaded as the dataset card ``README.md`` at the repo root.
        path_in_repo: folder of the repository to put the collections (and their
            ``SHA256SUMS``) in; default the root.
        verify: run :func:`posteriorzoo.collection.verify` on every file first, so that
            nothing corrupt (or not a collection) is published.

    Returns:
        The URL of the commit (or its id if the Hub gave no URL).

    Raises:
        ZooFormatError: a path is missing or not HDF5 (or, with ``verify``, not a
            collection), or the card is missing.
        ChecksumError: with ``verify``, a collection fails verification.
        HubError: the repository id is malformed, there is no token (``HF_TOKEN`` or a
            saved login), the network or the Hub failed, or the token lacks write access
            (the message says what to do).
    """
    files, card_path, folder = _checked_locally(repo_id, paths, revision, card, path_in_repo,
                                                verify)
    if is_offline():
        raise HubError(_OFFLINE_UPLOAD)
    if not find_token(token):
        raise HubError(no_token_message())
    operations = [
        CommitOperationAdd(path_in_repo=folder + f.name, path_or_fileobj=str(f.local))
        for f in files
    ]
    operations.append(
        CommitOperationAdd(path_in_repo=folder + MANIFEST_NAME,
                           path_or_fileobj=_manifest_bytes(files))
    )
    if card_path is not None:
        operations.append(
            CommitOperationAdd(path_in_repo=CARD_NAME, path_or_fileobj=str(card_path))
        )
    message = commit_message or f"Upload {len(files)} collection file(s) with posteriorzoo"
    api = HfApi(token=token)
    try:
        if create_repo:
            api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
        if revision not in (None, "main"):
            api.create_branch(repo_id, branch=revision, repo_type="dataset", exist_ok=True)
        info = api.create_commit(
            repo_id,
            operations,
            commit_message=message,
            repo_type="dataset",
            revision=revision,
        )
    except handled_errors() as error:
        raise to_hub_error(error, repo_id=repo_id, revision=revision, action="upload") from error
    return str(getattr(info, "commit_url", None) or getattr(info, "oid", None) or info)
