"""Layer-by-layer comparison of approximate posteriors with the target posterior.

For every method collection and every layer: the 20 MMD^2 statistics of the target's
samples (X, e.g. 1000 checkpoints) against the method's (Y, e.g. 100), their median,
mean and max; per method, the mean over layers of each of these weighted by the layers'
parameter counts (the figures of the paper's Table 2). "MMD" keeps the weight-space
symmetries; "NS-MMD" first writes canonical copies of the target and of every method
with the canonicalizer's defaults (permutation "first", scaling "norm", softmax shift
removed) and compares those.

Each layer is read once for all methods (the target's self-distances are shared), in
blocks of features, so memory stays O((m + n)^2 + block) even for layers with millions
of weights. :func:`compare_collections` works on zoo files, :func:`compare_arrays` on
arrays in memory; both return a :class:`ComparisonReport` that writes CSV, JSON and
Markdown, each with the provenance (command, library versions, seeds, inputs and their
SHA-256).
"""

# ruff: noqa: N803, N806, N815 -- the paper's and MMDAgg's names: X, Y, K, B1, B2, B3

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from posteriorzoo._faults import fault_point
from posteriorzoo.errors import InvalidOptionError, ShapeMismatchError
from posteriorzoo.mmd.aggregated import (
    MMDAggResult,
    check_test_options,
    mmdagg_from_distances,
)
from posteriorzoo.mmd.distances import SharedTargetDistances
from posteriorzoo.mmd.sources import (
    DEFAULT_BLOCK_BYTES,
    ArraySource,
    Layer,
    ZooSource,
    check_sources,
    display_name,
    features_per_block,
    group_layers,
    layer_blocks,
    parameter_keys,
    select_layers,
)
from posteriorzoo.mmd.statistics import (
    KernelMMDs,
    check_number_bandwidths,
    kernel_mmds_from_distances,
    kernel_names,
)

#: The canonicalizer's options used for NS-MMD (its defaults).
CANONICAL_OPTIONS = {"permutation": "first", "scaling": "norm", "softmax": True}
SYMMETRY_CHOICES = ("keep", "remove", "both")
_LABELS = {"keep": ("kept",), "remove": ("removed",), "both": ("kept", "removed")}
_TABLE_NAMES = {"kept": "MMD", "removed": "NS-MMD"}
FILE_NAMES = {"layers_csv": "mmd_layers.csv", "summary_csv": "mmd_summary.csv",
              "json": "mmd_report.json", "markdown": "mmd_report.md"}


@dataclass
class LayerResult:
    """The comparison of one method with the target on one layer.

    Attributes
    ----------
    method : str
        The method collection's name.
    symmetries : str
        ``"kept"`` (MMD) or ``"removed"`` (NS-MMD).
    layer : str
        Layer name; ``keys`` are the state keys it concatenates.
    parameters : int
        Values per checkpoint in the layer (its weight in the model-level means).
    mmd : KernelMMDs
        The 20 statistics and bandwidths.
    test : MMDAggResult or None
        The MMDAgg test, if it was asked for.
    """

    method: str
    symmetries: str
    layer: str
    keys: tuple[str, ...]
    parameters: int
    mmd: KernelMMDs
    test: MMDAggResult | None = None

    @property
    def median(self) -> float:
        return self.mmd.median

    @property
    def mean(self) -> float:
        return self.mmd.mean

    @property
    def max(self) -> float:
        return self.mmd.max


@dataclass
class MethodSummary:
    """A method's model-level figures: per-layer statistics averaged with layer sizes."""

    method: str
    symmetries: str
    layers: int
    parameters: int
    median: float
    mean: float
    max: float
    rejected_layers: int | None = None


