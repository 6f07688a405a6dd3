"""The admission policy of an asynchronous RL run: how many episodes run at once, which finished pieces a batch
takes and in what order, what is dropped as stale, what is rolled out again and when a running episode is cut into
a fragment. One object, shared by the learner (`learner/pending.py`, `learner/loop.py`), the rollout plan
(`rollout/manager.py`, the HTTP service) and the tests, so the bound S has one name end to end: `max_staleness`.

Lag. A token sampled with weights version v and trained by the learner at version V has lag V − v (versions).
`max_staleness` (S) is the bound a run promises for that lag. With (S + 1)·B episodes in flight the mean lag is
about S whatever the rule (Little's law); the rules differ in who pays (README "Admission"):

  window         arrival order; a trajectory whose oldest token is older than S is dropped (the long episodes:
                 a sample biased towards short ones)
  version_order  the oldest admission cohort first, never an episode admitted after one still running (nothing
                 goes stale, but the learner waits for each cohort's slowest episode)
  requeue        window, and a position dropped as stale is rolled out once more with fresh weights
  no_drop        arrival order and no staleness drop: nothing is waited for or dropped, but the early tokens of
                 a long episode run past S (DIS guards them); an episode past the safety bound is still ended
  fragments      (SAO: needs the critic) an episode whose oldest untrained token reaches `fragment_after`
                 versions is cut at its last finished turn; that prefix is trained as a fragment, its advantages
                 bootstrapped from the critic's value at the cut, and the episode goes on. Batches take the
                 oldest untrained tokens first. Generation waits (at turn boundaries, still cutting fragments
                 that fall due) while the learner holds `backlog_cap` or more untrained pieces: a token's lag is
                 its age at the cut plus its wait for a batch, and the wait is the backlog over B. Nothing is
                 dropped, and the learner never waits while B pieces are ready.

The safety bound (`no_drop`, `fragments`): an episode whose oldest untrained token is more than `hard_staleness`
versions old (default 4·S) is ended before its next turn and dropped as stale, so a stuck tool or a runaway
episode cannot hold a slot for ever (the episode timeout, `episode_timeout_s`, bounds it in seconds).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

Admission = Literal["window", "version_order", "requeue", "no_drop", "fragments"]
RULES: tuple[str, ...] = typing.get_args(Admission)
#: The admission setting's help (README "Admission"), the one text the CLI, the components and pipelines show.
ADMISSION_HELP = (
    "How the run admits episodes and batches them: no_drop, window, version_order, requeue or fragments. "
    "no_drop (the default): arrival order, nothing dropped or waited for, the early tokens of long episodes may "
    "lag more than S (DIS guards them; an episode older than the safety bound hard_staleness, default 4·S, is "
    "dropped); window: (S+1)·B episodes in flight, trained in arrival order, stale ones dropped; version_order: "
    "the oldest admission cohort first, never an episode admitted after one still running (nothing stale; the "
    "learner waits for each cohort); requeue: window, and a prompt dropped as stale is rolled out once more; "
    "fragments (sao only): long episodes are trained in pieces cut at turn boundaries, advantages bootstrapped "
    "from the critic (fewer tokens beyond S than no_drop, at a lower throughput).")
# Rules whose trajectories are dropped when their oldest token is more than S versions old.
DROPPING_RULES = ("window", "version_order", "requeue")
# The methods that can train a fragment: its advantages are bootstrapped from a learned critic.
FRAGMENT_METHODS = ("sao",)
DEFAULT_RULE = "no_drop"   # README "Admission": fastest trained tokens/s, unbiased, learns as window does
#: S's default, in weights versions: the one place it is written (RLConfig's setting, the policy and the simulator
#: read it)
DEFAULT_MAX_STALENESS = 4
# The safety bound of the non-dropping rules, in multiples of S (when hard_staleness is 0).
HARD_BOUND_FACTOR = 4


class AdmissionError(ValueError):
    """An admission setting that cannot work; the message names the field."""


@dataclass(frozen=True)
class AdmissionPolicy:
    """The admission settings of one rollout service's plan (and of the learner that consumes it).

    rule: one of RULES.
    max_staleness: S, in weights versions (the bound on a trained token's lag).
    max_in_flight: episodes started and not yet settled on this service (running, or a piece of them
        ready / taken and not acknowledged); a GRPO group counts G.
    hard_staleness: the safety bound of `no_drop` / `fragments`, in versions (0: 4·S, at least 1).
    batch_size: B, pieces per learner step (0: unknown; `fragments` then has no backlog cap)."""

    rule: str = DEFAULT_RULE
    max_staleness: int = DEFAULT_MAX_STALENESS
    max_in_flight: int = 64
    hard_staleness: int = 0
    batch_size: int = 0

    def validate(self) -> None:
        if self.rule not in RULES:
            raise AdmissionError(f"admission must be one of {', '.join(RULES)}, got {self.rule!r}")
        for name in ("max_staleness", "hard_staleness"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise AdmissionError(f"{name} must be an integer >= 0 (versions), got {value!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 0:
            raise AdmissionError(f"batch_size must be an integer >= 0 (pieces per learner step), got {self.batch_size!r}")
        if isinstance(self.max_in_flight, bool) or not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise AdmissionError(f"max_in_flight must be an integer >= 1 (episodes), got {self.max_in_flight!r}")
        if self.hard_staleness and self.hard_staleness < self.max_staleness:
            raise AdmissionError(f"hard_staleness ({self.hard_staleness}) must be 0 (auto) or >= max_staleness "
                                 f"({self.max_staleness})")

    # ------------------------------------------------------------------ what the rule does
    @property
    def drops_stale(self) -> bool:
        """Whether a trajectory with a token older than S versions is dropped (whole, with its group)."""
        return self.rule in DROPPING_RULES

    @property
    def requeues(self) -> bool:
        return self.rule == "requeue"

    @property
    def fragments(self) -> bool:
        return self.rule == "fragments"

    @property
    def order(self) -> str:
        """How a batch is chosen from the pieces the learner holds: "arrival", "admission" (the oldest admission
        cohort, waiting for running episodes of it) or "oldest_token" (the oldest untrained token first)."""
        return {"version_order": "admission", "fragments": "oldest_token"}.get(self.rule, "arrival")

    @property
    def abandon_after(self) -> int:
        """The service ends an episode before its next turn once its oldest untrained token is more than this
        many versions behind the weights (it could not be trained under a dropping rule; past the safety bound
        under the others)."""
        if self.drops_stale:
            return self.max_staleness
        return self.hard_staleness or max(1, HARD_BOUND_FACTOR * self.max_staleness)

    @property
    def fragment_after(self) -> int:
        """`fragments`: an episode is cut at a turn boundary once its oldest untrained token is this many
        versions old: half of S (at least 1), leaving the other half for the fragment's wait for a batch and
        the turn in progress, which cannot be cut."""
        return max(1, self.max_staleness // 2)

    @property
    def backlog_cap(self) -> int | None:
        """`fragments`: generation waits while this many pieces or more are ready or taken and not acknowledged
        (the learner's backlog): max(1, S − fragment_after − 1)·B. A piece cut at `fragment_after` versions waits
        one version for the step in progress and about backlog / B more for its batch (oldest first), so it is
        trained within S. None: no cap (other rules, or B unknown). At least B, so the learner always has a
        batch while generation waits."""
        if not self.fragments or not self.batch_size:
            return None
        return max(1, self.max_staleness - self.fragment_after - 1) * self.batch_size

    # ------------------------------------------------------------------ decisions
    def too_stale(self, lag: int) -> bool:
        """Whether the learner drops a trajectory whose oldest token has lag `lag` (versions) at training."""
        return lag > (self.max_staleness if self.drops_stale else self.abandon_after)

    def abandon_due(self, oldest_untrained: int, current: int) -> bool:
        """The service's check before a turn: `oldest_untrained` is the weights version of the episode's oldest
        sampled token not yet delivered in a fragment, `current` the service's version."""
        return current - oldest_untrained > self.abandon_after

    def fragment_due(self, oldest_untrained: int, current: int) -> bool:
        """The service's check at a turn boundary: cut the finished turns off as a fragment now."""
        return self.fragments and current - oldest_untrained >= self.fragment_after


def check_method(policy: AdmissionPolicy, method: str) -> None:
    """`fragments` needs a critic to bootstrap from (AdmissionError for the other methods)."""
    if policy.fragments and method not in FRAGMENT_METHODS:
        raise AdmissionError(f"admission 'fragments' needs a learned critic to bootstrap a fragment's advantages "
                             f"({', '.join(FRAGMENT_METHODS)}); {method!r} trains whole episodes: use no_drop, "
                             "version_order, window or requeue")
