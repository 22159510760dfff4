"""Reader and writer for the IDX format of MNIST and Fashion-MNIST.

An IDX file is a 4-byte magic number ``0x00 0x00 <type> <ndim>``, then ``ndim``
big-endian uint32 dimension sizes, then the values in C order, big-endian. The
published files are gzipped; both gzipped and plain files are read, told apart
by the gzip magic bytes rather than the file name, because mirrors and Linux
distributions do not agree on names (``.gz`` or not).

A file is read as a stream: the header first, whose dimensions say how many bytes
follow; those are checked against a bound (``max_bytes``, by default
:data:`MAX_IDX_BYTES`) before anything is allocated, then exactly they are read, and
one byte more means trailing data. A gzip stream is never decompressed beyond what the
header declares, so a small file of compressed zeros cannot inflate in memory.
"""

from __future__ import annotations

import gzip as gzip_module
import io
import math
import os
import struct
import zlib
from pathlib import Path
from typing import BinaryIO

import numpy as np

from posteriorzoo._api import public
from posteriorzoo._streams import READ_CHUNK, read_up_to
from posteriorzoo.errors import DataFormatError

__all__ = ["IDX_TYPES", "MAX_IDX_BYTES", "read_idx", "write_idx"]

#: Largest IDX file read when no other bound is given (header and values), bytes.
MAX_IDX_BYTES = 2**31

#: IDX type code -> big-endian numpy dtype of the stored values.
IDX_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_CODE_OF_KIND = {(dt.kind, dt.itemsize): code for code, dt in IDX_TYPES.items()}
_GZIP_MAGIC = b"\x1f\x8b"


