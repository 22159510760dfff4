"""Crafted and corrupted collections for the fuzz suite (tests/test_fuzz_collections.py).

Each case is a function ``craft(path, workdir)`` that damages the collection at ``path``
in one way. The cases fall into the classes the reliability issue names:

- ``attribute``: a file attribute deleted or replaced by a value of a bad type;
- ``structure``: members removed, replaced, reshaped, retyped; counts out of range;
- ``content``: weights or metadata changed with the stored digests left as they were,
  or NaN weights without the diverged flag, or a wrong shape behind valid digests;
- ``hostile``: links, external storage, virtual datasets, compression;
- ``foreign dtype``: valid digests over numbers a collection does not hold: a state
  tensor big-endian, boolean, integer where the model has floats, complex; a
  ``num_classes`` no network can have; and, refused only where they matter
  (:data:`PARTLY_REFUSED`), a float16 tensor, a wrong shape or integer weights under
  ``validated=False``, a metadata string that is not UTF-8;
- ``bitflip``: one bit flipped at a byte offset.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

from posteriorzoo.zoo.schema import METADATA_DTYPE, checkpoint_digest, row_digest

#: Bytes that must never appear in any output: the content of a file that a hostile
#: collection names as external storage.
SECRET = b"SECRET-" + hashlib.sha256(b"posteriorzoo").hexdigest().encode()[:40]

Craft = Callable[[Path, Path], None]
ATTRIBUTES = ("format", "schema_version", "architecture", "dataset", "method", "num_classes",
              "model_options", "recipe", "state_keys", "created_by", "annotations",
              "validated")
BAD_VALUES: dict[str, object] = {
    "deleted": None, "int": 7, "nan": float("nan"), "non-utf8": np.bytes_(b"\xff\xfe"),
    "array": np.arange(3), "bad-json": "{not json", "json-list": "[]",
    "json-string": '"x"', "empty": "",
}


def _reseal(handle: h5py.File, indices: list[int] | None = None) -> None:
    """Recompute stored digests after a change, so only the check under test can fire."""
    keys = json.loads(handle.attrs["state_keys"])
    committed = int(handle["committed"][0])
    rows = handle["metadata"][:committed]
    for index in indices if indices is not None else range(committed):
        arrays = {key: handle["state"][key][index] for key in keys}
        rows[index]["sha256"] = checkpoint_digest(arrays, keys).encode()
    handle["metadata"][:committed] = rows
    handle["metadata_sha256"][:committed] = np.array(
        [row_digest(row).encode() for row in rows], dtype="S64")


def attribute_case(name: str, variant: str) -> Craft:
    def craft(path: Path, workdir: Path) -> None:
        with h5py.File(path, "r+", locking=False) as handle:
            if BAD_VALUES[variant] is None:
                if name in handle.attrs:
                    del handle.attrs[name]
            else:
                handle.attrs[name] = BAD_VALUES[variant]
    return craft


def _replace_dataset(handle: h5py.File, name: str, **kwargs) -> None:
    del handle[name]
    handle.create_dataset(name, **kwargs)


def _committed(value: object, dtype: str = "<i8") -> Craft:
    def craft(path: Path, workdir: Path) -> None:
        with h5py.File(path, "r+", locking=False) as handle:
            _replace_dataset(handle, "committed", data=np.array([value], dtype=dtype))
    return craft


def _committed_string(path: Path, workdir: Path) -> None:
    with h5py.File(path, "r+", locking=False) as handle:
        _replace_dataset(handle, "committed", data=np.array([b"3"]))


def _committed_2d(path: Path, workdir: Path) -> None:
    with h5py.File(path, "r+", locking=False) as handle:
        _replace_dataset(handle, "committed", data=np.array([[3, 3]], dtype="<i8"))


def _delete(member: str) -> Craft:
    def craft(path: Path, workdir: Path) -> None:
        with h5py.File(path, "r+", locking=False) as handle:
            del handle[member]
    return craft


def _group_instead(member: str) -> Craft:
    def craft(path: Path, workdir: Path) -> None:
        with h5py.File(path, "r+", locking=False) as handle:
            del handle[member]
            handle.create_group(member)
    return craft


def _metadata_dropped_column(path: Path, workdir: Path) -> None:
    with h5py.File(path, "r+", locking=False) as handle:
        rows = handle["metadata"][()]
        names = [n for n in METADATA_DTYPE.names if n != "data_seed"]
        dtype = np.dtype([(n, METADATA_DTYPE[n]) for n in names])
        narrow = np.zeros(rows.shape, dtype)
        for n in names:
            narrow[n] = rows[n]
        _replace_dataset(handle, "metadata", data=narrow, maxshape=(None,))


def _metadata_2d(path: Path, workdir: Path) -> None:
    with h5py.File(path, "r+", locking=False) as handle:
        rows = handle["metadata"][()]
        _replace_dataset(handle, "metadata", data=rows.reshape(-1, 1))


def _short_dataset(path: Path, workdir: Path) -> None:
    with h5py.File(path, "r+", locking=False) as handle:
        data = handle["state/fc.bias"][:2]
        _replace_dataset(handle, "state/fc.bias", data=data, maxshape=(None, 10))


def _extra_member(path: Path, workdir: Path) -> None:
    with h5py.File(path, "r+", locking=False) as handle:
        handle.create_dataset("extra", data=np.zeros(3))


def _extra_state(path: Path, workdir: Path) -> None:
    with h5py.File(path, "r+", locking=False) as handle:
        handle.create_dataset("state/extra.weight", data=np.zeros((6, 2), "f4"))


def _wrong_shape(path: Path, workdir: Path) -> None:
    """fc.bias of 7 entries, with every digest recomputed so only the shape check fires."""
    with h5py.File(path, "r+", locking=False) as handle:
        data = handle["state/fc.bias"][:, :7]
        _replace_dataset(handle, "state/fc.bias", data=data, maxshape=(None, 7),
                         chunks=(6, 7))
        _reseal(handle)


def _nan_unflagged(path: Path, workdir: Path) -> None:
    """NaN weights in checkpoint 1, not flagged diverged, digests recomputed."""
    with h5py.File(path, "r+", locking=False) as handle:
        handle["state/fc.weight"][1, 0, 0] = np.nan
        _reseal(handle, [1])


def _changed_weight(path: Path, workdir: Path) -> None:
    with h5py.File(path, "r+", locking=False) as handle:
        handle["state/conv1.weight"][2, 0, 0, 0, 0] += 1e-3


def _changed_metadata(column: str, value: object) -> Craft:
    def craft(path: Path, workdir: Path) -> None:
        with h5py.File(path, "r+", locking=False) as handle:
            rows = handle["metadata"][()]
            rows[2][column] = value
            handle["metadata"][()] = rows
    return craft


def _changed_row_digest(path: Path, workdir: Path) -> None:
    with h5py.File(path, "r+", locking=False) as handle:
        handle["metadata_sha256"][0] = b"0" * 64


def _soft_link(path: Path, workdir: Path) -> None:
    with h5py.File(path, "r+", locking=False) as handle:
        del handle["state/fc.bias"]
        handle.create_dataset("state/copy", data=np.zeros((6, 10), "f4"))
        handle["state/fc.bias"] = h5py.SoftLink("/state/copy")


def _external_link(path: Path, workdir: Path) -> None:
    other = workdir / "other.h5"
    with h5py.File(other, "w") as handle:
        handle.create_dataset("bias", data=np.zeros((6, 10), "f4"))
    with h5py.File(path, "r+", locking=False) as handle:
        del handle["state/fc.bias"]
        handle["state/fc.bias"] = h5py.ExternalLink(str(other), "/bias")


def _external_storage(path: Path, workdir: Path) -> None:
    """fc.bias's bytes live in another file, named inside the HDF5 file."""
    secret = workdir / "secret.bin"
    secret.write_bytes(SECRET * 8)
    with h5py.File(path, "r+", locking=False) as handle:
        del handle["state/fc.bias"]
        handle.create_dataset("state/fc.bias", shape=(6, 10), dtype="f4",
                              external=[(str(secret), 0, h5py.h5f.UNLIMITED)])


