"""Resumable training checkpoints (torch distributed checkpoint) and the final Hugging Face export: the one
checkpoint format of every method (sft, cpt, dpo, gkd and the RL learner).

A training checkpoint directory holds ``dcp/`` (the named models and their optimisers — ``model`` for the
supervised methods, ``policy`` and ``critic`` for RL — sharded by rank and re-shardable to another world
size), ``trainer_state.json`` (step, data cursor or stream position, schedulers, method, config) and
``rng-rank<R>.pt``. Each rank stages its own files in its own directory and uploads them; rank 0 then
writes the manifest of all files and the ``_COMPLETE`` marker (`sao_core.storage`), so the ranks need no
shared filesystem (multi-node jobs publish to s3://) and a reader never sees a partial checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from sao_core import storage
from sao_core.training.distributed import DistContext, all_gather_object, barrier

STATE_FILE = "trainer_state.json"


@contextlib.contextmanager
def _single_process_quiet(ctx: DistContext):
    """DCP warns on every call that it runs without a process group; in one process that is intended."""
    with warnings.catch_warnings():
        if not ctx.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


log = logging.getLogger(__name__)


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def prune_checkpoints(checkpoints_uri: str, keep: int, pinned: Iterable[int] = ()) -> list[str]:
    """Delete the resumable checkpoints (``step-NNNNNN`` under `checkpoints_uri`, local or ``s3://``) beyond the
    newest `keep` complete ones, except those of a `pinned` step; an incomplete one older than the newest
    complete one (a publish a crash cut short) goes too. `keep` 0 keeps all. Call it after a checkpoint is
    complete: only then may older ones go, so a resume always finds the newest complete one. Returns the deleted
    URIs; a failure is logged as a warning and never fails the run (the next call tries again)."""
    if keep <= 0:
        return []
    try:
        names = storage.list_dirs(checkpoints_uri)
    except storage.StorageError as err:
        log.warning("could not list the checkpoints under %s: %s", checkpoints_uri, err)
        return []
    steps = {int(m.group(1)): name for name in names if (m := re.fullmatch(r"step-(\d+)", name))}
    complete = sorted((s for s in steps if storage.is_complete_checkpoint(storage.join(checkpoints_uri, steps[s]))),
                      reverse=True)
    if not complete:
        return []
    kept = set(complete[:keep]) | set(pinned)
    doomed = [s for s in steps if s not in kept and (s in complete or s < complete[0])]
    return delete_checkpoints([storage.join(checkpoints_uri, steps[s]) for s in sorted(doomed)], "checkpoint")


def delete_checkpoints(uris: list[str], what: str) -> list[str]:
    """Delete each published checkpoint of `uris`; a failure is logged as a warning naming `what` and the URI
    (never raised: a later prune tries again). Returns the deleted URIs."""
    deleted = []
    for uri in uris:
        try:
            storage.delete_checkpoint(uri)
        except storage.StorageError as err:
            log.warning("could not delete old %s %s: %s", what, uri, err)
            continue
        deleted.append(uri)
    return deleted


Parts = dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]


def _adapter_only(model) -> bool:
    from sao_core.training.lora import has_adapter

    return has_adapter(model)


def _state_options(model) -> StateDictOptions:
    """A LoRA model's checkpoint holds its adapter (and the adapter's optimiser states) only: the frozen base
    comes back from the run's `model` (verified when it is loaded), so a checkpoint is megabytes, not the
    model's size again."""
    return StateDictOptions(ignore_frozen_params=_adapter_only(model))


def save_training_checkpoint(staging: Path, dest_uri: str, parts: Parts, trainer_state: dict[str, Any],
                             ctx: DistContext) -> str:
    """Write and publish a resumable checkpoint of the named (model, optimiser) `parts` (collective: every rank
    calls it). `staging` is a local scratch directory (each rank uses its own sub-directory). Returns
    `dest_uri`."""
    mine = staging / f"rank-{ctx.rank}"
    shutil.rmtree(mine, ignore_errors=True)
    mine.mkdir(parents=True)
    if ctx.is_main:
        storage.begin_checkpoint(dest_uri)
    state: dict[str, Any] = {}
    for name, (model, optimizer) in parts.items():
        state[name], state[f"{name}_optim"] = get_state_dict(model, optimizer, options=_state_options(model))
    barrier(ctx)
    with _single_process_quiet(ctx):
        dcp.save(state, checkpoint_id=str(mine / "dcp"))
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    torch.save(rng, mine / f"rng-rank{ctx.rank}.pt")
    if ctx.is_main:
        (mine / STATE_FILE).write_text(json.dumps({**trainer_state, "world_size": ctx.world_size}, indent=2))
    try:
        entries: dict[str, Any] | str = storage.upload_checkpoint_files(mine, dest_uri)
    except storage.StorageError as err:
        entries = f"rank {ctx.rank}: {err}"
    everyone = all_gather_object(entries, ctx)
    shutil.rmtree(mine, ignore_errors=True)
    failed = [e for e in everyone if isinstance(e, str)]
    if failed:
        raise storage.StorageError(f"checkpoint {dest_uri} not published: {'; '.join(failed)}")
    if ctx.is_main:
        merged = {rel: entry for rank_entries in everyone for rel, entry in rank_entries.items()}
        adapters = sorted(name for name, (model, _) in parts.items() if _adapter_only(model))
        storage.complete_checkpoint(dest_uri, merged, metadata={"kind": "training-state",
                                                                "step": trainer_state["step"],
                                                                "method": trainer_state["method"],
                                                                **({"adapter_only": adapters} if adapters else {})})
    barrier(ctx)
    return dest_uri


