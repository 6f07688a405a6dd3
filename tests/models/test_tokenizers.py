"""Tokenizers unlike the embedded one (issue 37): a Llama-3 style and a Mistral style one, which have no pad token
and add a BOS token themselves, and a Qwen-style one whose chat template writes tool calls (``<tool_call>`` ...
``</tool_call>``) and tool replies the way Qwen's does. Each is built offline with `tokenizers` (trained on the
embedded corpus; the special tokens, BOS, EOS, pad and chat-template structure of the real ones), saved next to a
tiny random Llama of its vocabulary and published with a manifest. With each tokenizer every training method (sft,
cpt, dpo, gkd) trains a step, the RL learner steps (sao, grpo) and the HF engine generates a padded batch.

Before issue 37 every method and the learner passed ``tokenizer.pad_token_id`` (None for the first two) to
``torch.full`` and crashed; `sao_core.models.pad_token_id` now chooses the id in one place."""

from __future__ import annotations

import asyncio
import copy
import json
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sao_core import storage
from sao_core.models import load_model, load_tokenizer, pad_token_id
from sao_core.models.tokenizer_corpus import corpus_lines

# ------------------------------------------------------------------------------------------------ the tokenizers
LLAMA3_TEMPLATE = (   # Llama 3 Instruct's header / eot structure; assistant turns in {% generation %} blocks
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

MISTRAL_TEMPLATE = (   # Mistral Instruct: [INST] user [/INST] answer</s>
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- generation %}{{- ' ' + message['content'] + eos_token }}{%- endgeneration %}"
    "{%- else %}{{- raise_exception('only user and assistant messages') }}{%- endif %}"
    "{%- endfor %}"
)

QWEN_TEMPLATE = (   # Qwen2.5's: default system turn, tool calls as JSON in <tool_call>, tool replies in a user turn
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{%- if message.get('content') %}{{- message['content'] }}{%- endif %}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set fn = call.get('function', call) %}"
    "{%- if message.get('content') or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _train(core, special: list[str], vocab_size: int = 400):
    from tokenizers import pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(core.pre_tokenizer, pre_tokenizers.ByteLevel) else []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, initial_alphabet=alphabet,
                                  min_frequency=2, show_progress=False)
    core.train_from_iterator(corpus_lines(seed=3, num_lines=600), trainer)


def _llama3():
    """Byte-level BPE; BOS <|begin_of_text|> added by the tokenizer itself (post-processor), EOS <|eot_id|>, no pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    _train(core, special)
    bos = core.token_to_id("<|begin_of_text|>")
    core.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
        special_tokens=[("<|begin_of_text|>", bos)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                        additional_special_tokens=special[1:4], clean_up_tokenization_spaces=False)
    tokenizer.chat_template = LLAMA3_TEMPLATE
    return tokenizer


def _mistral():
    """Sentencepiece-like BPE (Metaspace ▁, <unk>); BOS <s> added by the tokenizer itself, EOS </s>, no pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    _train(core, special)
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", core.token_to_id("<s>"))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        additional_special_tokens=special[3:], clean_up_tokenization_spaces=False)
    tokenizer.chat_template = MISTRAL_TEMPLATE
    return tokenizer


def _qwen():
    """Byte-level BPE, no BOS, EOS <|im_end|>, pad <|endoftext|>; <tool_call> and friends are added tokens that are
    not special (as in Qwen2.5: decoding with skip_special_tokens keeps them)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    _train(core, special)
    core.add_tokens([AddedToken(t, special=False, normalized=False)
                     for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        bos_token=None, additional_special_tokens=["<|im_start|>"],
                                        clean_up_tokenization_spaces=False)
    tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer


FAMILIES = {"llama3": _llama3, "mistral": _mistral, "qwen": _qwen}
NO_PAD = ("llama3", "mistral")


def build_family(name: str, root: Path, seeds: tuple[int, ...] = (0,)) -> list[Path]:
    """The tokenizer of `name` with a tiny random Llama of its vocabulary per seed, each published (with a
    manifest) under `root`; returns their directories."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = FAMILIES[name]()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    out = []
    for seed in seeds:
        torch.manual_seed(seed)
        staging = root / f"staging-{seed}"
        tokenizer.save_pretrained(staging)
        LlamaForCausalLM(config).save_pretrained(staging)
        out.append(root / f"model-{seed}")
        storage.publish_checkpoint(staging, str(out[-1]), metadata={"kind": "test-tokenizer", "family": name})
    return out


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, list[Path]]:
    """Per family: the model the tests train and a teacher of other weights (GKD)."""
    root = tmp_path_factory.mktemp("tokenizer-families")
    return {name: build_family(name, root / name, seeds=(0, 1)) for name in FAMILIES}


