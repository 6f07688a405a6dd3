"""Embedded model: deterministic build, cache, chat template; loading from dirs, s3:// and hub ids."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sao_core import storage
from sao_core.models import (
    EMBEDDED_SMOLLM2,
    EMBEDDED_TINY,
    ModelLoadError,
    TinyModelSpec,
    build_tiny_model,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
    resolve_model,
)

BOOKKEEPING = {storage.MANIFEST_NAME, storage.COMPLETE_MARKER}


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if p.name not in BOOKKEEPING}


def test_build_twice_gives_byte_identical_files(tmp_path, tiny_model_dir):
    # A second build in a fresh process and a fresh cache must produce exactly the same bytes.
    code = ("import sys; from sao_core.models import build_tiny_model; "
            "print(build_tiny_model(sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONHASHSEED": "123"})
    second = Path(out.stdout.strip().splitlines()[-1])
    first = _digests(Path(tiny_model_dir))
    assert {"model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"} <= set(first)
    assert first == _digests(second)


def test_cached_build_is_reused(sao_cache, tiny_model_dir):
    weights = Path(tiny_model_dir) / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    again = build_tiny_model(Path(sao_cache) / "models", TinyModelSpec())
    assert str(again) == str(tiny_model_dir)
    assert weights.stat().st_mtime_ns == stamp
    assert storage.is_complete_checkpoint(str(again))


def test_incomplete_cache_is_rebuilt(tmp_path):
    target = build_tiny_model(tmp_path)
    (target / storage.COMPLETE_MARKER).unlink()
    rebuilt = build_tiny_model(tmp_path)
    assert storage.is_complete_checkpoint(str(rebuilt))


def test_different_spec_gets_its_own_directory(tmp_path):
    small = build_tiny_model(tmp_path, TinyModelSpec(hidden_size=64, intermediate_size=128))
    assert small.name != f"tiny-llama-{TinyModelSpec().fingerprint()}"
    assert json.loads((small / "config.json").read_text())["hidden_size"] == 64


def test_tokenizer_vocab_and_special_tokens(sao_cache):
    tokenizer = load_tokenizer(EMBEDDED_TINY, sao_cache)
    assert len(tokenizer) == 512
    for special in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                    "</tool_response>"):
        assert len(tokenizer.encode(special, add_special_tokens=False)) == 1, special
    assert tokenizer.eos_token == "<|im_end|>"
    text = "Compute 12 * 7 = 84 \\boxed{84} ünïcödé ✓"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text  # byte-level: lossless


def test_chat_template_marks_assistant_tokens_and_renders_tools(sao_cache):
    tokenizer = load_tokenizer(EMBEDDED_TINY, sao_cache)
    messages = [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Compute 3 + 4"},
        {"role": "assistant", "content": "<tool_call>calc 3 + 4</tool_call>"},
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "The answer is \\boxed{7}."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou can call tools.<|im_end|>\n"
        "<|im_start|>user\nCompute 3 + 4<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>calc 3 + 4</tool_call><|im_end|>\n"
        "<|im_start|>tool\n<tool_response>7</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nThe answer is \\boxed{7}.<|im_end|>\n"
    )
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    learned = [t for t, m in zip(encoded["input_ids"], encoded["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(learned) == "<tool_call>calc 3 + 4</tool_call><|im_end|>The answer is \\boxed{7}.<|im_end|>"
    # The generation prompt is a prefix of the full conversation: the model continues exactly there.
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")
    structured = [{"role": "user", "content": "list files"},
                  {"role": "assistant", "content": "",
                   "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"cmd": "ls"}}}]}]
    assert '<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}}</tool_call><|im_end|>' in \
        tokenizer.apply_chat_template(structured, tokenize=False)


def test_load_local_model_generates(sao_cache, tiny_model_dir):
    import torch

    model, tokenizer = load_model_and_tokenizer(tiny_model_dir, sao_cache)
    assert model.config.model_type == "llama"
    assert 300_000 < sum(p.numel() for p in model.parameters()) < 500_000
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Compute 1 + 1"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_corrupt_local_model_names_the_file(tmp_path, tiny_model_dir, sao_cache):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    with (copy / "model.safetensors").open("r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(str(copy), sao_cache)


def test_load_from_s3_downloads_once_and_verifies(moto_s3, tmp_path, tiny_model_dir):
    uri = moto_s3.uri("models/tiny")
    storage.publish_checkpoint(tiny_model_dir, uri)
    cache = tmp_path / "cache"
    resolved = resolve_model(uri, cache)
    assert resolved.source == "s3" and Path(resolved.path).is_relative_to(cache)
    model = load_model(uri, cache)
    assert model.config.vocab_size == 512
    # Corrupt the object in S3: a fresh cache must refuse it and name the file.
    storage.write_bytes(storage.join(uri, "config.json"), b"{}")
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model(uri, tmp_path / "fresh-cache")


def test_incomplete_s3_model_is_refused(moto_s3, tmp_path, tiny_model_dir):
    import boto3

    uri = moto_s3.uri("models/no-marker")
    storage.upload_dir(tiny_model_dir, uri)
    # Remove the marker that upload_dir copied, as if the publisher died before writing it.
    boto3.client("s3", endpoint_url=moto_s3.endpoint_url).delete_object(
        Bucket=moto_s3.bucket, Key=f"models/no-marker/{storage.COMPLETE_MARKER}")
    with pytest.raises(ModelLoadError, match="(?i)incomplete|_COMPLETE"):
        resolve_model(uri, tmp_path)


def test_hub_id_offline_gives_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert resolve_model("Qwen/Qwen3-0.6B", tmp_path).source == "huggingface"
    with pytest.raises(ModelLoadError, match="Qwen/Qwen3-0.6B.*not in the local Hugging Face cache"):
        load_tokenizer("Qwen/Qwen3-0.6B", tmp_path)


@pytest.mark.parametrize("reference, message", [
    ("embedded:giant", "unknown embedded model"),
    ("./no/such/dir", "no such directory"),
    ("/definitely/not/here", "no such directory"),
    ("not a model id!", "not an s3:// URI"),
    ("s3://", "s3"),
])
def test_bad_references(reference, message, tmp_path):
    with pytest.raises((ModelLoadError, storage.StorageError), match=message):
        resolve_model(reference, tmp_path)


def test_file_instead_of_directory(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="is a file"):
        resolve_model(str(f), tmp_path)


def test_bad_dtype(tmp_path, tiny_model_dir):
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load_model(tiny_model_dir, tmp_path, dtype="float7")


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_gguf_loads_and_answers(tmp_path):
    pytest.importorskip("gguf")
    try:
        resolved = resolve_model(EMBEDDED_SMOLLM2, tmp_path)
    except ModelLoadError as err:
        pytest.skip(str(err))
    import torch

    model, tokenizer = load_model_and_tokenizer(EMBEDDED_SMOLLM2, tmp_path)
    # The GGUF is de-quantised once into a verified float32 folder (issue 37): eos / pad from the GGUF's metadata.
    assert not resolved.gguf_file and storage.is_complete_checkpoint(resolved.path)
    assert model.config.model_type == "llama" and tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == 2
    assert resolve_model(EMBEDDED_SMOLLM2, tmp_path).path == resolved.path          # reused, not exported again
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3? Answer briefly."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "5" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:])


# ---------------------------------------------------------------------------------------------- verification
def _plain_copy(tiny_model_dir, dest: Path) -> Path:
    """The embedded model's files without its manifest and marker: a Hugging Face folder made elsewhere."""
    shutil.copytree(tiny_model_dir, dest, ignore=shutil.ignore_patterns(*BOOKKEEPING))
    return dest


