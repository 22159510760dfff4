"""A disk cache of the target's own distances, keyed by the content of its rows.

The target (e.g. 1,000 checkpoints) is compared with every method, in ``mmd``, in
``report`` and in the noise floor, and its self-distances (m (m - 1) / 2 pairs per
layer) are most of the arithmetic. They depend only on the target's rows, so they are
computed once and kept here: a second ``mmd`` of the same target, the report's noise
floor after its comparison, or a rerun after a crash reads them back.

What an entry is keyed by (:class:`DistanceKey`), so that any change of an input misses:

- the rows' content hashes, in order: a collection's recorded per-checkpoint SHA-256
  (``Zoo.digests``; a canonical copy has its own), or the SHA-256 of each row of arrays
  held in memory (:func:`array_row_hashes`);
- the layer: its state keys and their shapes (the feature selection);
- the precision mode of the distances (how they were accumulated);
- the distance algorithm: the package version and a hash of the source of
  :mod:`posteriorzoo.mmd.distances`, so a changed kernel never reads old entries.

An entry is one ``.npz`` file (no pickle: read with ``allow_pickle=False``) holding the
packed pairs i < j of the L1 and squared-L2 distances (float64, as
:attr:`Distances.xx <posteriorzoo.mmd.distances.Distances>`) and a JSON header with the
key, the shape and a SHA-256 of the values. It is written to a temporary file renamed
into place, and checked on every read (key, shape, dtype, finite, checksum): an entry
that fails is ignored with a :class:`DistanceCacheWarning`, deleted and recomputed, never
trusted.

Where and how big: ``$POSTERIORZOO_DISTANCE_CACHE`` if set (``off`` disables the cache),
else ``<cache root>/distances`` (:func:`posteriorzoo.data.cache_root`: ``$POSTERIORZOO_CACHE``,
``$XDG_CACHE_HOME/posteriorzoo`` or ``~/.cache/posteriorzoo``). At most
``$POSTERIORZOO_DISTANCE_CACHE_MB`` MiB (default 4096): the least recently used entries
are deleted past it. An entry takes 8 m (m - 1) bytes per layer: 8 MB per layer for
1,000 checkpoints (about 0.5 GB for ResNet-18's 62 tensors), 680 MB per layer for 9,216.
Layers cheaper to compute than to read (fewer than :data:`MIN_PAIR_WEIGHTS` pair-weights)
are not cached.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tempfile
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.mmd.distances import Distances

#: The environment variables: the cache's folder (or ``off``) and its bound in MiB.
ENV_FOLDER = "POSTERIORZOO_DISTANCE_CACHE"
ENV_LIMIT_MB = "POSTERIORZOO_DISTANCE_CACHE_MB"
DEFAULT_LIMIT_MB = 4096
#: Layers with fewer pair-weights (m (m - 1) / 2 x features) than this are computed, not
#: cached: about a second of the kernels, less than hashing and reading an entry costs.
MIN_PAIR_WEIGHTS = 2e8
#: How the distances are computed (part of the key): :mod:`~posteriorzoo.mmd.distances`'
#: precision on a kind of device (:func:`precision_key`).
DEFAULT_PRECISION_KEY = "exact@cpu"
_SUFFIX = ".npz"
#: A temporary file older than this is a killed writer's, not one being written.
_STALE_SECONDS = 3600
_FORMAT = "posteriorzoo-distance-cache-1"


class DistanceCacheWarning(UserWarning):
    """A cache entry could not be read, failed its checks, or could not be written."""


def precision_key(precision: str = "exact", device: str = "cpu") -> str:
    """The key's precision mode: the distances' precision and the kind of device
    (``"fast@cpu"``, ``"fast@cuda"``): each rounds differently."""
    return f"{precision}@{device.split(':')[0]}"


def _algorithm() -> str:
    """The package version and a hash of the distance kernels' source (every
    ``distances*.py`` of this package: exact, fast and torch paths)."""
    from posteriorzoo import __version__

    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("distances*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"{__version__}:{digest.hexdigest()[:16]}"


@dataclass(frozen=True)
class DistanceKey:
    """What one entry's distances depend on (see the module notes).

    Attributes
    ----------
    rows : tuple of str
        The rows' content hashes, in order.
    keys : tuple of str
        The layer's state keys, concatenated in this order.
    shapes : tuple of tuple of int
        Each key's shape per row.
    precision : str
        How the distances were accumulated.
    """

    rows: tuple[str, ...]
    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    precision: str = DEFAULT_PRECISION_KEY

    @property
    def features(self) -> int:
        return int(sum(np.prod(shape, dtype=np.int64) for shape in self.shapes))

    @property
    def pairs(self) -> int:
        return len(self.rows) * (len(self.rows) - 1) // 2

    def digest(self) -> str:
        """SHA-256 of everything above and of the distance algorithm."""
        rows = hashlib.sha256("\n".join(self.rows).encode()).hexdigest()
        text = json.dumps({"rows": rows, "count": len(self.rows), "keys": self.keys,
                           "shapes": self.shapes, "precision": self.precision,
                           "algorithm": _algorithm()}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


def array_row_hashes(arrays: Sequence[np.ndarray]) -> list[str]:
    """SHA-256 of each row across ``arrays`` (the same rows of each, sample axis first):
    dtype, shape and little-endian bytes, so a changed value, dtype or shape changes it."""
    count = len(arrays[0]) if arrays else 0
    hashes = []
    for row in range(count):
        digest = hashlib.sha256()
        for array in arrays:
            value = np.ascontiguousarray(array[row])
            if value.dtype.byteorder == ">":
                value = value.astype(value.dtype.newbyteorder("<"))
            digest.update(f"{value.dtype.str}\0{value.shape}\0".encode())
            digest.update(value.tobytes())
        hashes.append(digest.hexdigest())
    return hashes


def _checksum(l1: np.ndarray, l2sq: np.ndarray) -> str:
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(l1, dtype="<f8").tobytes())
    digest.update(np.ascontiguousarray(l2sq, dtype="<f8").tobytes())
    return digest.hexdigest()


class DistanceCache:
    """The target's packed self-distances per layer, in one folder.

    Parameters
    ----------
    folder : path-like
        Created when the first entry is written.
    limit_bytes : int
        Entries are deleted, least recently used first, while the folder holds more;
        an entry larger than this is not written.
    min_pair_weights : float
        Layers with less work than this are not cached (:meth:`worth`).
    """

    def __init__(self, folder: str | os.PathLike, limit_bytes: int = DEFAULT_LIMIT_MB << 20,
                 min_pair_weights: float = MIN_PAIR_WEIGHTS) -> None:
        if limit_bytes < 0:
            raise InvalidOptionError(f"the distance cache's limit must be >= 0, not {limit_bytes}")
        self.folder = Path(folder).expanduser()
        self.limit_bytes = int(limit_bytes)
        self.min_pair_weights = float(min_pair_weights)
        self.hits = 0
        self.misses = 0

    @classmethod
    def from_environment(cls) -> DistanceCache | None:
        """The cache the environment asks for (see the module notes), or None if ``off``."""
        where = os.environ.get(ENV_FOLDER)
        if where is not None and where.strip().lower() in ("off", "0", "no", "false", ""):
            return None
        if where is None:
            from posteriorzoo.data.download import cache_root

            where = str(cache_root() / "distances")
        text = os.environ.get(ENV_LIMIT_MB, str(DEFAULT_LIMIT_MB))
        try:
            megabytes = float(text)
        except ValueError:
            raise InvalidOptionError(f"{ENV_LIMIT_MB} must be a number of MiB, not "
                                     f"{text!r}") from None
        if not megabytes >= 0:
            raise InvalidOptionError(f"{ENV_LIMIT_MB} must be >= 0, not {text!r}")
        return cls(where, int(megabytes * (1 << 20)), MIN_PAIR_WEIGHTS)

    def worth(self, rows: int, features: int) -> bool:
        """Whether the self-distances of ``rows`` rows of ``features`` values cost enough
        to keep, and fit the bound."""
        pairs = rows * (rows - 1) // 2
        return pairs * features >= self.min_pair_weights and 16 * pairs <= self.limit_bytes

    def path(self, key: DistanceKey) -> Path:
        return self.folder / f"{key.digest()}{_SUFFIX}"

    def load(self, key: DistanceKey) -> tuple[np.ndarray, np.ndarray] | None:
        """The packed (L1, squared-L2) pairs of ``key``, or None on a miss.

        A file that cannot be read or fails a check is a miss: it is deleted, with a
        :class:`DistanceCacheWarning`, and the caller recomputes.
        """
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            self.misses += 1
            return None
        try:
            values = _parse(data, key)
        except Exception as error:  # noqa: BLE001 -- any damage is a miss, never a crash
            warnings.warn(f"distance cache entry {path} ignored and recomputed: {error}",
                          DistanceCacheWarning, stacklevel=2)
            path.unlink(missing_ok=True)
            self.misses += 1
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: evicted last
        self.hits += 1
        return values

    def store(self, key: DistanceKey, l1: np.ndarray, l2sq: np.ndarray) -> None:
        """Write an entry (temporary file renamed into place), then keep to the bound.

        A failure to write (a full disk, a read-only folder) is a warning: the results
        do not depend on the cache.
        """
        if 16 * key.pairs > self.limit_bytes:
            return
        header = {"format": _FORMAT, "key": key.digest(), "pairs": key.pairs,
                  "checksum": _checksum(l1, l2sq)}
        buffer = io.BytesIO()
        np.savez(buffer, l1=np.asarray(l1, dtype="<f8"), l2sq=np.asarray(l2sq, dtype="<f8"),
                 header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8))
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(prefix=".partial-", dir=self.folder)
            try:
                with os.fdopen(handle, "wb") as stream:
                    stream.write(buffer.getbuffer())
                os.replace(temporary, self.path(key))
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        except OSError as error:
            warnings.warn(f"distance cache {self.folder} not written: {error}",
                          DistanceCacheWarning, stacklevel=2)
            return
        self.evict()

    def _listing(self, pattern: str) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of the files matching ``pattern``; files that vanish while
        listed (another process evicting) are left out."""
        found = []
        with contextlib.suppress(OSError):
            for path in self.folder.glob(pattern):
                with contextlib.suppress(OSError):
                    info = path.stat()
                    found.append((info.st_mtime, info.st_size, path))
        return sorted(found)

    def entries(self) -> list[Path]:
        """The entries, least recently used first."""
        return [path for _, _, path in self._listing(f"*{_SUFFIX}")]

    def evict(self) -> None:
        """Delete the least recently used entries while the folder holds more than the
        bound, and temporary files that writers killed mid-write left (over an hour old)."""
        for mtime, _, path in self._listing(".partial-*"):
            if time.time() - mtime > _STALE_SECONDS:
                path.unlink(missing_ok=True)
        entries = self._listing(f"*{_SUFFIX}")
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= self.limit_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size


