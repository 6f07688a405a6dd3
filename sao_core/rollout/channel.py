"""A collective weight-update channel: full weights from the learner to rollout services in other processes
(`sao rollout serve`, TrainJob replicas) by broadcast over a process group of their own, not through files.

The group is made here, apart from torch.distributed's default group (the learner may already be in a torchrun
world): a `TCPStore` whose master is the learner (rank 0) and a `ProcessGroupGloo` over it; service i is rank
i + 1. Gloo moves CPU tensors; the same calls take a NCCL group and device buffers on GPUs (untested here).

The control plane is the service's authenticated HTTP API (sao_core/rollout/service.py):

    POST /v1/weights/channel {host, port, rank, world_size}   the service joins the group (returns once joined)
    POST /v1/weights/receive {version, digest?, resync, tensors: [[name, shape, dtype], ...]}
                                                             checked before any byte moves, then the receive starts
    (the learner broadcasts every bucket, hashing its update meanwhile)
    POST /v1/weights/commit {version, digest?}               the received tensors applied (`apply_update`: the
                                                             engine's digest must equal the sender's, given with
                                                             the receive or, once hashed, with the commit)

Tensors of 1 MB and more travel one by one as they are; smaller ones in flat buckets of one dtype (consecutive
tensors up to `BUCKET_BYTES`), laid out by `buckets` from the spec on both sides (measured: packing every tensor
into 64 MB buckets cost the sender a copy of the model and was slower than one call per tensor). Two broadcasts
are in flight on each side (`IN_FLIGHT`): the sender packs or converts the next bucket into a staging buffer
while one is on its way, the receiver has the next receive posted. Both sides keep their buffers from update to
update (the receiver one flat buffer per dtype, whatever the bucket layout): fresh memory costs its page faults,
which at SmolLM2-135M fp32 took longer than the copy of the bytes. The receiver keeps its buffers' slices as the
update's tensors (views, no copy) and the engine recomputes the xxh3 digest over what it copied in: a byte changed
on the way or a bucket not received stops the update ("did not arrive intact").

Trust: gloo traffic (and the TCPStore) is neither authenticated nor encrypted, as under torchrun: use the channel
on the cluster's own network. The digest catches transport faults, not an adversary on that network.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from urllib.parse import urlsplit

import torch

from sao_core.rollout.weights import WeightUpdate, assemble_digest, chunk_digests, copy_chunks, tensors_digest

#: bytes per broadcast bucket: small tensors (norms, biases) share one call
BUCKET_BYTES = 64 << 20
#: broadcasts in flight at once on each side: one on its way while the next is packed (sender) or posted (receiver)
IN_FLIGHT = 2
#: the dtypes a spec may name (what engines hold weights in)
DTYPES = {name: getattr(torch, name) for name in ("float32", "bfloat16", "float16", "float64", "float8_e4m3fn",
                                                  "float8_e5m2", "int8", "uint8", "int32", "int64", "bool")}

#: (name, shape, dtype) of each tensor, in send order
Spec = Sequence[tuple[str, tuple[int, ...], torch.dtype]]


class ChannelError(RuntimeError):
    """The channel could not be formed, or a transfer over it failed; the message says how."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r} (one of {', '.join(DTYPES)})")
    return DTYPES[name]


def update_spec(update: WeightUpdate) -> list[list]:
    """The wire spec of an update: [name, shape, dtype name] per tensor, in send order (JSON)."""
    return [[name, list(t.shape), dtype_name(d)] for (name, t), d in zip(update.tensors, update.dtypes, strict=True)]


def buckets(spec: Spec, limit: int = BUCKET_BYTES) -> list[list[int]]:
    """The indices of `spec` grouped into buckets: a tensor of `limit` / 64 bytes or more alone (sent as it is,
    no copy), consecutive smaller ones of one dtype together up to `limit` bytes (one call for a layer's norms).
    Sender and receiver both lay buckets out with this, from the same spec and limit."""
    out: list[list[int]] = []
    size, dtype, alone = 0, None, True
    for index, (_, shape, d) in enumerate(spec):
        nbytes = torch.Size(shape).numel() * d.itemsize
        big = nbytes * 64 >= limit
        if not out or big or alone or d != dtype or size + nbytes > limit:
            alone = big
            out.append([])
            size, dtype = 0, d
        out[-1].append(index)
        size += nbytes
    return out


