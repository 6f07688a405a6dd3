"""Shared set-up of the benchmarks: thread settings, the SFT warm start on tool_arith, RL data, a rollout
service in its own process, and the machine's conditions (load, cores) recorded with every result.

Import this module before torch (it sets the thread environment that OpenMP reads at start-up)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# One torch thread per process and passive OpenMP waits for every process of every arm, so that no arm is
# slowed by oversubscription (spin-waiting threads cost 3-70x on 2 shared cores).
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
              "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
              "VLLM_NO_USAGE_STATS": "1", "TQDM_DISABLE": "1"}
os.environ.update(THREAD_ENV)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Re-exported: the bench scripts draw with `_setup.bar_chart_png` and print with `_setup.fmt_table`.
from sao_core.sim.report import _COLORS, bar_chart_png, table  # noqa: E402, F401


def configure_torch() -> None:
    import torch

    torch.set_num_threads(1)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def conditions() -> dict:
    """Load and machine facts at this moment (stored with each measurement)."""
    import torch

    load1, load5, load15 = os.getloadavg()
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_1_5_15": [round(load1, 2), round(load5, 2),
                                                                            round(load15, 2)],
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "python": platform.python_version(),
            "torch": torch.__version__, "machine": platform.machine()}


def default_cache_dir() -> str:
    return os.environ.get("SAO_CACHE_DIR") or str(Path.home() / ".cache" / "sao")


def _key(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:10]


def warm_start(root: Path, sft_steps: int = 240, seed: int = 0, p_more: float | None = None,
               max_tokens: int = 128, rows: int = 600) -> str:
    """An SFT warm start of the embedded model on solved tool_arith episodes (single operations by default,
    chains of 1 + Geometric(p_more) operations with `p_more`). Reused when the same settings were trained
    under `root` before. Returns the exported model directory."""
    from sao_core.data.synthetic import tool_arith_sft_rows
    from sao_core.training.config import SFTConfig
    from sao_core.training.trainer import train

    settings = {"sft_steps": sft_steps, "seed": seed, "p_more": p_more, "max_tokens": max_tokens, "rows": rows}
    base = Path(root) / f"warm-{_key(settings)}"
    done = base / "model.txt"          # the model directory, relative to `base`
    if done.exists() and (base / done.read_text().strip()).is_dir():
        return str(base / done.read_text().strip())
    shutil.rmtree(base, ignore_errors=True)
    (base / "sft-data").mkdir(parents=True)
    data = tool_arith_sft_rows(rows, seed=5, p_more=p_more, max_ops=8)
    (base / "sft-data" / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    model = train("sft", SFTConfig(data=str(base / "sft-data"), output=str(base / "sft"), steps=sft_steps,
                                   batch_size=16, lr=3e-3, max_tokens=max_tokens, seed=seed))["model"]
    (base / "settings.json").write_text(json.dumps(settings))
    done.write_text(str(Path(model).resolve().relative_to(base.resolve())))
    return str(model)


def write_rl_data(directory: Path, tasks) -> str:
    """Prepare an rl dataset from tool_arith tasks (prompt metadata kept); returns its directory."""
    from sao_core.data.prepare import PrepareConfig, prepare

    directory = Path(directory)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    source = directory.with_suffix(".jsonl")
    source.write_text("".join(json.dumps({"id": t.id, "prompt": t.prompt, "env": t.env, "answer": t.answer,
                                          "metadata": t.metadata}) + "\n" for t in tasks))
    prepare(PrepareConfig(source=str(source), kind="rl", output=str(directory)))
    return str(directory)


def process_cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) used so far by this process, or by process `pid` and every
    live process below it (read from /proc, Linux: vLLM runs its engine core in a child process). The
    benchmarks divide it by wall seconds for the cores a stage occupies."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:          # the process ended while we looked
                continue
            stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))   # ppid, utime + stime
    tree, ticks, frontier = {pid}, 0, [pid]
    while frontier:
        parent = frontier.pop()
        ticks += stats.get(parent, (0, 0))[1]
        children = [p for p, (ppid, _) in stats.items() if ppid == parent and p not in tree]
        tree.update(children)
        frontier += children
    return ticks / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServiceProcess:
    """`sao rollout serve` in its own process (one torch thread), so that generation and the learner in
    this process do not share one interpreter lock."""

    def __init__(self, model: str, engine: str = "hf", max_batch: int = 32, engine_options: dict | None = None,
                 cache_dir: str | None = None, log_path: Path | None = None, start_timeout_s: float = 600.0,
                 weight_roots: list[str] | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sao_core.cli", "--quiet", "--threads", "1", "--log-level", "WARNING",
               "--cache-dir", cache_dir or default_cache_dir(), "rollout", "serve", "--model", model,
               "--engine", engine, "--port", str(self.port), "--max-batch", str(max_batch)]
        if engine_options:
            cmd += ["--engine-options", json.dumps(engine_options)]
        if weight_roots:
            cmd += ["--allowed-weight-roots", ",".join(weight_roots)]
        self.log_path = Path(log_path) if log_path else None
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, cwd=str(ROOT), env={**os.environ, **THREAD_ENV}, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        began = time.monotonic()
        import httpx

        while True:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text()[-2000:] if self.log_path else ""
                raise RuntimeError(f"rollout service exited with {self.proc.returncode}: {tail}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - began > start_timeout_s:
                self.stop()
                raise TimeoutError(f"rollout service did not start within {start_timeout_s} s")
            time.sleep(0.2)
        self.start_seconds = time.monotonic() - began

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is not None:
            return
        import httpx

        try:
            httpx.post(self.url + "/v1/shutdown", json={"grace_s": 0}, timeout=5.0)
            self.proc.wait(timeout_s)
        except (httpx.HTTPError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system, all threads) the service process and its children have used so far."""
        return process_cpu_seconds(self.proc.pid)

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# One table formatter and one bar chart for the benchmarks and the simulator.
fmt_table = table


