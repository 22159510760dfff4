"""Import in one streaming pass: each archive read once into a new collection, rows in
mode order whatever the tar order, a second read only where the names could not tell the
rows while streaming (and for an existing collection, checked in full before it is
written to), and an existing collection unchanged by an import that fails."""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save as save_safetensors_bytes
from zoo_helpers import checkpoint

import posteriorzoo.zoo.import_checks as import_checks
from posteriorzoo.collection import import_checkpoints, verify
from posteriorzoo.errors import NonFiniteWeightsError
from posteriorzoo.hashing import sha256_file
from posteriorzoo.zoo import create_zoo, open_zoo
from posteriorzoo.zoo.archives import member_mode_guess, member_modes

pytestmark = pytest.mark.filterwarnings("ignore:.*record no SHA-256")


def release(path: Path, members: list[tuple[str, int]], bad: str | None = None) -> Path:
    """A release-format .tgz of ``(member name, seed)`` in the order given: float16
    tensors with the authors' ``model.`` prefix; member ``bad`` holds a NaN."""
    with tarfile.open(path, "w:gz") as archive:
        for name, seed in members:
            state = {key: value.half() for key, value in checkpoint(seed).items()}
            if name == bad:
                state["fc.weight"][0, 0] = float("nan")
            data = save_safetensors_bytes({f"model.{k}": v.contiguous()
                                           for k, v in state.items()})
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def shuffled(numbers: list[int], seed: int = 0) -> list[int]:
    numbers = list(numbers)
    random.Random(seed).shuffle(numbers)
    return numbers


@pytest.fixture
def reads(monkeypatch) -> list[Path]:
    """The archives read, one entry per read."""
    seen: list[Path] = []
    original = import_checks.read_archive

    def counting(path, *args, **kwargs):
        seen.append(path)
        yield from original(path, *args, **kwargs)

    monkeypatch.setattr(import_checks, "read_archive", counting)
    return seen


def rows(path: Path) -> list[tuple[int, np.ndarray]]:
    """``(mode_id, fc.weight)`` of every row."""
    with open_zoo(path, verify=True) as zoo:
        return [(int(mode), zoo.arrays(i)["fc.weight"])
                for i, mode in enumerate(zoo.metadata["mode_id"])]


def assert_seeds(path: Path, seeds: list[int]) -> None:
    """Row i holds the checkpoint of ``seeds[i]`` (as float16)."""
    stored = rows(path)
    assert len(stored) == len(seeds)
    for (_, weight), seed in zip(stored, seeds, strict=True):
        assert np.array_equal(weight, checkpoint(seed)["fc.weight"].half().numpy())


def test_a_shuffled_archive_lands_in_mode_order_in_one_read(tmp_path, reads):
    order = shuffled(range(12))
    archive = release(tmp_path / "mnist-optunet-0-11.tgz",
                      [(f"mnist-optunet/model_{i}.safetensors", i) for i in order])
    result = import_checkpoints(tmp_path / "z.h5", [archive])
    assert reads == [archive]
    assert [mode for mode, _ in rows(tmp_path / "z.h5")] == list(range(12))
    assert_seeds(tmp_path / "z.h5", list(range(12)))
    assert result.sources == [f"{archive.name}:mnist-optunet/model_{i}.safetensors"
                              for i in range(12)]
    # the provenance's digest of the archive comes from that one read, and is right
    assert result.provenance["inputs"]["input 0"]["sha256"] == sha256_file(archive)
    report = verify(tmp_path / "z.h5")
    assert report.ok and report.rows_out_of_order == 0


def test_two_archives_given_in_reverse_land_in_mode_order(tmp_path, reads):
    second = release(tmp_path / "mnist-optunet-4-7.tgz",
                     [(f"m/model_{i}.safetensors", 4 + i) for i in shuffled(range(4), 1)])
    first = release(tmp_path / "mnist-optunet-0-3.tgz",
                    [(f"m/model_{i}.safetensors", i) for i in shuffled(range(4), 2)])
    import_checkpoints(tmp_path / "z.h5", [second, first])
    assert reads == [second, first]
    assert [mode for mode, _ in rows(tmp_path / "z.h5")] == list(range(8))
    assert_seeds(tmp_path / "z.h5", list(range(8)))


