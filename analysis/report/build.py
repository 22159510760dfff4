"""Build the benchmark report: Table 1, the Table 2 detail, the noise floor and figures.

:func:`build_report` runs the collection layer on the target and every method collection
(:func:`posteriorzoo.collection.compare` for MMD and NS-MMD,
:func:`posteriorzoo.collection.evaluate` for the predictive metrics,
:func:`posteriorzoo.collection.min_mass` for the mass figure) and
:func:`analysis.report.noise.noise_floor` on the target, and returns a
:class:`ReportResult`, whose :meth:`~ReportResult.write` gives the HTML page, Markdown,
CSV, JSON and the figures as PNG and PDF.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from analysis.labels import collection_label
from analysis.report import tables
from analysis.report.reference import (
    TARGET_NAME,
    answers,
    choose_reference,
    function_values,
    reference_comparisons,
    reference_predictives,
    reference_values,
)
from posteriorzoo.errors import InvalidOptionError, PosteriorZooError
from posteriorzoo.mmd.noise import NoiseFloor, held_out_size, noise_floor
from posteriorzoo.options import check_choice, check_integer
from posteriorzoo.results import CollectionResult, csv_text
from posteriorzoo.text import MMD_DISPLAY_SCALE
from posteriorzoo.vocabulary import POSTERIOR_GROUPS, SYMMETRIES

#: The ranges of the numeric options (``posteriorzoo report`` parses the same): ECE bins
#: (with more bins than test images most are empty), noise-floor splits (each is one more
#: MMD on every layer: time), collapse pairs (each pair's MI is computed on every image).
MAX_BINS = 10_000
MAX_SPLITS = 1_000
MAX_PAIRS = 100_000


class MixedDatasetsError(PosteriorZooError, ValueError):
    """A method collection was trained on another dataset than the target's."""


