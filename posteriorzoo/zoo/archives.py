"""The authors' release format: tar archives of safetensors files, read as a stream.

A release is a ``.tgz`` of float16 safetensors files, one per model, named
``models/<task>/<task>-<start>-<end>.tgz``. :func:`read_release_archive` reads it member
by member without extracting to disk, through a stream that refuses to deliver more
bytes than the member headers declare (:class:`ReadLimits` bounds each member, the
number of members and the bytes the archive expands to). :func:`release_task` tells the
collection attributes a release implies from its file name, :func:`member_modes` the
mode of each member from the members' names (:func:`member_mode_guess` from one name
alone, while the archive streams).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import re
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from posteriorzoo._api import public
from posteriorzoo.errors import ZooFormatError
from posteriorzoo.zoo.formats import (
    TAR_BLOCK,
    ReadLimits,
    Review,
    read_safetensors,
    require_file,
    safetensors_keys,
    sniff_format,
)

#: Release task names (``models/<task>/<task>-<start>-<end>.tgz``) -> collection attributes.
RELEASE_TASKS: dict[str, dict[str, Any]] = {
    "mnist-optunet": {"architecture": "optunet", "dataset": "mnist", "num_classes": 10},
    "cifar10-resnet18": {"architecture": "resnet18", "dataset": "cifar10", "num_classes": 10},
    "cifar100-resnet18": {"architecture": "resnet18", "dataset": "cifar100", "num_classes": 100},
    "tiny-imagenet-resnet18": {"architecture": "resnet18-tiny", "dataset": "tinyimagenet",
                               "num_classes": 200},
    "cifar10-resnet20-frn-silu": {"architecture": "resnet20-frn-silu", "dataset": "cifar10",
                                  "num_classes": 10},
}

_READ_CHUNK = 2**20
#: A numbered member: its file name ends in a number after a separator or alone
#: (``model_17.safetensors``, ``17.safetensors``; not ``resnet18.safetensors``).
_MEMBER_NUMBER = re.compile(r"(?:^|[_.-])(\d{1,9})\.safetensors$")
#: A release archive's name tells the range of its members: ``<task>-<start>-<end>.tgz``.
_ARCHIVE_RANGE = re.compile(r"-(\d{1,9})-(\d{1,9})\.(?:tgz|tar\.gz|tar)$")


class _BoundedReader:
    """A read-only stream that refuses to deliver more than the bytes it is allowed.

    :func:`read_archive` allows, after each member header, that member's declared data
    plus :attr:`ReadLimits.archive_header_bytes`; the whole archive at most
    :attr:`ReadLimits.total_archive_bytes`. Reads come in chunks of at most 1 MiB, so a
    huge request never decompresses a huge block at once.
    """

    def __init__(self, raw: BinaryIO, name: str, limits: ReadLimits) -> None:
        self.raw = raw
        self.name = name
        self.total = limits.total_archive_bytes
        self.slack = limits.archive_header_bytes
        self.consumed = 0
        self.limit = min(self.total, self.slack)

    def allow(self, data_bytes: int) -> None:
        """Let the next member's data (``data_bytes``) and the next headers be read."""
        self.limit = min(self.total, self.consumed + data_bytes + self.slack)

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = self.limit - self.consumed + 1
        parts = []
        while size > 0:
            allowed = self.limit - self.consumed
            if allowed <= 0:
                if self.raw.read(1):
                    self._refuse()
                break
            piece = self.raw.read(min(size, allowed, _READ_CHUNK))
            if not piece:
                break
            parts.append(piece)
            self.consumed += len(piece)
            size -= len(piece)
        return b"".join(parts)

    def _refuse(self) -> None:
        if self.limit >= self.total:
            raise ZooFormatError(f"{self.name}: the archive expands beyond {self.total} bytes, "
                                 "the limit; refusing to read on")
        raise ZooFormatError(
            f"{self.name}: the archive holds more data than its member headers declare "
            f"(over {self.slack} bytes of headers between two members); refusing to read on")


