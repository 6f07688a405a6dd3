"""Crash and resume: kill -9 the learner at random steps, resume each time, and check the stream invariant.

For each placement of the rollout service,

  colocated  the service runs inside the learner's process (the default of the KFP components): a kill
             takes both down, and the resumed learner starts a new plan from its ledger
  external   the service runs on its own (here: a thread of this process) and survives every kill; the
             resumed learner reconnects to its running plan

one run of `--steps` learner steps is killed with SIGKILL at `--kills` distinct random steps (each kill
after a random delay inside the step, so it lands anywhere in train / journal / push / ack / checkpoint)
and resumed with `--resume` after each; the last resume runs to the end. Then `sao_core.learner.journal.audit`
checks, from the journals and the final ledger: no (position, rollout) trained twice, every position up to
the last one trained is trained, dropped with a recorded reason or still owed, none skipped.

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

from sao_core.learner import journal  # noqa: E402

PLACEMENTS = ("colocated", "external")


def learner_command(data: str, output: Path, model: str, steps: int, batch_size: int, services: list[str],
                    method: str = "sao", admission: str = "window", env_options: dict | None = None,
                    max_total_tokens: int = 80, max_new_tokens_per_turn: int = 12) -> list[str]:
    """The `sao train-rl` command line of one learner incarnation (small and fast on CPU)."""
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


def crash_run(placement: str, kills: int, steps: int, seed: int, root: Path, model: str, data: str,
              cache_dir: str, batch_size: int = 8, method: str = "sao", admission: str = "window",
              timeout_s: float = 300.0, env_options: dict | None = None, max_total_tokens: int = 80,
              max_new_tokens_per_turn: int = 12) -> dict:
    """One run of `steps` learner steps with `kills` SIGKILLs at random distinct steps and a resume after
    each; returns the kill points, the final summary and the audit of its journal."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if not 1 <= kills <= steps - 4:
        raise ValueError(f"kills must be between 1 and steps - 4 = {steps - 4}, got {kills}")
    rng = random.Random(seed)
    # The last kill lands at least 4 steps before the end, so a fast learner cannot finish before it.
    kill_steps = sorted(rng.sample(range(1, steps - 3), kills))
    output = root / f"{placement}-{method}-{admission}"
    scratch_root = root / f"tmp-{placement}-{method}-{admission}"   # the learners' $TMPDIR: their scratch folders
    scratch_root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SAO_CACHE_DIR": cache_dir, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch_root)}
    server = None
    services: list[str] = []
    if placement == "external":
        from sao_core.rollout.server import RolloutServer, ServeConfig

        server = RolloutServer(ServeConfig(model=model, port=0, cache_dir=cache_dir,
                                           allowed_weight_roots=[str(output / "weights")])).start()
        services = [server.url]
    cmd = learner_command(data, output, model, steps, batch_size, services, method, admission, env_options,
                          max_total_tokens, max_new_tokens_per_turn)
    killed: list[dict] = []
    began = time.monotonic()
    try:
        for i, at in enumerate(kill_steps):
            proc = subprocess.Popen(cmd + (["--resume"] if i else []), env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + timeout_s
            while _metrics_lines(output) < at and proc.poll() is None:
                if time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"{placement}: the learner did not reach step {at} in {timeout_s:.0f} s")
                time.sleep(0.02)
            if proc.poll() is not None:
                raise RuntimeError(f"{placement}: the learner exited (code {proc.returncode}) before its kill at "
                                   f"step {at}: {proc.stderr.read()[-2000:]}")
            time.sleep(rng.uniform(0.0, 0.1))    # anywhere in the step: train, journal, push, ack, checkpoint
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed.append({"planned_step": at, "metrics_lines": _metrics_lines(output),
                           "journal_steps": _journal_steps(output)})
        scratch_after_kills = _scratch(scratch_root)
        final = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=timeout_s)
        if final.returncode != 0:
            raise RuntimeError(f"{placement}: the final resume failed: {final.stderr[-3000:]}")
        summary = json.loads(final.stdout[final.stdout.index("{"):])
        service = None
        if server is not None:
            from sao_core.rollout.client import RolloutClient

            client = RolloutClient(server.url)
            status = client.status()
            client.close()
            service = {k: status[k] for k in ("acknowledged", "dropped_by_learner", "version", "redelivered")}
    finally:
        if server is not None:
            server.stop()
    audit = journal.audit(str(output))
    lines = [json.loads(x) for x in (output / "metrics.jsonl").read_text().splitlines()]
    return {"placement": placement, "method": method, "admission": admission, "steps": steps, "kills": killed,
            "seconds": round(time.monotonic() - began, 1), "summary_steps": summary["steps"],
            "summary_trained": summary["trained_trajectories"], "metrics_steps": [r["step"] for r in lines],
            "replayed_lines": sum(1 for r in lines if r.get("replayed")),
            "version": summary["version"], "stream": summary.get("stream"), "service": service, "audit": audit,
            "scratch_after_kills": scratch_after_kills, "scratch_left": _scratch(scratch_root),
            "checkpoints_left": sorted(p.name for p in (output / "checkpoints").iterdir()),
            "split_by_kills": split_by_kills(output, killed),
            "dropped_by_reason": summary.get("dropped_by_reason", {})}


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
    for i, placement in enumerate(args.placements.split(",")):
        result = crash_run(placement, args.kills, args.steps, args.seed + i, work, model, str(work / "rl"), cache,
                           args.batch_size, args.method, args.admission)
        a = result["audit"]
        print(f"{placement}: {len(result['kills'])} kills at steps {[k['metrics_lines'] for k in result['kills']]}, "
              f"{a['trained_trajectories']} trained, {a['dropped_positions']} dropped {a['dropped_by_reason']}, "
              f"{len(a['owed'])} owed at the end, {len(a['skipped'])} skipped, "
              f"{len(a['duplicate_ids'])} trained twice: {'ok' if a['ok'] else a['problems']} ({result['seconds']} s)")
        results.append(result)
    payload = {"conditions": _setup.conditions(), "args": vars(args), "results": results}
    (out / "crash_resume.json").write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if all(r["audit"]["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
