"""Bounded reads from untrusted streams and files, shared by every reader of user input
(datasets, checkpoints, key maps, manifests, specs)."""

from __future__ import annotations

import os
from typing import BinaryIO

from posteriorzoo.errors import ZooFormatError

#: The largest single ``read`` request: a lying length never becomes one huge allocation.
READ_CHUNK = 1 << 20


def read_up_to(stream: BinaryIO, count: int) -> bytes:
    """Up to ``count`` bytes of ``stream`` (fewer only at its end), read in chunks of at
    most :data:`READ_CHUNK`."""
    parts, missing = [], count
    while missing > 0:
        piece = stream.read(min(missing, READ_CHUNK))
        if not piece:
            break
        parts.append(piece)
        missing -= len(piece)
    return b"".join(parts)


def read_small_file(path: str | os.PathLike, limit: int, what: str, hint: str = "") -> bytes:
    """The bytes of the file ``path``, which may hold at most ``limit`` of them.

    A larger file raises a one-line :class:`ZooFormatError` ("``what`` is N bytes, over
    the limit of ``limit``", then ``hint``, e.g. what such a file normally holds) without
    being read: refused by its size when the file system tells one, else (a device such
    as ``/dev/zero``, a pipe, a file that grows meanwhile) after reading at most
    ``limit + 1`` bytes. Errors opening or reading it (``FileNotFoundError``,
    ``IsADirectoryError``...) propagate, for the caller to word.
    """
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise ZooFormatError(f"{what} is {size:,} bytes, over the limit of {limit:,}"
                                 f"{hint}")
        data = read_up_to(handle, limit + 1)
    if len(data) > limit:
        raise ZooFormatError(f"{what} holds more than {limit:,} bytes (not read further), "
                             f"over the limit{hint}")
    return data