def advertised_host(url: str) -> str:
    """The address of this machine that the service at `url` reaches it by: 127.0.0.1 for a loopback service,
    else the source address of this machine's route to it (no packet is sent)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    try:
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, parts.port or 80))
        return s.getsockname()[0]


def _device(host: str):
    """The gloo device on this machine's address towards `host` (the learner's own address on rank 0)."""
    return torch.distributed.ProcessGroupGloo.create_device(hostname=host)


def _process_group(store, rank: int, world_size: int, timeout_s: float, local_host: str):
    options = torch.distributed.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = [_device(local_host)]
    return torch.distributed.ProcessGroupGloo(store, rank, world_size, options)


def _start_broadcast(group, tensor: torch.Tensor):
    """Start broadcasting `tensor` from rank 0 (gloo moves it on a thread of its own); the work to wait for."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


class _InFlight:
    """Broadcasts started and not yet waited for, at most `IN_FLIGHT`: the next bucket is packed or converted
    while the one before it is on its way."""

    def __init__(self, group):
        self.group, self.works = group, deque()

    def start(self, tensor: torch.Tensor) -> None:
        self.works.append(_start_broadcast(self.group, tensor))

    def make_room(self) -> None:
        """Wait until fewer than `IN_FLIGHT` broadcasts are in flight (the oldest first)."""
        while len(self.works) >= IN_FLIGHT:
            self.works.popleft().wait()

    def finish(self) -> None:
        while self.works:
            self.works.popleft().wait()


