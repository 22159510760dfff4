"""Rows in mode order: the trainer commits modes in order, verify reports rows out of
order, and reorder fixes a collection without changing any checkpoint."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from zoo_helpers import assert_one_line_error, checkpoint, flip_byte_in_chunk, run

from posteriorzoo.collection import verify
from posteriorzoo.errors import (
    ChecksumError,
    InvalidOptionError,
    ZooBusyError,
)
from posteriorzoo.reference import COLLECTIONS, reference_path
from posteriorzoo.zoo import create_zoo, open_zoo, reorder_collection, row_order
from train_zoo import make_spec
from train_zoo.backends import LocalBackend, SerialBackend
from train_zoo.backends import local as local_backend
from train_zoo.run import train_collection

SPEC_TOML = """
recipe = "optunet-mnist"
dataset = "digits"
checkpoints = {checkpoints}
base_seed = 7

[recipe_overrides]
epochs = 1
"""


def digits_spec(checkpoints: int = 4):
    return make_spec("optunet-mnist", dataset="digits", checkpoints=checkpoints, base_seed=7,
                     recipe_overrides={"epochs": 1})


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digests_by_mode(path: Path) -> dict[tuple[int, int], str]:
    """Each checkpoint's stored tensor digest, by (mode_id, sample_id)."""
    with open_zoo(path) as zoo:
        rows = zoo.metadata
        return {(int(m), int(s)): d for m, s, d in
                zip(rows["mode_id"], rows["sample_id"], zoo.digests, strict=True)}


def make_collection(path: Path, modes: list[int], samples: int = 1,
                    records: bool = True) -> Path:
    """A real collection whose modes are committed in the order ``modes`` (each with
    ``samples`` draws, and a training record when ``records``)."""
    template = checkpoint(0)
    with create_zoo(path, architecture="optunet", dataset="digits", method="swag",
                    num_classes=10, template=template) as zoo:
        for mode in modes:
            states = [checkpoint(100 * mode + sample) for sample in range(samples)]
            rows = [{"mode_id": mode, "sample_id": sample, "seed": mode,
                     "test_accuracy": 0.5 + mode / 100} for sample in range(samples)]
            zoo.append_many(states, rows,
                            records={mode: {"mode": mode, "rank": 20}} if records else None)
    return path


# ---------------------------------------------------------------------- the order itself
def test_row_order_counts_rows_out_of_place():
    ordering = row_order([1, 0, 2, 3], [0, 0, 0, 0])
    assert ordering.order.tolist() == [1, 0, 2, 3]
    assert (ordering.out_of_place, ordering.first, ordering.unknown) == (2, 0, 0)
    assert ordering.describe(4) == "rows out of mode order: 2 of 4 (first at row 0)"
    # samples order within a mode; rows without a mode keep their places
    ordering = row_order([0, 0, -1, 1], [1, 0, -1, 0])
    assert ordering.order.tolist() == [1, 0, 2, 3] and ordering.unknown == 1
    assert row_order([0, 1, 2], [0, 0, 0]).in_order


# ---------------------------------------------------------------------- the trainer
def test_two_local_workers_commit_modes_in_order(tmp_path):
    """Two worker processes: the group of mode 3 finishes long before the group of modes
    0-2, yet the rows hold modes 0, 1, 2, 3."""
    spec = digits_spec(checkpoints=4)
    out = tmp_path / "zoo.h5"
    train_collection(spec, out, backend=LocalBackend(workers=2, group_size=3),
                     engine="fast", progress=False)
    with open_zoo(out) as zoo:
        assert zoo.metadata["mode_id"].tolist() == [0, 1, 2, 3]
    report = verify(out)
    assert report.ok and report.rows_out_of_order == 0 and report.findings == []


class _ShuffledBackend:
    """Replays finished modes in the order ``arrival`` (as a backend whose workers finish
    out of order would deliver them), counting what the writer holds back."""

    def __init__(self, results: dict[int, list], arrival: list[int]) -> None:
        self.results, self.arrival = results, arrival

    def run(self, spec, indices, engine="auto"):
        for index in self.arrival:
            if index in indices:
                yield from self.results[index]


@pytest.fixture(scope="module")
def trained_modes():
    spec = digits_spec(checkpoints=4)
    results: dict[int, list] = {}
    for result in SerialBackend().run(spec, range(4), "fast"):
        results.setdefault(result.index, []).append(result)
    return spec, results


