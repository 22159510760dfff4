"""Hostile names through every format they land in: HTML, Markdown, CSV, JSON, figures.

A method name comes from the user (``NAME=PATH``) or from a file (its ``method``
attribute); so does a path. Names holding matplotlib mathtext (``$\\frob{$``, once a
ParseFatalException in ``report``, ``plot mmd`` and ``plot pca``), a newline (once a broken
Markdown table row), HTML (once raw in report.md), a table's ``|`` and Markdown's ``*``
must leave every command with exit 0, tables with their rows and columns, no markup, and
the exact name in the CSV and JSON.
"""

from __future__ import annotations

import csv
import io
import json
import re
import shutil

import pytest
from matplotlib import cbook
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image
from zoo_helpers import checkpoint, run

from posteriorzoo.results import csv_text
from posteriorzoo.text import (
    html_safe_json,
    html_text,
    markdown_text,
    matplotlib_text,
    visible,
)
from posteriorzoo.zoo import create_zoo

MATHTEXT = "$\\frob{$"
NEWLINE = "a\nb"
SCRIPT = "<script>alert(1)</script>"
PIPE_STAR = "|*"
HOSTILE = [MATHTEXT, NEWLINE, SCRIPT, PIPE_STAR]
#: A collection's own ``method`` attribute, shown when no NAME= is given.
ATTRIBUTE = "<em>$x$</em>\n|_`"
MORE = ["", "\\", "x\\$y", "1. a", "- b", "# c", "[d](e)", "&lt;", "tab\there", "\u2028",
        "~~s~~", "=SUM(A1)", 'q"uote,comma']
CELL = re.compile(r"(?<!\\)\|")


def _cells(line: str) -> list[str]:
    """A Markdown table row's cells (a ``|`` escaped with a backslash is content)."""
    return CELL.split(line.strip())[1:-1]


