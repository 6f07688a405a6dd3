"""HF transformers engine: continuous step-level batching in one engine thread (CPU or one GPU).

Every step samples the next token of up to `max_batch` requests. New requests join at the next step and
finished ones leave, so a short request never waits for a long one.

KV cache (default for attention-only decoder models such as Llama / Qwen2 / SmolLM2): the engine keeps a
resident batch, one row of a shared key / value buffer per request from its admission to the end of its
turn; each forward writes the new keys / values of every row in place at that row's own positions, so no
cache is copied per step. Each step decodes the resident requests together (one new token each), then
admits waiting requests to free rows (first come, first served, up to `max_batch`) and prefills them
together over the parts of their contexts that are not cached. Multi-turn episodes send the whole context
again at every turn: the cache of the previous turn (copied out to a small LRU store when a request
finishes) is reused when it is a prefix of the new context, so only the tool's reply and the new turn's
tokens are encoded. With `kv_cache=False` (or for architectures the cache does not cover, e.g. sliding
window attention) the whole padded context is re-encoded at every step: simple, exact and slow.

New weights are loaded off the engine thread and swapped in between two steps: tokens sampled after the
swap carry the new version, in-flight requests keep going, and by default their cached keys / values
(and the finished turns' caches) are kept, as vLLM keeps the KV cache of requests in flight. The recorded
log-prob of a token is still exactly the probability it was sampled with (what DIS corrects against);
the keys / values behind it may come from older weights, but not older than the trajectory's oldest
version tag (the prompt was encoded by the weights that sampled the first token; each later turn extends
its own previous turn's cache), so the staleness bound on version tags bounds them too. (One exception:
a turn whose whole context is identical to another episode's finished context may take over that cache.) `recompute_kv_on_update=True` drops every cache at a swap instead, so
every log-prob is the new weights' given the full context; that re-encodes every context in flight at
every update, which with updates every second and long multi-turn contexts costs more than the updates
leave time for (measured: 24x slower on 80 tool episodes of 20 turns).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from sao_core.rollout.engines.base import SEED_LIMIT, EngineError, Generation, SamplingParams

log = logging.getLogger(__name__)

# Extra positions allocated when the resident batch's buffer grows, so that the next tokens and turns usually
# fit without another reallocation.
_CACHE_SLACK = 256


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    generator: torch.Generator
    uniforms: list[float] = field(default_factory=list)   # draws for its tokens, taken from `generator` 64 at a time
    started: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    row: int = -1                      # its row of the engine's resident batch while it holds one, else -1
    kv_len: int = 0                    # positions of prompt + tokens whose keys / values are in that row

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens


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


def _plain(params: SamplingParams) -> bool:
    """Sampling from the model's own distribution (temperature 1, no truncation)."""
    return params.temperature == 1.0 and params.top_k == 0 and params.top_p >= 1.0


@dataclass(frozen=True)
class _CacheShape:
    layers: int
    kv_heads: int
    head_dim: int


