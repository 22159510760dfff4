"""Training records (schema 3): what each mode's method phase recorded, stored in the
collection beside its checkpoints, crash-safely and covered by digests.

A record is validated before anything is written, committed in the same block as its
mode's checkpoints, checked against its SHA-256 when read with ``verify=True`` and by
``posteriorzoo verify``; crafted record tables are refused when the file opens; schema 2
files read with no records and are upgraded by the next writer; a writer killed between
writing a record and committing its mode leaves no record of that mode.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest
from zoo_helpers import checkpoint

from posteriorzoo.cli import main
from posteriorzoo.collection import verify
from posteriorzoo.errors import ChecksumError, ZooFormatError, ZooSchemaError
from posteriorzoo.reference import reference_path
from posteriorzoo.zoo import create_zoo, open_zoo
from posteriorzoo.zoo.schema import RECORD_BYTES, RECORD_DTYPE, canonical_json

SGHMC_RECORD = {"method": "sghmc", "chains": [
    {"chain": 0, "kinetic_temperature": 1.02, "beta_hat_capped": None},
    {"chain": 1, "kinetic_temperature": 0.98, "beta_hat_capped": 0.0}]}


def _mode(mode: int, samples: int = 2) -> tuple[list, list[dict]]:
    """``samples`` checkpoints of mode ``mode`` and their metadata."""
    return ([checkpoint(10 * mode + s) for s in range(samples)],
            [{"seed": 10 * mode + s, "mode_id": mode, "sample_id": s} for s in range(samples)])


def _collection(path: Path, records: dict[int, dict | None]) -> None:
    """A collection with one block per mode of ``records`` (None: no record)."""
    with create_zoo(path, architecture="optunet", dataset="digits", method="sghmc",
                    num_classes=10, template=checkpoint(0)) as zoo:
        for mode, record in records.items():
            zoo.append_many(*_mode(mode), records=None if record is None else {mode: record})


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------- round trip
def test_records_round_trip(tmp_path):
    path = tmp_path / "zoo.h5"
    numpy_valued = {"rank": np.int64(3), "scale": np.float32(0.5), "ok": np.bool_(True),
                    "iterates": (1, 2)}
    _collection(path, {0: SGHMC_RECORD, 1: None, 2: numpy_valued})
    with open_zoo(path, verify=True) as zoo:
        assert zoo.has_training_records and len(zoo) == 6
        assert zoo.training_records() == {
            0: SGHMC_RECORD, 2: {"rank": 3, "scale": 0.5, "ok": True, "iterates": [1, 2]}}
    with h5py.File(path, "r") as handle:
        assert handle.attrs["schema_version"] == 4  # records (schema 3) and chains (4)
        table = handle["mode_records"]
        assert table.dtype == RECORD_DTYPE and table.shape == (2,)
        assert table[0]["record"] == canonical_json(SGHMC_RECORD).encode()
        assert table[0]["sha256"] == hashlib.sha256(table[0]["record"]).hexdigest().encode()
    report = verify(path)
    assert report.ok and report.records == 2 and report.record_mismatches == []
    assert "2 training records" in report.summary()


def test_a_repeated_mode_is_described_by_its_last_record(tmp_path):
    path = tmp_path / "zoo.h5"
    _collection(path, {0: {"run": 1}})
    with open_zoo(path, mode="r+") as zoo:
        zoo.append_many(*_mode(0), records={0: {"run": 2}})
        assert zoo.training_records() == {0: {"run": 2}}
    with h5py.File(path, "r") as handle:
        assert handle["mode_records"].shape == (2,)
    with open_zoo(path, mode="r+") as zoo:  # a writer changes nothing before it appends
        assert zoo.training_records() == {0: {"run": 2}}
    with h5py.File(path, "r") as handle:
        assert handle["mode_records"].shape == (2,)
    with open_zoo(path, mode="r+") as zoo:  # its first append keeps each mode's last record
        zoo.append_many(*_mode(1), records={1: {"run": 1}})
        assert zoo.training_records() == {0: {"run": 2}, 1: {"run": 1}}
    with h5py.File(path, "r") as handle:
        assert handle["mode_records"].shape == (2,)
    assert verify(path).ok


# ---------------------------------------------------------------------- validation
class Unserialisable:
    pass


BAD_RECORDS = {
    "not-json": ({0: {"value": Unserialisable()}}, "Unserialisable"),
    "nan": ({0: {"chains": [{"kinetic_temperature": float("nan")}]}}, "finite"),
    "infinite-numpy": ({0: {"sigma": np.float32("inf")}}, "finite"),
    "oversized": ({0: {"text": "x" * RECORD_BYTES}}, f"{RECORD_BYTES + 11} bytes"),
    "not-an-object": ({0: [1, 2]}, "JSON object"),
    "integer-key": ({0: {1: "a"}}, "JSON object keys are text"),
    "too-deep": ({0: {"a": json.loads("[" * 40 + "]" * 40)}}, "nested"),
    "mode-not-in-block": ({5: {"a": 1}}, "no checkpoint of this append has mode_id 5"),
    "negative-mode": ({-1: {"a": 1}}, "mode_id -1"),
    "mode-not-integer": ({"0": {"a": 1}}, "keyed by mode_id"),
    "not-a-mapping": ([{"a": 1}], "must map mode_id"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_a_bad_record_is_refused_before_anything_is_written(tmp_path, case):
    records, message = BAD_RECORDS[case]
    path = tmp_path / "zoo.h5"
    _collection(path, {0: {"run": 1}})
    baseline = tmp_path / "baseline.h5"
    shutil.copy(path, baseline)
    with open_zoo(baseline, mode="r+"):  # the same open and close, without the append
        pass
    with open_zoo(path, mode="r+") as zoo:
        with pytest.raises(ZooSchemaError, match=message):
            zoo.append_many(*_mode(0), records=records)
        assert len(zoo) == 2
    assert path.read_bytes() == baseline.read_bytes()
    with open_zoo(path, verify=True) as zoo:
        assert zoo.training_records() == {0: {"run": 1}}


def test_a_record_without_checkpoints_is_refused(tmp_path):
    path = tmp_path / "zoo.h5"
    _collection(path, {0: None})
    with open_zoo(path, mode="r+") as zoo, pytest.raises(ZooSchemaError, match="checkpoints"):
        zoo.append_many([], [], records={0: {"a": 1}})


# ---------------------------------------------------------------------- integrity
def _tamper(path: Path, record: bytes, digest: bytes | None = None) -> None:
    """Replace the stored bytes of the first record (and its digest when given)."""
    with h5py.File(path, "r+") as handle:
        row = handle["mode_records"][0]
        row["record"] = record
        if digest is not None:
            row["sha256"] = digest
        handle["mode_records"][0] = row


def test_a_changed_record_is_refused_by_verify_and_by_verified_reads(tmp_path, capsys):
    path = tmp_path / "zoo.h5"
    _collection(path, {0: SGHMC_RECORD, 1: {"run": 1}})
    changed = canonical_json(SGHMC_RECORD).replace("1.02", "9.99").encode()
    _tamper(path, changed)
    with open_zoo(path, verify=True) as zoo, pytest.raises(ChecksumError, match="mode 0"):
        zoo.training_records()
    with open_zoo(path) as zoo:  # without verification the bytes are read as they are
        assert zoo.training_records()[0]["chains"][0]["kinetic_temperature"] == 9.99
    report = verify(path)
    assert not report.ok and report.record_mismatches == [0]
    assert "training record" in report.summary()
    assert main(["verify", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training record" in err[0] and "mode 0" in err[0]


@pytest.mark.parametrize("bad", [b'{"a": NaN}', b'{"a": 1e999}', b"[1, 2]", b"{\xff}",
                                 b'{"a": '])
def test_a_record_that_is_not_json_is_refused_even_with_its_digest(tmp_path, bad):
    path = tmp_path / "zoo.h5"
    _collection(path, {0: SGHMC_RECORD})
    _tamper(path, bad, hashlib.sha256(bad).hexdigest().encode())
    with open_zoo(path) as zoo, pytest.raises(ZooFormatError, match="not a JSON object"):
        zoo.training_records()
    assert verify(path).record_mismatches == [0]


def _replace(handle: h5py.File, **kwargs) -> None:
    rows = handle["mode_records"][()]
    del handle["mode_records"]
    handle.create_dataset("mode_records", **{"data": rows, **kwargs})


def _wrong_dtype(handle: h5py.File, folder: Path) -> None:
    rows = handle["mode_records"][()]
    narrow = np.dtype([("mode_id", "<i8"), ("record", "S100"), ("sha256", "S64")])
    _replace(handle, data=rows.astype(narrow), maxshape=(None,), chunks=(1,))


def _external(handle: h5py.File, folder: Path) -> None:
    outside = folder / "outside.bin"
    outside.write_bytes(b"\0" * RECORD_DTYPE.itemsize)
    del handle["mode_records"]
    handle.create_dataset("mode_records", shape=(1,), dtype=RECORD_DTYPE,
                          external=[(str(outside), 0, RECORD_DTYPE.itemsize)])


CRAFTED = {
    "wrong-dtype": (_wrong_dtype, "another layout"),
    "two-dimensional": (lambda h, f: _replace(h, data=h["mode_records"][()].reshape(1, 1)),
                        "another layout"),
    "contiguous": (lambda h, f: _replace(h), "chunked, resizable"),
    "compressed": (lambda h, f: _replace(h, maxshape=(None,), chunks=(1,),
                                         compression="gzip"), "compressed"),
    "external": (_external, "another file"),
    "too-many-rows": (lambda h, f: h["mode_records"].resize(10**9, axis=0),
                      "1000000000 training records"),
    "group": (lambda h, f: (h.__delitem__("mode_records"), h.create_group("mode_records")),
              "not a dataset"),
    "deleted": (lambda h, f: h.__delitem__("mode_records"), "missing"),
    "in-a-schema-2-file": (lambda h, f: h.attrs.__setitem__("schema_version", 2),
                           "unexpected members"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_record_table_is_refused_at_open(tmp_path, case, capsys):
    path = tmp_path / "zoo.h5"
    _collection(path, {0: SGHMC_RECORD})
    craft, message = CRAFTED[case]
    with h5py.File(path, "r+") as handle:
        craft(handle, tmp_path)
    before = _sha(path)
    with pytest.raises(ZooFormatError, match=message):
        open_zoo(path)
    with pytest.raises(ZooFormatError, match=message):
        open_zoo(path, mode="r+")
    assert main(["info", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert _sha(path) == before


# ---------------------------------------------------------------------- schema 2
def _schema_2_copy(shipped: Path, path: Path) -> None:
    """A copy of a shipped collection as schema 2 wrote it: no table of training records
    (the shipped files were schema 2 until they were rewritten within HDF5 1.10's formats)."""
    shutil.copy(shipped, path)
    with h5py.File(path, "r+", locking=False) as handle:
        del handle["mode_records"]
        handle.attrs["schema_version"] = 2
        del handle.attrs["hdf5_format"]


def test_a_schema_2_file_reads_without_records_and_is_upgraded_by_a_writer(tmp_path):
    shipped = reference_path("bbb")
    shipped_digest = _sha(shipped)
    path = tmp_path / "bbb.h5"
    _schema_2_copy(shipped, path)
    with open_zoo(path, verify=True) as zoo:
        assert zoo.layout.schema_version == 2 and not zoo.has_training_records
        assert zoo.training_records() == {}
        count, state = len(zoo), zoo.state_dict(0)
        mode = int(zoo.metadata["mode_id"].max()) + 1
    report = verify(path)
    assert report.ok and report.records == 0
    assert any("no training records" in note for note in report.notes)
    with open_zoo(path, mode="r+") as zoo:
        zoo.append_many([state], [{"mode_id": mode, "sample_id": 0}],
                        records={mode: {"method": "bbb", "layers": {}}})
    with open_zoo(path, verify=True) as zoo:
        assert zoo.layout.schema_version == 3 and len(zoo) == count + 1
        assert zoo.training_records() == {mode: {"method": "bbb", "layers": {}}}
    assert verify(path).ok
    assert _sha(shipped) == shipped_digest


# ---------------------------------------------------------------------- kills
KILLED_WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from zoo_helpers import checkpoint
    from posteriorzoo.zoo import open_zoo

    with open_zoo(sys.argv[1], mode="r+") as zoo:
        zoo.append_many([checkpoint(10), checkpoint(11)],
                        [{{"mode_id": 1, "sample_id": s}} for s in range(2)],
                        records={{1: {{"killed": True}}}})
    """)


def _killed_append(path: Path, folder: Path) -> None:
    """Append mode 1 with a record in a process killed just before the commit."""
    script = folder / "writer.py"
    script.write_text(KILLED_WRITER.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "POSTERIORZOO_KILL_AT": "zoo-before-commit"}
    process = subprocess.run([sys.executable, str(script), str(path)], env=env,
                             capture_output=True, timeout=120)
    assert process.returncode == -9, process.stderr.decode()[-500:]


def test_sigkill_between_the_record_and_the_commit_leaves_no_record(tmp_path):
    path = tmp_path / "zoo.h5"
    _collection(path, {0: SGHMC_RECORD})
    _killed_append(path, tmp_path)
    with h5py.File(path, "r", swmr=True, locking=False) as handle:
        assert handle["mode_records"].shape == (2,)  # the kill came after the record
        assert int(handle["committed"][0]) == 2
    with open_zoo(path, verify=True) as zoo:
        assert len(zoo) == 2 and zoo.training_records() == {0: SGHMC_RECORD}
    # The next writer rebuilds the file; mode 1 appended again without a record has none.
    with open_zoo(path, mode="r+") as zoo:
        zoo.append_many(*_mode(1))
    with open_zoo(path, verify=True) as zoo:
        assert len(zoo) == 4 and zoo.training_records() == {0: SGHMC_RECORD}
    assert verify(path).ok


def test_a_resumed_writer_records_the_killed_mode_again(tmp_path):
    path = tmp_path / "zoo.h5"
    _collection(path, {0: SGHMC_RECORD})
    _killed_append(path, tmp_path)
    with open_zoo(path, mode="r+") as zoo:
        zoo.append_many(*_mode(1), records={1: {"resumed": True}})
    with open_zoo(path, verify=True) as zoo:
        assert zoo.training_records() == {0: SGHMC_RECORD, 1: {"resumed": True}}
    assert verify(path).ok


def test_records_of_an_uncommitted_block_are_dropped_by_the_next_writer(tmp_path):
    """A failed block's leftovers without a kill (a write failure abandons the file)."""
    path = tmp_path / "zoo.h5"
    _collection(path, {0: SGHMC_RECORD})
    with h5py.File(path, "r+") as handle:  # mode 1's block: rows and a record, no commit
        for name in ["metadata", "metadata_sha256", *(f"state/{k}" for k in handle["state"])]:
            handle[name].resize(4, axis=0)
        stale = json.dumps({"stale": True}).encode()
        handle["mode_records"].resize(2, axis=0)
        handle["mode_records"][1] = (1, stale, hashlib.sha256(stale).hexdigest().encode())
    with open_zoo(path, verify=True) as zoo:
        assert zoo.training_records() == {0: SGHMC_RECORD}
    with open_zoo(path, mode="r+") as zoo:
        zoo.append_many(*_mode(1))
        assert zoo.training_records() == {0: SGHMC_RECORD}
    with h5py.File(path, "r") as handle:
        assert handle["mode_records"].shape == (1,)


# ---------------------------------------------------------------------- train
SGHMC_SPEC = """\
recipe = "optunet-mnist"
dataset = "digits"
method = "sghmc"
modes = 1
samples_per_mode = 4
base_seed = 7

[recipe_overrides]
epochs = 1

[method_options]
chains = 2
noise_correction = true
burn_in = 20
thin = 5
preconditioner = "none"
"""


def test_train_stores_each_modes_record(tmp_path, capsys):
    spec = tmp_path / "sghmc.toml"
    spec.write_text(SGHMC_SPEC)
    out = tmp_path / "sghmc.h5"
    code = main(["train", str(spec), "--out", str(out), "--backend", "serial",
                 "--engine", "torch", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    with open_zoo(out, verify=True) as zoo:
        assert len(zoo) == 4
        records = zoo.training_records()
    assert list(records) == [0]
    chains = records[0]["chains"]
    assert len(chains) == 2
    assert all(chain["kinetic_temperature"] > 0 for chain in chains)
    assert verify(out).records == 1