def _virtual(path: Path, workdir: Path) -> None:
    other = workdir / "source.h5"
    with h5py.File(path, "r", locking=False) as handle:
        data = handle["state/fc.bias"][()]
    with h5py.File(other, "w") as handle:
        handle.create_dataset("bias", data=data)
    layout = h5py.VirtualLayout(shape=data.shape, dtype=data.dtype)
    layout[...] = h5py.VirtualSource(str(other), "bias", shape=data.shape)
    with h5py.File(path, "r+", locking=False) as handle:
        del handle["state/fc.bias"]
        handle.create_virtual_dataset("state/fc.bias", layout)


def _compressed(path: Path, workdir: Path) -> None:
    with h5py.File(path, "r+", locking=False) as handle:
        data = handle["state/fc.weight"][()]
        _replace_dataset(handle, "state/fc.weight", data=data, maxshape=(None, 10, 10),
                         compression="gzip", chunks=(6, 10, 10))


def _undeclared_rows(path: Path, workdir: Path) -> None:
    """Rows declared far beyond what the file holds (a tiny file claiming GBs)."""
    with h5py.File(path, "r+", locking=False) as handle:
        for key in json.loads(handle.attrs["state_keys"]):
            handle["state"][key].resize(10**7, axis=0)
        handle["metadata"].resize(10**7, axis=0)
        handle["metadata_sha256"].resize(10**7, axis=0)
        handle["committed"][0] = 10**7


