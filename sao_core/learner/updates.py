"""One learner step per method: advantages, critic updates (SAO) and the policy update.

sao           critic values → skip-observation GAE (adaptive λ) for advantages, λ = 1 returns for the
              critic; K critic updates; after the warm-up one DIS policy step.
grpo          group-normalised advantages; PPO clip against π_old recomputed by the learner (the
              synchronous baseline: one update per batch, so π_old is the current policy).
grpo_async    group advantages; PPO clip against the rollout engine's log-probs.
grpo_dis      group advantages; DIS against the rollout log-probs.
running_mean  one rollout per prompt; advantage = R − mean of the prompt's last rewards; DIS.

The training core (`sao_core/training/core.py`) supplies the optimisers, schedules, clipped steps and the
precision region (bf16 autocast when `precision` asks for it; float32 master weights); log-probs and entropies
come from the chunked output layer (`training/forward.py`), over the action tokens only.

Data parallel (torchrun, FSDP2): every rank receives the whole batch, computes the scalar advantages of
the whole batch (group statistics and the running-mean baseline stay identical on all ranks), then trains
on its own contiguous share of the rows. Each rank's loss is a token mean over its rows; multiplying it by
n_local · W / n_global before FSDP2 averages the gradients over the W ranks makes the update exactly the
token mean over the whole batch, as in one process. Advantage whitening uses global statistics. Metrics are
token-weighted over ranks (exact for token means and fractions; `lambda_mean` is a mean over trajectories;
`explained_variance` is the token-weighted mean of the per-rank values, an approximation).

Micro-batches: each rank sorts its rows by length and runs the forward/backward passes on groups of at most
`micro_batch_tokens` padded positions (rows × the group's own width), so long-tailed lengths do not pad every
row to the longest one. Advantages, whitening and GAE are computed on the whole local batch; each group's
loss is a token mean over its own action tokens, scaled by n_micro / n_local so the accumulated gradient is
the token mean over the local batch, and the optimiser steps once per update. Metrics are combined exactly
(token-weighted means, maxima; `explained_variance` is computed on the local batch's values).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from sao_core.learner.batch import RLBatch, micro_batch_rows
from sao_core.learner.config import RLConfig
from sao_core.objectives.gae import adaptive_lambda, skip_observation_gae
from sao_core.objectives.grpo import RunningMeanBaseline, group_advantages, ppo_clip_loss
from sao_core.objectives.sao import dis_policy_loss, explained_variance, value_loss
from sao_core.training.core import autocast, build_optimizer, build_scheduler, clip_and_step
from sao_core.training.distributed import DistContext, all_reduce
from sao_core.training.forward import model_logprobs

# The methods whose policy loss is DIS against the rollout log-probs.
DIS_METHODS = ("sao", "grpo_dis", "running_mean")
# Metrics combined over ranks by sum or max instead of the token-weighted mean.
_SUMMED = {"action_tokens", "fragment_rows", "bootstrap_value_sum"}
_MAXED = {"logp_diff_max"}
_ROW_MEANS = {"lambda_mean"}  # means over trajectories, not tokens

# One forward/backward unit: (row indices [b] into the local batch, the rows trimmed to [b, w], whether it is
# real; a filler pass (False) only keeps FSDP2's collectives in step across ranks and has a zero loss factor).
MicroBatch = tuple[torch.Tensor, RLBatch, bool]


def _policy_forward(policy, batch: RLBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Log-probs [B, T] with gradient (float32, 0 off the action tokens), plus entropy and |logp − rollout_logp|
    statistics. Only action tokens go through the output layer, in chunks (`training.forward`)."""
    mask = batch.action_mask.bool()
    logp, entropy = model_logprobs(policy, batch.input_ids, batch.attention_mask, positions=mask,
                                   with_entropy=True)
    with torch.no_grad():
        # Entropy of the next-token distribution at the positions that sampled action tokens.
        diff = (logp.detach() - batch.rollout_logprobs).abs()[mask]
        stats = {"entropy": float(entropy[mask].mean()) if mask.any() else 0.0,
                 "logp_diff_mean": float(diff.mean()) if diff.numel() else 0.0,
                 "logp_diff_max": float(diff.max()) if diff.numel() else 0.0}
    return logp, stats