def test_modes_that_arrive_early_wait_for_their_predecessors(tmp_path, trained_modes):
    spec, results = trained_modes
    out = tmp_path / "zoo.h5"
    train_collection(spec, out, backend=_ShuffledBackend(results, [2, 1, 3, 0]),
                     progress=False)
    with open_zoo(out) as zoo:
        assert zoo.metadata["mode_id"].tolist() == [0, 1, 2, 3]
        assert zoo.digests == digests_in_order(results)


def digests_in_order(results: dict[int, list]) -> list[str]:
    from posteriorzoo.zoo.schema import checkpoint_digest

    return [checkpoint_digest(r.state, list(r.state)) for index in sorted(results)
            for r in results[index]]


def test_a_resumed_run_keeps_its_modes_and_appends_the_rest_in_order(tmp_path,
                                                                       trained_modes):
    spec, results = trained_modes
    out = tmp_path / "zoo.h5"

    class KilledRunError(Exception):
        pass

    class DiesAfterTwoModes(_ShuffledBackend):
        def run(self, spec, indices, engine="auto"):
            for count, result in enumerate(super().run(spec, indices, engine)):
                if count == 3:  # modes 1, 0 and 3 delivered; 3 waits for 2
                    raise KilledRunError
                yield result

    with pytest.raises(KilledRunError):
        train_collection(spec, out, backend=DiesAfterTwoModes(results, [1, 0, 3, 2]),
                         progress=False)
    with open_zoo(out) as zoo:
        assert zoo.metadata["mode_id"].tolist() == [0, 1]   # what was committed stays
    train_collection(spec, out, backend=_ShuffledBackend(results, [3, 2]), progress=False)
    with open_zoo(out) as zoo:
        assert zoo.metadata["mode_id"].tolist() == [0, 1, 2, 3]
        assert zoo.digests == digests_in_order(results)


def test_resuming_an_old_out_of_order_file_says_how_to_fix_it(tmp_path, trained_modes):
    spec, results = trained_modes
    out = tmp_path / "zoo.h5"
    with pytest.raises(RuntimeError, match="never produced mode 0"):
        # an old writer's file: mode 1 committed, mode 0 not
        train_collection(spec, out, backend=_ShuffledBackend(results, [1]), progress=False)
    with pytest.warns(UserWarning, match="mode 0 will be appended after mode 1.*reorder"):
        train_collection(spec, out, backend=_ShuffledBackend(results, [0, 2, 3]),
                         progress=False)
    with open_zoo(out) as zoo:
        assert zoo.metadata["mode_id"].tolist() == [1, 0, 2, 3]
    report = verify(out)
    assert report.ok and report.rows_out_of_order == 2


class _ThreadPool(concurrent.futures.ThreadPoolExecutor):
    """Stands in for the process pool: same interface, threads in this process."""

    def __init__(self, workers, mp_context=None, initializer=None, initargs=()):
        super().__init__(workers)


def test_local_backend_yields_in_order_with_a_bounded_window(monkeypatch):
    """Mode 0 is slow: later modes finish first, wait, and no more than 2 x workers
    groups are ever submitted and not yet yielded."""
    started: list[int] = []
    release = threading.Event()

    def train_group(spec, group, engine, plugins=None, device="cpu"):
        started.extend(group)
        if group == [0]:
            release.wait(10)
        return list(group)

    monkeypatch.setattr(local_backend, "ProcessPoolExecutor", _ThreadPool)
    monkeypatch.setattr(local_backend, "_train_group", train_group)
    stream = LocalBackend(workers=2).run(digits_spec(checkpoints=10), range(10), "fast")
    first = concurrent.futures.ThreadPoolExecutor(1).submit(next, stream)
    deadline = time.monotonic() + 10
    while len(started) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # modes 1-3 finish; nothing more may start while mode 0 runs
    assert sorted(started) == [0, 1, 2, 3]
    release.set()
    assert first.result(timeout=10) == 0
    assert list(stream) == list(range(1, 10))


class _LastFirstRay:
    """Just enough of ``ray``: tasks finish in reverse order of submission."""

    def __init__(self) -> None:
        self.submitted: list[list[int]] = []
        self.unyielded = self.most_unyielded = 0

    def is_initialized(self) -> bool:
        return True

    def cluster_resources(self) -> dict[str, float]:
        return {"CPU": 1.0}

    def put(self, value):
        return value

    def remote(self, **options):
        fake = self

        class Task:
            @staticmethod
            def options(**options):
                return Task

            @staticmethod
            def remote(spec, group, engine, plugins=None, device="cpu", progress=None):
                fake.submitted.append(group)
                fake.unyielded += 1
                fake.most_unyielded = max(fake.most_unyielded, fake.unyielded)
                return list(group)

        return lambda function: Task

    def wait(self, refs, num_returns=1):
        return refs[-num_returns:], refs[:-num_returns]

    def get(self, ref):
        return ref

    def cancel(self, ref, force=False):
        pass