@pytest.fixture(params=list(FAMILIES))
def family(request, family_dirs, sao_cache):
    """(name, model directory, its tokenizer as the project loads it)."""
    path = family_dirs[request.param][0]
    return request.param, path, load_tokenizer(str(path), sao_cache)


# ------------------------------------------------------------------------------------------------ data
def _conversation(name: str, rng: random.Random) -> list[dict]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    question = {"role": "user", "content": f"Compute {a} + {b}"}
    answer = {"role": "assistant", "content": f"The answer is \\boxed{{{a + b}}}."}
    if name != "qwen":
        return [question, answer]
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"expr": f"{a} + {b}"}}}]}
    return [question, call, {"role": "tool", "content": str(a + b)}, answer]


def _rows(name: str, method: str, count: int = 8) -> list[dict]:
    rng = random.Random(5)
    rows = []
    for i in range(count):
        messages = _conversation(name, rng)
        if method == "cpt":
            rows.append({"text": f"Line {i}: the critic estimates the value of a state. " * (1 + i % 3)})
        elif method == "dpo":
            rows.append({"prompt": messages[:-1], "chosen": [messages[-1]],
                         "rejected": [{"role": "assistant", "content": f"It is {rng.randint(0, 9)}" * (1 + i % 3)}]})
        else:
            rows.append({"messages": messages})
    return rows


# ------------------------------------------------------------------------------------------------ the tests
def test_pad_token_id_prefers_pad_then_eos_then_zero():
    def tok(pad, eos):
        return SimpleNamespace(pad_token_id=pad, eos_token_id=eos)

    assert pad_token_id(tok(3, 7)) == 3
    assert pad_token_id(tok(0, 7)) == 0, "pad id 0 is a pad id, not a missing one"
    assert pad_token_id(tok(None, 7)) == 7
    assert pad_token_id(tok(None, [9, 4])) == 9
    assert pad_token_id(tok(None, None)) == 0
    assert pad_token_id(tok(None, [])) == 0


def test_the_tokenizers_have_the_properties_of_the_real_ones(family):
    name, _, tokenizer = family
    eos = tokenizer.eos_token_id
    assert eos is not None
    if name in NO_PAD:
        assert tokenizer.pad_token_id is None and tokenizer.pad_token is None
        assert pad_token_id(tokenizer) == eos
        assert tokenizer.pad_token_id is None, "pad_token_id() must not set a pad token on the tokenizer"
        ids = tokenizer("Compute 3 + 4").input_ids
        assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1, "BOS added automatically"
    else:
        assert tokenizer.bos_token_id is None and pad_token_id(tokenizer) == tokenizer.pad_token_id != eos
    messages = _conversation(name, random.Random(1))
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    if tokenizer.bos_token_id is not None:   # the template writes BOS; the tokenizer must not add a second
        assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    learned = [i for i, m in zip(ids, mask, strict=True) if m]
    assert learned[-1] == eos and ids.count(eos) >= 1
    if name == "qwen":
        text = tokenizer.decode(learned, skip_special_tokens=True)
        assert '<tool_call>\n{"name": "calc", "arguments": {"expr": ' in text and "</tool_call>" in text
        for marker in ("<tool_call>", "</tool_call>", "<tool_response>"):
            assert ids.count(tokenizer.convert_tokens_to_ids(marker)) >= 1, f"{marker} is one token"
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        assert "<|im_start|>user\n<tool_response>\n" in rendered, "tool replies come back in a user turn"
        assert tokenizer.convert_tokens_to_ids("<tool_response>") not in learned


