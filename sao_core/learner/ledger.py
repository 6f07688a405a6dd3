"""Stream accounting: which prompt-stream positions a run has trained, dropped (and why) or still owes.

The prompt stream is one fixed sequence per seed (`RolloutPlan`): position p is rolled out by the service
of shard p mod K. Per shard the ledger keeps a low-water mark (every position of that shard below it is
settled) and the settled positions above it with their outcome, "trained" or a drop reason. A position is
*owed* while it is not settled; a restarted or rejoining plan starts at its shard's mark and skips the
settled positions above it (`plan_fields`), so it rolls out every owed position and none that is settled.
Only a few positions sit above a mark at a time (those that finished before an older one), so the state
stays small; it is saved in every checkpoint and rebuilt from the journal on resume.

Fragments (admission "fragments"): an episode may be trained in pieces 0..n (`Trajectory.fragment_index`). The
ledger keeps the trained piece indices of each unsettled position (`pieces`) and settles the position as trained
once every piece up to its last one is trained, whatever order they were trained in. A position whose episode was
lost after some of its pieces were trained (its service restarted) is settled with the drop reason
FRAGMENT_LOST: rolling it out again would train its prompt twice.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

TRAINED = "trained"
# The outcome of positions below a mark whose own outcome was not kept (a ledger converted from an older
# checkpoint that only knew "everything before this position is done", or after a change of shard count).
SETTLED = "settled"
# The outcome of a position whose episode was lost (its service restarted) after some of its fragments trained.
FRAGMENT_LOST = "fragment_lost"


class StreamLedger:
    """Outcomes of stream positions for `num_shards` interleaved shards (position p belongs to p mod K)."""

    def __init__(self, num_shards: int = 1):
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        self.num_shards = num_shards
        self.lows = list(range(num_shards))      # lows[r]: first unsettled position of shard r
        self.settled: dict[int, str] = {}        # settled positions above their shard's mark
        self.outcomes: Counter = Counter()       # positions per outcome over the whole run
        self.pieces: dict[int, dict[str, Any]] = {}   # unsettled positions with trained fragments:
                                                      # {"trained": set of piece indices, "last": index or None}

    # ------------------------------------------------------------------ queries
    def is_settled(self, position: int) -> bool:
        return position < self.lows[position % self.num_shards] or position in self.settled

    def outcome(self, position: int) -> str | None:
        """ "trained", a drop reason, SETTLED (below a mark, outcome not kept) or None (owed)."""
        if position in self.settled:
            return self.settled[position]
        return SETTLED if position < self.lows[position % self.num_shards] else None

    @property
    def frontier(self) -> int:
        """One past the highest settled position (0 when nothing is settled)."""
        highest = max([low - self.num_shards for low in self.lows] + list(self.settled), default=-1)
        return max(highest + 1, 0)

    @property
    def low_water_mark(self) -> int:
        """Every position below this one is settled."""
        return min(self.lows)

    def owed_count(self) -> int:
        """Unsettled positions below the frontier: running, finished but not trained, or lost in a crash."""
        frontier = self.frontier
        below = sum(max(0, -(-(frontier - low) // self.num_shards)) for low in self.lows)
        return below - len(self.settled)

    def owed(self, limit: int = 1000) -> list[int]:
        """The first `limit` owed positions below the frontier, ascending."""
        frontier, out = self.frontier, []
        for p in range(self.low_water_mark, frontier):
            if not self.is_settled(p):
                out.append(p)
                if len(out) >= limit:
                    break
        return out

    def has_piece(self, position: int, index: int) -> bool:
        """Whether piece `index` of `position` is trained (every piece of a settled position counts as done)."""
        if self.is_settled(position):
            return True
        return index in self.pieces.get(position, {}).get("trained", ())

    def partial(self, shard: int, num_shards: int) -> list[int]:
        """Unsettled positions of `shard` (of `num_shards`) with some pieces trained, ascending."""
        return sorted(p for p in self.pieces if p % num_shards == shard)

    # ------------------------------------------------------------------ updates
    def train_piece(self, position: int, index: int, last: bool) -> bool:
        """Piece `index` of `position` was trained (`last`: the episode's final piece); settles the position as
        trained once pieces 0..last all are. Returns whether the position is settled now."""
        if self.is_settled(position):
            return True
        if index == 0 and last:
            return self.settle(position, TRAINED)
        entry = self.pieces.setdefault(position, {"trained": set(), "last": None})
        entry["trained"].add(index)
        if last:
            entry["last"] = index
        if entry["last"] is not None and entry["trained"] >= set(range(entry["last"] + 1)):
            return self.settle(position, TRAINED)
        return False

    def settle(self, position: int, outcome: str) -> bool:
        """Record `outcome` for `position`; False (and no change) if it was settled already."""
        if position < 0:
            raise ValueError(f"stream positions are >= 0, got {position}")
        if self.is_settled(position):
            return False
        self.pieces.pop(position, None)
        self.settled[position] = outcome
        self.outcomes[outcome] += 1
        self._advance(position % self.num_shards)
        return True

    def _advance(self, shard: int) -> None:
        low = self.lows[shard]
        while low in self.settled:
            del self.settled[low]
            low += self.num_shards
        self.lows[shard] = low

    def reshard(self, num_shards: int) -> None:
        """Re-express the ledger for `num_shards` shards (a run resumed with another number of services).
        Positions below an old mark keep no outcome of their own (SETTLED)."""
        if num_shards == self.num_shards:
            return
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        base = self.low_water_mark
        explicit = dict(self.settled)
        for p in range(base, max(self.lows)):
            if p < self.lows[p % self.num_shards]:
                explicit[p] = SETTLED
        self.num_shards = num_shards
        self.lows = [base + (r - base) % num_shards for r in range(num_shards)]
        self.settled = explicit
        for shard in range(num_shards):
            self._advance(shard)

    def plan_fields(self, shard: int, num_shards: int) -> dict[str, Any]:
        """`start_position` and `skip_positions` of the plan for `shard` of `num_shards`: it then rolls out
        exactly the owed positions of its shard, and everything after."""
        self.reshard(num_shards)
        return {"start_position": self.lows[shard],
                "skip_positions": sorted(p for p in self.settled if p % num_shards == shard)}

    # ------------------------------------------------------------------ state
    def to_state(self) -> dict[str, Any]:
        return {"num_shards": self.num_shards, "lows": list(self.lows),
                "settled": {str(p): o for p, o in sorted(self.settled.items())},
                "outcomes": dict(self.outcomes), "owed": self.owed_count(),
                "pieces": {str(p): {"trained": sorted(e["trained"]), "last": e["last"]}
                           for p, e in sorted(self.pieces.items())}}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> StreamLedger:
        """The ledger of a checkpoint's `stream` entry; ValueError names what is malformed."""
        try:
            ledger = cls(int(state["num_shards"]))
            lows = [int(x) for x in state["lows"]]
            settled = {int(p): str(o) for p, o in state.get("settled", {}).items()}
            outcomes = Counter({str(k): int(v) for k, v in state.get("outcomes", {}).items()})
            pieces = {int(p): {"trained": {int(i) for i in e["trained"]},
                               "last": None if e.get("last") is None else int(e["last"])}
                      for p, e in state.get("pieces", {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"malformed stream ledger ({type(err).__name__}: {err})") from None
        if len(lows) != ledger.num_shards or any(low % ledger.num_shards != r or low < 0
                                                 for r, low in enumerate(lows)):
            raise ValueError(f"malformed stream ledger: lows {lows} do not fit {ledger.num_shards} shards")
        ledger.lows, ledger.settled, ledger.outcomes, ledger.pieces = lows, settled, outcomes, pieces
        for shard in range(ledger.num_shards):
            ledger._advance(shard)
        return ledger

    @classmethod
    def from_position(cls, data_position: int) -> StreamLedger:
        """A ledger for a checkpoint written before stream accounting: everything before `data_position`
        counts as settled (its outcomes are unknown)."""
        ledger = cls(1)
        ledger.lows = [max(0, int(data_position))]
        return ledger
