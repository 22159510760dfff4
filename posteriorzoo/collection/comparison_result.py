"""The result of comparing collections: CSV, JSON and a Markdown table like Table 2."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posteriorzoo.mmd.comparison import Comparison, LayerResult, MethodSummary
from posteriorzoo.results import CollectionResult, csv_text
from posteriorzoo.text import MMD_DISPLAY_SCALE, markdown_text, scaled_label
from posteriorzoo.vocabulary import KERNEL_STATISTICS, SYMMETRIES

__all__ = ["FILE_NAMES", "CompareResult"]

#: The files :meth:`CompareResult.write` puts in its folder.
FILE_NAMES = ("mmd_report.json", "mmd_layers.csv", "mmd_summary.csv", "mmd_report.md")


@dataclass
class CompareResult(CollectionResult):
    """A :class:`~posteriorzoo.mmd.comparison.Comparison` with its provenance and writers.

    Files (:meth:`write`): ``mmd_report.json`` (every number and the provenance),
    ``mmd_layers.csv`` (one row per method, symmetry setting and layer with all 20 values and
    bandwidths), ``mmd_summary.csv`` (one row per method and symmetry setting, with m and n) and
    ``mmd_report.md`` (the Table-2 layout, the per-layer figures, the provenance). The CSV
    files are plain tables: pandas reads them as they are. CSV and JSON hold raw MMD^2;
    the Markdown shows it multiplied by ``scale`` (default
    :data:`~posteriorzoo.text.MMD_DISPLAY_SCALE`, recorded in the JSON as
    ``display_scale``). :meth:`to_frame` gives the per-layer rows (``to_frame("summary")``
    the per-method ones).

    ``canonical_target`` and ``canonical_copies`` (method name -> path) are the canonical
    copies :func:`~posteriorzoo.collection.compare` made for NS-MMD when it was asked to
    keep them (``canonical_dir``); None and empty otherwise.
    """

    kind = "mmd_report"
    frame_tables = ("layers",)
    comparison: Comparison
    scale: float = MMD_DISPLAY_SCALE
    canonical_target: Path | None = None
    canonical_copies: dict[str, Path] = field(default_factory=dict)

    # The comparison's own API, so a report reads like the numbers it holds.
    @property
    def results(self) -> list[LayerResult]:
        return self.comparison.results

    @property
    def methods(self) -> list[str]:
        return self.comparison.methods

    def summaries(self) -> list[MethodSummary]:
        return self.comparison.summaries()

    def summary(self, method: str, symmetries: str | None = None) -> MethodSummary:
        """One method's figures (:meth:`Comparison.summary
        <posteriorzoo.mmd.comparison.Comparison.summary>`: ``symmetries`` defaults to
        ``"keep"`` if it was computed, else ``"remove"``)."""
        return self.comparison.summary(method, symmetries)

    def size_text(self, data: Mapping[str, Any] | None = None) -> str:
        return self.comparison.size_text()

    def payload(self) -> dict[str, Any]:
        data = self.comparison.to_dict()
        # the values stay raw; the factor the Markdown (and the printed table) shows them by
        return {**{key: data.pop(key) for key in ("kernels", "statistic")},
                "display_scale": self.scale, **data}

    def tables(self) -> dict[str, str]:
        return {"mmd_layers.csv": self.layers_csv(), "mmd_summary.csv": self.summary_csv(),
                "mmd_report.md": self.to_markdown()}

    def layers_csv(self) -> str:
        """One row per method, symmetry setting and layer, with all 20 values."""
        count = len(self.comparison.kernels) // 2
        names = [f"laplace_{i + 1}" for i in range(count)] + \
                [f"gaussian_{i + 1}" for i in range(count)]
        header = ["method", "symmetries", "layer", "keys", "parameters", "m", "n",
                  "median", "mean", "max", *[f"mmd2_{k}" for k in names],
                  *[f"bandwidth_{k}" for k in names]]
        tested = any(r.test is not None for r in self.results)
        if tested:
            header += ["mmdagg_reject", "mmdagg_min_p_value", "mmdagg_u"]
        rows = []
        for r in self.results:
            row = [r.method, r.symmetries, r.layer, " ".join(r.keys), r.parameters,
                   r.mmd.m, r.mmd.n, r.median, r.mean, r.max,
                   *[float(v) for v in r.mmd.values], *[float(v) for v in r.mmd.bandwidths]]
            if tested:
                row += ([int(r.test.reject), float(r.test.p_values.min()), float(r.test.u)]
                        if r.test is not None else ["", "", ""])
            rows.append(row)
        return csv_text(header, rows)

    def summary_csv(self) -> str:
        """One row per method and symmetry setting: the weighted means over layers."""
        return csv_text(
            ["method", "symmetries", "m", "n", "layers", "parameters", "median", "mean",
             "max", "mmdagg_rejected_layers"],
            ([s.method, s.symmetries, s.m, s.n, s.layers, s.parameters, s.median, s.mean,
              s.max, "" if s.rejected_layers is None else s.rejected_layers]
             for s in self.summaries()))

    def to_markdown(self, scale: float | None = None, digits: int = 4) -> str:
        """A table laid out like the paper's Table 2, the per-layer figures, provenance.

        Parameters
        ----------
        scale : float, optional
            Multiply every MMD^2 by this in the tables (default: the report's ``scale``,
            :data:`~posteriorzoo.text.MMD_DISPLAY_SCALE`); every header says it, the CSV
            and JSON keep the raw values.
        digits : int
            Decimals shown.
        """
        scale = self.scale if scale is None else scale
        settings = self.comparison.symmetry_settings()
        summaries = {(s.method, s.symmetries): s for s in self.summaries()}

        def cell(value: float) -> str:
            return f"{value * scale:.{digits}f}"

        factor = "" if scale == 1 else f" x {scale:g}"
        lines = ["# MMD of approximate posteriors to the target posterior", ""]
        target = self.provenance.get("inputs", {}).get("target")
        if target:
            lines.append(f"Target: {markdown_text(target.get('path'))} "
                         f"({target.get('checkpoints')} samples).")
        lines += [
            "",
            f"Values: unbiased MMD^2{factor}. Per layer the median, mean and max over the "
            f"{len(self.comparison.kernels)} MMDAgg kernels "
            f"({len(self.comparison.kernels) // 2} Laplace, "
            f"{len(self.comparison.kernels) // 2} Gaussian); per method the mean of each over "
            "layers, weighted by the layers' parameter counts. MMD keeps the weight-space "
            "symmetries; NS-MMD compares canonical forms (symmetries removed). n: the "
            "method's samples.",
            ""]
        head = ["Method", "n"]
        for t in settings:
            head += [scaled_label(f"{SYMMETRIES[t].statistic} {stat}", scale)
                     for stat in KERNEL_STATISTICS]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|---" + "|---:" * (len(head) - 1) + "|")
        for method in self.methods:
            sizes = [s.n for (name, _), s in summaries.items() if name == method]
            row = [markdown_text(method), str(sizes[0]) if sizes else "/"]
            for t in settings:
                s = summaries.get((method, t))
                row += [cell(getattr(s, stat)) if s else "/" for stat in
                        KERNEL_STATISTICS]
            lines.append("| " + " | ".join(row) + " |")
        lines += ["", "## Per layer", ""]
        tested = any(r.test is not None for r in self.results)
        head = ["Method", "Layer", "Parameters"]
        for t in settings:
            head += [scaled_label(f"{SYMMETRIES[t].statistic} {stat}", scale)
                     for stat in KERNEL_STATISTICS]
            if tested:
                head.append(f"{SYMMETRIES[t].statistic} MMDAgg")
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|---|---" + "|---:" * (len(head) - 2) + "|")
        index = {(r.method, r.symmetries, r.layer): r for r in self.results}
        layer_order = list(dict.fromkeys((r.layer, r.parameters) for r in self.results))
        for method in self.methods:
            for layer, parameters in layer_order:
                row = [markdown_text(method), markdown_text(layer), str(parameters)]
                for t in settings:
                    r = index.get((method, t, layer))
                    row += [cell(getattr(r, stat)) if r else "/" for stat in
                            KERNEL_STATISTICS]
                    if tested:
                        row.append("/" if r is None or r.test is None else
                                   f"{'reject' if r.test.reject else 'accept'} "
                                   f"(min p {r.test.p_values.min():.3g})")
                lines.append("| " + " | ".join(row) + " |")
        lines += ["", "## Provenance", ""]
        # names and paths are the user's: each line as Markdown text, no markup
        lines += [f"- {markdown_text(line)}" for line in provenance_lines(self.provenance)]
        return "\n".join(lines) + "\n"


def provenance_lines(provenance: Mapping[str, Any]) -> list[str]:
    """Human-readable provenance, one fact per line (for the Markdown)."""
    lines = []
    for key in ("command", "created_at", "git_commit"):
        if provenance.get(key):
            lines.append(f"{key.replace('_', ' ')}: {provenance[key]}")
    if provenance.get("versions"):
        lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in
                                              provenance["versions"].items()))
    for role, item in provenance.get("inputs", {}).items():
        digest = f" sha256 {item['sha256']}" if item.get("sha256") else ""
        lines.append(f"{role}: {item.get('path')}{digest} ({item.get('checkpoints')} samples)")
    for key in ("seeds", "options", "canonicalizer", "warnings"):
        if provenance.get(key):
            lines.append(f"{key}: {json.dumps(provenance[key], sort_keys=True)}")
    return lines
