"""Training-health metrics of a batch's turn ends (README "Learning that holds").

A policy that stops ending its turns writes until the per-turn token cap: the turn is cut, the episode ends
with reward 0 without being graded, and its tokens crowd the batch. These metrics show that mode per step:

    turn_cut_share          share of the batch's trajectories whose last turn was cut at a token cap (the
                            engine stopped it for length: its last sampled token is not an end-of-turn token)
    turn_cut_correct_share  of those cut turns, the share that already held the right answer (the environment's
                            `grade_unfinished`; only where it grades one; absent when no turn was cut)
    end_of_turn_logprob     mean engine log-prob of the end-of-turn tokens the batch sampled (the probability
                            the policy gave to ending its turn where it did end it)
    tool_error_share        share of the batch's trajectories in which a tool call failed (the environment's
                            ``errors`` count > 0; tool environments only)

They are computed from the trajectories alone (no forward pass), so they cost nothing at any model size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sao_core.rollout.trajectory import Trajectory


def was_cut(trajectory: Trajectory, end_of_turn_ids: Iterable[int]) -> bool:
    """Whether the trajectory's last turn was stopped at a token cap: it ended for length and its last token is
    a sampled token other than an end-of-turn token (a "length" end at the turn limit ends on an observation
    or an end-of-turn token instead)."""
    if trajectory.finish_reason != "length" or not trajectory.token_ids or not trajectory.action_mask[-1]:
        return False
    return trajectory.token_ids[-1] not in set(end_of_turn_ids)


def turn_health(trajectories: Sequence[Trajectory], end_of_turn_ids: Iterable[int]) -> dict[str, float]:
    """The batch's turn-end metrics (see the module docstring); {} for an empty batch."""
    if not trajectories:
        return {}
    ends = set(end_of_turn_ids)
    cut = [t for t in trajectories if was_cut(t, ends)]
    out = {"turn_cut_share": len(cut) / len(trajectories)}
    graded = [t.metadata["info"]["cut_turn_correct"] for t in cut
              if isinstance((t.metadata.get("info") or {}).get("cut_turn_correct"), bool)]
    if graded:
        out["turn_cut_correct_share"] = sum(graded) / len(graded)
    end_logprobs = [lp for t in trajectories
                    for token, mask, lp in zip(t.token_ids, t.action_mask, t.rollout_logprobs, strict=True)
                    if mask and token in ends]
    if end_logprobs:
        out["end_of_turn_logprob"] = sum(end_logprobs) / len(end_logprobs)
    errors = [(t.metadata.get("info") or {}).get("errors") for t in trajectories]
    counted = [e for e in errors if isinstance(e, int) and not isinstance(e, bool)]
    if counted:
        out["tool_error_share"] = sum(1 for e in counted if e > 0) / len(trajectories)
    return out
