"""MMD as tiles of the distance matrices: the one-machine result, resumable, checked, and
the same on a local two-node Ray cluster as in this process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ray_cluster import two_node_cluster
from zoo_helpers import make_zoo

import posteriorzoo.mmd.tiles as tiles_module
from posteriorzoo.collection.tiles import ZooRows, compare_tiles
from posteriorzoo.errors import ChecksumError, InvalidOptionError, OutputExistsError
from posteriorzoo.mmd import compare_arrays, pooled_distances
from posteriorzoo.mmd.sources import Layer
from posteriorzoo.mmd.tiles import TileStore, TileWarning, plan_tiles
from posteriorzoo.zoo import open_zoo

KEYS = ("conv1.weight", "conv2.weight", "fc.weight", "fc.bias")


@pytest.fixture(scope="module")
def zoos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiles")
    return {"target": make_zoo(folder / "target.h5", range(11)),
            "a": make_zoo(folder / "a.h5", range(100, 105)),
            "b": make_zoo(folder / "b.h5", range(200, 207))}


@pytest.fixture(autouse=True)
def no_distance_cache(monkeypatch):
    monkeypatch.setenv("POSTERIORZOO_DISTANCE_CACHE", "off")


def arrays_of(path) -> dict[str, np.ndarray]:
    with open_zoo(path) as zoo:
        return {key: zoo.layer(key) for key in KEYS}


def run(zoos, folder, **options):
    return compare_tiles(zoos["target"], {"a": zoos["a"], "b": zoos["b"]},
                         tiles_dir=folder, block_rows=4, precision="exact", **options)


def numbers(result) -> list[np.ndarray]:
    return [np.concatenate([r.mmd.values, r.mmd.bandwidths.ravel()]) for r in result.results]


def assert_same(first, second) -> None:
    assert [(r.method, r.layer) for r in first.results] == \
        [(r.method, r.layer) for r in second.results]
    for a, b in zip(numbers(first), numbers(second), strict=True):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------- the plan
def test_the_plan_holds_the_tiles_the_mmd_reads_and_names_its_inputs():
    layers = [Layer("w", ("w",), 6)]
    digests = [["t0", "t1", "t2"], ["a0", "a1"], ["b0", "b1", "b2", "b3", "b4"]]
    plan = plan_tiles(digests, layers, {"w": (2, 3)}, block_rows=2)
    assert [(b.source, b.start, b.stop) for b in plan.blocks] == [
        (0, 0, 2), (0, 2, 3), (1, 0, 2), (2, 0, 2), (2, 2, 4), (2, 4, 5)]
    # target with everything, each method with itself; never method a with method b
    assert plan.tiles == ((0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (1, 1), (1, 2),
                          (1, 3), (1, 4), (1, 5), (2, 2), (3, 3), (3, 4), (3, 5), (4, 4),
                          (4, 5), (5, 5))
    others = [plan_tiles([digests[0], ["a0", "a9"], digests[2]], layers, {"w": (2, 3)},
                         block_rows=2),
              plan_tiles(digests, [Layer("v", ("v",), 6)], {"v": (2, 3)}, block_rows=2),
              plan_tiles(digests, layers, {"w": (3, 2)}, block_rows=2),
              plan_tiles(digests, layers, {"w": (2, 3)}, block_rows=3),
              plan_tiles(digests, layers, {"w": (2, 3)}, block_rows=2, precision="fast")]
    assert len({plan.fingerprint, *(other.fingerprint for other in others)}) == 6
    for bad in (1, 0, 2.5, True):
        with pytest.raises(InvalidOptionError, match="block_rows"):
            plan_tiles(digests, layers, {"w": (2, 3)}, block_rows=bad)


# -------------------------------------------------------------- the one-machine result
def test_gathered_tiles_are_the_one_machine_matrices_bit_for_bit(zoos, tmp_path):
    # The exact kernels add each pair's terms in feature order whichever tile, block or
    # self/cross pass computes it: the gathered matrices are the pooled ones, bit for bit,
    # and so are the statistics computed from them.
    result = run(zoos, tmp_path / "tiles")
    target = arrays_of(zoos["target"])
    methods = {"a": arrays_of(zoos["a"]), "b": arrays_of(zoos["b"])}
    store = TileStore(tmp_path / "tiles", plan_tiles(
        _digests(zoos), [Layer(k, (k,), 0) for k in KEYS], _shapes(zoos), block_rows=4,
        precision="exact"))
    for number, key in enumerate(KEYS):
        for k, name in enumerate(("a", "b"), start=1):
            gathered = store.pooled(number, k)
            alone = pooled_distances(target[key], methods[name][key], precision="exact")
            for part in ("xx", "xy", "yy"):
                for family in range(2):
                    np.testing.assert_array_equal(getattr(gathered, part)[family],
                                                  getattr(alone, part)[family])
    one_machine = compare_arrays(target, methods, precision="exact")
    assert_same(result.comparison, one_machine)
    from posteriorzoo.collection import compare

    streamed = compare(zoos["target"], {"a": zoos["a"], "b": zoos["b"]}, symmetries="keep")
    assert streamed.provenance["options"].get("precision", "exact") == "exact"
    assert_same(result.comparison, streamed.comparison)   # mmd without tiles: the same bits
    assert result.provenance["options"]["tiles"]["computed_now"] == 24


def _digests(zoos) -> list[list[str]]:
    out = []
    for name in ("target", "a", "b"):
        with open_zoo(zoos[name]) as zoo:
            out.append(zoo.digests)
    return out


def _shapes(zoos) -> dict[str, tuple[int, ...]]:
    with open_zoo(zoos["target"]) as zoo:
        return zoo.shapes


def fast_bounds(rows: np.ndarray, exact: tuple[np.ndarray, np.ndarray]
                ) -> tuple[np.ndarray, np.ndarray]:
    """Entrywise bounds of the fast kernels' L1 and squared-L2 errors (distances_fast's
    stated bound, doubled for its first-order terms) for the pooled ``rows``.

    A tile centres its rows on the mean c of one block's rows, so a centred row is
    x_i - c with |x_i - c| <= |x_i| + max_k |x_k| in any norm: that bounds |c_i| for
    every tile. L1: u (|c_i|_1 + |c_j|_1)(1 + g) + (g + g64) l1 with g = gamma(L1_CHUNK
    + 1), g64 = gamma64(chunks + 1). L2: 2u (a_i + a_j)^2 + 2 gamma(GRAM_CHUNK) a_i a_j
    + gamma64(d + 2)(a_i + a_j)^2, a_i the bound on |c_i|_2 (Cauchy-Schwarz on the sums).
    """
    from rounding_bounds import U32, U64, gamma

    from posteriorzoo.mmd.distances_fast import GRAM_CHUNK, L1_CHUNK

    d = rows.shape[1]
    norm1 = np.abs(rows).sum(axis=1)
    norm2 = np.sqrt((rows ** 2).sum(axis=1))
    c1, c2 = norm1 + norm1.max(), norm2 + norm2.max()
    g = gamma(L1_CHUNK + 1)
    g64 = gamma(d // L1_CHUNK + 2, U64)
    l1 = 2 * (U32 * (c1[:, None] + c1[None, :]) * (1 + g) + (g + g64) * exact[0])
    both = c2[:, None] + c2[None, :]
    l2 = 2 * (2 * U32 * both ** 2 + 2 * gamma(GRAM_CHUNK) * np.outer(c2, c2)
              + gamma(d + 2, U64) * both ** 2)
    return l1, l2


def test_fast_tiles_are_the_exact_matrices_within_the_fast_kernels_bound(zoos, tmp_path):
    compare_tiles(zoos["target"], [zoos["a"]], tiles_dir=tmp_path / "fast", block_rows=4,
                  precision="fast")
    plan = plan_tiles(_digests(zoos)[:2], [Layer(k, (k,), 0) for k in KEYS], _shapes(zoos),
                      block_rows=4, precision="fast")
    store = TileStore(tmp_path / "fast", plan)
    target, method = arrays_of(zoos["target"]), arrays_of(zoos["a"])
    worst = 0.0
    for number, key in enumerate(KEYS):
        rows = np.concatenate([target[key], method[key]]).reshape(16, -1).astype(np.float64)
        exact = pooled_distances(target[key], method[key], precision="exact").pooled()
        gathered = store.pooled(number, 1)
        bounds = fast_bounds(rows, exact)
        for family in range(2):
            full = np.zeros((16, 16))
            m = 11
            upper_x, upper_y = np.triu_indices(m, 1), np.triu_indices(5, 1)
            full[:m, :m][upper_x] = gathered.xx[family]
            full[:m, m:] = gathered.xy[family]
            full[m:, m:][upper_y] = gathered.yy[family]
            full = full + full.T
            error = np.abs(full - exact[family])
            assert (error <= bounds[family]).all(), (key, family)
            worst = max(worst, float((error / bounds[family]).max()))
            assert error.max() > 0 or family == 0  # the fast path is not the exact one
    print(f"fast tiles: largest error {worst:.3g} of its bound")
    assert worst < 1


# ------------------------------------------------------------------ resuming and checks
def test_a_rerun_computes_only_missing_or_damaged_tiles(zoos, tmp_path, monkeypatch):
    folder = tmp_path / "tiles"
    computed: list[tuple[int, int]] = []
    real = tiles_module.compute_tile

    def counting(plan, tile, read, features):
        if len(computed) == 9:
            raise KeyboardInterrupt  # killed after 9 tiles
        computed.append(tile)
        return real(plan, tile, read, features)

    monkeypatch.setattr(tiles_module, "compute_tile", counting)
    with pytest.raises(KeyboardInterrupt):
        run(zoos, folder)
    assert len(list(folder.glob("tile-*.npz"))) == 9 and not list(folder.glob(".partial-*"))
    stale = folder / ".partial-killed"   # as a worker killed mid-write leaves
    stale.write_bytes(b"half a tile")
    os.utime(stale, (1000, 1000))
    monkeypatch.setattr(tiles_module, "compute_tile", real)
    first = run(zoos, folder)   # resumed: the other 15
    assert first.provenance["options"]["tiles"]["computed_now"] == 15
    assert not stale.exists()
    again = run(zoos, folder)   # nothing left to compute
    assert again.provenance["options"]["tiles"]["computed_now"] == 0
    assert_same(first.comparison, again.comparison)

    damaged = sorted(folder.glob("tile-*.npz"))[3]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    with pytest.warns(TileWarning, match="computed again"):
        repaired = run(zoos, folder)
    assert repaired.provenance["options"]["tiles"]["computed_now"] == 1
    assert_same(first.comparison, repaired.comparison)


def test_a_tile_of_other_values_is_refused_by_its_checksum(zoos, tmp_path):
    folder = tmp_path / "tiles"
    first = run(zoos, folder)
    path = folder / "tile-00000-00003.npz"
    with np.load(path, allow_pickle=False) as archive:
        content = {name: archive[name] for name in archive.files}
    content["l1_2"] = content["l1_2"] + 1.0   # finite, right shape, wrong values
    np.savez(path, **content)
    with pytest.warns(TileWarning, match="checksum mismatch"):
        assert_same(first.comparison, run(zoos, folder).comparison)


def test_a_tiles_folder_of_other_inputs_is_refused_untouched(zoos, tmp_path):
    folder = tmp_path / "tiles"
    run(zoos, folder)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    with pytest.raises(OutputExistsError, match="other inputs"):
        compare_tiles(zoos["target"], {"a": zoos["a"]}, tiles_dir=folder, block_rows=4,
                      precision="exact")
    with pytest.raises(OutputExistsError):
        run(zoos, folder, layers=["fc.*"])
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


def test_a_worker_refuses_a_file_that_changed_since_the_plan(zoos, tmp_path):
    import hashlib

    with open_zoo(zoos["a"]) as zoo:
        planned = hashlib.sha256("\n".join(zoo.digests).encode()).hexdigest()
    rows = ZooRows([zoos["b"]], [planned])   # the path now holds other checkpoints
    with pytest.raises(ChecksumError, match="no longer holds"):
        next(rows(0, Layer("fc.bias", ("fc.bias",), 10), 0, 2, 10))
    rows = ZooRows([zoos["a"]], [planned])
    block = next(rows(0, Layer("fc.bias", ("fc.bias",), 10), 1, 3, 10))
    np.testing.assert_array_equal(block, arrays_of(zoos["a"])["fc.bias"][1:3])
    rows.close()


def test_tiles_compare_the_inputs_as_they_are(zoos, tmp_path):
    with pytest.raises(InvalidOptionError, match="posteriorzoo canonicalize"):
        run(zoos, tmp_path / "t", symmetries="remove")
    with pytest.raises(InvalidOptionError, match="backend"):
        run(zoos, tmp_path / "t", backend="dask")
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("options, message", [
    ({"num_gpus": 1}, "ray backend and a cuda device"),                     # serial
    ({"backend": "ray", "num_gpus": 1}, "ray backend and a cuda device"),   # cpu
    ({"backend": "ray", "device": "cuda", "precision": "fast"}, "give num_gpus"),
    ({"backend": "ray", "device": "cuda", "precision": "fast", "num_gpus": 1.5},
     "whole number"),
    ({"device": "cuda"}, "exact' runs on the CPU only"),
])
def test_gpu_options_of_tiles_are_checked_before_any_work(zoos, tmp_path, options, message):
    with pytest.raises(InvalidOptionError, match=message):
        compare_tiles(zoos["target"], [zoos["a"]], tiles_dir=tmp_path / "t",
                      **{"precision": "exact", **options})
    assert not (tmp_path / "t").exists()


# ------------------------------------------------------------------- a two-node cluster
def test_mmd_tiles_on_a_two_node_ray_cluster_are_the_serial_result(zoos, tmp_path):
    """``posteriorzoo mmd --tiles-dir --ray-address`` against a local two-node cluster
    (each node ``ray start --block`` in a home of its own, one CPU each; token
    authentication as the README's recipe): every tile computed by a Ray task, the
    tasks spread over both nodes, the report equal to the serial one bit for bit.

    The head also declares one GPU, which this machine need not have: tiles asked for on
    cuda with num_gpus are placed on it (CUDA_VISIBLE_DEVICES=0) and, with a CPU-only
    torch, refused in one line naming the cause."""
    pytest.importorskip("ray")
    posteriorzoo = str(Path(sys.executable).with_name("posteriorzoo"))
    command = [posteriorzoo, "mmd", str(zoos["target"]), f"a={zoos['a']}", f"b={zoos['b']}",
               "--symmetries", "keep", "--tile-rows", "4", "--json", "--no-progress"]
    with two_node_cluster(tmp_path, {"POSTERIORZOO_DISTANCE_CACHE": "off"},
                          ["--num-gpus=1"]) as (address, head_env):
        clustered = subprocess.run(
            [*command, "--out", str(tmp_path / "cluster"), "--tiles-dir",
             str(tmp_path / "cluster-tiles"), "--ray-address", address],
            env=head_env, capture_output=True, text=True, timeout=300)
        assert clustered.returncode == 0, clustered.stderr[-2000:]
        gpu = subprocess.run(
            [sys.executable, "-c",
             "import sys, torch\n"
             "if torch.cuda.is_available(): sys.exit(3)\n"
             "from posteriorzoo.collection import compare_tiles\n"
             f"compare_tiles({str(zoos['target'])!r}, [{str(zoos['a'])!r}], "
             f"tiles_dir={str(tmp_path / 'gpu')!r}, backend='ray', "
             f"ray_address={address!r}, device='cuda', precision='fast', "
             "num_gpus=0.5)\n"], env=head_env, capture_output=True, text=True, timeout=300)
        if gpu.returncode != 3:   # 3: a real GPU, where the task would compute its tile
            assert gpu.returncode == 1
            assert re.search(r"given a GPU \(CUDA_VISIBLE_DEVICES=0\) but torch .* sees "
                             r"no CUDA device", gpu.stderr), gpu.stderr[-2000:]
    serial = subprocess.run([*command, "--out", str(tmp_path / "serial"), "--tiles-dir",
                             str(tmp_path / "serial-tiles")], env=head_env,
                            capture_output=True, text=True, timeout=300)
    assert serial.returncode == 0, serial.stderr[-2000:]
    cluster_report, serial_report = json.loads(clustered.stdout), json.loads(serial.stdout)
    assert cluster_report["layers"] == serial_report["layers"]   # every number, exactly
    assert cluster_report["summary"] == serial_report["summary"]
    assert cluster_report["provenance"]["options"]["tiles"]["computed_now"] == 24
    workers = set()
    for path in (tmp_path / "cluster-tiles").glob("tile-*.npz"):
        with np.load(path, allow_pickle=False) as archive:
            workers.add(json.loads(bytes(archive["header"]).decode())["node"])
    assert len(workers) == 2   # both nodes computed tiles


def test_the_cli_refuses_tile_options_without_tiles(zoos, tmp_path, capsys):
    from posteriorzoo.cli import main

    out = tmp_path / "report"
    for extra in (["--ray-address", "auto"], ["--tile-rows", "8"],
                  ["--tiles-dir", str(tmp_path / "t"), "--keep-canonical"]):
        assert main(["mmd", str(zoos["target"]), str(zoos["a"]), "--out", str(out),
                     "--no-progress", *extra]) == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and ("--tiles-dir" in error[0]), error
    assert not out.exists() and not (tmp_path / "t").exists()
