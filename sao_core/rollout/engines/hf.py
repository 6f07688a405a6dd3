"""HF transformers engine: continuous step-level batching in one engine thread (CPU or one GPU).

Every step takes up to `max_batch` active requests, left-pads their contexts and runs one forward pass
to sample the next token of each. New requests join at the next step and finished ones leave, so a
short request never waits for a long one. The context is re-encoded at every step (no KV cache): simple
and exact, fine for the small models this engine is for; use vLLM for real models.

New weights are loaded off the engine thread and swapped in between two steps: tokens sampled after the
swap carry the new version, in-flight requests keep going.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from sao_core.rollout.engines.base import EngineError, Generation, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    generator: torch.Generator
    started: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


def _sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities to sample from for one row of logits [V] under temperature / top-k / top-p."""
    if params.temperature == 0:
        probs = torch.zeros_like(logits)
        probs[int(torch.argmax(logits))] = 1.0
        return probs
    scaled = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p
        filtered = torch.zeros_like(probs)
        filtered[order[keep]] = sorted_probs[keep]
        probs = filtered / filtered.sum()
    return probs


class HFEngine:
    """Engine over a `transformers` causal LM. Thread-safe entry points are the async methods."""

    def __init__(self, model: str, cache_dir: str, max_batch: int = 32, device: str = "cpu",
                 dtype: str = "float32", seed: int = 0):
        from sao_core.models import load_model_and_tokenizer

        self.model_ref = model
        self.cache_dir = cache_dir
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch = max_batch
        self.model, self.tokenizer = load_model_and_tokenizer(model, cache_dir, dtype=dtype)
        self.model.to(self.device)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_token_ids = tuple(t for t in {self.tokenizer.eos_token_id} if t is not None)
        self.version = 0
        self._seed = seed
        self._counter = 0
        self._inbox: queue.Queue = queue.Queue()
        self._active: list[_Request] = []
        self._swap: tuple | None = None
        self._paused = threading.Event()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._tokens_generated = 0
        self._busy_seconds = 0.0
        self._steps = 0
        self._positions = 0                  # token positions encoded (rows x padded width, summed over steps)
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public (async) API
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        params.validate()
        if not prompt_ids:
            raise EngineError("empty prompt")
        if self._stop.is_set():
            raise EngineError("engine is closed")
        loop = asyncio.get_running_loop()
        self._counter += 1
        seed = params.seed if params.seed is not None else self._seed * 1_000_003 + self._counter
        request = _Request(list(prompt_ids), params, loop, loop.create_future(), torch.Generator().manual_seed(seed))
        self._inbox.put(request)
        self._wake.set()
        try:
            return await request.future
        except asyncio.CancelledError:
            request.future.cancel()
            raise

    async def load_weights(self, model_dir: str, version: int) -> None:
        from sao_core.models import load_model

        new_model = await asyncio.to_thread(load_model, model_dir, self.cache_dir, self.dtype)
        new_model.to(self.device)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._swap = (new_model, version, loop, done)
        self._wake.set()
        await done

    async def pause(self) -> None:
        self._paused.set()

    async def resume(self) -> None:
        self._paused.clear()
        self._wake.set()

    async def close(self) -> None:
        self._stop.set()
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 10)

    def stats(self) -> dict:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        return {"engine": "hf", "model": self.model_ref, "version": self.version, "active": len(self._active),
                "paused": self._paused.is_set(), "tokens_generated": self._tokens_generated,
                "busy_share": self._busy_seconds / elapsed, "busy_seconds": self._busy_seconds,
                "uptime_seconds": elapsed, "steps": self._steps, "positions_encoded": self._positions}

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            while True:
                try:
                    self._active.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if self._swap is not None:
                self._apply_swap()
            self._active = [r for r in self._active if not r.future.cancelled()]
            if self._paused.is_set() or not self._active:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            batch = self._active[: self.max_batch]
            # Rotate so that more than max_batch requests share the steps fairly.
            self._active = self._active[self.max_batch:] + batch
            began = time.monotonic()
            try:
                self._step(batch)
            except Exception as err:  # a broken batch must not kill the engine thread
                log.exception("engine step failed")
                for request in batch:
                    self._finish(request, error=EngineError(f"generation failed: {err}"))
            self._busy_seconds += time.monotonic() - began
            self._steps += 1
        for request in self._active:
            self._finish(request, error=EngineError("engine closed"))

    def _apply_swap(self) -> None:
        new_model, version, loop, done = self._swap
        self._swap = None
        self.model = new_model
        self.version = version
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    def _step(self, batch: list[_Request]) -> None:
        contexts = [r.prompt + r.tokens for r in batch]
        width = max(len(c) for c in contexts)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, context in enumerate(contexts):
            ids[row, width - len(context):] = torch.tensor(context)
            mask[row, width - len(context):] = 1
        self._positions += ids.numel()
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                            position_ids=positions.to(self.device)).logits[:, -1].float().cpu()
        logp = torch.log_softmax(logits, dim=-1)
        for row, request in enumerate(batch):
            probs = _sampling_probs(logits[row], request.params)
            token = int(torch.multinomial(probs, 1, generator=request.generator))
            request.tokens.append(token)
            request.logprobs.append(float(logp[row, token]))
            request.versions.append(self.version)
            self._tokens_generated += 1
            stops = set(self.eos_token_ids) | set(request.params.stop_token_ids)
            if token in stops:
                self._finish(request, reason="stop")
            elif len(request.tokens) >= request.params.max_new_tokens:
                self._finish(request, reason="length")

    def _finish(self, request: _Request, reason: str = "stop", error: Exception | None = None) -> None:
        if request in self._active:
            self._active.remove(request)
        generation = Generation(request.tokens, request.logprobs, request.versions, reason,
                                seconds=time.monotonic() - request.started)

        def deliver():
            if request.future.done():
                return
            if error is not None:
                request.future.set_exception(error)
            else:
                request.future.set_result(generation)

        request.loop.call_soon_threadsafe(deliver)
