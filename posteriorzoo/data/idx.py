"""Reader and writer for the IDX format of MNIST and Fashion-MNIST.

An IDX file is a 4-byte magic number ``0x00 0x00 <type> <ndim>``, then ``ndim``
big-endian uint32 dimension sizes, then the values in C order, big-endian. The
published files are gzipped; both gzipped and plain files are read, told apart
by the gzip magic bytes rather than the file name, because mirrors and Linux
distributions do not agree on names (``.gz`` or not).
"""

from __future__ import annotations

import gzip as gzip_module
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from posteriorzoo._api import public
from posteriorzoo.errors import DataFormatError

__all__ = ["IDX_TYPES", "read_idx", "write_idx"]

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


def _read_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        raw = f.read()
    if not raw.startswith(_GZIP_MAGIC):
        return raw
    try:
        return gzip_module.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        # A truncated download typically ends here ("Compressed file ended before ...").
        raise DataFormatError(f"{path}: corrupt or truncated gzip stream ({exc})") from exc


@public
def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file, gzipped or plain.

    Parameters
    ----------
    path : str or os.PathLike
        The file. Gzip compression is detected from the first two bytes
        (``1f 8b``), whatever the name.

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
        The magic number or type code is invalid, the header is cut short, the
        payload is shorter or longer than the dimensions require, or the gzip
        stream is corrupt. The message names the file.
    FileNotFoundError
        ``path`` does not exist.
    """
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4:
        raise DataFormatError(f"{path}: not an IDX file ({len(data)} bytes, header needs 4)")
    zero0, zero1, code, ndim = data[0], data[1], data[2], data[3]
    if zero0 != 0 or zero1 != 0:
        raise DataFormatError(
            f"{path}: not an IDX file (magic starts {data[:2].hex()}, expected 0000)"
        )
    if code not in IDX_TYPES:
        known = ", ".join(f"0x{c:02X}" for c in IDX_TYPES)
        raise DataFormatError(f"{path}: unknown IDX type code 0x{code:02X} (known: {known})")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise DataFormatError(
            f"{path}: truncated IDX header ({len(data)} bytes, {ndim} dimensions need "
            f"{header_len})"
        )
    shape = struct.unpack(f">{ndim}I", data[4:header_len])
    dtype = IDX_TYPES[code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual = len(data) - header_len
    if actual != expected:
        what = "truncated" if actual < expected else "has trailing bytes"
        raise DataFormatError(
            f"{path}: IDX payload {what}: shape {shape} of {dtype.name} needs {expected} "
            f"bytes, found {actual}"
        )
    values = np.frombuffer(data, dtype=dtype, offset=header_len).reshape(shape)
    return values.astype(dtype.newbyteorder("="))


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