class Sender:
    """The learner's end (rank 0, the store's master) of a channel to `world_size - 1` services. `port` 0: a free
    one (`self.port`). `form()` blocks until every service joined (they are told to by HTTP meanwhile)."""

    def __init__(self, world_size: int, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 300.0,
                 bucket_bytes: int = BUCKET_BYTES):
        self.world_size, self.host, self.timeout_s, self.bucket_bytes = world_size, host, timeout_s, bucket_bytes
        self.store = torch.distributed.TCPStore(host, port, world_size, is_master=True,
                                                timeout=datetime.timedelta(seconds=timeout_s),
                                                wait_for_workers=False)
        self.port = self.store.port
        self.group = None
        # Per in-flight slot, a flat buffer per dtype that buckets are packed or converted into, kept from update
        # to update: fresh memory each time costs its page faults (~0.2 s per 540 MB here), more than the copy.
        # It holds two buckets' worth (a float32 learner to a bf16 engine at the Qwen3-1.7B shape: 2 x 622 MB,
        # its embedding), freed by `close`.
        self.staging: list[dict[torch.dtype, torch.Tensor]] = [{} for _ in range(IN_FLIGHT)]

    def form(self) -> None:
        self.group = _process_group(self.store, 0, self.world_size, self.timeout_s, self.host)

    def broadcast(self, update: WeightUpdate) -> float:
        """Send every tensor of `update` in its wire dtype, bucket by bucket, the next bucket packed while the one
        before is on its way; returns the seconds it took. Unless the update's digest is known or being hashed,
        the sender computes it on the way (`WeightUpdate.set_digest`): a packed or converted chunk is hashed
        right after it is written (in the cache), a tensor sent as it is while gloo sends it; after a failed
        broadcast, from the tensors."""
        if self.group is None:
            raise ChannelError("the weight channel is not formed")
        began = time.monotonic()
        spec = [(name, tuple(t.shape), d) for (name, t), d in zip(update.tensors, update.dtypes, strict=True)]
        digests: list[list[bytes]] | None = [[] for _ in spec] if update.claim_hash() else None
        flight = _InFlight(self.group)
        try:
            for index, bucket in enumerate(buckets(spec, self.bucket_bytes)):
                flight.make_room()   # the slot this bucket may be packed into is free again
                wire, packed = self._wire(update, bucket, index % IN_FLIGHT, digests)
                flight.start(wire)
                if digests is not None and not packed:
                    digests[bucket[0]] = chunk_digests(wire)
            flight.finish()
        except BaseException:
            if digests is not None:   # whoever reads the digest (a retry over a re-formed group) gets it
                try:
                    update.set_digest(tensors_digest(update.tensors, update.dtypes))
                except BaseException as err:   # ... or why there is none
                    update.set_digest(err)
            raise
        if digests is not None:
            update.set_digest(assemble_digest(spec, digests))
        return time.monotonic() - began

    def _wire(self, update: WeightUpdate, bucket: list[int], slot: int,
              digests: list[list[bytes]] | None) -> tuple[torch.Tensor, bool]:
        """(the bytes of `bucket` as one flat tensor in its wire dtype, whether they were packed): a lone
        contiguous tensor already in that dtype as it is (no copy), else packed (and converted) into the staging
        buffer of `slot`, with `digests` its tensors' chunk digests taken as they are written."""
        dtype, first = update.dtypes[bucket[0]], update.tensors[bucket[0]][1]
        if len(bucket) == 1 and first.dtype == dtype and first.is_contiguous():
            return first.reshape(-1), False
        total = sum(update.tensors[i][1].numel() for i in bucket)
        buffer = self.staging[slot].get(dtype)
        if buffer is None or buffer.numel() < total or buffer.device != first.device:
            buffer = self.staging[slot][dtype] = torch.empty(total, dtype=dtype, device=first.device)
        flat, begin = buffer[:total], 0
        for i in bucket:
            tensor = update.tensors[i][1]
            target = flat[begin:begin + tensor.numel()]
            if digests is None:
                target.view(tensor.shape).copy_(tensor)
            else:
                digests[i] = copy_chunks(target, tensor.contiguous().reshape(-1))
            begin += tensor.numel()
        return flat, True

    def close(self) -> None:
        """Leave the group: the connections close, so a service waiting for a broadcast fails at once."""
        self.group = None
        self.store = None
        self.staging = [{} for _ in range(IN_FLIGHT)]


def receive_buffers(spec: Spec, device: str | torch.device = "cpu",
                    reuse: dict[torch.dtype, torch.Tensor] | None = None) -> dict[torch.dtype, torch.Tensor]:
    """dtype -> one flat buffer that holds every tensor of `spec` in that dtype (the buckets are consecutive
    slices of it: `bucket_views`): `reuse`'s (an earlier receive's) where it is large enough and on `device`,
    whatever the bucket layout, else a new one."""
    totals: dict[torch.dtype, int] = {}
    for _, shape, dtype in spec:
        totals[dtype] = totals.get(dtype, 0) + torch.Size(shape).numel()
    reuse = reuse or {}
    return {dtype: reuse[dtype] if dtype in reuse and reuse[dtype].numel() >= total
            and reuse[dtype].device == torch.device(device) else torch.empty(total, dtype=dtype, device=device)
            for dtype, total in totals.items()}


