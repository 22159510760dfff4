"""Safetensors export/import, the authors' release archives, key maps, and no pickle."""

from __future__ import annotations

import io
import json
import os
import pickle
import tarfile

import numpy as np
import pytest
import torch
from safetensors.torch import save as save_safetensors_bytes
from zoo_helpers import checkpoint

from posteriorzoo.collection import export_checkpoint, import_checkpoints, verify
from posteriorzoo.errors import NonFiniteWeightsError, ZooFormatError, ZooSchemaError
from posteriorzoo.zoo import KeyMap, create_zoo, open_zoo, read_checkpoint, read_release_archive


@pytest.fixture
def source_zoo(tmp_path):
    path = tmp_path / "source.h5"
    states = [checkpoint(seed) for seed in range(4)]
    with create_zoo(path, architecture="optunet", dataset="digits", method="swag",
                    num_classes=10, template=states[0]) as zoo:
        for seed, state in enumerate(states):
            zoo.append(state, seed=seed, mode_id=seed // 2, sample_id=seed % 2,
                       test_accuracy=0.8 + seed / 100)
    return path, states


def test_safetensors_round_trip(tmp_path, source_zoo):
    path, states = source_zoo
    with open_zoo(path) as zoo:
        files = [export_checkpoint(zoo, i, tmp_path / f"c{i}.safetensors").out
                 for i in range(4)]
        original_digests = [str(d) for d in zoo.metadata["sha256"]]
    state, header = read_checkpoint(files[2])
    assert list(state) == list(states[2])  # key order restored from the header
    assert all(torch.equal(state[k], states[2][k]) for k in state)
    assert header["architecture"] == "optunet" and header["method"] == "swag"
    assert json.loads(header["metadata"])["mode_id"] == 1
    # a new collection rebuilt from the exported files alone
    summary = import_checkpoints(tmp_path / "copy.h5", files)
    assert summary.created and summary.indices == range(4)
    with open_zoo(tmp_path / "copy.h5") as copy:
        assert (copy.architecture, copy.dataset, copy.method) == ("optunet", "digits", "swag")
        assert [str(d) for d in copy.metadata["sha256"]] == original_digests
        np.testing.assert_array_equal(copy.metadata["sample_id"], [0, 1, 0, 1])
        for i, state in enumerate(states):
            assert all(torch.equal(copy.state_dict(i)[k], state[k]) for k in state)
    # appending to the existing collection: checkpoints it already holds are skipped
    summary = import_checkpoints(tmp_path / "copy.h5", files[:1])
    assert not summary.created and summary.indices == range(4, 4)
    assert summary.skipped_existing == 1 and summary.skipped_repeated == 0
    with open_zoo(tmp_path / "copy.h5") as copy:
        assert len(copy) == 4
    # a new checkpoint is appended
    extra = checkpoint(11)
    from safetensors.torch import save_file
    save_file(extra, str(tmp_path / "extra.safetensors"))
    summary = import_checkpoints(tmp_path / "copy.h5",
                                 [files[0], tmp_path / "extra.safetensors"])
    assert summary.indices == range(4, 5) and summary.skipped_existing == 1
    with open_zoo(tmp_path / "copy.h5") as copy:
        assert len(copy) == 5
        assert all(torch.equal(copy.state_dict(4)[k], extra[k]) for k in extra)


def _release_archive(path, states, prefix="model."):
    """A release-format .tgz: one float16 safetensors file per model, foreign key names."""
    with tarfile.open(path, "w:gz") as archive:
        for index, state in enumerate(states):
            foreign = {prefix + k: v.half().contiguous() for k, v in state.items()}
            data = save_safetensors_bytes(foreign)
            info = tarfile.TarInfo(f"mnist-optunet/model_{index}.safetensors")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        readme = b"not a checkpoint"
        info = tarfile.TarInfo("README.txt")
        info.size = len(readme)
        archive.addfile(info, io.BytesIO(readme))