def _read_values(path: Path, stream: BinaryIO, max_bytes: int) -> np.ndarray:
    head = read_up_to(stream, 4)
    if len(head) < 4:
        raise DataFormatError(f"{path}: not an IDX file ({len(head)} bytes, header needs 4)")
    zero0, zero1, code, ndim = head[0], head[1], head[2], head[3]
    if zero0 != 0 or zero1 != 0:
        raise DataFormatError(
            f"{path}: not an IDX file (magic starts {head[:2].hex()}, expected 0000)"
        )
    if code not in IDX_TYPES:
        known = ", ".join(f"0x{c:02X}" for c in IDX_TYPES)
        raise DataFormatError(f"{path}: unknown IDX type code 0x{code:02X} (known: {known})")
    header_len = 4 + 4 * ndim
    dims = read_up_to(stream, 4 * ndim)
    if len(dims) < 4 * ndim:
        raise DataFormatError(
            f"{path}: truncated IDX header ({4 + len(dims)} bytes, {ndim} dimensions need "
            f"{header_len})"
        )
    shape = struct.unpack(f">{ndim}I", dims)
    dtype = IDX_TYPES[code]
    expected = math.prod(shape) * dtype.itemsize
    if header_len + expected > max_bytes:
        raise DataFormatError(
            f"{path}: its IDX header declares shape {shape} of {dtype.name}, "
            f"{header_len + expected} bytes, more than the {max_bytes} this file may hold"
        )
    values = np.empty(expected // dtype.itemsize, dtype=dtype)
    view, filled = memoryview(values).cast("B"), 0
    while filled < expected:
        piece = stream.read(min(expected - filled, READ_CHUNK))
        if not piece:
            break
        view[filled:filled + len(piece)] = piece
        filled += len(piece)
    if filled != expected or stream.read(1):
        what = "truncated" if filled < expected else "has trailing bytes"
        found = f"found {filled}" if filled < expected else "found more"
        raise DataFormatError(
            f"{path}: IDX payload {what}: shape {shape} of {dtype.name} needs {expected} "
            f"bytes, {found}"
        )
    return values.reshape(shape).astype(dtype.newbyteorder("="), copy=False)


@public
def read_idx(path: str | os.PathLike[str], max_bytes: int | None = None) -> np.ndarray:
    """Read an IDX file, gzipped or plain.

    Parameters
    ----------
    path : str or os.PathLike
        The file. Gzip compression is detected from the first two bytes
        (``1f 8b``), whatever the name.
    max_bytes : int, optional
        Most bytes the (decompressed) file may hold, header included; default
        :data:`MAX_IDX_BYTES`. A header declaring more is refused before anything
        is allocated, and decompression never goes beyond what the header declares.

    Returns
    -------
    numpy.ndarray
        A new, writable array with the shape stored in the header and the
        native-endian dtype of the type code: ``uint8`` (0x08), ``int8`` (0x09),
        ``int16`` (0x0B), ``int32`` (0x0C), ``float32`` (0x0D) or ``float64``
        (0x0E). MNIST images come back as ``uint8`` of shape ``(N, 28, 28)``,
        labels as ``uint8`` of shape ``(N,)``.

    Raises
    ------
    DataFormatError
        The magic number or type code is invalid, the header is cut short or
        declares more than ``max_bytes``, the payload is shorter or longer than the
        dimensions require, or the gzip stream is corrupt. The message names the file.
    FileNotFoundError
        ``path`` does not exist.
    """
    return read_idx_file(Path(path), max_bytes)


def read_idx_file(path: Path, max_bytes: int | None = None, content: bytes | None = None
                  ) -> np.ndarray:
    """:func:`read_idx` of ``path``, or of ``content`` (its decompressed bytes, already
    read and checked) when given."""
    bound = MAX_IDX_BYTES if max_bytes is None else int(max_bytes)
    if content is not None:
        return _read_values(path, io.BytesIO(content), bound)
    with open(path, "rb") as raw:
        compressed = raw.read(2) == _GZIP_MAGIC
        raw.seek(0)
        if not compressed:
            return _read_values(path, raw, bound)
        try:
            with gzip_module.GzipFile(fileobj=raw, mode="rb") as stream:
                return _read_values(path, stream, bound)
        except (OSError, EOFError, zlib.error) as exc:
            # A truncated download typically ends here ("Compressed file ended before ...").
            raise DataFormatError(f"{path}: corrupt or truncated gzip stream ({exc})") from exc


@public
def write_idx(path: str | os.PathLike[str], array: np.ndarray, gzip: bool = False) -> Path:
    """Write ``array`` as an IDX file.

    Parameters
    ----------
    path : str or os.PathLike
        Destination; overwritten if it exists. The name is not changed, so add
        ``.gz`` yourself when ``gzip=True`` if you want the usual naming.
    array : numpy.ndarray
        Any shape (each dimension below 2**32, at most 255 dimensions) with
        dtype ``uint8``, ``int8``, ``int16``, ``int32``, ``float32`` or
        ``float64``; stored big-endian with the matching IDX type code.
    gzip : bool, default False
        Compress with gzip. The gzip header's timestamp is set to 0 so the same
        array always gives the same bytes.

    Returns
    -------
    pathlib.Path
        The path written.

    Raises
    ------
    DataFormatError
        The dtype has no IDX type code or the shape does not fit the header.
    """
    path = Path(path)
    array = np.asarray(array)
    code = _CODE_OF_KIND.get((array.dtype.kind, array.dtype.itemsize))
    if code is None:
        raise DataFormatError(
            f"{path}: dtype {array.dtype} cannot be stored in IDX "
            "(use uint8, int8, int16, int32, float32 or float64)"
        )
    if array.ndim > 255 or any(d >= 2**32 for d in array.shape):
        raise DataFormatError(f"{path}: shape {array.shape} does not fit an IDX header")
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = np.ascontiguousarray(array, dtype=IDX_TYPES[code]).tobytes()
    content = header + payload
    if gzip:
        content = gzip_module.compress(content, mtime=0)
    with open(path, "wb") as f:
        f.write(content)
    return path
