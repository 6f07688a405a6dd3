"""The rollout plan: the one contract between a learner, the rollout service's HTTP API and its manager.

`RolloutPlan` is written once, here. Each field carries its HTTP bounds (`wire` metadata: pydantic `Field`
keywords), and `request_model` builds the service's pydantic request model from it, so the field list, the
defaults and the bounds have one definition. The admission settings travel flat on the wire (`admission`,
`max_staleness`, `max_in_flight`, `hard_staleness`, `batch_size`) and are read in Python as one object,
`RolloutPlan.policy()` (rollout/admission.py: AdmissionPolicy); a learner fills them from its policy whole
(`RolloutPlan.with_policy`).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any

from sao_core.rollout.admission import DEFAULT_RULE, Admission, AdmissionError, AdmissionPolicy
from sao_core.rollout.engines.base import SamplingParams, check_training_sampling

#: the largest seed a request may give: 2^53 - 1, the largest integer every JSON client (and JSON-schema
#: tools, which compare bounds as floats) holds exactly; the engines themselves take [0, 2^63)
SEED_MAX = 2**53 - 1


class RolloutError(ValueError):
    """A request the manager cannot honour; the message says why (HTTP 4xx)."""


def _wire(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING,
          item: dict[str, Any] | None = None, **bounds: Any) -> Any:
    """A plan field with a default (or a default `factory`) and its HTTP bounds: `bounds` are pydantic `Field`
    keywords (ge, le, gt, min_length, max_length, description), `item` the bounds of each list item."""
    metadata = {"wire": bounds, "item": item or {}}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class RolloutPlan:
    """What to roll out. `rollouts_per_prompt` = 1 for SAO, G for GRPO groups (started together)."""

    # prepared rl dataset (directory, data.jsonl or s3://)
    dataset: str = _wire(min_length=1, description="prepared rl dataset: directory, data.jsonl or s3:// URI")
    rollouts_per_prompt: int = _wire(1, ge=1, le=1024)
    epochs: int = _wire(1, ge=0)                 # 0: cycle until stopped
    shuffle: bool = True
    seed: int = _wire(0, ge=0, le=SEED_MAX)
    limit: int | None = _wire(None, ge=1)        # use only the first N prompts
    max_in_flight: int = _wire(64, ge=1, le=100_000)   # episodes started and not yet acknowledged
    env_concurrency: dict[str, int] = field(default_factory=dict)   # per-environment running caps
    env_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    temperature: float = _wire(1.0, ge=0)
    top_p: float = _wire(1.0, gt=0, le=1)
    top_k: int = _wire(0, ge=0)
    max_new_tokens_per_turn: int = _wire(256, ge=1, le=1_000_000)
    max_total_tokens: int = _wire(4096, ge=1, le=10_000_000)
    episode_timeout_s: float = _wire(0.0, ge=0)
    # The learner's staleness bound S (versions) and admission rule (rollout/admission.py: AdmissionPolicy, the
    # one place their meaning is defined). With S set, an episode whose oldest untrained token is past the
    # policy's `abandon_after` ends before its next turn with finish_reason "stale" (delivered for the learner to
    # drop, with its whole group, as it would have been at the end), and under "fragments" its finished turns are
    # handed over as fragments. None: no learner bound; episodes always run to the end whole.
    max_staleness: int | None = _wire(None, ge=0, le=1_000_000, description=(
        "the learner's staleness bound S in weights versions (rollout/admission.py); None: episodes run to the end "
        "whole. With it an episode past the rule's bound ends before its next turn as 'stale'"))
    training: bool = True                        # training mode refuses non-default sampling
    # The prompt stream is one fixed sequence for a seed: position p = epoch × prompts + index in that
    # epoch's order. Services sharing a run take the positions p ≡ shard (mod num_shards); a plan
    # restarted for a resumed run rolls out the positions its learner still owes: those from start_position
    # on, except `skip_positions` (settled: trained or dropped, see learner/ledger.py).
    start_position: int = _wire(0, ge=0, description="skip prompt slots before this stream position")
    skip_positions: list[int] = _wire(
        factory=list, item={"ge": 0}, max_length=1_000_000,
        description="stream positions at or after start_position a resumed learner has settled already")
    # The learner's admission rule (AdmissionPolicy.rule). On the service, "requeue" accepts requeue requests
    # (POST /v1/trajectories/ack) and rolls such a position out once more; "fragments" cuts long episodes.
    admission: Admission = _wire(
        DEFAULT_RULE, description="the learner's admission rule (rollout/admission.py); requeue lets acks re-queue a "
                                  "dropped position once; fragments cuts long episodes at turn boundaries")
    hard_staleness: int = _wire(0, ge=0, le=1_000_000, description="safety bound of no_drop / fragments in versions "
                                                                   "(0: 4 x max_staleness)")
    batch_size: int = _wire(0, ge=0, le=1_000_000, description="the learner's batch size B (fragments: generation "
                                                               "waits while its backlog is max(1, S - S//2 - 1)·B pieces)")
    # the stream's sharing (see start_position above)
    shard: int = _wire(0, ge=0, description="this service's share of the prompt stream (0-based)")
    num_shards: int = _wire(1, ge=1, le=100_000, description="services sharing one prompt stream")

    def with_policy(self, policy: AdmissionPolicy) -> RolloutPlan:
        """This plan for a learner bound by `policy`: its five settings become the plan's admission fields."""
        return dataclasses.replace(self, admission=policy.rule, max_staleness=policy.max_staleness,
                                   max_in_flight=policy.max_in_flight, hard_staleness=policy.hard_staleness,
                                   batch_size=policy.batch_size)

    def policy(self) -> AdmissionPolicy | None:
        """The admission policy of this plan (None without a learner bound: nothing abandoned or cut)."""
        if self.max_staleness is None:
            return None
        return self._admission()

    def _admission(self) -> AdmissionPolicy:
        """The plan's admission settings as one object (S = 0 when the plan has no learner bound)."""
        return AdmissionPolicy(self.admission, self.max_staleness or 0, self.max_in_flight, self.hard_staleness,
                               self.batch_size)

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens_per_turn)

    def validate(self) -> None:
        """RolloutError naming the first field (as plan.<name>) that cannot work."""
        self._check_counts()
        self._check_stream()
        self._check_admission()
        self._check_sampling()

    def _check_counts(self) -> None:
        for name in ("rollouts_per_prompt", "max_in_flight", "max_new_tokens_per_turn", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise RolloutError(f"plan.{name} must be >= 1, got {getattr(self, name)}")
        if self.epochs < 0:
            raise RolloutError(f"plan.epochs must be >= 0, got {self.epochs}")
        if self.limit is not None and self.limit < 1:
            raise RolloutError(f"plan.limit must be >= 1, got {self.limit}")

    def _check_stream(self) -> None:
        if self.start_position < 0 or self.num_shards < 1 or not 0 <= self.shard < self.num_shards:
            raise RolloutError(f"plan needs start_position >= 0 and 0 <= shard < num_shards, got "
                               f"{self.start_position}, {self.shard}, {self.num_shards}")
        if any(p < 0 for p in self.skip_positions):
            raise RolloutError("plan.skip_positions must be stream positions (>= 0)")

    def _check_admission(self) -> None:
        try:
            self._admission().validate()
        except AdmissionError as err:
            raise RolloutError(f"plan.{err}") from None
        if self.admission == "fragments" and self.max_staleness is None:
            raise RolloutError("plan.admission 'fragments' needs plan.max_staleness (the bound the cuts keep)")
        if self.max_in_flight < self.rollouts_per_prompt:
            raise RolloutError(f"plan.max_in_flight ({self.max_in_flight}) must hold one prompt's "
                               f"{self.rollouts_per_prompt} rollouts (they are admitted together)")

    def _check_sampling(self) -> None:
        if any(v < 1 for v in self.env_concurrency.values()):
            raise RolloutError("plan.env_concurrency values must be >= 1")
        try:
            self.sampling().validate()
            if self.training:
                check_training_sampling(self.sampling())
        except ValueError as err:
            raise RolloutError(str(err)) from err


def request_model(name: str, base: type, checks: dict[str, tuple] | None = None) -> type:
    """The pydantic model of a plan in an HTTP request, built from RolloutPlan's fields: the same names, types
    and defaults, each with its `wire` bounds. `base`: the model's base class (its config, e.g. extra="forbid");
    `checks`: extra pydantic metadata per field name (e.g. an AfterValidator the service adds)."""
    from pydantic import Field, create_model

    hints = typing.get_type_hints(RolloutPlan)
    fields = {}
    for f in dataclasses.fields(RolloutPlan):
        annotation = hints[f.name]
        item = f.metadata.get("item")
        if item:
            annotation = list[Annotated[typing.get_args(annotation)[0], Field(**item)]]
        for check in (checks or {}).get(f.name, ()):
            annotation = Annotated[annotation, check]
        bounds = dict(f.metadata.get("wire", {}))
        if f.default_factory is not dataclasses.MISSING:
            bounds["default_factory"] = f.default_factory
        elif f.default is not dataclasses.MISSING:
            bounds["default"] = f.default
        fields[f.name] = (annotation, Field(**bounds))
    return create_model(name, __base__=base, **fields)
