"""Reading hostile checkpoint files: format detection, read limits, safetensors headers.

Inputs are treated as hostile. Nothing here unpickles: safetensors holds raw tensors and
a JSON header only. Formats are told apart by their first bytes, never by trying
decoders (:func:`sniff_format`). Every size is bounded before it is read
(:class:`ReadLimits`): a safetensors header, a checkpoint file, and (in
:mod:`posteriorzoo.zoo.archives`) an archive member, the number of archive members and
the bytes an archive expands to. A header's values are checked for type before anything
trusts them, so a malformed file raises one :class:`ZooFormatError`.

Safetensors data is read as a stream (:func:`read_safetensors`): first the header, whose
tensor entries must declare exactly the bytes that follow; then a caller's ``review`` of
the header may tighten the limits (an import bounds checkpoints by the size of the
architecture the header names) before any tensor byte is read; then exactly the declared
bytes, decoded in place without a second copy.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from posteriorzoo._api import public
from posteriorzoo._streams import READ_CHUNK, read_up_to
from posteriorzoo.errors import ZooFormatError

#: The ``format`` header value of checkpoints written by
#: :func:`posteriorzoo.collection.export_checkpoint`.
CHECKPOINT_FORMAT = "posteriorzoo-checkpoint"

#: Largest safetensors header read (the JSON that describes tensors and metadata), bytes.
#: Real headers take a few hundred bytes per tensor; when the checkpoint's tensors are
#: known the bound is ``HEADER_SLACK_BYTES + HEADER_BYTES_PER_TENSOR`` per tensor instead.
MAX_HEADER_BYTES = 16 * 2**20
#: What a header may hold besides its tensor entries (metadata row, options), bytes.
HEADER_SLACK_BYTES = 2**16
#: Header bytes allowed per tensor of the expected checkpoint (its entry, its state key).
HEADER_BYTES_PER_TENSOR = 2**10
#: Largest checkpoint (a safetensors file or archive member) read when the expected
#: size is unknown, bytes. When the architecture is known the bound is
#: ``4 * float64 bytes of one checkpoint + CHECKPOINT_SLACK_BYTES`` instead.
MAX_CHECKPOINT_BYTES = 2**30
#: What a checkpoint file may hold beyond 4x its float64 size (header, metadata).
CHECKPOINT_SLACK_BYTES = 2**20
#: Most entries (files, folders, links) read from one archive.
MAX_ARCHIVE_MEMBERS = 10_000
#: Bytes an archive may hold between two members' data (tar and pax headers, padding).
ARCHIVE_HEADER_BYTES = 2**20
#: Longest state key, in characters (also bounds the work of a key map's patterns).
MAX_KEY_LENGTH = 256
#: Most tensors in one checkpoint (a ResNet-18 has 122).
MAX_TENSORS = 10_000

#: safetensors dtypes that can be stored, as the little-endian numpy types safetensors
#: stores: floating point (weights) and integers (counters such as BatchNorm's
#: ``num_batches_tracked``; the architecture check refuses an integer weight). bfloat16
#: and float8 have no numpy type; a collection holds no booleans.
NUMPY_DTYPES: Mapping[str, np.dtype] = {
    "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"), "I16": np.dtype("<i2"), "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"), "U8": np.dtype("u1")}
SUPPORTED_DTYPES = frozenset(NUMPY_DTYPES)

GZIP_MAGIC = b"\x1f\x8b"
TAR_MAGIC = b"ustar"
TAR_MAGIC_OFFSET = 257
TAR_BLOCK = 512


@dataclass
class ReadLimits:
    """Bounds on what reading one input may cost; every one is checked before reading.

    Attributes
    ----------
    header_bytes : int
        Largest safetensors header.
    checkpoint_bytes : int
        Largest safetensors file or archive member (any member: skipped ones are read
        through too).
    archive_members : int
        Most entries in one archive.
    archive_header_bytes : int
        Most bytes an archive may hold between the data of two members (tar headers,
        pax and long-name records, padding, read-ahead).
    archive_bytes : int or None
        Most bytes one archive may expand to; default
        ``archive_members * (checkpoint_bytes + archive_header_bytes)``.
    """

    header_bytes: int = MAX_HEADER_BYTES
    checkpoint_bytes: int = MAX_CHECKPOINT_BYTES
    archive_members: int = MAX_ARCHIVE_MEMBERS
    archive_header_bytes: int = ARCHIVE_HEADER_BYTES
    archive_bytes: int | None = None

    @property
    def total_archive_bytes(self) -> int:
        """The bytes one archive may expand to: ``archive_bytes`` or its default."""
        if self.archive_bytes is not None:
            return self.archive_bytes
        return self.archive_members * (self.checkpoint_bytes + self.archive_header_bytes)

    def for_values(self, values: int) -> ReadLimits:
        """These limits, with checkpoints bounded by ``values`` numbers per checkpoint."""
        bound = 4 * 8 * int(values) + CHECKPOINT_SLACK_BYTES
        return dataclasses.replace(self, checkpoint_bytes=min(self.checkpoint_bytes, bound))

    def for_shapes(self, shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> ReadLimits:
        """These limits, with checkpoints bounded by the size of ``key -> (shape, dtype)``
        and headers by its number of tensors."""
        header = HEADER_SLACK_BYTES + HEADER_BYTES_PER_TENSOR * len(shapes)
        bounded = dataclasses.replace(self, header_bytes=min(self.header_bytes, header))
        return bounded.for_values(sum(int(np.prod(shape, dtype=np.int64))
                                      for shape, _ in shapes.values()))


def load_json(text: bytes | str, what: str) -> Any:
    """Parse JSON; malformed or absurdly nested text raises one ZooFormatError."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, bad UTF-8, depth
        raise ZooFormatError(f"{what} is not valid JSON: {str(error)[:200]}") from None