@dataclass
class ComparisonReport:
    """Every number of a comparison, with writers for CSV, JSON and Markdown."""

    results: list[LayerResult]
    methods: list[str]
    kernels: tuple[str, ...]
    provenance: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ aggregation
    def summaries(self) -> list[MethodSummary]:
        """One :class:`MethodSummary` per method and symmetry treatment, in input order."""
        out = []
        for symmetries in ("kept", "removed"):
            for method in self.methods:
                rows = [r for r in self.results
                        if r.method == method and r.symmetries == symmetries]
                if not rows:
                    continue
                weights = np.array([r.parameters for r in rows], dtype=np.float64)
                figures = {stat: float(np.average([getattr(r, stat) for r in rows],
                                                  weights=weights))
                           for stat in ("median", "mean", "max")}
                tested = [r.test for r in rows if r.test is not None]
                out.append(MethodSummary(
                    method, symmetries, len(rows), int(weights.sum()), **figures,
                    rejected_layers=sum(t.reject for t in tested) if tested else None))
        return out

    def summary(self, method: str, symmetries: str = "kept") -> MethodSummary:
        """The summary of one method (``symmetries``: "kept" or "removed")."""
        for item in self.summaries():
            if item.method == method and item.symmetries == symmetries:
                return item
        raise KeyError(f"no results for {method!r} with symmetries {symmetries}")

    # ------------------------------------------------------------------ writers
    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-serialisable data."""
        layers = []
        for r in self.results:
            entry = {"method": r.method, "symmetries": r.symmetries, "layer": r.layer,
                     "keys": list(r.keys), "parameters": r.parameters, "m": r.mmd.m,
                     "n": r.mmd.n, "median": r.median, "mean": r.mean, "max": r.max,
                     "mmd2": r.mmd.values.tolist(),
                     "bandwidths": r.mmd.bandwidths.tolist()}
            if r.test is not None:
                entry["mmdagg"] = r.test.to_dict()
            layers.append(entry)
        return {"provenance": self.provenance, "kernels": list(self.kernels),
                "statistic": "unbiased MMD^2 U-statistic (complete)",
                "summary": [vars(s) for s in self.summaries()], "layers": layers}

    def to_json(self, path: str | os.PathLike) -> Path:
        """Write :meth:`to_dict` as JSON; returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    def _csv_header(self) -> str:
        lines = [f"# {line}" for line in provenance_lines(self.provenance)]
        return "\n".join(lines) + "\n"

    def layers_csv(self) -> str:
        """One row per method, symmetry treatment and layer, with all 20 values."""
        count = len(self.kernels) // 2
        names = [f"laplace_{i + 1}" for i in range(count)] + \
                [f"gaussian_{i + 1}" for i in range(count)]
        header = ["method", "symmetries", "layer", "keys", "parameters", "m", "n",
                  "median", "mean", "max", *[f"mmd2_{k}" for k in names],
                  *[f"bandwidth_{k}" for k in names]]
        tested = any(r.test is not None for r in self.results)
        if tested:
            header += ["mmdagg_reject", "mmdagg_min_p_value", "mmdagg_u"]
        buffer = io.StringIO()
        buffer.write(self._csv_header())
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(header)
        for r in self.results:
            row = [r.method, r.symmetries, r.layer, " ".join(r.keys), r.parameters,
                   r.mmd.m, r.mmd.n, repr(r.median), repr(r.mean), repr(r.max),
                   *[repr(float(v)) for v in r.mmd.values],
                   *[repr(float(v)) for v in r.mmd.bandwidths]]
            if tested:
                row += ([int(r.test.reject), repr(float(r.test.p_values.min())),
                         repr(r.test.u)] if r.test is not None else ["", "", ""])
            writer.writerow(row)
        return buffer.getvalue()

    def summary_csv(self) -> str:
        """One row per method and symmetry treatment: the weighted means over layers."""
        buffer = io.StringIO()
        buffer.write(self._csv_header())
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(["method", "symmetries", "layers", "parameters", "median", "mean",
                         "max", "mmdagg_rejected_layers"])
        for s in self.summaries():
            writer.writerow([s.method, s.symmetries, s.layers, s.parameters, repr(s.median),
                             repr(s.mean), repr(s.max),
                             "" if s.rejected_layers is None else s.rejected_layers])
        return buffer.getvalue()

    def to_markdown(self, scale: float = 1.0, digits: int = 4) -> str:
        """A table laid out like the paper's Table 2, the per-layer figures, provenance.

        Parameters
        ----------
        scale : float
            Multiply every MMD^2 by this in the tables (e.g. 100); the CSV and JSON keep
            the raw values.
        digits : int
            Decimals shown.
        """
        treatments = [t for t in ("kept", "removed")
                      if any(r.symmetries == t for r in self.results)]
        summaries = {(s.method, s.symmetries): s for s in self.summaries()}

        def cell(value: float) -> str:
            return f"{value * scale:.{digits}f}"

        factor = "" if scale == 1 else f" x {scale:g}"
        lines = ["# MMD of approximate posteriors to the target posterior", ""]
        target = self.provenance.get("target", {})
        if target:
            where = target.get("path") or target.get("name")
            lines.append(f"Target: `{where}` ({target.get('samples', target.get('checkpoints'))}"
                         f" samples).")
        lines += [
            "",
            f"Values: unbiased MMD^2{factor}. Per layer the median, mean and max over the "
            f"{len(self.kernels)} MMDAgg kernels ({len(self.kernels) // 2} Laplace, "
            f"{len(self.kernels) // 2} Gaussian); per method the mean of each over layers, "
            "weighted by the layers' parameter counts. MMD keeps the weight-space "
            "symmetries; NS-MMD compares canonical forms (symmetries removed).",
            ""]
        head = ["Method"]
        for t in treatments:
            head += [f"{_TABLE_NAMES[t]} {stat}" for stat in ("median", "mean", "max")]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|---" + "|---:" * (len(head) - 1) + "|")
        for method in self.methods:
            row = [method]
            for t in treatments:
                s = summaries.get((method, t))
                row += [cell(getattr(s, stat)) if s else "/" for stat in
                        ("median", "mean", "max")]
            lines.append("| " + " | ".join(row) + " |")
        lines += ["", "## Per layer", ""]
        tested = any(r.test is not None for r in self.results)
        head = ["Method", "Layer", "Parameters"]
        for t in treatments:
            head += [f"{_TABLE_NAMES[t]} {stat}" for stat in ("median", "mean", "max")]
            if tested:
                head.append(f"{_TABLE_NAMES[t]} MMDAgg")
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|---|---" + "|---:" * (len(head) - 2) + "|")
        index = {(r.method, r.symmetries, r.layer): r for r in self.results}
        layer_order = list(dict.fromkeys((r.layer, r.parameters) for r in self.results))
        for method in self.methods:
            for layer, parameters in layer_order:
                row = [method, f"`{layer}`", str(parameters)]
                for t in treatments:
                    r = index.get((method, t, layer))
                    row += [cell(getattr(r, stat)) if r else "/" for stat in
                            ("median", "mean", "max")]
                    if tested:
                        row.append("/" if r is None or r.test is None else
                                   f"{'reject' if r.test.reject else 'accept'} "
                                   f"(min p {r.test.p_values.min():.3g})")
                lines.append("| " + " | ".join(row) + " |")
        lines += ["", "## Provenance", ""]
        lines += [f"- {line}" for line in provenance_lines(self.provenance)]
        return "\n".join(lines) + "\n"

    def write(self, out_dir: str | os.PathLike, scale: float = 1.0, overwrite: bool = False
              ) -> dict[str, Path]:
        """Write the CSV, JSON and Markdown files into a new folder ``out_dir``.

        The folder is built under a temporary name and appears only when complete; an
        existing one is replaced only with ``overwrite``. Returns the files' paths.
        """
        from posteriorzoo.outputs import atomic_directory

        out_dir = Path(out_dir)
        with atomic_directory(out_dir, overwrite=overwrite) as partial:
            self.write_into(partial, scale)
        return {kind: out_dir / name for kind, name in FILE_NAMES.items()}

    def write_into(self, directory: str | os.PathLike, scale: float = 1.0) -> dict[str, Path]:
        """Write the files into an existing folder (e.g. a temporary output being built)."""
        out_dir = Path(directory)
        paths = {kind: out_dir / name for kind, name in FILE_NAMES.items()}
        paths["layers_csv"].write_text(self.layers_csv())
        paths["summary_csv"].write_text(self.summary_csv())
        self.to_json(paths["json"])
        paths["markdown"].write_text(self.to_markdown(scale=scale))
        return paths


