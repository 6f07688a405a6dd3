"""The learner's journal under ``<output>/journal/``: what was trained and what was dropped, written before
the rollout services are told (acknowledged), so a crash never loses the record of either.

    step-NNNNNN.json          the batch of learner step N: {"step", "version_before", "ids", "trajectories"
                              (with their stream positions), "sha256"}
    drop-NNNNNN-MMM.json      trajectories dropped after step N (the M-th such record after that step):
                              {"after_step", "index", "records": [{"id", "position", "sample_index", "attempt",
                              "reason", "requeue"}], "sha256"}
                              (requeue: the position is rolled out once more, so it stays owed)
    plan-NNNNNN.json          the N-th plan a rollout service accepted: {"index", "after_step", "shard",
                              "num_shards", "start_position", "skip_positions", "ledger" (the learner's
                              stream ledger when it was sent), "sha256"}

Integrity. ``sha256`` is the digest of the entry's other fields as canonical JSON (sorted keys, no spaces);
`read_step` and `read_drops` recompute it, and check that the entry names the step (and index) of its file,
so a changed digit, a truncated file or bad JSON stops a resume with a `JournalError` naming the file and the
step. Entries written before digests (a step object without ``sha256``, a drop file that is a bare list) are
refused unless the caller passes ``unverified`` (``--unverified``), then replayed unchecked with a warning.

`audit` checks a run's whole record against the stream-accounting invariant (see `ledger`), the plans included:
every position still owed at the end must be covered by the newest plan sent to its shard (from its
``start_position`` on, not in its ``skip_positions``), else it was skipped; an entry that fails its check is one
of its problems.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sao_core import storage
from sao_core.learner.ledger import StreamLedger
from sao_core.training.checkpointing import STATE_FILE, step_name

_STEP = re.compile(r"^step-(\d+)\.json$")
_DROP = re.compile(r"^drop-(\d+)-(\d+)\.json$")
_PLAN = re.compile(r"^plan-(\d+)\.json$")
DIGEST_KEY = "sha256"

log = logging.getLogger(__name__)


class JournalError(ValueError):
    """A journal entry is unreadable, damaged or changed; the message names the file and the step."""


def _canonical(payload: dict[str, Any]) -> str:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _sealed(payload: dict[str, Any]) -> str:
    """The entry as canonical JSON with its sha256 appended as the last field (one serialisation)."""
    text = _canonical(payload)
    return f'{text[:-1]},"{DIGEST_KEY}":"{_digest(text)}"}}'


def _read_entry(uri: str, what: str, unverified: bool) -> Any:
    """The checked content of one journal entry, without its digest. `what` names the entry in errors."""
    try:
        text = storage.read_text(uri)
    except storage.StorageError as err:
        raise JournalError(f"journal entry {uri} ({what}) cannot be read: {err}") from err
    try:
        data = json.loads(text)
    except ValueError as err:
        raise JournalError(f"journal entry {uri} ({what}) is not valid JSON: truncated or damaged ({err}); "
                           "restore it from a copy: the run cannot be resumed exactly past it") from None
    if isinstance(data, dict) and DIGEST_KEY in data:
        recorded = data.pop(DIGEST_KEY)
        if _digest(_canonical(data)) != recorded:
            raise JournalError(f"journal entry {uri} ({what}) does not match its sha256: it was changed after it "
                               "was written; restore it from a copy: the run cannot be resumed exactly past it")
        return data
    if not unverified:
        raise JournalError(f"journal entry {uri} ({what}) has no sha256 (written before journal digests), so it "
                           "cannot be checked; resume with --unverified (config field unverified: true) to replay "
                           "it unchecked")
    log.warning("replaying journal entry %s (%s) unchecked: it has no sha256 (--unverified)", uri, what)
    return data


def journal_dir(output: str) -> str:
    return storage.join(output, "journal")


def step_uri(output: str, step: int) -> str:
    return storage.join(journal_dir(output), f"{step_name(step)}.json")


def drop_uri(output: str, after_step: int, index: int) -> str:
    return storage.join(journal_dir(output), f"drop-{after_step:06d}-{index:03d}.json")


def write_step(output: str, step: int, version_before: int, trajectories: list) -> None:
    storage.write_text(step_uri(output, step), _sealed(
        {"step": step, "version_before": version_before, "ids": [t.id for t in trajectories],
         "trajectories": [t.to_dict() for t in trajectories]}))


def _check_step(uri: str, entry: Any, step: int) -> dict[str, Any]:
    if not isinstance(entry, dict) or entry.get("step") != step or not isinstance(entry.get("trajectories"), list):
        found = entry.get("step") if isinstance(entry, dict) else type(entry).__name__
        raise JournalError(f"journal entry {uri} (step {step}) is malformed: expected the trajectories of step "
                           f"{step}, found step {found!r}")
    return entry


def read_step(output: str, step: int, unverified: bool = False) -> dict[str, Any] | None:
    """The checked entry of learner step `step`, or None if there is none (JournalError if it is bad)."""
    uri = step_uri(output, step)
    if not storage.exists(uri):
        return None
    return _check_step(uri, _read_entry(uri, f"step {step}", unverified), step)


def write_drops(output: str, after_step: int, index: int, records: list[dict[str, Any]]) -> None:
    storage.write_text(drop_uri(output, after_step, index),
                       _sealed({"after_step": after_step, "index": index, "records": records}))


def plan_uri(output: str, index: int) -> str:
    return storage.join(journal_dir(output), f"plan-{index:06d}.json")


def count_plans(output: str) -> int:
    """How many plans the run's journal holds (the index of the next one)."""
    try:
        return sum(1 for name in storage.list_files(journal_dir(output)) if _PLAN.match(name))
    except storage.StorageError:
        return 0