def test_release_archive_import_with_key_map(tmp_path):
    states = [checkpoint(seed) for seed in range(3)]
    archive = tmp_path / "mnist-optunet-0-2.tgz"
    _release_archive(archive, states)
    assert [name.split(":")[1] for name, _ in read_release_archive(archive)] == [
        f"mnist-optunet/model_{i}.safetensors" for i in range(3)]
    key_map_file = tmp_path / "keys.json"
    key_map_file.write_text(json.dumps({"rules": [["^model\\.", ""]]}))
    # The release's wrapper prefix ("model.") is stripped without a key map, and the
    # provenance records the rule; a prefix that leaves other keys than the model's
    # still needs one, and the refusal names both sides of the renaming.
    implied = import_checkpoints(tmp_path / "implied.h5", [archive])
    assert implied.provenance["options"]["key_map"]["rules"] == [("^model\\.", "")]
    nested = tmp_path / "mnist-optunet-0-1.tgz"
    _release_archive(nested, states[:2], prefix="model.net.")
    with pytest.raises(ZooSchemaError, match=r"missing key 'conv1\.weight' \(and \d+ more\); "
                       r"unexpected key 'model\.net\.conv1\.weight' .*key map"):
        import_checkpoints(tmp_path / "no-map.h5", [nested])
    assert not (tmp_path / "no-map.h5").exists()
    summary = import_checkpoints(tmp_path / "release.h5", [archive],
                                 key_map=KeyMap.from_file(key_map_file))
    assert summary.indices == range(3)
    with open_zoo(tmp_path / "implied.h5") as a, open_zoo(tmp_path / "release.h5") as b:
        assert a.digests == b.digests
    with open_zoo(tmp_path / "release.h5") as zoo:
        # attributes implied by the archive's name
        assert (zoo.architecture, zoo.dataset, zoo.method, zoo.num_classes) == (
            "optunet", "mnist", "de", 10)
        assert zoo.dtypes["conv2.weight"] == np.float16  # stored as released
        for i, state in enumerate(states):
            assert all(torch.equal(zoo.state_dict(i)[k], state[k].half()) for k in state)
        assert zoo.metadata_dict(1)["source"].endswith("model_1.safetensors")
    assert verify(tmp_path / "release.h5").ok
    # cast to float32 on import
    import_checkpoints(tmp_path / "release32.h5", [archive], dtype=torch.float32,
                       key_map=KeyMap(rules=[("^model\\.", "")]))
    with open_zoo(tmp_path / "release32.h5") as zoo:
        assert zoo.dtypes["fc.weight"] == np.float32


def test_key_map_rules():
    state = {"module.a": torch.zeros(1), "module.b": torch.ones(1), "opt.step": torch.zeros(1)}
    mapped = KeyMap(rename={"module.a": "x"}, rules=[("^module\\.", "")],
                    drop=["^opt\\."]).apply(state)
    assert list(mapped) == ["x", "b"]
    with pytest.raises(ZooSchemaError, match="two keys"):
        KeyMap(rules=[("^module\\.[ab]$", "same")]).apply(state)


def test_key_map_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ZooFormatError, match="JSON"):
        KeyMap.from_file(bad)
    bad.write_text(json.dumps({"rules": [["(unclosed", ""]]}))
    with pytest.raises(ZooFormatError, match="bad rule"):
        KeyMap.from_file(bad)
    with pytest.raises(ZooFormatError, match="not found"):
        KeyMap.from_file(tmp_path / "absent.json")


def test_one_bad_input_leaves_the_collection_unchanged(tmp_path, source_zoo):
    path, states = source_zoo
    good = tmp_path / "good.safetensors"
    with open_zoo(path) as zoo:
        export_checkpoint(zoo, 0, good)
    nan_state = {k: v.clone() for k, v in states[1].items()}
    nan_state["fc.bias"][0] = float("nan")
    nan_file = tmp_path / "nan.safetensors"
    from safetensors.torch import save_file
    save_file(nan_state, str(nan_file))
    wrong_shape = tmp_path / "shape.safetensors"
    save_file({**states[1], "fc.bias": torch.zeros(3)}, str(wrong_shape))
    before = path.read_bytes()
    with pytest.raises(NonFiniteWeightsError):
        import_checkpoints(path, [good, nan_file])
    with pytest.raises(ZooSchemaError, match="shape"):
        import_checkpoints(path, [good, wrong_shape])
    assert path.read_bytes() == before


