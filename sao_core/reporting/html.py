"""HTML helpers shared by the reports: the style sheet, tables, number formats, the page frame, and the
few functions every value written into a report goes through.

Every report is one self-contained HTML file: inline CSS and SVG, no scripts that run, no network. KFP shows
it to everyone who can see the run, and its text comes from files a run writes (metric names, paths, data
set rows), so nothing from those files reaches the page except through :func:`esc` (text and attribute
values), :func:`slug` (element ids), :func:`script_json` (JSON data blocks) and :func:`safe_href` (links).
Each page also carries a Content-Security-Policy (:func:`csp_meta`) that runs no script and loads nothing,
so a mistake in one of them still cannot run code."""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re
from collections.abc import Sequence
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
ul.constant { columns: 2 320px; font-size: 13px; margin: 4px 0 16px; padding-left: 20px; }
ul.constant li { break-inside: avoid; } p.zero { font-size: 14px; }
table.inner { margin: 0; font-size: 12px; } table.inner th, table.inner td { padding: 1px 6px; }
"""


class Raw(str):
    """Cell text that is already HTML."""


# ----------------------------------------------------------------------------- escaping
def esc(value: Any) -> str:
    """`value` as HTML text, safe both between tags and inside a double- or single-quoted attribute value:
    ``& < > " '`` become character references. The one escaping function of the reports."""
    return html.escape(str(value), quote=True)


_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def slug(key: Any) -> str:
    """An element id (or fragment) for `key`: the key itself when it is 1-64 of ``[A-Za-z0-9_-]`` (so ids
    stay readable and stable, e.g. ``loss``), else its safe characters followed by a hash of the whole key,
    so two different keys never share an id and no character of an odd key ever reaches markup unescaped."""
    text = str(key)
    if _SAFE_ID.fullmatch(text):
        return text
    kept = re.sub(r"[^A-Za-z0-9_-]+", "_", text).strip("_")[:40]
    # surrogatepass: a JSON file may hold a lone surrogate, which strict UTF-8 refuses to encode
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{kept}-{digest}" if kept else f"id-{digest}"


# Inside <script> the HTML parser ends the element at "</script" and enters a state that swallows the rest
# of the page at "<!--" followed by "<script"; "&" matters when the text is ever read as HTML, and U+2028 /
# U+2029 end a line in older JavaScript parsers. As \uXXXX escapes they are the same JSON string.
_SCRIPT_JSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_SCRIPT_JSON_UNSAFE = re.compile("[<>&\u2028\u2029]")


def script_json(value: Any) -> str:
    """`value` as JSON text that can sit inside a ``<script>`` element: it holds none of ``< > &`` U+2028
    U+2029 (each is written as its ``\\uXXXX`` escape, which JSON reads back as the same character).
    NaN and infinities are refused (ValueError), as JSON has no such numbers."""
    text = json.dumps(value, allow_nan=False)
    return _SCRIPT_JSON_UNSAFE.sub(lambda m: _SCRIPT_JSON_ESCAPES[m.group()], text)


# ----------------------------------------------------------------------------- links
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_LINK_SCHEMES = ("http", "https")
# What browsers drop before they read a URL's scheme: tabs and newlines anywhere ("java\tscript:" is
# javascript:), C0 controls and spaces at either end.
_URL_IGNORED = re.compile(r"[\t\n\r]")
_URL_TRIMMED = "".join(chr(c) for c in range(0x21))


def safe_href(url: Any) -> str | None:
    """`url` as a link target when it is an http(s) URL or a relative reference (a path, ``?query`` or
    ``#fragment``), else None (also for None). Judged as a browser reads it, so ``javascript:``, ``data:``, ``vbscript:``,
    ``file:`` and every other scheme are refused however they are spelt, and so are scheme-relative
    ``//host`` references (also spelt with backslashes), which lead to another host. The caller escapes
    the result (:func:`esc`) like any attribute value."""
    if url is None:
        return None
    seen = _URL_IGNORED.sub("", str(url)).strip(_URL_TRIMMED)
    if not seen:
        return None
    scheme = _SCHEME.match(seen)
    if scheme:
        return seen if scheme.group(1).lower() in _LINK_SCHEMES else None
    if seen[:2].replace("\\", "/") == "//":
        return None
    return seen


def link(url: Any, shown: str) -> Raw:
    """``<a href=url>shown</a>`` when :func:`safe_href` allows `url`; else `shown` alone, as text. `shown`
    is escaped unless it is :class:`Raw`."""
    text = shown if isinstance(shown, Raw) else esc(shown)
    href = safe_href(url)
    return Raw(f'<a href="{esc(href)}">{text}</a>' if href is not None else text)


# ----------------------------------------------------------------------------- the page
def content_security_policy(scripts: Sequence[str] = ()) -> str:
    """The policy of every report: nothing is fetched (``default-src 'none'``), inline style is allowed
    (the reports' one style sheet), images only as ``data:`` URLs, no forms, no ``<base>``, and no script
    runs: inline event handlers, ``javascript:`` URLs and injected ``<script>`` are all refused. The reports
    draw their charts as SVG on the server and need no script; should one ever need an inline script, pass
    its exact text in `scripts`: it is allowed by its sha256 hash (never by 'unsafe-inline')."""
    allowed = " ".join(_script_hash(text) for text in scripts) or "'none'"
    return (f"default-src 'none'; script-src {allowed}; style-src 'unsafe-inline'; img-src data:; "
            "base-uri 'none'; form-action 'none'")


def _script_hash(text: str) -> str:
    """A CSP source for one inline script: the base64 sha256 of its exact UTF-8 text."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


def csp_meta(scripts: Sequence[str] = ()) -> str:
    """The ``<meta http-equiv="Content-Security-Policy">`` tag of :func:`content_security_policy`; it
    must come first in ``<head>``, before anything the policy governs."""
    return f'<meta http-equiv="Content-Security-Policy" content="{esc(content_security_policy(scripts))}">'


def num(value: Any, digits: int = 4) -> str:
    """A number as a reader wants it: integers (and floats that are whole) in full, other floats to `digits`
    significant digits (``7.526751268999988`` -> ``7.527``, ``1e-06`` stays ``1e-06``); NaN and infinities as
    written; anything else as ``str``. The result is text: the caller escapes it like any other."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.{digits}g}"


def pct(value: Any) -> str:
    return "–" if value is None else f"{100 * float(value):.1f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Sequence[int] = (), cls: str = "") -> str:
    """An HTML table; cells are escaped unless they are :class:`Raw`; columns in `numeric` align right."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            text = cell if isinstance(cell, Raw) else esc(cell)
            cells.append(f'<td class="num">{text}</td>' if i in numeric else f"<td>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table class="{esc(cls)}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def page(title: str, body: Sequence[str], extra_css: str = "") -> str:
    """A whole HTML document: its Content-Security-Policy, `title`, the shared style sheet (plus
    `extra_css`) and the body parts (HTML, built with the helpers above)."""
    return "\n".join(["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', csp_meta(),
                      f"<title>{esc(title)}</title><style>{CSS}{extra_css}</style></head><body>",
                      *[part for part in body if part], "</body></html>"])