def check_state_key(key: object, what: str) -> str:
    """``key`` if it is a string of at most :data:`MAX_KEY_LENGTH` characters."""
    if not isinstance(key, str):
        raise ZooFormatError(f"{what}: a state key must be a string, not {key!r}"[:300])
    if len(key) > MAX_KEY_LENGTH:
        raise ZooFormatError(f"{what}: a state key is {len(key)} characters; "
                             f"the limit is {MAX_KEY_LENGTH}")
    return key


def require_file(path: Path) -> None:
    """Raise ZooFormatError unless ``path`` is an existing regular file."""
    if not path.is_file():
        raise ZooFormatError(f"{path}: no such file")


# ---------------------------------------------------------------------- format detection
def _safetensors_header_size(prefix: bytes, size: int, limits: ReadLimits) -> int | str:
    """The header length of safetensors data starting with ``prefix``, or why it is not one.

    ``prefix`` holds the first 9 bytes (or fewer, if the data is shorter); ``size`` is the
    length of the whole data.
    """
    if len(prefix) < 9:
        return f"{size} bytes is too short"
    length = int.from_bytes(prefix[:8], "little")
    if length < 2 or length > size - 8:
        return f"its header length {length} does not fit its {size} bytes"
    if length > limits.header_bytes:
        return f"its header of {length} bytes exceeds the limit of {limits.header_bytes}"
    if prefix[8:9] != b"{":
        return "its header is not a JSON object"
    return length


@public
def sniff_format(path: str | os.PathLike, limits: ReadLimits | None = None) -> str:
    """What an input file is, from its first bytes: ``"safetensors"``, ``"tar"``, ``"tar.gz"``.

    Nothing is decoded beyond the first tar block; anything else raises ZooFormatError.
    """
    path = Path(path)
    limits = limits or ReadLimits()
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(TAR_MAGIC_OFFSET + len(TAR_MAGIC))
            if head[:2] == GZIP_MAGIC:
                handle.seek(0)
                try:
                    with gzip.GzipFile(fileobj=handle, mode="rb") as stream:
                        block = stream.read(TAR_BLOCK)
                except (OSError, EOFError, zlib.error) as error:
                    raise ZooFormatError(f"{path}: a corrupt gzip file ({error})") from None
                if block[TAR_MAGIC_OFFSET:TAR_MAGIC_OFFSET + 5] != TAR_MAGIC:
                    raise ZooFormatError(f"{path}: a gzip file that does not hold a tar "
                                         "archive")
                return "tar.gz"
    except OSError as error:
        raise ZooFormatError(f"{path}: cannot be read: {error}") from None
    if head[TAR_MAGIC_OFFSET:TAR_MAGIC_OFFSET + 5] == TAR_MAGIC:
        return "tar"
    found = _safetensors_header_size(head[:9], size, limits)
    if isinstance(found, int):
        return "safetensors"
    raise ZooFormatError(f"{path}: neither a safetensors file nor a tar archive ({found})")


# ---------------------------------------------------------------------- safetensors
def _check_header_values(metadata: Mapping[str, Any], name: str) -> None:
    """The ``__metadata__`` values this package writes and reads, checked for type."""
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise ZooFormatError(f"{name}: header metadata {key!r} must be text")
    text = metadata.get("num_classes", "")
    if text and not (len(text) <= 9 and text.isascii() and text.isdigit() and int(text) > 0):
        raise ZooFormatError(f"{name}: header 'num_classes' must be a positive integer, "
                             f"not {text!r}"[:300])
    for key, kind, label in (("model_options", dict, "a JSON object"),
                             ("metadata", dict, "a JSON object"),
                             ("state_keys", list, "a JSON list of strings")):
        if key in metadata:
            value = load_json(metadata[key], f"{name}: header {key!r}")
            if not isinstance(value, kind) or (
                    kind is list and not all(isinstance(item, str) for item in value)):
                raise ZooFormatError(f"{name}: header {key!r} must be {label}")
    if metadata.get("format") == CHECKPOINT_FORMAT:
        for key in ("architecture", "dataset", "method"):
            if not metadata.get(key):
                raise ZooFormatError(f"{name}: header {key!r} is missing")


