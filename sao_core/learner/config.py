"""Settings of an RL run (`sao train-rl`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sao_core.rollout.admission import DEFAULT_RULE, RULES, AdmissionError, AdmissionPolicy, check_method
from sao_core.training.config import CoreConfig

RL_METHODS = ("sao", "grpo", "grpo_async", "grpo_dis", "running_mean")
GROUP_METHODS = ("grpo", "grpo_async", "grpo_dis")
ADMISSION_RULES = RULES


@dataclass
class RLConfig(CoreConfig):
    """One RL run. Steps count learner steps (one batch each); lengths are in tokens.

    The training core's fields (model, steps, schedule, warmup_steps, min_lr_ratio, weight_decay, grad_clip,
    precision, gradient_checkpointing, checkpoint_every, resume, log_every, seed, cache_dir) come from
    `CoreConfig`, shared with the supervised methods. The schedule applies to both learning rates: the
    policy's over its policy updates (steps − critic_warmup_steps), the critic's over the learner steps
    (its K updates of one step share that step's rate). SAO's defaults are the paper's: constant lr, no
    warm-up, no weight decay. `data` is a prepared rl dataset; `model` the initial policy and critic."""

    method: str = "sao"                        # sao | grpo | grpo_async | grpo_dis | running_mean
    services: tuple[str, ...] = ()             # rollout service URLs; empty: start one in this process
    service_token_file: str = ""              # file with the services' bearer token (else $SAO_ROLLOUT_TOKEN[_FILE])
    engine: str = "hf"                         # engine of the colocated service: hf | vllm
    batch_size: int = 32                       # trajectories per step (B)
    group_size: int = 8                        # G for the GRPO methods (batch_size must be a multiple)
    max_staleness: int = 4                     # S: the bound on a trained token's lag, in versions (rollout/admission.py)
    max_in_flight: int = 0                     # 0: (max_staleness + 1) × batch_size (sync grpo: batch_size)
    policy_lr: float = 1e-6
    critic_lr: float = 5e-6
    critic_updates: int = 2                    # K critic updates per policy update
    critic_warmup_steps: int = 10              # critic-only steps before the first policy update
    freeze_critic_attention: bool = False
    value_clip: float = 0.0                    # 0: no clipping of the value loss
    eps_low: float = 0.3                       # DIS band (1 - eps_low, 1 + eps_high)
    eps_high: float = 5.0
    clip_low: float = 0.2                      # PPO clip for grpo / grpo_async
    clip_high: float = 0.28
    lambda_alpha: float = 1.5                  # adaptive lambda: clamp(1 - 1/(alpha * l), 0, 1)
    gamma: float = 1.0
    whiten_advantages: bool = False
    baseline_window: int = 8                   # running_mean: last rewards per prompt
    micro_batch_tokens: int = 16384            # max rows x width (padded positions) per learner forward/backward, rows grouped by length (padding <= half); 0: one pass
    env_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    max_new_tokens_per_turn: int = 256
    max_total_tokens: int = 4096
    rollout_max_batch: int = 32                # colocated hf engine: sequences per forward pass
    rollout_options: dict[str, Any] = field(default_factory=dict)  # colocated service: other ServeConfig fields, e.g. {"gpu_memory_utilization": 0.3}
    take_wait_s: float = 2.0                   # long-poll wait per request
    service_retry_s: float = 300.0             # how long to wait when no rollout service answers before failing
    shutdown_services: bool = False            # at the end, shut the services down (TrainJob: lets the job end)
    # How the run keeps generation ahead of training without starving long episodes (rollout/admission.py, README
    # "Admission"): window (arrival order, stale dropped), version_order (oldest admission cohort first, waits
    # for it), requeue (window; a stale position rolled out once more), no_drop (arrival order, nothing dropped,
    # lag unbounded below the safety bound), fragments (SAO: long episodes trained in pieces within S).
    admission: str = DEFAULT_RULE              # window | version_order | requeue | no_drop | fragments
    hard_staleness: int = 0                    # no_drop / fragments: end episodes older than this many versions (0: 4 S)
    failed_episodes: str = "drop"              # drop | train: episodes ended by an engine/environment error or a timeout
    failed_reward: float = 0.0                 # the reward they are trained with when failed_episodes is train
    keep_weight_versions: int = 3              # published weight versions kept (older ones deleted)
    log_every: int = 1
    metrics_port: int = 0                      # the learner's Prometheus /metrics port (rank 0, all interfaces); 0: off
    # Evaluation during training (sao_core/learner/evaluation.py, README "Evaluation during training"): held-out
    # rewards at the current weights from the rollout services, logged as eval_* in metrics.jsonl.
    eval_every: int = 0                        # evaluate every N learner steps, at step 0 and at the last step; 0: off
    eval_data: str = ""                        # held-out set: a prepared rl dataset, or swe_verified | beyond_aime | imo_answerbench
    eval_limit: int = 0                        # evaluate only the first N prompts of eval_data (0: all)
    eval_samples: int = 1                      # sampled answers (temperature 1) per prompt (0: none)
    eval_greedy: bool = True                   # also one greedy answer (temperature 0) per prompt
    eval_concurrency: int = 32                 # evaluation episodes (and /v1/generate requests) in flight at once
    eval_options: dict[str, Any] = field(default_factory=dict)  # benchmark eval_data: other EvalConfig fields, e.g. {"max_new_tokens": 4096}

    @property
    def in_flight_cap(self) -> int:
        if self.max_in_flight:
            return self.max_in_flight
        return self.batch_size if self.method == "grpo" else (self.max_staleness + 1) * self.batch_size

    def admission_policy(self, services: int = 1) -> AdmissionPolicy:
        """The admission policy each of `services` rollout services runs under. Its in-flight cap is the run's
        shared out, but never below one batch, so a single live replica can still fill a batch while the others
        are down (below that the learner would wait forever for trajectories the cap forbids)."""
        return AdmissionPolicy(self.admission, self.max_staleness, max(self.in_flight_cap // max(services, 1),
                                                                       self.batch_size), self.hard_staleness,
                               self.batch_size)

    @property
    def rollouts_per_prompt(self) -> int:
        return self.group_size if self.method in GROUP_METHODS else 1

    def validate(self) -> None:
        super().validate()
        if self.method not in RL_METHODS:
            raise ValueError(f"RLConfig.method must be one of {', '.join(RL_METHODS)}, got {self.method!r}")
        for key in ("batch_size", "group_size", "critic_updates", "max_new_tokens_per_turn",
                    "max_total_tokens", "rollout_max_batch", "keep_weight_versions"):
            if getattr(self, key) < 1:
                raise ValueError(f"RLConfig.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("max_staleness", "max_in_flight", "critic_warmup_steps", "value_clip", "micro_batch_tokens"):
            if getattr(self, key) < 0:
                raise ValueError(f"RLConfig.{key} must be >= 0, got {getattr(self, key)}")
        if self.method in GROUP_METHODS and self.batch_size % self.group_size:
            raise ValueError(f"RLConfig.batch_size ({self.batch_size}) must be a multiple of group_size "
                             f"({self.group_size}) for {self.method}")
        if self.method in GROUP_METHODS and self.group_size < 2:
            raise ValueError("RLConfig.group_size must be >= 2 for the GRPO methods")
        if not (self.policy_lr > 0 and self.critic_lr > 0):
            raise ValueError("RLConfig.policy_lr and critic_lr must be > 0")
        if not 0 <= self.eps_low <= 1 or self.eps_high < 0:
            raise ValueError("RLConfig needs 0 <= eps_low <= 1 and eps_high >= 0")
        try:
            policy = self.admission_policy()
            policy.validate()
            check_method(policy, self.method)
        except AdmissionError as err:
            raise ValueError(f"RLConfig.{err}") from None
        if self.failed_episodes not in ("drop", "train"):
            raise ValueError(f"RLConfig.failed_episodes must be drop or train, got {self.failed_episodes!r}")
        if not math.isfinite(self.failed_reward):
            raise ValueError(f"RLConfig.failed_reward must be a finite number, got {self.failed_reward}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"RLConfig.metrics_port must be 0 (off) or a TCP port, got {self.metrics_port}")
        for key in ("eval_every", "eval_limit", "eval_samples"):
            if getattr(self, key) < 0:
                raise ValueError(f"RLConfig.{key} must be >= 0, got {getattr(self, key)}")
        if self.eval_concurrency < 1:
            raise ValueError(f"RLConfig.eval_concurrency must be >= 1, got {self.eval_concurrency}")
        if self.eval_every and not self.eval_data:
            raise ValueError("RLConfig.eval_every needs eval_data: a prepared rl dataset or a benchmark name "
                             "(swe_verified, beyond_aime, imo_answerbench)")
        if self.eval_every and not (self.eval_samples or self.eval_greedy):
            raise ValueError("RLConfig.eval_every needs eval_samples >= 1 or eval_greedy")
        if self.engine not in ("hf", "vllm"):
            raise ValueError(f"RLConfig.engine must be hf or vllm, got {self.engine!r}")
