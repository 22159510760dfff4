"""SHA-256 manifests of collection files, in the ``sha256sum`` format.

A folder of collections (as published on the Hub) holds a file ``SHA256SUMS`` with one
line ``<hex digest>  <file name>`` per file, so ``sha256sum -c SHA256SUMS`` checks it
too. Inside each collection, every checkpoint also carries its own digest (see
:mod:`posteriorzoo.zoo.store`); the manifest protects whole files in transit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from posteriorzoo._api import public
from posteriorzoo._streams import read_small_file
from posteriorzoo.errors import ChecksumError, ZooFormatError
from posteriorzoo.hashing import sha256_file

MANIFEST_NAME = "SHA256SUMS"
#: Largest manifest read, in bytes. A manifest lists the files of one folder of
#: collections, one line of about 70 bytes plus the name each: a real one is a few lines,
#: and 4 MiB holds tens of thousands of them. A larger one (from a hostile Hub or folder)
#: is refused unread, so reading any manifest costs at most a few MB of memory.
MAX_MANIFEST_BYTES = 4 * 2**20
#: Most characters of a bad manifest line shown in an error, so that the message stays one
#: readable line whatever the line holds.
SHOWN_LINE_CHARACTERS = 200
#: Where ``str.splitlines`` breaks lines (the line boundaries manifests have always been
#: read with), found one at a time so that no list of every line is built.
_LINE_BREAK = re.compile("\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")


def _lines(text: str) -> Iterator[str]:
    """The lines of ``text``, as ``text.splitlines()`` gives them, one at a time."""
    start = 0
    for match in _LINE_BREAK.finditer(text):
        yield text[start:match.start()]
        start = match.end()
    if start < len(text):
        yield text[start:]


def _shown(line: str) -> str:
    """``line`` quoted for an error message, cut to :data:`SHOWN_LINE_CHARACTERS`
    characters and an ellipsis when longer."""
    quoted = repr(line[:SHOWN_LINE_CHARACTERS + 1])  # the slice keeps repr's work small
    if len(quoted) <= SHOWN_LINE_CHARACTERS:
        return quoted
    return f"{quoted[:SHOWN_LINE_CHARACTERS]}... ({len(line):,} characters)"


def read_manifest(path: str | Path) -> dict[str, str]:
    """Parse a ``SHA256SUMS`` file into ``{file name: hex digest}``.

    A manifest over :data:`MAX_MANIFEST_BYTES` is refused without being read, and an
    error quotes at most :data:`SHOWN_LINE_CHARACTERS` characters of a bad line.
    """
    entries: dict[str, str] = {}
    try:
        raw = read_small_file(path, MAX_MANIFEST_BYTES, f"{path}: the manifest",
                              " (a manifest holds one short line per file)")
    except FileNotFoundError as error:
        raise ZooFormatError(f"manifest not found: {path}") from error
    except OSError as error:
        raise ZooFormatError(f"{path}: cannot read the manifest: "
                             f"{error.strerror or error}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ZooFormatError(f"{path}: not a sha256sum manifest (not UTF-8 text)") from None
    del raw  # the text alone is kept while its lines are parsed
    for number, line in enumerate(_lines(text), start=1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        name = name.lstrip("*")
        if not sep or len(digest) != 64 or not name:
            raise ZooFormatError(f"{path}:{number}: not a sha256sum line: {_shown(line)}")
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
