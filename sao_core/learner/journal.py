"""The learner's journal under ``<output>/journal/``: what was trained and what was dropped, written before
the rollout services are told (acknowledged), so a crash never loses the record of either.

    step-NNNNNN.json          the batch of learner step N (trajectories, with their stream positions)
    drop-NNNNNN-MMM.json      trajectories dropped after step N (the M-th such record after that step):
                              [{"id", "position", "sample_index", "attempt", "reason", "requeue"}]
                              (requeue: the position is rolled out once more, so it stays owed)

`audit` checks a run's whole record against the stream-accounting invariant (see `ledger`).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from sao_core import storage
from sao_core.learner.ledger import StreamLedger
from sao_core.training.checkpointing import STATE_FILE, step_name

_STEP = re.compile(r"^step-(\d+)\.json$")
_DROP = re.compile(r"^drop-(\d+)-(\d+)\.json$")


def journal_dir(output: str) -> str:
    return storage.join(output, "journal")


def step_uri(output: str, step: int) -> str:
    return storage.join(journal_dir(output), f"{step_name(step)}.json")


def drop_uri(output: str, after_step: int, index: int) -> str:
    return storage.join(journal_dir(output), f"drop-{after_step:06d}-{index:03d}.json")


def write_step(output: str, step: int, version_before: int, trajectories: list) -> None:
    storage.write_text(step_uri(output, step), json.dumps(
        {"step": step, "version_before": version_before, "ids": [t.id for t in trajectories],
         "trajectories": [t.to_dict() for t in trajectories]}))


def read_step(output: str, step: int) -> dict[str, Any] | None:
    uri = step_uri(output, step)
    return json.loads(storage.read_text(uri)) if storage.exists(uri) else None


def write_drops(output: str, after_step: int, index: int, records: list[dict[str, Any]]) -> None:
    storage.write_text(drop_uri(output, after_step, index), json.dumps(records))


def read_drops(output: str, after_step: int) -> list[list[dict[str, Any]]]:
    """The drop records written after `after_step`, in order (index 0, 1, ... until one is missing)."""
    out = []
    while True:
        uri = drop_uri(output, after_step, len(out))
        if not storage.exists(uri):
            return out
        out.append(json.loads(storage.read_text(uri)))


def audit(output: str) -> dict[str, Any]:
    """Check a run's journal against the stream-accounting invariant: every position up to the last one
    trained is trained exactly once, dropped with a recorded reason, or still owed by the newest ledger (so the
    next plan rolls it out); no (position, rollout) is trained twice; nothing is both trained and dropped.

    The newest checkpoint's ledger is compared with the journal when it was written at the last journaled
    step (the end of a finished run); `ok` is False with the reasons in `problems` otherwise."""
    names = storage.list_files(journal_dir(output))
    trained: Counter = Counter()             # (position, sample_index) -> times trained
    trained_positions: set[int] = set()
    dropped: dict[int, str] = {}
    ids: Counter = Counter()
    last_step = 0
    requeued = 0
    problems: list[str] = []
    for name in names:
        if m := _STEP.match(name):
            entry = json.loads(storage.read_text(storage.join(journal_dir(output), name)))
            last_step = max(last_step, int(m.group(1)))
            for t in entry["trajectories"]:
                position = t.get("metadata", {}).get("position")
                if position is None:
                    problems.append(f"{name}: trajectory {t['id']} has no stream position")
                    continue
                trained[(position, t.get("sample_index", 0))] += 1
                trained_positions.add(position)
                ids[t["id"]] += 1
        elif _DROP.match(name):
            for record in json.loads(storage.read_text(storage.join(journal_dir(output), name))):
                if record.get("requeue"):      # rolled out once more: still owed, not a drop
                    requeued += 1
                    continue
                if dropped.get(record["position"], "group") == "group":  # a group's own reason wins
                    dropped[record["position"]] = record["reason"]
    twice = sorted(k for k, n in trained.items() if n > 1)
    if twice:
        problems.append(f"{len(twice)} (position, rollout) pairs trained more than once, e.g. {twice[:5]}")
    both = sorted(trained_positions & set(dropped))
    if both:
        problems.append(f"{len(both)} positions both trained and dropped, e.g. {both[:5]}")
    frontier = max(trained_positions, default=-1) + 1
    unsettled = [p for p in range(frontier) if p not in trained_positions and p not in dropped]

    ledger, ledger_step = _newest_ledger(output)
    skipped: list[int] = []
    if ledger is None:
        problems.append("no checkpoint")
    else:
        # A position the ledger counts as settled must have a record; one it owes must have none.
        skipped = [p for p in unsettled if ledger.is_settled(p)]
        if skipped:
            problems.append(f"{len(skipped)} positions skipped (settled in the ledger, never trained or dropped), "
                            f"e.g. {skipped[:5]}")
        if ledger_step == last_step:
            unrecorded = [p for p in set(trained_positions) | set(dropped) if not ledger.is_settled(p)]
            if unrecorded:
                problems.append(f"{len(unrecorded)} journaled positions the final ledger still owes, "
                                f"e.g. {sorted(unrecorded)[:5]}")
    return {"ok": not problems, "problems": problems, "steps": last_step, "trained_trajectories": sum(trained.values()),
            "trained_positions": len(trained_positions), "dropped_positions": len(dropped),
            "dropped_by_reason": dict(Counter(dropped.values())), "requeued": requeued, "frontier": frontier,
            "owed": [p for p in unsettled if p not in skipped], "skipped": skipped,
            "ledger_step": ledger_step, "duplicate_ids": sorted(i for i, n in ids.items() if n > 1)}


def _newest_ledger(output: str) -> tuple[StreamLedger | None, int | None]:
    latest = storage.latest_checkpoint(storage.join(output, "checkpoints"))
    if latest is None:
        return None, None
    state = json.loads(storage.read_text(storage.join(latest, STATE_FILE)))
    if "stream" not in state:  # written before stream accounting: all before data_position counted as done
        return StreamLedger.from_position(state.get("data_position", 0)), state.get("step")
    return StreamLedger.from_state(state["stream"]), state.get("step")