def test_a_numbering_the_names_tell_only_at_the_end_is_read_twice(tmp_path, reads):
    # range 10-59, members counted from 0: number 20 reads as mode 20 (in the range)
    # until member 3 shows the count starts at 0, making it mode 30
    numbers = [20, 3, 7, 15]
    archive = release(tmp_path / "mnist-optunet-10-59.tgz",
                      [(f"m/model_{n}.safetensors", n) for n in numbers])
    assert member_mode_guess(archive.name, "m/model_20.safetensors") == 20
    assert member_modes(archive.name, [f"m/model_{n}.safetensors" for n in numbers]) == {
        f"m/model_{n}.safetensors": 10 + n for n in numbers}
    import_checkpoints(tmp_path / "z.h5", [archive])
    assert reads == [archive, archive]
    assert [mode for mode, _ in rows(tmp_path / "z.h5")] == [13, 17, 25, 30]
    assert_seeds(tmp_path / "z.h5", [3, 7, 15, 20])


def test_a_repeated_member_leaves_no_hole(tmp_path, reads):
    # member 1 repeats member 0's tensors: skipped, so modes 2 and 3 move up a row
    archive = release(tmp_path / "mnist-optunet-0-3.tgz",
                      [("m/model_3.safetensors", 3), ("m/model_1.safetensors", 0),
                       ("m/model_0.safetensors", 0), ("m/model_2.safetensors", 2)])
    result = import_checkpoints(tmp_path / "z.h5", [archive])
    assert result.skipped_repeated == 1 and result.indices == range(3)
    assert [mode for mode, _ in rows(tmp_path / "z.h5")] == [1, 2, 3]
    assert_seeds(tmp_path / "z.h5", [0, 2, 3])
    assert verify(tmp_path / "z.h5").ok


def test_unnumbered_members_keep_their_order_in_one_read(tmp_path, reads):
    archive = release(tmp_path / "mnist-optunet-0-2.tgz",
                      [("m/c.safetensors", 2), ("m/a.safetensors", 0), ("m/b.safetensors", 1)])
    import_checkpoints(tmp_path / "z.h5", [archive])
    assert reads == [archive]
    assert [mode for mode, _ in rows(tmp_path / "z.h5")] == [-1, -1, -1]
    assert_seeds(tmp_path / "z.h5", [2, 0, 1])


def existing(path: Path, count: int) -> Path:
    with create_zoo(path, architecture="optunet", dataset="mnist", method="de",
                    num_classes=10, template={k: v.half() for k, v in checkpoint(0).items()}
                    ) as zoo:
        zoo.append_many([{k: v.half() for k, v in checkpoint(s).items()}
                         for s in range(count)],
                        [{"mode_id": s, "sample_id": 0} for s in range(count)])
    return path


def test_into_an_existing_collection_in_mode_order(tmp_path, reads):
    path = existing(tmp_path / "z.h5", 2)
    archive = release(tmp_path / "mnist-optunet-2-6.tgz",
                      [(f"m/model_{n}.safetensors", n) for n in shuffled(range(2, 7), 3)])
    result = import_checkpoints(path, [archive], checkpoints_per_batch=2)
    # checked in full before the collection is written to, then read again to write
    assert reads == [archive, archive] and result.indices == range(2, 7)
    assert [mode for mode, _ in rows(path)] == list(range(7))
    assert_seeds(path, list(range(7)))
    assert sorted(p.name for p in tmp_path.iterdir()) == [archive.name, "z.h5"]
    # run again: everything is stored already
    again = import_checkpoints(path, [archive])
    assert again.indices == range(7, 7) and again.skipped_existing == 5


def test_a_bad_last_member_changes_nothing(tmp_path):
    path = existing(tmp_path / "z.h5", 2)
    before = path.read_bytes()
    names = [f"m/model_{i}.safetensors" for i in range(2, 7)]
    archive = release(tmp_path / "mnist-optunet-2-6.tgz",
                      [(name, 2 + i) for i, name in enumerate(names)], bad=names[-1])
    with pytest.raises(NonFiniteWeightsError, match="model_6"):
        import_checkpoints(path, [archive])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [archive.name, "z.h5"]
    with pytest.raises(NonFiniteWeightsError):
        import_checkpoints(tmp_path / "new.h5", [archive])
    assert not (tmp_path / "new.h5").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [archive.name, "z.h5"]


def test_float32_import_of_float16_members_keeps_the_values(tmp_path):
    archive = release(tmp_path / "mnist-optunet-0-1.tgz",
                      [("m/model_1.safetensors", 1), ("m/model_0.safetensors", 0)])
    import_checkpoints(tmp_path / "z.h5", [archive], dtype=torch.float32)
    with open_zoo(tmp_path / "z.h5") as zoo:
        for mode in (0, 1):
            expected = checkpoint(mode)["fc.weight"].half().float().numpy()
            assert np.array_equal(zoo.arrays(mode)["fc.weight"], expected)
