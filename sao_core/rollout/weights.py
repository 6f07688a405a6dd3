"""In-memory weight updates: the learner's parameters handed to an engine without files.

A `WeightUpdate` is the new policy's full weights as named tensors in the engine's dtype (the order they are
sent in), the version they are, and a digest of exactly those tensors: xxh3-128 over each tensor's name, dtype,
shape and bytes, in send order. The receiver copies the tensors into its existing parameters and recomputes
the digest over what it now holds (`tensors_digest` of its own parameters in the same order); a tensor changed
or skipped on the way, a wrong dtype or shape, or names the engine does not have stop the update with an error
naming what differed.

Why xxh3 and not sha256: the digest guards against transport faults and bugs (a bucket skipped, a stale
buffer), not against an adversary who can write into the process (who could change the parameters anyway).
xxh3 hashes at memory speed (~0.04 s for SmolLM2-135M's 538 MB on this CPU, sha256 0.34 s). Durable versions
on storage keep their sha256 manifests (`sao_core.storage`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

#: digest scheme, written in front of every digest so a reader can tell it from a sha256 manifest digest
DIGEST_SCHEME = "xxh3-128"

NamedTensors = Sequence[tuple[str, torch.Tensor]]


class WeightUpdateError(ValueError):
    """An in-memory update does not fit the receiving model or did not arrive intact; the message says how."""


def _bytes_of(tensor: torch.Tensor):
    """A zero-copy byte view of a tensor on the CPU (a copy for one on another device)."""
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy()


def tensors_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """xxh3-128 over each tensor's name, dtype, shape and bytes, in the given order: ``xxh3-128:<32 hex>``."""
    import xxhash

    hasher = xxhash.xxh3_128()
    for name, tensor in named:
        hasher.update(f"{name}\0{str(tensor.dtype).removeprefix('torch.')}\0{tuple(tensor.shape)}\0".encode())
        hasher.update(_bytes_of(tensor))
    return f"{DIGEST_SCHEME}:{hasher.hexdigest()}"


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


@dataclass(frozen=True)
class WeightUpdate:
    """Version `version` of the policy as `tensors` (name, tensor) in the engine's dtype, and their `digest`
    (`tensors_digest`). The tensors may be the learner's own parameters (no copy, when dtype and device already
    match): the receiver copies them before the learner trains again."""

    version: int
    tensors: tuple[tuple[str, torch.Tensor], ...]
    digest: str

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    @classmethod
    def build(cls, version: int, state: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> WeightUpdate:
        """The update of `state` (a full state dict under the engine's names), each tensor in the engine's dtype
        for it (`dtypes`, name -> dtype; a name the engine lacks keeps its own, and the engine refuses it):
        tensors already in it are sent as they are (no copy), the others converted once."""
        def wire(name: str, t: torch.Tensor) -> torch.Tensor:
            dtype = dtypes.get(name, t.dtype)
            return t.detach() if t.dtype == dtype else t.detach().to(dtype)

        tensors = tuple((name, wire(name, t)) for name, t in unique_named_tensors(state))
        return cls(version, tensors, tensors_digest(tensors))


def apply_update(model: torch.nn.Module, update: WeightUpdate) -> str:
    """Copy `update` into `model`'s existing parameters and buffers (in place, in their dtype and device) and
    return the digest of what the model now holds, recomputed in the update's order.

    Checked before anything is copied: every name is one of the model's state entries, every tensor has its
    shape and dtype, and every storage of the model is covered (a missing tensor would leave old weights in a
    model that claims the new version). WeightUpdateError otherwise, the model untouched. A digest that differs
    after the copy means the bytes changed on the way: WeightUpdateError, and the model holds a mixture (the
    caller must not serve it)."""
    own = model.state_dict(keep_vars=True)
    sent = dict(update.tensors)
    if len(sent) != len(update.tensors):
        raise WeightUpdateError(f"weight update v{update.version} names a tensor twice")
    unknown = sorted(set(sent) - set(own))
    if unknown:
        raise WeightUpdateError(f"weight update v{update.version} holds {len(unknown)} tensors this model does not "
                                f"have (first: {unknown[0]}); is it another architecture?")
    for name, tensor in update.tensors:
        target = own[name]
        if tuple(target.shape) != tuple(tensor.shape) or target.dtype != tensor.dtype:
            raise WeightUpdateError(f"weight update v{update.version}: {name} is {tuple(tensor.shape)} "
                                    f"{tensor.dtype}, the model's is {tuple(target.shape)} {target.dtype}")
    covered = {(own[n].untyped_storage().data_ptr(), own[n].storage_offset()) for n in sent}
    missing = [name for name, target in unique_named_tensors(own)
               if (target.untyped_storage().data_ptr(), target.storage_offset()) not in covered]
    if missing:
        raise WeightUpdateError(f"weight update v{update.version} lacks {len(missing)} of the model's tensors "
                                f"(first: {missing[0]}): a bucket was skipped; the weights were not changed")
    with torch.no_grad():
        for name, tensor in update.tensors:
            own[name].data.copy_(tensor)
    received = tensors_digest((name, own[name]) for name, _ in update.tensors)
    if received != update.digest:
        raise WeightUpdateError(f"weight update v{update.version} did not arrive intact: the sender's digest is "
                                f"{update.digest}, the tensors received hash to {received}")
    return received