def _cache_shape(model) -> _CacheShape | None:
    """Shape of the per-layer key / value cache, or None when this engine's cache does not cover the
    architecture (sliding-window or non-attention layers, encoder-decoder)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return None
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return None
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return None
    try:
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return _CacheShape(config.num_hidden_layers, kv_heads, head_dim)
    except AttributeError:
        return None


class _PrefixStore:
    """Finished turns' caches, least recently stored dropped first, found by the context that extends them.

    Lookup must not scan every entry (hundreds, once per joining turn): each entry is indexed by a hash chain
    over its whole blocks of `block` tokens, so a lookup hashes the new context's blocks once and, from its
    longest block prefix down, checks only entries filed under that prefix (a token-by-token comparison
    confirms a candidate, so hash collisions cannot give a wrong cache)."""

    def __init__(self, capacity: int, block: int = 16):
        self.capacity = capacity
        self.block = block
        self._entries: OrderedDict[int, tuple[tuple[int, ...], torch.Tensor, int]] = OrderedDict()
        self._index: dict[int, set[int]] = {}
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _chain(self, tokens, blocks: int) -> list[int]:
        """Hashes of the first 0, 1, ..., `blocks` whole blocks of `tokens`."""
        chain = [0]
        for i in range(blocks):
            chain.append(hash((chain[-1], tuple(tokens[i * self.block:(i + 1) * self.block]))))
        return chain

    def put(self, tokens: tuple[int, ...], kv: torch.Tensor) -> None:
        """Store the cache `kv` whose first len(tokens) positions hold `tokens`."""
        bucket = self._chain(tokens, len(tokens) // self.block)[-1]
        key, self._next_key = self._next_key, self._next_key + 1
        self._entries[key] = (tokens, kv, bucket)
        self._index.setdefault(bucket, set()).add(key)
        while len(self._entries) > self.capacity:
            self._remove(next(iter(self._entries)))

    def take(self, context: list[int]) -> tuple[torch.Tensor | None, int]:
        """Remove and return the cache of the longest stored context that is a prefix of `context` (an episode
        continues once), with the positions to reuse: all of them, but at most len(context) - 1 (the last
        context token must be fed to get the next token's logits)."""
        chain = self._chain(context, len(context) // self.block)
        for bucket in reversed(chain):
            best, best_len = None, 0
            for key in self._index.get(bucket, ()):
                tokens = self._entries[key][0]
                if best_len < len(tokens) <= len(context) and tuple(context[:len(tokens)]) == tokens:
                    best, best_len = key, len(tokens)
            if best is not None:
                kv = self._entries[best][1]
                self._remove(best)
                return kv, min(best_len, len(context) - 1)
        return None, 0

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()

    def _remove(self, key: int) -> None:
        _, _, bucket = self._entries.pop(key)
        members = self._index[bucket]
        members.discard(key)
        if not members:
            del self._index[bucket]


def _row_cache(keys: list[torch.Tensor], values: list[torch.Tensor], write_at: torch.Tensor, width: int):
    """A transformers `Cache` over per-layer tensors [B, kv_heads, capacity, head_dim] (rows of the resident
    batch): the forward pass writes the keys / values of its q new positions of row b at `write_at[b]` [B, q]
    (each row its own positions, in place) and attends over the first `width` positions."""
    from transformers.cache_utils import Cache, DynamicLayer

    rows = torch.arange(write_at.shape[0]).unsqueeze(1)

    class _Layer(DynamicLayer):
        def __init__(self, k: torch.Tensor, v: torch.Tensor):
            super().__init__()
            self.keys, self.values = k, v
            self.dtype, self.device = k.dtype, k.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            # [B, heads, q, dim] -> rows b, positions write_at[b, i]
            self.keys[rows, :, write_at] = key_states.transpose(1, 2)
            self.values[rows, :, write_at] = value_states.transpose(1, 2)
            return self.keys[:, :, :width], self.values[:, :, :width]

        def get_seq_length(self) -> int:
            return width

    return Cache(layers=[_Layer(k, v) for k, v in zip(keys, values, strict=True)])


_GQA_ATTENTION = "sao_sdpa_gqa"


def _gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):
    """transformers' SDPA attention, but key / value heads shared by several query heads (GQA) are used in
    place (`enable_gqa`) instead of being copied per query head, which transformers does whenever a mask is
    given. query [B, Hq, q, D], key / value [B, Hkv, k, D] (reads of the cache; copying them every layer
    and step cost more than the attention). Returns ([B, q, Hq, D], None)."""
    q_length, kv_length = query.shape[2], key.shape[2]
    causal = q_length > 1 and attention_mask is None and (is_causal if is_causal is not None
                                                           else getattr(module, "is_causal", True))
    if causal and kv_length > q_length:   # as transformers: an empty static cache's unused positions
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout if module.training else 0.0, scale=scaling,
        is_causal=causal, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _use_gqa_attention(model) -> None:
    """Switch a model that uses transformers' SDPA attention to `_gqa_sdpa_attention` (same masks)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(_GQA_ATTENTION, _gqa_sdpa_attention)
    AttentionMaskInterface.register(_GQA_ATTENTION, sdpa_mask)
    model.set_attn_implementation(_GQA_ATTENTION)


@functools.cache
def _takes_logits_to_keep(model_class: type) -> bool:
    """Whether an architecture's forward takes `logits_to_keep` (looked up once per class)."""
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


class HFEngine:
    """Engine over a `transformers` causal LM. Thread-safe entry points are the async methods.

    `max_batch`: sequences per forward pass (with the KV cache more requests wait for a free row, first come
    first served; without it they take turns). `kv_cache`: keep keys /
    values per request and reuse a finished request's cache for a context that extends it (see the
    module docstring); `prefix_cache_entries` finished caches are kept (least recently used dropped);
    `recompute_kv_on_update`: drop the caches at a weight update (see the module docstring).
    `dtype` "auto" (the default): bfloat16 on a CUDA device, float32 on CPU (`sao_core.models.resolve_dtype`);
    float32, bfloat16 and float16 are used as given. `context_length` is the model's context
    (`max_position_embeddings` in its config): the rollout manager refuses plans whose `max_total_tokens`
    exceed it. `unverified`: a local model folder without a manifest is loaded as it is
    (`sao_core.models.verify_model_dir`); weight updates are always verified.
    """

    context_source = "the model's max_position_embeddings"

    def __init__(self, model: str, cache_dir: str, max_batch: int = 32, device: str = "cpu",
                 dtype: str = "auto", seed: int = 0, kv_cache: bool = True, prefix_cache_entries: int = 0,
                 recompute_kv_on_update: bool = False, unverified: bool = False):
        from sao_core.models import context_length_of, load_model_and_tokenizer, pad_token_id, resolve_dtype

        if max_batch < 1:
            raise EngineError(f"max_batch must be >= 1, got {max_batch}")
        if prefix_cache_entries < 0:
            raise EngineError(f"prefix_cache_entries must be >= 0, got {prefix_cache_entries}")
        self.model_ref = model
        self.cache_dir = cache_dir
        self.device = torch.device(device)
        try:
            self.dtype = resolve_dtype(dtype, self.device)
        except ValueError as err:
            raise EngineError(str(err)) from err
        self.max_batch = max_batch
        self.model, self.tokenizer = load_model_and_tokenizer(model, cache_dir, dtype=self.dtype,
                                                              unverified=unverified)
        self.model.to(self.device)
        self.context_length = context_length_of(self.model.config.to_dict())
        _use_gqa_attention(self.model)
        self.cache_shape = _cache_shape(self.model) if kv_cache else None
        if kv_cache and self.cache_shape is None:
            log.warning("the HF engine's KV cache does not cover %s; contexts are re-encoded at every step",
                        type(self.model).__name__)
        self.prefix_cache_entries = prefix_cache_entries or 4 * max_batch
        self.recompute_kv_on_update = bool(recompute_kv_on_update)
        self._prefix_store = _PrefixStore(self.prefix_cache_entries)
        # The resident batch: request i holds row i of `_slots` [layers, 2, rows, kv_heads, capacity, head_dim],
        # its keys / values left-aligned in positions [0, kv_len). See _step_cached.
        self._slots: torch.Tensor | None = None
        self._rows: list[_Request] = []
        self.pad_id = pad_token_id(self.tokenizer)
        self.eos_token_ids = tuple(t for t in {self.tokenizer.eos_token_id} if t is not None)
        self.version = 0
        self._seed = seed
        self._counter = 0
        self._inbox: queue.Queue = queue.Queue()
        self._active: list[_Request] = []
        self._swap: tuple | None = None
        self._calls: queue.Queue = queue.Queue()   # (fn, loop, future): run in the engine thread between steps
        self._model_is_base = True                 # the live model is the base (+ an adapter): adapters apply to it
        self._broken: str | None = None            # why the live weights must not be served (a corrupt update)
        self.lora_mode: str | None = None          # "adapter" once a LoRA adapter is in use
        self._adapter_base: dict | None = None     # the base model's modules adapters are checked against
        self._paused = threading.Event()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._tokens_generated = 0
        self._busy_seconds = 0.0
        self._steps = 0
        self._positions = 0                  # token positions encoded (fed through the model), summed over steps
        self._prefill_tokens = 0
        self._reused_tokens = 0              # context positions taken from a finished request's cache
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
        if self._broken is not None:
            raise EngineError(f"the engine's weights are unusable ({self._broken})")
        loop = asyncio.get_running_loop()
        self._counter += 1
        seed = params.seed if params.seed is not None else (self._seed * 1_000_003 + self._counter) % SEED_LIMIT
        request = _Request(list(prompt_ids), params, loop, loop.create_future(), torch.Generator().manual_seed(seed))
        self._inbox.put(request)
        self._wake.set()
        try:
            return await request.future
        except asyncio.CancelledError:
            request.future.cancel()
            raise

    async def load_weights(self, model_dir: str, version: int) -> None:
        """Full weights: loaded off the engine thread, swapped in between two steps. A LoRA adapter folder
        (`lora.is_adapter_dir`): checked against the base model first (`_load_adapter`), then applied to the
        base model the engine started with (peft, unmerged, as the learner computes it) in the engine thread
        between two steps; the first adapter injects the LoRA layers, later ones copy a few megabytes of adapter
        weights. After full weights of another version the base is loaded again before an adapter is applied."""
        from sao_core.models import load_model
        from sao_core.training import lora

        if lora.is_adapter_dir(model_dir):
            await self._load_adapter(model_dir, version)
            return
        new_model = await asyncio.to_thread(load_model, model_dir, self.cache_dir, self.dtype)
        new_model.to(self.device)
        _use_gqa_attention(new_model)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._swap = (new_model, version, loop, done)
        self._wake.set()
        await done
        self._model_is_base = False
        self.lora_mode = None

    async def update_in_memory(self, update) -> str:
        """Full weights handed over in memory (`sao_core.rollout.weights.WeightUpdate`, a colocated learner):
        copied into the live model's parameters in the engine thread between two steps (no files, no new model
        object), then the digest of what the model holds is recomputed and must equal the sender's. Returns
        that digest; tokens sampled afterwards carry `update.version`. A bad update (names, shapes, dtypes, a
        skipped tensor) is refused before anything changes (EngineError); a digest mismatch after the copy, or any
        failure once the copy has begun, leaves the engine refusing to serve until a good update arrives.
        A LoRA adapter update (`update.adapter_config` set): `_update_adapter_in_memory`."""
        from sao_core.rollout.weights import WeightsCorrupted, WeightUpdateError, apply_update

        if update.adapter_config is not None:
            return await self._update_adapter_in_memory(update)

        def run() -> str:
            if self.lora_mode is not None:
                raise EngineError("in-memory full weights cannot replace a model carrying a LoRA adapter; "
                                  f"the current weights (version {self.version}) stay")
            try:
                digest = apply_update(self.model, update)
            except WeightUpdateError as err:
                if isinstance(err, WeightsCorrupted):
                    self._broken = str(err)
                raise EngineError(f"{err}; the current weights (version {self.version}) stay"
                                  if self._broken is None else str(err)) from err
            self._broken = None
            self.version = update.version
            self._model_is_base = False
            self._after_weight_change(False)
            return digest

        return await self._in_engine_thread(run)

    async def _update_adapter_in_memory(self, update) -> str:
        """A LoRA adapter handed over in memory, with the guarantees of an adapter folder: its tensors copied and
        their digest checked against the sender's (`weights.receive_adapter`), then checked against the base
        model like a folder (`lora.check_adapter`), then applied the same way (`_put_adapter`). Returns the
        digest; a refused adapter leaves the engine as it was (EngineError naming the problem)."""
        from sao_core.rollout.weights import WeightUpdateError, receive_adapter
        from sao_core.training import lora

        where = f"in-memory adapter v{update.version}"
        try:
            weights, digest = await asyncio.to_thread(receive_adapter, update)
        except WeightUpdateError as err:
            raise EngineError(f"{err}; the current weights (version {self.version}) stay") from err

        def check(base) -> tuple:
            return lora.check_adapter(update.adapter_config, weights, base, where), weights

        await self._put_adapter(check, where, update.version)
        return digest

    def weight_dtypes(self) -> dict:
        """name -> dtype of every state entry of the live model (what an in-memory update must be sent in)."""
        return {name: tensor.dtype for name, tensor in self.model.state_dict(keep_vars=True).items()}

    async def score(self, token_ids: list[int], start: int) -> list[float]:
        """Log-probs of `token_ids[start:]` under the weights in use (raw distribution), computed in the
        engine thread between two steps, so never across a weight swap."""
        if not 1 <= start < len(token_ids):
            raise EngineError(f"score: start must be in [1, {len(token_ids) - 1}], got {start}")

        def run() -> list[float]:
            if self._broken is not None:
                raise EngineError(f"the engine's weights are unusable ({self._broken})")
            ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
            logits = self.model(input_ids=ids, use_cache=False).logits[0, start - 1:-1].float()
            logp = torch.log_softmax(logits, dim=-1)
            return logp.gather(1, ids[0, start:].unsqueeze(1)).squeeze(1).cpu().tolist()

        return await self._in_engine_thread(run)

    async def _in_engine_thread(self, fn):
        """Run `fn()` in the engine thread between two steps (also while paused); its result or exception."""
        if self._stop.is_set():
            raise EngineError("engine is closed")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._calls.put((fn, loop, done))
        self._wake.set()
        return await done

    async def _load_adapter(self, adapter_dir: str, version: int) -> None:
        """An adapter folder, checked against the base model's module names and shapes (`lora.check_adapter_dir`:
        pure parsing and shape checks, nothing injected), then applied (`_put_adapter`)."""
        from sao_core.training import lora

        await self._put_adapter(functools.partial(lora.check_adapter_dir, adapter_dir), adapter_dir, version)

    async def _put_adapter(self, check, where: str, version: int) -> None:
        """Check an adapter off the engine thread, then apply it in the engine thread: `check(base)` (`base` the
        base model's `lora.base_modules`) returns its (LoraConfig, weights under peft's file names) or raises
        ValueError; `where` names the adapter in errors. A refused adapter leaves the engine as it was (weights,
        version, lora_mode): EngineError."""
        from sao_core.models import load_model
        from sao_core.training import lora

        base = None   # a fresh base model, when full weights of another version are in use
        if self._adapter_base is None:   # the base's modules never change: described once
            if not self._model_is_base:
                base = await asyncio.to_thread(load_model, self.model_ref, self.cache_dir, self.dtype)
            self._adapter_base = await asyncio.to_thread(lora.base_modules, self.model if base is None else base)
        try:
            checked = await asyncio.to_thread(check, self._adapter_base)
        except ValueError as err:
            raise EngineError(f"{err}; the current weights (version {self.version}) stay") from err
        if base is None and not self._model_is_base:
            base = await asyncio.to_thread(load_model, self.model_ref, self.cache_dir, self.dtype)
        if base is not None:
            base.to(self.device)
            _use_gqa_attention(base)
        await self._in_engine_thread(functools.partial(self._apply_adapter, self.model if base is None else base,
                                                       checked, where, version))

    def _apply_adapter(self, model, checked, where: str, version: int) -> None:
        """(engine thread) the checked adapter (`_put_adapter`: its config and weights) into `model` (the
        base, or the live model already carrying an adapter); `model` becomes the live model at `version`.
        `lora.put_adapter_into` is transactional: when it fails, `model` is as it was, and so is the engine."""
        from sao_core.training import lora

        config, weights = checked
        try:
            lora.put_adapter_into(model, config, weights, where)
        except Exception as err:   # the model is as it was (put_adapter_into undid its changes): say so
            raise EngineError(f"{err}; the current weights (version {self.version}) stay") from err
        model.eval()
        dtype_changed = self._slots is not None and self._slots.dtype != model.dtype
        self.model, self.version = model, version
        self._model_is_base, self.lora_mode = True, "adapter"
        self._after_weight_change(dtype_changed)

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
        return {"engine": "hf", "model": self.model_ref, "version": self.version, "dtype": self.dtype,
                "context_length": self.context_length, "active": len(self._active),
                "paused": self._paused.is_set(), "tokens_generated": self._tokens_generated,
                "busy_share": self._busy_seconds / elapsed, "busy_seconds": self._busy_seconds,
                "uptime_seconds": elapsed, "steps": self._steps, "positions_encoded": self._positions,
                "kv_cache": self.cache_shape is not None, "lora": self.lora_mode,
                "prefill_tokens": self._prefill_tokens, "prefix_reused_tokens": self._reused_tokens}

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
            self._run_calls()
            if self._broken is not None:   # never sample from weights that did not arrive intact
                for request in list(self._active):
                    self._finish(request, error=EngineError(f"the engine's weights are unusable ({self._broken})"))
            for request in [r for r in self._active if r.future.cancelled()]:
                self._active.remove(request)
                self._leave_row(request)
            if self._paused.is_set() or not self._active:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            if self.cache_shape is None:
                batch = self._active[: self.max_batch]
                # Rotate so that more than max_batch requests share the steps fairly.
                self._active = self._active[self.max_batch:] + batch
            else:
                batch = list(self._active)    # the resident batch admits up to max_batch, first come first
            began = time.monotonic()
            try:
                if self.cache_shape is None:
                    self._step_reencode(batch)
                else:
                    self._step_cached()
            except Exception as err:  # a broken batch must not kill the engine thread
                log.exception("engine step failed")
                for request in batch:
                    self._finish(request, error=EngineError(f"generation failed: {err}"))
            self._busy_seconds += time.monotonic() - began
            self._steps += 1
        for request in self._active:
            self._finish(request, error=EngineError("engine closed"))
        while not self._calls.empty():
            _, loop, done = self._calls.get_nowait()
            loop.call_soon_threadsafe(lambda done=done: done.done() or done.set_exception(EngineError("engine closed")))

    def _run_calls(self) -> None:
        while True:
            try:
                fn, loop, done = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                result, error = fn(), None
            except Exception as err:  # handed to the caller; the engine thread goes on
                result, error = None, err

            def deliver(done=done, result=result, error=error):
                if done.done():
                    return
                if error is not None:
                    done.set_exception(error)
                else:
                    done.set_result(result)

            loop.call_soon_threadsafe(deliver)

    def _apply_swap(self) -> None:
        new_model, version, loop, done = self._swap
        self._swap = None
        dtype_changed = self._slots is not None and self._slots.dtype != new_model.dtype
        self.model = new_model
        self.version = version
        self._broken = None
        self._after_weight_change(dtype_changed)
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    def _after_weight_change(self, dtype_changed: bool) -> None:
        if self.recompute_kv_on_update or dtype_changed:
            # Keys / values of the old weights must not be reused: every request in flight re-encodes its
            # context with the new weights when it is admitted again.
            self._prefix_store.clear()
            for request in self._rows:
                request.row, request.kv_len = -1, 0
            self._rows, self._slots = [], None

    def _step_reencode(self, batch: list[_Request]) -> None:
        """One token per request, re-encoding every left-padded context [B, max context length]."""
        contexts = [r.context for r in batch]
        width = max(len(c) for c in contexts)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, context in enumerate(contexts):
            ids[row, width - len(context):] = torch.tensor(context)
            mask[row, width - len(context):] = 1
        self._positions += ids.numel()
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        # Only the last position's logits: [B, V], not [B, T, V] (at a 152k vocabulary and long contexts the
        # full tensor is gigabytes), where the architecture's forward takes `logits_to_keep`.
        keep = {"logits_to_keep": 1} if _takes_logits_to_keep(type(self.model)) else {}
        logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                            position_ids=positions.to(self.device), use_cache=False, **keep).logits[:, -1].float().cpu()
        self._sample(batch, logits)

    def _step_cached(self) -> None:
        """Decode the resident requests together (one forward, one new token each); then admit waiting requests
        to free rows (up to max_batch) and prefill them together (one forward over the context tokens their
        rows do not hold yet; a finished turn's cache is copied in when their context extends it).

        A request keeps its row from admission to the end of its turn, so keys / values are written once, in
        place, and never copied per step; rows are kept contiguous (the last one moves into a freed row)."""
        if self._rows:
            decode = list(self._rows)
            self._sample(decode, self._forward_rows(0, [[r.tokens[-1]] for r in decode]))
        # From the live list: requests that finished in the decode above have left it.
        joining = [r for r in self._active if r.row < 0][:self.max_batch - len(self._rows)]
        if joining:
            first = len(self._rows)
            feeds = [self._admit(r) for r in joining]
            self._prefill_tokens += sum(len(f) for f in feeds)
            self._sample(joining, self._forward_rows(first, feeds))

    def _admit(self, request: _Request) -> list[int]:
        """Give the request the next row, with a finished turn's keys / values when its context extends that
        turn's; returns the context tokens still to encode."""
        context = request.context
        kv, reused = self._prefix_store.take(context)
        row = len(self._rows)
        self._reserve(row + 1, len(context) + 1)
        if reused:
            self._slots[:, :, row, :, :reused] = kv[:, :, :, :reused]
        request.row, request.kv_len = row, reused
        self._rows.append(request)
        self._reused_tokens += reused
        return context[reused:]

    def _reserve(self, rows: int, positions: int) -> None:
        """Make `_slots` hold at least `rows` rows of `positions` positions (grown geometrically; the rows in
        use are copied over)."""
        slots, shape = self._slots, self.cache_shape
        if slots is not None and slots.shape[2] >= rows and slots.shape[4] >= positions:
            return
        have_rows, have_positions = (slots.shape[2], slots.shape[4]) if slots is not None else (0, 0)
        if rows > have_rows:
            rows = min(max(rows, 2 * have_rows, 8), max(self.max_batch, rows))
        if positions > have_positions:
            positions = max(positions + _CACHE_SLACK, have_positions + have_positions // 2)
        rows, positions = max(rows, have_rows), max(positions, have_positions)
        grown = torch.zeros((shape.layers, 2, rows, shape.kv_heads, positions, shape.head_dim),
                            dtype=self.model.dtype, device=self.device)
        if slots is not None and self._rows:
            used = max(r.kv_len for r in self._rows)
            grown[:, :, :len(self._rows), :, :used] = slots[:, :, :len(self._rows), :, :used]
        self._slots = grown

    def _leave_row(self, request: _Request) -> None:
        """Free the request's row; the last row moves into it (rows stay contiguous)."""
        row = request.row
        if row < 0:
            return
        last = self._rows.pop()
        if last is not request:
            self._slots[:, :, row, :, :last.kv_len] = self._slots[:, :, last.row, :, :last.kv_len]
            self._rows[row], last.row = last, row
        request.row = -1

    def _forward_rows(self, first: int, feeds: list[list[int]]) -> torch.Tensor:
        """Encode `feeds[i]` (the next context tokens of the request in row first + i, after its kv_len cached
        positions) for rows first, first + 1, ... in one forward pass; their keys / values are written into
        the rows in place. Returns the logits of each request's next token [n, V].

        Feeds are left-padded to the longest, S, so that every row's last column is a real token; a padding
        token's keys / values go to the row's last position, which no query attends to (capacity >= width + 1)."""
        n, span = len(feeds), max(len(f) for f in feeds)
        requests = self._rows[first:first + n]
        cached = [r.kv_len for r in requests]
        width = max(c + len(f) for c, f in zip(cached, feeds, strict=True))
        self._reserve(first + n, width + 1)
        slots, spare = self._slots, self._slots.shape[4] - 1
        # ids, positions and write positions built in Python and converted once (per-row tensor ops cost more).
        ids, positions, write_at = [], [], []
        for c, feed in zip(cached, feeds, strict=True):
            pad = span - len(feed)
            ids.append([self.pad_id] * pad + feed)
            positions.append([0] * pad + list(range(c, c + len(feed))))
            write_at.append([spare] * pad + list(range(c, c + len(feed))))
        positions_t = torch.tensor(positions, dtype=torch.long)
        # 4-D attention mask [n, 1, S, width] (True = attend), built here: transformers uses a 4-D mask as given
        # instead of deriving one from a padding mask at every step. A fed token sees its row's positions up to
        # its own; a padding query sees position 0 only (finite, discarded).
        column = torch.arange(width).view(1, 1, 1, -1)
        real = (torch.arange(span).view(1, -1) >= span - torch.tensor([len(f) for f in feeds]).view(-1, 1))
        mask = torch.where(real.view(n, 1, span, 1), column <= positions_t.view(n, 1, span, 1), column == 0)
        if getattr(self.model.config, "_attn_implementation", None) != _GQA_ATTENTION:
            # other attention kernels (eager) add the mask to the scores
            mask = torch.zeros(mask.shape, dtype=self.model.dtype).masked_fill(~mask, torch.finfo(self.model.dtype).min)
        view = slots[:, :, first:first + n]
        cache = _row_cache([view[i, 0] for i in range(view.shape[0])], [view[i, 1] for i in range(view.shape[0])],
                           torch.tensor(write_at, dtype=torch.long, device=self.device), width)
        logits = self.model(input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
                            attention_mask=mask.to(self.device), position_ids=positions_t.to(self.device),
                            past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float().cpu()
        for r, feed in zip(requests, feeds, strict=True):
            r.kv_len += len(feed)
        self._positions += sum(len(f) for f in feeds)
        return logits

    def _sample(self, batch: list[_Request], logits: torch.Tensor) -> None:
        """Sample one token per request from `logits` [B, V]; finish the requests that stop."""
        logp = torch.log_softmax(logits, dim=-1)
        probs = logp.exp()
        for row, r in enumerate(batch):
            if not _plain(r.params):
                probs[row] = _sampling_probs(logits[row], r.params)
        # Inverse-CDF sampling with the request's next uniform draw from its own generator: the same tokens for a
        # request whatever else shares its batch, one batched search instead of a multinomial per row.
        for r in batch:
            if len(r.uniforms) <= len(r.tokens):
                r.uniforms += torch.rand(64, generator=r.generator).tolist()
        cdf = probs.cumsum(dim=-1)
        draws = torch.tensor([r.uniforms[len(r.tokens)] for r in batch]) * cdf[:, -1]
        tokens = torch.searchsorted(cdf, draws.unsqueeze(1), right=True).squeeze(1).clamp(max=cdf.shape[1] - 1)
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        for row, (request, token) in enumerate(zip(batch, tokens.tolist(), strict=True)):
            request.tokens.append(token)
            request.logprobs.append(chosen[row])
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
        if error is None and request.row >= 0 and request.kv_len:
            # Keep the cache for the episode's next turn, whose context starts with this one.
            kv = self._slots[:, :, request.row, :, :request.kv_len].clone()
            self._prefix_store.put(tuple(request.context[:request.kv_len]), kv)
        self._leave_row(request)
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
