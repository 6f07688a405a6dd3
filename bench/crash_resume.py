"""Crash and resume: kill -9 the learner at random steps, resume each time, and check the stream invariant.

For each placement of the rollout service,

  colocated  the service runs inside the learner's process (the default of the KFP components): a kill
             takes both down, and the resumed learner starts a new plan from its ledger
  external   the service runs on its own (here: a thread of this process) and survives every kill; the
             resumed learner reconnects to its running plan

one run of `--steps` learner steps is killed with SIGKILL at `--kills` distinct random steps (each kill
after a random delay inside the step, so it lands anywhere in train / journal / push / ack / checkpoint; a
step of the learner it kills, one step later if the learner killed before got past it) and resumed with
`--resume` after each; the last resume runs to the end. The learners are forked from a process that has
done their imports (`_forks.py`). Then `sao_core.learner.journal.audit` checks, from the journals and the
final ledger: no (position, rollout) trained twice, every position up to the last one trained is trained,
dropped with a recorded reason or still owed, none skipped.

    .venv/bin/python bench/crash_resume.py                       # 5 kills per placement, 24 steps (~3 min)
    .venv/bin/python bench/crash_resume.py --quick               # 5 kills per placement, 12 steps of B = 4 (CI)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402,F401  (thread environment before torch)
from _forks import ForkServer  # noqa: E402

from sao_core.learner import journal  # noqa: E402

PLACEMENTS = ("colocated", "external")


def learner_command(data: str, output: Path, model: str, steps: int, batch_size: int, services: list[str],
                    method: str = "sao", admission: str = "window", env_options: dict | None = None,
                    max_total_tokens: int = 80, max_new_tokens_per_turn: int = 12) -> list[str]:
    """The `sao train-rl` command line of one learner incarnation (small and fast on CPU); its first item is the
    `sao` script, which the fork server runs as `__main__`."""
    cmd = [str(Path(sys.executable).parent / "sao"), "--quiet", "train-rl", "--data", data, "--output", str(output),
           "--model", model, "--method", method, "--steps", str(steps),
           "--batch-size", str(batch_size), "--group-size", "4", "--critic-warmup-steps", "2",
           "--checkpoint-every", "3", "--max-new-tokens-per-turn", str(max_new_tokens_per_turn), "--max-total-tokens", str(max_total_tokens),
           "--policy-lr", "1e-4", "--critic-lr", "1e-4", "--max-staleness", "2"]
    if admission != "window":
        cmd += ["--admission", admission]
    if env_options:
        cmd += ["--env-options", json.dumps(env_options)]
    if services:
        cmd += ["--services", *services]
    return cmd


def _metrics_lines(output: Path) -> int:
    path = output / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _journal_steps(output: Path) -> int:
    """The newest journaled step (0: none)."""
    names = list((output / "journal").glob("step-*.json")) if (output / "journal").exists() else []
    return max((int(p.stem.split("-")[1]) for p in names), default=0)


def split_by_kills(output: Path, kills: list[dict]) -> int:
    """Episodes trained in fragments with a kill between two of their pieces (pieces journaled at steps a < b
    with a kill after step a was journaled and before step b was)."""
    steps: dict[str, list[int]] = {}
    for path in sorted((output / "journal").glob("step-*.json")):
        entry = json.loads(path.read_text())
        for t in entry["trajectories"]:
            base = t["id"].split("-f")[0]
            steps.setdefault(base, []).append(entry["step"])
    return sum(1 for got in steps.values() if len(got) > 1
               and any(min(got) <= k["journal_steps"] < max(got) for k in kills))


def _scratch(tmp: Path) -> list[str]:
    """The learners' scratch folders under `tmp` (sao-learner-<run>-rank<N>)."""
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("sao-learner-"))


#: What the fork server imports once for every learner process (`_forks.py`): the heavy part of `sao train-rl`.
PRELOAD = ("torch", "transformers", "peft", "torch.utils.tensorboard", "prometheus_client", "sao_core.cli",
           "sao_core.learner.loop", "sao_core.rollout.server", "sao_core.rollout.engines.hf", "sao_core.eval.run",
           "sao_core.kfp.client", "sao_core.sim.commands", "sao_core.cluster.launcher")