def _padded(size: int) -> int:
    """``size`` rounded up to whole tar blocks (a member's data on disk)."""
    return -(-size // TAR_BLOCK) * TAR_BLOCK


@public
def read_release_archive(path: str | os.PathLike, *, limits: ReadLimits | None = None
                         ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Yield ``(member name, state_dict)`` for each safetensors file of a release ``.tgz``.

    Members are read from the archive stream in order; nothing is extracted to disk.
    The archive must be a plain or gzip-compressed tar (recognised by its first bytes).
    Each member's declared size is checked against ``limits.checkpoint_bytes`` before its
    data is read, as are the number of members and the bytes the archive expands to; a
    safetensors member is decompressed as it is read, its header first, and never beyond
    the tensor bytes that header declares.

    Parameters
    ----------
    path : path-like
        The archive.
    limits : ReadLimits, optional
        Bounds on what reading it may cost (default :class:`ReadLimits`).

    Yields
    ------
    tuple of (str, dict of str to torch.Tensor)
        ``archive-name:member-name`` and the member's state_dict.
    """
    for name, state, _ in read_archive(Path(path), limits or ReadLimits()):
        yield name, state


class _Hashing:
    """A read-only file that feeds every byte read to a SHA-256."""

    def __init__(self, raw: BinaryIO, digest: Any) -> None:
        self.raw, self.digest = raw, digest

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.digest.update(data)
        return data

    def drain(self) -> None:
        """Hash what the tar stream left unread (its end-of-archive padding)."""
        while self.read(_READ_CHUNK):
            pass


def _members(path: Path, limits: ReadLimits, digests: dict[Path, str] | None = None
             ) -> Iterator[tuple[tarfile.TarInfo, BinaryIO | None]]:
    """Every member of an archive stream, in order, with a handle on its data when it is
    a safetensors file (None for the members skipped), under ``limits``: the number of
    members, each member's declared size, the bytes the archive expands to. The caller
    reads a handle before asking for the next member (:func:`_archive_errors` words
    what goes wrong). With ``digests``, the archive file's SHA-256 is put there when the
    stream ends, from the same read (no second read for the provenance)."""
    require_file(path)
    kind = sniff_format(path, limits)
    if kind == "safetensors":
        raise ZooFormatError(f"{path}: a safetensors file, not a tar archive")
    members = 0
    with open(path, "rb") as opened:
        raw: Any = _Hashing(opened, hashlib.sha256()) if digests is not None else opened
        stream: BinaryIO = gzip.GzipFile(fileobj=raw, mode="rb") if kind == "tar.gz" else raw
        reader = _BoundedReader(stream, str(path), limits)
        with tarfile.open(fileobj=reader, mode="r|") as archive:  # type: ignore[call-overload]
            for member in archive:
                members += 1
                if members > limits.archive_members:
                    raise ZooFormatError(f"{path}: more than {limits.archive_members} "
                                         "archive members, the limit")
                if member.size > limits.checkpoint_bytes:
                    raise ZooFormatError(
                        f"{path}: member {member.name[:200]!r} declares {member.size} "
                        f"bytes, over the limit of {limits.checkpoint_bytes} bytes")
                reader.allow(_padded(member.size))
                taken = (member.isfile() and not member.issparse()
                         and member.name.endswith(".safetensors"))
                yield member, archive.extractfile(member) if taken else None
        if digests is not None:
            raw.drain()
            digests[path] = raw.digest.hexdigest()


@contextlib.contextmanager
def _archive_errors(path: Path) -> Iterator[None]:
    """A broken stream (tar, gzip or I/O) as one :class:`ZooFormatError` naming ``path``."""
    try:
        yield
    except (tarfile.TarError, EOFError, OSError, zlib.error) as error:
        raise ZooFormatError(f"{path}: not a readable tar archive ({error})"[:400]) from None


def read_archive(path: Path, limits: ReadLimits, review: Review | None = None,
                 digests: dict[Path, str] | None = None
                 ) -> Iterator[tuple[str, dict[str, torch.Tensor], dict[str, str]]]:
    """Like :func:`read_release_archive`, with each member's header metadata too.

    Each safetensors member is read as a stream (:func:`~posteriorzoo.zoo.formats.
    read_safetensors`): its header first, then ``review`` (which may tighten the limits,
    or refuse), then exactly the tensor bytes the header declares. With ``digests``, the
    archive's SHA-256 is put there once it is read to its end.
    """
    with _archive_errors(path):
        for member, handle in _members(path, limits, digests):
            if handle is None:
                continue
            name = f"{path.name}:{member.name}"
            state, header = read_safetensors(handle, member.size, name, limits, review)
            yield name, state, header


def list_archive(path: Path, limits: ReadLimits
                 ) -> Iterator[tuple[str, int, list[str] | None]]:
    """``(member name, bytes, tensor keys)`` of every member of an archive, in order,
    under the limits :func:`read_archive` applies: the keys (from the member's header
    alone) of the safetensors members it would read, None for the members it skips. No
    tensor is decoded: the dry run of ``import``."""
    with _archive_errors(path):
        for member, handle in _members(path, limits):
            keys = None if handle is None else safetensors_keys(
                handle, member.size, f"{path.name}:{member.name}", limits)
            yield member.name, member.size, keys


def release_task(path: str | os.PathLike) -> dict[str, Any] | None:
    """Collection attributes implied by a release archive's name, or None if unknown."""
    name = Path(path).name
    # Longest task first, so a task whose name extends another's wins over the shorter.
    for task, attributes in sorted(RELEASE_TASKS.items(), key=lambda item: -len(item[0])):
        if name.startswith(task + "-") or name == f"{task}.tgz":
            return dict(attributes)
    return None


def member_modes(archive_name: str, members: Iterable[str], taken: Iterable[int] = ()
                 ) -> dict[str, int]:
    """``{member: mode}`` for the members of a release archive, when their names number
    them; ``{}`` when they do not tell.

    A member's number is the one its file name ends with (``.../model_17.safetensors``).
    Every member must be numbered and the numbers distinct. When the archive's name gives
    a range (``mnist-optunet-1024-2047.tgz``), a number inside it is the mode; numbers
    counted from 0 within the archive are shifted to the range's start. Numbers already
    ``taken`` (modes of the collection or of other inputs) make the archive's numbering
    unusable: ``{}``.
    """
    members = list(members)
    numbers = []
    for member in members:
        number = _member_number(member)
        if number is None:
            return {}
        numbers.append(number)
    if not numbers or len(set(numbers)) != len(numbers):
        return {}
    bounds = _ARCHIVE_RANGE.search(archive_name)
    if bounds is not None:
        start, end = int(bounds.group(1)), int(bounds.group(2))
        if all(start <= number <= end for number in numbers):
            pass
        elif all(0 <= number <= end - start for number in numbers):
            numbers = [start + number for number in numbers]
        else:
            return {}
    if set(numbers) & set(taken):
        return {}
    return dict(zip(members, numbers, strict=True))


def _member_number(member: str) -> int | None:
    """The number a member's file name ends with, or None."""
    found = _MEMBER_NUMBER.search(member.rsplit("/", 1)[-1])
    return None if found is None else int(found.group(1))


def numbering_start(archive_name: str) -> int:
    """The first mode a release archive's name gives (``...-1024-2047.tgz``: 1024), else 0."""
    bounds = _ARCHIVE_RANGE.search(archive_name)
    return 0 if bounds is None else int(bounds.group(1))


def member_mode_guess(archive_name: str, member: str) -> int | None:
    """The mode :func:`member_modes` gives ``member`` when its archive's numbering turns
    out usable, told from its name alone (None: it is not numbered, or its number lies
    outside the range the archive's name gives).

    An import streams an archive once, so it places each member at this guess and
    checks it against :func:`member_modes` of all the names at the end. The guess can
    differ only where the archive's name gives a range ``start-end`` whose start is
    below its length (a number ``n`` with ``start <= n <= end - start`` is taken as in
    the range, though other members may show the numbering counts from 0).
    """
    number = _member_number(member)
    if number is None:
        return None
    bounds = _ARCHIVE_RANGE.search(archive_name)
    if bounds is None:
        return number
    start, end = int(bounds.group(1)), int(bounds.group(2))
    if start <= number <= end:
        return number
    if 0 <= number <= end - start:
        return start + number
    return None