def test_garbage_and_pickles_are_rejected_without_unpickling(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.safetensors"
    evil.write_bytes(pickle.dumps(Payload()))
    torch_file = tmp_path / "model.pt"
    torch.save({"w": torch.zeros(2)}, torch_file)
    for bad in (evil, torch_file):
        with pytest.raises(ZooFormatError, match="not a valid safetensors"):
            read_checkpoint(bad)
    with pytest.raises(ZooFormatError):
        import_checkpoints(tmp_path / "z.h5", [evil], architecture="optunet", dataset="d",
                           method="m")
    assert not marker.exists()
    assert not (tmp_path / "z.h5").exists()


def test_new_collection_needs_its_attributes(tmp_path):
    from safetensors.torch import save_file
    plain = tmp_path / "plain.safetensors"
    save_file(checkpoint(0), str(plain))
    with pytest.raises(ZooFormatError, match="architecture"):
        import_checkpoints(tmp_path / "z.h5", [plain])
    summary = import_checkpoints(tmp_path / "z.h5", [plain], architecture="optunet",
                                 dataset="fashion-mnist", method="de", num_classes=10)
    assert summary.created


def test_verify_export_and_import_return_collection_results(tmp_path, source_zoo):
    """Each returns a CollectionResult whose provenance records the inputs' SHA-256."""
    import hashlib

    from posteriorzoo.collection import CollectionResult, export_all
    from posteriorzoo.zoo import sha256_file

    path, _ = source_zoo
    report = verify(path, command="posteriorzoo verify source.h5")
    data = report.to_dict()
    assert isinstance(report, CollectionResult) and data["kind"] == "verify"
    assert data["ok"] and data["checkpoints"] == 4 and data["problems"] == []
    assert data["provenance"]["tool"] == "posteriorzoo verify"
    assert data["provenance"]["command"] == "posteriorzoo verify source.h5"
    assert data["provenance"]["inputs"]["collection"]["sha256"] == sha256_file(path)
    written = report.write(tmp_path / "verified")
    assert sorted(written) == ["bad_checkpoints.csv", "verify.json"]
    assert written["bad_checkpoints.csv"].read_text() == "checkpoint,problem\n"
    with open_zoo(path) as zoo:  # an open collection is verified and left open
        assert verify(zoo).ok
        assert zoo.state_dict(0)

    one = export_checkpoint(path, -1, tmp_path / "last.safetensors")
    assert one.kind == "export" and one.out == tmp_path / "last.safetensors"
    assert one.files == [{"name": "last.safetensors", "index": 3, "sha256": hashlib.sha256(
        one.out.read_bytes()).hexdigest()}]
    assert one.to_dict()["provenance"]["inputs"]["collection"]["sha256"] == sha256_file(path)
    assert one.provenance["options"]["index"] == 3

    every = export_all(path, tmp_path / "all")
    assert [(f["name"], f["index"]) for f in every.files] == [
        (f"{i:06d}.safetensors", i) for i in range(4)]
    for entry in every.files:
        assert entry["sha256"] == sha256_file(tmp_path / "all" / entry["name"])
    assert every.to_dict()["exported"] == every.files
    written = every.write(tmp_path / "export-record")
    assert sorted(written) == ["export.json", "exported.csv"]
    assert json.loads(written["export.json"].read_text())["checkpoints"] == 4

    inputs = sorted((tmp_path / "all").glob("*.safetensors"))
    imported = import_checkpoints(tmp_path / "copy.h5", [*inputs, inputs[0]],
                                  command="posteriorzoo import")
    data = imported.to_dict()
    assert data["kind"] == "import" and data["added"] == [0, 1, 2, 3]
    assert data["inputs"] == 5 and data["skipped_repeated"] == 1 and data["skipped"] == 1
    assert [entry["sha256"] for entry in data["provenance"]["inputs"].values()] == [
        sha256_file(file) for file in [*inputs, inputs[0]]]
    assert data["provenance"]["options"]["checkpoints_per_batch"] == 64
    written = imported.write(tmp_path / "import-record")
    assert written["imported.csv"].read_text().splitlines()[1] == "0,000000.safetensors"


def test_import_dry_run_lists_what_would_be_taken(tmp_path, capsys):
    """--dry-run reads the inputs' headers only and writes nothing: each member taken
    with the mode its name numbers, the members skipped, the attributes the archive's
    name implies and the key map (the release's model. prefix, implied)."""
    from posteriorzoo.cli import main
    from posteriorzoo.collection import plan_import

    states = [checkpoint(seed) for seed in range(3)]
    archive = tmp_path / "mnist-optunet-0-2.tgz"
    _release_archive(archive, states)
    before = sorted(tmp_path.iterdir())
    plan = plan_import([archive])
    [entry] = plan["inputs"]
    assert [(item["name"], item["mode"]) for item in entry["taken"]] == [
        (f"mnist-optunet/model_{i}.safetensors", i) for i in range(3)]
    assert [item["name"] for item in entry["skipped"]] == ["README.txt"]
    assert plan["attributes"] == {"architecture": "optunet", "dataset": "mnist",
                                  "method": "de", "num_classes": 10, "model_options": {}}
    assert plan["key_map"]["rules"] == [("^model\\.", "")] and plan["key_map"]["implied"]
    assert plan["checkpoints"] == 3 and json.loads(json.dumps(plan))["written"] is False
    assert main(["import", str(archive), "--out", str(tmp_path / "z.h5"), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "take mnist-optunet/model_2.safetensors" in printed and "-> mode 2" in printed
    assert "skip README.txt" in printed and "nothing was written" in printed
    assert sorted(tmp_path.iterdir()) == before   # no collection, no temporary file