def _combine(parts: list[tuple[float, dict[str, float]]], tokens: float) -> dict[str, float]:
    """Metrics of the local batch from per-micro-batch metrics: (action tokens, metrics) pairs. Token-weighted
    means (exact for token means and fractions of action tokens), maxima for `_MAXED`."""
    return {k: max(m[k] for _, m in parts) if k in _MAXED else sum(n * m[k] for n, m in parts) / max(tokens, 1.0)
            for k in parts[0][1]} if parts else {}


def _whiten(adv: torch.Tensor, mask: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Advantages minus their mean over the action tokens of the whole batch, over the (unbiased) std."""
    values = adv[mask.bool()].double()
    n, total, squares = all_reduce([values.numel(), float(values.sum()), float((values ** 2).sum())], ctx)
    if n < 2:
        return adv
    mean = total / n
    std = max((squares - n * mean * mean) / (n - 1), 0.0) ** 0.5
    return torch.where(mask.bool(), (adv - mean) / (std + 1e-8), torch.zeros_like(adv))


def share_rows(batch_size: int, ctx: DistContext) -> tuple[int, int]:
    """[start, stop) rows of a batch of `batch_size` trained by this rank (contiguous, sizes differ by ≤ 1)."""
    base, extra = divmod(batch_size, ctx.world_size)
    start = ctx.rank * base + min(ctx.rank, extra)
    return start, start + base + (1 if ctx.rank < extra else 0)


def group_index(batch: RLBatch) -> torch.Tensor:
    """[B] integer id of each trajectory's group (same prompt and epoch)."""
    keys: dict[tuple, int] = {}
    return torch.tensor([keys.setdefault((t.prompt_id, t.metadata.get("epoch", 0)), len(keys))
                         for t in batch.trajectories])


def sao_targets(batch: RLBatch, values: torch.Tensor, config: RLConfig
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SAO's policy advantages (skip-observation GAE, adaptive λ) and the critic's targets (λ = 1) from the
    critic's values [B, T] of `batch`: (advantages [B, T], returns [B, T], bootstrap [B]). A fragment's bootstrap
    is the value at its cut, read at the extra position `collate` gives it (V of its whole prefix); an episode's
    last piece bootstraps from 0. λ is adaptive on each row's own action tokens (a fragment's: those of its turns)."""
    mask = batch.action_mask
    bootstrap = torch.zeros(len(batch.trajectories), dtype=torch.float32, device=mask.device)
    for row, t in enumerate(batch.trajectories):
        if t.is_fragment:
            bootstrap[row] = values[row, len(t.token_ids)].float()
    lam = adaptive_lambda(mask.sum(dim=1), config.lambda_alpha)
    advantages, _ = skip_observation_gae(batch.rewards, values, mask, config.gamma, lam, bootstrap)
    _, returns = skip_observation_gae(batch.rewards, values, mask, config.gamma, 1.0, bootstrap)
    return advantages, returns, bootstrap


class Updater:
    """Holds the models and optimisers of one run and performs learner steps."""

    def __init__(self, config: RLConfig, policy, critic=None, ctx: DistContext | None = None,
                 end_of_turn_ids: tuple[int, ...] = ()):
        """`policy` and `critic` must already be sharded (`shard_model`) when running under torchrun.
        `end_of_turn_ids`: the tokens that end a model turn, for the ``end_of_turn_*`` metrics of a step (the
        learner's log-prob of the sampled end-of-turn tokens, their mean advantage and, for the DIS methods, the
        share DIS kept); empty: none."""
        self.config = config
        self.end_of_turn_ids = tuple(end_of_turn_ids)
        self.ctx = ctx or DistContext()
        self.policy = policy
        self.critic = critic
        # The training core's optimiser and schedule: the policy's over its policy updates, the critic's over the
        # learner steps (stepped once per step, after its K updates).
        self.policy_opt = build_optimizer(policy.parameters(), config.policy_lr, config.weight_decay)
        policy_updates = config.steps - (config.critic_warmup_steps if config.method == "sao" else 0)
        self.policy_sched = build_scheduler(self.policy_opt, config, policy_updates)
        self.critic_opt = self.critic_sched = None
        if critic is not None:
            self.critic_opt = build_optimizer(critic.parameters(), config.critic_lr, config.weight_decay)
            self.critic_sched = build_scheduler(self.critic_opt, config, config.steps)
        self.baseline = RunningMeanBaseline(window=config.baseline_window)
        # Bins of the dis_kept_by_lag metric: lags 0..S of the run's admission policy, and one for every lag beyond.
        self.lag_bins = config.admission_policy().max_staleness + 2

    def step(self, batch: RLBatch, step_index: int, allow_empty_rows: bool = False,
             version: int | None = None) -> tuple[dict[str, float], bool]:
        """One learner step on the whole batch (every rank passes the same batch); returns (metrics, whether
        the policy changed). Metrics are the same on every rank. `version`: the learner's weights version, for
        the DIS methods' ``dis_kept_by_lag`` metric ({lag: share of the action tokens of that lag the DIS band
        kept}; the key "<S+1>+" holds every lag beyond max_staleness).

        Fragments (`Trajectory.is_fragment`, SAO only): the advantages and the critic's targets of a fragment's
        tokens bootstrap from the critic's value at its cut (`collate` gives it the extra position that value is
        read from); its λ is adaptive on the fragment's own action length, so the cut's value reaches its first
        token with the weight exp(−1/α) a whole episode's reward has at its first token.

        A trajectory without action tokens is refused (the learner drops it as "no_action_tokens" before it
        reaches a batch: it has nothing to train, and its prompt may be long enough to stall the critic's
        forward pass); `allow_empty_rows` only for replaying a journal written before that rule."""
        self._check_batch(batch, allow_empty_rows)
        # Scalar advantages need the whole batch (groups, running-mean history): computed on every rank.
        scalar = self._scalar_advantages(batch)
        # The episodes' rewards: a fragment's 0 is not a reward (its value comes from the critic at the cut).
        finals = [t.reward for t in batch.trajectories if not t.is_fragment]
        reward_mean = sum(finals) / len(finals) if finals else None
        start, stop = share_rows(len(batch.trajectories), self.ctx)
        batch = batch.rows(start, stop).to(self.ctx.device)
        mask = batch.action_mask
        n_local = float(mask.sum())
        (n_global,) = all_reduce([n_local], self.ctx)
        # Turns this rank's token mean into its share of the token mean over the whole batch (see above).
        loss_scale = n_local * self.ctx.world_size / max(n_global, 1.0)
        micro = self._micro_batches(batch)
        metrics: dict[str, float] = {"action_tokens": n_local}
        if self.config.method == "sao":
            advantages = self._critic_phase(batch, micro, metrics, loss_scale)
            metrics["critic_lr"] = self.critic_sched.get_last_lr()[0]
            self.critic_sched.step()
            if step_index < self.config.critic_warmup_steps:
                metrics["critic_warmup"] = 1.0
                return self._reduce(metrics, n_local, len(batch.trajectories), reward_mean), False
        else:
            advantages = scalar[start:stop].to(self.ctx.device).unsqueeze(1) * mask
        if self.config.whiten_advantages:
            advantages = _whiten(advantages, mask, self.ctx)
        turn_ends, by_lag = self._policy_phase(micro, advantages, metrics, n_local, loss_scale, version)
        metrics["advantage_mean"] = float(advantages[mask.bool()].mean()) if mask.any() else 0.0
        out = self._reduce(metrics, n_local, len(batch.trajectories), reward_mean)
        out.update(self._token_diagnostics(turn_ends, by_lag, version))
        return out, True

    def _check_batch(self, batch: RLBatch, allow_empty_rows: bool) -> None:
        """ValueError for a batch this step cannot train (see `step`)."""
        method = self.config.method
        if len(batch.trajectories) < self.ctx.world_size:
            raise ValueError(f"a batch of {len(batch.trajectories)} trajectories cannot be shared by "
                             f"{self.ctx.world_size} ranks")
        if not allow_empty_rows:
            empty = [t.id for t in batch.trajectories if t.num_action_tokens == 0]
            if empty:
                raise ValueError(f"trajectory {empty[0]} has no action tokens ({len(empty)} in this batch); the "
                                 "learner must drop such trajectories (no_action_tokens), not train on them")
        if method != "sao" and any(t.is_fragment for t in batch.trajectories):
            raise ValueError(f"{method} cannot train a fragment of a running episode (no critic to bootstrap from); "
                             "admission 'fragments' is for sao")

    def _scalar_advantages(self, batch: RLBatch) -> torch.Tensor | None:
        """[B] one advantage per trajectory of the whole batch (running_mean, the GRPO methods); None for sao."""
        method = self.config.method
        if method == "running_mean":
            return torch.tensor([self.baseline.advantage(t.prompt_id, t.reward) for t in batch.trajectories])
        if method != "sao":
            return group_advantages(batch.rewards, group_index(batch)).to(torch.float32)
        return None

    def _policy_phase(self, micro: list[MicroBatch], advantages: torch.Tensor, metrics: dict[str, float],
                      n_local: float, loss_scale: float, version: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy update on this rank's micro-batches (`advantages` [B_local, T]); adds its metrics to
        `metrics` and returns the local sums of the token diagnostics: end-of-turn tokens [4] (count, Σ logp,
        Σ kept, Σ advantage) and action tokens by lag [2, lag_bins] (all, kept by DIS)."""
        track_lag = version is not None and self.config.method in DIS_METHODS
        self.policy.train()
        parts = []
        turn_ends = torch.zeros(4, dtype=torch.float64)
        by_lag = torch.zeros(2, self.lag_bins, dtype=torch.float64)
        for index, mb, real in micro:
            rows_advantages = advantages[index, :mb.input_ids.shape[1]]
            with autocast(self.config.precision, self.ctx.device):
                logp, stats = _policy_forward(self.policy, mb)
                loss, m = self._policy_loss(logp, mb, rows_advantages)
            if real and self.end_of_turn_ids:
                turn_ends += self._end_of_turn_sums(logp.detach(), mb, rows_advantages)
            if real and track_lag:
                by_lag += self._kept_by_lag(logp.detach(), mb, version, self.lag_bins)
            n_micro = float(mb.action_mask.sum()) if real else 0.0
            # The micro-batch's token mean times n_micro / n_local: its share of the local token mean.
            (loss * (n_micro / max(n_local, 1.0) * loss_scale)).backward()
            if real:
                parts.append((n_micro, {**stats, "policy_loss": float(loss.detach()),
                                        **{f"policy_{k}": v for k, v in m.items() if k not in ("loss", "action_tokens")}}))
        metrics.update(_combine(parts, n_local))
        metrics["policy_lr"] = self.policy_sched.get_last_lr()[0]
        metrics["policy_grad_norm"] = clip_and_step(self.policy_opt, self.policy.parameters(), self.config.grad_clip,
                                                    self.policy_sched)
        return turn_ends, by_lag

    def _token_diagnostics(self, turn_ends: torch.Tensor, by_lag: torch.Tensor, version: int | None
                           ) -> dict[str, float]:
        """The step's per-token diagnostics over all ranks (collective): ``dis_kept_by_lag`` (DIS methods, with
        a `version`) and the ``end_of_turn_*`` metrics (with end-of-turn ids)."""
        out: dict = {}
        bins = self.lag_bins
        if version is not None and self.config.method in DIS_METHODS:
            sums = all_reduce([float(x) for x in by_lag.flatten()], self.ctx)
            last = f"{bins - 1}+"     # every lag beyond max_staleness
            out["dis_kept_by_lag"] = {(str(k) if k < bins - 1 else last): sums[bins + k] / sums[k]
                                      for k in range(bins) if sums[k]}
        if self.end_of_turn_ids:
            count, logp_sum, kept_sum, adv_sum = all_reduce([float(x) for x in turn_ends], self.ctx)
            if count:
                out.update(end_of_turn_learner_logprob=logp_sum / count, end_of_turn_advantage=adv_sum / count)
                if self.config.method in DIS_METHODS:
                    out["end_of_turn_kept"] = kept_sum / count
        return out

    def _kept_by_lag(self, logp: torch.Tensor, mb: RLBatch, version: int, bins: int) -> torch.Tensor:
        """[2, bins]: action tokens and those inside the DIS band, by lag (version − the token's version; the
        last bin holds every lag ≥ bins − 1)."""
        mask = mb.action_mask.bool() & (mb.versions >= 0)
        lag = (version - mb.versions[mask]).clamp(min=0, max=bins - 1)
        ratio = torch.exp(logp.float()[mask] - mb.rollout_logprobs.float()[mask])
        kept = (ratio > 1.0 - self.config.eps_low) & (ratio < 1.0 + self.config.eps_high)
        return torch.stack([torch.bincount(lag, minlength=bins).double(),
                            torch.bincount(lag[kept], minlength=bins).double()]).cpu()

    def _end_of_turn_sums(self, logp: torch.Tensor, mb: RLBatch, advantages: torch.Tensor) -> torch.Tensor:
        """[count, Σ learner log-prob, Σ kept by the DIS band, Σ advantage] over the micro-batch's sampled
        end-of-turn tokens (logp, advantages: [b, w])."""
        ends = mb.action_mask.bool() & torch.isin(mb.input_ids, torch.tensor(self.end_of_turn_ids,
                                                                             device=mb.input_ids.device))
        ratio = torch.exp(logp.float() - mb.rollout_logprobs.float())[ends]
        kept = (ratio > 1.0 - self.config.eps_low) & (ratio < 1.0 + self.config.eps_high)
        return torch.tensor([float(ends.sum()), float(logp.float()[ends].sum()), float(kept.sum()),
                             float(advantages.float()[ends].sum())], dtype=torch.float64)

    def _policy_loss(self, logp: torch.Tensor, mb: RLBatch, advantages: torch.Tensor):
        """The method's policy loss on one micro-batch (all [b, w]): a token mean over its action tokens."""
        cfg, mask = self.config, mb.action_mask
        if cfg.method in DIS_METHODS:
            return dis_policy_loss(logp, mb.rollout_logprobs, advantages, mask, cfg.eps_low, cfg.eps_high)
        if cfg.method == "grpo_async":
            return ppo_clip_loss(logp, mb.rollout_logprobs, advantages, mask, cfg.clip_low, cfg.clip_high)
        # grpo: π_old recomputed by the learner; one update per batch, so it is the current policy (the weights
        # change only after the last micro-batch).
        return ppo_clip_loss(logp, logp.detach(), advantages, mask, cfg.clip_low, cfg.clip_high)

    def _micro_batches(self, batch: RLBatch) -> list[MicroBatch]:
        """This rank's rows in groups of at most `micro_batch_tokens` padded positions (0: the local batch as
        one group, untrimmed). Under torchrun every rank runs as many passes as the rank with the most groups
        (FSDP2 gathers and reduces in every pass): the extra ones repeat this rank's smallest group as fillers."""
        budget = self.config.micro_batch_tokens
        if not budget:
            return [(torch.arange(len(batch.trajectories), device=batch.input_ids.device), batch, True)]
        lengths = [int(n) for n in batch.attention_mask.sum(dim=1).tolist()]
        micro = [(torch.tensor(rows, device=batch.input_ids.device), batch.select(rows), True)
                 for rows in micro_batch_rows(lengths, budget)]
        (passes,) = all_reduce([len(micro)], self.ctx, op="max")
        smallest = min(micro, key=lambda u: u[1].input_ids.numel())
        return micro + [(smallest[0], smallest[1], False)] * (int(passes) - len(micro))

    def _reduce(self, metrics: dict[str, float], tokens: float, rows: int, reward_mean: float | None
                ) -> dict[str, float]:
        """Combine per-rank metrics: token-weighted mean, except sums, maxima and per-trajectory means."""
        keys = sorted(metrics)

        def weighted(k: str) -> float:
            return metrics[k] if k in _SUMMED else metrics[k] * (rows if k in _ROW_MEANS else tokens)

        *summed, total_tokens, total_rows = all_reduce([weighted(k) for k in keys] + [tokens, rows], self.ctx)
        maxed = dict(zip(keys, all_reduce([metrics[k] for k in keys], self.ctx, op="max"), strict=True))
        out = {k: maxed[k] if k in _MAXED else v if k in _SUMMED
               else v / max(total_rows if k in _ROW_MEANS else total_tokens, 1e-12)
               for k, v in zip(keys, summed, strict=True)}
        if reward_mean is not None:   # None: a batch of fragments only
            out["reward_mean"] = reward_mean
        if "bootstrap_value_sum" in out:   # the critic's mean value at the cuts of this step's fragments
            total = out.pop("bootstrap_value_sum")
            if out["fragment_rows"]:
                out["bootstrap_value_mean"] = total / out["fragment_rows"]
        return out

    def _critic_phase(self, batch: RLBatch, micro: list[MicroBatch], metrics: dict[str, float],
                      loss_scale: float) -> torch.Tensor:
        """K critic updates on the local batch; returns the policy advantages [B_local, T]."""
        cfg = self.config
        mask = batch.action_mask
        n_local = float(mask.sum())
        self.critic.eval()
        # Old values [B_local, T] from the micro-batches (0 on trimmed padding, which no loss reads); GAE is
        # row-wise but runs on the whole local batch at once.
        old_values = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        with torch.no_grad(), autocast(cfg.precision, self.ctx.device):
            for index, mb, real in micro:
                values = self.critic(mb.input_ids, mb.attention_mask)
                if real:
                    old_values[index, :values.shape[1]] = values.float()
        lam = adaptive_lambda(mask.sum(dim=1), cfg.lambda_alpha)
        advantages, returns, bootstrap = sao_targets(batch, old_values, cfg)
        # Sums over ranks (every rank sets both keys, so the metric reduction stays in step): see `_reduce`.
        fragments = [row for row, t in enumerate(batch.trajectories) if t.is_fragment]
        metrics["fragment_rows"] = float(len(fragments))
        metrics["bootstrap_value_sum"] = float(bootstrap[fragments].sum()) if fragments else 0.0
        self.critic.train()
        for k in range(cfg.critic_updates):
            # The first update's values [B_local, T], for the explained variance.
            first_values = torch.zeros_like(old_values) if k == 0 else None
            parts = []
            for index, mb, real in micro:
                with autocast(cfg.precision, self.ctx.device):
                    values = self.critic(mb.input_ids, mb.attention_mask)
                    width = values.shape[1]
                    loss, m = value_loss(values.float(), old_values[index, :width], returns[index, :width],
                                         mb.action_mask, cfg.value_clip)
                n_micro = float(mb.action_mask.sum()) if real else 0.0
                (loss * (n_micro / max(n_local, 1.0) * loss_scale)).backward()
                if real:
                    parts.append((n_micro, {"critic_loss": m["value_loss"]}))
                    if first_values is not None:
                        first_values[index, :width] = values.detach().float()
            norm = clip_and_step(self.critic_opt, self.critic.parameters(), cfg.grad_clip)
            if k == 0:
                # Not a token mean: computed once on the whole local batch.
                metrics["explained_variance"] = explained_variance(first_values, returns, mask)
            metrics.update(_combine(parts, n_local))
            metrics["critic_grad_norm"] = norm
        metrics["lambda_mean"] = float(lam.mean())
        return advantages

    # ------------------------------------------------------------------ state for checkpoints
    def checkpoint_parts(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        """The named (model, optimiser) pairs of the run, for the training core's checkpoint format."""
        parts = {"policy": (self.policy, self.policy_opt)}
        if self.critic is not None:
            parts["critic"] = (self.critic, self.critic_opt)
        return parts

    def extra_state(self) -> dict:
        """JSON-able state beside the tensors: the schedules and the running-mean baseline."""
        state = {"baseline": self.baseline.state_dict(), "policy_scheduler": self.policy_sched.state_dict()}
        if self.critic_sched is not None:
            state["critic_scheduler"] = self.critic_sched.state_dict()
        return state

    def load_extra_state(self, state: dict) -> None:
        """Restore `extra_state()` output (every rank passes the same dict)."""
        self.baseline.load_state_dict(state["baseline"])
        self.policy_sched.load_state_dict(state["policy_scheduler"])
        if self.critic_sched is not None:
            self.critic_sched.load_state_dict(state["critic_scheduler"])

    def full_model_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Full (unsharded, CPU) state dicts of the policy and the critic. Collective under torchrun; only rank
        0's dicts hold the tensors."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {name: get_model_state_dict(model, options=options)
                for name, (model, _) in self.checkpoint_parts().items()}