def load_training_checkpoint(local_dir: Path, parts: Parts, ctx: DistContext) -> dict[str, Any]:
    """Restore the named models, optimisers and RNG from a verified local copy of a checkpoint (every rank
    passes its own copy); return its trainer state."""
    state = json.loads((local_dir / STATE_FILE).read_text())
    loaded: dict[str, Any] = {}
    for name, (model, optimizer) in parts.items():
        loaded[name], loaded[f"{name}_optim"] = get_state_dict(model, optimizer, options=_state_options(model))
    with _single_process_quiet(ctx):
        dcp.load(loaded, checkpoint_id=str(local_dir / "dcp"))
    for name, (model, optimizer) in parts.items():
        adapter_only = _adapter_only(model)
        # An adapter-only checkpoint leaves the frozen base as it is (strict=False); every trained weight must load.
        result = set_state_dict(model, optimizer, model_state_dict=loaded[name],
                                optim_state_dict=loaded[f"{name}_optim"],
                                options=StateDictOptions(ignore_frozen_params=adapter_only, strict=not adapter_only))
        if adapter_only:
            trained = {n for n, p in model.named_parameters() if p.requires_grad}
            missing = [k for k in getattr(result, "missing_keys", []) if k in trained]
            if missing or getattr(result, "unexpected_keys", []):
                raise ValueError(f"checkpoint {local_dir}: the {name} adapter does not fit the model: missing "
                                 f"{missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}")
    rng_file = local_dir / f"rng-rank{ctx.rank}.pt"
    if state.get("world_size") == ctx.world_size and rng_file.exists():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return state


def trainable_state_dict(model) -> dict[str, torch.Tensor]:
    """The full (gathered, on CPU) weights of the parameters that train, e.g. a LoRA adapter's: a collective
    under FSDP2 that moves only those."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=True))


def save_full_model(model, tokenizer, staging: Path, ctx: DistContext) -> bool:
    """Gather the full weights of a (possibly FSDP2-sharded) causal LM and write a Hugging Face directory
    (safetensors + tokenizer) at `staging` on rank 0. Collective; returns True on the rank that wrote."""
    from sao_core.training.lora import plain_model

    # A LoRA model is written with its adapter merged (peft's merge), under the base model's names.
    gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not ctx.is_main:
        return False
    plain = plain_model(model, gathered)
    shutil.rmtree(staging, ignore_errors=True)
    plain.save_pretrained(staging, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    return True


def write_full_weights(config, state: dict, tokenizer, staging: Path) -> None:
    """Write a Hugging Face folder (safetensors, config, tokenizer) of the full weights `state` (plain causal-LM
    names, e.g. `lora.plain_state_dict`) of a model of `config` at `staging`, without building a model that
    is randomly initialised first (`lora.model_holding`)."""
    import torch

    from sao_core.training.lora import model_holding

    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    shutil.rmtree(staging, ignore_errors=True)
    model_holding(config, state, dtype).save_pretrained(staging, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)


def export_hf_model(model, tokenizer, staging: Path, dest_uri: str, metadata: dict[str, Any],
                    ctx: DistContext) -> str | None:
    """Gather the full weights and publish a Hugging Face model (safetensors + tokenizer) at `dest_uri`.

    Collective; rank 0 writes. Returns `dest_uri` on rank 0, None elsewhere.
    """
    if not save_full_model(model, tokenizer, staging, ctx):
        barrier(ctx)
        return None
    storage.publish_checkpoint(staging, dest_uri, metadata={"kind": "model", **metadata})
    shutil.rmtree(staging, ignore_errors=True)
    barrier(ctx)
    return dest_uri