@dataclass
class ReportResult(CollectionResult):
    """Everything the report shows.

    Attributes
    ----------
    rows : list of dict
        One per method: ``name``, ``path``, ``method``, ``group`` (reference /
        single-mode / multi-mode; DE is multi-mode, as in the paper), ``n`` and the raw
        values of Table 1 (``mmd``, ``ns_mmd``: layer-weighted median MMD^2; ``accuracy``,
        ``ece``, ``brier``, ``aupr``, ``fpr95`` in [0, 1] or [0, 2] for Brier; ``idmi``,
        ``oodmi`` in nats; ``agreement`` and ``tv`` with the target's predictive, in
        [0, 1]; with a gold standard ``mmd_ref``, ``ns_mmd_ref``, ``agreement_ref``,
        ``tv_ref``) and of Table 2 (``mmd_median`` ... ``ns_mmd_max``,
        ``rejected_layers`` with ``test``).
    noise : dict
        Treatment (``"keep"``, ``"remove"``) -> :class:`NoiseFloor`.
    per_layer : dict
        Treatment -> method -> layer -> median MMD^2.
    figures : dict
        Name -> ``matplotlib.figure.Figure``.
    datasets : dict
        ``id`` and ``ood`` dataset names and image counts.
    function_noise : dict or None
        The target's function-space noise band (:func:`analysis.report.reference.function_band`;
        None in a weights-only report).
    reference : dict or None
        The gold standard (:mod:`analysis.report.reference`): ``name``, ``kind``,
        ``path``, the target's distances to it (``target``) and the ``answers``.
    """

    kind = "report"
    target: dict[str, Any]
    rows: list[dict[str, Any]]
    noise: dict[str, NoiseFloor]
    per_layer: dict[str, dict[str, dict[str, float]]]
    datasets: dict[str, Any]
    tests: list[dict[str, Any]] = field(default_factory=list)
    diagnostics: list[dict[str, Any]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict, repr=False)
    figure_notes: dict[str, str] = field(default_factory=dict)
    function_noise: dict[str, Any] | None = None
    reference: dict[str, Any] | None = None

    def columns(self) -> tuple[tuple[str, str, float, str], ...]:
        """Table 1's columns (:func:`analysis.report.tables.table1_columns`)."""
        if self.reference is None:
            return tables.table1_columns()
        return tables.table1_columns(self.reference["name"],
                                     samples=self.reference["kind"] == "collection")

    def payload(self) -> dict[str, Any]:
        # MMD values stay raw here and in the CSV; the tables show them x display_scale
        return {"target": self.target, "datasets": self.datasets,
                "display_scale": MMD_DISPLAY_SCALE, "rows": self.rows,
                "noise_floor": {k: v.to_dict() for k, v in self.noise.items()},
                "per_layer": self.per_layer, "mmdagg_tests": self.tests,
                "diagnostics": self.diagnostics, "figures": sorted(self.figures),
                "figure_notes": self.figure_notes, "function_noise": self.function_noise,
                "reference": self.reference}

    def tables(self) -> dict[str, str]:
        from analysis.report.page import html_page, markdown_page

        columns = self.columns()
        table1 = csv_text(["name", "group", "n", *(k for k, *_ in columns)],
                          ([r["name"], r["group"], r["n"], *(r.get(k) for k, *_ in columns)]
                           for r in self.rows))
        table2 = csv_text(["name", *(k for k, _ in tables.TABLE2_COLUMNS)],
                          ([r["name"], *(r.get(k) for k, _ in tables.TABLE2_COLUMNS)]
                           for r in self.rows))
        noise = csv_text(["symmetries", "split", "held_out", "median_mmd2"],
                         ([k, i, v.held_out, float(x)] for k, v in self.noise.items()
                          for i, x in enumerate(v.splits)))
        files = {"table1.csv": table1, "table2.csv": table2, "noise_floor.csv": noise,
                 "report.md": markdown_page(self), "report.html": html_page(self)}
        if self.diagnostics:
            files["diagnostics.csv"] = csv_text(
                ["name", "method", "flags", "summary"],
                ([d["name"], d["method"], "; ".join(d["flags"]), d["summary"]]
                 for d in self.diagnostics))
        if self.tests:
            files["mmdagg_tests.csv"] = csv_text(list(self.tests[0]),
                                                 (list(t.values()) for t in self.tests))
        return files

    def figure_png(self, name: str) -> bytes:
        """Figure ``name`` as PNG (110 dpi), rendered on the first call only: the page
        embeds the same bytes that ``figures/<name>.png`` holds, and the PDF keeps the
        layout of this render."""
        rendered = self.__dict__.setdefault("_rendered_png", {})
        if name not in rendered:
            figure = self.figures[name]
            buffer = io.BytesIO()
            figure.savefig(buffer, format="png", dpi=110)
            rendered[name] = buffer.getvalue()
            # Keep the layout this render computed: the PDF reuses it instead of running
            # the constrained layout (most of a figure's rendering time) once more.
            figure.set_layout_engine("none")
        return rendered[name]

    def write_into(self, folder: str | os.PathLike) -> dict[str, Path]:
        """The tables, the JSON, and every figure as ``figures/<name>.png`` and ``.pdf``."""
        folder = Path(folder)
        paths = super().write_into(folder)
        (folder / "figures").mkdir(exist_ok=True)
        for name, figure in self.figures.items():
            png, pdf = folder / "figures" / f"{name}.png", folder / "figures" / f"{name}.pdf"
            png.write_bytes(self.figure_png(name))
            figure.savefig(pdf, format="pdf")
            paths[f"figures/{name}.png"], paths[f"figures/{name}.pdf"] = png, pdf
        return paths


def _label(zoo: Any, taken: set[str], stem: str) -> str:
    label = collection_label(zoo)
    return label if label not in taken else stem


def _group(zoo: Any) -> str:
    posterior = zoo.annotations.get("posterior")
    if posterior in POSTERIOR_GROUPS:
        return posterior
    return "multi-mode" if zoo.method == "de" else "other"