def _check_header(header: Any, name: str) -> dict[str, str]:
    """Check a safetensors header's structure; returns its ``__metadata__``."""
    if not isinstance(header, dict):
        raise ZooFormatError(f"{name}: not a valid safetensors file (its header is not a "
                             "JSON object)")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ZooFormatError(f"{name}: header '__metadata__' must be a JSON object")
    if len(header) - ("__metadata__" in header) > MAX_TENSORS:
        raise ZooFormatError(f"{name}: its header lists {len(header)} tensors; the limit is "
                             f"{MAX_TENSORS}")
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        check_state_key(key, name)
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
            raise ZooFormatError(f"{name}: not a valid safetensors file (tensor {key!r} "
                                 "has no dtype)"[:300])
        if entry["dtype"] not in SUPPORTED_DTYPES:
            raise ZooFormatError(
                f"{name}: tensor {key!r} has dtype {entry['dtype']!r}; supported are "
                f"{', '.join(sorted(SUPPORTED_DTYPES))} (convert bfloat16 to float32)"[:400])
    _check_header_values(metadata, name)
    return metadata


def _check_checkpoint_size(size: int, name: str, limits: ReadLimits) -> None:
    if size > limits.checkpoint_bytes:
        raise ZooFormatError(f"{name}: {size} bytes exceeds the limit of "
                             f"{limits.checkpoint_bytes} bytes for one checkpoint")


@dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors header: where its bytes are and what they hold."""

    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_entries(header: Mapping[str, Any], name: str) -> tuple[dict[str, _Entry], int]:
    """The tensor entries of a checked header and the bytes of tensor data they declare.

    The entries must tile the data exactly, as safetensors writes it: each holds the
    bytes of its shape and dtype, the first starts at 0 and each next one where the
    previous ends (no gap, no overlap).
    """
    entries: dict[str, _Entry] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(shape, list) or not all(_is_count(n) for n in shape) \
                or len(shape) > 64:
            raise ZooFormatError(f"{name}: tensor {key!r} has no valid shape"[:300])
        if not isinstance(offsets, list) or len(offsets) != 2 \
                or not all(_is_count(n) for n in offsets) or offsets[0] > offsets[1]:
            raise ZooFormatError(f"{name}: tensor {key!r} has no valid data_offsets"[:300])
        dtype = NUMPY_DTYPES[entry["dtype"]]
        if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
            raise ZooFormatError(f"{name}: tensor {key!r} declares {offsets[1] - offsets[0]} "
                                 f"bytes for shape {tuple(shape)} of {entry['dtype']}"[:300])
        entries[key] = _Entry(dtype, tuple(shape), offsets[0], offsets[1])
    position = 0
    for key, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            raise ZooFormatError(f"{name}: tensor {key!r} does not start where the previous "
                                 "one ends (gap or overlap in the data offsets)"[:300])
        position = entry.end
    return entries, position


def _read_into(stream: BinaryIO, buffer: bytearray) -> int:
    """Fill ``buffer`` from ``stream`` in chunks of at most 1 MiB; returns the bytes placed
    (fewer than its length only at the end of the stream)."""
    view, filled = memoryview(buffer), 0
    while filled < len(buffer):
        piece = stream.read(min(len(buffer) - filled, READ_CHUNK))
        if not piece:
            break
        view[filled:filled + len(piece)] = piece
        filled += len(piece)
    return filled


#: A reader's look at a header before any tensor byte is read: ``review(name, metadata,
#: limits)`` returns the limits the data must then meet, or raises.
Review = Callable[[str, Mapping[str, str], ReadLimits], ReadLimits]


def _read_header(stream: BinaryIO, size: int, name: str, limits: ReadLimits
                 ) -> tuple[dict[str, Any], dict[str, str], int]:
    """``(header, its metadata, header length)`` of a safetensors stream, read no further
    than its header (bounded by ``limits.header_bytes``) and checked for structure."""
    prefix = read_up_to(stream, 9)
    found = _safetensors_header_size(prefix, size, limits)
    if isinstance(found, str):
        raise ZooFormatError(f"{name}: not a valid safetensors file ({found})")
    text = prefix[8:] + read_up_to(stream, found - 1)
    if len(text) != found:
        raise ZooFormatError(f"{name}: truncated safetensors header")
    header = load_json(text, f"{name}: the safetensors header")
    return header, _check_header(header, name), found


def safetensors_keys(stream: BinaryIO, size: int, name: str, limits: ReadLimits
                     ) -> list[str]:
    """The tensor keys of a safetensors stream of ``size`` bytes, from its header alone
    (in the ``state_keys`` order it records, else sorted), checked as
    :func:`read_safetensors` checks them; no tensor data is read."""
    header, metadata, _ = _read_header(stream, size, name, limits)
    entries, _ = _tensor_entries(header, name)
    if "state_keys" in metadata:
        keys = json.loads(metadata["state_keys"])
        if set(keys) == set(entries):
            return list(keys)
    return sorted(entries)


def read_safetensors(stream: BinaryIO, size: int, name: str, limits: ReadLimits,
                     review: Review | None = None
                     ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(state_dict, header metadata)`` of the ``size`` bytes of safetensors ``stream``.

    Read as a stream, never more than declared: the 8-byte header length, the header
    (checked against ``limits.header_bytes``, then for structure and value types), then
    ``review`` if given (its limits apply from here on), then the size check against
    ``limits.checkpoint_bytes`` (the tensors must declare exactly the ``size`` bytes that
    follow the header), and only then the tensor data: exactly the declared bytes,
    decoded in place.

    The state keeps the key order recorded in the ``state_keys`` header when there is one
    (else sorted keys, as safetensors returns them), so a round trip preserves the
    model's order.
    """
    header, metadata, found = _read_header(stream, size, name, limits)
    if review is not None:
        limits = review(name, metadata, limits)
        if found > limits.header_bytes:
            raise ZooFormatError(f"{name}: its header of {found} bytes exceeds the limit of "
                                 f"{limits.header_bytes} for this checkpoint's tensors")
    _check_checkpoint_size(size, name, limits)
    entries, data_bytes = _tensor_entries(header, name)
    if 8 + found + data_bytes != size:
        raise ZooFormatError(f"{name}: not a valid safetensors file (its tensors declare "
                             f"{data_bytes} bytes of data, it holds {size - 8 - found})")
    data = bytearray(data_bytes)
    if _read_into(stream, data) != data_bytes:
        raise ZooFormatError(f"{name}: truncated safetensors data")
    tensors = {key: _decode(data, entry, key, name) for key, entry in sorted(entries.items())}
    if "state_keys" in metadata:
        keys = json.loads(metadata["state_keys"])  # checked by _check_header_values
        if set(keys) == set(tensors):
            tensors = {key: tensors[key] for key in keys}
    return tensors, dict(metadata)


