"""Adapters are checked before they touch anything (issue 38, part 1): a hostile LoRA adapter pushed to the HF
engine is refused with an error naming the field or tensor and the file, the engine serves bit-identical
log-probs afterwards (whether it held the base or an adapter), and the next legitimate adapter is accepted;
`sao checkpoint merge` and the vLLM engine's adapter check refuse the same adapters; a failure while the checked
adapter is put into the model leaves the model as it was; the adapters the project writes pass."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from lora_helpers import make_adapter
from safetensors.torch import load_file, save_file

from sao_core.models import EMBEDDED_TINY, load_model
from sao_core.rollout.engines.base import EngineError
from sao_core.rollout.engines.hf import HFEngine
from sao_core.training import lora
from sao_core.training.merge import MergeError, merge_checkpoint

PROBE = [3, 17, 5, 42, 9, 11, 28, 7, 64, 2, 33, 19]


def _reference(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))]


@pytest.fixture(scope="module")
def good(tmp_path_factory, sao_cache, tiny_model_dir) -> dict:
    """Two legitimate adapters (q_proj, v_proj; rank 4) as the project writes them, and the log-probs of PROBE
    under each (peft's model)."""
    root = tmp_path_factory.mktemp("good")
    found = {}
    for name, seed in (("v1", 1), ("v2", 2)):
        reference = make_adapter(tiny_model_dir, sao_cache, root / name, seed=seed)
        found[name], found[f"{name}_logprobs"] = root / name, _reference(reference, PROBE)
    return found


# ------------------------------------------------------------------------------------------ hostile adapters
def _copy(good_dir: Path, out: Path, config: dict | None = None, weights=None) -> Path:
    """`good_dir` copied to `out`, its config updated with `config`, its weights passed through `weights`."""
    shutil.copytree(good_dir, out)
    if config:
        data = json.loads((out / lora.ADAPTER_CONFIG).read_text())
        (out / lora.ADAPTER_CONFIG).write_text(json.dumps({**data, **config}))
    if weights:
        tensors = load_file(str(out / lora.ADAPTER_WEIGHTS))
        save_file(weights(tensors), str(out / lora.ADAPTER_WEIGHTS))
    return out


def _drop_a_b_matrix(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if not k.endswith("layers.1.self_attn.v_proj.lora_B.weight")}


def _smuggle_a_base_weight(tensors: dict) -> dict:
    """peft's loader copies any name it knows: a base layer's weight rides along with the adapter."""
    return {**tensors, "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight": torch.zeros(128, 128)}


def _nan(tensors: dict) -> dict:
    name = next(k for k in sorted(tensors) if "lora_A" in k)
    poisoned = tensors[name].clone()
    poisoned[0, 0] = float("nan")
    return {**tensors, name: poisoned}


CONFIG, WEIGHTS = lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS
# name -> (config changes, weight changes, the file the error names, what it says)
HOSTILE = {
    "use_dora": ({"use_dora": True}, None, CONFIG, r"use_dora True is refused: DoRA"),
    "init_false_missing_weight": ({"init_lora_weights": False}, _drop_a_b_matrix, WEIGHTS,
                                  r"missing adapter weight .*layers\.1\.self_attn\.v_proj\.lora_B\.weight"),
    "layer_replication": ({"layer_replication": [[0, 2], [1, 2]]}, None, CONFIG,
                          r"layer_replication \[\[0, 2\], \[1, 2\]\] is refused"),
    "huge_rank": ({"r": 200000}, None, CONFIG, r"r 200000 is refused: .*MAX_LORA_RANK"),
    "pissa": ({"init_lora_weights": "pissa"}, None, CONFIG, r"init_lora_weights 'pissa' is refused"),
    "many_targets": ({"target_modules": ["q_proj", "v_proj"] + [f"m{i}" for i in range(100_000)]}, None, CONFIG,
                     r"target_modules lists 100002 names, more than 1024"),
    "regex_targets": ({"target_modules": "(.|.)*Z"}, None, CONFIG,
                      r"target_modules '\(\.\|\.\)\*Z' is refused: a string is read by peft as a regular "
                      r"expression"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, None, CONFIG, r"modules_to_save \['lm_head'\] is refused"),
    "smuggled_base_weight": (None, _smuggle_a_base_weight, WEIGHTS,
                             r"unexpected weight .*layers\.0\.self_attn\.q_proj\.base_layer\.weight"),
    "nan_weight": (None, _nan, WEIGHTS, r"the adapter weight .*lora_A\.weight holds NaN"),
}


@pytest.fixture(scope="module")
def hostile(good, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile")
    return {name: _copy(good["v1"], root / name, config, weights)
            for name, (config, weights, _, _) in HOSTILE.items()}


# ------------------------------------------------------------------------------------------ the HF engine
def _state(engine) -> tuple:
    stats = engine.stats()
    return engine.version, stats["lora"], engine.lora_mode


@pytest.mark.parametrize("carrying", [False, True], ids=["on-the-base", "over-an-adapter"])
@pytest.mark.parametrize("case", list(HOSTILE))
def test_the_hf_engine_refuses_a_hostile_adapter_and_serves_what_it_served(case, carrying, hostile, good,
                                                                           tiny_model_dir, sao_cache):
    """Refused (its error names the field or tensor and the file) within a second, the log-probs served
    afterwards bit-identical, version and lora mode unchanged, the next legitimate adapter accepted. Before
    issue 38 each of these changed the served model, stayed accepted (pissa), or hung the engine."""
    following = "v1" if carrying else "v2"   # the next legitimate adapter

    async def go():
        engine = HFEngine(str(tiny_model_dir), str(sao_cache), max_batch=2)
        try:
            if carrying:   # v2: a hostile copy of v1 partly copied in would show
                await engine.load_weights(str(good["v2"]), 1)
            before, state = await engine.score(PROBE, 1), _state(engine)
            began = time.monotonic()
            with pytest.raises(EngineError) as refused:
                await asyncio.wait_for(engine.load_weights(str(hostile[case]), 7), timeout=30)
            took = time.monotonic() - began
            assert await engine.score(PROBE, 1) == before and _state(engine) == state
            await engine.load_weights(str(good[following]), 8)
            assert _state(engine) == (8, "adapter", "adapter")
            return str(refused.value), took, await engine.score(PROBE, 1)
        finally:
            await engine.close()

    message, took, served = asyncio.run(go())
    _, _, file, what = HOSTILE[case]
    assert re.match(re.escape(f"{hostile[case]}/{file}: ") + ".*" + what, message), message
    # Refused before peft builds anything: r 200000 or the backtracking regex would take minutes (or the memory);
    # a refusal takes milliseconds idle, the bound is loose for a loaded machine.
    assert took < 5.0, f"refusing took {took:.2f} s"
    assert max(abs(a - b) for a, b in zip(served, good[f"{following}_logprobs"], strict=True)) < 1e-4


def test_a_failure_while_the_checked_adapter_goes_in_leaves_the_engine_as_it_was(good, tiny_model_dir, sao_cache,
                                                                                 monkeypatch):
    """`lora.put_adapter_into` is transactional: peft failing half way through copying the weights (first adapter:
    after injecting the LoRA layers; later adapter: over the previous adapter's weights) leaves the served
    log-probs bit-identical and no LoRA layer behind, and the next adapter goes in."""
    from peft import set_peft_model_state_dict

    real = lora._set_adapter

    def copies_half_then_fails(model, adapter, where):
        set_peft_model_state_dict(model, {k: v for i, (k, v) in enumerate(sorted(adapter.items())) if i % 2})
        raise RuntimeError("out of memory (simulated)")

    async def go():
        engine = HFEngine(str(tiny_model_dir), str(sao_cache), max_batch=2)
        try:
            base = await engine.score(PROBE, 1)
            modules = [type(m) for m in engine.model.modules()]
            params = [(n, p.requires_grad) for n, p in engine.model.named_parameters()]
            monkeypatch.setattr(lora, "_set_adapter", copies_half_then_fails)
            with pytest.raises(EngineError, match=r"out of memory \(simulated\); the current weights \(version 0\)"):
                await engine.load_weights(str(good["v1"]), 1)
            assert await engine.score(PROBE, 1) == base and _state(engine) == (0, None, None)
            assert [type(m) for m in engine.model.modules()] == modules and not lora.has_adapter(engine.model)
            assert [(n, p.requires_grad) for n, p in engine.model.named_parameters()] == params
            assert not hasattr(engine.model, "peft_config")
            monkeypatch.setattr(lora, "_set_adapter", real)
            await engine.load_weights(str(good["v1"]), 1)
            with_v1 = await engine.score(PROBE, 1)
            monkeypatch.setattr(lora, "_set_adapter", copies_half_then_fails)
            with pytest.raises(EngineError, match="simulated"):
                await engine.load_weights(str(good["v2"]), 2)
            assert await engine.score(PROBE, 1) == with_v1 and _state(engine) == (1, "adapter", "adapter")
            monkeypatch.setattr(lora, "_set_adapter", real)
            await engine.load_weights(str(good["v2"]), 2)
            return with_v1, await engine.score(PROBE, 1)
        finally:
            await engine.close()

    with_v1, with_v2 = asyncio.run(go())
    assert max(abs(a - b) for a, b in zip(with_v1, good["v1_logprobs"], strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(with_v2, good["v2_logprobs"], strict=True)) < 1e-4


# ------------------------------------------------------------------------------------------ merge, vLLM
@pytest.mark.parametrize("case", list(HOSTILE))
def test_merge_refuses_a_hostile_adapter_and_publishes_nothing(case, hostile, sao_cache, tmp_path):
    """`sao checkpoint merge` refuses each hostile adapter with the check's error (before issue 38 a pissa
    adapter merged into other weights than the legitimate merge, a regex hung it)."""
    began = time.monotonic()
    with pytest.raises(MergeError) as refused:
        merge_checkpoint(EMBEDDED_TINY, str(hostile[case]), str(tmp_path / "out"), str(sao_cache), unverified=True)
    assert time.monotonic() - began < 10
    assert re.match(re.escape(f"adapter {hostile[case]}") + ".*" + HOSTILE[case][3], str(refused.value)), \
        str(refused.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", list(HOSTILE))
def test_the_vllm_engines_adapter_check_refuses_a_hostile_adapter(case, hostile, good, tiny_model_dir):
    """The vLLM engine's check (run before vLLM or the merge sees an adapter; needs no vLLM) refuses each."""
    from sao_core.rollout.engines import vllm

    modules = lora.base_modules_of_folder(tiny_model_dir)
    shapes = vllm._base_shapes(tiny_model_dir)
    assert vllm.check_adapter(str(good["v1"]), shapes, modules) == 4
    with pytest.raises(EngineError, match=r"broken LoRA adapter"):
        vllm.check_adapter(str(hostile[case]), shapes, modules)


# ------------------------------------------------------------------------------------------ legitimate adapters
@pytest.mark.parametrize("targets", ["", "all-linear", "q_proj,v_proj,down_proj", "embed_tokens,q_proj",
                                     "lm_head,o_proj"])
def test_the_adapters_the_project_writes_pass_the_check(targets, tiny_model_dir, sao_cache, tmp_path):
    """peft's default targets, all-linear (saved as every linear layer's full name), plain names, an embedding:
    what `write_adapter` writes passes against the base model, and loaded into a plain model computes what the
    peft model computes."""
    reference = make_adapter(tiny_model_dir, sao_cache, tmp_path / "a", rank=8, target_modules=targets)
    config, weights = lora.check_adapter_dir(tmp_path / "a", lora.base_modules_of_folder(tiny_model_dir))
    assert weights and all(".lora_" in name for name in weights)
    raw = json.loads((tmp_path / "a" / lora.ADAPTER_CONFIG).read_text())
    assert lora.check_adapter(raw, weights, load_model(str(tiny_model_dir), str(sao_cache))).r == 8
    served = lora.load_adapter_into(load_model(str(tiny_model_dir), str(sao_cache)).eval(), tmp_path / "a")
    assert max(abs(a - b) for a, b in zip(_reference(served, PROBE), _reference(reference, PROBE),
                                          strict=True)) < 1e-5


def test_bounds_are_named_and_fit_the_layers(good, tiny_model_dir, tmp_path):
    """r above the smallest dimension of a targeted layer, alpha out of bounds, a target that is no layer, an
    option this check does not know: each refused by name."""
    base = lora.base_modules_of_folder(tiny_model_dir)
    raw = json.loads((good["v1"] / lora.ADAPTER_CONFIG).read_text())
    weights = load_file(str(good["v1"] / lora.ADAPTER_WEIGHTS))
    for change, message in (({"r": 100}, r"r 100 exceeds the smallest dimension \(64\) of the target module "
                                         r"model\.layers\.\d\.self_attn\.v_proj"),
                            ({"lora_alpha": 1e9}, r"lora_alpha 1000000000\.0 is refused"),
                            ({"lora_alpha": 0}, r"lora_alpha 0 is refused"),
                            ({"target_modules": ["input_layernorm"]}, r"target module .*input_layernorm is a "
                                                                      r"LlamaRMSNorm"),
                            ({"target_modules": ["self_attn"]}, r"is a LlamaAttention, not a Linear"),
                            ({"fan_in_fan_out": True}, r"fan_in_fan_out True does not fit"),
                            ({"bias": "all"}, r"bias 'all' is refused"),
                            ({"rank_pattern": {".*": 2}}, r"rank_pattern \{'\.\*': 2\} is refused"),
                            ({"peft_type": "LOHA"}, r"peft_type 'LOHA' is not LORA"),
                            ({"use_bdlora": {"x": 1}}, r"use_bdlora .* is refused"),
                            ({"some_future_option": 3}, r"some_future_option 3 is refused: an option this "
                                                        r"version does not know")):
        with pytest.raises(ValueError, match=r"^where/adapter_config\.json: .*" + message):
            lora.check_adapter({**raw, **change}, weights, base, where="where")
    assert lora.check_adapter({**raw, "some_future_option": None, "runtime_config": {}}, weights, base).r == 4
