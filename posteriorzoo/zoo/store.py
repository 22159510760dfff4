"""The HDF5 checkpoint store: one collection of same-architecture checkpoints per file.

Two access patterns are first-class:

- one layer across all N checkpoints, ``zoo.layer("conv2.weight")`` -> array (N, 10, 1, 5, 5),
  read from one dataset chunked along the checkpoint axis;
- checkpoint i as a state_dict, ``zoo.state_dict(i)`` -> ``{key: torch.Tensor}``.

Appends are crash-safe: whole checkpoints are written and flushed before the committed
count advances (see :mod:`posteriorzoo.zoo.lifecycle` for creating and opening files).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from posteriorzoo.errors import (
    NonFiniteWeightsError,
    UnknownNameError,
    ZooFormatError,
    ZooSchemaError,
)
from posteriorzoo.zoo import schema
from posteriorzoo.zoo.schema import (
    FORMAT_NAME,
    METADATA_DTYPE,
    SCHEMA_VERSION,
    canonical_json,
    checkpoint_digest,
    metadata_row,
)

#: Target size of one chunk of a state dataset; small layers pack many checkpoints per chunk.
DEFAULT_CHUNK_BYTES = 1 << 18
MAX_CHUNK_ROWS = 1024
_METADATA_CHUNK_ROWS = 256
#: Batches of one tensor up to this size are stacked into one write.
_STACK_BYTES = 1 << 24
_STATE_GROUP = "state"
_CRASHED_WRITER_MARKERS = ("already open for write", "consistency flags")

ArrayLike = torch.Tensor | np.ndarray


def as_numpy(value: ArrayLike) -> np.ndarray:
    """A tensor or array as a numpy array (tensors are detached and moved to the CPU)."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            raise ZooSchemaError("bfloat16 tensors are not supported; convert to float32")
        return value.detach().cpu().numpy()
    return np.asarray(value)






def open_h5(path: Path, mode: str) -> h5py.File:
    """Open an HDF5 file, turning library errors into :class:`ZooFormatError`."""
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
        return h5py.File(path, "r+", libver="latest", locking=False)
    except OSError as error:
        if mode != "r" and any(m in str(error) for m in _CRASHED_WRITER_MARKERS):
            raise
        raise ZooFormatError(
            f"{path}: cannot be read as HDF5 (truncated or corrupt): {error}") from None