def _inputs(target: Path, methods: Sequence[str | os.PathLike] | Mapping[str, Any],
            allow_mixed: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The target's and the methods' names, groups, datasets; refuses mixed datasets."""
    from posteriorzoo.zoo import open_zoo

    named = (list(methods.items()) if isinstance(methods, Mapping)
             else [item if isinstance(item, tuple) else (None, item) for item in methods])
    if not named:
        raise InvalidOptionError("no method collection to report on")
    with open_zoo(target) as zoo:
        info = {"path": str(target), "dataset": zoo.dataset, "n": len(zoo),
                "architecture": zoo.architecture}
    entries, taken = [], set()
    for name, path in named:
        with open_zoo(Path(path)) as zoo:
            name = name or _label(zoo, taken, Path(path).stem)
            if name in taken:
                raise InvalidOptionError(f"two methods are named {name!r}")
            taken.add(name)
            entries.append({"name": name, "path": str(path), "method": zoo.method,
                            "group": _group(zoo), "n": len(zoo), "dataset": zoo.dataset})
    mixed = [e["name"] for e in entries if e["dataset"] != info["dataset"]]
    if mixed and not allow_mixed:
        raise MixedDatasetsError(
            f"{', '.join(mixed)} trained on another dataset than the target's "
            f"({info['dataset']}); pass allow_mixed=True (--allow-mixed) to compare anyway")
    return info, entries


def build_report(target: str | os.PathLike,
                 methods: Sequence[str | os.PathLike] | Mapping[str, str | os.PathLike], *,
                 id_data: str | None = None, ood_data: str | None = None,
                 allow_mixed: bool = False, test: bool = False, bins: int = 15,
                 ood_score: str = "max-probability", n_images: int | None = None,
                 splits: int = 50, n_pairs: int = 300, collapse: str | None = None,
                 seed: int = 0, figures: bool = True, workdir: str | os.PathLike | None = None,
                 progress: bool = False, command: str | None = None,
                 predict: Callable[[Any, Any], np.ndarray] | None = None,
                 timings: dict[str, float] | None = None,
                 predictions: bool = True, device: str = "cpu",
                 precision: str | None = None, reference: str | None = None,
                 reference_predictive: str | os.PathLike | None = None) -> ReportResult:
    """The benchmark report of method collections against a target collection.

    Parameters
    ----------
    target : path-like
        The target posterior (e.g. 1000 independently trained checkpoints).
    methods : sequence of path-like or (name, path) pairs, or mapping of name to path
        The method collections; a missing name (a bare path, or None) defaults to the
        method and its posterior annotation (``SWAG``, ``MM-SWAG``), else the file stem.
    id_data : str, optional
        In-distribution dataset of the predictive metrics (default: the target's).
    ood_data : str, optional
        Out-of-distribution dataset (same image shape): AUPR, FPR95 and OODMI.
    allow_mixed : bool
        Compare collections trained on another dataset than the target's (refused
        otherwise with :class:`MixedDatasetsError`).
    test : bool
        Also run the MMDAgg test on every layer (decisions and p-values).
    bins : int
        ECE bins, 1 to :data:`MAX_BINS`.
    ood_score : {"max-probability", "mutual-information"}
        The OOD score of AUPR and FPR95.
    n_images : int, optional
        Use only the first ``n_images`` images of each split.
    splits : int
        Random splits of the noise floor, 1 to :data:`MAX_SPLITS`.
    n_pairs : int
        Member pairs of the functional-collapse figure, 0 to :data:`MAX_PAIRS` (not
        drawn without ``figures``).
    collapse : str, optional
        The method whose pairwise MI the collapse figure shows (default: DE if present,
        else the first method).
    seed : int
        Seed of the noise floor's splits, the pairs and the MMDAgg test.
    figures : bool
        Draw the figures (matplotlib).
    workdir : path-like, optional
        An existing folder where the temporary canonical copies go (deleted at the end).
    progress : bool
        Show progress bars.
    command : str, optional
        Recorded in the provenance.
    predict : callable, optional
        ``predict(zoo, images)``: the members' softmax outputs (``evaluate``'s
        ``predict``). Default:
        :func:`posteriorzoo.collection.evaluation.member_probabilities` (numba kernels
        for OptuNets, the torch path otherwise); with ``engine="torch"`` it gives the
        torch path for every collection. It is called from the report's second thread;
        one that runs torch modules holds
        :data:`posteriorzoo.symmetry.structure.FX_TRACING` meanwhile (torch.fx patches
        ``nn.Module`` for the whole process while the first thread traces a model).
    predictions : bool
        Compute the predictive metrics (default). False gives a weights-only report (MMD,
        NS-MMD, the noise floors, diagnostics, the weight figures) that reads no data set
        and runs no network: for when the data set or a GPU is missing. Table 1's
        predictive columns are then empty and the collapse figure is not drawn.
    device : str
        Where the members' predictions, the canonical copies and the fast distances run
        (``cpu``, ``cuda``, ``cuda:N``; predictions batched, one checkpoint's weights at a
        time: :func:`~posteriorzoo.collection.evaluation.member_probabilities`).
    precision : {"exact", "fast"}, optional
        The distances' arithmetic of the MMD and the noise floors
        (:func:`posteriorzoo.collection.compare`; default: exact on cpu, fast on cuda).
    reference : str, optional
        The method (its name) that is the gold standard; default: the one collection whose
        method samples the recipe's posterior exactly (full-batch HMC), if any
        (:mod:`analysis.report.reference`). Its row is grouped ``reference``; Table 1
        gains MMD and NS-MMD to it and agreement and TV with its predictive, and the
        report answers how far the target is from it.
    reference_predictive : path-like, optional
        Instead, a gold-standard predictive from elsewhere: an N x C probability file in
        the NeurIPS 2021 competition's ``probs.csv`` layout on the test split of
        ``id_data`` (:func:`~posteriorzoo.collection.reference_predictive.read_reference_predictive`
        checks it): agreement and TV only.
    timings : dict, optional
        Filled with the wall seconds each stage took: ``load``, ``canonicalize``,
        ``mmd``, ``noise floor``, ``predictions``, ``metrics``, ``diagnostics``,
        ``figures`` (``benchmarks/bench_report.py``). ``predictions`` and ``metrics`` run
        in a second thread beside ``canonicalize`` ... ``diagnostics`` (and in both
        threads at the end; each adds up the calls of both), so the stages add up to
        more than the report's time.
    """
    from posteriorzoo.collection import compare, diagnose
    from posteriorzoo.collection.comparison import ZooSource, parameter_keys
    from posteriorzoo.collection.evaluation import (
        member_probabilities,
        read_images_first,
        reusing_images,
    )
    from posteriorzoo.devices import check_device
    from posteriorzoo.metrics import OOD_SCORES
    from posteriorzoo.mmd.distances import check_precision
    from posteriorzoo.outputs import check_folder
    from posteriorzoo.provenance import describe_input, record
    from posteriorzoo.zoo import open_zoo

    check_integer("bins", bins, 1, MAX_BINS)
    check_integer("splits", splits, 1, MAX_SPLITS)
    check_integer("n_pairs", n_pairs, 0, MAX_PAIRS)
    check_integer("seed", seed, 0)
    check_choice("ood_score", ood_score, OOD_SCORES)
    if workdir is not None:  # before any work, not when the first copy is written
        check_folder(workdir, "workdir")
    target = Path(target)
    timings = {} if timings is None else timings
    stage = _stage_timer(timings)
    check_device(device)
    precision = precision or ("exact" if device == "cpu" else "fast")
    check_precision(precision, device)
    distances = {"precision": precision, "device": device}
    predict = _timed(predict or functools.partial(member_probabilities, device=device),
                     timings, "predictions")
    with stage("load"):
        info, entries = _inputs(target, methods, allow_mixed)
        gold = choose_reference(entries, reference, reference_predictive)
    if gold is not None and gold.kind == "predictive" and not predictions:
        raise InvalidOptionError("a reference predictive is compared with the methods' "
                                 "predictions: not in a weights-only report")
    held_out = held_out_size(info["n"], [e["n"] for e in entries])
    names = [e["name"] for e in entries]
    if collapse is not None and collapse not in names:
        raise InvalidOptionError(f"collapse must name a method ({', '.join(names)}), "
                                 f"not {collapse!r}")
    collapse = collapse or ("DE" if "DE" in names else names[0])
    id_data = id_data or info["dataset"]
    # Table 1's metrics (the members' predictions) read only the inputs: a second thread
    # evaluates the collections one at a time while this one removes the symmetries and
    # compares the weights, then takes the collections still left. The heavy kernels of
    # both release the GIL, so the two share the cores; every result is the one they give
    # run one after the other. Each dataset split is read once (reusing_images).
    stopping = threading.Event()
    with reusing_images(), \
            tempfile.TemporaryDirectory(prefix="report-", dir=workdir) as scratch, \
            contextlib.ExitStack() as files, \
            ThreadPoolExecutor(1, thread_name_prefix="report-metrics") as pool:
        # The datasets first, in this thread: a missing one is refused before any long
        # stage, and the evaluations reuse the images read here.
        if predictions:
            with stage("load"):
                read_images_first(id_data, ood_data, n_images=n_images)
        todo = [e for e in entries if gold is None or e["name"] != gold.name] \
            if predictions else []
        evaluations: dict[str, Any] = {}
        options = ({"dataset": id_data, "ood_dataset": ood_data, "ood_score": ood_score,
                    "bins": bins, "n_images": n_images, "seed": seed},
                   {collapse: n_pairs if figures else 0})   # the pairs feed a figure only
        # The predictives every method is scored against (the target's; the gold
        # standard's), computed once by the metrics thread before any method's metrics.
        references = _Once(functools.partial(
            reference_predictives, target, gold, evaluations, predict, *options,
            held_out=held_out, splits=splits, seed=seed))
        evaluating = pool.submit(_evaluations, todo, evaluations, stopping, stage, predict,
                                 *options, references) if predictions else None
        with _stops_on_error(stopping):
            # The target's weights are never held in memory: the noise floors and figures
            # stream them from the files (a 1,000-checkpoint ResNet-18 target is 45 GB),
            # through the distance cache keyed by the checkpoints' recorded digests.
            targets = {}
            with stage("load"):
                zoo = files.enter_context(open_zoo(target, verify=True))
                keys = parameter_keys(zoo)
                targets["keep"] = ZooSource("target", zoo, keys=keys)
            # The stored weights' noise floor first: mostly kernels that release the GIL,
            # while the metrics thread starts (reading datasets, importing), which needs it
            noise = {}
            with stage("noise floor"):
                noise["keep"] = noise_floor(targets["keep"], symmetries="keep",
                                            held_out=held_out, splits=splits, seed=seed,
                                            **distances)
            canonical = Path(scratch) / "canonical"
            canonical.mkdir()
            with stage("mmd"):
                comparison = compare(target, {e["name"]: e["path"] for e in entries},
                                     symmetries="both", test=test, seed=seed,
                                     canonical_dir=canonical, progress=progress,
                                     command=command, **distances)
            to_reference = {}
            if gold is not None and gold.kind == "collection":
                with stage("mmd"):
                    to_reference = reference_comparisons(
                        gold, target, entries, comparison, seed=seed, command=command,
                        **distances)
            # compare's own clock tells its canonicalization from its statistics
            canonicalizing = (comparison.provenance.get("canonicalizer") or {}).get(
                "seconds", 0.0)
            timings["canonicalize"] = timings.get("canonicalize", 0.0) + canonicalizing
            timings["mmd"] -= canonicalizing
            # compare's canonical copy of the target (the target itself if it is canonical
            # already), named by compare: never guessed from the file name
            with stage("load"):
                zoo = files.enter_context(open_zoo(comparison.canonical_target or target,
                                                   verify=True))
                targets["remove"] = ZooSource("target", zoo, keys=keys)
            with stage("noise floor"):
                noise["remove"] = noise_floor(targets["remove"], symmetries="remove",
                                              held_out=held_out, splits=splits, seed=seed,
                                              **distances)
            per_layer: dict[str, dict[str, dict[str, float]]] = {}
            tests = [{"method": r.method, "symmetries": r.symmetries, "layer": r.layer,
                      "reject": bool(r.test.reject),
                      "min_p_value": float(np.min(r.test.p_values)),
                      "alpha": float(r.test.alpha)}
                     for r in comparison.results if r.test is not None]
            for result in comparison.results:
                per_layer.setdefault(result.symmetries, {}).setdefault(
                    result.method, {})[result.layer] = result.median
            # The inputs were verified as compare read them; IDMI is in Table 1 already.
            with stage("diagnostics"):
                diagnostics = [diagnosis_row(entry["name"],
                                             diagnose(entry["path"], predictions=False,
                                                      verify=False))
                               for entry in entries]
            if evaluating is not None:
                _evaluations(todo, evaluations, stopping, stage, predict, *options,
                             references)   # help
                evaluating.result()
        timings["metrics"] = timings.get("metrics", 0.0) - timings.get("predictions", 0.0)
        rows = [_row(entry, comparison, evaluations.get(entry["name"]),
                     None if gold is not None and entry["name"] == gold.name else to_reference)
                for entry in entries]
        shared = references.value if predictions else None
        reference_info = None
        if gold is not None:
            reference_info = {**gold.to_dict(), "target": {
                **(reference_values(TARGET_NAME, to_reference) if to_reference else {}),
                **((shared or {}).get("target_to_reference") or {})}}
            reference_info["answers"] = answers(
                {**reference_info, "function_band": (shared or {}).get("band")}, rows, noise)
        drawn, notes = ({}, {})
        if figures:
            from analysis.report.figures import report_figures

            with stage("figures"):
                drawn, notes = report_figures(target, targets, per_layer, noise,
                                              evaluations.get(collapse), collapse, entries,
                                              distances)
    first = evaluations.get(entries[0]["name"])
    return ReportResult(
        info, rows, noise, per_layer,
        {"id": id_data if predictions else None, "ood": ood_data if predictions else None,
         "images": first.image_counts if first else None, "bins": bins,
         "ood_score": ood_score, "collapse": collapse if predictions else None,
         "predictions": predictions},
        tests=tests, diagnostics=diagnostics, figures=drawn, figure_notes=notes,
        function_noise=(shared or {}).get("band"), reference=reference_info,
        provenance=record(
            "posteriorzoo report", command=command,
            inputs={"target": describe_input(target),
                    **{f"method {e['name']}": describe_input(Path(e["path"]))
                       for e in entries},
                    **({"reference predictive": describe_input(Path(gold.path))}
                       if gold is not None and gold.kind == "predictive" else {})},
            seeds={"noise_floor": seed, "pairs": seed, "test": seed if test else None},
            options={"predictions": predictions, "device": device, "precision": precision,
                     "id_data": id_data, "ood_data": ood_data, "allow_mixed": allow_mixed,
                     "test": test, "bins": bins, "ood_score": ood_score,
                     "n_images": n_images, "splits": splits, "n_pairs": n_pairs,
                     "collapse": collapse, "held_out": held_out,
                     "reference": None if gold is None else gold.name}))


def _stage_timer(timings: dict[str, float]) -> Callable[[str], Any]:
    """``with stage(name):`` adds the block's wall time to ``timings[name]``."""
    @contextlib.contextmanager
    def stage(name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - started

    return stage


def _timed(function: Callable[..., Any], timings: dict[str, float], name: str
           ) -> Callable[..., Any]:
    """``function``, adding the wall time of each call to ``timings[name]``."""
    stage = _stage_timer(timings)

    def timed(*args: Any, **kwargs: Any) -> Any:
        with stage(name):
            return function(*args, **kwargs)

    return timed


class _Once:
    """A value computed by the first thread that asks for it; the others wait for it."""

    def __init__(self, compute: Callable[[], Any]) -> None:
        self._compute, self._lock, self._value = compute, threading.Lock(), None

    def get(self) -> Any:
        with self._lock:
            if self._value is None:
                self._value = self._compute()
            return self._value

    @property
    def value(self) -> Any:
        """The value if it was computed, else None."""
        return self._value


def _evaluations(todo: list[dict[str, Any]], evaluations: dict[str, Any],
                 stopping: threading.Event, stage: Callable[[str], Any],
                 predict: Callable[..., Any], options: dict[str, Any],
                 pairs: dict[str, int], references: _Once) -> None:
    """Table 1's metrics of the method collections left in ``todo``, taken one at a time
    (by both threads once the weights' half is done), into ``evaluations``, each scored
    against the ``references`` (computed first)."""
    from posteriorzoo.collection import evaluate

    with stage("metrics"):   # less the predictions (timed apart)
        shared = references.get()["references"]
        while not stopping.is_set():
            try:
                entry = todo.pop(0)
            except IndexError:
                break
            evaluations[entry["name"]] = evaluate(
                entry["path"], **options, n_pairs=pairs.get(entry["name"], 0),
                predict=predict, references=shared)


@contextlib.contextmanager
def _stops_on_error(stopping: threading.Event) -> Iterator[None]:
    """Sets ``stopping`` if the block raises (the other thread then ends early)."""
    try:
        yield
    except BaseException:
        stopping.set()
        raise


def diagnosis_row(name: str, diagnosis: Any) -> dict[str, Any]:
    """One line of the report's diagnostics section: the flags and what the samples say
    (:func:`posteriorzoo.collection.diagnose`)."""
    parts = []
    for chain in diagnosis.chains or []:
        temperature = chain["kinetic_temperature"]
        acceptance = [a for a in chain.get("acceptance_rate") or [] if a is not None]
        if acceptance:   # a Metropolis-corrected sampler (HMC): what it recorded instead
            bfmi = [b for b in chain.get("e_bfmi") or [] if b is not None]
            shown = ("acceptance " + ", ".join(f"{a:.2f}" for a in acceptance)
                     + (", E-BFMI " + ", ".join(f"{b:.2f}" for b in bfmi) if bfmi else ""))
        else:
            shown = "kinetic temperature " + (
                "not recorded" if temperature is None else
                ", ".join(f"{t:.2f}" for t in temperature if t is not None)
                + f" (exact chain {chain['exact_temperature']:.2f})")
        likelihood = chain.get("log_likelihood")
        if likelihood:
            shown += (f", test log-likelihood ESS {likelihood['ess']:.1f} and split R-hat "
                      f"{likelihood['r_hat']:.2f}")
        parts.append(
            f"mode {chain['mode']}: {chain['chains']} chain(s) x {chain['draws']} draws, ESS "
            f"median {chain['ess']['median']:.1f}, R-hat median {chain['r_hat']['median']:.2f}"
            f" (max {chain['r_hat']['worst']:.2f}; {100 * chain['r_hat_above_1_01']:.0f}% of "
            f"weights above 1.01),"
            f" lag-1 autocorrelation {chain['autocorrelation'].get('1', {}).get('median', 0):.2f},"
            f" halves {chain['drift']['median']:.2f} sd apart, {shown}")
    between = getattr(diagnosis, "between_chains", None)
    if between and between.get("sentence"):
        parts.append(between["sentence"])
    layers = [v for v in diagnosis.variational or [] if v.get("moved_factor") is not None]
    if layers:
        worst = max(layers, key=lambda v: v["moved_factor"])
        final = (worst["sample_sigma"] if worst["sample_sigma"] is not None
                 else worst["final_sigma"])
        parts.append(f"sigma moved at most x{worst['moved_factor']:.2f} from its initial "
                     f"value ({worst['layer']}: {final:.3g} against "
                     f"{worst['initial_sigma']:.3g})")
    accuracy = diagnosis.diversity.get("test_accuracy")
    if accuracy:
        parts.append(f"member test accuracy {accuracy['min']:.3f} to {accuracy['max']:.3f} "
                     f"(std {accuracy['std']:.3f})")
    if diagnosis.unknown:
        parts.append(f"{len(diagnosis.unknown)} item(s) not recorded")
    return {"name": name, "method": diagnosis.method, "flags": list(diagnosis.flags),
            "summary": "; ".join(parts)}


def _row(entry: Mapping[str, Any], comparison: Any, evaluation: Any | None,
         to_reference: Mapping[str, Any] | None = None) -> dict[str, Any]:
    row = {key: entry[key] for key in ("name", "path", "method", "group", "n")}
    for word, setting in SYMMETRIES.items():
        prefix = setting.statistic.lower().replace("-", "_")
        try:
            summary = comparison.summary(entry["name"], word)
        except (KeyError, InvalidOptionError):
            continue
        row.update({prefix: summary.median, f"{prefix}_median": summary.median,
                    f"{prefix}_mean": summary.mean, f"{prefix}_max": summary.max})
        if summary.rejected_layers is not None:
            row["rejected_layers"] = (row.get("rejected_layers") or 0) + summary.rejected_layers
    if evaluation is not None:   # None: a weights-only report
        row.update({key: value for key, value in evaluation.metrics().items()
                    if key != "nll"}, nll=evaluation.ensemble_nll)
        row.update(function_values(evaluation))
    if to_reference:
        row.update(reference_values(entry["name"], to_reference))
    return row
