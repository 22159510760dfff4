"""The HDF5 checkpoint store: one collection of same-architecture checkpoints per file.

Two access patterns are first-class:

- one layer across all N checkpoints, ``zoo.layer("conv2.weight")`` -> array (N, 10, 1, 5, 5),
  read from one dataset chunked along the checkpoint axis;
- checkpoint i as a state_dict, ``zoo.state_dict(i)`` -> ``{key: torch.Tensor}``.

Appends are crash-safe: whole checkpoints, and the training records of their modes, are
written and flushed before the committed count advances (see
:mod:`posteriorzoo.zoo.lifecycle` for creating and opening files).
An append first checks that the file system has room for its block; a write that fails
anyway (a disk filled by another process) abandons the file (:func:`abandon`) and
raises :class:`~posteriorzoo.errors.NoSpaceError`: the file keeps the checkpoints
committed before, as if the writer had been killed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from posteriorzoo import outputs
from posteriorzoo._api import public
from posteriorzoo._faults import fault_point
from posteriorzoo.dtypes import ArrayLike, as_numpy
from posteriorzoo.errors import (
    ChecksumError,
    NonFiniteWeightsError,
    NoSpaceError,
    PosteriorZooError,
    UnknownNameError,
    ZooFormatError,
    ZooSchemaError,
)
from posteriorzoo.provenance import library_versions
from posteriorzoo.zoo import schema, verified
from posteriorzoo.zoo.architecture import check_architecture
from posteriorzoo.zoo.layout import (
    COMMITTED,
    MAX_APPEND_ROWS,
    METADATA,
    MODE_RECORDS,
    ROW_DIGESTS,
    STATE_GROUP,
    Layout,
    read_layout,
)
from posteriorzoo.zoo.schema import (
    METADATA_DTYPE,
    RECORD_DTYPE,
    canonical_json,
    checkpoint_digest,
    decode_table,
    metadata_row,
    record_bytes,
    record_digest,
    row_digest,
)

#: Target size of one chunk of a state dataset; small layers pack many checkpoints per chunk.
DEFAULT_CHUNK_BYTES = 1 << 18
MAX_CHUNK_ROWS = 1024
_METADATA_CHUNK_ROWS = 256
#: One training record (16.5 kB) per chunk: a record allocates no space for others.
_RECORD_CHUNK_ROWS = 1
#: Training records read at once (about 4 MB).
_RECORD_BLOCK_ROWS = 256
#: Batches of one tensor up to this size are stacked into one write.
_STACK_BYTES = 1 << 24
_STATE_GROUP = STATE_GROUP
#: Bytes of whole checkpoints read at once while verifying digests.
_VERIFY_BLOCK_BYTES = 1 << 28


def all_finite(array: np.ndarray) -> bool:
    """Whether an array holds no NaN or infinity (always, for integers).

    float16 is tested on its bits (exponent all ones: infinite or NaN), 4x faster than
    ``np.isfinite``, which converts every value; it was half the cost of checking a
    float16 ResNet-18 checkpoint.
    """
    if array.dtype.kind != "f":
        return True
    if array.dtype == np.float16:
        return not ((array.view(np.uint16) & 0x7C00) == 0x7C00).any()
    return bool(np.isfinite(array).all())
_CRASHED_WRITER_MARKERS = ("already open for write", "consistency flags")
#: What HDF5 says, reading in SWMR mode, of a file whose writer had not started SWMR.
_NON_SWMR_WRITER_MARKER = "not already open for SWMR writing"
#: File space HDF5 takes beyond the chunks of the data: object headers, chunk indexes,
#: free-space records (measured: 10 kB for an empty collection, 12 to 25 kB for
#: collections of 1 to 3,000 checkpoints, of which 2 to 15 kB are not the empty file's).
METADATA_MARGIN = 1 << 14


#: The most bytes of an abandoned file (its metadata: chunk data is left out) copied into
#: memory; beyond, the stand-in is the file opened read-only, whose writes fail.
_STAND_IN_LIMIT = 1 << 30


def _descriptor(handle: h5py.File) -> int | None:
    """The operating-system descriptor of an open file (HDF5's default sec2 driver)."""
    try:
        descriptor = handle.id.get_vfd_handle() if handle.id.valid else None
    except (OSError, RuntimeError, ValueError, TypeError):
        return None
    return descriptor if isinstance(descriptor, int) and descriptor >= 0 else None


def _chunk_ranges(handle: h5py.File) -> list[tuple[int, int]]:
    """``(offset, size)`` of every allocated chunk of the file's datasets (best effort:
    nothing when the file cannot tell)."""
    ranges: list[tuple[int, int]] = []

    def collect(_: str, item: object) -> None:
        if isinstance(item, h5py.Dataset) and item.chunks is not None:
            item.id.chunk_iter(lambda info: ranges.append((info.byte_offset, info.size)))

    try:
        handle.visititems(collect)
    except Exception:  # a damaged index: copy everything
        return []
    return sorted(r for r in ranges if r[0] is not None and r[0] >= 0)


def _stand_in(handle: h5py.File, descriptor: int) -> int:
    """A descriptor that reads like the file and takes writes without touching it: an
    in-memory copy of its metadata (chunk data, never read again, left out as holes);
    a read-only descriptor of the file itself where that is not possible."""
    size = os.fstat(descriptor).st_size
    skip = _chunk_ranges(handle)
    copied = size - sum(min(length, max(0, size - offset)) for offset, length in skip)
    if hasattr(os, "memfd_create") and copied <= _STAND_IN_LIMIT:
        try:
            copy = os.memfd_create("posteriorzoo-abandoned", os.MFD_CLOEXEC)
        except OSError:
            copy = None
        if copy is not None:
            try:
                os.ftruncate(copy, size)
                position = 0
                for offset, length in [*skip, (size, 0)]:
                    while position < min(offset, size):
                        piece = os.pread(descriptor, min(1 << 20, offset - position), position)
                        if not piece:
                            break
                        os.pwrite(copy, piece, position)
                        position += len(piece)
                    position = max(position, offset + length)
                return copy
            except OSError:
                os.close(copy)
    return os.open(f"/proc/self/fd/{descriptor}", os.O_RDONLY)


_SIGNATURE = b"\x89HDF\r\n\x1a\n"


@contextlib.contextmanager
def _file_size_limit_lifted() -> Iterator[None]:
    """Raise the soft file-size limit (``ulimit -f``) to the hard one for a while: the
    stand-in of an abandoned file must take writes at any offset of it."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    except (ImportError, OSError, ValueError):
        yield
        return
    if soft == hard:
        yield
        return
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _carry_back_status(copy: int, real: int) -> None:
    """Write the superblock HDF5 closed the stand-in ``copy`` with into the file ``real``
    when the two differ only in the status flags (and so the checksum): the file is then
    marked closed rather than open for writing, readable as before. Only superblocks of
    version 2 and 3 (the writers' ``libver="latest"``), at the start of the file."""
    head = os.pread(real, 12, 0)
    if len(head) < 12 or head[:8] != _SIGNATURE or head[8] not in (2, 3):
        return
    size = 12 + 4 * head[9] + 4  # four addresses, then the checksum
    before, after = os.pread(real, size, 0), os.pread(copy, size, 0)
    flags, checksum = slice(11, 12), slice(size - 4, size)
    if (len(before) == len(after) == size and before != after
            and before[:11] == after[:11] and before[12:size - 4] == after[12:size - 4]
            and after[flags] == b"\0"):
        os.pwrite(real, after[flags], 11)
        os.pwrite(real, after[checksum], size - 4)


def abandon(handle: h5py.File) -> None:
    """Close a file after a failed write without letting HDF5 write to it again.

    HDF5 keeps a file whose flush failed (a full disk) open; closing it fails again, and
    when the interpreter exits, releasing its datasets crashes the process (a
    segmentation fault inside ``H5D_close``). So the file's descriptor is first pointed
    at a stand-in that reads like the file and takes HDF5's remaining writes in memory
    (:func:`_stand_in`): the close completes, and the file stays as the failed write left
    it, as if its writer had been killed then (what readers and the next writer handle,
    see :mod:`posteriorzoo.zoo.lifecycle`). If closing changed nothing but the
    superblock's "open for writing" flags, those are cleared in the file too, so it
    reads as a file closed normally.
    """
    descriptor = _descriptor(handle)
    copy = real = None
    if descriptor is not None:
        try:
            stand_in = _stand_in(handle, descriptor)
            real = os.dup(descriptor)
        except OSError:
            stand_in = None
        if stand_in is not None:
            try:
                copy = os.dup(stand_in)
                os.dup2(stand_in, descriptor)
            finally:
                os.close(stand_in)
    with contextlib.suppress(Exception), _file_size_limit_lifted():
        if handle.id.valid:
            handle.close()
    try:
        if copy is not None and real is not None and not handle.id.valid:
            with contextlib.suppress(OSError):
                _carry_back_status(copy, real)
    finally:
        for descriptor in (copy, real):
            if descriptor is not None:
                os.close(descriptor)


def close_or_abandon(handle: h5py.File) -> BaseException | None:
    """Flush and close ``handle``; if that fails (a full disk), abandon it (see
    :func:`abandon`) and return the error."""
    try:
        if handle.id.valid:
            if handle.mode != "r":
                handle.flush()  # a failure here leaves nothing half-closed
            handle.close()
    except (OSError, RuntimeError, ValueError) as error:
        abandon(handle)
        return error
    return None


def write_failure(path: Path, error: BaseException, needed: int) -> Exception:
    """The error to raise for a failed write of ``path``: NoSpaceError when the disk is
    full (``needed``: the bytes the output needs), otherwise an OSError of one line."""
    if outputs.is_no_space(error):
        return NoSpaceError(path.parent, needed)
    text = str(error)
    # HDF5's message holds the system's after a time stamp and a buffer address
    system = re.search(r"error message = '([^']*)'", text)
    reason = system.group(1) if system else (text.splitlines()[0] if text else
                                             type(error).__name__)
    return OSError(f"{path}: cannot be written: {reason}")


@contextlib.contextmanager
def reserved(handle: h5py.File, path: Path, needed: int, report: int | None = None
             ) -> Iterator[None]:
    """Reserve ``needed`` bytes of disk past the end of ``handle``'s file for the block's
    writes (:func:`posteriorzoo.outputs.reserve_space`), and give back what they did not
    use when it ends. Raises NoSpaceError (``report``: the size its message gives)
    before the block runs when the space is not free."""
    descriptor = _descriptor(handle)
    start = os.fstat(descriptor).st_size if descriptor is not None else 0
    try:
        held = descriptor is not None and outputs.reserve_space(descriptor, start, needed)
    except OSError as error:
        if outputs.is_no_space(error):
            raise NoSpaceError(path.parent, needed if report is None else report) from None
        held = False
    if not held:  # no reservation on this system: the free space must do
        outputs.ensure_space(path.parent, needed, report=report)
    try:
        yield
    finally:
        if held:
            outputs.release_space(descriptor, start + needed)


@contextlib.contextmanager
def writing_h5(handle: h5py.File, path: Path, needed: int) -> Iterator[h5py.File]:
    """Yield ``handle`` and close it when the block ends. A failed write or close abandons
    the file (:func:`abandon`) and raises :func:`write_failure`'s error."""
    try:
        yield handle
    except (OSError, RuntimeError, ValueError) as error:
        abandon(handle)
        raise write_failure(path, error, needed) from None
    except BaseException:
        close_or_abandon(handle)
        raise
    error = close_or_abandon(handle)
    if error is not None:
        raise write_failure(path, error, needed) from None


def new_bytes(datasets: Iterable[h5py.Dataset], start: int, stop: int) -> int:
    """File space rows ``start .. stop-1`` take in ``datasets`` chunked along their first
    axis: the chunks no row before ``start`` touched (HDF5 writes whole chunks)."""
    total = 0
    for dataset in datasets:
        row_bytes = int(np.prod(dataset.shape[1:], dtype=np.int64)) * dataset.dtype.itemsize
        chunks = dataset.chunks
        if chunks is None:  # contiguous: exactly the rows
            total += (stop - start) * row_bytes
            continue
        rows = chunks[0]
        chunk_bytes = int(np.prod(chunks, dtype=np.int64)) * dataset.dtype.itemsize
        total += (math.ceil(stop / rows) - math.ceil(start / rows)) * chunk_bytes
    return total


def last_record_rows(mode_ids: Iterable[int], committed_modes: set[int]) -> dict[int, int]:
    """``{mode: row}``: the last row of ``/mode_records`` (whose ``mode_id`` column is
    ``mode_ids``) of each mode in ``committed_modes``; rows of other modes are leftovers of
    an interrupted append."""
    rows: dict[int, int] = {}
    for index, mode in enumerate(mode_ids):
        if int(mode) in committed_modes:
            rows[int(mode)] = index
    return rows


def parse_record(data: bytes) -> dict[str, Any] | None:
    """A stored training record as a dict; None unless it is a JSON object of finite
    numbers (what :func:`posteriorzoo.zoo.schema.record_bytes` writes)."""
    def refuse(constant: str) -> None:
        raise ValueError(constant)

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):  # 1e999
            raise ValueError(text)
        return value

    try:
        value = json.loads(data.decode("utf-8"), parse_constant=refuse, parse_float=finite)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _file_access() -> h5py.h5p.PropFAID:
    """File access of every writer: the format bounds of :data:`schema.HDF5_FORMAT`, and
    no HDF5 file locks (the writers' own ``flock`` serialises them, see
    :mod:`posteriorzoo.zoo.lifecycle`)."""
    access = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    low, high = (getattr(h5py.h5f, "LIBVER_" + name.upper()) for name in schema.HDF5_FORMAT)
    access.set_libver_bounds(low, high)
    access.set_file_locking(False, False)
    return access


def create_h5(path: Path) -> h5py.File:
    """A new, empty HDF5 file at ``path`` (truncated if it exists), written within
    :data:`schema.HDF5_FORMAT`."""
    return h5py.File(path, "w", libver=schema.HDF5_FORMAT, locking=False)


def open_h5(path: Path, mode: str) -> h5py.File:
    """Open an HDF5 file, turning library errors into :class:`ZooFormatError`.

    ``mode="r"`` reads. ``mode="a"`` appends, in single-writer / multiple-reader mode from
    the first byte HDF5 writes: the superblock then says "open for SWMR writing" at every
    moment the file is open, which readers and the next writer understand after a kill
    (a file opened for writing outside SWMR mode, even for an instant, is refused by every
    reader until HDF5's flag is cleared).
    """
    try:
        if mode == "r":
            try:
                # Plain mode first: it checks the file is whole (not truncated).
                return h5py.File(path, "r", locking=False)
            except OSError as error:
                if not any(m in str(error) for m in _CRASHED_WRITER_MARKERS):
                    raise
                # A writer is appending (or was killed): SWMR reading is safe either way.
                return h5py.File(path, "r", swmr=True, locking=False)
        flags = h5py.h5f.ACC_RDWR | h5py.h5f.ACC_SWMR_WRITE
        return h5py.File(h5py.h5f.open(os.fsencode(path), flags, fapl=_file_access()))
    except OSError as error:
        if mode != "r" and any(m in str(error) for m in _CRASHED_WRITER_MARKERS):
            raise
        if _NON_SWMR_WRITER_MARKER in str(error):
            raise ZooFormatError(
                f"{path}: left open for writing outside SWMR mode by a writer that was "
                "killed (an earlier posteriorzoo, or another program), so HDF5 refuses "
                f"to read it; clear HDF5's flag with 'h5clear -s {path}' (Debian's "
                "hdf5-tools), then check it with 'posteriorzoo verify'") from None
        raise ZooFormatError(
            f"{path}: cannot be read as HDF5 (truncated or corrupt): {error}") from None


def _require_model(path: Path, layout: Layout) -> None:
    """Refuse a collection whose model is not registered, naming the plugin it records."""
    from posteriorzoo.models import model_entry

    try:
        model_entry(layout.architecture, module=layout.model_module,
                    package=layout.model_package)
    except UnknownNameError as error:
        raise UnknownNameError(f"{path}: {error}") from None


class Zoo:
    """A collection of checkpoints of one architecture, dataset and method in one HDF5 file.

    Use :func:`open_zoo` or :func:`create_zoo` rather than the constructor. A zoo is a
    context manager; opened with ``mode="r+"`` it accepts :meth:`append`.

    The file's layout is checked when it opens (:mod:`posteriorzoo.zoo.layout`). Opened
    with ``verify=True``, a zoo also never returns checkpoint data it has not checked:
    reading checkpoint i checks its SHA-256 and its metadata row's, and reading layers
    across checkpoints first checks every checkpoint once. A mismatch raises
    :class:`ChecksumError`.

    Attributes
    ----------
    path : pathlib.Path
        The collection file.
    architecture, dataset, method : str
        What the checkpoints are (``architecture`` is a name of :mod:`posteriorzoo.models`
        unless the collection was created with ``validate=False``).
    num_classes : int or None
        Output size of the network.
    model_options : dict
        Keyword options of ``posteriorzoo.models.build`` (e.g. ``{"width": 8}``).
    recipe : dict
        The training recipe (free-form, JSON-serialisable).
    annotations : dict
        How the collection was derived from another one, if it was (e.g. canonicalized).
    """

    def __init__(self, path: Path, handle: h5py.File, lock_fd: int | None = None, *,
                 verify: bool = False, final_path: Path | None = None) -> None:
        self.path = path
        self._file = handle
        self._lock_fd = lock_fd
        self._final_path = final_path
        #: Opens the file for writing at the first write of a writer opened read-only
        #: under its lock (see :func:`posteriorzoo.zoo.lifecycle.open_zoo`): given the
        #: path and the lock, returns the handle and the lock (a rebuilt file's).
        self._start_writing: Callable[[Path, int], tuple[h5py.File, int]] | None = None
        self._overwrite = False
        self.verify = bool(verify)
        self._verified_upto = 0
        self._verified: set[int] = set()
        #: The file as it was before its first check (posteriorzoo.zoo.verified), and
        #: whether a note in the user's cache says it is verified.
        self._seen: tuple[dict[str, int] | None, int] | None = None
        self._noted = False
        with self._reading("the collection's structure"):
            layout = read_layout(handle, path)
        self.layout = layout
        self.architecture = layout.architecture
        self.dataset = layout.dataset
        self.method = layout.method
        self.num_classes = layout.num_classes
        self.model_options: dict[str, Any] = layout.model_options
        self.recipe: dict[str, Any] = layout.recipe
        self.annotations: dict[str, Any] = layout.annotations
        self.created_by: dict[str, Any] = layout.created_by
        self._keys: list[str] = layout.state_keys
        group = handle[STATE_GROUP]
        self._datasets = {key: group[key] for key in self._keys}
        # One checkpoint's shape and dtype per key, read once: the datasets grow along the
        # checkpoint axis only, and h5py asks HDF5 again on every .shape and .dtype.
        self._row_layout = {key: (tuple(ds.shape[1:]), ds.dtype)
                            for key, ds in self._datasets.items()}
        if layout.validated:
            _require_model(path, layout)
            try:
                check_architecture(self.architecture, self.tensor_layout, self.num_classes,
                                   self.model_options)
            except PosteriorZooError as error:
                raise ZooFormatError(
                    f"{path}: does not fit architecture {self.architecture}: {error}") from None

    @contextlib.contextmanager
    def _reading(self, what: str) -> Iterator[None]:
        """Turn HDF5 library errors while reading ``what`` into one ZooFormatError."""
        try:
            yield
        except PosteriorZooError:
            raise
        except (OSError, RuntimeError, KeyError, ValueError, TypeError) as error:
            raise ZooFormatError(
                f"{self.path}: {what} cannot be read (corrupt file): {error}") from None

    # ------------------------------------------------------------------ structure
    def _committed(self) -> int:
        with self._reading("the committed count"):
            dataset = self._file[COMMITTED]
            if self._file.swmr_mode:
                dataset.refresh()
            return int(dataset[0])

    @property
    def writable(self) -> bool:
        return self._lock_fd is not None

    @property
    def has_row_digests(self) -> bool:
        """Whether metadata rows carry digests (schema 2; schema 1 files have none)."""
        return ROW_DIGESTS in self._file

    @property
    def has_training_records(self) -> bool:
        """Whether the file can hold training records (schema 3; older files have none)."""
        return MODE_RECORDS in self._file

    @property
    def metadata_dtype(self) -> np.dtype:
        """The table the file stores its metadata rows in: its schema version's
        (:func:`~posteriorzoo.zoo.schema.metadata_dtype`; a rebuild keeps it)."""
        return schema.metadata_dtype(self.layout.schema_version)

    def __len__(self) -> int:
        """Number of complete checkpoints."""
        return self._committed()

    @property
    def state_keys(self) -> list[str]:
        """State keys (parameters and buffers) in the model's state_dict order."""
        return list(self._keys)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of each tensor of one checkpoint (without the checkpoint axis)."""
        return {key: shape for key, (shape, _) in self._row_layout.items()}

    @property
    def dtypes(self) -> dict[str, np.dtype]:
        """Stored dtype of each tensor."""
        return {key: dtype for key, (_, dtype) in self._row_layout.items()}

    @property
    def tensor_layout(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``{key: (shape, dtype)}`` of one checkpoint, in state_dict order."""
        return dict(self._row_layout)

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of one checkpoint's tensors."""
        return sum(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                   for shape, dtype in self.tensor_layout.values())

    def space_needed(self, checkpoints: int, records: int = 0) -> int:
        """Estimated bytes of file space appending ``checkpoints`` checkpoints (and
        ``records`` training records) takes."""
        start = len(self)
        with self._reading("the collection's structure"):
            growing = [*self._datasets.values(), self._file[METADATA], self._file[ROW_DIGESTS]]
            needed = METADATA_MARGIN + new_bytes(growing, start, start + checkpoints)
            if records and self.has_training_records:
                table = self._file[MODE_RECORDS]
                needed += new_bytes([table], table.shape[0], table.shape[0] + records)
            return needed

    def _output_size(self, needed: int) -> int:
        """What a NoSpaceError says the output needs: ``needed`` more bytes, plus for a
        collection not yet published what it holds already (a failure deletes it)."""
        return needed if self.published else needed + outputs.disk_usage(self.path)

    def check_space(self, checkpoints: int) -> None:
        """Refuse (:class:`~posteriorzoo.errors.NoSpaceError`) unless the collection's
        folder has room for ``checkpoints`` more checkpoints; writes nothing."""
        needed = self.space_needed(checkpoints)
        outputs.ensure_space(self.path.parent, needed, report=self._output_size(needed))

    @contextlib.contextmanager
    def _writing(self, needed: int) -> Iterator[None]:
        """Abandon the file when a write fails (see :func:`abandon`), raising NoSpaceError
        for a full disk (``needed``: the output's size for its message)."""
        try:
            yield
        except (OSError, RuntimeError, ValueError) as error:
            abandon(self._file)
            raise write_failure(self.path, error, needed) from None

    def dataset_handle(self, key: str) -> h5py.Dataset:
        """The raw h5py dataset of ``key`` (rows past ``len(self)`` are not checkpoints).

        With ``verify=True`` every checkpoint is checked before the handle is returned.
        """
        self._require_key(key)
        self.verify_all()
        return self._datasets[key]

    def _require_key(self, key: str) -> None:
        if key not in self._datasets:
            raise UnknownNameError(
                f"{self.path}: no tensor {key!r}; it holds {', '.join(self._keys)}"
            )

    # ------------------------------------------------------------------ integrity
    def block_rows(self, budget: int = _VERIFY_BLOCK_BYTES) -> int:
        """Checkpoints per block so that one block of whole checkpoints fits ``budget`` bytes."""
        return max(1, budget // max(1, self.checkpoint_bytes))

    def check_checkpoints(self, start: int, stop: int,
                          arrays: Mapping[str, np.ndarray] | None = None
                          ) -> list[tuple[int, str]]:
        """Check checkpoints ``start .. stop-1``: returns ``(index, problem)`` pairs.

        A problem is a tensor digest that differs from the stored SHA-256, a metadata row
        that differs from its stored digest (schema 2), or NaN/inf weights in a checkpoint
        not flagged diverged. ``arrays`` (``{key: (stop-start, *shape)}``) avoids reading
        the tensors again when the caller already has them.
        """
        with self._reading(f"checkpoints {start}..{stop - 1}"):
            if arrays is None:
                arrays = {key: self._datasets[key][start:stop] for key in self._keys}
            rows = self._file[METADATA][start:stop]
            digests = self._file[ROW_DIGESTS][start:stop] if self.has_row_digests else None

        def check(offset: int) -> list[tuple[int, str]]:
            index = start + offset
            found = []
            checkpoint = {key: arrays[key][offset] for key in self._keys}
            if checkpoint_digest(checkpoint, self._keys) != bytes(rows["sha256"][offset]).decode(
                    errors="replace"):
                found.append((index, "its tensors differ from their stored SHA-256"))
            if digests is not None and row_digest(rows[offset]) != bytes(
                    digests[offset]).decode(errors="replace"):
                found.append((index, "its metadata row differs from its stored SHA-256"))
            finite = all(all_finite(value) for value in checkpoint.values())
            if not finite and not rows["diverged"][offset]:
                found.append((index, "it holds NaN/inf weights without the diverged flag"))
            return found

        return [problem for offset in range(stop - start) for problem in check(offset)]

    def _raise_problems(self, problems: list[tuple[int, str]]) -> None:
        if problems:
            verified.forget(self.path)
            index, problem = problems[0]
            more = f" ({len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
            raise ChecksumError(f"{self.path}: checkpoint {index} is corrupt: {problem}{more}; "
                                "'posteriorzoo verify' reports all damage")

    def _content_digest(self, count: int) -> str:
        """:func:`posteriorzoo.zoo.verified.content_digest` of the first ``count`` rows."""
        with self._reading("the metadata table"):
            rows = self._file[METADATA][:count]
            digests = self._file[ROW_DIGESTS][:count] if self.has_row_digests else None
        return verified.content_digest(rows, digests)

    def _trust_note(self) -> None:
        """With ``verify=True``, before the first check: when a note in the user's cache
        says this file, unchanged since, was verified (:mod:`posteriorzoo.zoo.verified`),
        its committed checkpoints count as checked; otherwise remember how the file looked
        before the checks start, to note it once they all pass."""
        if not self.verify or self._seen is not None or not verified.enabled():
            return
        self._seen = verified.snapshot(self.path)
        count = len(self)
        if count and verified.recorded(self.path, self._seen[0], count,
                                       self._content_digest(count)):
            self._verified_upto = max(self._verified_upto, count)
            self._noted = True

    def _checked_through(self, stop: int) -> None:
        """Rows ``0 .. stop-1`` are checked; once they are all the committed ones, note it
        in the user's cache (see :meth:`_trust_note`)."""
        self._verified_upto = stop
        count = len(self)
        if stop >= count and not self._noted and self._seen is not None and count:
            self._noted = verified.remember(self.path, self._seen, count,
                                            self._content_digest(count))

    def verify_all(self) -> None:
        """With ``verify=True``: check every checkpoint not yet checked (once per zoo),
        unless a note in the user's cache says this file, unchanged, was verified
        (:mod:`posteriorzoo.zoo.verified`)."""
        if not self.verify:
            return
        self._trust_note()
        count = len(self)
        rows = self.block_rows()
        for start in range(self._verified_upto, count, rows):
            stop = min(count, start + rows)
            self._raise_problems(self.check_checkpoints(start, stop))
            self._checked_through(stop)

    def _verify_rows(self) -> None:
        if not self.verify or not self.has_row_digests:
            return
        self._trust_note()
        with self._reading("the metadata table"):
            count = len(self)
            if count <= self._verified_upto:  # verify_all already checked these rows
                return
            rows = self._file[METADATA][:count]
            digests = self._file[ROW_DIGESTS][:count]
        for index in range(count):
            if row_digest(rows[index]) != bytes(digests[index]).decode(errors="replace"):
                self._raise_problems(
                    [(index, "its metadata row differs from its stored SHA-256")])

    # ------------------------------------------------------------------ reading
    def layer(self, key: str, index: slice | Sequence[int] | np.ndarray | None = None
              ) -> np.ndarray:
        """One tensor across checkpoints.

        Parameters
        ----------
        key : str
            A state key, e.g. ``"conv2.weight"``.
        index : slice, sequence of int, boolean mask, or None
            Which checkpoints (default: all committed ones), in the order given.

        Returns
        -------
        numpy.ndarray of shape (n_selected, *tensor_shape), in the stored dtype.
        """
        self._require_key(key)
        self.verify_all()
        with self._reading(f"tensor {key!r}"):
            return self._layer(key, index)

    def _layer(self, key: str, index: slice | Sequence[int] | np.ndarray | None) -> np.ndarray:
        dataset = self._datasets[key]
        if self._file.swmr_mode:
            dataset.refresh()
        count = len(self)
        if index is None:
            return dataset[:count]
        if isinstance(index, slice):
            start, stop, step = index.indices(count)
            if step == 1:
                return dataset[start:stop]
            index = np.arange(start, stop, step)
        selector = np.asarray(index)
        if selector.dtype != bool:
            selector = selector.astype(np.int64)
        positions = np.arange(count)[selector]
        if positions.size == 0:
            return np.empty((0, *dataset.shape[1:]), dataset.dtype)
        order = np.argsort(positions, kind="stable")
        unique, inverse = np.unique(positions[order], return_inverse=True)
        block = dataset[unique]
        result = np.empty((positions.size, *dataset.shape[1:]), dataset.dtype)
        result[order] = block[inverse]
        return result

    def layer_blocks(self, key: str, rows: int = 256) -> Iterator[tuple[int, np.ndarray]]:
        """Stream one tensor across checkpoints in blocks: yields ``(start, block)``.

        ``block`` has shape (<= rows, *tensor_shape); memory stays bounded by one block.
        """
        self._require_key(key)
        self.verify_all()
        count = len(self)
        for start in range(0, count, rows):
            with self._reading(f"tensor {key!r}"):
                block = self._datasets[key][start:min(count, start + rows)]
            yield start, block

    def checkpoint_blocks(self, rows: int | None = None
                          ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """Stream whole checkpoints in blocks: yields ``(start, {key: (B, *shape)})``.

        With ``verify=True`` each block is checked as it is read (no second read).
        """
        rows = rows or self.block_rows()
        self._trust_note()
        count = len(self)
        for start in range(0, count, rows):
            stop = min(count, start + rows)
            with self._reading(f"checkpoints {start}..{stop - 1}"):
                block = {key: self._datasets[key][start:stop] for key in self._keys}
            if self.verify and stop > self._verified_upto:
                self._raise_problems(self.check_checkpoints(start, stop, block))
                if start <= self._verified_upto:
                    self._checked_through(stop)
            yield start, block

    def arrays(self, index: int) -> dict[str, np.ndarray]:
        """Checkpoint ``index`` as ``{key: numpy array}`` in state_dict order."""
        count = len(self)
        if not -count <= index < count:
            raise IndexError(f"checkpoint {index} out of range; the zoo holds {count}")
        index %= count
        self._trust_note()
        with self._reading(f"checkpoint {index}"):
            arrays = {key: ds[index] for key, ds in self._datasets.items()}
        if self.verify and index >= self._verified_upto and index not in self._verified:
            self._raise_problems(self.check_checkpoints(
                index, index + 1, {key: value[None] for key, value in arrays.items()}))
            self._verified.add(index)
        return arrays

    def state_dict(self, index: int) -> dict[str, torch.Tensor]:
        """Checkpoint ``index`` as a state_dict for ``model.load_state_dict``."""
        # h5py returns fresh arrays, so sharing their memory with the tensors is safe.
        return {key: torch.from_numpy(np.asarray(value))
                for key, value in self.arrays(index).items()}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for index in range(len(self)):
            yield self.state_dict(index)

    @property
    def metadata(self) -> np.ndarray:
        """Metadata table: a structured array of shape (N,), columns in
        ``schema.COLUMN_NAMES``; string columns are numpy ``str`` (decoded UTF-8).

        Every column is there whatever the file's schema version: one an older file does
        not store holds its missing value (``chain`` -1 in a schema 1 to 3 file)."""
        return decode_table(schema.as_table(self.stored_metadata()))

    def stored_metadata(self) -> np.ndarray:
        """The metadata table as stored (string columns as UTF-8 bytes, the columns of
        the file's schema version, :attr:`metadata_dtype`): what the row digests cover."""
        self._verify_rows()
        with self._reading("the metadata table"):
            dataset = self._file[METADATA]
            if self._file.swmr_mode:
                dataset.refresh()
            return dataset[: len(self)]

    @property
    def digests(self) -> list[str]:
        """Every committed checkpoint's tensor SHA-256 (hex), in order."""
        return [bytes(value).decode(errors="replace")
                for value in self.stored_metadata()["sha256"]]

    def training_records(self) -> dict[int, dict[str, Any]]:
        """What each mode's method phase recorded while training (mode id -> record).

        Only modes with committed checkpoints, in ascending order; a mode recorded more
        than once (a resumed run appended it again) is described by its last record.
        Schema 1 and 2 collections store no records, so this is empty for them; the
        diagnostics (:func:`posteriorzoo.collection.diagnose`) then say what only a
        record could tell. With ``verify=True`` each record is checked against its stored
        SHA-256 (a mismatch raises :class:`ChecksumError`); a record that is not a JSON
        object raises :class:`ZooFormatError`.
        """
        records = {}
        for mode, data, digest in self._stored_records():
            if self.verify and record_digest(data) != digest:
                raise ChecksumError(
                    f"{self.path}: the training record of mode {mode} is corrupt: it "
                    "differs from its stored SHA-256; 'posteriorzoo verify' reports all damage")
            record = parse_record(data)
            if record is None:
                raise ZooFormatError(f"{self.path}: the training record of mode {mode} is "
                                     "not a JSON object of finite numbers (corrupt file)")
            records[mode] = record
        return records

    def check_records(self) -> list[tuple[int, str]]:
        """Check the training records of the committed modes: ``(mode, problem)`` pairs.

        A problem is a record whose bytes differ from its stored SHA-256, or one that is
        not a JSON object of finite numbers.
        """
        problems = []
        for mode, data, digest in self._stored_records():
            if record_digest(data) != digest:
                problems.append((mode, "its training record differs from its stored SHA-256"))
            elif parse_record(data) is None:
                problems.append((mode, "its training record is not a JSON object"))
        return problems

    def record_rows(self) -> dict[int, int]:
        """``{mode: row of /mode_records}``: the row describing each committed mode."""
        if not self.has_training_records:
            return {}
        table = self.stored_metadata()
        committed_modes = {int(mode) for mode in table["mode_id"] if mode >= 0}
        with self._reading("the training records"):
            records = self._file[MODE_RECORDS]
            if self._file.swmr_mode:
                records.refresh()
            # A record is written in the block that commits its mode's checkpoints, never
            # more records than checkpoints: rows past the committed count are leftovers.
            stop = min(records.shape[0], len(table))
            mode_ids = records.fields("mode_id")[:stop] if stop else np.zeros(0, np.int64)
        return last_record_rows(mode_ids.tolist(), committed_modes)

    def _stored_records(self) -> Iterator[tuple[int, bytes, str]]:
        """``(mode, record bytes, stored SHA-256)`` of each committed mode, ascending."""
        by_row = sorted((row, mode) for mode, row in self.record_rows().items())
        found = []
        for start in range(0, len(by_row), _RECORD_BLOCK_ROWS):
            block = by_row[start:start + _RECORD_BLOCK_ROWS]
            with self._reading("the training records"):
                rows = self._file[MODE_RECORDS][[row for row, _ in block]]
            for (_, mode), stored in zip(block, rows, strict=True):
                found.append((mode, bytes(stored["record"]),
                              bytes(stored["sha256"]).decode(errors="replace")))
        return iter(sorted(found))

    def metadata_dict(self, index: int) -> dict[str, Any]:
        """Metadata row ``index`` as a plain dict (strings decoded)."""
        count = len(self)
        if not -count <= index < count:
            raise IndexError(f"checkpoint {index} out of range; the zoo holds {count}")
        index %= count
        with self._reading(f"metadata row {index}"):
            row = self._file[METADATA][index]  # one row, not the whole table
            if self.verify and self.has_row_digests and row_digest(row) != bytes(
                    self._file[ROW_DIGESTS][index]).decode(errors="replace"):
                self._raise_problems(
                    [(index, "its metadata row differs from its stored SHA-256")])
        # a column the file's schema does not store reads as missing (see metadata)
        table = schema.as_table(np.asarray(row))
        return {name: schema.decode(table[name][()]) for name in METADATA_DTYPE.names}

    # ------------------------------------------------------------------ writing
    def append(self, state_dict: Mapping[str, ArrayLike], **metadata: Any) -> int:
        """Append one checkpoint; returns its index. See :meth:`append_many`."""
        return self.append_many([state_dict], [metadata])[0]

    def append_many(
        self,
        state_dicts: Sequence[Mapping[str, ArrayLike]],
        metadata: Sequence[Mapping[str, Any]] | None = None,
        records: Mapping[int, Mapping[str, Any]] | None = None,
    ) -> range:
        """Append whole checkpoints atomically; returns their indices.

        Every checkpoint is validated (keys, shapes, dtypes, finite values unless its
        metadata says ``diverged=True``, metadata values of the columns' types) before
        anything is written, so a bad one leaves the file untouched. Metadata keys are
        column names of :data:`posteriorzoo.zoo.schema.METADATA_COLUMNS`; ``versions``
        defaults to the running library versions, ``method`` to the collection's method.
        A file of schema 1 to 3 has no ``chain`` column: a chain given for it is dropped
        with a warning (:meth:`prepare`).

        ``records`` maps a ``mode_id`` of these checkpoints to what its method phase
        recorded while training (a JSON object, see
        :func:`posteriorzoo.zoo.schema.record_bytes`); each is validated with the
        checkpoints and committed with them (:meth:`training_records` reads them back).
        """
        if not self.writable:
            raise ZooFormatError(f"{self.path}: opened read-only; use open_zoo(path, mode='r+')")
        metadata = list(metadata) if metadata is not None else [{} for _ in state_dicts]
        if len(metadata) != len(state_dicts):
            raise ZooSchemaError("state_dicts and metadata differ in length")
        if not state_dicts:
            if records:
                raise ZooSchemaError("a training record is appended with its mode's "
                                     "checkpoints; none were given")
            return range(len(self), len(self))
        rows, stacks = self.prepare(state_dicts, metadata)
        return self._write_block(stacks, rows, self.prepare_records(records, rows))

    def prepare_records(self, records: Mapping[int, Mapping[str, Any]] | None,
                        rows: np.ndarray) -> np.ndarray:
        """Validate training records for the checkpoints whose metadata rows are ``rows``
        and build their ``/mode_records`` rows (ascending mode) without writing anything.

        Raises :class:`ZooSchemaError` for a key that is not a ``mode_id`` of ``rows``, or
        a record that is not JSON (see :func:`posteriorzoo.zoo.schema.record_bytes`).
        """
        if not records:
            return np.zeros(0, dtype=RECORD_DTYPE)
        if not isinstance(records, Mapping):
            raise ZooSchemaError(f"training records must map mode_id to a record, not "
                                 f"{type(records).__name__}")
        if not self.has_training_records and self._start_writing is None:
            # (a pending rebuild gives the file its table before the first append)
            raise ZooFormatError(f"{self.path}: this collection cannot hold training records")
        modes = {int(mode) for mode in rows["mode_id"]}
        prepared = []
        for mode, record in records.items():
            if isinstance(mode, bool | np.bool_) or not isinstance(mode, int | np.integer):
                raise ZooSchemaError(f"training records are keyed by mode_id (an integer), "
                                     f"not {mode!r}")
            if mode < 0 or int(mode) not in modes:
                raise ZooSchemaError(
                    f"training record of mode {mode}: no checkpoint of this append has "
                    f"mode_id {mode}; a record is appended with its mode's checkpoints")
            data = record_bytes(record, int(mode))
            prepared.append((int(mode), data, record_digest(data).encode()))
        return np.array(sorted(prepared), dtype=RECORD_DTYPE)

    def prepare(self, state_dicts: Sequence[Mapping[str, ArrayLike]],
                metadata: Sequence[Mapping[str, Any]]
                ) -> tuple[np.ndarray, dict[str, list[np.ndarray]]]:
        """Validate checkpoints and build their metadata rows without writing anything.

        Returns ``(rows, {key: [array, ...]})``; raises on the first bad checkpoint. The
        rows are of the current table (:data:`~posteriorzoo.zoo.schema.METADATA_DTYPE`);
        a file of an older schema stores them in its own, without the columns it lacks:
        a value given for one of those (a ``chain`` for a schema 1 to 3 file) is dropped
        with a warning, not refused (:mod:`posteriorzoo.zoo.schema`).
        """
        versions = canonical_json(library_versions())
        stacks: dict[str, list[np.ndarray]] = {key: [] for key in self._keys}
        rows = np.zeros(len(state_dicts), dtype=METADATA_DTYPE)
        now = time.time()
        for position, (state, values) in enumerate(zip(state_dicts, metadata, strict=True)):
            diverged = values.get("diverged", False)
            if not isinstance(diverged, bool | np.bool_):
                raise ZooSchemaError(f"checkpoint {position}: metadata 'diverged' must be "
                                     f"a boolean, not {diverged!r}")
            arrays = self._validated(state, bool(diverged), position)
            values = {"versions": versions, "method": self.method, **values}
            row = metadata_row(values)
            row["sha256"] = checkpoint_digest(arrays, self._keys).encode()
            row["written_at"] = now
            rows[position] = row
            for key in self._keys:
                stacks[key].append(arrays[key])
        dropped = schema.dropped_columns(rows, self.metadata_dtype)
        if dropped:
            # Rows are stored in the file's own table (their digests hash them there), so
            # an older file keeps no such column: dropped rather than refused, so that a
            # run begun before the column existed can be resumed (module docstring).
            warnings.warn(f"{self.path}: a schema {self.layout.schema_version} collection "
                          f"has no metadata column {', '.join(map(repr, dropped))}; the "
                          "values given are not stored (they read as not recorded); a new "
                          "collection stores them", stacklevel=3)
        return rows, stacks

    def _validated(self, state: Mapping[str, ArrayLike], diverged: bool, position: int
                   ) -> dict[str, np.ndarray]:
        keys = list(state.keys())
        if set(keys) != set(self._keys):
            missing = [k for k in self._keys if k not in state]
            extra = [k for k in keys if k not in self._datasets]
            raise ZooSchemaError(
                f"checkpoint {position}: keys do not match the collection "
                f"(missing {missing[:3]}, unexpected {extra[:3]})"
            )
        arrays = {}
        for key in self._keys:
            array = as_numpy(state[key])
            shape, dtype = self._row_layout[key]
            if array.shape != shape:
                raise ZooSchemaError(
                    f"checkpoint {position}: {key} has shape {array.shape}, "
                    f"the collection stores {shape}"
                )
            if array.dtype != dtype:
                raise ZooSchemaError(
                    f"checkpoint {position}: {key} has dtype {array.dtype}, "
                    f"the collection stores {dtype}"
                )
            if not diverged and not all_finite(array):
                raise NonFiniteWeightsError(
                    f"checkpoint {position}: {key} has NaN or infinite values "
                    "(pass diverged=True to record a diverged run)"
                )
            arrays[key] = array
        return arrays

    def _write_block(self, blocks: Mapping[str, Sequence[np.ndarray]], rows: np.ndarray,
                     records: np.ndarray | None = None) -> range:
        if rows.shape[0] > MAX_APPEND_ROWS:
            raise ZooSchemaError(f"one append adds at most {MAX_APPEND_ROWS} checkpoints, not "
                                 f"{rows.shape[0]}: append them in parts")
        self._open_for_writing()
        start = len(self)
        stop = start + rows.shape[0]
        records = records if records is not None else np.zeros(0, dtype=RECORD_DTYPE)
        needed = self.space_needed(stop - start, len(records))
        report = self._output_size(needed)
        # The block's disk space is allocated before the file changes: on a full disk the
        # collection stays as it was, and the writes cannot run out of space midway.
        with self._writing(report), reserved(self._file, self.path, needed, report):
            for key in self._keys:
                dataset = self._datasets[key]
                dataset.resize(stop, axis=0)
                fault_point("zoo-resized")
                arrays = blocks[key]
                if sum(array.nbytes for array in arrays) <= _STACK_BYTES:
                    dataset[start:stop] = np.stack(arrays)
                else:  # large tensors: one write each rather than a stacked copy
                    for offset, array in enumerate(arrays):
                        dataset[start + offset] = array
                fault_point("zoo-tensor-written")
            self._commit_rows(start, rows, records)
        return range(start, stop)

    def _commit_rows(self, start: int, rows: np.ndarray, records: np.ndarray) -> None:
        """Write the metadata rows (and training records) of checkpoints ``start ..`` whose
        tensors are written, then advance the committed count past them."""
        stop = start + rows.shape[0]
        table = self._file[METADATA]
        # in the file's own table, and hashed there (prepare warned of what is dropped)
        rows = schema.as_table(rows, table.dtype)
        table.resize(stop, axis=0)
        table[start:stop] = rows
        fault_point("zoo-rows-written")
        digests = self._file[ROW_DIGESTS]
        digests.resize(stop, axis=0)
        digests[start:stop] = np.array([row_digest(row).encode() for row in rows],
                                       dtype=digests.dtype)
        if len(records):
            # The checkpoint rows reach the file first: whatever a kill leaves, the
            # record table is never longer than the metadata table (layout checks).
            self._file.flush()
            table = self._file[MODE_RECORDS]
            first = table.shape[0]
            table.resize(first + len(records), axis=0)
            fault_point("zoo-records-resized")
            table[first:] = records
        # The commit point: data first, then the count that makes it visible.
        self._file.flush()
        fault_point("zoo-before-commit")
        self._file[COMMITTED][0] = stop
        self._file.flush()
        fault_point("zoo-commit")

    # ------------------------------------------------------------------ placed writes
    def write_uncommitted(self, position: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Write one checkpoint's tensors (``arrays``, as :meth:`prepare` returns them:
        ``{key: [array]}`` or ``{key: array}``) at row ``len(self) + position``, without
        committing it.

        This is how an import puts each checkpoint straight at its final row whatever
        order its inputs arrive in (:func:`posteriorzoo.collection.import_checkpoints`):
        the datasets grow to hold the row, rows are written in any order, and nothing is
        visible to readers until :meth:`commit_uncommitted` commits the rows written (a
        kill before leaves rows past the committed count, which readers never read and
        the next writer cuts off). Writing a row again replaces it.
        """
        if not self.writable:
            raise ZooFormatError(f"{self.path}: opened read-only; use open_zoo(path, mode='r+')")
        if isinstance(position, bool) or not 0 <= position < MAX_APPEND_ROWS:
            raise ZooSchemaError(f"a checkpoint is placed at most {MAX_APPEND_ROWS} rows past "
                                 f"the committed ones, not {position}")
        self._open_for_writing()
        row = len(self) + int(position)
        needed = new_bytes(self._datasets.values(), row, row + 1)
        report = self._output_size(needed)
        with self._writing(report), reserved(self._file, self.path, needed, report):
            for key in self._keys:
                dataset = self._datasets[key]
                if dataset.shape[0] <= row:
                    dataset.resize(row + 1, axis=0)
                    fault_point("zoo-resized")
                value = arrays[key]
                dataset[row] = value[0] if isinstance(value, list | tuple) else value
                fault_point("zoo-tensor-written")

    def commit_uncommitted(self, rows: np.ndarray) -> range:
        """Commit the checkpoints written past the committed count by
        :meth:`write_uncommitted`, with their metadata rows ``rows`` (from
        :meth:`prepare`, in row order; ``sha256`` is each checkpoint's digest).

        Every row ``len(self) .. len(self)+len(rows)-1`` must have been written: the caller
        places them; the digests that :meth:`verify_all` checks later catch a row that was
        not. Returns the committed indices.
        """
        if not self.writable:
            raise ZooFormatError(f"{self.path}: opened read-only; use open_zoo(path, mode='r+')")
        self._open_for_writing()
        start = len(self)
        stop = start + rows.shape[0]
        short = [key for key, dataset in self._datasets.items() if dataset.shape[0] < stop]
        if short:
            raise ZooSchemaError(f"{self.path}: rows {start}..{stop - 1} of {short[0]!r} "
                                 "were never written")
        needed = self.space_needed(0) + new_bytes(
            [self._file[METADATA], self._file[ROW_DIGESTS]], start, stop)
        with self._writing(needed), reserved(self._file, self.path, needed):
            self._commit_rows(start, rows, np.zeros(0, dtype=RECORD_DTYPE))
        return range(start, stop)

    def _open_for_writing(self) -> None:
        """Reopen a writer that has read the file only so far for writing: nothing in the
        file changes until the first append (a refused one included)."""
        if self._start_writing is None or self._lock_fd is None:
            return
        start, self._start_writing = self._start_writing, None
        self._file.close()
        lock, self._lock_fd = self._lock_fd, None  # start() owns it, and releases it if it fails
        self._file, self._lock_fd = start(self.path, lock)
        fault_point("zoo-opened")
        group = self._file[STATE_GROUP]
        self._datasets = {key: group[key] for key in self._keys}

    # ------------------------------------------------------------------ publishing
    @property
    def published(self) -> bool:
        """False while a new collection is still under its temporary name."""
        return self._final_path is None

    def publish(self, overwrite: bool = False) -> Path:
        """Move a collection created with ``publish=False`` to its final name.

        Readers never see it before: until then it has a temporary name that a later
        writer reclaims if this process dies. Returns the final path.
        """
        from posteriorzoo.outputs import publish

        if self._final_path is None:
            return self.path
        with self._writing(METADATA_MARGIN):
            self._file.flush()
        fault_point("zoo-publish")
        publish(self.path, self._final_path, overwrite=overwrite)
        self.path, self._final_path = self._final_path, None
        return self.path

    def discard(self) -> None:
        """Close and delete a collection that was never published (no-op otherwise)."""
        if self._final_path is None:
            self.close()
            return
        partial = self.path
        try:
            with contextlib.suppress(OSError, PosteriorZooError):  # it is deleted anyway
                self.close()
        finally:
            partial.unlink(missing_ok=True)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the file and release the writer's lock.

        A close whose last flush fails (a full disk) abandons the file (:func:`abandon`)
        and raises NoSpaceError (or OSError).
        """
        try:
            fault_point("zoo-close")
            error = close_or_abandon(self._file)
            if error is not None:
                raise write_failure(self.path, error, METADATA_MARGIN) from None
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def __enter__(self) -> Zoo:
        return self

    def __exit__(self, exc_type: type | None, *exc_info: object) -> None:
        # An unpublished collection is published when its block completes and deleted
        # when the block raises (or a write failed): it appears complete or not at all.
        if self._final_path is None:
            if exc_type is None:
                self.close()
            else:  # the block's error is the one to report
                with contextlib.suppress(OSError, PosteriorZooError):
                    self.close()
        elif exc_type is None and self._file.id.valid:
            try:
                self.publish(overwrite=self._overwrite)
                self.close()
            except BaseException:
                self.discard()
                raise
        else:
            self.discard()

    def __repr__(self) -> str:
        state = "open" if self._file.id.valid else "closed"
        return (f"<Zoo {self.path.name!s}: {self.architecture} / {self.dataset} / {self.method}, "
                f"{len(self) if self._file.id.valid else '?'} checkpoints, {state}>")


@public
def iter_checkpoints(zoo: Zoo, indices: Iterable[int] | None = None
                     ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Yield ``(index, state_dict)`` for the given (default: all) checkpoints."""
    for index in range(len(zoo)) if indices is None else indices:
        yield index, zoo.state_dict(index)