def provenance_lines(provenance: Mapping[str, Any]) -> list[str]:
    """Human-readable provenance, one fact per line (used by the CSV and Markdown)."""
    lines = []
    if provenance.get("command"):
        lines.append(f"command: {provenance['command']}")
    if provenance.get("created_at"):
        lines.append(f"created: {provenance['created_at']}")
    if provenance.get("versions"):
        lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in
                                              provenance["versions"].items()))
    for item in [provenance.get("target"), *provenance.get("methods", [])]:
        if not item:
            continue
        where = item.get("path") or "(arrays in memory)"
        digest = f" sha256 {item['sha256']}" if item.get("sha256") else ""
        lines.append(f"{item.get('role', 'input')} {item['name']}: {where}{digest} "
                     f"({item.get('samples', item.get('checkpoints'))} samples)")
    if "seeds" in provenance:
        lines.append(f"seeds: {json.dumps(provenance['seeds'], sort_keys=True)}")
    if provenance.get("options"):
        lines.append(f"options: {json.dumps(provenance['options'], sort_keys=True)}")
    canonical = provenance.get("canonicalizer")
    if canonical:
        lines.append(f"canonicalizer: {json.dumps(canonical, sort_keys=True)}")
    return lines


# ---------------------------------------------------------------------- the computation
def _test_options(test: bool, alpha: float, B1: int, B2: int, B3: int,
                  seed: int) -> dict[str, Any] | None:
    return {"alpha": alpha, "B1": B1, "B2": B2, "B3": B3, "seed": seed} if test else None


