"""Process-group setup and FSDP2 sharding. Plain single process when not launched by torchrun."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: rank, world size and the device it trains on."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def local_device_index(environ: Mapping[str, str], device_count: int) -> int:
    """The GPU index of this process under torchrun: its ``LOCAL_RANK`` (torchrun sets it to 0 .. processes on
    this node - 1). The global rank modulo the GPU count picks the wrong GPU when nodes run different numbers
    of processes. Raises ValueError when LOCAL_RANK is missing, not an integer, or has no GPU on this node."""
    raw = (environ.get("LOCAL_RANK") or "").strip()
    if not raw:
        raise ValueError("LOCAL_RANK is not set: under torchrun it chooses this process's GPU (torchrun sets it; "
                         "another launcher must set it to the process's index on its node)")
    try:
        local = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be an integer, got {raw!r}") from None
    if not 0 <= local < device_count:
        raise ValueError(f"LOCAL_RANK {local} has no GPU: this node sees {device_count} GPU(s); start at most "
                         f"{device_count} processes per node (torchrun --nproc-per-node) or check "
                         "CUDA_VISIBLE_DEVICES")
    return local


def init_distributed() -> DistContext:
    """Join the torchrun process group (NCCL on GPU, gloo on CPU), or return a single-process context.
    On GPU each process uses the GPU of its LOCAL_RANK (`local_device_index`)."""
    if not dist.is_torchelastic_launched():
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return DistContext(device=device)
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        local = local_device_index(os.environ, torch.cuda.device_count())
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    return DistContext(rank=rank, world_size=world, device=device)


def shard_model(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """FSDP2 (`fully_shard`) each decoder layer, then the root; a no-op in a single process."""
    if not ctx.distributed:
        return model
    return fully_shard_layers(model)


def fully_shard_layers(model: torch.nn.Module) -> torch.nn.Module:
    """`fully_shard` each decoder layer, then the root, in the current process group (also a group of one)."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM (model.model.layers), of the critic (model.backbone.layers) or of either
    wrapped by peft (a LoRA model): the first ModuleList named `layers`."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(module, torch.nn.ModuleList):
            return list(module)
    return []


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def broadcast_object(value, ctx: DistContext):
    """Rank 0's `value` on every rank (any picklable object)."""
    if not ctx.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(value, ctx: DistContext) -> list:
    """Every rank's `value` (any picklable object), in rank order, on every rank; [value] in one process."""
    if not ctx.distributed:
        return [value]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return out


def all_reduce_mean(values: dict[str, float], ctx: DistContext) -> dict[str, float]:
    """Average a dict of floats over ranks (metrics)."""
    if not ctx.distributed or not values:
        return values
    keys = sorted(values)
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64,
                          device=ctx.device if ctx.device.type == "cuda" else "cpu")
    dist.all_reduce(tensor)
    return {k: float(v) / ctx.world_size for k, v in zip(keys, tensor.tolist(), strict=True)}


def all_reduce(values: list[float], ctx: DistContext, op: str = "sum") -> list[float]:
    """Element-wise sum (or max) of a list of floats over ranks; the list itself in one process."""
    if not ctx.distributed or not values:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=ctx.device if ctx.device.type == "cuda" else "cpu")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return [float(v) for v in tensor.tolist()]