def _table(markdown: str, header_start: str) -> list[list[str]]:
    """The rows of the Markdown table whose header row starts with ``header_start``."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    return rows


# ----------------------------------------------------------------------------- the module
@pytest.mark.parametrize("name", HOSTILE + [ATTRIBUTE] + MORE)
def test_each_format_keeps_the_name_and_drops_its_markup(name):
    shown = visible(name)
    assert not any(c in shown for c in "\n\r\t\u2028")          # one line, every character
    assert "<" not in html_text(name) and ">" not in html_text(name)
    cell = markdown_text(name)
    assert "\n" not in cell and "<" not in cell and len(_cells(f"| {cell} | x |")) == 2
    # matplotlib shows the text as it is: no mathtext, and \$ is shown as $
    escaped = matplotlib_text(name)
    assert not cbook.is_math_text(escaped)
    assert escaped.replace("\\$", "$") == shown
    # CSV: csv.reader gives back the exact name (no formula prefix added)
    text = csv_text(["name", "value"], [[name, 0.1]])
    assert list(csv.reader(io.StringIO(text, newline="")))[1] == [name, "0.1"]
    # JSON for a page: the same value, no "<"
    text = html_safe_json({"name": name})
    assert "<" not in text and json.loads(text) == {"name": name}


@pytest.mark.parametrize("name", HOSTILE + [ATTRIBUTE])
def test_escaped_names_render_in_titles_legends_and_ticks(name):
    figure = Figure()
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    ax.plot([0, 1], [0, 1], label=matplotlib_text(name))
    ax.set_title(matplotlib_text(name))
    ax.set_xticks([0, 1], [matplotlib_text(name), "x"])
    ax.legend()
    figure.canvas.draw()        # mathtext would raise here
    assert ax.get_title() == matplotlib_text(name)


# ------------------------------------------------------------------------- the commands
def _collection(path, seeds, method="de"):
    states = [checkpoint(seed) for seed in seeds]
    with create_zoo(path, architecture="optunet", dataset="digits", method=method,
                    num_classes=10, template=states[0]) as zoo:
        zoo.append_many(states)
    return path


@pytest.fixture(scope="module")
def zoos(tmp_path_factory):
    """A 12-checkpoint target, one 4-member method per hostile name (each its own file:
    the canonical copies are named by file), and one whose method attribute is hostile."""
    folder = tmp_path_factory.mktemp("hostile")
    target = _collection(folder / "target.h5", range(12))
    method = _collection(folder / "method.h5", range(100, 104))
    named = {}
    for number, name in enumerate(HOSTILE):
        named[name] = folder / f"m{number}.h5"
        shutil.copyfile(method, named[name])
    attribute = _collection(folder / "attribute.h5", range(200, 204), method=ATTRIBUTE)
    return {"target": target, "named": named, "attribute": attribute, "folder": folder}


def _arguments(zoos) -> list[str]:
    return [f"{name}={path}" for name, path in zoos["named"].items()] + [str(zoos["attribute"])]


def _no_markup(*texts: str) -> None:
    for text in texts:
        assert "<script" not in text.lower() and "<em" not in text


def test_report_with_hostile_names(zoos, tmp_path, capsys):
    out = tmp_path / "report"
    code, printed, err = run(capsys, "report", zoos["target"], *_arguments(zoos), "--out", out,
                             "--n-images", "30", "--splits", "2", "--n-pairs", "3",
                             "--no-progress")
    assert code == 0, err
    names = [*HOSTILE, ATTRIBUTE]                  # the attribute's own name (no label)
    markdown = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    _no_markup(markdown, page, printed)
    for text in (markdown, printed):
        table = _table(text, "| Method |")
        assert len(table) == 2 + len(names) + 2       # header, rule, methods, noise rows
        assert {len(row) for row in table} == {len(table[0])}
        assert sorted(row[0].strip() for row in table[2:2 + len(names)]) == \
            sorted(markdown_text(name) for name in names)
        detail = _table(text, "| Method | n | MMD median") if text is markdown else None
        assert detail is None or len(detail) == 2 + len(names)
    assert html_text(SCRIPT) in page and html_text(NEWLINE) in page
    with open(out / "table1.csv", newline="") as table1:
        assert sorted(row["name"] for row in csv.DictReader(table1)) == sorted(names)
    data = json.loads((out / "report.json").read_text())
    assert sorted(row["name"] for row in data["rows"]) == sorted(names)
    for name in ("mmd", "pca"):
        Image.open(out / "figures" / f"{name}.png").verify()
        assert (out / "figures" / f"{name}.pdf").stat().st_size > 1000


@pytest.mark.parametrize("figure", ["mmd", "pca"])
def test_plot_with_hostile_names(zoos, tmp_path, capsys, figure):
    words = ([zoos["target"], *_arguments(zoos)] if figure == "mmd"
             else [f"{MATHTEXT}={zoos['target']}", *_arguments(zoos)[1:]])
    extra = ["--noise-splits", "2"] if figure == "mmd" else []
    code, out, err = run(capsys, "plot", figure, *words, *extra, "--out", tmp_path / figure,
                         "--json")
    assert code == 0, err
    numbers = json.loads(out)["numbers"]
    names = set(numbers["per_layer"] if figure == "mmd" else numbers["curves"])
    expected = {*HOSTILE[1:], "attribute"} | ({HOSTILE[0]} if figure == "mmd" else {MATHTEXT})
    assert names == expected
    Image.open(tmp_path / f"{figure}.png").verify()
    assert (tmp_path / f"{figure}.pdf").stat().st_size > 1000


def test_mmd_with_hostile_names(zoos, tmp_path, capsys):
    out = tmp_path / "mmd"
    code, printed, err = run(capsys, "mmd", zoos["target"], *_arguments(zoos), "--out", out,
                             "--symmetries", "keep", "--no-progress")
    assert code == 0, err
    markdown = (out / "mmd_report.md").read_text()
    _no_markup(markdown, printed)
    names = [*HOSTILE, "attribute"]                # mmd names an unnamed file by its stem
    summary = _table(markdown, "| Method | n |")
    assert len(summary) == 2 + len(names) and {len(row) for row in summary} == {4 + 1}
    layers = _table(markdown, "| Method | Layer |")
    assert len(layers) == 2 + 4 * len(names) and {len(row) for row in layers} == {6}
    with open(out / "mmd_summary.csv", newline="") as table:
        assert sorted(row["method"] for row in csv.DictReader(table)) == sorted(names)
    report = json.loads((out / "mmd_report.json").read_text())
    assert sorted({row["method"] for row in report["layers"]}) == sorted(names)