def compare_sources(target, methods: Sequence, layers: Sequence[Layer], *,
                    symmetries: str = "kept", number_bandwidths: int = 10,
                    block_bytes: int = DEFAULT_BLOCK_BYTES,
                    test: Mapping[str, Any] | None = None, bar=None) -> list[LayerResult]:
    """Compare every method source with the target source on every layer.

    Each layer is streamed once: block after block of its features is read from the
    target and from every method, and the target's self-distances are shared.

    Parameters
    ----------
    target, methods : ArraySource or ZooSource
        Where the samples come from (see :mod:`posteriorzoo.mmd.sources`).
    layers : sequence of Layer
    symmetries : str
        Label stored in the results ("kept" or "removed").
    number_bandwidths : int
    block_bytes : int
        Budget of one block over all sources (values counted at 8 bytes).
    test : mapping or None
        MMDAgg options (alpha, B1, B2, B3, seed) to also run the test per layer.
    bar : tqdm progress bar or None
        Advanced by one per method and layer.
    """
    features = features_per_block(target.rows + sum(m.rows for m in methods), block_bytes)
    results = []
    for layer in layers:
        shared = SharedTargetDistances(target.rows, [m.rows for m in methods])
        streams = [layer_blocks(source, layer, features) for source in (target, *methods)]
        for blocks in zip(*streams, strict=True):
            shared.update(blocks[0], blocks[1:], check_finite=False)
        for k, method in enumerate(methods):
            distances = shared.pooled(k)
            mmd = kernel_mmds_from_distances(distances, number_bandwidths)
            outcome = (mmdagg_from_distances(distances, number_bandwidths=number_bandwidths,
                                             **test) if test else None)
            results.append(LayerResult(method.name, symmetries, layer.name, layer.keys,
                                       layer.size, mmd, outcome))
            if bar is not None:
                bar.set_postfix_str(f"{symmetries} {layer.name} {method.name}", refresh=False)
                bar.update(1)
            fault_point("mmd-layer")
    return results


