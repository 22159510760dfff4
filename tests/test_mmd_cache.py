"""The distance cache: the target's self-distances computed once, reused by mmd and the
noise floor, keyed by the rows' content, never trusted when damaged, bounded in size."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
from zoo_helpers import make_zoo

import posteriorzoo.mmd.cache as cache_module
from posteriorzoo.collection import compare
from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.mmd import noise_floor
from posteriorzoo.mmd.cache import (
    DistanceCache,
    DistanceCacheWarning,
    DistanceKey,
    array_row_hashes,
)
from posteriorzoo.zoo import open_zoo

KEY = DistanceKey(("a" * 64, "b" * 64, "c" * 64), ("fc.weight",), ((10, 10),), "fast@cpu")


def packed(seed: int, pairs: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random(pairs) * 10, rng.random(pairs) * 100


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """The environment's cache in a folder of this test, caching every layer."""
    where = tmp_path / "distances"
    monkeypatch.setenv(cache_module.ENV_FOLDER, str(where))
    monkeypatch.delenv(cache_module.ENV_LIMIT_MB, raising=False)
    monkeypatch.setattr(cache_module, "MIN_PAIR_WEIGHTS", 0)
    return where


@pytest.fixture
def loads(monkeypatch) -> list[bool]:
    """True (a hit) or False (a miss) for every read of the cache, in order."""
    seen: list[bool] = []
    real = DistanceCache.load

    def spy(self, key):
        values = real(self, key)
        seen.append(values is not None)
        return values

    monkeypatch.setattr(DistanceCache, "load", spy)
    return seen


# --------------------------------------------------------------------------- entries
def test_an_entry_reads_back_and_any_change_of_its_inputs_misses(tmp_path, monkeypatch):
    cache = DistanceCache(tmp_path, min_pair_weights=0)
    l1, l2sq = packed(0)
    assert cache.load(KEY) is None
    cache.store(KEY, l1, l2sq)
    got = cache.load(KEY)
    np.testing.assert_array_equal(got[0], l1)
    np.testing.assert_array_equal(got[1], l2sq)
    rows = KEY.rows
    for changed in (DistanceKey((rows[0], rows[1], "d" * 64), KEY.keys, KEY.shapes,
                                KEY.precision),                      # one row's content
                    DistanceKey(rows[::-1], KEY.keys, KEY.shapes, KEY.precision),  # order
                    DistanceKey(rows, ("fc.bias",), KEY.shapes, KEY.precision),  # the layer
                    DistanceKey(rows, KEY.keys, ((100,),), KEY.precision),       # shapes
                    DistanceKey(rows, KEY.keys, KEY.shapes, "exact@cpu"),        # precision
                    DistanceKey(rows, KEY.keys, KEY.shapes, "fast@cuda")):       # device
        assert cache.load(changed) is None
    monkeypatch.setattr(cache_module, "_algorithm", lambda: "0.2.0:another-kernel")
    assert cache.load(KEY) is None  # another distance algorithm never reads old entries
    assert (cache.hits, cache.misses) == (1, 8)


def rewrite(path, **arrays) -> None:
    """Replace some arrays of an entry, keeping the rest (its header) as it is."""
    with np.load(path, allow_pickle=False) as archive:
        content = {name: archive[name] for name in archive.files}
    content.update(arrays)
    buffer = io.BytesIO()
    np.savez(buffer, **content)
    path.write_bytes(buffer.getvalue())


def header_of(path) -> dict:
    with np.load(path, allow_pickle=False) as archive:
        return json.loads(bytes(archive["header"]).decode())


