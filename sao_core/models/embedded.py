"""The embedded default model: a tiny Llama-architecture causal LM built offline.

`build_tiny_model` trains a byte-level BPE tokenizer on a fixed corpus, initialises a small Llama with a
fixed seed and saves both in Hugging Face format. The same spec always gives byte-identical files, and
the result is cached in a directory named after the spec, so a second build returns at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sao_core import storage  # noqa: E402

# Bump when the build procedure changes, so cached builds of the old procedure are not reused.
BUILDER_VERSION = 1

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

# ChatML. Assistant turns are wrapped in {% generation %} so that
# `apply_chat_template(..., return_assistant_tokens_mask=True)` marks exactly the tokens the model
# must learn to produce. Tool results come back as role "tool" inside <tool_response> tags.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- generation -%}"
    "{%- if message.get('content') -%}{{ message['content'] }}{%- endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call.get('function', call) -%}"
    "{{ '<tool_call>{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string -%}{{ fn['arguments'] }}{%- else -%}{{ fn['arguments'] | tojson }}{%- endif -%}"
    "{{ '}</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>' }}"
    "{%- endgeneration -%}"
    "{{ '\\n' }}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{ '<|im_start|>tool\\n<tool_response>' + message['content'] + '</tool_response><|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the embedded model. Defaults give ~0.4M parameters (CPU learns a tool task in minutes)."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096
    seed: int = 0
    corpus_lines: int = 3000

    def fingerprint(self) -> str:
        """Stable 12-hex-digit id of this spec and the builder version (names the cache directory)."""
        payload = json.dumps({"builder": BUILDER_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def _build_tokenizer(spec: TinyModelSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from sao_core.models.tokenizer_corpus import corpus_lines

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    core.train_from_iterator(corpus_lines(spec.seed, spec.corpus_lines), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=spec.max_position_embeddings,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_model(spec: TinyModelSpec, tokenizer):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True,
        temperature=1.0, top_k=0, top_p=1.0,
    )
    return model


def build_tiny_model(cache_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Build (or reuse) the embedded tiny model under `cache_dir`; return its directory.

    The directory holds a Hugging Face model and tokenizer plus the checkpoint manifest and
    `_COMPLETE` marker of `sao_core.storage`, so it can be published to S3 as it is. Building takes
    about a second on one CPU core; a complete cached build is returned without work.
    """
    spec = spec or TinyModelSpec()
    target = Path(cache_dir) / f"tiny-llama-{spec.fingerprint()}"
    if storage.is_complete_checkpoint(str(target)):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        staging = Path(tmp) / "model"
        tokenizer = _build_tokenizer(spec)
        model = _build_model(spec, tokenizer)
        tokenizer.save_pretrained(staging)
        model.save_pretrained(staging, safe_serialization=True)
        (staging / "sao_model_spec.json").write_text(
            json.dumps({"builder": BUILDER_VERSION, **dataclasses.asdict(spec)}, indent=2, sort_keys=True) + "\n"
        )
        # Publish into a sibling and rename, so a concurrent builder never sees half a model.
        published = Path(tmp) / "published"
        storage.publish_checkpoint(staging, str(published), metadata={"kind": "embedded", "spec": spec.fingerprint()})
        if target.exists():
            shutil.rmtree(target)
        published.rename(target)
    return target
