"""In-memory weight updates: the learner's parameters handed to an engine without files.

A `WeightUpdate` is the new policy's full weights as named tensors in the engine's dtype (the order they are
sent in), the version they are, and a digest of exactly those tensors (`tensors_digest`): xxh3-128 over, for
each tensor in send order, its name, dtype and shape, then the xxh3-128 digest of each of its chunks of `CHUNK`
elements (its bytes in the wire dtype). Hashing chunk by chunk lets several threads hash one update, each chunk
while it is in the CPU's cache. The receiver copies the tensors into its existing parameters and recomputes the
digest over what it now holds; a tensor changed or skipped on the way, a wrong dtype or shape, or names the
engine does not have stop the update with an error naming what differed.

In one process (a colocated engine) the sender's digest is computed by the copy itself unless something hashed
it first (`apply_update`): each chunk is hashed as the sender holds it, copied, and hashed again as the engine
now holds it, by several threads (`update_threads`); the bytes are read from memory once, as by a bare copy.

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

import os
import threading
from collections.abc import Callable, Iterable, Sequence

import torch

#: digest scheme, written in front of every digest so a reader can tell it from a sha256 manifest digest
DIGEST_SCHEME = "xxh3-128"
#: the scheme where the xxhash package is missing (a bare GPU machine running bench/gpu_check.py): both sides
#: of an update in one process hash the same way; two processes with different schemes disagree, by name
FALLBACK_SCHEME = "blake2b-128"


def _hashers() -> tuple[object, Callable[[object], bytes], str]:
    """(a new streaming hasher for the digest, the function giving a chunk's 16-byte digest, the scheme name)."""
    try:
        import xxhash
    except ImportError:
        import hashlib

        return (hashlib.blake2b(digest_size=16), lambda data: hashlib.blake2b(data, digest_size=16).digest(),
                FALLBACK_SCHEME)
    return xxhash.xxh3_128(), xxhash.xxh3_128_digest, DIGEST_SCHEME


#: elements per chunk of the digest (part of its definition: both ends use this value): a chunk just copied is
#: hashed while it is in the CPU's cache (2 MB of float32, 1 MB of bfloat16: about a core's L2 here). Fewer,
#: larger chunks mean less interpreter work per update. A prototype of this copy at the SmolLM2-135M shape,
#: float32, two threads (2026-12-05) took 1.18x a bare copy with 1 << 18, 1.03-1.09x with 1 << 19 and 1.00-1.11x
#: with 1 << 20.
CHUNK = 1 << 19


def update_threads() -> int:
    """Threads that copy and hash one update: the cores this process may run on, at most 4 (a guess: more
    threads than memory channels would not copy faster; only 1-3 were run, on this 2-core machine)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


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


class _Chunks:
    """The chunks of named tensors in send order, each tensor seen as 1-D: `sources[i]` is chunk i of its tensor,
    `owner[i]` the index of that tensor. Built once per update, read by every worker."""

    def __init__(self, tensors: Sequence[torch.Tensor], targets: bool = False):
        """`targets`: the tensors are to be written into, so the chunks must be views of them (a tensor whose
        elements are not contiguous is refused by `view`); else a non-contiguous tensor is read through a copy."""
        self.sources: list[torch.Tensor] = []
        self.owner: list[int] = []
        flats = [t.view(-1) if targets else t.detach().contiguous().reshape(-1) for t in tensors]
        for index, flat in enumerate(flats):
            for begin in range(0, flat.numel(), CHUNK):
                self.sources.append(flat[begin:begin + CHUNK])
                self.owner.append(index)

    def digest(self, named: Iterable[tuple[str, Sequence[int]]], dtypes: Sequence[torch.dtype],
               chunk_digests: Sequence[bytes]) -> str:
        """The update's digest from its per-chunk digests (`chunk_digests[i]` of chunk i)."""
        headers = [(name, shape, dtype) for (name, shape), dtype in zip(named, dtypes, strict=True)]
        per_tensor: list[list[bytes]] = [[] for _ in headers]
        for index, digest in zip(self.owner, chunk_digests, strict=True):
            per_tensor[index].append(digest)
        return assemble_digest(headers, per_tensor)


def assemble_digest(headers: Sequence[tuple[str, Sequence[int], torch.dtype]],
                    chunk_digests: Sequence[Sequence[bytes]]) -> str:
    """The digest of an update (`tensors_digest`'s definition) from each tensor's (name, shape, wire dtype), in
    send order, and the digests of its chunks (`chunk_digests`, `copy_chunks`)."""
    hasher, _, scheme = _hashers()
    for (name, shape, dtype), digests in zip(headers, chunk_digests, strict=True):
        hasher.update(_header(name, dtype, shape))
        for digest in digests:
            hasher.update(digest)
    return f"{scheme}:{hasher.hexdigest()}"


def chunk_digests(flat: torch.Tensor) -> list[bytes]:
    """The digest of each chunk of `CHUNK` elements of a 1-D tensor already in its wire dtype, in order, on
    this thread (for a sender that hashes what it sends while it sends it)."""
    _, digest, _ = _hashers()
    return [digest(_host_bytes(flat[begin:begin + CHUNK])) for begin in range(0, flat.numel(), CHUNK)]


def copy_chunks(target: torch.Tensor, source: torch.Tensor) -> list[bytes]:
    """Copy 1-D `source` into 1-D `target` (as many elements; converted to `target`'s dtype) chunk by chunk,
    hashing each chunk of `target` right after it lands, while it is in the cache: its chunk digests (those
    `chunk_digests(target)` would give), on this thread."""
    _, digest, _ = _hashers()
    out = []
    for begin in range(0, target.numel(), CHUNK):
        chunk = target[begin:begin + CHUNK]
        chunk.copy_(source[begin:begin + CHUNK])
        out.append(digest(_host_bytes(chunk)))
    return out


class _Scratch:
    """One worker's conversion buffers (a chunk in another dtype), one per dtype, made on first use."""

    def __init__(self):
        self.buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def converted(self, chunk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`chunk` in `dtype` (itself if it already is; else copied into this worker's buffer, valid until the
        next call for that dtype)."""
        if chunk.dtype == dtype:
            return chunk
        key = (dtype, chunk.device)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(CHUNK, dtype=dtype, device=chunk.device)
        return self.buffers[key][:chunk.numel()].copy_(chunk)


def _striped(count: int, work: Callable[[int, int], None]) -> None:
    """`work(worker, i)` for every i in range(count), striped over `update_threads()` threads (this one is worker 0).
    The first error of any worker stops the others at their next chunk and is raised here once all ended."""
    if count == 0:
        return
    workers = min(update_threads(), count)
    errors: list[BaseException] = []

    def run(worker: int) -> None:
        try:
            for i in range(worker, count, workers):
                if errors:
                    return
                work(worker, i)
        except BaseException as err:   # raised in the caller's thread below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(w,), name=f"weights-chunks-{w}", daemon=True)
               for w in range(1, workers)]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def tensors_digest(named: Iterable[tuple[str, torch.Tensor]], dtypes: Sequence[torch.dtype] | None = None) -> str:
    """xxh3-128 over each tensor's name, dtype and shape, followed by the xxh3-128 digest of each of its chunks
    of `CHUNK` elements, in the given order: ``xxh3-128:<32 hex>``. With `dtypes` (one per tensor), the bytes are
    those of the tensor converted to that dtype (chunk by chunk into a small buffer, never as a whole copy).
    The chunks are hashed by `update_threads()` threads."""
    named = list(named)
    dtypes = [t.dtype for _, t in named] if dtypes is None else list(dtypes)
    chunks = _Chunks([t for _, t in named])
    digests: list[bytes] = [b""] * len(chunks.sources)
    _, chunk_digest, _ = _hashers()
    scratch = [_Scratch() for _ in range(update_threads())]

    def hash_chunk(worker: int, i: int) -> None:
        digests[i] = chunk_digest(_host_bytes(scratch[worker].converted(chunks.sources[i], dtypes[chunks.owner[i]])))

    _striped(len(chunks.sources), hash_chunk)
    return chunks.digest(((n, t.shape) for n, t in named), dtypes, digests)


def unique_named_tensors(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The entries of a state dict in its order, each storage once: a tied weight (SmolLM2's output layer is
    its embedding) is sent under its first name only."""
    seen: set[tuple[int, int]] = set()
    out = []
    for name, tensor in state.items():
        key = _storage_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        out.append((name, tensor))
    return out


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's elements begin: two entries with the same key are one weight (tied)."""
    if not tensor.numel():
        return id(tensor), 0
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset()


class WeightUpdate:
    """Version `version` of the policy: `tensors` (name, tensor) to be received in `dtypes` (one per tensor; the
    bytes sent are each tensor converted to its dtype), and `digest`, the digest of those bytes in order
    (`tensors_digest`).

    The sender's digest is computed once, by whoever needs it first: a receiver in this process while it copies
    (`apply_update`), a sender that hashes on a thread while the bytes travel (`hash_in_background`), or a
    reader of `digest` (which waits for a hash under way). The tensors may be the learner's own parameters (no
    copy is made): the learner must not change them until the receiver answered. `digest` given: that value
    (e.g. what a sender announced). `adapter_config` (a LoRA run): the tensors are a LoRA adapter's weights under
    peft's file names, and this the dict its ``adapter_config.json`` would hold; None: full weights."""

    def __init__(self, version: int, tensors: NamedTensors, dtypes: Sequence[torch.dtype] | None = None,
                 digest: str | None = None, adapter_config: dict | None = None):
        self.version = version
        self.adapter_config = adapter_config
        self.tensors = tuple((name, t.detach()) for name, t in tensors)
        self.dtypes = tuple(dtypes) if dtypes is not None else tuple(t.dtype for _, t in self.tensors)
        if len(self.dtypes) != len(self.tensors):
            raise ValueError(f"{len(self.dtypes)} dtypes for {len(self.tensors)} tensors")
        self._digest: str | BaseException | None = digest
        self._claim = threading.Lock()
        self._claimed = digest is not None
        self._done = threading.Event()
        if digest is not None:
            self._done.set()

    def claim_hash(self) -> bool:
        """True (once) for the caller that is to compute the sender's digest and hand it to `set_digest`;
        False if it is given, computed or under way."""
        with self._claim:
            taken, self._claimed = not self._claimed, True
        return taken

    def set_digest(self, digest: str | BaseException) -> None:
        """The sender's digest (or the error that stopped its hash), from the caller `claim_hash` chose."""
        self._digest = digest
        self._done.set()

    def hash_in_background(self) -> None:
        """Start the sender's hash on a thread of its own (it releases the interpreter lock), unless it is given,
        computed or under way; `digest` waits for it."""
        if self.claim_hash():
            threading.Thread(target=self._hash, name=f"weights-digest-v{self.version}", daemon=True).start()

    def _hash(self) -> None:
        try:
            digest: str | BaseException = tensors_digest(self.tensors, self.dtypes)
        except BaseException as err:   # handed to whoever reads the digest
            digest = err
        self.set_digest(digest)

    @property
    def digest(self) -> str:
        if self.claim_hash():
            self._hash()
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
        refuses it). Nothing is copied, converted or hashed here: the receiver converts while it copies."""
        named = unique_named_tensors(state)
        return cls(version, named, [dtypes.get(name, t.dtype) for name, t in named])

    @classmethod
    def adapter(cls, version: int, weights: dict[str, torch.Tensor], config: dict) -> WeightUpdate:
        """The update of a LoRA adapter: `weights` under peft's file names (`lora.adapter_state_dict`), sent in
        their own dtypes, and `config`, the dict its ``adapter_config.json`` would hold."""
        return cls(version, list(weights.items()), adapter_config=config)


def apply_update(model: torch.nn.Module, update: WeightUpdate) -> str:
    """Copy `update` into `model`'s existing parameters and buffers (in place, converting to their dtype, on their
    device) and return the digest of what the model now holds, each chunk hashed right after it is copied
    (while it is in the CPU's cache), by `update_threads()` threads. If nothing has hashed the update yet, the same
    threads compute the sender's digest too, each chunk just before it is copied (`WeightUpdate.set_digest`).

    Checked before anything is copied: every name is one of the model's state entries, named once, no two
    names land in one weight, every tensor has its shape and its wire dtype is the model's, and every storage of
    the model is covered (a missing tensor would leave old weights in a model that claims the new version).
    WeightUpdateError otherwise, the model untouched. A digest that differs from the sender's after the copy
    means the bytes changed on the way, and any failure once the copy has begun (either hash, the copy itself)
    leaves old and new weights mixed: WeightsCorrupted in both cases (the caller must not serve the model)."""
    own = model.state_dict(keep_vars=True)
    aliases = _check_fits(own, update)
    owes_digest = update.claim_hash()   # nothing hashed it yet: the copy computes the sender's digest too
    try:
        received, sent = _copy_and_hash(own, update, owes_digest, aliases)
        if owes_digest:
            update.set_digest(sent)
            owes_digest = False
        expected = update.digest
    except Exception as err:   # the copy has begun: whatever failed, old and new weights are now mixed
        if owes_digest:   # a reader of the update's digest learns why there is none
            update.set_digest(err)
        raise WeightsCorrupted(f"weight update v{update.version} failed part-way ({type(err).__name__}: {err}); "
                               "the model holds a mixture of old and new weights") from err
    if received != expected:
        raise WeightsCorrupted(f"weight update v{update.version} did not arrive intact: the sender's digest is "
                                f"{expected}, the tensors received hash to {received}")
    return received


def _check_fits(own: dict[str, torch.Tensor], update: WeightUpdate) -> set[str]:
    """WeightUpdateError unless `update` names every weight of `own`, each name once, in its shape and dtype;
    the names that land in a weight an earlier name already fills (tied in `own`, equal values: checked)."""
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
    landing: dict[tuple[int, int], str] = {}
    aliases: set[str] = set()
    for (name, tensor), dtype in zip(update.tensors, update.dtypes, strict=True):
        first = landing.setdefault(_storage_key(own[name]), name)
        if first == name:
            continue
        # One weight in this model (tied) sent under two names (a gathered learner state unties them): the
        # values must agree, or one of them would be lost unseen.
        if not torch.equal(tensor.to(dtype), sent[first].to(dtype)):
            raise WeightUpdateError(f"weight update v{update.version} sends {first} and {name}, which are one "
                                    "weight in this model (tied), with different values; the weights were not "
                                    "changed")
        aliases.add(name)
    missing = [name for name, target in unique_named_tensors(own) if _storage_key(target) not in landing]
    if missing:
        raise WeightUpdateError(f"weight update v{update.version} lacks {len(missing)} of the model's tensors "
                                f"(first: {missing[0]}): a bucket was skipped; the weights were not changed")
    return aliases


def _copy_and_hash(own: dict[str, torch.Tensor], update: WeightUpdate, sender_hashes: bool,
                   aliases: set[str]) -> tuple[str, str | None]:
    """Copy each tensor of `update` into its target in `own`, chunk by chunk, hashing each chunk right after it
    lands; (the digest of what the targets now hold, the sender's digest or None). `sender_hashes`: each chunk
    is also hashed as the sender holds it (converted to the wire dtype) just before it is copied, which brings it
    into the cache the copy then reads it from. `aliases`: names whose target an earlier name fills (tied): not
    copied again, their target hashed once every copy is done."""
    chunks = _Chunks([t for _, t in update.tensors])
    targets = _Chunks([own[name].data for name, _ in update.tensors], targets=True)
    received: list[bytes] = [b""] * len(chunks.sources)
    sent: list[bytes] = [b""] * len(chunks.sources) if sender_hashes else []
    _, chunk_digest, _ = _hashers()
    scratch = [_Scratch() for _ in range(update_threads())]
    alias = {i for i, owner in enumerate(chunks.owner) if update.tensors[owner][0] in aliases}

    def copy_chunk(worker: int, i: int) -> None:
        source, target = chunks.sources[i], targets.sources[i]
        if sender_hashes:
            source = scratch[worker].converted(source, target.dtype)
            sent[i] = chunk_digest(_host_bytes(source))
        if i not in alias:
            target.copy_(source)
        received[i] = chunk_digest(_host_bytes(target))

    firsts = [i for i in range(len(chunks.sources)) if i not in alias]
    with torch.no_grad():
        _striped(len(firsts), lambda worker, k: copy_chunk(worker, firsts[k]))
        later = sorted(alias)
        _striped(len(later), lambda worker, k: copy_chunk(worker, later[k]))
    shapes = [(name, t.shape) for name, t in update.tensors]
    return (targets.digest(shapes, update.dtypes, received),
            chunks.digest(shapes, update.dtypes, sent) if sender_hashes else None)


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