def _base_provenance(command: str | None) -> dict[str, Any]:
    import numba

    from posteriorzoo.provenance import library_versions

    versions = library_versions()
    versions["numba"] = numba.__version__
    return {"tool": "posteriorzoo mmd", "command": command,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions}


def _options(layers: Sequence[Layer], number_bandwidths: int, block_bytes: int,
             test: Mapping[str, Any] | None, **extra: Any) -> dict[str, Any]:
    return {"layers": [layer.name for layer in layers], "number_bandwidths": number_bandwidths,
            "kernels": f"{number_bandwidths} laplace (L1) + {number_bandwidths} gaussian (L2)",
            "bandwidth_rule": "MMDAgg: cross distances of the first 500 rows of X and Y",
            "statistic": "complete unbiased MMD^2 U-statistic",
            "model_level": "mean over layers weighted by parameter count",
            "block_bytes": block_bytes, "mmdagg_test": dict(test) if test else None, **extra}


def _seeds(test: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"mmdagg": test["seed"] if test else None,
            "note": "the MMD statistics themselves use no random numbers"}


def compare_arrays(target: Mapping[str, np.ndarray],
                   methods: Mapping[str, Mapping[str, np.ndarray]], *,
                   layers: Sequence[str] | None = None, number_bandwidths: int = 10,
                   symmetries: str = "kept", test: bool = False, alpha: float = 0.05,
                   B1: int = 2000, B2: int = 2000, B3: int = 50,
                   seed: int = 0, block_bytes: int = DEFAULT_BLOCK_BYTES,
                   progress: bool = False, command: str | None = None) -> ComparisonReport:
    """Compare samples held in memory, layer by layer (the API form of ``posteriorzoo mmd``).

    Parameters
    ----------
    target : mapping of str to array of shape (m, *shape)
        The target posterior's samples, one array per layer (e.g. ``{"fc.weight": W}``
        with W of shape (1000, 10, 10)); m >= 2.
    methods : mapping of str to mapping of str to array of shape (n_k, *shape)
        Each method's samples with the same layer keys and shapes; n_k >= 2.
    layers : sequence of str, optional
        Layer names or fnmatch patterns (default: every key of ``target``).
    number_bandwidths : int
        Bandwidths per kernel family (10: MMDAgg's 20 kernels).
    symmetries : str
        Label of the results, "kept" or "removed" (say "removed" if you canonicalized the
        samples yourself, e.g. with :func:`posteriorzoo.symmetry.canonicalize`).
    test : bool
        Also run the MMDAgg test on every layer (with alpha, B1, B2, B3, seed).
    block_bytes : int
        Budget of one block of features over all samples.
    progress : bool
        Show a progress bar.
    command : str, optional
        Recorded in the provenance.

    Returns
    -------
    ComparisonReport
    """
    from tqdm.auto import tqdm

    check_number_bandwidths(number_bandwidths)
    if symmetries not in ("kept", "removed"):
        raise InvalidOptionError(f"symmetries must be 'kept' or 'removed', not {symmetries!r}")
    if not methods:
        raise InvalidOptionError("no method samples to compare with the target")
    target_source = ArraySource("target", target)
    method_sources = [ArraySource(name, arrays) for name, arrays in methods.items()]
    chosen = select_layers(group_layers(list(target), target_source.shapes), layers)
    check_sources(target_source, method_sources, chosen)
    options = _test_options(test, alpha, B1, B2, B3, seed)
    if options:
        check_test_options(alpha, B1, B2, B3, seed)
    with tqdm(total=len(chosen) * len(method_sources), desc="mmd", unit="layer",
              disable=not progress) as bar:
        results = compare_sources(target_source, method_sources, chosen,
                                  symmetries=symmetries, number_bandwidths=number_bandwidths,
                                  block_bytes=block_bytes, test=options, bar=bar)
    provenance = _base_provenance(command)
    provenance.update(
        target={**target_source.provenance, "role": "target"},
        methods=[{**s.provenance, "role": "method"} for s in method_sources],
        seeds=_seeds(options), options=_options(chosen, number_bandwidths, block_bytes, options,
                                                symmetries=symmetries),
        canonicalizer=None)
    return ComparisonReport(results, [s.name for s in method_sources],
                            kernel_names(number_bandwidths), provenance)