METHOD_CONFIG = {"sft": "SFTConfig", "cpt": "CPTConfig", "dpo": "DPOConfig", "gkd": "GKDConfig"}


@pytest.mark.parametrize("method", list(METHOD_CONFIG))
def test_every_training_method_trains_a_step(family, family_dirs, method, tmp_path, sao_cache):
    from sao_core.training import config as training_config
    from sao_core.training.trainer import train

    name, model_dir, tokenizer = family
    data = tmp_path / "data"
    data.mkdir()
    (data / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(name, method)))
    extra = {"teacher_model": str(family_dirs[name][1]), "on_policy_fraction": 1.0, "max_new_tokens": 6} \
        if method == "gkd" else {}
    config = getattr(training_config, METHOD_CONFIG[method])(
        data=str(data), output=str(tmp_path / "run"), model=str(model_dir), steps=1, batch_size=4, lr=1e-2,
        warmup_steps=0, schedule="constant", max_tokens=192 if name == "qwen" else 64, cache_dir=str(sao_cache),
        log_every=1, report_every=0, **extra)
    summary = train(method, config)
    assert summary["steps"] == 1 and summary["last_train_loss"] == summary["last_train_loss"]   # not NaN
    before, after = load_model(str(model_dir), sao_cache), load_model(summary["model"], sao_cache)
    assert any(not torch.equal(a, b) for a, b in zip(before.state_dict().values(), after.state_dict().values(),
                                                      strict=True)), "the step changed no weight"
    assert load_tokenizer(summary["model"], sao_cache).pad_token_id == tokenizer.pad_token_id, \
        "the exported tokenizer is the one trained with (no pad token added)"


def _trajectories(tokenizer, count: int = 4):
    """`count` chat-template trajectories of different lengths (so the batch is padded): groups of two per prompt,
    rewards 0 and 1 in each group."""
    from sao_core.rollout.trajectory import Trajectory

    rows = []
    for i in range(count):
        prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": f"Compute {i // 2} + 4"}],
                                                    tokenize=True, add_generation_prompt=True,
                                                    return_dict=True)["input_ids"])
        action = tokenizer.encode(f"The answer is {4 + i}" + " then" * i, add_special_tokens=False)
        action.append(tokenizer.eos_token_id)
        rows.append(Trajectory(id=f"t{i}", prompt_id=f"p{i // 2}", env="tool_arith", token_ids=prompt + action,
                               action_mask=[0] * len(prompt) + [1] * len(action),
                               rollout_logprobs=[0.0] * len(prompt) + [-6.0] * len(action),
                               versions=[-1] * len(prompt) + [0] * len(action), reward=float(i % 2), num_turns=1,
                               finish_reason="stop", metadata={"epoch": 0, "position": i}))
    return rows


@pytest.mark.parametrize("method", ["sao", "grpo"])
def test_the_rl_learner_steps(family, method, tmp_path, sao_cache):
    from sao_core.learner.config import RLConfig
    from sao_core.learner.learner import Learner
    from sao_core.objectives.common import token_logprobs
    from sao_core.training.distributed import DistContext

    name, model_dir, tokenizer = family
    config = RLConfig(data=str(tmp_path / "unused"), output=str(tmp_path / "run"), model=str(model_dir),
                      method=method, batch_size=4, group_size=2, policy_lr=1e-2, critic_lr=1e-2,
                      critic_warmup_steps=0, critic_updates=1, max_new_tokens_per_turn=8, max_total_tokens=128,
                      cache_dir=str(sao_cache))
    (tmp_path / "scratch").mkdir()
    learner = Learner.load(config, DistContext(), tmp_path / "scratch")
    assert (learner.critic is not None) == (method == "sao")
    batch = _trajectories(tokenizer)
    assert len({len(t.token_ids) for t in batch}) > 1, "the batch must need padding"
    for t in batch:   # the policy's own log-probs (an engine at version 0): every ratio is 1, so the step learns
        ids = torch.tensor([t.token_ids])
        with torch.no_grad():
            logprobs = token_logprobs(learner.policy(ids).logits, ids)[0]
        t.rollout_logprobs = [float(lp) if m else 0.0 for m, lp in zip(t.action_mask, logprobs, strict=True)]
    before = [p.detach().clone() for p in learner.policy.parameters()]
    result = learner.step(batch)
    assert result.changed and result.tokens == sum(sum(t.action_mask) for t in batch)
    assert all(v == v for v in result.metrics.values() if isinstance(v, float)), result.metrics   # no NaN
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.policy.parameters(), strict=True))