def test_ray_backend_yields_in_order_with_a_bounded_window(monkeypatch):
    from train_zoo.backends import ray_backend

    fake = _LastFirstRay()
    monkeypatch.setattr(ray_backend, "import_ray", lambda: fake)
    stream = ray_backend.RayBackend(max_in_flight=3).run(digits_spec(8), range(8), "fast")
    for expected, result in enumerate(stream):
        assert result == expected
        fake.unyielded -= 1
    assert expected == 7 and fake.most_unyielded == 3


# ---------------------------------------------------------------------- verify
def test_verify_reports_rows_out_of_mode_order(tmp_path, capsys):
    path = make_collection(tmp_path / "old.h5", [0, 2, 1, 3], samples=2)
    report = verify(path)
    assert report.ok  # intact checkpoints: a finding, not damage
    assert (report.rows_out_of_order, report.first_out_of_order) == (4, 2)
    assert report.findings == ["rows out of mode order: 4 of 8 (first at row 2); "
                               "`posteriorzoo reorder` writes them in order, digests "
                               "unchanged"]
    assert report.to_dict()["rows_out_of_order"] == 4
    code, out, err = run(capsys, "verify", path, "--no-progress")
    assert code == 0 and err == ""
    assert "OK, 8 checkpoints" in out and "rows out of mode order: 4 of 8 (first at row 2)" in out
    in_order = make_collection(tmp_path / "new.h5", [0, 1, 2, 3])
    assert verify(in_order).findings == [] and verify(in_order).rows_out_of_order == 0


def test_the_shipped_collections_are_in_mode_order():
    for name in COLLECTIONS:
        with h5py.File(reference_path(name), "r") as handle:
            rows = handle["metadata"][:int(handle["committed"][0])]
        ordering = row_order(rows["mode_id"], rows["sample_id"])
        assert ordering.in_order, (name, ordering.describe(rows.size))


# ---------------------------------------------------------------------- reorder
def _tensors_and_rows(path: Path) -> dict[tuple[int, int], tuple]:
    """Everything a row holds, by (mode_id, sample_id): tensors, metadata row, row digest."""
    with h5py.File(path, "r") as handle:
        count = int(handle["committed"][0])
        rows = handle["metadata"][:count]
        digests = handle["metadata_sha256"][:count]
        tensors = {key: handle["state"][key][:count] for key in handle["state"]}
    return {(int(row["mode_id"]), int(row["sample_id"])):
            (row.tobytes(), bytes(digests[i]),
             {key: value[i].tobytes() for key, value in tensors.items()})
            for i, row in enumerate(rows)}


def _structure(path: Path) -> dict:
    """What reorder must not change: attributes, records, dataset shapes, chunks, filters."""
    with h5py.File(path, "r") as handle:
        datasets = {}
        handle.visititems(lambda name, item: datasets.__setitem__(name, (
            item.shape, item.dtype.str, item.chunks, item.compression, item.maxshape))
            if isinstance(item, h5py.Dataset) else None)
        return {"attrs": {k: handle.attrs[k] for k in handle.attrs}, "datasets": datasets,
                "records": handle["mode_records"][:].tobytes()
                if "mode_records" in handle else None}


def test_reorder_keeps_every_checkpoint_and_everything_else(tmp_path, capsys):
    path = make_collection(tmp_path / "old.h5", [2, 0, 3, 1], samples=3)
    before, structure, original = _tensors_and_rows(path), _structure(path), sha256(path)
    out = tmp_path / "ordered.h5"
    code, text, err = run(capsys, "reorder", path, "--out", out)
    assert code == 0, err
    assert "12 of 12 rows moved into mode order (first at row 0)" in text
    assert sha256(path) == original                    # the input is never modified
    assert _tensors_and_rows(out) == before            # every row's bytes, digests included
    assert _structure(out) == structure                # attributes, records, chunking
    with open_zoo(out) as zoo:
        assert zoo.metadata["mode_id"].tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
        assert zoo.metadata["sample_id"].tolist() == [0, 1, 2] * 4
        assert zoo.training_records() == {m: {"mode": m, "rank": 20} for m in range(4)}
    report = verify(out)
    assert report.ok and report.rows_out_of_order == 0
    assert digests_by_mode(out) == digests_by_mode(path)


