"""The metadata column ``chain`` (schema 4): which Markov chain a sample was drawn from.

Files of schemas 1 to 3 (every shipped collection) have no such column: they open,
verify (their row digests hash rows in their own table) and read ``chain`` -1. New files
store it, its value is covered by the row's SHA-256, and ``diagnose`` groups a mode's
draws by it instead of guessing the chain-major split. An append to an older file keeps
the file's table: a chain given for it is dropped with a warning (the rule of
:mod:`posteriorzoo.zoo.schema`), and a rebuild keeps the file's schema.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest

from posteriorzoo.collection import diagnose, verify
from posteriorzoo.diagnostics import DEFAULT_LAGS, chain_statistics
from posteriorzoo.errors import ChecksumError, ZooFormatError
from posteriorzoo.models import build
from posteriorzoo.reference import reference_path
from posteriorzoo.zoo import create_zoo, open_zoo, upgrade_zoo
from posteriorzoo.zoo.schema import (
    METADATA_DTYPE,
    SCHEMA_VERSION,
    metadata_dtype,
    row_digest,
)

NOT_RECORDED = "chains not recorded; split by the chains option in sample order"


def _template() -> dict[str, np.ndarray]:
    return {key: value.numpy() for key, value in build("optunet").state_dict().items()}


def _draw(template, rng, centre: float) -> dict[str, np.ndarray]:
    return {key: (centre + 0.1 * rng.standard_normal(value.shape)).astype(value.dtype)
            for key, value in template.items()}


def _sghmc_zoo(path, draws, rows, chains=2):
    """An SGHMC collection of ``draws`` (state dicts) with metadata ``rows``, whose recipe
    says ``chains`` chains per mode."""
    with create_zoo(path, architecture="optunet", dataset="fashion-mnist", method="sghmc",
                    num_classes=10, template=draws[0],
                    recipe={"method_options": {"chains": chains}}) as zoo:
        zoo.append_many(draws, rows)
    return path


def _weights(path) -> np.ndarray:
    """(N, d) float64: every weight of each checkpoint, in state key order (diagnose's)."""
    with open_zoo(path) as zoo:
        return np.concatenate([zoo.layer(key).reshape(len(zoo), -1).astype(np.float64)
                               for key in zoo.state_keys], axis=1)


def _old_copy(path):
    shutil.copy(reference_path("sghmc"), path)
    return path


# ------------------------------------------------------------------ older files
def test_a_schema_3_file_opens_verifies_and_reads_chain_minus_one(tmp_path):
    path = _old_copy(tmp_path / "sghmc.h5")
    with open_zoo(path, verify=True) as zoo:
        assert zoo.layout.schema_version == 3 < SCHEMA_VERSION
        assert "chain" not in zoo.stored_metadata().dtype.names
        assert zoo.stored_metadata().dtype == metadata_dtype(3) == zoo.metadata_dtype
        table = zoo.metadata
        assert table.dtype.names == METADATA_DTYPE.names
        assert (table["chain"] == -1).all() and len(table) == len(zoo) == 100
        assert zoo.metadata_dict(7)["chain"] == -1
        # the stored digests are of the rows as stored, without the column
        with h5py.File(path, "r", locking=False) as handle:
            assert row_digest(handle["metadata"][0]) == handle["metadata_sha256"][0].decode()
    report = verify(path)
    assert report.ok, report.problems


def test_a_changed_row_of_a_schema_3_file_is_still_caught(tmp_path):
    path = _old_copy(tmp_path / "sghmc.h5")
    with h5py.File(path, "r+", locking=False) as handle:
        rows = handle["metadata"][()]
        rows["sample_id"][3] = 99
        handle["metadata"][()] = rows
    assert not verify(path).ok
    with open_zoo(path, verify=True) as zoo, pytest.raises(ChecksumError, match="metadata row"):
        zoo.stored_metadata()


def test_a_table_of_another_schema_is_refused(tmp_path):
    """Schema 3 with the schema 4 table, and schema 4 with the schema 3 table: refused
    at open, whichever way round."""
    old = _old_copy(tmp_path / "old.h5")
    with h5py.File(old, "r+", locking=False) as handle:
        handle.attrs["schema_version"] = 4
    with pytest.raises(ZooFormatError, match="schema 4's metadata table"):
        open_zoo(old)
    rng = np.random.default_rng(0)
    new = _sghmc_zoo(tmp_path / "new.h5", [_draw(_template(), rng, 0.0)], [{"chain": 0}])
    with h5py.File(new, "r+", locking=False) as handle:
        handle.attrs["schema_version"] = 3
    with pytest.raises(ZooFormatError, match="schema 3's metadata table"):
        open_zoo(new)


# ------------------------------------------------------------------ new files
def test_a_new_file_round_trips_chains_and_its_digests_cover_them(tmp_path):
    rng = np.random.default_rng(1)
    template = _template()
    chains = [0, 1, 0, 1, 2, -1]
    path = _sghmc_zoo(tmp_path / "zoo.h5", [_draw(template, rng, 0.0) for _ in chains],
                      [{"mode_id": 0, "sample_id": j, "chain": c}
                       for j, c in enumerate(chains)])
    with open_zoo(path, verify=True) as zoo:
        assert zoo.layout.schema_version == SCHEMA_VERSION == 4
        assert zoo.stored_metadata().dtype == METADATA_DTYPE
        assert zoo.metadata["chain"].tolist() == chains
        assert [zoo.metadata_dict(i)["chain"] for i in range(len(chains))] == chains
    with open_zoo(path, mode="r+") as zoo, warnings.catch_warnings():
        warnings.simplefilter("error")  # no column dropped: no warning
        zoo.append(_draw(template, rng, 0.0), mode_id=0, sample_id=6, chain=3)
    with open_zoo(path) as zoo:
        assert zoo.metadata["chain"].tolist() == [*chains, 3]
    assert verify(path).ok
    # tampering with the chain alone breaks the row's SHA-256
    with h5py.File(path, "r+", locking=False) as handle:
        rows = handle["metadata"][()]
        rows["chain"][1] = 0
        handle["metadata"][()] = rows
    report = verify(path)
    assert not report.ok and any("metadata row" in problem for problem in report.problems)
    with open_zoo(path, verify=True) as zoo, pytest.raises(ChecksumError, match="checkpoint 1"):
        zoo.stored_metadata()


OLD_PYTHON = Path("/usr/bin/python3")
OLD_READER = ("import h5py, json, sys\n"
              "with h5py.File(sys.argv[1], 'r') as f:\n"
              "    print(json.dumps([h5py.version.hdf5_version,\n"
              "                      f['metadata']['chain'].tolist(),\n"
              "                      [d.decode() for d in f['metadata_sha256'][()]]]))\n")


def _old_hdf5() -> str:
    if not OLD_PYTHON.exists():
        return ""
    probe = subprocess.run([str(OLD_PYTHON), "-c", "import h5py; print(h5py.version."
                            "hdf5_version)"], capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else ""


@pytest.mark.skipif(not _old_hdf5().startswith("1.10"),
                    reason="Debian's python3-h5py (HDF5 1.10) is not installed "
                           "(.ci/run installs it)")
def test_hdf5_1_10_reads_the_chain_column(tmp_path):
    rng = np.random.default_rng(5)
    path = _sghmc_zoo(tmp_path / "zoo.h5", [_draw(_template(), rng, 0.0) for _ in range(3)],
                      [{"chain": c} for c in (1, 0, 1)])
    result = subprocess.run([str(OLD_PYTHON), "-c", OLD_READER, str(path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    version, chains, digests = json.loads(result.stdout)
    assert version.startswith("1.10") and chains == [1, 0, 1]
    with open_zoo(path) as zoo:
        assert digests == [row_digest(row) for row in zoo.stored_metadata()]


# ------------------------------------------------------------------ appends to older files
def test_an_append_to_a_schema_3_file_drops_a_chain_with_a_warning(tmp_path):
    path = _old_copy(tmp_path / "sghmc.h5")
    with open_zoo(path) as zoo:
        state, count = zoo.arrays(0), len(zoo)
    with open_zoo(path, mode="r+") as zoo:
        with pytest.warns(UserWarning, match="schema 3 collection has no metadata column "
                                             "'chain'"):
            zoo.append(state, mode_id=1, sample_id=0, chain=2)
        with warnings.catch_warnings():  # a chain of -1 (none) loses nothing: no warning
            warnings.simplefilter("error")
            zoo.append(state, mode_id=1, sample_id=1, chain=-1)
            zoo.append(state, mode_id=1, sample_id=2)
    with open_zoo(path, verify=True) as zoo:
        assert zoo.layout.schema_version == 3  # the file keeps its table
        assert zoo.stored_metadata().dtype == metadata_dtype(3)
        assert len(zoo) == count + 3
        assert (zoo.metadata["chain"] == -1).all()
        assert zoo.metadata["sample_id"][-3:].tolist() == [0, 1, 2]
    assert verify(path).ok
    assert upgrade_zoo(path) is None  # already the newest schema of its table


def test_a_rebuild_keeps_a_schema_2_file_s_table_and_makes_it_schema_3(tmp_path):
    path = _old_copy(tmp_path / "sghmc.h5")
    with h5py.File(path, "r+", locking=False) as handle:
        del handle["mode_records"]
        handle.attrs["schema_version"] = 2
    with open_zoo(path) as zoo:
        digests = zoo._file["metadata_sha256"][:].tolist()
    assert upgrade_zoo(path) == "its schema is older than 3"
    with open_zoo(path, verify=True) as zoo:
        assert zoo.layout.schema_version == 3
        assert zoo.stored_metadata().dtype == metadata_dtype(3)
        assert zoo._file["metadata_sha256"][:].tolist() == digests
        assert (zoo.metadata["chain"] == -1).all()
    assert verify(path).ok


# ------------------------------------------------------------------ diagnose
def _interleaved(tmp_path, record: bool, per_chain: int = 8):
    """Two chains around 0 and 1, stored interleaved in sample order (sample j is chain
    j % 2): the recorded grouping separates them, the chain-major split mixes them."""
    rng = np.random.default_rng(2)
    template = _template()
    draws, rows = [], []
    for j in range(2 * per_chain):
        draws.append(_draw(template, rng, float(j % 2)))
        rows.append({"mode_id": 0, "sample_id": j, **({"chain": j % 2} if record else {})})
    return _sghmc_zoo(tmp_path / f"zoo-{record}.h5", draws, rows)


def test_diagnose_groups_draws_by_their_recorded_chain(tmp_path):
    path = _interleaved(tmp_path, record=True)
    result = diagnose(path, predictions=False)
    chain = result.chains[0]
    assert (chain["chains"], chain["draws"]) == (2, 8)
    assert not any("chains not recorded" in line for line in result.unknown)
    weights = _weights(path)
    lags = tuple(lag for lag in DEFAULT_LAGS if lag < 8)
    grouped = chain_statistics(np.stack([weights[0::2], weights[1::2]]), lags)
    split = chain_statistics(weights.reshape(2, 8, -1), lags)
    # the same float64 values into the same function: bit for bit
    assert chain["r_hat"]["median"] == grouped.r_hat.median
    assert chain["ess"]["median"] == grouped.ess.median
    # chains around 0 and 1 do not mix; the chain-major split would have said they do
    assert grouped.r_hat.median > 1.5 and split.r_hat.median < 1.1
    assert chain["r_hat"]["median"] != split.r_hat.median


def test_diagnose_without_recorded_chains_splits_and_says_so(tmp_path):
    path = _interleaved(tmp_path, record=False)
    result = diagnose(path, predictions=False)
    chain = result.chains[0]
    weights = _weights(path)
    lags = tuple(lag for lag in DEFAULT_LAGS if lag < 8)
    split = chain_statistics(weights.reshape(2, 8, -1), lags)
    assert chain["r_hat"]["median"] == split.r_hat.median
    assert result.unknown.count(f"mode 0: {NOT_RECORDED}") == 1


def test_diagnose_of_a_shipped_collection_says_chains_are_not_recorded():
    result = diagnose(reference_path("sghmc"), predictions=False)
    assert f"mode 0: {NOT_RECORDED}" in result.unknown
    assert (result.chains[0]["chains"], result.chains[0]["draws"]) == (4, 25)


def test_partly_recorded_chains_fall_back_to_the_split(tmp_path):
    rng = np.random.default_rng(3)
    template = _template()
    path = _sghmc_zoo(tmp_path / "zoo.h5", [_draw(template, rng, 0.0) for _ in range(8)],
                      [{"mode_id": 0, "sample_id": j, "chain": -1 if j == 5 else j % 2}
                       for j in range(8)])
    result = diagnose(path, predictions=False)
    assert result.unknown.count(f"mode 0: {NOT_RECORDED}") == 1
    assert result.chains[0]["draws"] == 4


def test_chains_of_unequal_length_use_the_first_draws_of_each(tmp_path):
    rng = np.random.default_rng(4)
    template = _template()
    chains = [0, 1] * 5 + [0]  # chain 0 holds 6 draws, chain 1 holds 5
    path = _sghmc_zoo(tmp_path / "zoo.h5",
                      [_draw(template, rng, float(c)) for c in chains],
                      [{"mode_id": 0, "sample_id": j, "chain": c}
                       for j, c in enumerate(chains)])
    result = diagnose(path, predictions=False)
    assert "mode 0: its chains hold 6, 5 draws; the statistics use the first 5 of each" \
        in result.unknown
    weights = _weights(path)
    lags = tuple(lag for lag in DEFAULT_LAGS if lag < 5)
    direct = chain_statistics(np.stack([weights[0::2][:5], weights[1::2][:5]]), lags)
    assert result.chains[0]["r_hat"]["median"] == direct.r_hat.median


# ------------------------------------------------------------------ the trainer
def test_sghmc_training_records_each_sample_s_chain(tmp_path):
    from train_zoo import make_spec
    from train_zoo.backends import SerialBackend
    from train_zoo.run import train_collection

    spec = make_spec("optunet-mnist", dataset="digits", method="sghmc", modes=1,
                     samples_per_mode=4, base_seed=5, recipe_overrides={"epochs": 1},
                     method_options={"burn_in": 4, "thin": 2, "preconditioner": "none",
                                     "chains": 2})
    out = tmp_path / "sghmc.h5"
    train_collection(spec, out, backend=SerialBackend(), progress=False)
    with open_zoo(out, verify=True) as zoo:
        rows = zoo.metadata
        assert rows["sample_id"].tolist() == [0, 1, 2, 3]
        assert rows["chain"].tolist() == [0, 0, 1, 1]  # chain-major, as the chains ran
        recorded = [c["chain"] for c in zoo.training_records()[0]["chains"]]
        assert sorted(set(rows["chain"].tolist())) == recorded
    assert not any("chains not recorded" in line
                   for line in diagnose(out, predictions=False).unknown)


def test_a_method_without_chains_stores_chain_minus_one(tmp_path):
    from train_zoo import make_spec, train_checkpoints

    spec = make_spec("optunet-mnist", dataset="digits", method="mc-dropout", modes=1,
                     samples_per_mode=2, base_seed=5, recipe_overrides={"epochs": 1})
    results = train_checkpoints(spec, [0], engine="torch")
    assert [r.chain for r in results] == [-1, -1]
    assert all(r.metadata(1, "h", "s")["chain"] == -1 for r in results)
