"""Delivery check of a weight push: after a rollout service loads a version, its log-probs for a fixed probe
sequence must equal the learner's at that version (within `delivery_tolerance`), or the run stops with an
error naming the service. A push the engine silently ignored (an adapter never applied, the wrong base, a
stale version) is caught here, before trajectories of another policy are trained on.

The probe is `delivery_check_tokens` token ids drawn once from the run's seed over the tokenizer's ids; the
learner scores them with its policy (no gradient, under its autocast), the service with `POST /v1/score`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sao_core.learner.errors import LearnerError


@dataclass(frozen=True)
class Probe:
    """The learner's log-probs of `token_ids[start:]` at weights `version`; a service passes when the mean
    absolute difference of its own is at most `tolerance` (nats per token)."""

    token_ids: list[int]
    start: int
    logprobs: list[float]
    version: int
    tolerance: float


def probe_tokens(vocab: int, length: int, seed: int) -> list[int]:
    """`length` token ids in [0, vocab) from a generator seeded with `seed` (the same in every run with it)."""
    generator = torch.Generator().manual_seed(seed + 7_919)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


def learner_logprobs(model, token_ids: list[int], start: int, autocast_ctx, device) -> list[float]:
    """The policy's log-probs of `token_ids[start:]` (no gradient; a collective forward under FSDP2)."""
    from sao_core.training.forward import model_logprobs

    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast_ctx:
            logp, _ = model_logprobs(model, ids)
    finally:
        model.train(was_training)
    return logp[0, start:].float().cpu().tolist()


def compare(answer: dict, probe: Probe, url: str) -> dict[str, float]:
    """{"mean", "max"} |service − learner| over the probe; LearnerError naming the service when the service
    scored another version or the mean exceeds the tolerance."""
    theirs = answer.get("logprobs") or []
    if answer.get("version") != probe.version or len(theirs) != len(probe.logprobs):
        raise LearnerError(f"delivery check: rollout service {url} scored the probe at version "
                           f"{answer.get('version')} ({len(theirs)} log-probs); the learner pushed version "
                           f"{probe.version} ({len(probe.logprobs)} expected)")
    diffs = [abs(a - b) for a, b in zip(theirs, probe.logprobs, strict=True)]
    mean, most = sum(diffs) / len(diffs), max(diffs)
    if not mean <= probe.tolerance:
        raise LearnerError(
            f"delivery check: rollout service {url} does not serve the learner's weights version {probe.version}: "
            f"its log-probs of the {len(diffs)}-token probe differ from the learner's by {mean:.4g} nats per "
            f"token on average (max {most:.4g}; delivery_tolerance {probe.tolerance:g}). The weights it loaded "
            "are not the ones pushed (an adapter not applied, another base model, a stale version); stopping "
            "rather than training on another policy's trajectories")
    return {"mean": mean, "max": most}
