"""``posteriorzoo annotate``: a collection's posterior group set after training from a
measurement, with the reason recorded, and nothing else of the file changed.

The known answers are the input itself: every dataset of the copy must hold the input's
bytes (compared byte for byte, not within a tolerance), every attribute but
``annotations`` its value, and the provenance the input's SHA-256 computed here with
hashlib. The report's group is read back through ``analysis.report.build._group`` and a
small report.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from test_hdf5_compat import (
    assert_old_reader_agrees,
    assert_tools_read,
    needs_hdf5_tools,
    needs_old_reader,
)
from zoo_helpers import assert_one_line_error, checkpoint, flip_byte_in_chunk, run

from posteriorzoo.collection import verify
from posteriorzoo.errors import (
    ChecksumError,
    InvalidOptionError,
    OutputExistsError,
    ZooBusyError,
    ZooFormatError,
)
from posteriorzoo.vocabulary import METHODS, POSTERIOR_GROUPS
from posteriorzoo.zoo import AnnotateResult, annotate_collection, create_zoo, open_zoo
from posteriorzoo.zoo.annotate import MAX_REASON_CHARACTERS

SINGLE, MULTI = POSTERIOR_GROUPS
REASON = "loss barriers: 3 of 3 particles in distinct modes (barrier > 0.5 nats)"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def svgd_collection(path: Path, method: str = "svgd", annotations: dict | None = None
                    ) -> Path:
    """Two SVGD "modes" of three particles, with training records, as the trainer writes
    them: the spec said one group, which only a measurement can confirm."""
    if annotations is None:
        annotations = {"posterior": SINGLE, "modes": 2, "samples_per_mode": 3}
    with create_zoo(path, architecture="optunet", dataset="digits", method=method,
                    num_classes=10, template=checkpoint(0), annotations=annotations) as zoo:
        for mode in range(2):
            zoo.append_many([checkpoint(10 * mode + sample) for sample in range(3)],
                            [{"mode_id": mode, "sample_id": sample, "seed": mode,
                              "test_accuracy": 0.5 + sample / 10} for sample in range(3)],
                            records={mode: {"particles": 3, "bandwidth": 1.5 + mode}})
    return path


def everything(path: Path) -> dict:
    """Every object of the file: each dataset's bytes, dtype, shape, chunks, maxshape and
    filters, and every attribute of every object (the root's annotations apart)."""
    found: dict = {}
    with h5py.File(path, "r", locking=False) as handle:
        def visit(name: str, item: object) -> None:
            entry = {"attrs": {key: item.attrs[key] for key in item.attrs
                               if not (name == "/" and key == "annotations")}}
            if isinstance(item, h5py.Dataset):
                data = np.ascontiguousarray(item[()])
                entry.update(bytes=data.tobytes(), dtype=item.dtype.str, shape=item.shape,
                             chunks=item.chunks, maxshape=item.maxshape,
                             compression=item.compression,
                             layout=item.id.get_create_plist().get_layout())
            found[name] = entry

        visit("/", handle)
        handle.visititems(visit)
        found["superblock"] = handle.id.get_create_plist().get_version()
    # attribute values compared as their bytes (arrays compare elementwise)
    for entry in found.values():
        if isinstance(entry, dict):
            entry["attrs"] = {key: (np.asarray(value).dtype.str, np.asarray(value).tobytes())
                              if not isinstance(value, str | bytes) else value
                              for key, value in entry["attrs"].items()}
    return found


def stored_annotations(path: Path) -> tuple[dict, object]:
    """The annotations as parsed, and the attribute's HDF5 type."""
    with h5py.File(path, "r", locking=False) as handle:
        attribute = handle.attrs.get_id("annotations")
        return json.loads(handle.attrs["annotations"]), h5py.check_string_dtype(
            attribute.dtype)


# ---------------------------------------------------------------------- the round trip
def test_annotate_changes_only_the_annotations(tmp_path, capsys):
    path = svgd_collection(tmp_path / "svgd.h5")
    before, original = everything(path), sha256(path)
    old, string_type = stored_annotations(path)
    out = tmp_path / "svgd-mm.h5"
    code, text, err = run(capsys, "annotate", path, "--posterior", MULTI, "--reason",
                          f"  {REASON} ", "--out", out)
    assert code == 0, err
    assert err == ""
    assert text == (f"{path}: posterior {SINGLE} -> {MULTI} ({REASON}); written to {out}, "
                    "every checkpoint's digest checked, nothing else changed\n")
    assert sha256(path) == original                    # the input is never modified
    assert everything(out) == before                   # every other byte and attribute
    new, new_type = stored_annotations(out)
    assert new_type == string_type                     # the attribute's kind is kept
    setting = new.pop("posterior_set")
    assert new == {**old, "posterior": MULTI}
    assert setting["from"] == SINGLE and setting["reason"] == REASON  # spaces dropped
    assert set(setting) == {"from", "reason", "provenance"}
    made = setting["provenance"]
    assert made["tool"] == "posteriorzoo annotate"
    assert made["inputs"]["collection"]["sha256"] == original
    assert made["command"].startswith("posteriorzoo annotate ") and REASON in made["command"]
    assert made["versions"]["h5py"] == h5py.__version__
    assert made["options"]["posterior"] == MULTI and made["options"]["in_place"] is False
    report = verify(out)
    assert report.ok and report.checkpoints == 6 and report.records == 2
    with open_zoo(out, verify=True) as zoo, open_zoo(path) as source:
        zoo.verify_all()
        assert zoo.digests == source.digests
        assert zoo.training_records() == source.training_records()
        assert zoo.annotations["posterior"] == MULTI


def test_the_result_and_its_json_say_what_was_done(tmp_path, capsys):
    path = svgd_collection(tmp_path / "svgd.h5")
    result = annotate_collection(path, tmp_path / "out.h5", posterior=MULTI, reason=REASON)
    assert isinstance(result, AnnotateResult)
    assert (result.previous, result.posterior, result.checkpoints, result.method) == (
        SINGLE, MULTI, 6, "svgd")
    with open_zoo(tmp_path / "out.h5") as zoo:
        assert zoo.annotations["posterior_set"]["provenance"] == result.provenance
    code, text, err = run(capsys, "annotate", path, "--posterior", MULTI, "--reason", REASON,
                          "--out", tmp_path / "again.h5", "--json")
    assert code == 0, err
    data = json.loads(text)
    assert data["kind"] == "annotate" and data["posterior"] == MULTI
    assert data["previous"] == SINGLE and data["reason"] == REASON
    assert data["provenance"]["inputs"]["collection"]["sha256"] == sha256(path)


def test_annotating_again_keeps_the_earlier_decisions(tmp_path):
    path = svgd_collection(tmp_path / "svgd.h5")
    first = tmp_path / "first.h5"
    annotate_collection(path, first, posterior=MULTI, reason=REASON)
    firsts = stored_annotations(first)[0]["posterior_set"]
    before = everything(first)
    result = annotate_collection(first, in_place=True, posterior=SINGLE,
                                 reason="a finer barrier test joins the particles")
    assert (result.out, result.in_place, result.previous) == (first, True, MULTI)
    annotations = stored_annotations(first)[0]
    assert annotations["posterior"] == SINGLE
    setting = annotations["posterior_set"]
    assert setting["from"] == MULTI and setting["earlier"] == [firsts]
    assert setting["provenance"]["options"]["in_place"] is True
    assert everything(first) == before
    # a third time: the history is a list, oldest first, never nested
    annotate_collection(first, in_place=True, posterior=MULTI, reason="third")
    third = stored_annotations(first)[0]["posterior_set"]
    assert [entry["reason"] for entry in third["earlier"]] == [REASON, setting["reason"]]
    assert all("earlier" not in entry for entry in third["earlier"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first.h5", "svgd.h5"]


def test_a_collection_without_a_recorded_group_is_annotated_from_none(tmp_path):
    path = svgd_collection(tmp_path / "swag.h5", method="swag", annotations={})
    annotate_collection(path, tmp_path / "out.h5", posterior=SINGLE, reason=REASON)
    annotations = stored_annotations(tmp_path / "out.h5")[0]
    assert annotations["posterior"] == SINGLE and annotations["posterior_set"]["from"] is None
    assert set(annotations) == {"posterior", "posterior_set"}


def test_the_longest_reason_is_kept_whole(tmp_path):
    path = svgd_collection(tmp_path / "svgd.h5")
    reason = "x" * MAX_REASON_CHARACTERS
    annotate_collection(path, tmp_path / "out.h5", posterior=MULTI, reason=reason)
    assert stored_annotations(tmp_path / "out.h5")[0]["posterior_set"]["reason"] == reason


# ---------------------------------------------------------------------- refusals
@pytest.fixture
def collection(tmp_path) -> Path:
    return svgd_collection(tmp_path / "svgd.h5")


def _unchanged(folder: Path, path: Path, digest: str, names: list[str]) -> None:
    assert sha256(path) == digest
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)


@pytest.mark.parametrize("posterior", ["multimode", "Multi-mode", "", "other", "reference"])
def test_an_unknown_group_is_refused(collection, tmp_path, capsys, posterior):
    digest = sha256(collection)
    with pytest.raises(InvalidOptionError, match="posterior must be one of single-mode, "
                                                 "multi-mode"):
        annotate_collection(collection, tmp_path / "out.h5", posterior=posterior,
                            reason=REASON)
    code, _, err = run(capsys, "annotate", collection, "--posterior", posterior, "--reason",
                       REASON, "--out", tmp_path / "out.h5")
    assert_one_line_error(code, err, "--posterior", "invalid choice")
    _unchanged(tmp_path, collection, digest, ["svgd.h5"])


@pytest.mark.parametrize("reason, fragment", [
    ("", "reason is empty"), ("   ", "reason is empty"),
    ("two\nlines", "one line"), ("a\ttab", "one line"), ("bell\x07", "one line"),
    ("x" * (MAX_REASON_CHARACTERS + 1), "at most 500"),
], ids=["empty", "spaces", "newline", "tab", "control", "too-long"])
def test_a_bad_reason_is_refused(collection, tmp_path, capsys, reason, fragment):
    digest = sha256(collection)
    with pytest.raises(InvalidOptionError, match=fragment):
        annotate_collection(collection, tmp_path / "out.h5", posterior=MULTI, reason=reason)
    code, _, err = run(capsys, "annotate", collection, "--posterior", MULTI, "--reason",
                       reason, "--out", tmp_path / "out.h5")
    assert_one_line_error(code, err, "posteriorzoo annotate: error:", fragment)
    _unchanged(tmp_path, collection, digest, ["svgd.h5"])


def test_a_reason_that_is_not_text_is_refused(collection, tmp_path):
    with pytest.raises(InvalidOptionError, match="reason"):
        annotate_collection(collection, tmp_path / "out.h5", posterior=MULTI, reason=3)


def test_missing_and_non_collection_files_are_refused(tmp_path, capsys):
    missing = tmp_path / "absent.h5"
    with pytest.raises(ZooFormatError, match="no such file"):
        annotate_collection(missing, tmp_path / "out.h5", posterior=MULTI, reason=REASON)
    code, _, err = run(capsys, "annotate", missing, "--posterior", MULTI, "--reason", REASON,
                       "--out", tmp_path / "out.h5")
    assert_one_line_error(code, err, "no such file")
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(range(256)) * 8)
    plain = tmp_path / "plain.h5"
    with h5py.File(plain, "w") as handle:
        handle["x"] = np.arange(3)
    for path, fragment in ((garbage, "cannot be read as HDF5"),
                           (plain, "not a posteriorzoo collection")):
        digest = sha256(path)
        with pytest.raises(ZooFormatError, match=fragment):
            annotate_collection(path, tmp_path / "out.h5", posterior=MULTI, reason=REASON)
        code, _, err = run(capsys, "annotate", path, "--posterior", MULTI, "--reason",
                           REASON, "--out", tmp_path / "out.h5")
        assert_one_line_error(code, err, fragment)
        assert sha256(path) == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.h5", "plain.h5"]


def test_a_damaged_checkpoint_is_refused_and_nothing_is_written(collection, tmp_path,
                                                                 capsys):
    flip_byte_in_chunk(collection, "fc.weight")
    digest = sha256(collection)
    with pytest.raises(ChecksumError, match="corrupt"):
        annotate_collection(collection, tmp_path / "out.h5", posterior=MULTI, reason=REASON)
    code, _, err = run(capsys, "annotate", collection, "--posterior", MULTI, "--reason",
                       REASON, "--in-place")
    assert_one_line_error(code, err, "corrupt", "posteriorzoo verify")
    _unchanged(tmp_path, collection, digest, ["svgd.h5"])


def test_a_damaged_training_record_is_refused_and_nothing_is_written(collection, tmp_path,
                                                                      capsys):
    with h5py.File(collection, "r+", libver=("v110", "v110"), locking=False) as handle:
        rows = handle["mode_records"][:]
        rows["record"][1] = rows["record"][1].replace(b"2.5", b"9.5")  # digest kept
        handle["mode_records"][:] = rows
    digest = sha256(collection)
    with pytest.raises(ChecksumError, match="training record of mode 1"):
        annotate_collection(collection, tmp_path / "out.h5", posterior=MULTI, reason=REASON)
    code, _, err = run(capsys, "annotate", collection, "--posterior", MULTI, "--reason",
                       REASON, "--out", tmp_path / "out.h5")
    assert_one_line_error(code, err, "training record of mode 1", "nothing was written")
    _unchanged(tmp_path, collection, digest, ["svgd.h5"])


def test_the_output_policy(collection, tmp_path, capsys):
    digest = sha256(collection)
    out = tmp_path / "out.h5"
    out.write_bytes(b"precious")
    with pytest.raises(OutputExistsError, match="already exists"):
        annotate_collection(collection, out, posterior=MULTI, reason=REASON)
    code, _, err = run(capsys, "annotate", collection, "--posterior", MULTI, "--reason",
                       REASON, "--out", out)
    assert_one_line_error(code, err, "already exists")
    assert out.read_bytes() == b"precious"
    for overwrite in (False, True):   # the input is replaced only with --in-place
        with pytest.raises(InvalidOptionError, match="replace the input"):
            annotate_collection(collection, collection, posterior=MULTI, reason=REASON,
                                overwrite=overwrite)
    code, _, err = run(capsys, "annotate", collection, "--posterior", MULTI, "--reason",
                       REASON, "--out", collection, "--overwrite")
    assert_one_line_error(code, err, "replace the input")
    with pytest.raises(InvalidOptionError, match="either"):
        annotate_collection(collection, out, in_place=True, posterior=MULTI, reason=REASON)
    with pytest.raises(InvalidOptionError, match="--in-place"):
        annotate_collection(collection, posterior=MULTI, reason=REASON)
    code, _, err = run(capsys, "annotate", collection, "--posterior", MULTI, "--reason",
                       REASON)
    assert_one_line_error(code, err, "--out", "--in-place", "required")
    code, _, err = run(capsys, "annotate", collection, "--posterior", MULTI, "--reason",
                       REASON, "--in-place", "--overwrite")
    assert_one_line_error(code, err, "--overwrite applies to --out")
    assert (tmp_path / "nowhere").exists() is False
    with pytest.raises(InvalidOptionError, match="does not exist"):
        annotate_collection(collection, tmp_path / "nowhere" / "out.h5", posterior=MULTI,
                            reason=REASON)
    _unchanged(tmp_path, collection, digest, ["svgd.h5", "out.h5"])
    assert out.read_bytes() == b"precious"
    # --overwrite replaces it
    annotate_collection(collection, out, posterior=MULTI, reason=REASON, overwrite=True)
    assert stored_annotations(out)[0]["posterior"] == MULTI


def test_a_collection_of_one_network_per_mode_is_refused(tmp_path, capsys):
    path = svgd_collection(tmp_path / "de.h5", method="de", annotations={})
    digest = sha256(path)
    with pytest.raises(InvalidOptionError, match="one independently trained network per "
                                                 "mode"):
        annotate_collection(path, tmp_path / "out.h5", posterior=SINGLE, reason=REASON)
    code, _, err = run(capsys, "annotate", path, "--posterior", SINGLE, "--reason", REASON,
                       "--in-place")
    assert_one_line_error(code, err, "a DE collection", "not annotated")
    _unchanged(tmp_path, path, digest, ["de.h5"])


def test_which_methods_have_one_network_per_mode_is_the_trainers(tmp_path):
    """The vocabulary's flag, which the command reads without torch, is the trainer's
    (DE only: SVGD, of the same family, trains its particles as one mode)."""
    from train_zoo.methods.registry import REGISTRY

    assert set(REGISTRY) == set(METHODS)
    for name, method in REGISTRY.items():
        assert METHODS[name].one_sample_per_mode is method.one_sample_per_mode, name
    assert [n for n, info in METHODS.items() if info.one_sample_per_mode] == ["de"]
    assert METHODS["svgd"].family == METHODS["de"].family == "ensemble"


def test_the_trainer_writes_the_groups_of_the_vocabulary():
    from train_zoo import make_spec
    from train_zoo.run import _annotations

    one = make_spec("optunet-mnist", dataset="digits", method="swag", modes=1,
                    samples_per_mode=4)
    many = make_spec("optunet-mnist", dataset="digits", method="swag", modes=2,
                     samples_per_mode=2)
    assert (_annotations(one)["posterior"], _annotations(many)["posterior"]) == (SINGLE,
                                                                                 MULTI)


def test_a_writer_holding_the_collection_is_waited_for_by_nobody(collection, tmp_path,
                                                                  capsys):
    digest = sha256(collection)
    with open_zoo(collection, mode="r+"):
        with pytest.raises(ZooBusyError, match="writing"):
            annotate_collection(collection, tmp_path / "out.h5", posterior=MULTI,
                                reason=REASON)
        code, _, err = run(capsys, "annotate", collection, "--posterior", MULTI,
                           "--reason", REASON, "--in-place")
        assert_one_line_error(code, err, "another process is writing")
    _unchanged(tmp_path, collection, digest, ["svgd.h5"])


@pytest.mark.parametrize("where", ["--in-place", "--out"])
def test_a_killed_run_leaves_the_input_and_no_output(collection, tmp_path, where):
    digest = sha256(collection)
    out = tmp_path / "out.h5"
    command = [sys.executable, "-m", "posteriorzoo", "annotate", str(collection),
               "--posterior", MULTI, "--reason", REASON,
               *(["--in-place"] if where == "--in-place" else ["--out", str(out)])]
    killed = subprocess.run(command, capture_output=True,
                            env={**os.environ, "POSTERIORZOO_KILL_AT": "publish"})
    assert killed.returncode == -9
    assert sha256(collection) == digest and not out.exists()
    subprocess.run(command, check=True, capture_output=True)   # reclaims the partial
    written = collection if where == "--in-place" else out
    assert stored_annotations(written)[0]["posterior"] == MULTI and verify(written).ok
    expected = ["svgd.h5"] if where == "--in-place" else ["out.h5", "svgd.h5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == expected


# ---------------------------------------------------------------------- readers
def test_info_shows_the_group_and_the_reason(collection, tmp_path, capsys):
    out = tmp_path / "out.h5"
    annotate_collection(collection, out, posterior=MULTI, reason=REASON)
    code, text, err = run(capsys, "info", out)
    assert code == 0, err
    lines = [line for line in text.splitlines() if line.startswith("  posterior ")]
    assert len(lines) == 1
    assert lines[0].startswith(f"  posterior     {MULTI}, set after training (was {SINGLE}; ")
    assert lines[0].endswith(f"): {REASON}")
    shown = next(line for line in text.splitlines() if line.startswith("  annotations"))
    assert json.loads(shown.split(None, 1)[1]) == {"modes": 2, "posterior": MULTI,
                                                   "samples_per_mode": 3}
    code, text, _ = run(capsys, "info", out, "--json")
    assert json.loads(text)["annotations"]["posterior_set"]["reason"] == REASON
    code, text, _ = run(capsys, "info", collection)   # nothing set: no such line
    assert code == 0 and "  posterior " not in text


def test_the_report_groups_the_collection_by_its_new_group(tmp_path):
    from analysis.labels import collection_label
    from analysis.report import build_report
    from analysis.report.build import _group

    path = svgd_collection(tmp_path / "svgd.h5")
    out = tmp_path / "svgd-mm.h5"
    annotate_collection(path, out, posterior=MULTI, reason=REASON)
    with open_zoo(path) as before, open_zoo(out) as after:
        assert (_group(before), _group(after)) == (SINGLE, MULTI)
        assert (collection_label(before), collection_label(after)) == ("SVGD", "MM-SVGD")
    target = tmp_path / "target.h5"
    states = [checkpoint(100 + seed) for seed in range(20)]
    with create_zoo(target, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=states[0]) as zoo:
        zoo.append_many(states, [{"seed": seed} for seed in range(20)])
    report = build_report(target, {"SVGD": path, "MM-SVGD": out}, figures=False, splits=2,
                          n_images=50, n_pairs=2)
    groups = {row["name"]: row["group"] for row in report.rows}
    assert groups == {"SVGD": SINGLE, "MM-SVGD": MULTI}
    # one run (modes 1) measured multi-mode: the method's own name, in the multi-mode group
    one = svgd_collection(tmp_path / "one.h5",
                          annotations={"posterior": SINGLE, "modes": 1,
                                       "samples_per_mode": 6})
    annotate_collection(one, tmp_path / "one-mm.h5", posterior=MULTI, reason=REASON)
    with open_zoo(tmp_path / "one-mm.h5") as after:
        assert (_group(after), collection_label(after)) == (MULTI, "SVGD")


@needs_old_reader
def test_hdf5_1_10_reads_the_annotated_copy(collection, tmp_path):
    """Debian's h5py on HDF5 1.10.8 reads every object and attribute of the copy, the new
    annotations included, with the values this environment's h5py reads."""
    out = tmp_path / "out.h5"
    annotate_collection(collection, out, posterior=MULTI, reason=REASON)
    assert_old_reader_agrees([collection, out])
    with h5py.File(out, "r", locking=False) as handle:
        assert handle.attrs["hdf5_format"] == "v110"
        assert handle.id.get_create_plist().get_version()[0] == 3


@needs_hdf5_tools
def test_h5ls_and_h5dump_read_the_annotated_copy(collection, tmp_path):
    out = tmp_path / "out.h5"
    annotate_collection(collection, out, posterior=MULTI, reason=REASON)
    assert_tools_read(out)
