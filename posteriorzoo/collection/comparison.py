"""Compare method collections with the target collection: MMD and NS-MMD, layer by layer.

:func:`compare` reads each layer of every collection in blocks (the numbers come from the
pure core :mod:`posteriorzoo.mmd.comparison`) and returns a
:class:`~posteriorzoo.collection.comparison_result.CompareResult`.

What may be compared: collections whose weight layouts (state keys and shapes) agree,
whatever their model options (an MC Dropout collection and a Deep Ensemble of the same
network compare). Different datasets or training recipes give a
:class:`CompatibilityWarning` (also recorded in the provenance), not an error.

NS-MMD ("remove") compares canonical forms, made with the canonicalizer's options
(``permutation``, ``scaling``, ``softmax``; recorded). A collection that is already
canonical (its annotations say ``canonicalized_from``) is used as it is, never
canonicalized again; if every input is canonical, only NS-MMD is computed (``"both"``
then means ``"remove"``, and ``"keep"`` is refused: the symmetries are gone). A raw target
with a canonical method, or the reverse, is refused.
"""

# ruff: noqa: N803 -- MMDAgg's names B1, B2, B3

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from posteriorzoo._api import public
from posteriorzoo.collection._open import model_of
from posteriorzoo.collection.comparison_result import CompareResult
from posteriorzoo.errors import InvalidOptionError, ShapeMismatchError, UnknownNameError
from posteriorzoo.hashing import sha256_file
from posteriorzoo.mmd.comparison import (
    Comparison,
    compare_sources,
    describe_options,
    mmdagg_options,
)
from posteriorzoo.mmd.distances import DEFAULT_PRECISION, check_precision
from posteriorzoo.mmd.sources import (
    DEFAULT_BLOCK_BYTES,
    check_sources,
    group_layers,
    select_layers,
)
from posteriorzoo.mmd.statistics import check_number_bandwidths, kernel_names
from posteriorzoo.options import check_bool, check_choice
from posteriorzoo.outputs import check_folder
from posteriorzoo.provenance import record
from posteriorzoo.vocabulary import (
    LAYER_GROUPS,
    PERMUTATION_KEYS,
    SCALINGS,
    SYMMETRIES,
    SYMMETRY_CHOICES,
)
from posteriorzoo.zoo import Zoo, open_zoo

__all__ = ["CompatibilityWarning", "ZooSource", "canonical_copy_names", "compare",
           "display_name", "parameter_keys"]

#: Recipe entries that name or distinguish a collection rather than how it was trained.
_OWN_RECIPE_KEYS = {"name", "base_seed", "method", "samples_per_mode", "method_options",
                    "num_classes", "model_options"}
_EXCLUDED_BUFFERS = ("num_batches_tracked",)


class CompatibilityWarning(UserWarning):
    """Compared collections differ in dataset or training recipe."""


class ZooSource:
    """A collection's samples (all its committed checkpoints), read in blocks.

    Blocks that are part of a chunk are read with the chunk cache off, so only their bytes
    are read even when a chunk holds a whole checkpoint.
    """

    def __init__(self, name: str, zoo: Zoo, sha256: str | None = None,
                 keys: Sequence[str] | None = None) -> None:
        self.name = name
        self.zoo = zoo
        self.label = str(zoo.path)
        self.rows = len(zoo)
        # ``keys``: the tensors this source offers (default every one), e.g. the
        # parameters only (parameter_keys), for a consumer that takes every layer given
        self.shapes = (zoo.shapes if keys is None
                       else {key: zoo.shapes[key] for key in keys})
        # each checkpoint's recorded SHA-256: the distance cache's key of these rows
        self.row_digests = zoo.digests
        self._direct: dict[str, h5py.Dataset] = {}
        self.provenance = {
            "name": name, "path": str(zoo.path), "sha256": sha256, "checkpoints": self.rows,
            "architecture": zoo.architecture, "dataset": zoo.dataset, "method": zoo.method,
            "annotations": zoo.annotations}

    def _uncached(self, key: str) -> h5py.Dataset:
        if key not in self._direct:
            dataset = self.zoo.dataset_handle(key)
            access = h5py.h5p.create(h5py.h5p.DATASET_ACCESS)
            access.set_chunk_cache(0, 0, 1.0)
            identifier = h5py.h5d.open(dataset.file.id, dataset.name.encode(), access)
            self._direct[key] = h5py.Dataset(identifier)
        return self._direct[key]

    def read(self, key: str, index: tuple, rows: slice | None = None) -> np.ndarray:
        """Rows ``rows`` (default all) of the hyperslab ``index`` of ``key``, flattened to
        ``(rows, features)``."""
        whole = all(isinstance(i, slice) and i == slice(None) for i in index)
        dataset = self.zoo.dataset_handle(key) if whole else self._uncached(key)
        block = np.asarray(dataset[(rows or slice(0, self.rows), *index)])
        return block.reshape(len(block), -1)

    def close(self) -> None:
        self._direct.clear()