def bucket_views(spec: Spec, layout: list[list[int]], buffers: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
    """One flat tensor per bucket of `layout`: the next slice of the buffer of its dtype (`receive_buffers`)."""
    used = dict.fromkeys(buffers, 0)
    views = []
    for bucket in layout:
        dtype = spec[bucket[0]][2]
        size = sum(torch.Size(spec[i][1]).numel() for i in bucket)
        views.append(buffers[dtype][used[dtype]:used[dtype] + size])
        used[dtype] += size
    return views


class Receiver:
    """A service's end of a channel: joins the group on construction (blocks until every member joined)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0):
        if not 1 <= rank < world_size:
            raise ChannelError(f"rank {rank} is not a service rank of a group of {world_size} (1 .. {world_size - 1})")
        self.rank, self.world_size = rank, world_size
        try:   # fail fast when nothing listens there (the store's own connect retries until `timeout_s`)
            socket.create_connection((host, port), timeout=min(10.0, timeout_s)).close()
        except (OSError, ValueError) as err:   # ValueError: a host name that is no name (NUL, surrogates)
            raise ChannelError(f"cannot reach the weight channel at {host}:{port}: {err}") from err
        try:
            self.store = torch.distributed.TCPStore(host, port, world_size, is_master=False,
                                                    timeout=datetime.timedelta(seconds=timeout_s))
            self.group = _process_group(self.store, rank, world_size, timeout_s, advertised_host(f"tcp://{host}:{port}"))
        except (RuntimeError, OSError, ValueError) as err:
            raise ChannelError(f"cannot join the weight channel at {host}:{port} as rank {rank} of {world_size}: "
                               f"{err}") from err

    def receive(self, version: int, spec: Spec, bucket_bytes: int = BUCKET_BYTES,
                device: str | torch.device = "cpu",
                buffers: dict[torch.dtype, torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
        """Receive the tensors of `spec` into `buffers` (`receive_buffers`; None: new ones), the next bucket's
        receive posted while one arrives: (name, tensor) in spec order, views of the buffers."""
        layout = buckets(spec, bucket_bytes)
        flats = bucket_views(spec, layout, receive_buffers(spec, device, buffers))
        flight = _InFlight(self.group)
        try:
            for flat in flats:
                flight.make_room()
                flight.start(flat)
            flight.finish()
        except RuntimeError as err:
            raise ChannelError(f"weights version {version} did not arrive over the weight channel: {err}") from err
        named: list[tuple[str, torch.Tensor]] = []
        for bucket, flat in zip(layout, flats, strict=True):
            begin = 0
            for i in bucket:
                size = torch.Size(spec[i][1]).numel()
                named.append((spec[i][0], flat[begin:begin + size].view(spec[i][1])))
                begin += size
        return named

    def close(self) -> None:
        self.group = None
        self.store = None


def check_spec(model: torch.nn.Module, spec: Spec) -> None:
    """ValueError unless `spec` fits `model` exactly as `apply_update` will demand: every name one of its state
    entries (once), each shape and dtype the model's, and every storage of the model covered."""
    from sao_core.rollout.weights import unique_named_tensors

    own = model.state_dict(keep_vars=True)
    names = [name for name, _, _ in spec]
    if len(set(names)) != len(names):
        raise ValueError("the spec names a tensor twice")
    for name, shape, dtype in spec:
        if name not in own:
            raise ValueError(f"{name} is not a weight of this model (is the learner's another architecture?)")
        target = own[name]
        if tuple(target.shape) != tuple(shape) or target.dtype != dtype:
            raise ValueError(f"{name} is {tuple(shape)} {dtype_name(dtype)}, the model's is {tuple(target.shape)} "
                             f"{dtype_name(target.dtype)}")

    def key(t):
        return t.untyped_storage().data_ptr(), t.storage_offset()

    covered = {key(own[name]) for name in names}
    missing = [name for name, t in unique_named_tensors(own) if key(t) not in covered]
    if missing:
        raise ValueError(f"the spec lacks {len(missing)} of the model's tensors (first: {missing[0]})")


class ServiceChannel:
    """The channel state of one rollout service: the group it joined and the one receive at a time. Its methods
    are called on the service's event loop; `join` and waiting for a receive block (run them in threads)."""

    def __init__(self):
        self.receiver: Receiver | None = None
        self.joining = False                                            # a join in progress
        self.thread: threading.Thread | None = None                    # the last receive's thread
        self.pending: tuple[int, bool, dict] | None = None             # version, resync, outcome: not committed
        # The receive buffers of the last committed update, reused by the next receive (any bucket layout): fresh
        # ones cost their page faults on arrival (0.18 s of a 0.24 s broadcast at SmolLM2-135M fp32 here). The
        # service holds one copy of the weights in the engine's dtype between updates (an update's peak anyway).
        self.spare: dict[torch.dtype, torch.Tensor] | None = None

    def receiving(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def leave(self) -> None:
        old, self.receiver, self.pending, self.spare = self.receiver, None, None, None
        if old is not None:
            old.close()

    def join(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> dict:
        """Join a new group (blocking), leaving the previous one. A receive still waiting on the previous group is
        waited for first, up to `timeout_s`: a learner closes its old group before it forms a new one, so that
        receive fails at once (its update is never committed). ChannelError on failure."""
        thread = self.thread
        if thread is not None and thread.is_alive():
            thread.join(timeout_s)
            if thread.is_alive():
                raise ChannelError(f"a weight receive over the previous channel still runs after {timeout_s:.0f} s; "
                                   "not joining a new one")
        self.leave()
        self.receiver = Receiver(host, port, rank, world_size, timeout_s)
        return {"joined": True, "rank": rank, "world_size": world_size}

    def start(self, version: int, resync: bool, spec: Spec, digest: str | None, bucket_bytes: int) -> None:
        """Start receiving `version` in a thread of its own (its outcome is read at the commit: `take`, then
        `received`), into the spare buffers where they fit (`release` gives them back once the commit is done with
        them). `digest` None: the sender gives it with the commit (it hashes while it broadcasts)."""
        outcome: dict = {"buffers": receive_buffers(spec, reuse=self.spare),
                         "digest": digest, "dtypes": [d for _, _, d in spec]}
        self.spare = None
        receiver = self.receiver

        def run():
            try:
                outcome["tensors"] = receiver.receive(version, spec, bucket_bytes, buffers=outcome["buffers"])
                if digest is not None:
                    outcome["update"] = WeightUpdate(version, outcome["tensors"], outcome["dtypes"], digest=digest)
            except BaseException as err:   # read by the commit
                outcome["error"] = err

        self.pending = (version, resync, outcome)
        self.thread = threading.Thread(target=run, name=f"weights-receive-v{version}", daemon=True)
        self.thread.start()

    @staticmethod
    def received(version: int, outcome: dict, digest: str | None) -> WeightUpdate:
        """The update a finished receive delivered, with the sender's digest: announced at the receive, or
        `digest` given with the commit (both: they must agree). ValueError when the receive failed (its error's
        message), or the digest is missing or differs."""
        if "error" in outcome:
            raise ValueError(str(outcome["error"])) from outcome["error"]
        announced = outcome["digest"]
        if digest is not None and announced is not None and digest != announced:
            raise ValueError(f"the commit of weights version {version} names digest {digest}, the receive announced "
                             f"{announced}")
        if digest is None and announced is None:
            raise ValueError(f"weights version {version} has no digest: the sender gave it neither with the receive "
                             "nor with the commit")
        return WeightUpdate(version, outcome["tensors"], outcome["dtypes"], digest=digest or announced)

    def release(self, outcome: dict) -> None:
        """The receive of `outcome` is done with (its update applied or refused, nothing reads its tensors any
        more): its buffers are the next receive's, unless the receive failed (a broadcast of the broken group
        may still be under way into them)."""
        if self.receiver is not None and "error" not in outcome:
            self.spare = outcome.get("buffers")

    def take(self, version: int) -> tuple[bool, threading.Thread, dict]:
        """The receive of `version` for its commit: (resync, its thread to wait for, its outcome for `received`
        once the thread ended: "tensors", with "update" where the digest was announced, or "error"); it is no
        longer pending. LookupError when no receive of `version` is."""
        if self.pending is None or self.pending[0] != version:
            waiting = "none" if self.pending is None else f"version {self.pending[0]}"
            raise LookupError(f"no receive of version {version} to commit (pending: {waiting})")
        (_, resync, outcome), self.pending = self.pending, None
        return resync, self.thread, outcome
