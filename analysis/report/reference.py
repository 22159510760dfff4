"""The report's references in function space and the gold standard.

Every method is scored in function space against the **target's** posterior predictive
(the average softmax of its checkpoints): **agreement**, the share of test images where the
two predictives pick the same class, and **total variation** (TV), half the L1 distance
between them averaged over the images: the NeurIPS 2021 approximate-inference
competition's metrics (Izmailov et al. 2021).

A second reference, the **gold standard**, is either

- a collection among the methods whose sampler is exact for the recipe's posterior (full
  batch HMC: :attr:`posteriorzoo.vocabulary.MethodInfo.exact`), or one named with
  ``reference=``: its row moves to the group ``reference``, and every other method, the
  target included, is also compared with it in weights (MMD and NS-MMD, the target's
  kernels and layer weights) and in function (agreement, TV); or
- an ``N x C`` predictive from elsewhere (the competition's ``probs.csv``,
  :func:`posteriorzoo.collection.reference_predictive.read_reference_predictive`): only
  the function-space columns.

:func:`answers` then says, with the noise bands, how far the target is from the reference
in weights and in function, which method is closest to it, and whether the paper's
ordering (DE < multi-mode < single-mode) holds with either reference. The function-space
band is :func:`posteriorzoo.metrics.predictive_noise`: the target's predictive against the
predictive of ``held_out`` of its own checkpoints, over the noise floor's splits.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from posteriorzoo.errors import InvalidOptionError
from posteriorzoo.text import MMD_DISPLAY_SCALE
from posteriorzoo.vocabulary import SYMMETRIES, method_info

#: The group of the gold standard's row in Table 1 (shown first).
REFERENCE_GROUP = "reference"
#: The target's name in the comparison with the gold standard.
TARGET_NAME = "target"
#: Row keys of the function-space columns against the target and against the reference.
TARGET_KEYS = ("agreement", "tv")
REFERENCE_KEYS = ("mmd_ref", "ns_mmd_ref", "agreement_ref", "tv_ref")
#: The percentiles of the function-space band, as the MMD noise floor's.
BAND_PERCENTILES = (5.0, 95.0)


@dataclass
class Reference:
    """The gold standard of a report.

    Attributes
    ----------
    name : str
        Its display name (a method row's name, or the predictive file's stem).
    kind : {"collection", "predictive"}
    path : str
    """

    name: str
    kind: str
    path: str

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "kind": self.kind, "path": self.path}


def choose_reference(entries: Sequence[dict[str, Any]], reference: str | None,
                     reference_predictive: str | Path | None) -> Reference | None:
    """The report's gold standard, and its entry moved to the ``reference`` group.

    ``reference`` names a method entry; without it, the one entry whose method is an exact
    sampler is taken (none: no gold standard; more than one: refused, name one). A
    ``reference_predictive`` file is the gold standard instead; both at once are refused.
    """
    names = [entry["name"] for entry in entries]
    if reference is not None and reference_predictive is not None:
        raise InvalidOptionError("give either a reference collection or a reference "
                                 "predictive file, not both")
    if reference_predictive is not None:
        path = Path(reference_predictive)
        return Reference(path.stem, "predictive", str(path))
    if reference is not None:
        if reference not in names:
            raise InvalidOptionError(f"the reference must name a method ({', '.join(names)}),"
                                     f" not {reference!r}")
        chosen = [entry for entry in entries if entry["name"] == reference]
    else:
        chosen = [entry for entry in entries
                  if getattr(method_info(entry["method"]), "exact", False)]
        if len(chosen) > 1:
            raise InvalidOptionError(
                f"{', '.join(e['name'] for e in chosen)} all sample the posterior exactly: "
                "name the one that is the reference (reference=, --reference)")
    if not chosen:
        return None
    if len(entries) < 2:
        raise InvalidOptionError(f"{chosen[0]['name']} is the reference: give at least one "
                                 "method to compare with it")
    chosen[0]["group"] = REFERENCE_GROUP
    return Reference(chosen[0]["name"], "collection", chosen[0]["path"])


def function_band(target_members: np.ndarray, held_out: int, splits: int,
                  seed: int) -> dict[str, Any]:
    """The function-space noise band of the target: agreement and TV of ``held_out`` of its
    checkpoints against the rest, over ``splits`` draws from ``seed``; each metric's median
    and 5th-95th percentile band."""
    from posteriorzoo.metrics import predictive_noise

    held_out = min(held_out, len(target_members) - 1)
    draws = predictive_noise(target_members, held_out, splits, seed)
    return {"held_out": held_out, "splits": splits,
            **{name: {"median": float(np.median(values)),
                      "band": [float(v) for v in np.percentile(values, BAND_PERCENTILES)]}
               for name, values in (("agreement", draws["agreement"]),
                                    ("tv", draws["total_variation"]))}}


def reference_comparisons(reference: Reference, target: Path, entries: Sequence[dict],
                          comparison: Any, **options: Any) -> dict[str, Any]:
    """MMD and NS-MMD of every other method and of the target to the reference collection:
    ``{symmetry word: CompareResult}``. The raw collections for MMD; NS-MMD on the
    canonical copies the report's comparison made (every input canonical already, so
    nothing is canonicalized again)."""
    from posteriorzoo.collection import compare

    others = [entry for entry in entries if entry["name"] != reference.name]
    results = {}
    words = {result.symmetries for result in comparison.results}
    if SYMMETRIES["keep"].word in words:
        results[SYMMETRIES["keep"].word] = compare(
            reference.path, {TARGET_NAME: target, **{e["name"]: e["path"] for e in others}},
            symmetries="keep", **options)
    copies = comparison.canonical_copies
    if SYMMETRIES["remove"].word in words and reference.name in copies:
        results[SYMMETRIES["remove"].word] = compare(
            copies[reference.name],
            {TARGET_NAME: comparison.canonical_target or target,
             **{e["name"]: copies[e["name"]] for e in others}},
            symmetries="remove", **options)
    return results


def reference_values(name: str, comparisons: Mapping[str, Any]) -> dict[str, float]:
    """``mmd_ref`` and ``ns_mmd_ref`` of the method ``name`` (layer-weighted medians)."""
    values = {}
    for word, result in comparisons.items():
        key = "mmd_ref" if word == SYMMETRIES["keep"].word else "ns_mmd_ref"
        values[key] = result.summary(name, word).median
    return values


def function_values(evaluation: Any) -> dict[str, float]:
    """The function-space columns of a method's row from its evaluation's
    ``function_space`` (against ``target`` and ``reference``)."""
    values = {}
    for name, suffix in (("target", ""), ("reference", "_ref")):
        scores = (evaluation.function_space or {}).get(name)
        if scores is not None:
            values[f"agreement{suffix}"] = scores["agreement"]
            values[f"tv{suffix}"] = scores["total_variation"]
    return values


def reference_predictives(target: Path, gold: Reference | None,
                           evaluations: dict[str, Any], predict: Callable[..., Any],
                           options: dict[str, Any], pairs: dict[str, int], *,
                           held_out: int, splits: int, seed: int) -> dict[str, Any]:
    """The predictives the methods are scored against: the target's (its checkpoints'
    predictions also give the function-space noise band) and the gold standard's (its
    collection evaluated here, as its row, into ``evaluations``, or its file read and
    checked). ``options`` and ``pairs`` are the report's evaluation options; ``held_out``,
    ``splits`` and ``seed`` size the band as the noise floor's."""
    from posteriorzoo.collection import evaluate
    from posteriorzoo.metrics import agreement, total_variation

    captured: list[np.ndarray] = []

    def capture(zoo: Any, images: Any) -> np.ndarray:
        members = predict(zoo, images)
        captured.append(members)
        return members

    # the target's predictive on the in-distribution images only (no row, no OOD)
    own = {key: options[key] for key in ("dataset", "bins", "n_images")}
    target_predictive = evaluate(target, **own, predict=capture).predictive
    band = function_band(captured[0], held_out, splits, seed)
    captured.clear()   # the target's members are not kept
    shared: dict[str, Any] = {"references": {"target": target_predictive}, "band": band}
    if gold is None:
        return shared
    if gold.kind == "collection":
        evaluation = evaluate(gold.path, **options, n_pairs=pairs.get(gold.name, 0),
                              predict=predict, references={"target": target_predictive})
        evaluations[gold.name] = evaluation
        predictive = evaluation.predictive
    else:
        predictive = _read_predictive(gold.path, options["dataset"], options["n_images"],
                                      target_predictive.shape[1])
    shared["references"]["reference"] = predictive
    shared["target_to_reference"] = {
        "agreement_ref": agreement(target_predictive, predictive),
        "tv_ref": total_variation(target_predictive, predictive)}
    return shared


