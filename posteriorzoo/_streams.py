"""Bounded reads from untrusted streams, shared by the dataset and checkpoint readers."""

from __future__ import annotations

from typing import BinaryIO

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
