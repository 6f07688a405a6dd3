"""A collective weight-update channel: full weights from the learner to rollout services in other processes
(`sao rollout serve`, TrainJob replicas) by broadcast over a process group of their own, not through files.

The group is made here, apart from torch.distributed's default group (the learner may already be in a torchrun
world): a `TCPStore` whose master is the learner (rank 0) and a `ProcessGroupGloo` over it; service i is rank
i + 1. Gloo moves CPU tensors; the same calls take a NCCL group and device buffers on GPUs (untested here).

The control plane is the service's authenticated HTTP API (sao_core/rollout/service.py):

    POST /v1/weights/channel {host, port, rank, world_size}   the service joins the group (returns once joined)
    POST /v1/weights/receive {version, digest, resync, tensors: [[name, shape, dtype], ...]}
                                                             checked before any byte moves, then the receive starts
    (the learner broadcasts every bucket)
    POST /v1/weights/commit {version}                        the received tensors applied (`apply_update`: the
                                                             engine's digest must equal the announced one)

Tensors of 1 MB and more travel one by one as they are; smaller ones in flat buckets of one dtype (consecutive
tensors up to `BUCKET_BYTES`), laid out by `buckets` from the spec on both sides (measured: packing every tensor
into 64 MB buckets cost the sender a copy of the model and was slower than one call per tensor). The receiver keeps its buckets as the update's tensors (views,
no copy) and the engine recomputes the xxh3 digest over what it copied in: a byte changed on the way or a bucket
not received stops the update ("did not arrive intact").

Trust: gloo traffic (and the TCPStore) is neither authenticated nor encrypted, as under torchrun: use the channel
on the cluster's own network. The digest catches transport faults, not an adversary on that network.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

import torch

from sao_core.rollout.weights import WeightUpdate

#: bytes per broadcast bucket: small tensors (norms, biases) share one call
BUCKET_BYTES = 64 << 20
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


def _broadcast(group, tensor: torch.Tensor) -> None:
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


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

    def form(self) -> None:
        self.group = _process_group(self.store, 0, self.world_size, self.timeout_s, self.host)

    def broadcast(self, update: WeightUpdate) -> float:
        """Send every tensor of `update` in its wire dtype, bucket by bucket; returns the seconds it took."""
        if self.group is None:
            raise ChannelError("the weight channel is not formed")
        began = time.monotonic()
        spec = [(name, tuple(t.shape), d) for (name, t), d in zip(update.tensors, update.dtypes, strict=True)]
        for bucket in buckets(spec, self.bucket_bytes):
            if len(bucket) == 1:
                _, tensor = update.tensors[bucket[0]]
                dtype = update.dtypes[bucket[0]]
                flat = tensor.detach().contiguous().reshape(-1)
                if flat.dtype != dtype:
                    flat = flat.to(dtype)
            else:
                total = sum(update.tensors[i][1].numel() for i in bucket)
                flat = torch.empty(total, dtype=update.dtypes[bucket[0]], device=update.tensors[bucket[0]][1].device)
                begin = 0
                for i in bucket:
                    tensor = update.tensors[i][1]
                    flat[begin:begin + tensor.numel()].copy_(tensor.detach().reshape(-1))
                    begin += tensor.numel()
            _broadcast(self.group, flat)
        return time.monotonic() - began

    def close(self) -> None:
        """Leave the group: the connections close, so a service waiting for a broadcast fails at once."""
        self.group = None
        self.store = None


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

    def receive(self, version: int, spec: Spec, digest: str, bucket_bytes: int = BUCKET_BYTES,
                device: str | torch.device = "cpu") -> WeightUpdate:
        """Receive the tensors of `spec` (buffers allocated here, bucket by bucket) and return them as the update
        of `version` with the digest the learner announced (the engine checks it against what it copies in)."""
        named: list[tuple[str, torch.Tensor]] = []
        try:
            for bucket in buckets(spec, bucket_bytes):
                sizes = [torch.Size(spec[i][1]).numel() for i in bucket]
                flat = torch.empty(sum(sizes), dtype=spec[bucket[0]][2], device=device)
                _broadcast(self.group, flat)
                begin = 0
                for i, size in zip(bucket, sizes, strict=True):
                    named.append((spec[i][0], flat[begin:begin + size].view(spec[i][1])))
                    begin += size
        except RuntimeError as err:
            raise ChannelError(f"weights version {version} did not arrive over the weight channel: {err}") from err
        return WeightUpdate(version, named, [d for _, _, d in spec], digest=digest)

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

    def receiving(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def leave(self) -> None:
        old, self.receiver, self.pending = self.receiver, None, None
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

    def start(self, version: int, resync: bool, spec: Spec, digest: str, bucket_bytes: int) -> None:
        """Start receiving `version` in a thread of its own (its outcome is read at the commit: `take`)."""
        outcome: dict = {}
        receiver = self.receiver

        def run():
            try:
                outcome["update"] = receiver.receive(version, spec, digest, bucket_bytes)
            except BaseException as err:   # read by the commit
                outcome["error"] = err

        self.pending = (version, resync, outcome)
        self.thread = threading.Thread(target=run, name=f"weights-receive-v{version}", daemon=True)
        self.thread.start()

    def take(self, version: int) -> tuple[bool, threading.Thread, dict]:
        """The receive of `version` for its commit: (resync, its thread to wait for, its outcome: "update" or
        "error" once the thread ended); it is no longer pending. LookupError when no receive of `version` is."""
        if self.pending is None or self.pending[0] != version:
            waiting = "none" if self.pending is None else f"version {self.pending[0]}"
            raise LookupError(f"no receive of version {version} to commit (pending: {waiting})")
        (_, resync, outcome), self.pending = self.pending, None
        return resync, self.thread, outcome