def test_reorder_respects_the_output_policy(tmp_path, capsys):
    path = make_collection(tmp_path / "old.h5", [1, 0], records=False)
    out = tmp_path / "ordered.h5"
    out.write_bytes(b"precious")
    code, _, err = run(capsys, "reorder", path, "--out", out)
    assert_one_line_error(code, err, "already exists")
    assert out.read_bytes() == b"precious"
    with pytest.raises(InvalidOptionError, match="replace the input"):
        reorder_collection(path, path, overwrite=True)
    with pytest.raises(InvalidOptionError, match="either"):
        reorder_collection(path, out, in_place=True)
    code, _, err = run(capsys, "reorder", path, "--in-place", "--overwrite")
    assert_one_line_error(code, err, "--overwrite applies to --out")
    assert reorder_collection(path, out, overwrite=True).moved == 2
    assert verify(out).rows_out_of_order == 0
    original = sha256(path)
    # in place only when asked, and nothing written when already in order
    result = reorder_collection(out, in_place=True)
    assert (result.moved, result.written) == (0, False)
    result = reorder_collection(path, in_place=True)
    assert (result.moved, result.written, result.out) == (2, True, path)
    assert sha256(path) != original and verify(path).rows_out_of_order == 0
    assert digests_by_mode(path) == digests_by_mode(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.h5", "ordered.h5"]


def test_reorder_refuses_a_damaged_collection_and_writes_nothing(tmp_path, capsys):
    path = make_collection(tmp_path / "old.h5", [1, 0, 2], records=False)
    flip_byte_in_chunk(path, "fc.weight")
    original = sha256(path)
    with pytest.raises(ChecksumError, match="damaged"):
        reorder_collection(path, tmp_path / "out.h5")
    code, _, err = run(capsys, "reorder", path, "--in-place")
    assert_one_line_error(code, err, "damaged", "nothing was written")
    assert sha256(path) == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.h5"]


def test_reorder_waits_for_no_writer(tmp_path):
    path = make_collection(tmp_path / "old.h5", [1, 0], records=False)
    with open_zoo(path, mode="r+"), pytest.raises(ZooBusyError, match="writing"):
        reorder_collection(path, tmp_path / "out.h5")
    assert not (tmp_path / "out.h5").exists()


def test_killed_reorder_leaves_nothing_and_a_rerun_succeeds(tmp_path):
    path = make_collection(tmp_path / "old.h5", [1, 0, 2], records=False)
    original = sha256(path)
    command = [sys.executable, "-m", "posteriorzoo", "reorder", str(path), "--in-place"]
    killed = subprocess.run(command, capture_output=True,
                            env={**os.environ, "POSTERIORZOO_KILL_AT": "publish"})
    assert killed.returncode == -9
    assert sha256(path) == original
    subprocess.run(command, check=True, capture_output=True)
    assert verify(path).rows_out_of_order == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.h5"]


def test_reorder_of_an_unordered_copy_of_a_shipped_collection(tmp_path):
    """The shipped DE, with its rows shuffled as an old two-worker run left them, comes
    back byte for byte: only the order of rows ever differed."""
    shipped = reference_path("de")
    shuffled = tmp_path / "de.h5"
    shuffled.write_bytes(shipped.read_bytes())
    order = np.arange(100)
    order[[6, 7]], order[[40, 41, 42]] = [7, 6], [42, 40, 41]
    with h5py.File(shuffled, "r+") as handle:
        for name in ["metadata", "metadata_sha256", *(f"state/{k}" for k in handle["state"])]:
            handle[name][:100] = handle[name][:100][order]
    assert verify(shuffled).rows_out_of_order == 5
    reorder_collection(shuffled, in_place=True)
    assert shuffled.read_bytes() == shipped.read_bytes()


@pytest.mark.slow
def test_a_killed_two_worker_run_resumes_in_mode_order(tmp_path):
    spec_path = tmp_path / "zoo.toml"
    spec_path.write_text(SPEC_TOML.format(checkpoints=6))
    out = tmp_path / "zoo.h5"
    command = [sys.executable, "-m", "posteriorzoo", "train", str(spec_path), "--out",
               str(out), "--workers", "2", "--no-progress"]
    killed = subprocess.run(command, capture_output=True,
                            env={**os.environ, "POSTERIORZOO_KILL_AT": "zoo-commit:3"})
    assert killed.returncode == -9
    with open_zoo(out) as zoo:
        assert zoo.metadata["mode_id"].tolist() == [0, 1, 2]
    subprocess.run(command, check=True, capture_output=True)
    with open_zoo(out) as zoo:
        assert zoo.metadata["mode_id"].tolist() == list(range(6))
    assert verify(out).ok
