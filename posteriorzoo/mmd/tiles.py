"""The distance matrices of many collections as tiles: computed anywhere, kept, gathered.

The MMD of a target (m checkpoints) with methods (n_1, n_2, ... checkpoints) needs, per
layer, the L1 and squared-L2 distances of the pooled rows [X; Y_k] for every k. For the
whole release (9,216 checkpoints) that is days of one machine's arithmetic, so the
matrices are cut into tiles that independent workers compute:

- every source's rows are cut into blocks of at most ``block_rows`` rows (a block never
  spans two sources);
- a tile is a pair of blocks (i, j), i <= j, and holds the distances of their rows on
  every layer, from :func:`~posteriorzoo.mmd.distances.cross_distances` (a diagonal tile
  is one block against itself);
- only the tiles the MMD reads are planned: those with a block of the target, and those
  whose two blocks belong to the same method (the distances between two methods are
  never used).

Each finished tile is one ``.npz`` file in the tiles folder (no pickle), written to a
temporary file renamed into place, with a header naming the plan's fingerprint (every
row's content hash, the layers, the precision, the block size, the distance algorithm)
and a SHA-256 per layer. A rerun skips the tiles that are there and pass their checks
(:class:`TileStore`), so a killed run resumes; a damaged tile is computed again. The
gathered matrices (:meth:`TileStore.pooled`) are the one-machine matrices: bit for bit
with the exact kernels (each pair's sum does not depend on the tile that computes it),
within the fast kernels' stated bound otherwise
(:mod:`posteriorzoo.mmd.distances_fast`: the rounding depends on the rows each tile
centres on).

Reading the rows is the caller's: :func:`compute_tile` takes a function that yields a
row range's column blocks, so the same tile code runs in this process, in a pool or on
Ray workers that open the collection files themselves
(:mod:`posteriorzoo.collection.tiles`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from posteriorzoo.errors import InvalidOptionError, OutputExistsError
from posteriorzoo.mmd.cache import _algorithm, precision_key
from posteriorzoo.mmd.distances import DEFAULT_PRECISION, Distances, cross_distances
from posteriorzoo.mmd.sources import Layer

__all__ = ["Block", "TilePlan", "TileStore", "TileWarning", "compute_tile", "plan_tiles"]

#: Rows per block: a tile of two such blocks holds 2 x 1024^2 float64 per layer (16 MiB).
DEFAULT_BLOCK_ROWS = 1024
_FORMAT = "posteriorzoo-distance-tile-1"
_PLAN = "plan.json"
#: A temporary file older than this is a killed writer's, not one being written.
_STALE_SECONDS = 3600

#: Reads rows [start, stop) of one source on one layer: yields column blocks (rows, b)
#: in feature order (the same cuts for every call with the same ``features``).
RowReader = Callable[[int, Layer, int, int, int], Iterable[np.ndarray]]


class TileWarning(UserWarning):
    """A tile file failed its checks and is computed again."""


@dataclass(frozen=True)
class Block:
    """Rows [start, stop) of source ``source`` (0: the target)."""

    source: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class TilePlan:
    """Which tiles the MMD of a target with its methods needs, and what they depend on.

    Attributes
    ----------
    counts : tuple of int
        Rows of the target, then of each method.
    blocks : tuple of Block
        Every source's rows, cut into blocks, in source and row order.
    tiles : tuple of (int, int)
        Pairs of block numbers (i <= j) to compute.
    layers : tuple of Layer
    fingerprint : str
        SHA-256 of the rows' content hashes, layers, precision, block size and distance
        algorithm: a tile computed for other inputs never matches.
    precision, device : str
        Passed to :func:`~posteriorzoo.mmd.distances.cross_distances`.
    """

    counts: tuple[int, ...]
    blocks: tuple[Block, ...]
    tiles: tuple[tuple[int, int], ...]
    layers: tuple[Layer, ...]
    fingerprint: str
    precision: str = DEFAULT_PRECISION
    device: str = "cpu"


def plan_tiles(row_digests: Sequence[Sequence[str]], layers: Sequence[Layer],
               shapes: dict[str, tuple[int, ...]], *, block_rows: int = DEFAULT_BLOCK_ROWS,
               precision: str = DEFAULT_PRECISION, device: str = "cpu") -> TilePlan:
    """The tiles of a target (``row_digests[0]``, one content hash per row) and its methods.

    Raises
    ------
    InvalidOptionError
        ``block_rows`` below 2, or fewer than two sources.
    """
    if isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 2:
        raise InvalidOptionError(f"block_rows must be an integer >= 2, not {block_rows!r}")
    if len(row_digests) < 2:
        raise InvalidOptionError("tiles need a target and at least one method")
    blocks = tuple(Block(source, start, min(start + block_rows, len(digests)))
                   for source, digests in enumerate(row_digests)
                   for start in range(0, len(digests), block_rows))
    tiles = tuple((i, j) for i in range(len(blocks)) for j in range(i, len(blocks))
                  if 0 in (blocks[i].source, blocks[j].source)
                  or blocks[i].source == blocks[j].source)
    text = json.dumps({
        "rows": [hashlib.sha256("\n".join(map(str, d)).encode()).hexdigest()
                 for d in row_digests],
        "layers": [[layer.name, list(layer.keys), [list(shapes[k]) for k in layer.keys]]
                   for layer in layers],
        "precision": precision_key(precision, device), "block_rows": block_rows,
        "algorithm": _algorithm()}, sort_keys=True)
    return TilePlan(tuple(len(d) for d in row_digests), blocks, tiles, tuple(layers),
                    hashlib.sha256(text.encode()).hexdigest(), precision, device)


def compute_tile(plan: TilePlan, tile: tuple[int, int], read: RowReader,
                 features: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Layer name -> (L1, squared L2) of tile ``tile``: (rows of block i, rows of block j).

    ``read(source, layer, start, stop, features)`` yields the column blocks of a row range.
    """
    first, second = (plan.blocks[k] for k in tile)
    out = {}
    for layer in plan.layers:
        a = read(first.source, layer, first.start, first.stop, features)
        b = a if tile[0] == tile[1] else read(second.source, layer, second.start,
                                              second.stop, features)
        out[layer.name] = cross_distances(a, b, precision=plan.precision,
                                          device=plan.device)
    return out


