"""The report as one self-contained HTML page (figures embedded as PNG) and as Markdown.

Every string the user controls (method names, paths, dataset and architecture names) goes
through :mod:`posteriorzoo.text` for the format it lands in: ``html_text`` on the page,
``markdown_text`` in report.md and the printed Table 1; the provenance is JSON with
``< > &`` escaped (``html_safe_json``), so no markup of a name reaches either file.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from analysis.report import tables
from posteriorzoo.text import (
    MMD_DISPLAY_SCALE,
    html_safe_json,
    html_text,
    markdown_text,
    scaled_label,
)
from posteriorzoo.vocabulary import SYMMETRIES

if TYPE_CHECKING:
    from analysis.report.build import ReportResult

_STYLE = """
body { font-family: sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
caption { text-align: left; font-size: 0.9em; color: #444; padding-bottom: 0.4em; }
th, td { border: 1px solid #bbb; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
tr.noise td { background: #eef3fb; font-style: italic; }
.note { background: #f7f7f2; border-left: 4px solid #99a; padding: 0.6em 1em; }
.warning { background: #fdf3e1; border-left: 4px solid #d89b2b; padding: 0.6em 1em; }
summary { cursor: pointer; color: #444; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.9em; color: #444; }
pre { background: #f4f4f4; padding: 0.8em; overflow-x: auto; font-size: 0.8em; }
"""

FIGURE_CAPTIONS = {
    "marginals": "Layer marginals of the target: one weight position per unit, raw "
                 "(symmetries kept) and canonical (symmetries removed). Two-sample "
                 "Kolmogorov-Smirnov p-values between units: Proposition 1 says the raw "
                 "marginals are equal (large p-values); removing the permutation symmetry "
                 "separates them (small p-values). Paper Fig. 9.",
    "mass": "Mass (sum of squared weights) of every target checkpoint before and after "
            "min-mass, and each layer's largest absolute weight. Paper Fig. 2.",
    "collapse": "Functional collapse: mutual information (nats) of pairs of members, on "
                "in-distribution and OOD images, and their scatter with Pearson's r. "
                "Paper Figs. 3 and 7.",
    "mmd": "Median MMD^2 per layer and method, symmetries kept; the shaded band is the "
           "noise floor (5th to 95th percentile of the target against held-out draws of "
           "itself).",
    "ns-mmd": "The same with symmetries removed (NS-MMD, canonical forms).",
    "pca": "Cumulative explained variance of the weights' principal components, per "
           "collection (stored weights).",
}


def _noise_rows(report: ReportResult) -> list[list[str]]:
    """Two reference rows of Table 1: the target's halves and the noise band (of MMD,
    NS-MMD, and agreement and TV with the target's predictive)."""
    keep, remove = report.noise.get("keep"), report.noise.get("remove")
    columns = report.columns()
    function = report.function_noise or {}

    def function_cells(band: bool) -> list[str]:
        cells = []
        for key, _, scale, _ in columns[2:]:
            spread = function.get(key)
            if spread is None:
                cells.append("-")
            elif band:
                low, high = spread["band"]
                cells.append(f"[{scale * low:.2f}, {scale * high:.2f}]")
            else:
                cells.append("-")
        return cells

    def band(noise: Any) -> str:
        if noise is None:
            return "-"
        low, high = noise.band
        return f"[{MMD_DISPLAY_SCALE * low:.3f}, {MMD_DISPLAY_SCALE * high:.3f}]"

    def halves(noise: Any) -> str:
        return "-" if noise is None else f"{MMD_DISPLAY_SCALE * noise.halves['median']:.3f}"

    any_noise = keep or remove
    split_n = any_noise.held_out if any_noise else 0
    half_n = any_noise.halves["n"] if any_noise else 0
    return [["target halves", "noise floor", str(half_n), halves(keep), halves(remove)]
            + function_cells(band=False),
            ["target splits (5-95%)", "noise floor", str(split_n), band(keep), band(remove)]
            + function_cells(band=True)]


def _same(text: str) -> str:
    return text


def noise_floor_warning(report: ReportResult) -> str | None:
    """A sentence when the target holds too few checkpoints for its noise floor to say much
    (:func:`posteriorzoo.mmd.small_target_warning`), else None."""
    from posteriorzoo.mmd import small_target_warning

    noise = next(iter(report.noise.values()), None)
    return None if noise is None else small_target_warning(report.target["n"],
                                                           noise.held_out)


def _verdicts(report: ReportResult, escape: Callable[[str], str] = _same) -> list[str]:
    """One line per method: is its MMD inside the noise band? Names through ``escape``."""
    lines = []
    for row in report.rows:
        parts = []
        for key, setting in (("mmd", SYMMETRIES["keep"]), ("ns_mmd", SYMMETRIES["remove"])):
            noise, value = report.noise.get(setting.word), row.get(key)
            if noise is None or value is None:
                continue
            inside = noise.contains(value)
            parts.append(f"{scaled_label(setting.statistic)} {MMD_DISPLAY_SCALE * value:.3f} is "
                         f"{'inside' if inside else 'outside'} the noise band")
        spread, value = (report.function_noise or {}).get("tv"), row.get("tv")
        if spread is not None and value is not None:
            low, high = spread["band"]
            parts.append(f"TV (x 100) {100 * value:.2f} is "
                         f"{'inside' if low <= value <= high else 'outside'} its band")
        if parts:
            lines.append(f"{escape(row['name'])}: " + "; ".join(parts))
    return lines


def _captions(report: ReportResult, escape: Callable[[str], str] = _same
              ) -> tuple[str, str]:
    """The captions of Table 1 and of the Table 2 detail; dataset names through
    ``escape``."""
    data = report.datasets
    images = data.get("images") or {}
    ood = (f"OOD: {escape(data['ood'])} ({images.get('ood', 0)} images, score "
           f"{data['ood_score']})" if data.get("ood") else "no OOD set")
    metrics = (("Predictive metrics of each "
                f"collection's posterior predictive (average softmax) on {escape(data['id'])} "
                f"({images.get('id', 0)} images; ECE with {data['bins']} bins); {ood}. "
                f"Acc, ECE, AUPR, FPR95 in %; Brier x 100; IDMI and OODMI in nats x 100; "
                "Agree (agreement: images where the method's and the target's predictives "
                "pick the same class) in %, TV (total variation between them) x 100. ")
               if data.get("predictions", True) else
               "A weights-only report (no predictions): the predictive metrics are not "
               "computed. ")
    gold = report.reference
    versus = ""
    if gold:
        source = ("its samples and predictive" if gold["kind"] == "collection"
                  else f"a predictive read from {escape(gold['path'])}")
        versus = (f"Columns named {escape(gold['name'])}: the same against the gold "
                  f"standard {escape(gold['name'])} ({source}); its row is the group "
                  "reference. ")
    table1 = (f"Table 1. MMD and NS-MMD: layer-weighted median over the 20 MMDAgg kernels "
              f"of the unbiased MMD^2 to the target, x {MMD_DISPLAY_SCALE:g}. {metrics}"
              f"{versus}Blue rows: the target against itself (the noise floor).")
    table2 = ("Table 2 detail: the median, mean and maximum over the 20 kernels, each "
              f"averaged over layers with their parameter counts, MMD^2 x {MMD_DISPLAY_SCALE:g}; "
              "n is the "
              "method's number of samples (the target has "
              f"{report.target['n']}).")
    return table1, table2


def html_page(report: ReportResult) -> str:
    """The self-contained HTML page."""
    caption1, caption2 = _captions(report)
    columns = report.columns()
    table1 = tables.html_table(tables.table1_header(columns),
                               tables.table1_rows(report.rows, columns=columns),
                               caption=caption1, table_id="table1",
                               titles=tables.table1_titles(columns))
    noise_html = "".join('<tr class="noise">' + "".join(f"<td>{html_text(c)}</td>"
                                                        for c in row) + "</tr>"
                         for row in _noise_rows(report))
    table1 = table1.replace("</tbody>", noise_html + "</tbody>")
    table2 = tables.html_table(tables.TABLE2_HEADER, tables.table2_rows(report.rows),
                               caption=caption2, table_id="table2")
    figures = "".join(
        f'<figure id="figure-{name}"><img alt="{name}" src="data:image/png;base64,'
        f'{base64.b64encode(report.figure_png(name)).decode("ascii")}"><figcaption>'
        f"{html_text(FIGURE_CAPTIONS.get(name, name))} "
        f"{html_text(report.figure_notes.get(name, ''))} (PDF: figures/{name}.pdf)"
        "</figcaption></figure>" for name in report.figures)
    verdicts = "".join(f"<li>{html_text(line)}</li>" for line in _verdicts(report))
    warning = noise_floor_warning(report)
    warning = f'<p class="warning" id="noise-warning">{html_text(warning)}</p>' if warning else ""
    provenance = html_text(html_safe_json(report.provenance, indent=1, default=str))
    target = report.target
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>posteriorzoo report: {html_text(target['path'])}</title>
<style>{_STYLE}</style></head><body>
<h1>How close is each approximate posterior to the target?</h1>
<p>Target: <code>{html_text(target['path'])}</code>, {target['n']} checkpoints of
{html_text(target['architecture'])} trained on {html_text(target['dataset'])}.</p>
<div class="note"><p><b>How to read this page.</b> <b>MMD</b> is the maximum mean
discrepancy between a method's samples and the target's checkpoints, layer by layer, as
the unbiased estimate of MMD<sup>2</sup> (it can be slightly negative when the two are
alike), shown x {MMD_DISPLAY_SCALE:g}. <b>NS-MMD</b> ("no symmetries") is the same after every
collection
is put in canonical form: permutations of hidden units sorted, ReLU scalings normalised,
the softmax shift removed, so that checkpoints which compute the same function compare
as equal. The <b>noise floor</b> is the same statistic between disjoint draws of the
target itself: a method whose value lies inside the band cannot be told from another
draw of the target with as many samples. Lower is better for MMD, ECE, Brier, FPR95;
higher for accuracy and AUPR.</p></div>
<h2>Table 1</h2>
{warning}
{table1}
<ul id="verdicts">{verdicts}</ul>
{_answers_html(report)}
<h2>MMD detail (Table 2)</h2>
{table2}
{_tests_html(report)}
{_diagnostics_html(report)}
<h2>Figures</h2>
{figures}
<h2>Provenance</h2>
<details><summary>The command, library versions, git commit, seeds and the SHA-256 of
every input (JSON; also in report.json)</summary>
<pre id="provenance">{provenance}</pre>
</details>
</body></html>
"""


def markdown_page(report: ReportResult) -> str:
    """The same tables as Markdown, with the figures linked."""
    caption1, caption2 = _captions(report, markdown_text)
    columns = report.columns()
    rows1 = tables.table1_rows(report.rows, markdown_text, columns) + _noise_rows(report)
    warning = noise_floor_warning(report)
    lines = [f"# posteriorzoo report: {markdown_text(report.target['path'])}", "", caption1,
             *([f"> **Warning.** {warning}", ""] if warning else [""]),
             tables.markdown_table(tables.table1_header(columns), rows1),
             *[f"- {line}" for line in _verdicts(report, markdown_text)], "",
             *_answers_markdown(report), caption2, "",
             tables.markdown_table(tables.TABLE2_HEADER,
                                   tables.table2_rows(report.rows, markdown_text)),
             *_diagnostics_markdown(report)]
    lines += [f"![{name}](figures/{name}.png)\n\n{FIGURE_CAPTIONS.get(name, name)}\n"
              for name in report.figures]
    lines += ["## Provenance", "", "```json",
              html_safe_json(report.provenance, indent=1, default=str), "```", ""]
    return "\n".join(lines)


def table1_text(report: ReportResult) -> str:
    """Table 1 with its noise rows and verdicts, as printed by ``posteriorzoo report``."""
    caption, _ = _captions(report, markdown_text)
    warning = noise_floor_warning(report)
    columns = report.columns()
    return "\n".join([caption, "", tables.markdown_table(
        tables.table1_header(columns), tables.table1_rows(report.rows, markdown_text, columns)
        + _noise_rows(report)), *_verdicts(report, markdown_text),
        *([f"warning: {warning}"] if warning else []),
        *_answers_markdown(report)])


def _answers(report: ReportResult) -> list[str]:
    return list((report.reference or {}).get("answers") or [])


def _answers_title(report: ReportResult) -> str:
    return f"The target against the gold standard ({report.reference['name']})"


def _answers_html(report: ReportResult) -> str:
    """The section answering how far the target is from the gold standard."""
    lines = _answers(report)
    if not lines:
        return ""
    items = "".join(f"<li>{html_text(line)}</li>" for line in lines)
    return f'<h2>{html_text(_answers_title(report))}</h2><ul id="reference">{items}</ul>'


def _answers_markdown(report: ReportResult) -> list[str]:
    lines = _answers(report)
    if not lines:
        return []
    return ["", f"## {markdown_text(_answers_title(report))}", "",
            *[f"- {markdown_text(line)}" for line in lines], ""]


DIAGNOSTICS_CAPTION = (
    "Diagnostics (posteriorzoo diagnose): what each collection's samples say, whatever its "
    "method promises. Chains: effective sample size and rank-normalised split R-hat per "
    "weight (ArviZ; flags below half the draws and above 1.05), lag-1 autocorrelation, the "
    "distance between the halves of each chain in standard deviations, and the recorded "
    "kinetic temperature (flag above 1.1 x the exact chain's). Variational: the samples' "
    "sigma against its initial value (flag within a factor 1.25 in every layer).")


def _diagnostics_cells(report: ReportResult) -> list[list[str]]:
    return [[d["name"], "; ".join(d["flags"]) or "none", d["summary"]]
            for d in report.diagnostics]


def _diagnostics_html(report: ReportResult) -> str:
    if not report.diagnostics:
        return ""
    return "<h2>Diagnostics</h2>" + tables.html_table(
        ["Method", "Flags", "What the samples say"], _diagnostics_cells(report),
        caption=DIAGNOSTICS_CAPTION, table_id="diagnostics")


def _diagnostics_markdown(report: ReportResult) -> list[str]:
    if not report.diagnostics:
        return []
    cells = [[markdown_text(cell) for cell in row] for row in _diagnostics_cells(report)]
    return ["", "## Diagnostics", "", DIAGNOSTICS_CAPTION, "",
            tables.markdown_table(["Method", "Flags", "What the samples say"], cells)]


def _tests_html(report: ReportResult) -> str:
    """The MMDAgg test per method, symmetry setting and layer (with --test)."""
    if not report.tests:
        return ""
    cells = [[t["method"], t["symmetries"], t["layer"], "reject" if t["reject"] else "keep",
              f"{t['min_p_value']:.4f}"] for t in report.tests]
    alpha = report.tests[0]["alpha"]
    return "<h2>MMDAgg test</h2>" + tables.html_table(
        ["Method", "symmetries", "layer", "decision", "min p-value"], cells, table_id="tests",
        caption=f"The aggregated MMD test (Schrab et al.) at level {alpha} per layer: reject "
                "means the method's samples and the target's differ; min p-value is the "
                "smallest over the 20 kernels (each kernel's threshold is corrected for "
                "the aggregation).")