def _method_paths(methods: Sequence[str | os.PathLike] | Mapping[str, str | os.PathLike]
                  ) -> list[tuple[str, Path]]:
    if isinstance(methods, Mapping):
        return [(str(name), Path(path)) for name, path in methods.items()]
    taken: set[str] = set()
    return [(display_name(Path(path), taken), Path(path)) for path in methods]


def _canonical_copy(source: Path, digest: str, directory: Path, command: str | None,
                    progress: bool, verify: bool) -> tuple[Path, bool]:
    """The canonical form of ``source`` in ``directory`` (reused if already there)."""
    from posteriorzoo.symmetry.collection import canonicalize_collection
    from posteriorzoo.zoo import open_zoo

    options = CANONICAL_OPTIONS
    name = (f"{source.stem}-{digest[:16]}-{options['permutation']}-{options['scaling']}"
            f"{'-softmax' if options['softmax'] else ''}.h5")
    path = directory / name
    if path.exists():
        with contextlib.suppress(Exception), open_zoo(path) as zoo, open_zoo(source) as original:
            annotations = zoo.annotations
            if (len(zoo) == len(original)
                    and all(annotations.get(k) == v for k, v in options.items())):
                return path, True
        path.unlink()
    canonicalize_collection(source, path, progress=progress, command=command, verify=verify,
                            **options)
    return path, False