def _records_wrong_dtype(path: Path, workdir: Path) -> None:
    """A training-record table whose records are narrower than the format's."""
    narrow = np.dtype([("mode_id", "<i8"), ("record", "S100"), ("sha256", "S64")])
    with h5py.File(path, "r+", locking=False) as handle:
        _replace_dataset(handle, "mode_records", shape=(0,), maxshape=(None,), chunks=(1,),
                         dtype=narrow)


def _records_undeclared_rows(path: Path, workdir: Path) -> None:
    """More training records declared than the file has checkpoint rows."""
    with h5py.File(path, "r+", locking=False) as handle:
        handle["mode_records"].resize(10**7, axis=0)


def _retyped(key: str, dtype: str, *, validated: bool = True, reseal: bool = True
             ) -> Craft:
    """``/state/<key>`` rewritten as ``dtype`` (same values as far as it holds them,
    chunked and resizable as the store writes it), digests recomputed unless not
    ``reseal``; with ``validated=False``, the file says it was never checked against its
    architecture."""
    def craft(path: Path, workdir: Path) -> None:
        with h5py.File(path, "r+", locking=False) as handle:
            old = handle[f"state/{key}"]
            data, chunks = old[()], old.chunks
            _replace_dataset(handle, f"state/{key}", data=data.astype(dtype),
                             maxshape=(None, *data.shape[1:]), chunks=chunks)
            if not validated:
                handle.attrs["validated"] = False
            if reseal:
                _reseal(handle)
    return craft


def _unvalidated_wrong_shape(path: Path, workdir: Path) -> None:
    """fc.weight of 7 rows instead of 10 in a file marked ``validated=False`` (so it is not
    checked against its architecture when it opens), digests recomputed."""
    with h5py.File(path, "r+", locking=False) as handle:
        data = handle["state/fc.weight"][:, :7]
        _replace_dataset(handle, "state/fc.weight", data=data,
                         maxshape=(None, *data.shape[1:]), chunks=(6, *data.shape[1:]))
        handle.attrs["validated"] = False
        _reseal(handle)


def _num_classes(value: int) -> Craft:
    def craft(path: Path, workdir: Path) -> None:
        with h5py.File(path, "r+", locking=False) as handle:
            handle.attrs["num_classes"] = np.int64(value)
    return craft


def _non_utf8_metadata(path: Path, workdir: Path) -> None:
    """Checkpoint 0's ``source`` column holds bytes that are not UTF-8, digests recomputed
    (the API stores a ``bytes`` value as it is given)."""
    with h5py.File(path, "r+", locking=False) as handle:
        rows = handle["metadata"][()]
        rows[0]["source"] = b"\xff\xfe"
        handle["metadata"][()] = rows
        _reseal(handle)


#: The commands that build the network of the collection they read.
NETWORK_COMMANDS = frozenset({"canonicalize", "min-mass", "mmd-target", "mmd-method"})
#: Foreign-dtype cases that not every command must refuse: case -> the commands that
#: must. A float16 tensor is a collection as the release stores it; a file marked
#: ``validated=False`` may hold a network other than the registered one (info and verify
#: say whether it fits), which only the commands that build the network refuse; text
#: that is not UTF-8 cannot be written into an export's header. What these commands
#: accept is the crafted file, not the pristine one, so an export is not compared with
#: the pristine checkpoint.
PARTLY_REFUSED: dict[str, frozenset[str]] = {
    "float16-tensor": frozenset(),
    "unvalidated-wrong-shape": NETWORK_COMMANDS,
    "unvalidated-int-weights": NETWORK_COMMANDS,
    "non-utf8-metadata": frozenset({"export", "export-all"}),
}


