"""SHA-256 manifests of collection files, in the ``sha256sum`` format.

A folder of collections (as published on the Hub) holds a file ``SHA256SUMS`` with one
line ``<hex digest>  <file name>`` per file, so ``sha256sum -c SHA256SUMS`` checks it
too. Inside each collection, every checkpoint also carries its own digest (see
:mod:`posteriorzoo.zoo.store`); the manifest protects whole files in transit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from posteriorzoo._api import public
from posteriorzoo.errors import ChecksumError, ZooFormatError
from posteriorzoo.hashing import sha256_file

MANIFEST_NAME = "SHA256SUMS"


def read_manifest(path: str | Path) -> dict[str, str]:
    """Parse a ``SHA256SUMS`` file into ``{file name: hex digest}``."""
    entries: dict[str, str] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as error:
        raise ZooFormatError(f"manifest not found: {path}") from error
    except UnicodeDecodeError:
        raise ZooFormatError(f"{path}: not a sha256sum manifest (not UTF-8 text)") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        name = name.lstrip("*")
        if not sep or len(digest) != 64 or not name:
            raise ZooFormatError(f"{path}:{number}: not a sha256sum line: {line!r}")
        entries[name] = digest.lower()
    return entries


def manifest_text(entries: Mapping[str, str]) -> str:
    """``SHA256SUMS`` content for ``{file name: hex digest}``: one ``<digest>  <name>``
    line per file, sorted by name (what ``sha256sum -c`` reads)."""
    return "".join(f"{entries[name]}  {name}\n" for name in sorted(entries))


@public
def write_manifest(
    directory: str | Path, names: Iterable[str] | None = None, pattern: str = "*.h5"
) -> Path:
    """Write ``directory/SHA256SUMS`` for ``names`` (default: files matching ``pattern``).

    Names are paths relative to ``directory``. Returns the manifest's path.
    """
    directory = Path(directory)
    if names is None:
        names = [p.relative_to(directory).as_posix() for p in directory.rglob(pattern)]
    names = sorted(set(names) - {MANIFEST_NAME})
    text = manifest_text({name: sha256_file(directory / name) for name in names})
    target = directory / MANIFEST_NAME
    temporary = target.with_name(target.name + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(target)
    return target


@public
def verify_manifest(directory: str | Path, names: Iterable[str] | None = None) -> list[str]:
    """Check files of ``directory`` against its ``SHA256SUMS``.

    Only ``names`` are checked if given (e.g. the files a partial download fetched);
    otherwise every entry. Returns the checked names; raises :class:`ChecksumError`
    naming each missing or mismatching file.
    """
    directory = Path(directory)
    expected = read_manifest(directory / MANIFEST_NAME)
    selected = sorted(expected) if names is None else sorted(names)
    problems = []
    for name in selected:
        if name not in expected:
            problems.append(f"{name}: not listed in {MANIFEST_NAME}")
        elif not (directory / name).is_file():
            problems.append(f"{name}: missing")
        elif sha256_file(directory / name) != expected[name]:
            problems.append(f"{name}: SHA-256 mismatch (corrupt or altered)")
    if problems:
        raise ChecksumError("; ".join(problems))
    return selected
