"""Weight-push cost: seconds to publish new weights and load them into a rollout service, against the time
to copy the same bytes on this machine.

For each engine (HF transformers, vLLM) and model size, a rollout service runs in its own process
(`sao rollout serve`, one torch thread) and the learner side does, per push, exactly what the learner
loop does after a policy step:

- export   `save_pretrained` of the (perturbed) policy + tokenizer to a staging directory (safetensors)
- publish  `storage.publish_checkpoint` to the weights store (copy, sha256 manifest, `_COMPLETE` marker) and
           `checkpoint_digest`
- load     POST /v1/weights: the service checks the digest, verifies (or downloads) every file, loads the
           model and swaps it in between two engine steps; the time until the call returns

and, interleaved with those, the baseline `copy`: `shutil.copytree` of the same files to a fresh directory
on the same disk. It reports medians in seconds, bytes/s of each phase and the ratio push / copy. The
store is a local directory (default) or, with `--store s3`, a moto S3 server on 127.0.0.1. Sizes: `tiny` is
the embedded model (0.36M parameters, 1.5 MB), `medium` a 25M-parameter Llama of the same family (102 MB), both
random weights. Reproduce with:

    .venv/bin/python bench/weight_push.py --output local_outputs/bench/weight_push        # HF + vLLM, ~6 min
    .venv/bin/python bench/weight_push.py --quick                                        # HF, tiny, ~1 min
"""

from __future__ import annotations

import argparse
import importlib.util
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
from sao_core.models.embedded import TinyModelSpec, build_tiny_model  # noqa: E402
from sao_core.rollout.client import RolloutClient  # noqa: E402

SIZES = {
    "tiny": TinyModelSpec(),
    "medium": TinyModelSpec(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=4),
}
VLLM_OPTIONS = {"max_model_len": 1024, "kv_cache_memory_bytes": 64 << 20}


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _start_moto():
    from moto.server import ThreadedMotoServer

    port = _setup._free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
    storage._clear_client_cache()
    import boto3

    boto3.client("s3").create_bucket(Bucket="bench")
    return server


def measure_one(engine: str, size: str, reps: int, store_root: str, scratch: Path, log_dir: Path) -> dict:
    from sao_core.models import load_model_and_tokenizer

    cache = _setup.default_cache_dir()
    model_dir = build_tiny_model(cache, SIZES[size])
    policy, tokenizer = load_model_and_tokenizer(str(model_dir), cache)
    options = VLLM_OPTIONS if engine == "vllm" else None
    began = time.monotonic()
    service = _setup.ServiceProcess(str(model_dir), engine=engine, engine_options=options,
                                    log_path=log_dir / f"service-{engine}-{size}.log", weight_roots=[store_root])
    start_s = time.monotonic() - began
    client = RolloutClient(service.url, consumer="bench-weight-push", timeout_s=600)
    samples: dict[str, list[float]] = {"export": [], "publish": [], "load": [], "service_load": [], "copy": []}
    nbytes = 0
    try:
        for version in range(1, reps + 2):          # the first push warms up (imports, caches) and is not kept
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
            staging = scratch / "staging"
            shutil.rmtree(staging, ignore_errors=True)
            t0 = time.perf_counter()
            policy.save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
            t1 = time.perf_counter()
            uri = storage.join(store_root, f"{engine}-{size}", f"v{version:06d}")
            storage.publish_checkpoint(staging, uri, metadata={"version": version})
            digest = storage.checkpoint_digest(uri)
            t2 = time.perf_counter()
            answer = client.push_weights(version, uri, digest)
            t3 = time.perf_counter()
            copy_to = scratch / f"copy-{version}"
            t4 = time.perf_counter()
            shutil.copytree(staging, copy_to)
            t5 = time.perf_counter()
            nbytes = _dir_bytes(staging)
            shutil.rmtree(copy_to, ignore_errors=True)
            if not storage.is_s3_uri(uri):
                shutil.rmtree(uri, ignore_errors=True)
            if version == 1:
                continue
            for key, value in (("export", t1 - t0), ("publish", t2 - t1), ("load", t3 - t2),
                               ("service_load", answer["seconds"]), ("copy", t5 - t4)):
                samples[key].append(value)
        status = client.status()
    finally:
        client.close()
        service.stop()
    med = {k: statistics.median(v) for k, v in samples.items()}
    push = med["export"] + med["publish"] + med["load"]
    return {"engine": engine, "size": size, "bytes": nbytes,
            "parameters": sum(p.numel() for p in policy.parameters()), "service_start_s": start_s,
            "final_version": status["version"], "median_s": med, "samples_s": samples, "push_s": push,
            "push_over_copy": push / med["copy"], "push_bytes_per_s": nbytes / push,
            "copy_bytes_per_s": nbytes / med["copy"],
            "bytes_per_s": {k: nbytes / v if v > 0 else None for k, v in med.items()}}