def test_the_hf_engine_generates_a_padded_batch(family, sao_cache):
    from sao_core.objectives.common import token_logprobs
    from sao_core.rollout.engines.base import SamplingParams
    from sao_core.rollout.engines.hf import HFEngine

    name, model_dir, tokenizer = family
    prompts = [t.token_ids[:-3] for t in _trajectories(tokenizer, 3)]   # three lengths, one batch

    async def go():
        engine = HFEngine(str(model_dir), str(sao_cache), max_batch=3, seed=1)
        done = await asyncio.gather(*[engine.generate(p, SamplingParams(max_new_tokens=6, seed=i))
                                      for i, p in enumerate(prompts)])
        await engine.close()
        return engine, done

    engine, done = asyncio.run(go())
    assert engine.pad_id == pad_token_id(tokenizer)
    model = load_model(str(model_dir), sao_cache)
    for prompt, generation in zip(prompts, done, strict=True):
        assert generation.token_ids and all(0 <= t < len(tokenizer) for t in generation.token_ids)
        ids = torch.tensor([prompt + list(generation.token_ids)])
        with torch.no_grad():
            alone = token_logprobs(model(input_ids=ids).logits, ids)[0, len(prompt):]
        # Padding the batch changed nothing: each row's log-probs are those of the row alone.
        assert torch.allclose(alone, torch.tensor(generation.logprobs), atol=1e-4)


def test_assistant_tokens_of_a_template_without_generation_blocks(sao_cache):
    """Released templates (SmolLM2's, Llama 3's, Qwen's) have no {% generation %} block: the assistant's tokens
    come from renderings of the conversation's prefixes, through the end-of-turn token; the embedded tiny
    model's template, which has the blocks, gives the same mask both ways."""
    from sao_core.models import EMBEDDED_TINY, load_tokenizer
    from sao_core.training.chat_batch import _marks_generation, assistant_spans_by_prefix, encode_chat

    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."},
                {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6."}]
    tiny = load_tokenizer(EMBEDDED_TINY, sao_cache)
    assert _marks_generation(tiny)
    by_blocks = encode_chat(tiny, messages, 512)
    assert assistant_spans_by_prefix(tiny, messages) == (by_blocks.input_ids, by_blocks.loss_mask)
    plain = copy.deepcopy(tiny)
    plain.chat_template = plain.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    plain.chat_template = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", plain.chat_template)
    assert not _marks_generation(plain)
    encoded = encode_chat(plain, messages, 512)
    assert (encoded.input_ids, encoded.loss_mask) == (by_blocks.input_ids, by_blocks.loss_mask)
    assert plain.decode([i for i, m in zip(encoded.input_ids, encoded.loss_mask, strict=True) if m]) == \
        "It is 4.<|im_end|>6.<|im_end|>"
    rewriting = copy.deepcopy(plain)   # a template that renders earlier turns differently: refused, not guessed
    rewriting.chat_template = "{% for m in messages %}{{ m['content'] if loop.last else 'x' }}{% endfor %}"
    with pytest.raises(ValueError, match="cannot be told apart"):
        encode_chat(rewriting, messages, 512)