def write_plan(output: str, index: int, after_step: int, shard: int, num_shards: int, stream: dict[str, Any],
               ledger: dict[str, Any]) -> None:
    """Journal the `index`-th plan a service accepted (its stream fields and the ledger they came from)."""
    storage.write_text(plan_uri(output, index), _sealed(
        {"index": index, "after_step": after_step, "shard": shard, "num_shards": num_shards,
         "start_position": int(stream.get("start_position", 0)),
         "skip_positions": sorted(int(p) for p in stream.get("skip_positions", [])), "ledger": ledger}))


def _check_plan(uri: str, entry: Any, index: int) -> dict[str, Any]:
    if not isinstance(entry, dict) or entry.get("index") != index or not all(
            isinstance(entry.get(k), int) for k in ("shard", "num_shards", "start_position")) or \
            not isinstance(entry.get("skip_positions"), list):
        raise JournalError(f"journal entry {uri} (plan {index}) is malformed: expected plan {index}'s shard, "
                           "num_shards, start_position and skip_positions")
    return entry


def _covers(plan: dict[str, Any], position: int) -> bool:
    """Whether `plan` rolls out stream `position`: its shard's, from its start, not skipped."""
    return (position % plan["num_shards"] == plan["shard"] and position >= plan["start_position"]
            and position not in plan["skip_set"])


def _drop_records(uri: str, entry: Any, after_step: int, index: int) -> list[dict[str, Any]]:
    if isinstance(entry, list):          # written before digests (accepted only unverified)
        records = entry
    elif isinstance(entry, dict) and entry.get("after_step") == after_step and entry.get("index") == index:
        records = entry.get("records")
    else:
        records = None
    if not isinstance(records, list) or not all(isinstance(r, dict) and "position" in r for r in records):
        raise JournalError(f"journal entry {uri} (drops after step {after_step}) is malformed: expected drop record "
                           f"{index} after step {after_step}")
    return records


def read_drops(output: str, after_step: int, unverified: bool = False) -> list[list[dict[str, Any]]]:
    """The checked drop records written after `after_step`, in order (index 0, 1, ... until one is missing)."""
    out = []
    while True:
        uri = drop_uri(output, after_step, len(out))
        if not storage.exists(uri):
            return out
        entry = _read_entry(uri, f"drops after step {after_step}", unverified)
        out.append(_drop_records(uri, entry, after_step, len(out)))