def line_chart_png(path: Path, title: str, xs: list[float], series: dict[str, list[float]], xlabel: str = "",
                   ylabel: str = "", points: dict[str, list[tuple[float, float]]] | None = None) -> None:
    """Lines (and optional scatter points) as PNG with Pillow."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    width, height, left, bottom, top, right = 900, 520, 70, 60, 40, 200
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 10), title, fill="black", font=font)
    all_y = [v for vs in series.values() for v in vs] + [p[1] for ps in (points or {}).values() for p in ps]
    all_x = list(xs) + [p[0] for ps in (points or {}).values() for p in ps]
    x0, x1 = min(all_x), max(all_x)
    y0, y1 = 0.0, max(all_y + [1e-12]) * 1.05
    x1 = x1 if x1 > x0 else x0 + 1

    def at(x, y):
        return (left + (x - x0) / (x1 - x0) * (width - left - right),
                height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom))

    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    for k in range(6):
        yv = y0 + (y1 - y0) * k / 5
        _, py = at(x0, yv)
        draw.text((5, py - 6), f"{yv:.3g}", fill="black", font=font)
        xv = x0 + (x1 - x0) * k / 5
        px, _ = at(xv, y0)
        draw.text((px - 10, height - bottom + 6), f"{xv:.3g}", fill="black", font=font)
    draw.text((left + 200, height - 25), xlabel, fill="black", font=font)
    draw.text((5, top - 16), ylabel, fill="black", font=font)
    for j, (name, ys) in enumerate(series.items()):
        color = _COLORS[j % len(_COLORS)]
        draw.line([at(x, y) for x, y in zip(xs, ys, strict=True)], fill=color, width=2)
        draw.text((width - right + 10, top + 16 * j), name[:30], fill=color, font=font)
    for j, (name, ps) in enumerate((points or {}).items(), start=len(series)):
        color = _COLORS[j % len(_COLORS)]
        for x, y in ps:
            px, py = at(x, y)
            draw.ellipse([px - 4, py - 4, px + 4, py + 4], outline=color, width=2)
        draw.text((width - right + 10, top + 16 * j), name[:30], fill=color, font=font)
    image.save(path)