def parameter_keys(zoo: Zoo, include_buffers: bool = False) -> list[str]:
    """The state keys of a collection that are compared, in state_dict order.

    Parameters are the keys of ``named_parameters()`` of the collection's architecture,
    built with its ``num_classes`` and model options. For an architecture the registry
    does not know, every floating-point key that is not a BatchNorm running statistic
    counts. ``include_buffers`` adds the floating-point buffers (running mean and
    variance); integer buffers such as ``num_batches_tracked`` are never compared.
    """
    floating = [key for key, dtype in zoo.dtypes.items()
                if np.issubdtype(dtype, np.floating) and not key.endswith(_EXCLUDED_BUFFERS)]
    if include_buffers:
        return floating
    try:
        model, _ = model_of(zoo)
        names = {name for name, _ in model.named_parameters()}
    except UnknownNameError:
        names = {key for key in floating if not key.endswith(("running_mean", "running_var"))}
    return [key for key in floating if key in names]


def display_name(path: Path, taken: set[str]) -> str:
    """A unique report name for a collection file (its stem, numbered if repeated)."""
    name = path.stem
    candidate, counter = name, 2
    while candidate in taken:
        candidate = f"{name}-{counter}"
        counter += 1
    taken.add(candidate)
    return candidate


def _named(methods: Sequence[str | os.PathLike] | Mapping[str, str | os.PathLike]
           ) -> list[tuple[str, Path]]:
    if isinstance(methods, Mapping):
        return [(str(name), Path(path)) for name, path in methods.items()]
    taken: set[str] = set()
    return [(display_name(Path(path), taken), Path(path)) for path in methods]


def _check_layouts(inputs: list[tuple[str, Path]], zoos: list[Zoo]) -> list[str]:
    """Refuse differing weight layouts; return the warnings about datasets and recipes."""
    reference, notes = zoos[0], []
    recipe = {k: v for k, v in reference.recipe.items() if k not in _OWN_RECIPE_KEYS}
    for (_, path), zoo in zip(inputs[1:], zoos[1:], strict=True):
        if zoo.shapes != reference.shapes:
            keys = list(reference.shapes) + [k for k in zoo.shapes if k not in reference.shapes]
            first = next(k for k in keys if zoo.shapes.get(k) != reference.shapes.get(k))
            raise ShapeMismatchError(
                f"{path}: its weights are laid out differently from the target's (first "
                f"difference: {first!r} is {zoo.shapes.get(first)} there, "
                f"{reference.shapes.get(first)} in the target)")
        if zoo.dataset != reference.dataset:
            notes.append(f"{path.name} was trained on {zoo.dataset}, the target on "
                         f"{reference.dataset}")
        own = {k: v for k, v in zoo.recipe.items() if k not in _OWN_RECIPE_KEYS}
        if recipe and own and own != recipe:
            differing = sorted(k for k in set(own) | set(recipe) if own.get(k) != recipe.get(k))
            notes.append(f"{path.name} was trained with another recipe than the target "
                         f"(differs in {', '.join(differing)})")
    for note in notes:
        warnings.warn(note, CompatibilityWarning, stacklevel=3)
    return notes


def _canonical_state(inputs: list[tuple[str, Path]], zoos: list[Zoo],
                     options: Mapping[str, Any]) -> bool:
    """Whether the inputs are already canonical (all of them), refusing a mixture."""
    canonical = ["canonicalized_from" in zoo.annotations for zoo in zoos]
    if not any(canonical):
        return False
    if not all(canonical):
        raw = [path.name for (_, path), flag in zip(inputs, canonical, strict=True) if not flag]
        done = [path.name for (_, path), flag in zip(inputs, canonical, strict=True) if flag]
        raise InvalidOptionError(
            f"{', '.join(done)} already canonical but {', '.join(raw)} not: compare raw "
            "collections (NS-MMD canonicalizes them alike), or canonicalize every input "
            "with the same options")
    for (_, path), zoo in zip(inputs, zoos, strict=True):
        used = {key: zoo.annotations.get(key) for key in options}
        if used != dict(options):
            raise InvalidOptionError(
                f"{path.name} was canonicalized with {used}, not the {dict(options)} asked "
                "for: give the same canonicalizer options")
    return True


