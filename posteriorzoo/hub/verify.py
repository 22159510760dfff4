"""Check a downloaded snapshot against the ``SHA256SUMS`` manifests it contains.

Every folder of a published repository may hold a ``SHA256SUMS`` (see
:mod:`posteriorzoo.zoo.manifest`) listing files of that folder and below, by paths
relative to it; :func:`posteriorzoo.hub.upload` writes one next to the collections it
uploads. Only files that are present and selected by the include patterns are checked,
so a partial download verifies what it fetched.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from huggingface_hub.utils import filter_repo_objects

from posteriorzoo._api import public
from posteriorzoo.errors import ChecksumError, ZooFormatError
from posteriorzoo.zoo.manifest import MANIFEST_NAME, read_manifest, verify_manifest

#: Patterns that select every manifest of a repository (root and sub-folders).
MANIFEST_PATTERNS = (MANIFEST_NAME, f"*/{MANIFEST_NAME}")


@dataclass(frozen=True)
class VerificationReport:
    """What :func:`verify_snapshot` checked, by paths relative to the snapshot folder."""

    directory: Path
    manifests: tuple[str, ...]
    verified: tuple[str, ...]
    unverified: tuple[str, ...]
    """Selected files present in the folder that no manifest lists (not checked)."""


def normalize_patterns(include: str | Iterable[str] | None) -> list[str] | None:
    """``None`` (everything) or a list of glob patterns, as huggingface_hub matches them."""
    if include is None:
        return None
    patterns = [include] if isinstance(include, str) else list(include)
    return [pattern for pattern in patterns if pattern] or None


def matching(names: Iterable[str], include: list[str] | None) -> list[str]:
    """The ``names`` that ``include`` selects (all if ``include`` is None), sorted."""
    return sorted(filter_repo_objects(items=list(names), allow_patterns=include))


def snapshot_files(directory: str | Path) -> list[str]:
    """Files under ``directory`` as POSIX relative paths, skipping hidden files and folders.

    Hidden entries are huggingface_hub's bookkeeping (``.cache/``) and git metadata
    (``.gitattributes``), not data.
    """
    directory = Path(directory)
    names = []
    for path in directory.rglob("*"):
        relative = path.relative_to(directory)
        if any(part.startswith(".") for part in relative.parts) or not path.is_file():
            continue
        names.append(relative.as_posix())
    return sorted(names)


def is_safe_name(name: str) -> bool:
    """Whether a repository path stays inside its folder (relative, without ``..``)."""
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts


@public
def verify_snapshot(
    directory: str | Path, include: str | Iterable[str] | None = None
) -> VerificationReport:
    """Verify the files of ``directory`` listed in its manifests and selected by ``include``.

    Raises :class:`ChecksumError` if there is no manifest at all, or naming every
    selected listed file that is missing or whose SHA-256 digest differs; raises
    :class:`~posteriorzoo.errors.ZooFormatError` for a malformed manifest (one that is
    not UTF-8 text, or a line that is not ``<digest>  <name>``).
    """
    return check_snapshot(Path(directory), normalize_patterns(include))


def check_snapshot(directory: Path, patterns: list[str] | None,
                   shown_as: Path | None = None) -> VerificationReport:
    """:func:`verify_snapshot`; messages name ``shown_as`` (default ``directory``), e.g. the
    folder a temporary download is for."""
    shown = directory if shown_as is None else shown_as
    files = snapshot_files(directory)
    manifests = [name for name in files if PurePosixPath(name).name == MANIFEST_NAME]
    if not manifests:
        raise ChecksumError(
            f"no {MANIFEST_NAME} manifest in {shown}, so its files cannot be verified: "
            "use them unverified with verify=False (--no-verify on the command line) "
            "only if you trust the source"
        )
    problems: list[str] = []
    verified: set[str] = set()
    for manifest in manifests:
        folder = PurePosixPath(manifest).parent
        prefix = "" if folder == PurePosixPath(".") else f"{folder.as_posix()}/"
        try:
            listed = read_manifest(directory / manifest)
        except ZooFormatError as error:
            raise ZooFormatError(str(error).replace(str(directory), str(shown))) from None
        unsafe = sorted(name for name in listed if not is_safe_name(name))
        problems += [f"{manifest}: refuses path outside its folder: {name}" for name in unsafe]
        by_repo_path = {prefix + name: name for name in listed if is_safe_name(name)}
        selected = matching(by_repo_path, patterns)
        if not selected:
            continue
        try:
            verify_manifest(directory / folder, [by_repo_path[path] for path in selected])
        except ChecksumError as error:
            problems.append(f"{manifest}: {error}" if prefix else str(error))
        verified.update(selected)
    if problems:
        raise ChecksumError(
            f"verification of {shown} failed: "
            + "; ".join(problems)
            + " (delete the local copy and download again; if it persists, the repository's "
            f"{MANIFEST_NAME} and files disagree)"
        )
    unlisted = [name for name in files if name not in verified and name not in manifests]
    return VerificationReport(
        directory=directory,
        manifests=tuple(manifests),
        verified=tuple(sorted(verified)),
        unverified=tuple(matching(unlisted, patterns)),
    )
