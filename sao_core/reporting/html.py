"""HTML helpers shared by the reports: the style sheet, tables, number formats and the page frame.

Every report is one self-contained HTML file: inline CSS and SVG, no scripts that run, no network."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

CSS = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1100px; color: #222; padding: 0 16px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ccc; }
h3 { font-size: 15px; margin-top: 20px; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f2f4f7; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.up { color: #1d7a35; } .down { color: #b8323a; } .muted { color: #777; }
code { font-size: 12px; } svg.chart { display: block; margin: 8px 0 16px; max-width: 100%; height: auto; }
details { margin: 8px 0; } summary { cursor: pointer; }
"""


class Raw(str):
    """Cell text that is already HTML."""


def pct(value: Any) -> str:
    return "–" if value is None else f"{100 * float(value):.1f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Sequence[int] = (), cls: str = "") -> str:
    """An HTML table; cells are escaped unless they are :class:`Raw`; columns in `numeric` align right."""
    head = "".join(f"<th>{escape(str(h))}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            text = cell if isinstance(cell, Raw) else escape(str(cell))
            cells.append(f'<td class="num">{text}</td>' if i in numeric else f"<td>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def page(title: str, body: Sequence[str], extra_css: str = "") -> str:
    """A whole HTML document: `title`, the shared style sheet (plus `extra_css`) and the body parts."""
    return "\n".join(["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
                      f"<title>{escape(title)}</title><style>{CSS}{extra_css}</style></head><body>",
                      *[part for part in body if part], "</body></html>"])