def _read_predictive(path: str, dataset: str, n_images: int | None, classes: int
                     ) -> np.ndarray:
    """A reference predictive file on the whole test split of ``dataset`` (checked against
    its labels), cut to the first ``n_images`` rows as the images are."""
    from posteriorzoo.collection.reference_predictive import read_reference_predictive
    from posteriorzoo.data import load_dataset

    labels = load_dataset(dataset, "test").labels
    predictive = read_reference_predictive(path, rows=len(labels), classes=classes,
                                           labels=labels)
    return predictive[:n_images]


def _inside(value: float, band: Sequence[float]) -> str:
    return "inside" if band[0] <= value <= band[1] else "outside"


def _ordering(rows: Sequence[Mapping[str, Any]], key: str) -> str | None:
    """Whether DE < the multi-mode median < the single-mode median holds for ``key``."""
    de = [r[key] for r in rows if r.get("method") == "de" and r.get(key) is not None]
    multi = [r[key] for r in rows if r["group"] == "multi-mode" and r.get("method") != "de"
             and r.get(key) is not None]
    single = [r[key] for r in rows if r["group"] == "single-mode" and r.get(key) is not None]
    if not (de and multi and single):
        return None
    de_value, multi_median, single_median = de[0], statistics.median(multi), \
        statistics.median(single)
    holds = de_value < multi_median < single_median
    return (f"DE {_fmt(key, de_value)}, multi-mode median {_fmt(key, multi_median)}, "
            f"single-mode median {_fmt(key, single_median)}: "
            f"{'holds' if holds else 'does not hold'}")


