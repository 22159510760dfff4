"""The report's tables: Table 1 (one row per method) and the Table 2 detail.

Rows are plain dicts of raw values (MMD^2, fractions in [0, 1], nats); the display
scales are applied only when a table is rendered, and each rendered table says its
scale in its caption.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posteriorzoo.text import MMD_DISPLAY_SCALE, html_text, scaled_label
from posteriorzoo.vocabulary import POSTERIOR_GROUPS, SYMMETRIES

#: Table 1's columns: (key, header, display multiplier, what the header means).
TABLE1_COLUMNS = (
    ("mmd", scaled_label(SYMMETRIES["keep"].statistic), MMD_DISPLAY_SCALE,
     f"MMD^2 x {MMD_DISPLAY_SCALE:g}, symmetries kept (layer-weighted median over kernels)"),
    ("ns_mmd", scaled_label(SYMMETRIES["remove"].statistic), MMD_DISPLAY_SCALE,
     f"MMD^2 x {MMD_DISPLAY_SCALE:g} with symmetries removed (No Symmetries)"),
    ("accuracy", "Acc", 100.0, "accuracy of the posterior predictive, %"),
    ("ece", "ECE", 100.0, "expected calibration error (top label), %"),
    ("brier", "Brier", 100.0, "Brier score x 100 (sum over classes; 0 is perfect)"),
    ("aupr", "AUPR", 100.0, "area under the precision-recall curve for OOD detection, %"),
    ("fpr95", "FPR95", 100.0, "false positive rate at 95% OOD recall, %"),
    ("idmi", "IDMI", 100.0, "mutual information on in-distribution images, nats x 100"),
    ("oodmi", "OODMI", 100.0, "mutual information on OOD images, nats x 100"),
    ("agreement", "Agree", 100.0, "agreement with the target's predictive: share of "
     "images where both pick the same class, %"),
    ("tv", "TV", 100.0, "total variation to the target's predictive (half the L1 distance, "
     "mean over images) x 100"),
)


def reference_columns(name: str, samples: bool = True
                      ) -> tuple[tuple[str, str, float, str], ...]:
    """Table 1's columns against the gold standard ``name`` (HMC): MMD and NS-MMD to its
    samples (when it has ``samples``: not a predictive file), agreement and TV with its
    predictive."""
    columns = (
        ("mmd_ref", scaled_label(f"{SYMMETRIES['keep'].statistic} to {name}"),
         MMD_DISPLAY_SCALE, f"MMD^2 x {MMD_DISPLAY_SCALE:g} to {name}'s samples, symmetries "
                            "kept"),
        ("ns_mmd_ref", scaled_label(f"{SYMMETRIES['remove'].statistic} to {name}"),
         MMD_DISPLAY_SCALE, f"MMD^2 x {MMD_DISPLAY_SCALE:g} to {name}'s samples, symmetries "
                            "removed"),
        ("agreement_ref", f"Agree {name}", 100.0, f"agreement with {name}'s predictive, %"),
        ("tv_ref", f"TV {name}", 100.0, f"total variation to {name}'s predictive x 100"),
    )
    return columns if samples else columns[2:]


def table1_columns(reference: str | None = None, samples: bool = True
                   ) -> tuple[tuple[str, str, float, str], ...]:
    """Table 1's columns: :data:`TABLE1_COLUMNS`, then those against the gold standard
    named ``reference`` when the report has one (:func:`reference_columns`)."""
    return TABLE1_COLUMNS + (reference_columns(reference, samples) if reference else ())
#: The Table 2 detail: (key, header); MMD^2 x MMD_DISPLAY_SCALE like Table 1.
TABLE2_COLUMNS = (("n", "n"), ("mmd_median", scaled_label("MMD median")),
                  ("mmd_mean", scaled_label("MMD mean")), ("mmd_max", scaled_label("MMD max")),
                  ("ns_mmd_median", scaled_label("NS-MMD median")),
                  ("ns_mmd_mean", scaled_label("NS-MMD mean")),
                  ("ns_mmd_max", scaled_label("NS-MMD max")),
                  ("rejected_layers", "layers rejected"))
GROUPS = ("reference", *POSTERIOR_GROUPS, "other")


def shown(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    """A number as the tables show it ("-" when absent)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int | bool) and scale == 1.0:
        return str(value)
    return f"{value * scale:.{digits}f}"


def _same(text: str) -> str:
    return text


def table1_rows(rows: Sequence[Mapping[str, Any]],
                escape: Callable[[str], str] = _same,
                columns: Sequence[tuple[str, str, float, str]] = TABLE1_COLUMNS
                ) -> list[list[str]]:
    """Table 1 as text cells, grouped: the gold standard, single-mode methods, then
    multi-mode ones; the method names (the user's) passed through ``escape`` (e.g.
    :func:`posteriorzoo.text.markdown_text`); ``columns`` from :func:`table1_columns`."""
    cells = []
    for group in GROUPS:
        for row in (r for r in rows if r["group"] == group):
            cells.append([escape(row["name"]), group, str(row["n"])]
                         + [shown(row.get(key), scale) for key, _, scale, _ in columns])
    return cells


def table2_rows(rows: Sequence[Mapping[str, Any]],
                escape: Callable[[str], str] = _same) -> list[list[str]]:
    """The MMD detail as text cells (MMD^2 x :data:`MMD_DISPLAY_SCALE`, four digits),
    names through ``escape``."""
    return [[escape(row["name"])] + [shown(row.get(key), 1.0 if key in ("n", "rejected_layers")
                                   else MMD_DISPLAY_SCALE, 4) for key, _ in TABLE2_COLUMNS]
            for row in rows]


def markdown_table(header: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    """A Markdown table of cells that are already Markdown (user text escaped with
    :func:`posteriorzoo.text.markdown_text`)."""
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines) + "\n"


def html_table(header: Sequence[str], cells: Sequence[Sequence[str]], *, caption: str,
               table_id: str, titles: Sequence[str] | None = None) -> str:
    """An HTML table of plain-text cells (every cell, header and caption is escaped with
    :func:`posteriorzoo.text.html_text` here); ``titles`` are tooltips of the header
    cells."""
    titles = titles or [""] * len(header)
    head = "".join(f'<th title="{html_text(t)}">{html_text(h)}</th>'
                   for h, t in zip(header, titles, strict=True))
    body = "".join("<tr>" + "".join(f"<td>{html_text(c)}</td>" for c in row) + "</tr>"
                   for row in cells)
    return (f'<table id="{html_text(table_id)}"><caption>{html_text(caption)}</caption>'
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")




def table1_header(columns: Sequence[tuple[str, str, float, str]] = TABLE1_COLUMNS
                  ) -> list[str]:
    """Table 1's header cells for ``columns``."""
    return ["Method", "Group", "n"] + [header for _, header, _, _ in columns]


def table1_titles(columns: Sequence[tuple[str, str, float, str]] = TABLE1_COLUMNS
                  ) -> list[str]:
    """The tooltips of Table 1's header cells for ``columns``."""
    return ["", "reference: the gold standard (full-batch HMC); single-mode: samples "
            "around one network; multi-mode: around 10 (DE: independent networks)",
            "samples"] + [t for *_, t in columns]

TABLE2_HEADER = ["Method"] + [header for _, header in TABLE2_COLUMNS]
