"""In-memory weight updates: the learner's parameters handed to an engine without files.

A `WeightUpdate` is the new policy's full weights as named tensors in the engine's dtype (the order they are
sent in), the version they are, and a digest of exactly those tensors: xxh3-128 over each tensor's name, dtype,
shape and bytes, in send order. The receiver copies the tensors into its existing parameters and recomputes
the digest over what it now holds (`tensors_digest` of its own parameters in the same order); a tensor changed
or skipped on the way, a wrong dtype or shape, or names the engine does not have stop the update with an error
naming what differed.

A LoRA run sends its adapter the same way (a few megabytes): the same `WeightUpdate`, whose tensors are the
adapter's weights under peft's file names and whose `adapter_config` is what the adapter folder's
``adapter_config.json`` would hold. The receiver copies the tensors, hashes its copy, checks it as it would check
an adapter folder (`sao_core.training.lora.check_adapter`) and only then applies it (`HFEngine.update_in_memory`).

Why xxh3 and not sha256: the digest guards against transport faults and bugs (a bucket skipped, a stale
buffer), not against an adversary who can write into the process (who could change the parameters anyway).
xxh3 hashes at memory speed (~0.04 s for SmolLM2-135M's 538 MB on this CPU, sha256 0.34 s). Durable versions
on storage keep their sha256 manifests (`sao_core.storage`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch

#: digest scheme, written in front of every digest so a reader can tell it from a sha256 manifest digest
DIGEST_SCHEME = "xxh3-128"
#: the scheme where the xxhash package is missing (a bare GPU machine running bench/gpu_check.py): both sides
#: of an update in one process hash the same way; two processes with different schemes disagree, by name
FALLBACK_SCHEME = "blake2b-128"


def _hasher():
    """(a new streaming hasher, its scheme name)."""
    try:
        import xxhash
    except ImportError:
        import hashlib

        return hashlib.blake2b(digest_size=16), FALLBACK_SCHEME
    return xxhash.xxh3_128(), DIGEST_SCHEME


#: elements per chunk of the streaming digest: the chunk just copied is hashed while it is in the CPU's cache
#: (4 MB of float32, 2 MB of bfloat16: about a core's L2 here). Every tensor of SmolLM2-135M but the embedding
#: is one chunk: fewer, larger chunks mean less interpreter work per update, on this thread and on the sender's
#: hash thread (with 1 << 18 an update took 1.63-1.69x the bare copy with a float32 engine, 1.83-1.97x with
#: bfloat16; with 1 << 20 1.43-1.56x and 1.57-1.79x: bench/weight_transport.py, 2026-12-05). The digest does not
#: depend on it.
CHUNK = 1 << 20

NamedTensors = Sequence[tuple[str, torch.Tensor]]


class WeightUpdateError(ValueError):
    """An in-memory update does not fit the receiving model or did not arrive intact; the message says how."""


class WeightsCorrupted(WeightUpdateError):
    """The tensors received hash differently from the sender's digest: the model now holds a mixture."""


def _header(name: str, dtype: torch.dtype, shape) -> bytes:
    return f"{name}\0{str(dtype).removeprefix('torch.')}\0{tuple(shape)}\0".encode()


def _host_bytes(chunk: torch.Tensor):
    """The bytes of a contiguous 1-D chunk as a buffer on the CPU (a copy only for a device tensor)."""
    if chunk.device.type != "cpu":
        chunk = chunk.cpu()
    return chunk.view(torch.uint8).numpy()


def tensors_digest(named: Iterable[tuple[str, torch.Tensor]], dtypes: Sequence[torch.dtype] | None = None) -> str:
    """xxh3-128 over each tensor's name, dtype, shape and bytes, in the given order: ``xxh3-128:<32 hex>``.
    With `dtypes` (one per tensor), the bytes are those of the tensor converted to that dtype (converted chunk by
    chunk into a small buffer, never as a whole copy)."""
    hasher, scheme = _hasher()
    scratch: dict[torch.dtype, torch.Tensor] = {}
    for index, (name, tensor) in enumerate(named):
        dtype = tensor.dtype if dtypes is None else dtypes[index]
        hasher.update(_header(name, dtype, tensor.shape))
        flat = tensor.detach().contiguous().reshape(-1)
        for begin in range(0, flat.numel(), CHUNK):
            chunk = flat[begin:begin + CHUNK]
            if chunk.dtype != dtype:
                if dtype not in scratch:
                    scratch[dtype] = torch.empty(CHUNK, dtype=dtype, device=flat.device)
                chunk = scratch[dtype][:chunk.numel()].copy_(chunk)
            hasher.update(_host_bytes(chunk))
    return f"{scheme}:{hasher.hexdigest()}"