def _fmt(key: str, value: float) -> str:
    if key.startswith(("mmd", "ns_mmd")):
        return f"{MMD_DISPLAY_SCALE * value:.2f}"
    if key.startswith("agreement"):
        return f"{100 * value:.1f}%"
    return f"{100 * value:.2f}"   # TV, x 100 as in Table 1


def _rank_correlation(rows: Sequence[Mapping[str, Any]], key: str, other: str
                      ) -> tuple[float, int] | None:
    """Spearman's rank correlation of the methods' ``key`` and ``other`` (both present)."""
    from scipy.stats import spearmanr

    pairs = [(r[key], r[other]) for r in rows
             if r.get(key) is not None and r.get(other) is not None]
    if len(pairs) < 3:
        return None
    rho = spearmanr([a for a, _ in pairs], [b for _, b in pairs]).statistic
    return float(rho), len(pairs)


def answers(reference: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
            noise: Mapping[str, Any]) -> list[str]:
    """The report's answers, one sentence each, with the numbers and their noise bands:
    how far the target is from the reference in weights and in function, which method is
    closest to it, whether the paper's ordering holds with either reference, and whether
    the symmetries explain the gap (NS-MMD against MMD)."""
    name = reference["name"]
    target = reference.get("target") or {}
    band = reference.get("function_band") or {}
    lines = []
    weights = []
    for key, word in (("mmd_ref", "keep"), ("ns_mmd_ref", "remove")):
        value, floor = target.get(key), noise.get(word)
        if value is None or floor is None:
            continue
        low, high = floor.band
        weights.append(f"{'MMD' if word == 'keep' else 'NS-MMD'} (x {MMD_DISPLAY_SCALE:g}) "
                       f"{MMD_DISPLAY_SCALE * value:.2f} ({_inside(value, (low, high))} the "
                       f"target's noise band [{MMD_DISPLAY_SCALE * low:.2f}, "
                       f"{MMD_DISPLAY_SCALE * high:.2f}])")
    function = []
    for key, label, band_key in (("agreement_ref", "agreement", "agreement"),
                                 ("tv_ref", "TV (x 100)", "tv")):
        value, spread = target.get(key), band.get(band_key)
        if value is None:
            continue
        text = f"{label} {_fmt(key, value)}"
        if spread:
            low, high = spread["band"]
            text += (f" ({_inside(value, (low, high))} the band of {band['held_out']} target "
                     f"checkpoints against the rest, [{_fmt(key, low)}, {_fmt(key, high)}])")
        function.append(text)
    if weights or function:
        lines.append(f"How far is the target from {name}? In weights: "
                     + ("; ".join(weights) or "not computed") + ". In function: "
                     + ("; ".join(function) or "not computed") + ".")
    methods = [r for r in rows if r["group"] != REFERENCE_GROUP]
    closest = []
    for key, label in (("mmd_ref", "MMD (x 100)"), ("ns_mmd_ref", "NS-MMD (x 100)"),
                       ("tv_ref", "TV (x 100)"), ("agreement_ref", "agreement")):
        scored = [r for r in methods if r.get(key) is not None]
        if not scored:
            continue
        pick = (max if key == "agreement_ref" else min)(scored, key=lambda r: r[key])
        closest.append(f"by {label}, {pick['name']} ({_fmt(key, pick[key])})")
    if closest:
        lines.append(f"Which method is closest to {name}? " + "; ".join(closest) + ".")
    orders = []
    for key, other, label in (("mmd", "mmd_ref", "MMD (x 100)"),
                              ("ns_mmd", "ns_mmd_ref", "NS-MMD (x 100)"),
                              ("tv", "tv_ref", "TV (x 100)")):
        against_target, against_reference = _ordering(methods, key), _ordering(methods, other)
        if against_reference is None:
            continue
        rho = _rank_correlation(methods, key, other)
        orders.append(f"{label}: to the target, {against_target or 'not computed'}; to "
                      f"{name}, {against_reference}"
                      + (f"; Spearman's rank correlation of the two rankings {rho[0]:.2f} "
                         f"over {rho[1]} methods" if rho else ""))
    if orders:
        lines.append("Does the paper's ordering (DE < multi-mode < single-mode) survive with "
                     f"{name} as the reference? " + ". ".join(orders) + ".")
    raw, canonical = target.get("mmd_ref"), target.get("ns_mmd_ref")
    if raw is not None and canonical is not None and noise.get("remove") is not None:
        inside = noise["remove"].contains(canonical)
        lines.append(
            f"Do the symmetries explain the gap? NS-MMD between the target and {name} is "
            f"{MMD_DISPLAY_SCALE * canonical:.2f} against MMD {MMD_DISPLAY_SCALE * raw:.2f} "
            f"({canonical / raw:.0%} of it): "
            + ("with the symmetries removed the target is inside its noise band, so they "
               "explain the gap." if inside else
               "it stays outside the noise band with the symmetries removed, so they do not "
               "explain all of it.")
            if raw > 0 else
            f"Do the symmetries explain the gap? MMD is {MMD_DISPLAY_SCALE * raw:.2f}: no gap "
            "to explain.")
    return lines
