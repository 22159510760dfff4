"""User-controlled text (method names, paths, file attributes, dataset names) made safe
for each format it lands in: one function per format.

A name is the user's: ``NAME=PATH`` on the command line, a collection's ``method``
attribute, a file's path. It may hold anything, ``$\\frob{$``, a newline,
``<script>``, ``|``. Each writer passes it through the function of its format:

- :func:`html_text`: HTML text or attribute value (``& < > " '`` as entities).
- :func:`markdown_text`: Markdown inline text and table cells: the characters Markdown
  or a GitHub-style table would read (``\\ ` * _ [ ] | ~ $ #`` and a leading ``- + =``
  or number) are backslash-escaped, ``& < >`` become entities, so no HTML passes
  through.
- :func:`matplotlib_text`: a figure's titles, labels, ticks and legends. matplotlib
  reads a string with an even number of unescaped ``$`` as mathtext (``$\\frob{$`` is a
  ParseFatalException); each ``$`` becomes ``\\$``, which matplotlib shows as ``$`` (and
  a backslash outside mathtext is shown as it is). Figures use matplotlib's default
  ``text.usetex = False``.
- CSV: :func:`posteriorzoo.results.csv_text` writes every table; the ``csv`` module quotes
  what needs quoting (commas, quotes, newlines), so ``csv.reader`` gives back the exact
  name. Spreadsheet formula prefixes (``= + - @``) are deliberately *not* neutralised:
  the CSV files are data for programs (pandas, scripts) that must get back the exact name
  the JSON holds, and a prefixed quote would change every name that starts with ``-``;
  open them in a spreadsheet with the columns as text.

Control characters (newlines, tabs, ...) cannot be shown in a table row, a legend line
or an HTML cell: :func:`visible` shows each as its escape (a newline as ``\\n``), and the
HTML, Markdown and matplotlib functions apply it first. JSON (``json.dumps``) and CSV
keep the exact text.
"""

from __future__ import annotations

import html
import json
import unicodedata
from typing import Any

__all__ = ["MMD_DISPLAY_SCALE", "html_safe_json", "html_text", "markdown_text",
           "matplotlib_text", "scaled_label", "visible"]

#: MMD^2 values are shown multiplied by this wherever a person reads them (``posteriorzoo
#: mmd``'s table, ``report``, ``plot mmd``), as the paper's Table 1 shows them; each
#: header says so (:func:`scaled_label`). CSV and JSON keep the raw values and record
#: the factor as ``display_scale``.
MMD_DISPLAY_SCALE = 100

# Characters with a meaning in Markdown inline text or in a GitHub-style table cell.
_MARKDOWN_SPECIAL = set("\\`*_[]|~$#")
_MARKDOWN_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
# Characters that start a list item, a heading underline or an ordered list at the start
# of a line (a name may begin a list item's text).
_MARKDOWN_LEADING = set("-+=")


def visible(text: object) -> str:
    """``str(text)`` with every control, line- or paragraph-separator character shown as
    Python writes it in a string literal (a newline as the two characters ``\\n``, a
    bell as ``\\x07``, U+2028 as ``\\u2028``): plain ASCII, which every font has."""
    return "".join(repr(character)[1:-1]
                   if unicodedata.category(character) in ("Cc", "Zl", "Zp") else character
                   for character in str(text))


def html_text(text: object) -> str:
    """``text`` as HTML text or a quoted attribute value: visible, entities escaped."""
    return html.escape(visible(text), quote=True)


def markdown_text(text: object) -> str:
    """``text`` as Markdown inline text or a table cell: one line, no markup, no HTML."""
    shown = visible(text)
    escaped = []
    for position, character in enumerate(shown):
        if character in _MARKDOWN_ENTITIES:
            escaped.append(_MARKDOWN_ENTITIES[character])
        elif character in _MARKDOWN_SPECIAL or (position == 0
                                                and character in _MARKDOWN_LEADING):
            escaped.append("\\" + character)
        else:
            escaped.append(character)
    result = "".join(escaped)
    # "1. x" or "1) x" at the start of a line is an ordered list
    digits = len(result) - len(result.lstrip("0123456789"))
    if digits and result[digits:digits + 1] in (".", ")"):
        result = result[:digits] + "\\" + result[digits:]
    return result


def matplotlib_text(text: object) -> str:
    """``text`` for a matplotlib title, label, tick or legend: shown as it is, never parsed
    as mathtext."""
    return visible(text).replace("$", "\\$")


def html_safe_json(value: Any, **options: Any) -> str:
    """``json.dumps(value, **options)`` with ``< > &`` written as ``\\u003c``, ``\\u003e``,
    ``\\u0026``: the same JSON, which no HTML or Markdown renderer reads as markup (for
    provenance embedded in a page)."""
    text = json.dumps(value, **options)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def scaled_label(label: str, scale: float = MMD_DISPLAY_SCALE) -> str:
    """A header for values shown multiplied by ``scale``: ``"MMD (x 100)"`` (``label``
    alone for a scale of 1)."""
    return label if scale == 1 else f"{label} (x {scale:g})"
