"""The HDF5 store: round trips, access patterns, validation, locking, bad files."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
import torch
from zoo_helpers import checkpoint

from posteriorzoo.collection import verify
from posteriorzoo.errors import (
    InvalidOptionError,
    NonFiniteWeightsError,
    OutputExistsError,
    UnknownNameError,
    ZooBusyError,
    ZooFormatError,
    ZooSchemaError,
)
from posteriorzoo.models import build
from posteriorzoo.zoo import checkpoint_digest, create_zoo, open_zoo


@pytest.fixture
def optunet_zoo(tmp_path):
    states = [checkpoint(seed) for seed in range(6)]
    path = tmp_path / "optunet.h5"
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=states[0], recipe={"lr": 0.04}) as zoo:
        for seed, state in enumerate(states):
            zoo.append(state, seed=seed, data_seed=100 + seed, test_accuracy=0.5 + seed / 100)
    return path, states


def test_state_dict_round_trip_is_bit_identical(optunet_zoo):
    path, states = optunet_zoo
    with open_zoo(path) as zoo:
        assert len(zoo) == len(states)
        assert zoo.state_keys == list(states[0])
        for index, state in enumerate(states):
            loaded = zoo.state_dict(index)
            assert list(loaded) == list(state)
            for key in state:
                assert loaded[key].dtype == state[key].dtype
                assert torch.equal(loaded[key], state[key])
        # negative index counts from the end, like a list
        assert torch.equal(zoo.state_dict(-1)["fc.bias"], states[-1]["fc.bias"])
        with pytest.raises(IndexError):
            zoo.state_dict(len(states))


@pytest.mark.parametrize("stack_bytes", [0, 1 << 24], ids=["row-by-row", "stacked"])
def test_resnet_buffers_round_trip(tmp_path, monkeypatch, stack_bytes):
    monkeypatch.setattr("posteriorzoo.zoo.store._STACK_BYTES", stack_bytes)
    states = [checkpoint(seed, "resnet18", num_classes=10, width=4) for seed in range(3)]
    path = tmp_path / "resnet.h5"
    with create_zoo(path, architecture="resnet18", dataset="cifar10", method="de",
                    num_classes=10, model_options={"width": 4}, template=states[0]) as zoo:
        zoo.append_many(states)
    with open_zoo(path) as zoo:
        assert zoo.model_options == {"width": 4}
        assert zoo.shapes["bn1.num_batches_tracked"] == ()
        for index, state in enumerate(states):
            loaded = zoo.state_dict(index)
            assert all(torch.equal(loaded[k], state[k]) for k in state)
        model = __import__("posteriorzoo.models", fromlist=["build"]).build(
            "resnet18", num_classes=10, width=4)
        model.load_state_dict(zoo.state_dict(1))  # strict: every key present, shapes right


def test_layer_across_checkpoints(optunet_zoo):
    path, states = optunet_zoo
    reference = np.stack([s["conv2.weight"].numpy() for s in states])
    with open_zoo(path) as zoo:
        np.testing.assert_array_equal(zoo.layer("conv2.weight"), reference)
        for index in ([4, 1, 1, 0], np.array([5, 2]), slice(1, None, 2), slice(-2, None),
                      reference[:, 0, 0, 0, 0] > 0, []):
            np.testing.assert_array_equal(zoo.layer("conv2.weight", index), reference[index])
        blocks = list(zoo.layer_blocks("conv2.weight", rows=4))
        assert [start for start, _ in blocks] == [0, 4]
        np.testing.assert_array_equal(np.concatenate([b for _, b in blocks]), reference)
        with pytest.raises(UnknownNameError, match="conv9"):
            zoo.layer("conv9.weight")


def test_layer_is_chunked_along_checkpoints(optunet_zoo):
    path, _ = optunet_zoo
    with open_zoo(path) as zoo:
        chunks = zoo.dataset_handle("conv2.weight").chunks
        # whole tensors per chunk, many checkpoints per chunk for a small layer
        assert chunks[1:] == (10, 1, 5, 5)
        assert chunks[0] > 100


def test_metadata_table(optunet_zoo):
    path, states = optunet_zoo
    with open_zoo(path) as zoo:
        table = zoo.metadata
        assert table.shape == (len(states),)
        np.testing.assert_array_equal(table["seed"], np.arange(len(states)))
        np.testing.assert_array_equal(table["data_seed"], 100 + np.arange(len(states)))
        # stored as given and read back, the same float64 expression: exact
        np.testing.assert_array_equal(table["test_accuracy"], 0.5 + np.arange(6) / 100)
        assert np.isnan(table["train_loss"]).all()  # unknown values are NaN, not 0
        assert (table["epoch"] == -1).all()
        row = zoo.metadata_dict(2)
        assert row["method"] == "de"
        assert "torch" in row["versions"]
        assert row["sha256"] == checkpoint_digest(
            {k: v.numpy() for k, v in states[2].items()}, zoo.state_keys)
        assert zoo.recipe == {"lr": 0.04}


def _content(path):
    with open_zoo(path) as zoo:
        return len(zoo), [str(d) for d in zoo.metadata["sha256"]]


def test_bad_checkpoints_are_rejected_and_leave_the_file_unchanged(optunet_zoo):
    path, states = optunet_zoo
    before = _content(path)
    good = states[0]
    missing = {k: v for k, v in good.items() if k != "fc.bias"}
    wrong_shape = {**good, "fc.bias": torch.zeros(11)}
    wrong_dtype = {**good, "fc.bias": good["fc.bias"].double()}
    nan = {**good, "fc.weight": good["fc.weight"].clone().fill_(float("nan"))}
    with open_zoo(path, mode="r+") as zoo:
        with pytest.raises(ZooSchemaError, match="missing"):
            zoo.append(missing)
        with pytest.raises(ZooSchemaError, match="shape"):
            zoo.append(wrong_shape)
        with pytest.raises(ZooSchemaError, match="dtype"):
            zoo.append(wrong_dtype)
        with pytest.raises(NonFiniteWeightsError):
            zoo.append(nan)
        # a batch with one bad member writes nothing at all
        with pytest.raises(NonFiniteWeightsError):
            zoo.append_many([good, nan])
        with pytest.raises(ZooSchemaError, match="unknown metadata"):
            zoo.append(good, sead=1)
        with pytest.raises(ZooSchemaError, match="limit"):
            zoo.append(good, source="x" * 300)
    assert _content(path) == before
    assert verify(path).ok


def test_diverged_checkpoints_are_kept_and_flagged(optunet_zoo):
    path, states = optunet_zoo
    nan = {**states[0], "fc.weight": states[0]["fc.weight"].clone().fill_(float("nan"))}
    with open_zoo(path, mode="r+") as zoo:
        index = zoo.append(nan, seed=99, diverged=True)
    with open_zoo(path) as zoo:
        assert bool(zoo.metadata["diverged"][index])
        assert torch.isnan(zoo.state_dict(index)["fc.weight"]).all()
    assert verify(path).ok


def test_create_validates_against_the_architecture(tmp_path):
    mlp = checkpoint(0, "mlp", widths=(2, 3, 1))
    with pytest.raises(ZooSchemaError):
        create_zoo(tmp_path / "a.h5", architecture="optunet", dataset="d", method="m",
                   template=mlp)
    with pytest.raises(UnknownNameError):
        create_zoo(tmp_path / "b.h5", architecture="no-such-net", dataset="d", method="m",
                   template=mlp)
    assert not list(tmp_path.iterdir())  # nothing left behind
    with create_zoo(tmp_path / "c.h5", architecture="my-own-net", dataset="d", method="m",
                    template=mlp, validate=False) as zoo:
        zoo.append(mlp)
    assert verify(tmp_path / "c.h5").ok
    with pytest.raises(OutputExistsError, match="exists"):
        create_zoo(tmp_path / "c.h5", architecture="my-own-net", dataset="d", method="m",
                   template=mlp, validate=False)


def test_read_only_and_single_writer(optunet_zoo):
    path, states = optunet_zoo
    with open_zoo(path) as reader, pytest.raises(ZooFormatError, match="read-only"):
        reader.append(states[0])
    with open_zoo(path, mode="r+") as writer:
        with pytest.raises(ZooBusyError):
            open_zoo(path, mode="r+")
        # a reader opened while the writer appends sees each commit
        with open_zoo(path) as reader:
            count = len(reader)
            writer.append(states[1], seed=7)
            assert len(reader) == count + 1
            assert torch.equal(reader.state_dict(count)["fc.weight"], states[1]["fc.weight"])
    with open_zoo(path, mode="r+") as writer:  # the lock is released on close
        assert len(writer) == len(states) + 1


def test_unreadable_files_raise_format_errors(tmp_path, optunet_zoo):
    path, _ = optunet_zoo
    with pytest.raises(ZooFormatError, match="no such file"):
        open_zoo(tmp_path / "absent.h5")
    text = tmp_path / "text.h5"
    text.write_text("not hdf5 at all")
    with pytest.raises(ZooFormatError, match="not an HDF5 file"):
        open_zoo(text)
    truncated = tmp_path / "truncated.h5"
    shutil.copy(path, truncated)
    with open(truncated, "r+b") as handle:
        handle.truncate(truncated.stat().st_size // 2)
    with pytest.raises(ZooFormatError):
        open_zoo(truncated)
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as handle:
        handle["x"] = np.arange(3)
    with pytest.raises(ZooFormatError, match="not a posteriorzoo collection"):
        open_zoo(foreign)
    with pytest.raises(ZooFormatError, match="not an HDF5"):
        open_zoo(text, mode="r+")
    with pytest.raises(ZooFormatError, match="not a file"):
        open_zoo(tmp_path)


def test_string_metadata_columns_are_str(tmp_path):
    model = build("optunet")
    with create_zoo(tmp_path / "z.h5", architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=model.state_dict()) as zoo:
        zoo.append(model.state_dict(), source="né ici")
    with open_zoo(tmp_path / "z.h5") as zoo:
        rows = zoo.metadata
        assert rows["source"][0] == "né ici" and isinstance(rows["method"][0], str)
        assert rows["method"][0] == "de" and len(rows["sha256"][0]) == 64
        assert zoo.stored_metadata()["source"][0] == "né ici".encode()


def test_create_zoo_never_replaces_a_folder(tmp_path):
    folder = tmp_path / "zoo.h5"
    folder.mkdir()
    (folder / "kept").write_text("x")
    for overwrite in (False, True):
        with pytest.raises(InvalidOptionError, match="is a folder"):
            create_zoo(folder, architecture="optunet", dataset="digits", method="de",
                       num_classes=10, template=checkpoint(0), overwrite=overwrite)
    assert (folder / "kept").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["zoo.h5"]


def test_rows_written_out_of_order_are_committed_in_place(tmp_path):
    """write_uncommitted puts a checkpoint at any row past the committed ones; readers
    see none of them until commit_uncommitted, which refuses rows never written."""
    path = tmp_path / "placed.h5"
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=checkpoint(0)) as zoo:
        zoo.append(checkpoint(0), seed=0)
        prepared = {}
        for seed in (3, 1, 2):  # arrive out of order, land at row seed
            rows, stacks = zoo.prepare([checkpoint(seed)], [{"seed": seed}])
            zoo.write_uncommitted(seed - 1, stacks)
            prepared[seed] = rows[0]
        with open_zoo(path) as reader:
            assert len(reader) == 1
        with pytest.raises(ZooSchemaError, match="never written"):
            zoo.commit_uncommitted(np.array([prepared[s] for s in (1, 2, 3, 3)]))
        assert zoo.commit_uncommitted(np.array([prepared[s] for s in (1, 2, 3)])) \
            == range(1, 4)
    with open_zoo(path, verify=True) as zoo:
        zoo.verify_all()
        assert zoo.metadata["seed"].tolist() == [0, 1, 2, 3]
        for seed in range(4):
            assert torch.equal(zoo.state_dict(seed)["fc.weight"], checkpoint(seed)["fc.weight"])


def test_all_finite_agrees_with_numpy_on_every_float16_and_on_wider_floats():
    from posteriorzoo.zoo.store import all_finite

    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = np.isfinite(every)
    assert [all_finite(every[i:i + 1]) for i in range(every.size)] == finite.tolist()
    assert all_finite(every[finite]) and not all_finite(every)
    for dtype in (np.float32, np.float64):
        for bad in (np.nan, np.inf, -np.inf):
            values = np.ones(1000, dtype=dtype)
            assert all_finite(values)
            values[777] = bad
            assert not all_finite(values)
    assert all_finite(np.array([2**62], dtype=np.int64))
