"""Resumable training checkpoints (torch distributed checkpoint) and the final Hugging Face export.

A training checkpoint directory holds ``dcp/`` (model and optimiser, sharded by rank, re-shardable),
``trainer_state.json`` (step, data cursor, scheduler, method) and ``rng-rank<R>.pt``. It is published
with `sao_core.storage.publish_checkpoint`, so it is complete only once its ``_COMPLETE`` marker exists
and every file is verified against the manifest when it is read back.

All ranks write into one staging directory, so the ranks of a job must share a filesystem (one node,
or a shared volume); the checkpoint then goes to a path or an s3:// prefix.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import warnings
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
from sao_core.training.distributed import DistContext, barrier

STATE_FILE = "trainer_state.json"


@contextlib.contextmanager
def _single_process_quiet(ctx: DistContext):
    """DCP warns on every call that it runs without a process group; in one process that is intended."""
    with warnings.catch_warnings():
        if not ctx.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def save_training_checkpoint(staging: Path, dest_uri: str, model, optimizer, trainer_state: dict[str, Any],
                             ctx: DistContext) -> str:
    """Write and publish a resumable checkpoint (collective: every rank calls it). Returns `dest_uri`."""
    if ctx.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier(ctx)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _single_process_quiet(ctx):
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(staging / "dcp"))
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    torch.save(rng, staging / f"rng-rank{ctx.rank}.pt")
    barrier(ctx)
    if ctx.is_main:
        (staging / STATE_FILE).write_text(json.dumps({**trainer_state, "world_size": ctx.world_size}, indent=2))
        storage.publish_checkpoint(staging, dest_uri, metadata={"kind": "training-state",
                                                                "step": trainer_state["step"],
                                                                "method": trainer_state["method"]})
        shutil.rmtree(staging, ignore_errors=True)
    barrier(ctx)
    return dest_uri


def load_training_checkpoint(local_dir: Path, model, optimizer, ctx: DistContext) -> dict[str, Any]:
    """Restore model, optimiser and RNG from a verified local checkpoint; return its trainer state."""
    state = json.loads((local_dir / STATE_FILE).read_text())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    loaded = {"model": model_sd, "optim": optim_sd}
    with _single_process_quiet(ctx):
        dcp.load(loaded, checkpoint_id=str(local_dir / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    rng_file = local_dir / f"rng-rank{ctx.rank}.pt"
    if state.get("world_size") == ctx.world_size and rng_file.exists():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return state


def save_full_model(model, tokenizer, staging: Path, ctx: DistContext) -> bool:
    """Gather the full weights of a (possibly FSDP2-sharded) causal LM and write a Hugging Face directory
    (safetensors + tokenizer) at `staging` on rank 0. Collective; returns True on the rank that wrote."""
    from transformers import AutoModelForCausalLM

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not ctx.is_main:
        return False
    shutil.rmtree(staging, ignore_errors=True)
    dtype = next(model.parameters()).dtype
    plain = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    plain.load_state_dict(full, strict=True)
    plain.save_pretrained(staging, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    return True


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