@dataclass
class _JournalRecord:
    """What a run's journal holds, read entry by entry for `audit`; an entry that fails its check is a problem."""

    trained: Counter = field(default_factory=Counter)   # (position, sample_index, piece) -> times trained
    pieces: dict[tuple[int, int], set[int]] = field(default_factory=dict)   # (position, sample) -> pieces trained
    last_piece: dict[tuple[int, int], int] = field(default_factory=dict)    # (position, sample) -> its last piece
    trained_positions: set[int] = field(default_factory=set)
    dropped: dict[int, str] = field(default_factory=dict)     # position -> drop reason
    ids: Counter = field(default_factory=Counter)
    last_step: int = 0
    requeued: int = 0
    plans: dict[int, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, output: str) -> _JournalRecord:
        record = cls()
        for name in storage.list_files(journal_dir(output)):
            uri = storage.join(journal_dir(output), name)
            try:
                if m := _STEP.match(name):
                    record.add_step(name, _check_step(uri, _read_entry(uri, f"step {int(m.group(1))}", True),
                                                      int(m.group(1))))
                elif m := _PLAN.match(name):
                    plan = _check_plan(uri, _read_entry(uri, f"plan {int(m.group(1))}", True), int(m.group(1)))
                    record.plans[int(m.group(1))] = {**plan, "skip_set": set(plan["skip_positions"])}
                elif m := _DROP.match(name):
                    after, index = int(m.group(1)), int(m.group(2))
                    record.add_drops(_drop_records(uri, _read_entry(uri, f"drops after step {after}", True), after,
                                                   index))
            except JournalError as err:
                record.problems.append(str(err))
        return record

    def add_step(self, name: str, entry: dict[str, Any]) -> None:
        """Count the trajectories of a checked step entry (file `name`)."""
        self.last_step = max(self.last_step, entry["step"])
        for t in entry["trajectories"]:
            metadata = t.get("metadata", {})
            position = metadata.get("position")
            if position is None:
                self.problems.append(f"{name}: trajectory {t['id']} has no stream position")
                continue
            episode = (position, t.get("sample_index", 0))
            index = int(metadata.get("fragment", 0))
            self.trained[(*episode, index)] += 1
            self.pieces.setdefault(episode, set()).add(index)
            if t.get("finish_reason") != "fragment":
                self.trained_positions.add(position)
                self.last_piece[episode] = index
            self.ids[t["id"]] += 1

    def add_drops(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            if record.get("requeue"):      # rolled out once more: still owed, not a drop
                self.requeued += 1
                continue
            if self.dropped.get(record["position"], "group") == "group":  # a group's own reason wins
                self.dropped[record["position"]] = record["reason"]

    def missing_pieces(self) -> list[tuple[int, int]]:
        """Episodes whose last piece was trained without every piece before it."""
        return sorted(k for k, last in self.last_piece.items() if not self.pieces[k] >= set(range(last + 1)))

    def check_training(self) -> None:
        """Nothing trained twice, no episode trained without all its fragments, nothing both trained and dropped."""
        twice = sorted(k for k, n in self.trained.items() if n > 1)
        if twice:
            self.problems.append(f"{len(twice)} (position, rollout, piece) triples trained more than once, "
                                 f"e.g. {twice[:5]}")
        missing = self.missing_pieces()
        if missing:
            self.problems.append(f"{len(missing)} episodes trained without all their fragments, e.g. {missing[:5]}")
        both = sorted(self.trained_positions & set(self.dropped))
        if both:
            self.problems.append(f"{len(both)} positions both trained and dropped, e.g. {both[:5]}")

    def check_ledger(self, ledger: StreamLedger | None, ledger_step: int | None, unsettled: list[int]) -> list[int]:
        """The positions of `unsettled` (neither trained nor dropped) that the newest `ledger` counts as settled:
        skipped. When the ledger was written at the last journaled step, every journaled position must be
        settled in it."""
        if ledger is None:
            self.problems.append("no checkpoint")
            return []
        # A position the ledger counts as settled must have a record; one it owes must have none.
        skipped = [p for p in unsettled if ledger.is_settled(p)]
        if skipped:
            self.problems.append(f"{len(skipped)} positions skipped (settled in the ledger, never trained or "
                                 f"dropped), e.g. {skipped[:5]}")
        if ledger_step == self.last_step:
            unrecorded = [p for p in self.trained_positions | set(self.dropped) if not ledger.is_settled(p)]
            if unrecorded:
                self.problems.append(f"{len(unrecorded)} journaled positions the final ledger still owes, "
                                     f"e.g. {sorted(unrecorded)[:5]}")
        return skipped

    def uncovered(self, owed: list[int]) -> list[int]:
        """The `owed` positions the newest plan sent to their shard does not roll out (an older plan of that
        shard was replaced by it): skipped, never to be rolled out."""
        if self.last_step and not self.plans:
            self.problems.append("no plan in the journal: the plans sent to the services cannot be checked (a run "
                                 "from before plans were journaled)")
        if not self.plans:
            return []
        newest = [self.plans[i] for i in sorted(self.plans, reverse=True)]
        none = {"num_shards": 1, "shard": 0, "skip_set": set()}
        uncovered = [p for p in owed if not _covers(next((q for q in newest if p % q["num_shards"] == q["shard"]),
                                                         {**none, "start_position": p + 1}), p)]
        if uncovered:
            self.problems.append(f"{len(uncovered)} owed positions no plan sent covers (skipped: never to be "
                                 f"rolled out), e.g. {uncovered[:5]}")
        return uncovered


def audit(output: str) -> dict[str, Any]:
    """Check a run's journal against the stream-accounting invariant: every position up to the last one
    trained is trained exactly once, dropped with a recorded reason, or still owed by the newest ledger (so the
    next plan rolls it out); no (position, rollout, piece) is trained twice; nothing is both trained and dropped.

    Fragments: a position counts as trained when its episode's last piece is, and every piece before it must be
    trained too (else `missing_pieces`); a position with only some pieces trained is owed, or settled with a
    drop reason (its episode failed or was lost after those pieces: not a problem).

    The newest checkpoint's ledger is compared with the journal when it was written at the last journaled
    step (the end of a finished run); `ok` is False with the reasons in `problems` otherwise."""
    record = _JournalRecord.read(output)
    record.check_training()
    frontier = max(record.trained_positions, default=-1) + 1
    unsettled = [p for p in range(frontier) if p not in record.trained_positions and p not in record.dropped]
    ledger, ledger_step = _newest_ledger(output)
    skipped = record.check_ledger(ledger, ledger_step, unsettled)
    owed = [p for p in unsettled if p not in skipped]
    uncovered = record.uncovered(owed)
    skipped = skipped + uncovered
    owed = [p for p in owed if p not in uncovered]
    return {"ok": not record.problems, "problems": record.problems, "steps": record.last_step,
            "trained_trajectories": sum(record.trained.values()),
            "trained_positions": len(record.trained_positions), "dropped_positions": len(record.dropped),
            "dropped_by_reason": dict(Counter(record.dropped.values())), "requeued": record.requeued,
            "frontier": frontier, "owed": owed, "skipped": skipped, "plans": len(record.plans),
            "ledger_step": ledger_step, "duplicate_ids": sorted(i for i, n in record.ids.items() if n > 1),
            "fragmented_episodes": sum(1 for k in record.last_piece if record.last_piece[k] > 0),
            "missing_pieces": record.missing_pieces()}


def _newest_ledger(output: str) -> tuple[StreamLedger | None, int | None]:
    latest = storage.latest_checkpoint(storage.join(output, "checkpoints"))
    if latest is None:
        return None, None
    state = json.loads(storage.read_text(storage.join(latest, STATE_FILE)))
    if "stream" not in state:  # written before stream accounting: all before data_position counted as done
        return StreamLedger.from_position(state.get("data_position", 0)), state.get("step")
    return StreamLedger.from_state(state["stream"]), state.get("step")