def learner_forks(work: Path, cache_dir: str) -> ForkServer:
    """A fork server for learner processes (thread settings of one core each); one can serve several
    `crash_run`s (each process gets its own environment)."""
    return ForkServer({**os.environ, "SAO_CACHE_DIR": cache_dir, "OMP_NUM_THREADS": "1"}, PRELOAD, work)


def crash_run(placement: str, kills: int, steps: int, seed: int, root: Path, model: str, data: str,
              cache_dir: str, batch_size: int = 8, method: str = "sao", admission: str = "window",
              timeout_s: float = 300.0, env_options: dict | None = None, max_total_tokens: int = 80,
              max_new_tokens_per_turn: int = 12, forks: ForkServer | None = None) -> dict:
    """One run of `steps` learner steps with `kills` SIGKILLs at random distinct steps and a resume after
    each; returns the kill points, the final summary and the audit of its journal. The learner processes are
    forked by `forks` (`learner_command()[0]` is the Python script each runs) or by a fork server of this run's."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if not 1 <= kills <= steps - 4:
        raise ValueError(f"kills must be between 1 and steps - 4 = {steps - 4}, got {kills}")
    rng = random.Random(seed)
    # The last kill lands at least 4 steps before the end, so a fast learner cannot finish before it.
    kill_steps = sorted(rng.sample(range(1, steps - 3), kills))
    name = f"{placement}-{method}-{admission}"
    output = root / name
    scratch_root = root / f"tmp-{name}"   # the learners' $TMPDIR: their scratch folders
    scratch_root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SAO_CACHE_DIR": cache_dir, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch_root)}
    own_forks = forks is None
    forks = learner_forks(root / f"forks-{name}", cache_dir) if own_forks else forks
    server = None
    services: list[str] = []
    if placement == "external":
        from sao_core.rollout.server import RolloutServer, ServeConfig

        server = RolloutServer(ServeConfig(model=model, port=0, cache_dir=cache_dir,
                                           allowed_weight_roots=[str(output / "weights")])).start()
        services = [server.url]
    cmd = learner_command(data, output, model, steps, batch_size, services, method, admission, env_options,
                          max_total_tokens, max_new_tokens_per_turn)
    began = time.monotonic()
    try:
        killed = [_start_and_kill(forks, cmd + (["--resume"] if i else []), env, output, at, rng, timeout_s,
                                  placement) for i, at in enumerate(kill_steps)]
        scratch_after_kills = _scratch(scratch_root)
        summary = _resume_to_the_end(forks, cmd + ["--resume"], env, timeout_s, placement)
        service = _service_status(server.url) if server is not None else None
    finally:
        if server is not None:
            server.stop()
        if own_forks:
            forks.close()
    lines = [json.loads(x) for x in (output / "metrics.jsonl").read_text().splitlines()]
    return {"placement": placement, "method": method, "admission": admission, "steps": steps, "kills": killed,
            "seconds": round(time.monotonic() - began, 1), "summary_steps": summary["steps"],
            "summary_trained": summary["trained_trajectories"], "metrics_steps": [r["step"] for r in lines],
            "replayed_lines": sum(1 for r in lines if r.get("replayed")),
            "version": summary["version"], "stream": summary.get("stream"), "service": service,
            "audit": journal.audit(str(output)),
            "scratch_after_kills": scratch_after_kills, "scratch_left": _scratch(scratch_root),
            "checkpoints_left": sorted(p.name for p in (output / "checkpoints").iterdir()),
            "split_by_kills": split_by_kills(output, killed),
            "dropped_by_reason": summary.get("dropped_by_reason", {})}


def _start_and_kill(forks: ForkServer, cmd: list[str], env: dict[str, str], output: Path, at: int,
                    rng: random.Random, timeout_s: float, placement: str) -> dict:
    """Start a learner, SIGKILL it at a random point of its step `at` (once metrics.jsonl has `at` lines, or
    one line more than it had, if the learner killed before got past `at`: every kill lands in a step of the
    learner it kills, never in its start) and return where it was: the planned step, the metrics lines and the
    newest journaled step at the kill."""
    target = max(at, _metrics_lines(output) + 1)
    proc = forks.start(cmd, env)
    deadline = time.monotonic() + timeout_s
    while _metrics_lines(output) < target and proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{placement}: the learner did not reach step {target} in {timeout_s:.0f} s")
        time.sleep(0.02)
    if proc.poll() is not None:
        raise RuntimeError(f"{placement}: the learner exited (code {proc.returncode}) before its kill at "
                           f"step {target}: {proc.stderr()[-2000:]}")
    time.sleep(rng.uniform(0.0, 0.1))    # anywhere in the step: train, journal, push, ack, checkpoint
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return {"planned_step": at, "metrics_lines": _metrics_lines(output), "journal_steps": _journal_steps(output)}


def _resume_to_the_end(forks: ForkServer, cmd: list[str], env: dict[str, str], timeout_s: float,
                       placement: str) -> dict:
    """Run the last learner to the end; returns its summary (the JSON it prints)."""
    proc = forks.start(cmd, env)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{placement}: the final resume did not finish in {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{placement}: the final resume failed: {proc.stderr()[-3000:]}")
    out = proc.stdout()
    return json.loads(out[out.index("{"):])


def _service_status(url: str) -> dict:
    """The external service's counts after the run."""
    from sao_core.rollout.client import RolloutClient

    client = RolloutClient(url)
    status = client.status()
    client.close()
    return {k: status[k] for k in ("acknowledged", "dropped_by_learner", "version", "redelivered")}