def flip_middle_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {
    "a flipped byte": flip_middle_byte,
    "truncated": lambda path: path.write_bytes(path.read_bytes()[:100]),
    "not an archive": lambda path: path.write_bytes(b"not an npz file"),
    "a changed value": lambda path: rewrite(path, l1=packed(0)[0] * 2),
    "wrong shape": lambda path: rewrite(path, l1=np.zeros(4), l2sq=np.zeros(4)),
    "wrong dtype": lambda path: rewrite(path, l1=packed(0)[0].astype(np.float32)),
    # a NaN with a checksum that matches it: the checksum alone would not catch it
    "a NaN": lambda path: rewrite(path, l1=np.array([1.0, np.nan, 2.0]), header=np.frombuffer(
        json.dumps({**header_of(path), "checksum": cache_module._checksum(
            np.array([1.0, np.nan, 2.0]), packed(0)[1])}).encode(), dtype=np.uint8)),
    "another key's entry": lambda path: rewrite(path, header=np.frombuffer(
        json.dumps({**header_of(path), "key": "0" * 64}).encode(), dtype=np.uint8)),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_entry_is_a_miss_with_a_warning_never_trusted(tmp_path, damage):
    cache = DistanceCache(tmp_path, min_pair_weights=0)
    cache.store(KEY, *packed(0))
    path = cache.path(KEY)
    DAMAGE[damage](path)
    with pytest.warns(DistanceCacheWarning, match="ignored and recomputed"):
        assert cache.load(KEY) is None
    assert not path.exists()  # deleted: the recomputed values take its place
    cache.store(KEY, *packed(0))
    np.testing.assert_array_equal(cache.load(KEY)[0], packed(0)[0])


def test_the_cache_keeps_to_its_bound_least_recently_used_first(tmp_path):
    probe = DistanceCache(tmp_path / "probe", min_pair_weights=0)
    probe.store(KEY, *packed(0))
    size = probe.path(KEY).stat().st_size
    cache = DistanceCache(tmp_path / "bounded", limit_bytes=int(2.5 * size),
                          min_pair_weights=0)
    keys = [DistanceKey(KEY.rows, (f"layer{i}",), KEY.shapes) for i in range(4)]

    def kept() -> list[DistanceKey]:
        return [key for key in keys if cache.path(key).exists()]

    for age, key in enumerate(keys[:2]):
        cache.store(key, *packed(age))
        os.utime(cache.path(key), (1000 + age, 1000 + age))  # distinct ages, in order
    assert cache.load(keys[0]) is not None  # used again: now more recent than keys[1]
    os.utime(cache.path(keys[0]), (1001.5, 1001.5))
    cache.store(keys[2], *packed(2))
    assert kept() == [keys[0], keys[2]]  # the least recently used went, not the oldest
    os.utime(cache.path(keys[2]), (1002, 1002))
    cache.store(keys[3], *packed(3))
    assert kept() == [keys[2], keys[3]]
    assert sum(p.stat().st_size for p in cache.entries()) <= cache.limit_bytes
    # an entry larger than the whole bound is never written
    small = DistanceCache(tmp_path / "small", limit_bytes=16 * KEY.pairs - 1,
                          min_pair_weights=0)
    small.store(KEY, *packed(0))
    assert small.entries() == [] and not small.worth(len(KEY.rows), 10**9)


def test_where_the_cache_lives_and_how_it_is_turned_off(tmp_path, monkeypatch):
    for name in (cache_module.ENV_FOLDER, cache_module.ENV_LIMIT_MB, "POSTERIORZOO_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cache = DistanceCache.from_environment()
    assert cache.folder == tmp_path / "xdg" / "posteriorzoo" / "distances"
    assert cache.limit_bytes == cache_module.DEFAULT_LIMIT_MB << 20
    monkeypatch.setenv("POSTERIORZOO_CACHE", str(tmp_path / "pz"))
    assert DistanceCache.from_environment().folder == tmp_path / "pz" / "distances"
    monkeypatch.setenv(cache_module.ENV_FOLDER, str(tmp_path / "elsewhere"))
    monkeypatch.setenv(cache_module.ENV_LIMIT_MB, "1.5")
    cache = DistanceCache.from_environment()
    assert cache.folder == tmp_path / "elsewhere" and cache.limit_bytes == 3 << 19
    for off in ("off", "0", ""):
        monkeypatch.setenv(cache_module.ENV_FOLDER, off)
        assert DistanceCache.from_environment() is None
    monkeypatch.setenv(cache_module.ENV_FOLDER, str(tmp_path / "elsewhere"))
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv(cache_module.ENV_LIMIT_MB, bad)
        with pytest.raises(InvalidOptionError, match=cache_module.ENV_LIMIT_MB):
            DistanceCache.from_environment()


def test_a_cache_that_cannot_be_written_is_a_warning(tmp_path):
    (tmp_path / "file").write_text("a file where the folder would be")
    cache = DistanceCache(tmp_path / "file" / "distances", min_pair_weights=0)
    with pytest.warns(DistanceCacheWarning, match="not written"):
        cache.store(KEY, *packed(0))
    assert cache.load(KEY) is None


def test_row_hashes_follow_content_dtype_and_shape():
    rng = np.random.default_rng(1)
    array = rng.normal(size=(3, 4, 5))
    hashes = array_row_hashes([array])
    assert len(set(hashes)) == 3 and hashes == array_row_hashes([array.copy()])
    changed = array.copy()
    changed[1, 2, 3] = np.nextafter(changed[1, 2, 3], 10)  # one ulp of one value
    assert array_row_hashes([changed]) == [hashes[0], array_row_hashes([changed])[1],
                                           hashes[2]]
    assert array_row_hashes([changed])[1] != hashes[1]
    assert array_row_hashes([array.astype(np.float32)])[0] != hashes[0]
    assert array_row_hashes([array.reshape(3, 20)])[0] != hashes[0]
    assert array_row_hashes([array.astype(">f8")]) == hashes  # byte order is not content


# ------------------------------------------------------------------ mmd and the noise floor
def values(result) -> list[np.ndarray]:
    return [np.concatenate([r.mmd.values, r.mmd.bandwidths.ravel()])
            for r in result.comparison.results]


def assert_same(first, second) -> None:
    for a, b in zip(values(first), values(second), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_second_mmd_reuses_the_targets_distances_and_gives_the_same_bits(
        tmp_path, folder, loads, monkeypatch):
    target = make_zoo(tmp_path / "target.h5", range(12))
    method = make_zoo(tmp_path / "method.h5", range(100, 106))
    first = compare(target, {"m": method}, symmetries="keep")
    layers = len(first.comparison.results)
    assert loads == [False] * layers and len(list(folder.glob("*.npz"))) == layers
    second = compare(target, {"m": method}, symmetries="keep")
    assert loads[layers:] == [True] * layers   # every layer's X-X read back
    assert_same(first, second)
    monkeypatch.setenv(cache_module.ENV_FOLDER, "off")
    assert_same(first, compare(target, {"m": method}, symmetries="keep"))  # as without it
    assert len(loads) == 2 * layers  # off: not even looked up

    # one checkpoint of the target changed: its digest changes and every layer misses
    monkeypatch.setenv(cache_module.ENV_FOLDER, str(folder))
    edited = make_zoo(tmp_path / "edited.h5", [*range(11), 99])
    changed = compare(edited, {"m": method}, symmetries="keep")
    assert loads[2 * layers:] == [False] * layers
    monkeypatch.setenv(cache_module.ENV_FOLDER, "off")
    assert_same(changed, compare(edited, {"m": method}, symmetries="keep"))


def test_damaged_entries_are_recomputed_by_mmd_not_trusted(tmp_path, folder, loads):
    target = make_zoo(tmp_path / "target.h5", range(10))
    method = make_zoo(tmp_path / "method.h5", range(100, 105))
    first = compare(target, {"m": method}, symmetries="keep")
    for path in folder.glob("*.npz"):  # every entry now holds other (finite) distances
        with np.load(path, allow_pickle=False) as archive:
            rewrite(path, l1=archive["l1"] + 1.0)
    with pytest.warns(DistanceCacheWarning, match="checksum mismatch"):
        again = compare(target, {"m": method}, symmetries="keep")
    assert_same(first, again)
    assert_same(first, compare(target, {"m": method}, symmetries="keep"))  # rewritten: hits
    layers = len(first.comparison.results)
    assert loads == [False] * 2 * layers + [True] * layers


def test_the_noise_floor_reuses_the_distances_of_mmd(tmp_path, folder, loads):
    target = make_zoo(tmp_path / "target.h5", range(12))
    method = make_zoo(tmp_path / "method.h5", range(100, 106))
    compare(target, {"m": method}, symmetries="keep")
    entries = sorted(folder.glob("*.npz"))
    with open_zoo(target) as zoo:
        arrays = {key: zoo.layer(key) for key in ("conv1.weight", "conv2.weight",
                                                  "fc.weight", "fc.bias")}
        digests = zoo.digests
    del loads[:]
    shared = noise_floor(arrays, symmetries="keep", held_out=4, splits=3, row_digests=digests)
    assert loads == [True] * 4 and sorted(folder.glob("*.npz")) == entries  # mmd's entries
    # Without digests the rows are hashed: a first call stores, a second one hits and
    # gives the same bits, and both are the noise floor computed without the cache.
    del loads[:]
    own = noise_floor(arrays, symmetries="keep", held_out=4, splits=3)
    again = noise_floor(arrays, symmetries="keep", held_out=4, splits=3)
    assert loads == [False] * 4 + [True] * 4
    np.testing.assert_array_equal(own.splits, again.splits)
    os.environ[cache_module.ENV_FOLDER] = "off"
    try:
        plain = noise_floor(arrays, symmetries="keep", held_out=4, splits=3)
    finally:
        os.environ[cache_module.ENV_FOLDER] = str(folder)
    np.testing.assert_array_equal(own.splits, plain.splits)
    assert own.halves == plain.halves
    assert shared.splits.shape == plain.splits.shape
    with pytest.raises(InvalidOptionError, match="row_digests"):
        noise_floor(arrays, symmetries="keep", held_out=4, row_digests=digests[:-1])


def test_ns_mmd_reuses_the_canonical_targets_distances(tmp_path, folder, loads):
    # The canonical copy is made again by each run, in a temporary folder, with the same
    # content: its recorded digests, and so its cache keys, are the same.
    target = make_zoo(tmp_path / "target.h5", range(10))
    method = make_zoo(tmp_path / "method.h5", range(100, 105))
    first = compare(target, {"m": method}, symmetries="remove")
    layers = len(first.comparison.results)
    second = compare(target, {"m": method}, symmetries="remove")
    assert loads == [False] * layers + [True] * layers
    assert_same(first, second)


def test_a_hit_gives_the_same_bits_with_the_fast_kernels_too(tmp_path, folder, loads):
    # On a hit only X-Y and Y-Y are computed (within=False, and Y's own pass): the fast
    # kernels centre and sum them exactly as in the pass that also computes X-X, so the
    # statistics are the same bits, in several blocks of features as in one.
    from posteriorzoo.collection.comparison import ZooSource, parameter_keys
    from posteriorzoo.mmd.comparison import compare_sources
    from posteriorzoo.mmd.sources import group_layers, select_layers

    target = make_zoo(tmp_path / "target.h5", range(16))
    method = make_zoo(tmp_path / "method.h5", range(100, 108))

    def run(cache: bool) -> list[np.ndarray]:
        with open_zoo(target) as x, open_zoo(method) as y:
            layers = select_layers(group_layers(parameter_keys(x), x.shapes), None)
            results = compare_sources(ZooSource("t", x), [ZooSource("m", y)], layers,
                                      precision="fast", cache=cache,
                                      block_bytes=8 * 24 * 40)   # 40 features a block
        return [np.concatenate([r.mmd.values, r.mmd.bandwidths.ravel()]) for r in results]

    first, second, without = run(True), run(True), run(False)
    assert loads == [False] * 4 + [True] * 4
    for a, b, c in zip(first, second, without, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_a_killed_writers_temporary_file_is_cleared_later(tmp_path):
    cache = DistanceCache(tmp_path, min_pair_weights=0)
    old, fresh = tmp_path / ".partial-old", tmp_path / ".partial-fresh"
    old.write_bytes(b"half an entry")
    fresh.write_bytes(b"being written")
    os.utime(old, (1000, 1000))
    cache.store(KEY, *packed(0))
    assert not old.exists() and fresh.exists()   # another writer's file is left alone
    assert cache.entries() == [cache.path(KEY)]