def _checksum(l1: np.ndarray, l2sq: np.ndarray) -> str:
    digest = hashlib.sha256(np.ascontiguousarray(l1, dtype="<f8").tobytes())
    digest.update(np.ascontiguousarray(l2sq, dtype="<f8").tobytes())
    return digest.hexdigest()


class TileStore:
    """The tiles folder of one plan: write, check, list, gather.

    Parameters
    ----------
    folder : path-like
        Created if missing. It records the plan's fingerprint (``plan.json``); a folder
        holding the tiles of another plan is refused (:class:`OutputExistsError`) rather
        than mixed.
    plan : TilePlan
    """

    def __init__(self, folder: str | os.PathLike, plan: TilePlan) -> None:
        self.folder = Path(folder)
        self.plan = plan
        self.folder.mkdir(parents=True, exist_ok=True)
        manifest = self.folder / _PLAN
        record = {"format": _FORMAT, "fingerprint": plan.fingerprint,
                  "counts": list(plan.counts), "tiles": len(plan.tiles)}
        if manifest.exists():
            try:
                found = json.loads(manifest.read_text())
            except (OSError, ValueError):
                found = None
            if not isinstance(found, dict) or found.get("fingerprint") != plan.fingerprint:
                raise OutputExistsError(
                    f"{self.folder} holds the tiles of other inputs or options: give "
                    "another tiles folder, or delete this one")
        else:
            _write_atomic(manifest, json.dumps(record, indent=1).encode())
        # a killed worker's half-written tile (not one being written: over an hour old)
        for partial in self.folder.glob(".partial-*"):
            with contextlib.suppress(OSError):
                if time.time() - partial.stat().st_mtime > _STALE_SECONDS:
                    partial.unlink()

    def path(self, tile: tuple[int, int]) -> Path:
        return self.folder / f"tile-{tile[0]:05d}-{tile[1]:05d}.npz"

    def write(self, tile: tuple[int, int], values: dict[str, tuple[np.ndarray, np.ndarray]],
              node: str | None = None) -> None:
        """Keep one finished tile (a temporary file renamed into place); ``node`` names
        the machine that computed it (recorded, not checked)."""
        arrays, sums = {}, {}
        for number, layer in enumerate(self.plan.layers):
            l1, l2sq = values[layer.name]
            arrays[f"l1_{number}"] = np.asarray(l1, dtype="<f8")
            arrays[f"l2sq_{number}"] = np.asarray(l2sq, dtype="<f8")
            sums[layer.name] = _checksum(l1, l2sq)
        header = {"format": _FORMAT, "fingerprint": self.plan.fingerprint,
                  "tile": list(tile), "checksums": sums,
                  "node": node or platform.node()}
        buffer = io.BytesIO()
        np.savez(buffer, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8),
                 **arrays)
        _write_atomic(self.path(tile), buffer.getvalue())

    def read(self, tile: tuple[int, int], layers: Sequence[int] | None = None
             ) -> dict[int, tuple[np.ndarray, np.ndarray]] | None:
        """Layer number -> the tile's checked (L1, squared L2), or None if it is missing
        or fails a check (a :class:`TileWarning`; the file is then deleted)."""
        path = self.path(tile)
        if not path.exists():
            return None
        shape = tuple(self.plan.blocks[k].rows for k in tile)
        chosen = range(len(self.plan.layers)) if layers is None else layers
        try:
            with np.load(path, allow_pickle=False) as archive:
                header = json.loads(bytes(archive["header"]).decode())
                if (header.get("format") != _FORMAT
                        or header.get("fingerprint") != self.plan.fingerprint
                        or header.get("tile") != list(tile)):
                    raise ValueError("written for another plan or tile")
                out = {}
                for number in chosen:
                    l1, l2sq = archive[f"l1_{number}"], archive[f"l2sq_{number}"]
                    for values in (l1, l2sq):
                        if values.dtype != np.float64 or values.shape != shape:
                            raise ValueError(f"{values.dtype} {values.shape}, expected "
                                             f"float64 {shape}")
                        if not np.isfinite(values).all():
                            raise ValueError("NaN or infinite distances")
                    name = self.plan.layers[number].name
                    if _checksum(l1, l2sq) != header["checksums"].get(name):
                        raise ValueError(f"checksum mismatch in {name}")
                    out[number] = (l1, l2sq)
        except Exception as error:  # noqa: BLE001 -- any damage: compute the tile again
            warnings.warn(f"tile {path} ignored and computed again: {error}", TileWarning,
                          stacklevel=2)
            path.unlink(missing_ok=True)
            return None
        return out

    def pending(self) -> list[tuple[int, int]]:
        """The plan's tiles without a file that passes every check, in plan order."""
        return [tile for tile in self.plan.tiles if self.read(tile) is None]

    def pooled(self, layer: int, method: int) -> Distances:
        """The pooled distances of the target with method ``method`` (1-based source
        number) on layer number ``layer``, gathered from the tiles."""
        counts, blocks = self.plan.counts, self.plan.blocks
        offsets = {0: 0, method: counts[0]}
        rows = counts[0] + counts[method]
        l1, l2sq = np.zeros((rows, rows)), np.zeros((rows, rows))
        for tile in self.plan.tiles:
            first, second = (blocks[k] for k in tile)
            if {first.source, second.source} - {0, method}:
                continue
            values = self.read(tile, [layer])
            if values is None:
                raise InvalidOptionError(f"tile {tile} is missing or damaged: run the "
                                         "tiles again (finished ones are kept)")
            a = slice(offsets[first.source] + first.start, offsets[first.source] + first.stop)
            b = slice(offsets[second.source] + second.start,
                      offsets[second.source] + second.stop)
            for matrix, tile_values in zip((l1, l2sq), values[layer], strict=True):
                matrix[a, b] = tile_values
                matrix[b, a] = tile_values.T
        m, n = counts[0], counts[method]
        upper_x, upper_y = np.triu_indices(m, 1), np.triu_indices(n, 1)
        return Distances(
            xx=(l1[:m, :m][upper_x], l2sq[:m, :m][upper_x]),
            xy=(np.ascontiguousarray(l1[:m, m:]), np.ascontiguousarray(l2sq[:m, m:])),
            yy=(l1[m:, m:][upper_y], l2sq[m:, m:][upper_y]), m=m, n=n)


def _write_atomic(path: Path, data: bytes) -> None:
    handle, temporary = tempfile.mkstemp(prefix=".partial-", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def run_serial(store: TileStore, read: RowReader, features: int,
               tiles: Sequence[tuple[int, int]] | None = None) -> Iterator[tuple[int, int]]:
    """Compute and keep the pending tiles in this process; yield each as it is kept."""
    for tile in store.pending() if tiles is None else tiles:
        store.write(tile, compute_tile(store.plan, tile, read, features))
        yield tile