def _report_line(result: dict) -> str:
    a = result["audit"]
    return (f"{result['placement']}: {len(result['kills'])} kills at steps "
            f"{[k['metrics_lines'] for k in result['kills']]}, {a['trained_trajectories']} trained, "
            f"{a['dropped_positions']} dropped {a['dropped_by_reason']}, {len(a['owed'])} owed at the end, "
            f"{len(a['skipped'])} skipped, {len(a['duplicate_ids'])} trained twice: "
            f"{'ok' if a['ok'] else a['problems']} ({result['seconds']} s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--kills", type=int, default=5, help="SIGKILLs per placement, at distinct random steps")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--method", default="sao")
    parser.add_argument("--admission", default="window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="local_outputs/bench/crash_resume")
    parser.add_argument("--quick", action="store_true", help="12 steps of B = 4 (5 kills per placement still)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batch_size = 12, 4

    from sao_core.data.prepare import PrepareConfig, prepare
    from sao_core.envs.tool_arith import tool_arith_tasks
    from sao_core.models import EMBEDDED_TINY, resolve_model

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    cache = _setup.default_cache_dir()
    os.environ["SAO_CACHE_DIR"] = cache
    model = resolve_model(EMBEDDED_TINY, cache).path
    work = Path(tempfile.mkdtemp(prefix="crash-resume-"))
    raw = work / "raw.jsonl"
    raw.write_text("".join(json.dumps({"id": t.id, "prompt": t.prompt, "env": t.env, "answer": t.answer,
                                       "metadata": t.metadata}) + "\n" for t in tool_arith_tasks(2000, seed=3)))
    prepare(PrepareConfig(source=str(raw), kind="rl", output=str(work / "rl")))
    results = []
    forks = learner_forks(work / "forks", cache)
    try:
        for i, placement in enumerate(args.placements.split(",")):
            results.append(crash_run(placement, args.kills, args.steps, args.seed + i, work, model,
                                     str(work / "rl"), cache, args.batch_size, args.method, args.admission,
                                     forks=forks))
            print(_report_line(results[-1]))
    finally:
        forks.close()
    payload = {"conditions": _setup.conditions(), "args": vars(args), "results": results}
    (out / "crash_resume.json").write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if all(r["audit"]["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