def _parse(data: bytes, key: DistanceKey) -> tuple[np.ndarray, np.ndarray]:
    """The entry's values, after every check; raises on any mismatch."""
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        header = json.loads(bytes(archive["header"]).decode())
        l1, l2sq = archive["l1"], archive["l2sq"]
    if header.get("format") != _FORMAT or header.get("key") != key.digest():
        raise ValueError("written for other inputs")
    for name, values in (("l1", l1), ("l2sq", l2sq)):
        if values.dtype != np.float64 or values.shape != (key.pairs,):
            raise ValueError(f"{name} has {values.dtype} {values.shape}, expected float64 "
                             f"({key.pairs},)")
        if not np.isfinite(values).all() or (values < 0).any():
            raise ValueError(f"{name} has negative, NaN or infinite values")
    if _checksum(l1, l2sq) != header.get("checksum"):
        raise ValueError("checksum mismatch")
    return l1, l2sq


def resolve(cache: DistanceCache | bool) -> DistanceCache | None:
    """``True``: the environment's cache (:meth:`DistanceCache.from_environment`);
    ``False``: none; a :class:`DistanceCache`: that one."""
    if cache is True:
        return DistanceCache.from_environment()
    return cache or None


def layer_distances(target, methods: Sequence, layer, blocks: Iterable[Sequence[np.ndarray]],
                    *, cache: DistanceCache | bool = True, precision: str = "exact",
                    device: str = "cpu") -> list[Distances]:
    """The pooled distances of the target with each method on one layer, in one pass
    over ``blocks`` (the target's block, then each method's, feature block by block).

    The target's self-distances come from the cache when the target's rows carry content
    hashes (``target.row_digests``, a collection's) and an entry for them exists; then
    only the X-Y and Y-Y distances are computed, by the same kernels on the same blocks
    as without the cache (so the result is the same either way, bit for bit). Otherwise
    X-X is computed with the rest and stored.
    """
    from posteriorzoo.mmd.distances import SharedTargetDistances

    cache = resolve(cache)
    key = None
    digests = getattr(target, "row_digests", None)
    if cache is not None and digests is not None and cache.worth(target.rows, layer.size):
        key = DistanceKey(tuple(str(d) for d in digests), tuple(layer.keys),
                          tuple(tuple(int(s) for s in target.shapes[k]) for k in layer.keys),
                          precision_key(precision, device))
    cached = cache.load(key) if key is not None else None
    ns = [m.rows for m in methods]
    options = {"precision": precision, "device": device}
    if cached is None:
        shared = SharedTargetDistances(target.rows, ns, **options)
        for block in blocks:
            shared.update(block[0], block[1:], check_finite=False)
        if key is not None:
            cache.store(key, *shared.self_packed())
        return [shared.pooled(k) for k in range(len(methods))]
    cross = SharedTargetDistances(target.rows, ns, within=False, **options)
    own = [SharedTargetDistances(n, [], **options) for n in ns]
    for block in blocks:
        cross.update(block[0], block[1:], check_finite=False)
        for k, y_block in enumerate(block[1:]):
            own[k].update(y_block, [], check_finite=False)
    return [Distances(cached, cross.cross(k), own[k].self_packed(), target.rows, n)
            for k, n in enumerate(ns)]