def compare_collections(target: str | os.PathLike,
                        methods: Sequence[str | os.PathLike] | Mapping[str, str | os.PathLike],
                        *, symmetries: str = "both", layers: Sequence[str] | None = None,
                        group: str = "tensor", include_buffers: bool = False,
                        number_bandwidths: int = 10, test: bool = False, alpha: float = 0.05,
                        B1: int = 2000, B2: int = 2000, B3: int = 50,
                        seed: int = 0, block_bytes: int = DEFAULT_BLOCK_BYTES,
                        canonical_dir: str | os.PathLike | None = None,
                        workdir: str | os.PathLike | None = None, verify: bool = True,
                        progress: bool = False, command: str | None = None
                        ) -> ComparisonReport:
    """Compare method collections (zoo files) with the target collection, layer by layer.

    Parameters
    ----------
    target : path-like
        The target posterior's collection (e.g. 1000 independently trained checkpoints).
    methods : sequence of path-like, or mapping of name to path-like
        The method collections (same architecture). Names default to the file stems.
    symmetries : {"keep", "remove", "both"}
        MMD on the stored weights ("keep"), NS-MMD on canonical forms ("remove"), or both.
    layers : sequence of str, optional
        Layer names or fnmatch patterns (default: every parameter).
    group : {"tensor", "module"}
        A layer is one parameter tensor (default) or one module's parameters together.
    include_buffers : bool
        Also compare floating-point buffers (BatchNorm running statistics).
    number_bandwidths : int
        Bandwidths per kernel family (10: MMDAgg's 20 kernels).
    test : bool
        Also run the MMDAgg test per layer and method (alpha, B1, B2, B3, seed).
    block_bytes : int
        Budget of one block of features over all collections (values counted at 8 bytes).
    canonical_dir : path-like, optional
        Keep the canonical copies here and reuse those already there (default: a
        temporary directory, deleted at the end).
    workdir : path-like, optional
        Where the temporary directory goes (default: the system's).
    verify : bool
        Check every checkpoint's SHA-256 as it is read and refuse a corrupt collection
        (default True).
    progress : bool
        Show progress bars.
    command : str, optional
        Recorded in the provenance of the outputs and of the canonical copies.

    Returns
    -------
    ComparisonReport
    """
    from tqdm.auto import tqdm

    from posteriorzoo.hashing import sha256_file
    from posteriorzoo.zoo import open_zoo

    if symmetries not in SYMMETRY_CHOICES:
        raise InvalidOptionError(
            f"symmetries must be one of {', '.join(SYMMETRY_CHOICES)}, not {symmetries!r}")
    check_number_bandwidths(number_bandwidths)
    options = _test_options(test, alpha, B1, B2, B3, seed)
    if options:
        check_test_options(alpha, B1, B2, B3, seed)
    named = _method_paths(methods)
    if not named:
        raise InvalidOptionError("no method collection to compare with the target")
    inputs = [("target", Path(target)), *named]
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        zoos = [stack.enter_context(open_zoo(path, verify=verify)) for _, path in inputs]
        reference = zoos[0]
        for (_, path), zoo in zip(inputs[1:], zoos[1:], strict=True):
            if (zoo.architecture, zoo.num_classes, zoo.model_options) != (
                    reference.architecture, reference.num_classes, reference.model_options):
                raise ShapeMismatchError(
                    f"{path}: architecture {zoo.architecture} ({zoo.num_classes} classes, "
                    f"{zoo.model_options}) differs from the target's {reference.architecture} "
                    f"({reference.num_classes} classes, {reference.model_options})")
        keys = parameter_keys(reference, include_buffers)
        chosen = select_layers(group_layers(keys, reference.shapes, group), layers)
        digests = [sha256_file(path) for _, path in inputs]
        sources = [ZooSource(name, zoo, digest)
                   for (name, _), zoo, digest in zip(inputs, zoos, digests, strict=True)]
        check_sources(sources[0], sources[1:], chosen)
        labels = _LABELS[symmetries]
        canonical_info = None
        canonical_sources: list[ZooSource] = []
        if "removed" in labels:
            if canonical_dir is None:
                directory = Path(stack.enter_context(tempfile.TemporaryDirectory(
                    prefix="posteriorzoo-mmd-", dir=workdir)))
            else:
                directory = Path(canonical_dir)
                directory.mkdir(parents=True, exist_ok=True)
            clock = time.perf_counter()
            copies = []
            for (name, path), digest in zip(inputs, digests, strict=True):
                copy, reused = _canonical_copy(path, digest, directory, command, progress,
                                               verify)
                zoo = stack.enter_context(open_zoo(copy))
                canonical_sources.append(ZooSource(name, zoo, None))
                copies.append({"name": name, "path": str(copy) if canonical_dir else None,
                               "reused": reused})
            canonical_info = {
                "function": "posteriorzoo.symmetry.collection.canonicalize_collection",
                **CANONICAL_OPTIONS, "seconds": round(time.perf_counter() - clock, 3),
                "copies": copies}
        total = len(labels) * len(chosen) * (len(sources) - 1)
        results = []
        clock = time.perf_counter()
        with tqdm(total=total, desc="mmd", unit="layer", disable=not progress) as bar:
            for label in labels:
                group_sources = sources if label == "kept" else canonical_sources
                results += compare_sources(
                    group_sources[0], group_sources[1:], chosen, symmetries=label,
                    number_bandwidths=number_bandwidths, block_bytes=block_bytes,
                    test=options, bar=bar)
        for source in (*sources, *canonical_sources):
            source.close()
        provenance = _base_provenance(command)
        provenance.update(
            target={**sources[0].provenance, "role": "target"},
            methods=[{**s.provenance, "role": "method"} for s in sources[1:]],
            seeds=_seeds(options),
            options=_options(chosen, number_bandwidths, block_bytes, options,
                             symmetries=symmetries, group=group,
                             include_buffers=include_buffers,
                             layer_keys={layer.name: list(layer.keys) for layer in chosen}),
            canonicalizer=canonical_info,
            seconds={"statistics": round(time.perf_counter() - clock, 3),
                     "total": round(time.perf_counter() - started, 3)})
    return ComparisonReport(results, [s.name for s in sources[1:]],
                            kernel_names(number_bandwidths), provenance)
