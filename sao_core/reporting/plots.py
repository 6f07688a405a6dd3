"""Small, dependency-free SVG charts for the evaluation and training reports (inline in the HTML, so a
report is one self-contained file).

Every chart is an ``<svg>`` element with a ``<title>``, ``role="img"`` and an ``aria-label``; each bar is a
``<rect class="bar">`` and each line point a ``<circle class="point">`` carrying ``data-series``,
``data-label`` and ``data-value`` attributes (the plotted number), so a test or a script can read the
values back. Values are plain floats; fractions are drawn on a 0-100 % axis when ``percent`` is set.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from sao_core.reporting.html import esc, slug

PALETTE = ("#3b6fb6", "#e08a2c", "#4c9a5b", "#b8474d", "#7d5bb0", "#8c6d46", "#cc6fb0", "#6f7b86")
FONT = "font-family=\"system-ui, sans-serif\""


def _fmt(value: float, percent: bool) -> str:
    if percent:
        return f"{100 * value:.1f}%"
    if abs(value) >= 100 or float(value).is_integer():
        return f"{value:.0f}"
    return f"{value:.3g}"


def _nice_max(value: float) -> float:
    """A round axis maximum >= value (1, 2, 2.5, 5 x 10^n)."""
    if value <= 0:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        top = step * 10 ** exponent
        if top >= value:
            return float(top)
    return float(10 ** (exponent + 1))


def _open(width: int, height: int, title: str) -> list[str]:
    t = esc(title)
    return [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" aria-label="{t}" '
            f'viewBox="0 0 {width} {height}" width="{width}" height="{height}">',
            f"<title>{t}</title>",
            f'<rect class="background" x="0" y="0" width="{width}" height="{height}" fill="#fff"/>',
            f'<text x="{width / 2:.1f}" y="18" text-anchor="middle" font-size="14" font-weight="600" {FONT}>{t}</text>']


def _legend(names: Sequence[str], x: float, y: float) -> list[str]:
    out = []
    for i, name in enumerate(names):
        yy = y + 16 * i
        out.append(f'<rect x="{x:.1f}" y="{yy - 9:.1f}" width="10" height="10" fill="{PALETTE[i % len(PALETTE)]}"/>')
        out.append(f'<text x="{x + 14:.1f}" y="{yy:.1f}" font-size="11" {FONT}>{esc(name)}</text>')
    return out


def bar_chart(title: str, labels: Sequence[str], series: Mapping[str, Sequence[float | None]], *,
              percent: bool = True, y_label: str = "", width: int = 720, height: int = 320) -> str:
    """Grouped vertical bars: one group per label, one bar per series (None: no bar)."""
    names = list(series)
    values = [v for vs in series.values() for v in vs if v is not None]
    top = 1.0 if percent else _nice_max(max(values, default=1.0))
    left, right, top_pad, bottom = 56, 150 if len(names) > 1 else 20, 34, 64
    plot_w, plot_h = width - left - right, height - top_pad - bottom
    out = _open(width, height, title)
    for i in range(6):   # grid and y ticks
        v = top * i / 5
        y = top_pad + plot_h - plot_h * i / 5
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="10" {FONT}>{_fmt(v, percent)}</text>')
    if y_label:
        out.append(f'<text x="14" y="{top_pad + plot_h / 2:.1f}" font-size="11" {FONT} '
                   f'transform="rotate(-90 14 {top_pad + plot_h / 2:.1f})" text-anchor="middle">{esc(y_label)}</text>')
    group_w = plot_w / max(1, len(labels))
    bar_w = min(48.0, 0.8 * group_w / max(1, len(names)))
    for g, label in enumerate(labels):
        x0 = left + g * group_w + (group_w - bar_w * len(names)) / 2
        for s, name in enumerate(names):
            value = series[name][g] if g < len(series[name]) else None
            if value is None:
                continue
            h = plot_h * max(0.0, min(value, top)) / top
            x, y = x0 + s * bar_w, top_pad + plot_h - h
            colour = PALETTE[s % len(PALETTE)]
            out.append(f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{bar_w - 2:.1f}" height="{h:.1f}" '
                       f'fill="{colour}" data-series="{esc(name)}" data-label="{esc(label)}" '
                       f'data-value="{value:.6g}"><title>{esc(name)} {esc(label)}: {_fmt(value, percent)}</title></rect>')
            out.append(f'<text x="{x + (bar_w - 2) / 2:.1f}" y="{y - 3:.1f}" text-anchor="middle" font-size="9" '
                       f'{FONT}>{_fmt(value, percent)}</text>')
        out.append(f'<text x="{left + g * group_w + group_w / 2:.1f}" y="{top_pad + plot_h + 16}" text-anchor="middle" '
                   f'font-size="11" {FONT}>{esc(_short(label, int(group_w / 6) or 4))}</text>')
    out.append(f'<line x1="{left}" y1="{top_pad + plot_h}" x2="{left + plot_w}" y2="{top_pad + plot_h}" stroke="#333"/>')
    if len(names) > 1:
        out += _legend(names, left + plot_w + 16, top_pad + 10)
    out.append("</svg>")
    return "\n".join(out)


def hbar_chart(title: str, labels: Sequence[str], values: Sequence[float], *, counts: Sequence[int] | None = None,
               percent: bool = True, width: int = 720) -> str:
    """Horizontal bars, one per label (long labels such as repository names fit)."""
    row = 20
    left, right, top_pad = 220, 70, 34
    height = top_pad + row * max(1, len(labels)) + 24
    plot_w = width - left - right
    top = 1.0 if percent else _nice_max(max(values, default=1.0))
    out = _open(width, height, title)
    for i in range(6):
        x = left + plot_w * i / 5
        out.append(f'<line x1="{x:.1f}" y1="{top_pad}" x2="{x:.1f}" y2="{height - 22}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{height - 8}" text-anchor="middle" font-size="10" {FONT}>{_fmt(top * i / 5, percent)}</text>')
    for i, (label, value) in enumerate(zip(labels, values, strict=True)):
        y = top_pad + i * row
        w = plot_w * max(0.0, min(value, top)) / top
        shown = f"{label} ({counts[i]})" if counts is not None else label
        out.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end" font-size="11" {FONT}>{esc(_short(shown, 34))}</text>')
        out.append(f'<rect class="bar" x="{left}" y="{y + 3}" width="{w:.1f}" height="{row - 6}" fill="{PALETTE[0]}" '
                   f'data-series="score" data-label="{esc(label)}" data-value="{value:.6g}">'
                   f'<title>{esc(shown)}: {_fmt(value, percent)}</title></rect>')
        out.append(f'<text x="{left + w + 4:.1f}" y="{y + 13}" font-size="10" {FONT}>{_fmt(value, percent)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def line_chart(title: str, series: Mapping[str, Sequence[tuple[float, float]]], *, x_label: str = "",
               percent: bool = True, log2_x: bool = True, width: int = 720, height: int = 320) -> str:
    """Lines through (x, y) points, one per series; x on a log2 axis by default (pass@k curves)."""
    points = [p for ps in series.values() for p in ps]
    left, right, top_pad, bottom = 56, 170, 34, 48
    plot_w, plot_h = width - left - right, height - top_pad - bottom
    xs = sorted({p[0] for p in points}) or [1.0]

    def tx(x: float) -> float:
        lo, hi = (math.log2(xs[0]), math.log2(xs[-1])) if log2_x else (xs[0], xs[-1])
        v = math.log2(x) if log2_x else x
        return left + (plot_w * (v - lo) / (hi - lo) if hi > lo else plot_w / 2)

    top = 1.0 if percent else _nice_max(max((p[1] for p in points), default=1.0))

    def ty(y: float) -> float:
        return top_pad + plot_h - plot_h * max(0.0, min(y, top)) / top

    out = _open(width, height, title)
    for i in range(6):
        y = top_pad + plot_h - plot_h * i / 5
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="10" {FONT}>{_fmt(top * i / 5, percent)}</text>')
    for x in xs:
        out.append(f'<text x="{tx(x):.1f}" y="{top_pad + plot_h + 16}" text-anchor="middle" font-size="10" {FONT}>{x:g}</text>')
    if x_label:
        out.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 8}" text-anchor="middle" font-size="11" {FONT}>{esc(x_label)}</text>')
    for s, (name, pts) in enumerate(series.items()):
        colour = PALETTE[s % len(PALETTE)]
        pts = sorted(pts)
        if len(pts) > 1:
            path = " ".join(f"{'M' if i == 0 else 'L'}{tx(x):.1f},{ty(y):.1f}" for i, (x, y) in enumerate(pts))
            out.append(f'<path class="line" d="{path}" fill="none" stroke="{colour}" stroke-width="2" '
                       f'data-series="{esc(name)}"/>')
        for x, y in pts:
            out.append(f'<circle class="point" cx="{tx(x):.1f}" cy="{ty(y):.1f}" r="3.5" fill="{colour}" '
                       f'data-series="{esc(name)}" data-label="{x:g}" data-value="{y:.6g}">'
                       f'<title>{esc(name)} @{x:g}: {_fmt(y, percent)}</title></circle>')
    out += _legend(list(series), left + plot_w + 16, top_pad + 10)
    out.append("</svg>")
    return "\n".join(out)


def histogram_bins(values: Sequence[float], bins: int = 20) -> list[float]:
    """`bins` + 1 equal-width edges covering `values` (at least [0, 1])."""
    hi = max(values, default=1.0)
    hi = hi if hi > 0 else 1.0
    return [hi * i / bins for i in range(bins + 1)]


def _count_grid(top: float, left: float, top_pad: float, plot_w: float, plot_h: float) -> list[str]:
    """Six horizontal grid lines from 0 to `top` with their labels (the y axis of the stacked charts)."""
    out = []
    for i in range(6):
        y = top_pad + plot_h - plot_h * i / 5
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="10" {FONT}>{_fmt(top * i / 5, False)}</text>')
    return out


def _stacked_bars(columns: Sequence[tuple[str, Sequence[float]]], names: Sequence[str], top: float, left: float,
                  top_pad: float, plot_h: float, bar_w: float, tooltip) -> list[str]:
    """One stacked bar per column (label, one value per series in `names`), `bar_w` wide; each piece is a
    ``<rect class="bar">`` with data-series / data-label / data-value and a `tooltip(name, label, value)`."""
    out = []
    for b, (label, values) in enumerate(columns):
        base = 0.0
        for s, (name, c) in enumerate(zip(names, values, strict=True)):
            if not c:
                continue
            h = plot_h * c / top
            y = top_pad + plot_h - plot_h * (base + c) / top
            out.append(f'<rect class="bar" x="{left + b * bar_w:.1f}" y="{y:.1f}" width="{max(bar_w - 1, 0.5):.1f}" '
                       f'height="{h:.1f}" fill="{PALETTE[s % len(PALETTE)]}" data-series="{esc(name)}" '
                       f'data-label="{esc(label)}" data-value="{c:g}"><title>{esc(tooltip(name, label, c))}</title></rect>')
            base += c
    return out


def histogram(title: str, series: Mapping[str, Sequence[float]], *, bins: int = 20, x_label: str = "",
              width: int = 720, height: int = 300) -> str:
    """Stacked histogram of the values of each series over shared equal-width bins (counts on y)."""
    all_values = [v for vs in series.values() for v in vs]
    edges = histogram_bins(all_values, bins)
    counts = {name: [0] * bins for name in series}
    for name, vs in series.items():
        for v in vs:
            i = min(bins - 1, int(bins * v / edges[-1])) if edges[-1] > 0 else 0
            counts[name][max(0, i)] += 1
    totals = [sum(counts[n][i] for n in series) for i in range(bins)]
    top = _nice_max(max(totals, default=1))
    left, right, top_pad, bottom = 56, 170, 34, 48
    plot_w, plot_h = width - left - right, height - top_pad - bottom
    bar_w = plot_w / bins
    out = _open(width, height, title)
    out += _count_grid(top, left, top_pad, plot_w, plot_h)
    columns = [(f"{edges[i]:.0f}-{edges[i + 1]:.0f}", [counts[name][i] for name in series]) for i in range(bins)]
    out += _stacked_bars(columns, list(series), top, left, top_pad, plot_h, bar_w,
                         lambda name, label, c: f"{name} {label}: {c:g}")
    for i in range(0, bins + 1, max(1, bins // 5)):
        out.append(f'<text x="{left + i * bar_w:.1f}" y="{top_pad + plot_h + 16}" text-anchor="middle" font-size="10" '
                   f'{FONT}>{edges[i]:.0f}</text>')
    if x_label:
        out.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 8}" text-anchor="middle" font-size="11" {FONT}>{esc(x_label)}</text>')
    out += _legend(list(series), left + plot_w + 16, top_pad + 10)
    out.append("</svg>")
    return "\n".join(out)


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: max(1, n - 1)] + "…"


# ----------------------------------------------------------------------------- curves over training steps
def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (steps of 1, 2, 2.5 or 5 × 10^n), at most about `count` + 2.

    A range narrower than a millionth of its values' size (a metric that is constant up to float noise, such
    as 0.3 and 0.30000000000000004) is widened as if it were one value: a step below the values' float
    resolution would never advance from one tick to the next."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0, 1.0]
    if hi < lo:
        lo, hi = hi, lo
    if hi - lo <= 1e-6 * max(abs(lo), abs(hi)):
        mid = (lo + hi) / 2
        lo, hi = (mid - 1.0, mid + 1.0) if mid == 0 else (mid - abs(mid) * 0.1, mid + abs(mid) * 0.1)
    raw = (hi - lo) / max(1, count)
    exponent = math.floor(math.log10(raw))
    step = next(s * 10 ** exponent for s in (1, 2, 2.5, 5, 10) if s * 10 ** exponent >= raw)
    first = math.floor(lo / step) * step
    n = max(1, math.ceil((hi - first) / step - 1e-9))   # ticks by index: no accumulated float error
    digits = max(0, 2 - exponent)
    return [round(first + i * step, digits) for i in range(n + 1)]


def step_chart(title: str, x: Sequence[float], series: Mapping[str, Sequence[float | None]], *,
               smoothed: Mapping[str, Sequence[float | None]] | None = None, percent: bool = False,
               x_label: str = "step", chart_id: str = "", width: int = 720, height: int = 280,
               max_points: int = 80) -> str:
    """Curves over training steps: one line per series over a linear x axis (None values leave a gap), y
    from the data's own range (negative values included). `smoothed` (e.g. moving averages) are drawn as
    thicker lines over faint raw ones. Each line is a ``<path class="line">`` with ``data-series``; with at
    most `max_points` points each point is also a ``<circle class="point">`` carrying ``data-value``."""
    values = [v for vs in list(series.values()) + list((smoothed or {}).values()) for v in vs if v is not None]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if percent:
        lo, hi = min(0.0, lo), (max(1.0, hi) if hi > 0.5 or hi <= 0 else hi)   # 0-100 %, or 0 to a small top
    yt = nice_ticks(lo, hi)
    y0, y1 = yt[0], yt[-1]
    xs = [float(v) for v in x] or [0.0]
    x0, x1 = min(xs), max(xs)
    xt = nice_ticks(x0, x1) if x1 > x0 else [x0]
    left, right, top_pad, bottom = 64, 170, 34, 44
    plot_w, plot_h = width - left - right, height - top_pad - bottom

    def tx(v: float) -> float:
        return left + (plot_w * (v - x0) / (x1 - x0) if x1 > x0 else plot_w / 2)

    def ty(v: float) -> float:
        return top_pad + plot_h - plot_h * (v - y0) / ((y1 - y0) or 1.0)

    out = _open(width, height, title)
    if chart_id:   # an id holds no odd character, whatever the caller's key (slug)
        out[0] = out[0].replace('<svg ', f'<svg id="{slug(chart_id)}" ', 1)
    for v in yt:
        y = ty(v)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="10" {FONT}>{_fmt(v, percent)}</text>')
    for v in xt:
        if x0 <= v <= x1:
            out.append(f'<text x="{tx(v):.1f}" y="{top_pad + plot_h + 16}" text-anchor="middle" font-size="10" '
                       f'{FONT}>{v:g}</text>')
    if x_label:
        out.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 8}" text-anchor="middle" font-size="11" {FONT}>{esc(x_label)}</text>')
    names = list(series)
    legend = []
    for s, name in enumerate(names):
        colour = PALETTE[s % len(PALETTE)]
        has_smooth = bool(smoothed and name in smoothed)
        pts = [(xv, yv) for xv, yv in zip(xs, series[name], strict=False)]
        out += _path(pts, tx, ty, colour, name, "line", 1.2 if has_smooth else 2.0, 0.45 if has_smooth else 1.0)
        if len(pts) <= max_points:
            for xv, yv in pts:
                if yv is None:
                    continue
                out.append(f'<circle class="point" cx="{tx(xv):.1f}" cy="{ty(yv):.1f}" r="{2 if has_smooth else 3}" '
                           f'fill="{colour}" data-series="{esc(name)}" data-label="{xv:g}" data-value="{yv:.6g}">'
                           f'<title>{esc(name)} @ step {xv:g}: {_fmt(yv, percent)}</title></circle>')
        legend.append(name)
        if has_smooth:
            out += _path(list(zip(xs, smoothed[name], strict=False)), tx, ty, colour, f"{name} (moving avg)",
                         "line smoothed", 2.5, 1.0)
            legend.append(f"{name} (moving avg)")
    for i, name in enumerate(legend):   # one colour per series; its moving average shares it
        base = name.removesuffix(" (moving avg)")
        colour = PALETTE[names.index(base) % len(PALETTE)]
        yy = top_pad + 10 + 16 * i
        out.append(f'<rect x="{left + plot_w + 16:.1f}" y="{yy - 9:.1f}" width="10" height="{10 if base == name else 4}" '
                   f'fill="{colour}"/>')
        out.append(f'<text x="{left + plot_w + 30:.1f}" y="{yy:.1f}" font-size="11" {FONT}>{esc(_short(name, 28))}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _path(points: Sequence[tuple[float, float | None]], tx, ty, colour: str, name: str, cls: str, width: float,
          opacity: float) -> list[str]:
    """One ``<path>`` through the points; a None value starts a new segment."""
    parts, pen = [], "M"
    for xv, yv in points:
        if yv is None:
            pen = "M"
            continue
        parts.append(f"{pen}{tx(xv):.1f},{ty(yv):.1f}")
        pen = "L"
    if not parts:
        return []
    if len(parts) == 1:   # a single point: a dot, so the series is still visible
        x, y = parts[0][1:].split(",")
        return [f'<circle class="{cls}" cx="{x}" cy="{y}" r="3" fill="{colour}" data-series="{esc(name)}"/>']
    return [f'<path class="{cls}" d="{" ".join(parts)}" fill="none" stroke="{colour}" stroke-width="{width}" '
            f'stroke-opacity="{opacity}" data-series="{esc(name)}"/>']


def stacked_steps(title: str, x: Sequence[float], series: Mapping[str, Sequence[float]], *, x_label: str = "step",
                  chart_id: str = "", max_bars: int = 100, width: int = 720, height: int = 280) -> str:
    """Stacked bars over training steps (e.g. trajectories per staleness value at each step). With more than
    `max_bars` steps, consecutive steps are summed into equal bins (the bar's label says which)."""
    xs = list(x)
    size = max(1, -(-len(xs) // max_bars))
    bins = [(xs[i], xs[min(i + size, len(xs)) - 1], range(i, min(i + size, len(xs)))) for i in range(0, len(xs), size)]
    names = list(series)
    sums = [[sum(series[n][j] for j in idx) for (_, _, idx) in bins] for n in names]
    totals = [sum(col) for col in zip(*sums, strict=True)] if sums else []
    top = _nice_max(max(totals, default=1.0))
    left, right, top_pad, bottom = 64, 170, 34, 44
    plot_w, plot_h = width - left - right, height - top_pad - bottom
    bar_w = plot_w / max(1, len(bins))
    out = _open(width, height, title)
    if chart_id:   # an id holds no odd character, whatever the caller's key (slug)
        out[0] = out[0].replace('<svg ', f'<svg id="{slug(chart_id)}" ', 1)
    out += _count_grid(top, left, top_pad, plot_w, plot_h)
    columns = [(f"{first:g}" if first == last else f"{first:g}-{last:g}", [sums[s][b] for s in range(len(names))])
               for b, (first, last, _) in enumerate(bins)]
    out += _stacked_bars(columns, names, top, left, top_pad, plot_h, bar_w,
                         lambda name, label, c: f"step {label}, {name}: {c:g}")
    for i in range(0, len(bins), max(1, len(bins) // 6)):
        first = bins[i][0]
        out.append(f'<text x="{left + (i + 0.5) * bar_w:.1f}" y="{top_pad + plot_h + 16}" text-anchor="middle" '
                   f'font-size="10" {FONT}>{first:g}</text>')
    if x_label:
        out.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 8}" text-anchor="middle" font-size="11" {FONT}>{esc(x_label)}</text>')
    out += _legend(names, left + plot_w + 16, top_pad + 10)
    out.append("</svg>")
    return "\n".join(out)
