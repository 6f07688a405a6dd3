"""Settings of an RL run (`sao train-rl`)."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import Any, Literal

from sao_core.config import setting
from sao_core.rollout.admission import (
    ADMISSION_HELP,
    DEFAULT_MAX_STALENESS,
    DEFAULT_RULE,
    RULES,
    Admission,
    AdmissionError,
    AdmissionPolicy,
    check_method,
)
from sao_core.training.config import CoreConfig

Method = Literal["sao", "grpo", "grpo_async", "grpo_dis", "running_mean"]
Engine = Literal["vllm", "hf"]
RL_METHODS: tuple[str, ...] = typing.get_args(Method)
ENGINES: tuple[str, ...] = typing.get_args(Engine)
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

    method: Method = setting("sao", "RL method: sao, grpo (synchronous), grpo_async, grpo_dis or running_mean",
                             section="objective")
    services: tuple[str, ...] = setting((), "rollout service URLs; empty: start one in this process",
                                        placements=("trainjob",), section="rollout")
    service_token_file: str = setting("", "file with the services' bearer token (else $SAO_ROLLOUT_TOKEN[_FILE])",
                                      placements=("trainjob",), section="rollout")
    engine: Engine = setting("hf", "Rollout engine: vllm (GPU) or hf (transformers; small models, CPU).",
                             section="rollout")
    batch_size: int = setting(32, "Trajectories per step (B), one per prompt (GRPO: groups of group_size).",
                              unit="trajectories", section="objective")
    group_size: int = setting(8, "G, rollouts per prompt of the GRPO methods (batch_size must be a multiple)",
                              unit="trajectories", methods=GROUP_METHODS, section="objective")
    max_staleness: int = setting(DEFAULT_MAX_STALENESS,
                                 "S, the most weights versions a trained token may lag (window / version_order / "
                                 "requeue drop trajectories beyond it; no_drop / fragments drop only past the "
                                 "safety bound).", unit="versions", section="admission")
    max_in_flight: int = setting(0, "episodes in flight over all services; 0: (max_staleness + 1) x batch_size "
                                 "(sync grpo: batch_size)", unit="episodes", section="rollout")
    policy_lr: float = setting(1e-6, "Policy learning rate (peak, after the warm-up).",
                               section="optimisation")
    critic_lr: float = setting(5e-6, "Critic learning rate.", methods=("sao",), section="critic")
    critic_updates: int = setting(2, "Critic updates per policy update (K).", methods=("sao",),
                                  section="critic")
    critic_warmup_steps: int = setting(10, "Critic-only steps before the first policy update.", unit="steps",
                                       methods=("sao",), section="critic")
    critic_lora_rank: int = setting(0, "a LoRA adapter of this rank on the critic's body (its value head trains "
                                    "fully); 0: the critic trains every weight", methods=("sao",),
                                    section="critic")
    freeze_critic_attention: bool = setting(False, "train only the critic's MLPs and value head (attention frozen)",
                                            methods=("sao",), section="critic")
    value_clip: float = setting(0.0, "clip of the value loss around the old values; 0: no clipping",
                                methods=("sao",), section="critic")
    eps_low: float = setting(0.3, "DIS band lower width: tokens with ratio <= 1 - eps_low are masked (0.3 math with tools, 0.8 agentic coding).",
                             methods=("sao", "grpo_dis"), section="objective")
    eps_high: float = setting(5.0, "DIS band upper width: tokens with ratio >= 1 + eps_high are masked (5.0 math with tools, 3.0 agentic coding).",
                              methods=("sao", "grpo_dis"), section="objective")
    clip_low: float = setting(0.2, "PPO clip lower width (grpo, grpo_async)", methods=("grpo", "grpo_async"),
                              section="objective")
    clip_high: float = setting(0.28, "PPO clip upper width (grpo, grpo_async)", methods=("grpo", "grpo_async"),
                               section="objective")
    lambda_alpha: float = setting(1.5, "adaptive GAE lambda: clamp(1 - 1/(alpha * l), 0, 1) for a length l",
                                  methods=("sao",), section="objective")
    gamma: float = setting(1.0, "discount of the returns", methods=("sao",), section="objective")
    whiten_advantages: bool = setting(False, "normalise advantages to zero mean and unit variance per batch",
                                      section="objective")
    baseline_window: int = setting(8, "last rewards per prompt in the running-mean baseline", unit="rewards",
                                   methods=("running_mean",), section="objective")
    micro_batch_tokens: int = setting(16384, "max rows x width (padded positions) per learner forward/backward, "
                                      "rows grouped by length (padding <= half); 0: one pass", unit="tokens",
                                      section="optimisation")
    env_options: dict[str, dict[str, Any]] = setting(
        factory=dict, help='per-environment options, e.g. {"swe": {"sandbox": "kubernetes"}}',
                                                     section="rollout")
    max_new_tokens_per_turn: int = setting(256, "longest model turn", unit="tokens", section="rollout")
    max_total_tokens: int = setting(4096, "longest episode: prompt, turns and tool results", unit="tokens",
                                    section="rollout")
    rollout_max_batch: int = setting(32, "colocated hf engine: sequences per forward pass", unit="sequences",
                                     placements=("single_pod",), section="rollout")
    rollout_options: dict[str, Any] = setting(
        factory=dict, help='colocated service: other ServeConfig fields, e.g. {"gpu_memory_utilization": 0.3}',
        placements=("single_pod",), section="rollout")
    take_wait_s: float = setting(2.0, "long-poll wait per request for finished trajectories", unit="seconds",
                                 section="rollout")
    service_retry_s: float = setting(300.0, "how long to wait when no rollout service answers before failing",
                                     unit="seconds", section="rollout")
    shutdown_services: bool = setting(False, "at the end, shut the services down (TrainJob: lets the job end)",
                                      placements=("trainjob",), section="rollout")
    admission: Admission = setting(DEFAULT_RULE, ADMISSION_HELP, section="admission")
    hard_staleness: int = setting(0, "no_drop / fragments: end episodes older than this many versions (0: 4 S)",
                                  unit="versions", section="admission")
    failed_episodes: Literal["drop", "train"] = setting(
        "drop", "episodes ended by an engine/environment error or a timeout: drop them, or train them",
                                                        section="admission")
    failed_reward: float = setting(0.0, "the reward failed episodes are trained with when failed_episodes is train",
                                   section="admission")
    keep_weight_versions: int = setting(3, "published weight versions kept (older ones deleted)", unit="versions",
                                        section="publishing")
    weight_transport: Literal["auto", "files", "collective"] = setting(
        "auto", "how new weights reach the services: auto (in memory to a colocated hf engine, full weights or a "
        "LoRA adapter; through storage to the others), files (always through storage), collective: a gloo/NCCL "
        "group to external services (hf engines; full weights)", section="publishing")
    publish_every: int = setting(
        0, "in-memory pushes: also write every Nth version to storage in the background (0: only at checkpoints "
        "and the end)", unit="versions", section="publishing")
    lora_publish: Literal["adapter", "merged"] = setting(
        "adapter", "with lora_rank: publish each version as the LoRA adapter alone (megabytes), or merged into "
        "the full model (for engines that cannot take adapters)", section="publishing")
    delivery_check_tokens: int = setting(
        32, "after every weight push, compare each service's log-probs of this many tokens of a fixed chat exchange "
        "(the probe: the assistant's answer, through the chat template) with the learner's (0: off)", unit="tokens",
                                         section="publishing")
    delivery_tolerance: float = setting(
        0.15, "largest mean |service - learner| log-prob over the probe before the run stops. Measured "
        "(bench/delivery_probe.py): a bf16 engine that got the weights, against the float32 learner, 0.02-0.05 "
        "(SmolLM2-135M, 100 pushes) and 0.03 (Qwen3-1.7B shape); a zeroed MLP layer 0.56, another base model 9. "
        "A version or two behind is within bf16 noise: the version and digest checks catch that",
        unit="nats per token", section="publishing")
    log_every: int = setting(1, "steps between metrics lines (and progress updates)", unit="steps",
                             section="checkpoints")
    metrics_port: int = setting(0, "the learner's Prometheus /metrics port (rank 0, all interfaces); 0: off",
                                section="checkpoints")
    # Evaluation during training (sao_core/learner/evaluation.py, README "Evaluation during training"): held-out
    # rewards at the current weights from the rollout services, logged as eval_* in metrics.jsonl.
    eval_every: int = setting(0, "evaluate every N learner steps, at step 0 and at the last step; 0: off",
                              unit="steps", section="evaluation")
    eval_data: str = setting("", "held-out set: a prepared rl dataset, or swe_verified | beyond_aime | "
                             "imo_answerbench", section="evaluation")
    eval_limit: int = setting(0, "evaluate only the first N prompts of eval_data (0: all)", unit="prompts",
                              section="evaluation")
    eval_samples: int = setting(1, "sampled answers (temperature 1) per prompt (0: none)", unit="answers",
                                section="evaluation")
    eval_greedy: bool = setting(True, "also one greedy answer (temperature 0) per prompt",
                                section="evaluation")
    eval_concurrency: int = setting(32, "evaluation episodes (and /v1/generate requests) in flight at once",
                                    unit="episodes", section="evaluation")
    eval_options: dict[str, Any] = setting(
        factory=dict, help='benchmark eval_data: other EvalConfig fields, e.g. {"max_new_tokens": 4096}',
                                           section="evaluation")

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

    def rollout_lora_rank(self) -> int:
        """The LoRA rank the rollout engines must take adapters of (vLLM `max_lora_rank`): `lora_rank` when the run
        publishes adapters, else 0 (full or merged weights)."""
        return self.lora_rank if self.lora_rank and self.lora_publish == "adapter" else 0

    def validate(self) -> None:
        """ValueError naming the first setting that cannot work (RLConfig.<name>), concern by concern."""
        super().validate()
        self._check_sizes()
        self._check_weight_delivery()
        self._check_non_negative()
        self._check_objective()
        self._check_admission()
        self._check_failed_episodes_and_port()
        self._check_evaluation()
        if self.engine not in ("hf", "vllm"):
            raise ValueError(f"RLConfig.engine must be hf or vllm, got {self.engine!r}")

    def _check_sizes(self) -> None:
        """The method, and the counts and lengths that must be at least 1."""
        if self.method not in RL_METHODS:
            raise ValueError(f"RLConfig.method must be one of {', '.join(RL_METHODS)}, got {self.method!r}")
        for key in ("batch_size", "group_size", "critic_updates", "max_new_tokens_per_turn",
                    "max_total_tokens", "rollout_max_batch", "keep_weight_versions"):
            if getattr(self, key) < 1:
                raise ValueError(f"RLConfig.{key} must be >= 1, got {getattr(self, key)}")
        if self.critic_lora_rank < 0:
            raise ValueError(f"RLConfig.critic_lora_rank must be >= 0 (0: a full critic), got {self.critic_lora_rank}")

    def _check_weight_delivery(self) -> None:
        """The delivery probe and the weight transport."""
        if self.delivery_check_tokens == 1 or self.delivery_check_tokens < 0:
            raise ValueError(f"RLConfig.delivery_check_tokens must be 0 (off) or >= 2, got {self.delivery_check_tokens}")
        if not (math.isfinite(self.delivery_tolerance) and self.delivery_tolerance > 0):
            raise ValueError(f"RLConfig.delivery_tolerance must be > 0, got {self.delivery_tolerance}")
        if self.weight_transport not in ("auto", "files", "collective"):
            raise ValueError(f"RLConfig.weight_transport must be auto, files or collective, got "
                             f"{self.weight_transport!r}")
        if self.weight_transport == "collective" and self.rollout_lora_rank():
            raise ValueError("RLConfig.weight_transport collective sends full weights: with lora_rank set "
                             "lora_publish merged")

    def _check_non_negative(self) -> None:
        for key in ("max_staleness", "max_in_flight", "critic_warmup_steps", "value_clip", "micro_batch_tokens",
                    "publish_every"):
            if getattr(self, key) < 0:
                raise ValueError(f"RLConfig.{key} must be >= 0, got {getattr(self, key)}")

    def _check_objective(self) -> None:
        """GRPO groups, learning rates and the DIS band."""
        if self.method in GROUP_METHODS and self.batch_size % self.group_size:
            raise ValueError(f"RLConfig.batch_size ({self.batch_size}) must be a multiple of group_size "
                             f"({self.group_size}) for {self.method}")
        if self.method in GROUP_METHODS and self.group_size < 2:
            raise ValueError("RLConfig.group_size must be >= 2 for the GRPO methods")
        if not (self.policy_lr > 0 and self.critic_lr > 0):
            raise ValueError("RLConfig.policy_lr and critic_lr must be > 0")
        if not 0 <= self.eps_low <= 1 or self.eps_high < 0:
            raise ValueError("RLConfig needs 0 <= eps_low <= 1 and eps_high >= 0")

    def _check_admission(self) -> None:
        """The admission policy (rollout/admission.py) and whether the method can train under its rule."""
        try:
            policy = self.admission_policy()
            policy.validate()
            check_method(policy, self.method)
        except AdmissionError as err:
            raise ValueError(f"RLConfig.{err}") from None

    def _check_failed_episodes_and_port(self) -> None:
        if self.failed_episodes not in ("drop", "train"):
            raise ValueError(f"RLConfig.failed_episodes must be drop or train, got {self.failed_episodes!r}")
        if not math.isfinite(self.failed_reward):
            raise ValueError(f"RLConfig.failed_reward must be a finite number, got {self.failed_reward}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"RLConfig.metrics_port must be 0 (off) or a TCP port, got {self.metrics_port}")

    def _check_evaluation(self) -> None:
        """Evaluation during training."""
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
