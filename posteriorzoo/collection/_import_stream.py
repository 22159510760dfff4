"""One streaming pass of an import: every input read once, each new checkpoint written
straight to its row in mode order.

:func:`~posteriorzoo.collection.import_checkpoints` sets up what it knows before reading
(the collection, its digests and modes, the read limits) and hands the inputs to
:class:`ImportStream`, which

1. reads every checkpoint once (:func:`~posteriorzoo.zoo.import_checks.read_inputs`,
   decoded a checkpoint or two ahead by a thread of its own), checks it (keys, shapes,
   dtypes, finite values, metadata row; the digest its header records) and skips one
   already stored or repeated;
2. for a new collection, writes each new checkpoint, uncommitted, at the row it is
   expected to take (:meth:`~posteriorzoo.zoo.Zoo.write_uncommitted`): the mode its
   archive member's name numbers (:func:`~posteriorzoo.zoo.archives.member_mode_guess`),
   counted from the archives' first mode, or else the order of arrival;
3. at the end, knowing every name, takes the modes the names give
   (:func:`~posteriorzoo.zoo.archives.member_modes`) and the final order (rows of known
   mode by ``(mode_id, sample_id)``, then the others in the order they came), and checks
   each checkpoint was written where that order puts it, with no hole and no repeat.
   Where one was not (inputs holding their modes out of order, a numbering the last
   member settles), and always for an existing collection (which is not written to
   before every input is checked), the inputs are read again and each checkpoint
   written at its row, now known;
4. commits the rows in batches. A new collection is published by the caller.

Memory holds a few checkpoints (the one checked, those decoded ahead) and a metadata row
per checkpoint.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posteriorzoo._pipeline import read_ahead
from posteriorzoo.dtypes import as_numpy, torch_dtype
from posteriorzoo.errors import ChecksumError, PosteriorZooError, ZooFormatError, ZooSchemaError
from posteriorzoo.zoo.architecture import check_architecture
from posteriorzoo.zoo.archives import member_mode_guess, member_modes, numbering_start
from posteriorzoo.zoo.formats import ReadLimits
from posteriorzoo.zoo.import_checks import (
    check_against_layout,
    check_recorded_digest,
    collection_attributes,
    convert_floats,
    expected_keys,
    in_model_order,
    limits_for_new_collection,
    read_inputs,
    row_for_input,
)
from posteriorzoo.zoo.keymap import KeyMap, closest_reading, implied_reading, restore_integers
from posteriorzoo.zoo.layout import MAX_APPEND_ROWS
from posteriorzoo.zoo.lifecycle import create_zoo, normalise_template
from posteriorzoo.zoo.schema import METADATA_DTYPE
from posteriorzoo.zoo.store import Zoo

TensorLayout = dict[str, tuple[tuple[int, ...], np.dtype]]


@dataclass
class Entry:
    """One new checkpoint of the import."""

    arrival: int            # its position among every checkpoint the inputs hold
    name: str               # file, or ``archive:member``
    archive: str | None     # ``archive:`` of a member
    row: np.void            # its metadata row (Zoo.prepare), digest included
    header_mode: bool       # its header's metadata row gives its mode
    placed: int | None      # the row past the committed ones it was written to

    @property
    def digest(self) -> str:
        return bytes(self.row["sha256"]).decode()


class _Placer:
    """Where each new checkpoint goes as it arrives: at its guessed mode minus the
    archives' first mode (``numbered``), or in order of arrival. The first checkpoint
    that does not fit (no guess, a row taken twice) stops the placing: the rows are then
    written in a second pass."""

    def __init__(self, numbered: bool, base: int) -> None:
        self.numbered, self.base = numbered, base
        self.used: set[int] = set()
        self.misplaced = False

    def place(self, guess: int | None) -> int | None:
        if self.misplaced:
            return None
        slot = len(self.used) if not self.numbered else (
            None if guess is None else guess - self.base)
        if slot is None or not 0 <= slot < MAX_APPEND_ROWS or slot in self.used:
            self.misplaced = True
            return None
        self.used.add(slot)
        return slot


def final_order(entries: list[Entry]) -> list[int]:
    """Positions in ``entries`` (in arrival order) in the order of their rows: known
    modes by ``(mode_id, sample_id)`` (arrival breaks ties), then unknown modes as they
    came; :func:`posteriorzoo.zoo.row_order` calls that in order."""
    known = [i for i, entry in enumerate(entries) if int(entry.row["mode_id"]) >= 0]
    known.sort(key=lambda i: (int(entries[i].row["mode_id"]),
                              int(entries[i].row["sample_id"]), i))
    return known + [i for i, entry in enumerate(entries) if int(entry.row["mode_id"]) < 0]


class ImportStream:
    """The reading, checking, placing and committing of one import (see the module)."""

    def __init__(self, zoo_path: Path, files: list[Path], given: Mapping[str, Any], *,
                 writer: Zoo | None, attributes: dict[str, Any],
                 tensor_layout: TensorLayout | None, stored: set[str], taken_modes: set[int],
                 limits: ReadLimits, key_map: KeyMap | None, dtype: torch.dtype | None,
                 archives: list[str], verify: bool, command: str | None,
                 progress: bool) -> None:
        self.zoo_path, self.files, self.given = zoo_path, files, dict(given)
        self.writer, self.attributes = writer, attributes
        self.tensor_layout, self.stored, self.taken_modes = tensor_layout, stored, taken_modes
        self.wrapped = key_map is None  # a wrapper's prefix is looked for on the first input
        self.key_map = key_map or KeyMap()
        self.dtype, self.verify, self.command, self.progress = dtype, verify, command, progress
        self.archives = archives
        self.bounds = limits
        self.base = min((numbering_start(prefix[:-1]) for prefix in archives), default=0)
        self.template: dict[str, torch.Tensor] | None = None
        self.target: Zoo | None = writer  # where the rows are written
        self.placer: _Placer | None = None
        self.entries: list[Entry] = []
        self.members: dict[str, list[str]] = {prefix: [] for prefix in archives}
        self.unchecked: list[str] = []
        self.skipped_existing = self.skipped_repeated = 0
        self.sources: list[str] = []
        #: The SHA-256 of each archive, taken from its one read (for the provenance).
        self.file_digests: dict[Path, str] = {}
        #: The model's integer tensors, which an input may bring as floats.
        self.integers: dict[str, torch.dtype] = {}

    # ------------------------------------------------------------------ reading
    def _review(self, name: str, header: Mapping[str, str], limits: ReadLimits
                ) -> ReadLimits:
        """Before the first input's tensors are read: bound them by its architecture."""
        if self.tensor_layout is not None:
            return limits  # already bounded by the known layout
        try:
            return limits_for_new_collection(limits, self.files[0], header, self.given)
        except PosteriorZooError as error:
            raise type(error)(f"{name}: {error}") from None

    def _inputs(self) -> Iterator[tuple[str, dict[str, torch.Tensor], dict[str, str]]]:
        """Every checkpoint of the inputs, decompressed and decoded by a thread of its own
        one or two checkpoints ahead (zlib and the file reads release the GIL)."""
        return read_ahead(read_inputs(self.files, lambda: self.bounds, self._review,
                                      self.file_digests), depth=2)

    def _first(self, name: str, state: dict[str, torch.Tensor],
               header: Mapping[str, str]) -> None:
        """What the first checkpoint tells: the new collection's attributes and layout,
        and how its keys are read (a wrapper's prefix, a known foreign layout)."""
        if self.tensor_layout is None:
            self.attributes = collection_attributes(self.files[0], header, **self.given)
        # A new collection's model may take options a known layout implies (not given).
        keys_with = None if self.tensor_layout is not None else lambda options: expected_keys(
            {**self.attributes, "model_options": {**options, **self.attributes["model_options"]}})
        if self.wrapped:
            self.wrapped = False
            expected = self.tensor_layout or expected_keys(self.attributes)
            if reading := implied_reading(state, expected, keys_with):
                self.key_map = reading.key_map
                self.attributes["model_options"] = {**reading.options,
                                                    **self.attributes["model_options"]}
        self.integers, mapped = self._integers(), self.key_map.apply(state)
        floated = [key for key in self.integers if key in mapped and
                   mapped[key].is_floating_point()]
        if floated:
            warnings.warn(f"{name}: {len(floated)} integer tensor(s) ({floated[0]!r}...) "
                          "arrive in floating point: stored as the model's integers",
                          stacklevel=2)
        if self.tensor_layout is None:
            self.template = in_model_order(convert_floats(restore_integers(
                mapped, self.integers, name), self.dtype), self.attributes)
            self.tensor_layout = normalise_template(self.template)
            try:
                check_architecture(self.attributes["architecture"], self.tensor_layout,
                                   self.attributes["num_classes"],
                                   self.attributes["model_options"])
            except ZooSchemaError as error:
                # Only a key that is missing or unexpected can be mended by renaming;
                # name the keys as the closest reading (prefix stripped, layout known) has them.
                if " key " not in str(error):
                    raise ZooSchemaError(f"{name}: {error}") from None
                closest = closest_reading(self.template, expected_keys(self.attributes), keys_with)
                detail = f"state_dict does not fit model {self.attributes['architecture']!r} " \
                    f"{closest}" if closest else str(error)
                raise ZooSchemaError(f"{name}: {detail}; a key map can rename keys") from None
            self.bounds = self.bounds.for_shapes(self.tensor_layout)

    def _integers(self) -> dict[str, torch.dtype]:
        """The model's integer tensors (BatchNorm's counters) and their dtypes, which an
        input may bring as floats (:func:`~posteriorzoo.zoo.keymap.restore_integers`)."""
        if self.tensor_layout is not None:
            return {key: torch_dtype(dtype) for key, (_, dtype) in self.tensor_layout.items()
                    if np.dtype(dtype).kind in "iu"}
        from posteriorzoo import models

        try:
            shapes = models.expected_state_shapes(self.attributes["architecture"],
                                                  self.attributes["num_classes"],
                                                  **self.attributes["model_options"])
        except PosteriorZooError:   # the architecture's own check names the problem
            return {}
        return {key: dtype for key, (_, dtype) in shapes.items() if not dtype.is_floating_point}

    def _new_collection(self) -> Zoo:
        """The new collection, under its temporary name until it is published."""
        assert self.template is not None
        attributes = {key: self.attributes[key] for key in
                      ("architecture", "dataset", "method", "num_classes", "model_options")}
        return create_zoo(self.zoo_path, template=self.template, command=self.command,
                          validate=True, publish=False, **attributes)

    def _prepare(self, name: str, state: dict[str, torch.Tensor], header: Mapping[str, str],
                 count_unchecked: bool) -> tuple[np.void, dict[str, list[np.ndarray]], bool]:
        """The checked checkpoint: its metadata row (digest included), its arrays, and
        whether its header gave its mode."""
        assert self.tensor_layout is not None and self.target is not None
        if self.verify and not check_recorded_digest(state, header, name) and count_unchecked:
            self.unchecked.append(name)
        state = convert_floats(restore_integers(self.key_map.apply(state), self.integers, name),
                               self.dtype)
        row = row_for_input(header, name, self.attributes["method"])
        check_against_layout(self.tensor_layout, state, name,
                             diverged=bool(row.get("diverged", False)))
        arrays = {key: as_numpy(state[key]) for key in self.tensor_layout}
        try:
            rows, stacks = self.target.prepare([arrays], [row])
        except PosteriorZooError as error:
            raise type(error)(f"{name}: {error}") from None
        return rows[0], stacks, "mode_id" in row

    def read(self) -> None:
        """Pass 1: read and check every input once, writing each new checkpoint at its
        expected row."""
        from posteriorzoo.progress import progress as progress_bar

        seen = set(self.stored)
        for arrival, (name, state, header) in enumerate(progress_bar(
                self._inputs(), desc="import", unit="ckpt", enabled=self.progress)):
            if arrival == 0:
                self._first(name, state, header)
                if self.writer is None:
                    self.target = self._new_collection()
            row, stacks, header_mode = self._prepare(name, state, header, True)
            archive = next((p for p in self.archives if name.startswith(p)), None)
            if archive is not None:
                self.members[archive].append(name[len(archive):])
            elif int(row["mode_id"]) >= 0:
                self.taken_modes.add(int(row["mode_id"]))
            digest = bytes(row["sha256"]).decode()
            if digest in self.stored:
                self.skipped_existing += 1
                continue
            if digest in seen:
                self.skipped_repeated += 1
                continue
            seen.add(digest)
            guess = None if archive is None or header_mode else \
                member_mode_guess(archive[:-1], name[len(archive):])
            if self.placer is None:
                self.placer = _Placer(self.attributes["method"] == "de" and guess is not None,
                                      self.base)
            slot = self.placer.place(guess) if self.writer is None else None
            if slot is not None:
                assert self.target is not None
                self.target.write_uncommitted(slot, stacks)
            self.entries.append(Entry(arrival, name, archive, row, header_mode, slot))
        if not self.entries and not (self.skipped_existing or self.skipped_repeated):
            raise ZooFormatError("the inputs hold no safetensors checkpoints")
        if self.unchecked:
            others = (f" and {len(self.unchecked) - 1} more" if len(self.unchecked) > 1
                      else "")
            warnings.warn(f"{len(self.unchecked)} input checkpoint(s) record no SHA-256 of "
                          f"their tensors ({self.unchecked[0]}{others}): imported without "
                          "that check", stacklevel=5)

    # ------------------------------------------------------------------ placing
    def order(self) -> list[int]:
        """The modes the names give (a deep ensemble's numbered members), then the final
        order of the entries; rewrites the rows in a second pass where pass 1 did not
        put them there."""
        if self.attributes["method"] == "de":
            for archive, names in self.members.items():
                modes = member_modes(archive[:-1], names, self.taken_modes)
                self.taken_modes.update(modes.values())
                for entry in self.entries:
                    member = entry.name[len(archive):]
                    if entry.archive == archive and not entry.header_mode and member in modes:
                        entry.row["mode_id"], entry.row["sample_id"] = modes[member], 0
        order = final_order(self.entries)
        if any(self.entries[i].placed != slot for slot, i in enumerate(order)):
            self._rewrite(order)
        return order

    def _rewrite(self, order: list[int]) -> None:
        """Pass 2: read the inputs again and write each new checkpoint at its row."""
        from posteriorzoo.progress import progress as progress_bar

        if self.writer is None:  # a new collection: start again, rows placed
            assert self.target is not None
            self.target.discard()
            self.target = None
            self.target = self._new_collection()
        assert self.target is not None
        if self.writer is not None:
            # Refused on a full disk before the collection changes at all (a row written
            # past the committed ones still changes the file's bytes).
            self.target.check_space(len(order))
        slot_of = {self.entries[i].arrival: slot for slot, i in enumerate(order)}
        digest_of = {entry.arrival: entry.digest for entry in self.entries}
        for arrival, (name, state, header) in enumerate(progress_bar(
                self._inputs(), desc="place", unit="ckpt", enabled=self.progress)):
            if arrival not in slot_of:
                continue
            row, stacks, _ = self._prepare(name, state, header, False)
            if bytes(row["sha256"]).decode() != digest_of[arrival]:
                raise ChecksumError(f"{name}: changed while it was imported; nothing was "
                                    "written")
            self.target.write_uncommitted(slot_of[arrival], stacks)
        for slot, i in enumerate(order):
            self.entries[i].placed = slot

    # ------------------------------------------------------------------ committing
    def commit(self, order: list[int], checkpoints_per_batch: int) -> Iterator[range]:
        """Commit the written rows in batches of ``checkpoints_per_batch``, yielding the
        indices each batch added (:attr:`sources` names them, in row order)."""
        assert self.target is not None
        self.sources = [self.entries[i].name for i in order]
        rows = np.array([self.entries[i].row for i in order], dtype=METADATA_DTYPE)
        for start in range(0, len(rows), checkpoints_per_batch):
            yield self.target.commit_uncommitted(rows[start:start + checkpoints_per_batch])

    def close(self, failed: bool) -> None:
        """After a failure, delete a new collection (an existing one keeps its committed
        rows; rows written past them are never read and cut off by its next writer)."""
        target, self.target = self.target, None
        if failed and target is not None and self.writer is None:
            target.discard()