def _decode(data: bytearray, entry: _Entry, key: str, name: str) -> torch.Tensor:
    """The tensor ``entry`` describes in ``data`` (sharing its memory when aligned)."""
    count = (entry.end - entry.begin) // entry.dtype.itemsize
    if count == 0:
        return torch.from_numpy(np.empty(entry.shape, entry.dtype.newbyteorder("=")))
    array = np.frombuffer(data, dtype=entry.dtype, count=count, offset=entry.begin)
    if entry.begin % entry.dtype.itemsize or not entry.dtype.isnative:
        array = array.astype(entry.dtype.newbyteorder("="))  # aligned, native copy
    return torch.from_numpy(array.reshape(entry.shape))


@public
def read_checkpoint(path: str | os.PathLike, *, limits: ReadLimits | None = None,
                    review: Review | None = None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors checkpoint: returns ``(state_dict, header metadata)``.

    The file is recognised by its first bytes and its size is checked against
    ``limits`` before it is read; the header's values are checked for type, and its
    tensors must declare exactly the bytes the file holds.

    Parameters
    ----------
    path : path-like
        The safetensors file.
    limits : ReadLimits, optional
        Bounds on the header and file size (default :class:`ReadLimits`).
    review : callable, optional
        ``review(name, metadata, limits) -> limits``, called with the header's metadata
        before any tensor byte is read: it may tighten the limits, or raise.

    Returns
    -------
    tuple of (dict of str to torch.Tensor, dict of str to str)
        The state_dict and the header's ``__metadata__``.
    """
    path = Path(path)
    limits = limits or ReadLimits()
    require_file(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            found = _safetensors_header_size(handle.read(9), size, limits)
            if isinstance(found, str):
                raise ZooFormatError(f"{path}: not a valid safetensors file ({found})")
            _check_checkpoint_size(size, str(path), limits)
            handle.seek(0)
            # Exactly ``size`` bytes are read: a file that grew since stat() is not read
            # further, and one that shrank is reported as truncated.
            return read_safetensors(handle, size, str(path), limits, review)
    except OSError as error:
        raise ZooFormatError(f"{path}: cannot be read: {error}") from None
