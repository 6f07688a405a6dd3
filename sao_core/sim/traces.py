"""Episodes for the simulator from recorded trajectories: a jsonl of trajectories (e.g. the gen_only
arm's trajectories.jsonl of bench/async_vs_sync.py) or a learner journal directory (step-*.json)."""

from __future__ import annotations

import json
from pathlib import Path

from sao_core.sim.model import Episode, SimError


def load_episodes(path: str) -> list[Episode]:
    """Episodes of recorded trajectories (a jsonl of trajectories, e.g. gen_only/trajectories.jsonl, or a learner
    journal directory): action tokens per turn (runs of the action mask), prompt tokens, and tool seconds spread
    evenly over the turns that called a tool (seconds). SimError when `path` holds none."""
    source = Path(path)
    if not source.exists():
        raise SimError(f"recorded trajectories {source} do not exist")
    try:
        if source.is_dir():
            records = [t for p_ in sorted(source.glob("step-*.json"))
                       for t in json.loads(p_.read_text())["trajectories"]]
        else:
            records = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
        episodes = _episodes(records)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as err:
        raise SimError(f"{source} does not hold recorded trajectories (token_ids, action_mask): "
                       f"{type(err).__name__}: {err}") from None
    if not episodes:
        raise SimError(f"no trajectories with action tokens in {source}")
    return episodes


def _episodes(records: list[dict]) -> list[Episode]:
    episodes = []
    for t in records:
        runs, current, previous = [], 0, 0
        for m in t["action_mask"]:
            if m:
                current += 1
            elif previous:
                runs.append(current)
                current = 0
            previous = m
        if current:
            runs.append(current)
        if not runs:
            continue
        tool = t.get("timings", {}).get("tool_seconds", 0.0)
        gaps = max(1, len(runs) - 1)
        episodes.append(Episode(runs, [tool / gaps] * (len(runs) - 1), len(t["token_ids"]),
                                prompt_tokens=t["action_mask"].index(1)))
    return episodes