def foreign_dtype_cases() -> dict[str, Craft]:
    """The ``foreign dtype`` class: ``{name: craft}``."""
    return {
        "big-endian-float": _retyped("fc.weight", ">f4", reseal=False),
        "big-endian-int": _retyped("fc.bias", ">i4"),
        "float16-tensor": _retyped("fc.bias", "<f2"),
        "bool-tensor": _retyped("fc.bias", "?"),
        "int32-weights": _retyped("fc.bias", "<i4"),
        "int64-weights": _retyped("conv1.weight", "<i8"),
        "uint8-weights": _retyped("conv2.weight", "u1"),
        "complex-tensor": _retyped("fc.bias", "<c8"),
        "num-classes-huge": _num_classes(2**62),
        "num-classes-zero": _num_classes(0),
        "unvalidated-wrong-shape": _unvalidated_wrong_shape,
        "unvalidated-int-weights": _retyped("fc.bias", "<i4", validated=False),
        "non-utf8-metadata": _non_utf8_metadata,
    }


def named_cases() -> dict[str, tuple[str, Craft]]:
    """Every deterministic case: ``{name: (class, craft)}``."""
    cases: dict[str, tuple[str, Craft]] = {}
    for name in ATTRIBUTES:
        for variant in BAD_VALUES:
            cases[f"attr-{name}-{variant}"] = ("attribute", attribute_case(name, variant))
    structure = {
        "committed-negative": _committed(-1), "committed-huge": _committed(10**6),
        "committed-float": _committed(2.5, "<f8"), "committed-string": _committed_string,
        "committed-2d": _committed_2d, "committed-deleted": _delete("committed"),
        "metadata-dropped-column": _metadata_dropped_column, "metadata-2d": _metadata_2d,
        "metadata-deleted": _delete("metadata"), "metadata-group": _group_instead("metadata"),
        "row-digests-deleted": _delete("metadata_sha256"),
        "state-deleted": _delete("state"), "state-entry-group": _group_instead("state/fc.bias"),
        "state-entry-deleted": _delete("state/fc.bias"), "short-dataset": _short_dataset,
        "extra-member": _extra_member, "extra-state": _extra_state,
        "wrong-shape": _wrong_shape, "undeclared-rows": _undeclared_rows,
        "records-deleted": _delete("mode_records"), "records-wrong-dtype": _records_wrong_dtype,
        "records-undeclared-rows": _records_undeclared_rows,
    }
    content = {
        "nan-unflagged": _nan_unflagged, "changed-weight": _changed_weight,
        "changed-accuracy": _changed_metadata("test_accuracy", 0.123),
        "changed-data-seed": _changed_metadata("data_seed", 99),
        "changed-diverged": _changed_metadata("diverged", True),
        "changed-row-digest": _changed_row_digest,
    }
    hostile = {
        "soft-link": _soft_link, "external-link": _external_link,
        "external-storage": _external_storage, "virtual-dataset": _virtual,
        "compressed": _compressed,
    }
    for kind, group in (("structure", structure), ("content", content), ("hostile", hostile),
                        ("foreign dtype", foreign_dtype_cases())):
        for name, craft in group.items():
            cases[name] = (kind, craft)
    return cases


def bitflip(offset: int, bit: int = 0) -> Craft:
    def craft(path: Path, workdir: Path) -> None:
        with open(path, "r+b") as raw:
            raw.seek(offset)
            byte = raw.read(1)
            raw.seek(offset)
            raw.write(bytes([byte[0] ^ (1 << bit)]))
    return craft


def content_of(path: Path) -> object:
    """Everything a collection means, read with plain h5py; None if unreadable.

    Attributes, and every dataset up to the committed count (rows past it are leftovers
    that no reader sees).
    """
    try:
        with h5py.File(path, "r", locking=False) as handle:
            committed = int(handle["committed"][0])
            if not 0 <= committed <= path.stat().st_size:  # at least a byte a checkpoint
                return None
            attrs = {name: repr(handle.attrs[name]) for name in sorted(handle.attrs)}
            data = {}

            def visit(name: str, item: object) -> None:
                if isinstance(item, h5py.Dataset):
                    value = item[()] if name == "committed" else item[:committed]
                    data[name] = (str(item.dtype), value.tobytes())
                for attribute in item.attrs:
                    attrs[f"{name}@{attribute}"] = repr(item.attrs[attribute])

            handle.visititems(visit)
            return attrs, data
    except Exception:  # noqa: BLE001 - any failure to read means "unreadable"
        return None