def test_a_folder_without_a_manifest_is_refused_even_byte_flipped_and_loads_with_unverified(tmp_path, tiny_model_dir,
                                                                                         sao_cache):
    """Issue 17: delete manifest.json and a byte-flipped model loaded silently. Now the folder is refused (named,
    with what to do); `unverified` loads a plain folder as it is."""
    flipped = _plain_copy(tiny_model_dir, tmp_path / "flipped")
    weights = flipped / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF                                   # a weight, not the header: it would still load
    weights.write_bytes(bytes(data))
    for load in (load_model, load_tokenizer, resolve_model):
        with pytest.raises(ModelLoadError, match=rf"model directory {flipped} has no manifest.json.*--unverified"):
            load(str(flipped), sao_cache)
    plain = _plain_copy(tiny_model_dir, tmp_path / "plain")
    model, tokenizer = load_model_and_tokenizer(str(plain), sao_cache, unverified=True)
    assert model.config.vocab_size == 512 and len(tokenizer) == 512


def test_a_file_the_manifest_does_not_list_is_refused(tmp_path, tiny_model_dir, sao_cache):
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    (copy / "sub").mkdir()
    (copy / "sub" / "modeling_evil.py").write_text("import os\n")
    with pytest.raises(ModelLoadError, match=rf"not in its manifest.json: {copy}/sub/modeling_evil.py"):
        resolve_model(str(copy), sao_cache)
    with pytest.raises(storage.CheckpointError, match="modeling_evil.py"):
        storage.verify_checkpoint(copy)
    assert resolve_model(str(copy), sao_cache, unverified=True).source == "local"    # listed files still checked
    (copy / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="config.json does not match"):
        resolve_model(str(copy), sao_cache, unverified=True)


def test_a_tampered_embedded_build_is_refused(tmp_path):
    target = build_tiny_model(tmp_path / "models")
    (target / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"cached build of embedded:tiny .*/tokenizer.json.*delete that directory"):
        resolve_model(EMBEDDED_TINY, tmp_path)