def report(result: dict) -> str:
    s = result["settings"]
    lines = [f"weight push: {s['reps']} pushes per case (medians), store {s['store']}, "
             f"load {result['conditions']['before']['loadavg_1_5_15']} -> "
             f"{result['conditions']['after']['loadavg_1_5_15']}, {result['conditions']['before']['cpu_count']} cores",
             ""]
    cols = [("engine", "engine", ""), ("size", "size", ""), ("mb", "MB", ".1f"), ("export", "export s", ".3f"),
            ("publish", "publish s", ".3f"), ("load", "load s", ".3f"), ("service_load", "(in service) s", ".3f"),
            ("push", "push s", ".3f"), ("copy", "copy s", ".4f"), ("ratio", "push/copy", ".1f"),
            ("push_mbs", "push MB/s", ".1f"), ("copy_mbs", "copy MB/s", ".0f")]
    rows = []
    for case in result["cases"]:
        if "error" in case:
            rows.append({"engine": case["engine"], "size": case["size"]})
            continue
        m = case["median_s"]
        rows.append({"engine": case["engine"], "size": case["size"], "mb": case["bytes"] / 1e6, **m,
                     "push": case["push_s"], "ratio": case["push_over_copy"],
                     "push_mbs": case["push_bytes_per_s"] / 1e6, "copy_mbs": case["copy_bytes_per_s"] / 1e6})
    lines.append(_setup.fmt_table(rows, cols))
    for case in result["cases"]:
        if "error" in case:
            lines.append(f"{case['engine']} {case['size']}: not measured ({case['error']})")
    lines += ["", "push = export + publish + load (what the learner waits for after each policy step); copy = the "
                  "same bytes copied with shutil.copytree on this disk"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="hf,vllm", help="comma list: hf, vllm")
    parser.add_argument("--sizes", default="tiny,medium", help=f"comma list of {', '.join(SIZES)}")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--store", default="local", choices=["local", "s3"],
                        help="weights store: a local directory or a moto S3 server on loopback")
    parser.add_argument("--quick", action="store_true", help="HF engine, tiny model, 3 pushes")
    parser.add_argument("--output", default="local_outputs/bench/weight_push")
    args = parser.parse_args(argv)
    if args.quick:
        args.engines, args.sizes, args.reps = "hf", "tiny", min(args.reps, 3)
    _setup.configure_torch()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-weight-push-", dir=out))
    moto = _start_moto() if args.store == "s3" else None
    store_root = "s3://bench/weights" if moto else str(scratch / "store")
    result = {"settings": vars(args), "conditions": {"before": _setup.conditions()}, "cases": []}
    try:
        for engine in args.engines.split(","):
            for size in args.sizes.split(","):
                if engine == "vllm" and importlib.util.find_spec("vllm") is None:
                    result["cases"].append({"engine": engine, "size": size, "error": "vllm is not installed"})
                    continue
                try:
                    case = measure_one(engine, size, args.reps, store_root, scratch, out)
                except (RuntimeError, TimeoutError) as err:
                    case = {"engine": engine, "size": size, "error": str(err)[-500:]}
                print(f"{engine} {size}: " + (f"push {case['push_s']:.3f} s, copy {case['median_s']['copy']:.4f} s"
                                             if "error" not in case else case["error"][-200:]), flush=True)
                result["cases"].append(case)
    finally:
        if moto is not None:
            moto.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    result["conditions"]["after"] = _setup.conditions()
    (out / "weight_push.json").write_text(json.dumps(result, indent=2) + "\n")
    text = report(result)
    (out / "weight_push.txt").write_text(text + "\n")
    ok = [c for c in result["cases"] if "error" not in c]
    if ok:
        labels = [f"{c['engine']} {c['size']} ({c['bytes'] / 1e6:.1f} MB)" for c in ok]
        _setup.bar_chart_png(out / "weight_push.png", "weight push vs copying the same bytes (median seconds)",
                             labels, {"export": [c["median_s"]["export"] for c in ok],
                                      "publish": [c["median_s"]["publish"] for c in ok],
                                      "load into the service": [c["median_s"]["load"] for c in ok],
                                      "copy (baseline)": [c["median_s"]["copy"] for c in ok]}, unit=" s")
    print(text)
    print(f"\nresults: {out / 'weight_push.json'}, plot: {out / 'weight_push.png'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
