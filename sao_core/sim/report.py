"""Text tables and PNG bar charts of simulator results (the same layout `bench/simulator.py` has always
printed). Pure formatting: nothing here simulates."""

from __future__ import annotations

from pathlib import Path

# Metrics of one simulated method, in the order printed (rates per second or hour, shares of wall time 0-1,
# GPU-hours per 1,000 trained trajectories, staleness in policy versions, wall time in seconds).
RESULT_KEYS = ("trajectories_per_s", "steady_trajectories_per_s", "trajectories_per_hour", "tokens_per_s",
               "rollout_utilisation", "rollout_busy_share", "rollout_idle_share", "train_busy_share",
               "train_idle_share", "learner_wait_share", "gpu_hours_per_1000", "staleness_mean", "dropped", "wall_s")

VALIDATION_COLUMNS = [("tail", "tail", ""), ("arm", "arm", ""), ("measured", "measured traj/s", ".3f"),
                      ("predicted", "predicted traj/s", ".3f"), ("error", "error", "+.0%"),
                      ("measured_e2e", "meas. e2e", ".3f"), ("predicted_e2e", "pred. e2e", ".3f"),
                      ("error_e2e", "error e2e", "+.0%"), ("measured_idle", "gen idle meas.", ".2f"),
                      ("predicted_idle", "gen idle pred.", ".2f")]


def format_result(result: dict) -> str:
    """One method's metrics, one `  name value` line each."""
    lines = []
    for key in RESULT_KEYS:
        value = result[key]
        lines.append(f"  {key:<24} {value:.4g}" if isinstance(value, float) else f"  {key:<24} {value}")
    return "\n".join(lines)


def format_projection(projection: dict) -> str:
    """sync GRPO and SAO side by side, then SAO's trajectories/s over sync's."""
    s = projection["settings"]
    sync, sao = projection["sync"], projection["sao"]
    return "\n".join([
        f"sync GRPO (G={s['group_size']}{', colocated' if s['colocated_sync'] else ''}):", format_result(sync),
        f"SAO (S={s['max_staleness']}, in flight {s['sao_in_flight_cap']}):", format_result(sao),
        f"SAO / sync = {sao['trajectories_per_s'] / sync['trajectories_per_s']:.2f}x"])


def format_validation(validation: dict) -> str:
    """Predicted vs measured trajectories/s per arm, and the mean absolute errors."""
    text = table(validation["rows"], VALIDATION_COLUMNS)
    if validation["mean_abs_error"] is not None:
        text += (f"\nmean |error| {validation['mean_abs_error']:.0%} steady state (second half of the steps), "
                 f"{validation['mean_abs_error_e2e']:.0%} end to end")
    return text


def format_anchors(rows: list[dict]) -> str:
    """Each published anchor against its reconstruction, with what was stated and what was assumed."""
    return "\n".join(
        f"{r['anchor']}: published {r['published']:.2f}x, predicted {r['predicted']:.2f}x steady "
        f"({r['error']:+.0%}), {r['predicted_e2e']:.2f}x end to end; rollout utilisation sync "
        f"{r['sync']['rollout_utilisation']:.2f} async {r['async']['rollout_utilisation']:.2f}, GPU-h/1000 traj "
        f"sync {r['sync']['gpu_hours_per_1000']:.2f} async {r['async']['gpu_hours_per_1000']:.2f}\n"
        f"  stated: {r['stated']}\n  assumed: {r['assumed']}" for r in rows)


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A plain text table, right-aligned: columns are (key, header, format spec); None prints as '-'."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        cells.append(["-" if row.get(key) is None else format(row[key], spec) if spec else str(row[key])
                      for key, _, spec in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    out = []
    for n, r in enumerate(cells):
        out.append("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


_COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
           (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]


def bar_chart_png(path: Path, title: str, labels: list[str], series: dict[str, list[float | None]],
                  unit: str = "", stacked: bool = False, note: str = "") -> bool:
    """A horizontal bar chart as PNG with Pillow (no plotting library needed): one group of bars per label,
    one bar per series (or one stacked bar per label with `stacked`). Returns False, writing nothing, when
    Pillow is not installed (it is not a dependency of sao_core)."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        return False

    font = ImageFont.load_default()
    names = list(series)
    per_group = 1 if stacked else len(names)
    bar_h, gap, left, right, top = 14, 10, 260, 120, 46
    height = top + len(labels) * (per_group * bar_h + gap) + 30 + 16 * ((len(names) + 2) // 3) + (16 if note else 0)
    width = 980
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 10), title, fill="black", font=font)
    totals = [sum(v or 0 for v in (series[n][i] for n in names)) for i in range(len(labels))] if stacked else \
        [v or 0 for n in names for v in series[n]]
    top_value = max(totals + [1e-12])
    scale = (width - left - right) / top_value
    y = top
    for i, label in enumerate(labels):
        draw.text((10, y + 2), label[:40], fill="black", font=font)
        x = left
        for j, name in enumerate(names):
            value = series[name][i]
            if value is None:
                if not stacked:
                    y += bar_h
                continue
            length = max(1, int(value * scale))
            draw.rectangle([x, y, x + length, y + bar_h - 2], fill=_COLORS[j % len(_COLORS)])
            if stacked:
                x += length
            else:
                draw.text((x + length + 4, y + 1), f"{value:.3g}{unit}", fill="black", font=font)
                y += bar_h
        if stacked:
            draw.text((x + 4, y + 1), f"{totals[i]:.3g}{unit}", fill="black", font=font)
            y += bar_h
        y += gap
    y += 10
    for j, name in enumerate(names):
        cx, cy = 10 + (j % 3) * 320, y + (j // 3) * 16
        draw.rectangle([cx, cy + 2, cx + 10, cy + 12], fill=_COLORS[j % len(_COLORS)])
        draw.text((cx + 16, cy + 1), name[:48], fill="black", font=font)
    if note:
        draw.text((10, height - 16), note[:160], fill=(80, 80, 80), font=font)
    image.save(path)
    return True
