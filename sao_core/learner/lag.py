"""Per-token lag of what a learner step trains: how many weights versions behind the learner each trained token was
sampled (rollout/admission.py). A trajectory-level staleness hides what an admission rule does to long episodes:
their early tokens are the old ones. These metrics go into every metrics line (and from there the training report
and TensorBoard):

  token_lag            {lag: trained action tokens} of this step (versions)
  token_lag_p50 / p99 / max
  tokens_beyond_bound  share of this step's trained action tokens with lag > max_staleness
  token_lag_by_turns   {episode-turns bucket: mean lag of its trained tokens} (buckets as in learner/bias.py)
  fragments            pieces in the batch that are not an episode's last (admission fragments)
  fragments_per_episode  mean number of pieces of the episodes whose last piece is in the batch

The update adds ``dis_kept_by_lag`` ({lag: share of that lag's action tokens the DIS band kept}, the key
"<S+1>+" for every lag beyond max_staleness; `learner/updates.py`) and, for fragments, ``bootstrap_value_mean``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from sao_core.learner.bias import bucket
from sao_core.rollout.admission import AdmissionPolicy
from sao_core.rollout.trajectory import Trajectory


def token_lags(trajectories: list[Trajectory], version: int) -> Counter:
    """{lag: count} over the action tokens of `trajectories` trained at learner version `version`."""
    lags: Counter = Counter()
    for t in trajectories:
        for v, m in zip(t.versions, t.action_mask, strict=True):
            if m and v >= 0:
                lags[version - v] += 1
    return lags


def percentile(histogram: Counter, q: float) -> int:
    """The smallest lag with at least a share `q` of the counts at or below it (0 for an empty histogram)."""
    total = sum(histogram.values())
    if not total:
        return 0
    running = 0
    for lag in sorted(histogram):
        running += histogram[lag]
        if running >= q * total:
            return lag
    return max(histogram)


def lag_record(trajectories: list[Trajectory], version: int, policy: AdmissionPolicy) -> dict[str, Any]:
    """The step's lag metrics (see the module docstring) under the run's admission `policy` (its bound S)."""
    lags = token_lags(trajectories, version)
    total = sum(lags.values())
    by_turns: dict[str, list[int]] = {}
    for t in trajectories:
        n = sum(t.action_mask)
        if n:
            lag_sum = sum(version - v for v, m in zip(t.versions, t.action_mask, strict=True) if m and v >= 0)
            entry = by_turns.setdefault(bucket(t.num_turns), [0, 0])
            entry[0] += lag_sum
            entry[1] += n
    finals = [t for t in trajectories if not t.is_fragment]
    return {
        "token_lag": {str(k): lags[k] for k in sorted(lags)},
        "token_lag_p50": percentile(lags, 0.5), "token_lag_p99": percentile(lags, 0.99),
        "token_lag_max": max(lags, default=0),
        "tokens_beyond_bound": (sum(n for k, n in lags.items() if k > policy.max_staleness) / total
                                if total else 0.0),
        "token_lag_by_turns": {b: round(s / n, 4) for b, (s, n) in
                               sorted(by_turns.items(), key=lambda kv: int(kv[0].split("-")[0]))},
        "fragments": sum(t.is_fragment for t in trajectories),
        "fragments_per_episode": (sum(t.fragment_index + 1 for t in finals) / len(finals)) if finals else 0.0,
    }