def canonical_copy_names(names: Sequence[str]) -> list[str]:
    """The file names of the canonical copies of inputs with these (unique) display names:
    ``NAME-canonical.h5``, the name reduced to letters, digits, ``. _ -`` (a name is the
    user's: it may hold ``/`` or a newline) and numbered where two would coincide, also
    on a file system that ignores case. Two inputs with the same file name
    (``a/zoo.h5``, ``b/zoo.h5``) get two copies."""
    taken: set[str] = set()
    files = []
    for name in names:
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:80] or "collection"
        candidate, counter = stem, 2
        while candidate.lower() in taken:
            candidate = f"{stem}-{counter}"
            counter += 1
        taken.add(candidate.lower())
        files.append(f"{candidate}-canonical.h5")
    return files


def _canonical_copy(source: Path, path: Path, options: Mapping[str, Any],
                    command: str | None, progress: bool, verify: bool, device: str) -> Path:
    from posteriorzoo.collection.canonicalization import canonicalize

    canonicalize(source, path, progress=progress, command=command, verify=verify,
                 device=device, **options)
    return path


@public
def compare(target: str | os.PathLike,
            methods: Sequence[str | os.PathLike] | Mapping[str, str | os.PathLike], *,
            symmetries: str = "both", layers: Sequence[str] | None = None,
            group: str = "tensor", include_buffers: bool = False,
            permutation: str = "first", scaling: str = "norm", softmax: bool = True,
            number_bandwidths: int = 10, test: bool = False, alpha: float = 0.05,
            B1: int = 2000, B2: int = 2000, B3: int = 50, seed: int = 0,
            block_bytes: int = DEFAULT_BLOCK_BYTES, workdir: str | os.PathLike | None = None,
            canonical_dir: str | os.PathLike | None = None, verify: bool = True,
            progress: bool = False, command: str | None = None,
            precision: str = DEFAULT_PRECISION, device: str = "cpu") -> CompareResult:
    """Compare method collections with the target collection, layer by layer.

    Parameters
    ----------
    target : path-like
        The target posterior's collection (e.g. 1000 independently trained checkpoints).
    methods : sequence of path-like, or mapping of name to path-like
        The method collections. Names default to the file stems.
    symmetries : {"keep", "remove", "both"}
        MMD on the stored weights, NS-MMD on canonical forms, or both (see the module
        docstring for already-canonical inputs).
    layers : sequence of str, optional
        Layer names or fnmatch patterns (default: every parameter).
    group : {"tensor", "module"}
        A layer is one parameter tensor, or one module's parameters together.
    include_buffers : bool
        Also compare floating-point buffers (BatchNorm running statistics).
    permutation, scaling, softmax
        The canonicalizer's options for NS-MMD
        (:func:`posteriorzoo.collection.canonicalize`).
    number_bandwidths : int
        Bandwidths per kernel family (10: MMDAgg's 20 kernels).
    test, alpha, B1, B2, B3, seed
        Also run the MMDAgg test per layer and method, with these options.
    block_bytes : int
        Budget of one block of features over all collections (values counted at 8 bytes).
    workdir : path-like, optional
        An existing folder where the temporary folder of the canonical copies goes
        (default: the system's); it is deleted at the end.
    canonical_dir : path-like, optional
        An existing folder to keep the canonical copies in instead, named by the inputs'
        display names (``target-canonical.h5``, ``<name>-canonical.h5``:
        :func:`canonical_copy_names`; an existing copy there is an error). The result's
        ``canonical_target`` and ``canonical_copies`` (method name -> path) give them.
    verify : bool
        Check every checkpoint's SHA-256 as it is read (default True).
    progress : bool
        Show progress bars.
    command : str, optional
        Recorded in the provenance of the report and of the canonical copies.
    precision : {"exact", "fast"}
        The distances' arithmetic (:mod:`posteriorzoo.mmd.distances`): ``"exact"``
        (default: float64, the same bits on every machine and blocking) or ``"fast"``
        (float32 GEMM for L2 and a SIMD L1 kernel, float64 across chunks, within the bound
        :mod:`posteriorzoo.mmd.distances_fast` states: the ResNet-scale path).
    device : str
        ``cpu``, ``cuda`` or ``cuda:N``: where the distances (``"fast"`` only) and the
        canonical copies are computed.
    """
    from posteriorzoo.progress import progress as progress_bar

    check_choice("symmetries", symmetries, SYMMETRY_CHOICES)
    check_choice("permutation", permutation, PERMUTATION_KEYS)
    check_choice("scaling", scaling, SCALINGS)
    check_choice("group", group, LAYER_GROUPS)
    check_bool("softmax", softmax)
    check_number_bandwidths(number_bandwidths)
    check_precision(precision, device)
    mmdagg = mmdagg_options(test, alpha, B1, B2, B3, seed)
    # checked before any work: the folders are first written after every input is read
    if workdir is not None:
        check_folder(workdir, "workdir")
    if canonical_dir is not None:
        check_folder(canonical_dir, "canonical_dir")
    named = _named(methods)
    if not named:
        raise InvalidOptionError("no method collection to compare with the target")
    canonical_options = {"permutation": permutation, "scaling": scaling, "softmax": softmax}
    inputs = [("target", Path(target)), *named]
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        zoos = [stack.enter_context(open_zoo(path, verify=verify)) for _, path in inputs]
        notes = _check_layouts(inputs, zoos)
        already = _canonical_state(inputs, zoos, canonical_options)
        if already and symmetries == "keep":
            raise InvalidOptionError("the collections are canonical (symmetries removed): "
                                     "MMD with the symmetries kept needs the raw collections")
        labels = ("remove",) if already else \
            tuple(SYMMETRIES) if symmetries == "both" else (symmetries,)
        keys = parameter_keys(zoos[0], include_buffers)
        chosen = select_layers(group_layers(keys, zoos[0].shapes, group), layers)
        sources = [ZooSource(name, zoo, sha256_file(path))
                   for (name, path), zoo in zip(inputs, zoos, strict=True)]
        check_sources(sources[0], sources[1:], chosen)
        groups = {}
        canonicalizer = None
        # the canonical forms NS-MMD compares, when they outlive this call
        kept: list[Path] = []
        if "remove" in labels and not already:
            directory = Path(canonical_dir) if canonical_dir is not None else Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="posteriorzoo-mmd-",
                                                                dir=workdir)))
            copies = [directory / file for file in
                      canonical_copy_names([name for name, _ in inputs])]
            clock = time.perf_counter()
            groups["remove"] = [
                ZooSource(name, stack.enter_context(open_zoo(_canonical_copy(
                    path, copy, canonical_options, command, progress, verify, device))))
                for (name, path), copy in zip(inputs, copies, strict=True)]
            canonicalizer = {"function": "posteriorzoo.collection.canonicalize",
                             **canonical_options,
                             "seconds": round(time.perf_counter() - clock, 3),
                             "kept_in": None if canonical_dir is None else str(canonical_dir)}
            if canonical_dir is not None:
                kept = copies
                canonicalizer["copies"] = {
                    "target" if index == 0 else f"method {name}": copy.name
                    for index, ((name, _), copy) in enumerate(zip(inputs, copies,
                                                                  strict=True))}
        elif already:
            groups["remove"] = sources
            canonicalizer = {"inputs_already_canonical": True, **canonical_options}
            kept = [path for _, path in inputs]
        if "keep" in labels:
            groups["keep"] = sources
        results = []
        clock = time.perf_counter()
        total = len(labels) * len(chosen) * (len(sources) - 1)
        with progress_bar(total=total, desc="mmd", unit="layer", enabled=progress) as bar:
            for label in labels:
                members = groups[label]
                results += compare_sources(members[0], members[1:], chosen, symmetries=label,
                                           number_bandwidths=number_bandwidths,
                                           block_bytes=block_bytes, test=mmdagg, bar=bar,
                                           precision=precision, device=device)
        for group_sources in groups.values():
            for source in group_sources:
                source.close()
    options = describe_options(chosen, number_bandwidths, block_bytes, mmdagg,
                               symmetries=symmetries, computed=list(labels), group=group,
                               include_buffers=include_buffers,
                               layer_keys={layer.name: list(layer.keys) for layer in chosen},
                               precision=precision, device=device)
    comparison = Comparison(results, [s.name for s in sources[1:]],
                            kernel_names(number_bandwidths), options)
    copies = ({name: path for (name, _), path in zip(inputs[1:], kept[1:], strict=True)}
              if kept else {})
    provenance = record(
        "posteriorzoo mmd", command=command,
        inputs={"target": sources[0].provenance,
                **{f"method {s.name}": s.provenance for s in sources[1:]}},
        seeds={"mmdagg": seed if test else None,
               "note": "the MMD statistics themselves use no random numbers"},
        options=options, canonicalizer=canonicalizer, warnings=notes,
        seconds={"statistics": round(time.perf_counter() - clock, 3),
                 "total": round(time.perf_counter() - started, 3)})
    return CompareResult(comparison, canonical_target=kept[0] if kept else None,
                         canonical_copies=copies, provenance=provenance)