def unique_named_tensors(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The entries of a state dict in its order, each storage once: a tied weight (SmolLM2's output layer is
    its embedding) is sent under its first name only."""
    seen: set[tuple[int, int]] = set()
    out = []
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset()) if tensor.numel() else (id(tensor), 0)
        if key in seen:
            continue
        seen.add(key)
        out.append((name, tensor))
    return out


class WeightUpdate:
    """Version `version` of the policy: `tensors` (name, tensor) to be received in `dtypes` (one per tensor; the
    bytes sent are each tensor converted to its dtype), and `digest`, xxh3-128 of those bytes in order
    (`tensors_digest`).

    The digest is computed by the sender on a thread of its own, started here, while the receiver copies (the
    hash releases the interpreter lock): reading it (`digest`) waits for it. The tensors may be the learner's own
    parameters (no copy is made): the learner must not change them until the receiver answered. `digest` given:
    that value (e.g. what a sender announced). `adapter_config` (a LoRA run): the tensors are a LoRA adapter's
    weights under peft's file names, and this the dict its ``adapter_config.json`` would hold; None: full
    weights."""

    def __init__(self, version: int, tensors: NamedTensors, dtypes: Sequence[torch.dtype] | None = None,
                 digest: str | None = None, adapter_config: dict | None = None):
        self.version = version
        self.adapter_config = adapter_config
        self.tensors = tuple((name, t.detach()) for name, t in tensors)
        self.dtypes = tuple(dtypes) if dtypes is not None else tuple(t.dtype for _, t in self.tensors)
        if len(self.dtypes) != len(self.tensors):
            raise ValueError(f"{len(self.dtypes)} dtypes for {len(self.tensors)} tensors")
        self._digest = digest
        self._done = threading.Event()
        if digest is not None:
            self._done.set()
        else:
            threading.Thread(target=self._hash, name=f"weights-digest-v{version}", daemon=True).start()

    def _hash(self) -> None:
        try:
            self._digest = tensors_digest(self.tensors, self.dtypes)
        except BaseException as err:   # handed to whoever reads the digest
            self._digest = err
        finally:
            self._done.set()

    @property
    def digest(self) -> str:
        self._done.wait()
        if isinstance(self._digest, BaseException):
            raise WeightUpdateError(f"weight update v{self.version}: the sender's digest failed: "
                                    f"{self._digest}") from self._digest
        return self._digest

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: every tensor in its wire dtype."""
        return sum(t.numel() * d.itemsize for (_, t), d in zip(self.tensors, self.dtypes, strict=True))

    @classmethod
    def build(cls, version: int, state: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> WeightUpdate:
        """The update of `state` (a full state dict under the engine's names), each tensor received in the
        engine's dtype for it (`dtypes`, name -> dtype; a name the engine lacks keeps its own, and the engine
        refuses it). Nothing is copied or converted here: the receiver converts while it copies."""
        named = unique_named_tensors(state)
        return cls(version, named, [dtypes.get(name, t.dtype) for name, t in named])

    @classmethod
    def adapter(cls, version: int, weights: dict[str, torch.Tensor], config: dict) -> WeightUpdate:
        """The update of a LoRA adapter: `weights` under peft's file names (`lora.adapter_state_dict`), sent in
        their own dtypes, and `config`, the dict its ``adapter_config.json`` would hold."""
        return cls(version, list(weights.items()), adapter_config=config)


def apply_update(model: torch.nn.Module, update: WeightUpdate) -> str:
    """Copy `update` into `model`'s existing parameters and buffers (in place, converting to their dtype, on their
    device) and return the digest of what the model now holds, computed chunk by chunk right after each chunk
    is copied (while it is in the CPU's cache), in the update's order.

    Checked before anything is copied: every name is one of the model's state entries, every tensor has its
    shape and its wire dtype is the model's, and every storage of the model is covered (a missing tensor would
    leave old weights in a model that claims the new version). WeightUpdateError otherwise, the model untouched.
    A digest that differs from the sender's after the copy means the bytes changed on the way, and any failure
    once the copy has begun (the receiver's hash, the sender's digest, the copy itself) leaves old and new weights
    mixed: WeightsCorrupted in both cases (the caller must not serve the model)."""
    own = model.state_dict(keep_vars=True)
    sent = dict(update.tensors)
    if len(sent) != len(update.tensors):
        raise WeightUpdateError(f"weight update v{update.version} names a tensor twice")
    unknown = sorted(set(sent) - set(own))
    if unknown:
        raise WeightUpdateError(f"weight update v{update.version} holds {len(unknown)} tensors this model does not "
                                f"have (first: {unknown[0]}); is it another architecture?")
    for (name, tensor), dtype in zip(update.tensors, update.dtypes, strict=True):
        target = own[name]
        if tuple(target.shape) != tuple(tensor.shape) or target.dtype != dtype:
            raise WeightUpdateError(f"weight update v{update.version}: {name} is {tuple(tensor.shape)} "
                                    f"{dtype}, the model's is {tuple(target.shape)} {target.dtype}")
    covered = {(own[n].untyped_storage().data_ptr(), own[n].storage_offset()) for n in sent}
    missing = [name for name, target in unique_named_tensors(own)
               if (target.untyped_storage().data_ptr(), target.storage_offset()) not in covered]
    if missing:
        raise WeightUpdateError(f"weight update v{update.version} lacks {len(missing)} of the model's tensors "
                                f"(first: {missing[0]}): a bucket was skipped; the weights were not changed")
    # The hash stays on this thread, right behind the copy. A hasher thread fed the chunks just copied (bounded
    # queue) measured no faster on 2 cores, where the sender's hash already keeps the other core busy: 1.63x the
    # bare copy against 1.52x inline with chunks of 1 << 20, 2.31x against 1.68x with 1 << 18 (float32 engine,
    # SmolLM2-135M shape, interleaved in one process, 2026-12-05).
    try:
        received = _copy_and_hash(own, update)
        expected = update.digest
    except Exception as err:   # the copy has begun: whatever failed, old and new weights are now mixed
        raise WeightsCorrupted(f"weight update v{update.version} failed part-way ({type(err).__name__}: {err}); "
                               "the model holds a mixture of old and new weights") from err
    if received != expected:
        raise WeightsCorrupted(f"weight update v{update.version} did not arrive intact: the sender's digest is "
                                f"{expected}, the tensors received hash to {received}")
    return received


def _copy_and_hash(own: dict[str, torch.Tensor], update: WeightUpdate) -> str:
    """Copy each tensor of `update` into its target in `own`, chunk by chunk, hashing each chunk right after it
    lands; the digest of what the targets now hold."""
    hasher, scheme = _hasher()
    with torch.no_grad():
        for name, tensor in update.tensors:
            target = own[name].data
            hasher.update(_header(name, target.dtype, target.shape))
            source, flat = tensor.contiguous().reshape(-1), target.view(-1)
            for begin in range(0, flat.numel(), CHUNK):
                chunk = flat[begin:begin + CHUNK]
                chunk.copy_(source[begin:begin + CHUNK])
                hasher.update(_host_bytes(chunk))
    return f"{scheme}:{hasher.hexdigest()}"


def receive_adapter(update: WeightUpdate) -> tuple[dict[str, torch.Tensor], str]:
    """(the adapter's weights, their digest) of an adapter update (`WeightUpdate.adapter`): the tensors copied
    first (the sender may change its own once the receiver answered, and a check must see what is applied),
    then the copy hashed; its digest must equal the sender's. WeightUpdateError otherwise: nothing has been
    applied, the receiver is as it was."""
    if update.adapter_config is None:
        raise WeightUpdateError(f"weight update v{update.version} is full weights, not a LoRA adapter")
    copies = [(name, tensor.clone(memory_format=torch.contiguous_format)) for name, tensor in update.tensors]
    weights = dict(copies)
    if len(weights) != len(copies):
        raise WeightUpdateError(f"adapter update v{update.version} names a tensor twice")
    received, expected = tensors_digest(copies), update.digest
    if received != expected:
        raise WeightUpdateError(f"adapter update v{update.version} did not arrive intact: the sender's digest is "
                                f"{expected}, the tensors received hash to {received}")
    return weights, received
