"""Importing the authors' release archives: what the names tell is recorded (a numbered
member's number is its mode), and what nothing tells is shown as unknown."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as save_safetensors_bytes
from zoo_helpers import checkpoint, run

from posteriorzoo.collection import describe, import_checkpoints, verify
from posteriorzoo.zoo import KeyMap, open_zoo, reorder_collection
from posteriorzoo.zoo.archives import member_modes

KEYS = KeyMap(rules=[("^model\\.", "")])


def release(path: Path, members: dict[str, int]) -> Path:
    """A release-format .tgz: ``{member name: seed}``, float16, the authors' key prefix."""
    with tarfile.open(path, "w:gz") as archive:
        for name, seed in members.items():
            data = save_safetensors_bytes({f"model.{key}": value.half().contiguous()
                                           for key, value in checkpoint(seed).items()})
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def modes_of(path: Path) -> list[tuple[int, int]]:
    with open_zoo(path) as zoo:
        rows = zoo.metadata
        return list(zip(rows["mode_id"].tolist(), rows["sample_id"].tolist(), strict=True))


def test_numbered_members_become_modes_and_info_says_seeds_unknown(tmp_path, capsys):
    archive = release(tmp_path / "mnist-optunet-0-2.tgz",
                      {f"mnist-optunet/model_{i}.safetensors": i for i in range(3)})
    import_checkpoints(tmp_path / "authors.h5", [archive], key_map=KEYS)
    assert modes_of(tmp_path / "authors.h5") == [(0, 0), (1, 0), (2, 0)]
    code, out, _ = run(capsys, "info", tmp_path / "authors.h5")
    assert code == 0
    assert "  checkpoints   3 (3 modes)" in out and "  seeds         unknown" in out
    assert describe(tmp_path / "authors.h5").metadata["seeds"] is None


def test_members_numbered_within_their_archive_take_the_range_of_its_name(tmp_path):
    archive = release(tmp_path / "mnist-optunet-1024-1026.tgz",
                      {f"mnist-optunet/model_{i}.safetensors": i for i in range(3)})
    import_checkpoints(tmp_path / "authors.h5", [archive], key_map=KEYS)
    assert [mode for mode, _ in modes_of(tmp_path / "authors.h5")] == [1024, 1025, 1026]


def test_what_the_names_do_not_tell_stays_unknown(tmp_path, capsys):
    unnumbered = release(tmp_path / "mnist-optunet-0-1.tgz",
                         {"mnist-optunet/first.safetensors": 0,
                          "mnist-optunet/second.safetensors": 1})
    import_checkpoints(tmp_path / "a.h5", [unnumbered], key_map=KEYS)
    assert modes_of(tmp_path / "a.h5") == [(-1, -1), (-1, -1)]
    code, out, _ = run(capsys, "info", tmp_path / "a.h5")
    assert "  checkpoints   2 (modes unknown)" in out and "  seeds         unknown" in out
    assert "None" not in out and "(0 modes)" not in out
    info = json.loads(run(capsys, "info", tmp_path / "a.h5", "--json")[1])
    assert info["metadata"]["modes"] is None and info["metadata"]["seeds"] is None
    # a method's samples are not modes: numbered members of a SWAG import stay unknown
    numbered = release(tmp_path / "mnist-optunet-0-1-swag.tgz",
                       {f"m/model_{i}.safetensors": i for i in range(2)})
    import_checkpoints(tmp_path / "swag.h5", [numbered], key_map=KEYS, method="swag",
                       architecture="optunet", dataset="mnist")
    assert modes_of(tmp_path / "swag.h5") == [(-1, -1), (-1, -1)]


def test_numbers_that_repeat_a_mode_of_the_collection_are_not_recorded(tmp_path):
    first = release(tmp_path / "mnist-optunet-0-1.tgz",
                    {f"mnist-optunet/model_{i}.safetensors": i for i in range(2)})
    again = release(tmp_path / "mnist-optunet-0-1-other.tgz",
                    {f"mnist-optunet/model_{i}.safetensors": 10 + i for i in range(2)})
    path = tmp_path / "authors.h5"
    import_checkpoints(path, [first], key_map=KEYS)
    import_checkpoints(path, [again], key_map=KEYS)
    assert modes_of(path) == [(0, 0), (1, 0), (-1, -1), (-1, -1)]
    assert member_modes("x.tgz", ["a_1.safetensors", "b_1.safetensors"]) == {}


def test_members_out_of_numeric_order_land_in_mode_order(tmp_path):
    archive = release(tmp_path / "mnist-optunet-0-2.tgz",
                      {f"mnist-optunet/model_{i}.safetensors": i for i in (2, 0, 1)})
    path = tmp_path / "authors.h5"
    import_checkpoints(path, [archive], key_map=KEYS, dtype=torch.float32)
    assert [mode for mode, _ in modes_of(path)] == [0, 1, 2]
    assert verify(path).rows_out_of_order == 0
    assert reorder_collection(path, in_place=True).written is False
    with open_zoo(path) as zoo:
        for mode in range(3):
            expected = checkpoint(mode)["fc.weight"].half().float().numpy()
            assert np.array_equal(zoo.arrays(mode)["fc.weight"], expected)
