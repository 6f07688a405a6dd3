"""The engine interface and sampling settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

#: sampling seeds are in [0, SEED_LIMIT) (a signed 64-bit integer, what torch and vLLM take)
SEED_LIMIT = 2**63


class EngineError(RuntimeError):
    """The engine cannot do what was asked; the message says why."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Training rollouts must use the defaults (plain sampling at temperature 1)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0: no top-k
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()  # in addition to the tokenizer's end-of-turn token
    seed: int | None = None

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be in [0, 2^63), got {self.seed}")


def check_training_sampling(params: SamplingParams) -> None:
    """Training rollouts need the true behaviour log-probs: plain sampling at T = 1, no top-p / top-k."""
    if params.temperature != 1.0 or params.top_p != 1.0 or params.top_k != 0:
        raise ValueError(
            "training rollouts must sample with temperature 1.0, top_p 1.0 and top_k 0 so that the recorded "
            f"log-probs are the policy's (got temperature={params.temperature}, top_p={params.top_p}, "
            f"top_k={params.top_k}); other settings are allowed only in evaluation mode"
        )


def check_context(engine, max_total_tokens: int, what: str = "plan max_total_tokens") -> None:
    """Raise ValueError when a budget of `max_total_tokens` tokens (a whole episode: prompt, turns,
    observations) does not fit the engine's context, `engine.context_length` (an engine without one, e.g.
    a test double, is not checked)."""
    limit = getattr(engine, "context_length", None)
    if limit is None or max_total_tokens <= limit:
        return
    source = getattr(engine, "context_source", "max_model_len")
    fix = "raise max_model_len or lower max_total_tokens" if source == "max_model_len" else "lower max_total_tokens"
    raise ValueError(f"{what} {max_total_tokens} exceeds the engine's context of {limit} tokens ({source}); {fix}")


@dataclass
class Generation:
    """One sampled continuation. Lists are aligned: `logprobs[i]` and `versions[i]` belong to
    `token_ids[i]`. `logprobs` are under the model's own distribution (temperature 1, no truncation)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str                      # "stop" (end-of-turn token) or "length"
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


class Engine(Protocol):
    """An inference engine. `version` is the policy version of the weights in use. `context_length` is the
    most tokens one sequence may hold (prompt and generation; None: unknown) and `context_source` the setting
    that fixes it (vLLM: "max_model_len"; HF: the model's max_position_embeddings)."""

    version: int
    eos_token_ids: tuple[int, ...]
    context_length: int | None
    context_source: str

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...

    async def load_weights(self, model_dir: str, version: int) -> None:
        """Swap to the verified Hugging Face model in `model_dir`, or, when `model_dir` is a peft LoRA adapter
        folder (`sao_core.training.lora.is_adapter_dir`), to the engine's base model (the one it started
        with) plus that adapter; tokens sampled afterwards carry `version`. In-flight requests continue on the
        new weights. On failure the old weights stay."""
        ...

    async def score(self, token_ids: list[int], start: int) -> list[float]:
        """Log-probabilities of `token_ids[start:]`, each given the tokens before it, under the weights in use
        (the model's own distribution: temperature 1, no top-k / top-p), float per token. `start` >= 1. The
        learner's delivery check compares them with its own after a weight push."""
        ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def close(self) -> None: ...

    def stats(self) -> dict: ...