class Zoo:
    """A collection of checkpoints of one architecture, dataset and method in one HDF5 file.

    Use :func:`open_zoo` or :func:`create_zoo` rather than the constructor. A zoo is a
    context manager; opened with ``mode="a"`` it accepts :meth:`append`.

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

    def __init__(self, path: Path, handle: h5py.File, lock_fd: int | None = None) -> None:
        self.path = path
        self._file = handle
        self._lock_fd = lock_fd
        self._check_layout()
        attrs = handle.attrs
        self.architecture = str(attrs["architecture"])
        self.dataset = str(attrs["dataset"])
        self.method = str(attrs["method"])
        num_classes = int(attrs["num_classes"])
        self.num_classes = None if num_classes < 0 else num_classes
        self.model_options: dict[str, Any] = json.loads(attrs["model_options"])
        self.recipe: dict[str, Any] = json.loads(attrs["recipe"])
        self.annotations: dict[str, Any] = json.loads(attrs.get("annotations", "{}"))
        self.created_by: dict[str, Any] = json.loads(attrs["created_by"])
        self._keys: list[str] = json.loads(attrs["state_keys"])
        group = handle[_STATE_GROUP]
        missing = [key for key in self._keys if key not in group]
        if missing:
            raise ZooFormatError(f"{path}: state datasets missing: {missing[:3]}")
        self._datasets = {key: group[key] for key in self._keys}

    # ------------------------------------------------------------------ structure
    def _check_layout(self) -> None:
        attrs = self._file.attrs
        if attrs.get("format") != FORMAT_NAME:
            raise ZooFormatError(f"{self.path}: not a posteriorzoo collection (no format marker)")
        version = int(attrs.get("schema_version", -1))
        if version > SCHEMA_VERSION:
            raise ZooFormatError(
                f"{self.path}: schema version {version} is newer than this posteriorzoo "
                f"understands ({SCHEMA_VERSION}); upgrade posteriorzoo"
            )
        needed = ("architecture", "dataset", "method", "num_classes", "model_options",
                  "recipe", "state_keys", "created_by")
        absent = [name for name in needed if name not in attrs]
        for member in (_STATE_GROUP, "metadata", "committed"):
            if member not in self._file:
                absent.append(f"/{member}")
        if absent:
            raise ZooFormatError(f"{self.path}: damaged collection, missing {absent}")
        committed = self._committed()
        if committed > self._file["metadata"].shape[0]:
            raise ZooFormatError(f"{self.path}: committed count exceeds the metadata rows")

    def _committed(self) -> int:
        dataset = self._file["committed"]
        if self._file.swmr_mode:
            dataset.refresh()
        return int(dataset[0])

    @property
    def writable(self) -> bool:
        return self._lock_fd is not None

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
        return {key: tuple(ds.shape[1:]) for key, ds in self._datasets.items()}

    @property
    def dtypes(self) -> dict[str, np.dtype]:
        """Stored dtype of each tensor."""
        return {key: ds.dtype for key, ds in self._datasets.items()}

    @property
    def spec(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``{key: (shape, dtype)}`` of one checkpoint, in state_dict order."""
        return {key: (tuple(ds.shape[1:]), ds.dtype) for key, ds in self._datasets.items()}

    def dataset_handle(self, key: str) -> h5py.Dataset:
        """The raw h5py dataset of ``key`` (rows past ``len(self)`` are not checkpoints)."""
        self._require_key(key)
        return self._datasets[key]

    def _require_key(self, key: str) -> None:
        if key not in self._datasets:
            raise UnknownNameError(
                f"{self.path}: no tensor {key!r}; it holds {', '.join(self._keys)}"
            )

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
        count = len(self)
        for start in range(0, count, rows):
            yield start, self._datasets[key][start:min(count, start + rows)]

    def arrays(self, index: int) -> dict[str, np.ndarray]:
        """Checkpoint ``index`` as ``{key: numpy array}`` in state_dict order."""
        count = len(self)
        if not -count <= index < count:
            raise IndexError(f"checkpoint {index} out of range; the zoo holds {count}")
        index %= count
        return {key: ds[index] for key, ds in self._datasets.items()}

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
        """Metadata table: a structured array of shape (N,), columns in ``schema.COLUMN_NAMES``."""
        dataset = self._file["metadata"]
        if self._file.swmr_mode:
            dataset.refresh()
        return dataset[: len(self)]

    def metadata_dict(self, index: int) -> dict[str, Any]:
        """Metadata row ``index`` as a plain dict (strings decoded)."""
        count = len(self)
        if not -count <= index < count:
            raise IndexError(f"checkpoint {index} out of range; the zoo holds {count}")
        row = self._file["metadata"][index % count]  # one row, not the whole table
        return {name: schema.decode(row[name]) for name in METADATA_DTYPE.names}

    # ------------------------------------------------------------------ writing
    def append(self, state_dict: Mapping[str, ArrayLike], **metadata: Any) -> int:
        """Append one checkpoint; returns its index. See :meth:`append_many`."""
        return self.append_many([state_dict], [metadata])[0]

    def append_many(
        self,
        state_dicts: Sequence[Mapping[str, ArrayLike]],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> range:
        """Append whole checkpoints atomically; returns their indices.

        Every checkpoint is validated (keys, shapes, dtypes, finite values unless its
        metadata says ``diverged=True``) before anything is written, so a bad one leaves
        the file untouched. Metadata keys are column names of
        :data:`posteriorzoo.zoo.schema.METADATA_COLUMNS`; ``versions`` defaults to the
        running library versions, ``method`` to the collection's method.
        """
        if not self.writable:
            raise ZooFormatError(f"{self.path}: opened read-only; use open_zoo(path, mode='a')")
        metadata = list(metadata) if metadata is not None else [{} for _ in state_dicts]
        if len(metadata) != len(state_dicts):
            raise ValueError("state_dicts and metadata differ in length")
        if not state_dicts:
            return range(len(self), len(self))
        versions = canonical_json(schema.library_versions())
        stacks = {key: [] for key in self._keys}
        rows = np.zeros(len(state_dicts), dtype=METADATA_DTYPE)
        now = time.time()
        for position, (state, values) in enumerate(zip(state_dicts, metadata, strict=True)):
            arrays = self._validated(state, bool(values.get("diverged", False)), position)
            values = {"versions": versions, "method": self.method, **values}
            row = metadata_row(values)
            row["sha256"] = checkpoint_digest(arrays, self._keys).encode()
            row["written_at"] = now
            rows[position] = row
            for key in self._keys:
                stacks[key].append(arrays[key])
        return self._write_block(stacks, rows)

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
            dataset = self._datasets[key]
            if array.shape != dataset.shape[1:]:
                raise ZooSchemaError(
                    f"checkpoint {position}: {key} has shape {array.shape}, "
                    f"the collection stores {dataset.shape[1:]}"
                )
            if array.dtype != dataset.dtype:
                raise ZooSchemaError(
                    f"checkpoint {position}: {key} has dtype {array.dtype}, "
                    f"the collection stores {dataset.dtype}"
                )
            if not diverged and array.dtype.kind == "f" and not np.isfinite(array).all():
                raise NonFiniteWeightsError(
                    f"checkpoint {position}: {key} has NaN or infinite values "
                    "(pass diverged=True to record a diverged run)"
                )
            arrays[key] = array
        return arrays

    def _write_block(self, blocks: Mapping[str, Sequence[np.ndarray]], rows: np.ndarray
                     ) -> range:
        start = len(self)
        stop = start + rows.shape[0]
        for key in self._keys:
            dataset = self._datasets[key]
            dataset.resize(stop, axis=0)
            arrays = blocks[key]
            if sum(array.nbytes for array in arrays) <= _STACK_BYTES:
                dataset[start:stop] = np.stack(arrays)
            else:  # large tensors: one write each rather than a stacked copy
                for offset, array in enumerate(arrays):
                    dataset[start + offset] = array
        table = self._file["metadata"]
        table.resize(stop, axis=0)
        table[start:stop] = rows
        # The commit point: data first, then the count that makes it visible.
        self._file.flush()
        self._file["committed"][0] = stop
        self._file.flush()
        return range(start, stop)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the file and release the writer's lock."""
        if self._file.id.valid:
            self._file.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Zoo:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "open" if self._file.id.valid else "closed"
        return (f"<Zoo {self.path.name!s}: {self.architecture} / {self.dataset} / {self.method}, "
                f"{len(self) if self._file.id.valid else '?'} checkpoints, {state}>")


def iter_checkpoints(zoo: Zoo, indices: Iterable[int] | None = None
                     ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Yield ``(index, state_dict)`` for the given (default: all) checkpoints."""
    for index in range(len(zoo)) if indices is None else indices:
        yield index, zoo.state_dict(index)
