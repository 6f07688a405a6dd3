"""Merge a LoRA adapter into its base model: `sao checkpoint merge` and the evaluator's ``adapter`` setting.

A LoRA run publishes each weight version as an adapter folder in peft's format (``adapter_config.json`` +
``adapter_model.safetensors``) sealed with a manifest (`sao_core.storage.publish_checkpoint`; metadata kind
``lora_adapter``). `merge_checkpoint` turns one into a full Hugging Face model folder that any engine loads
without peft: the base model is resolved and verified (`sao_core.models.resolve_model`), the adapter fetched
and verified against its manifest (`sao_core.storage.fetch_checkpoint`), peft merges it
(`sao_core.training.lora.merge_adapter_dir`), and the result is published as a checkpoint with its own
manifest (metadata kind ``model``, with the base, the adapter and the adapter's digest), so it loads verified.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import uuid
import warnings
from pathlib import Path
from typing import Any

from sao_core import storage
from sao_core.models import ModelLoadError, resolve_model

log = logging.getLogger(__name__)

#: dtypes the merged weights may be written in ("auto": the base checkpoint's own)
MERGE_DTYPES = ("auto", "float32", "bfloat16")


class MergeError(ValueError):
    """An adapter cannot be merged into a base model; the message names the adapter, base or output and why."""


def fetch_adapter(adapter: str, cache_dir: str | Path, unverified: bool = False) -> tuple[Path, str | None]:
    """(verified local copy, manifest digest) of a LoRA adapter: a local folder or an ``s3://`` checkpoint.

    A folder without a manifest is accepted only with `unverified` (then its digest is None); a folder that is
    not a LoRA adapter (a full model, ...) is refused. MergeError says which and why."""
    from sao_core.training import lora  # torch and peft: imported when used, not by the CLI parser

    if not isinstance(adapter, str) or not adapter.strip():
        raise MergeError("adapter is empty: give a LoRA adapter folder or an s3:// adapter checkpoint")
    if storage.is_s3_uri(adapter):
        try:
            local = storage.fetch_checkpoint(adapter, Path(cache_dir) / "s3")
            digest: str | None = storage.checkpoint_digest(adapter)
        except storage.StorageError as err:
            raise MergeError(f"cannot fetch adapter {adapter}: {err}") from err
    else:
        local = Path(adapter.removeprefix("file://")).expanduser()
        if not local.is_dir():
            raise MergeError(f"adapter {adapter}: no such folder (give a LoRA adapter folder or an s3:// adapter "
                             "checkpoint)")
        digest = None
        if storage.has_manifest(local, f"adapter folder {adapter}", "merge", unverified, MergeError):
            try:
                storage.verify_checkpoint(local, allow_unlisted=unverified)
                digest = storage.checkpoint_digest(str(local))
            except storage.StorageError as err:
                raise MergeError(f"adapter {adapter} failed verification: {err}") from err
    if not lora.is_adapter_dir(local):
        what = " (it is a full model folder: evaluate or load it as the model itself)" \
            if (local / "config.json").is_file() else ""
        raise MergeError(f"{adapter} is not a LoRA adapter: no {lora.ADAPTER_CONFIG}{what}")
    try:
        lora.read_adapter(local)
    except ValueError as err:
        raise MergeError(f"adapter {adapter}: {err}") from err
    return local, digest


def _fit_error(err: Exception) -> str:
    """One line out of the complaint that an adapter does not fit a model: the adapter check's
    (`lora.AdapterMismatch`: its first problem, without the file, which the caller names), or peft's / torch's."""
    from sao_core.training.lora import AdapterMismatch

    if isinstance(err, AdapterMismatch):
        return err.summary()
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    mismatches = [line for line in lines if line.startswith("size mismatch")]
    if mismatches:
        more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
        return mismatches[0].rstrip(".") + more
    text = "; ".join(lines) or type(err).__name__
    return text if len(text) <= 500 else text[:500] + " ..."


def _named_base(adapter_dir: Path) -> str:
    """The base model an adapter says it was trained on: its manifest's ``base_model`` (what a LoRA run
    publishes), else peft's ``base_model_name_or_path``; "" when neither says."""
    import json

    from sao_core.training import lora

    for name, key in ((storage.MANIFEST_NAME, "metadata"), (lora.ADAPTER_CONFIG, None)):
        try:
            data = json.loads((adapter_dir / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        data = data.get(key) if key and isinstance(data, dict) else data
        field = "base_model" if key else "base_model_name_or_path"
        if isinstance(data, dict) and isinstance(data.get(field), str) and data[field]:
            return data[field]
    return ""


def _check_output(output: str, *inputs: Path) -> None:
    """Refuse a local output that is one of the inputs (or inside one), a file, or a folder holding other files."""
    if storage.is_s3_uri(output):
        storage.parse_s3_uri(output)
        return
    target = Path(output).expanduser().resolve()
    for given in inputs:
        source = given.resolve()
        if target == source or source in target.parents or target in source.parents:
            raise MergeError(f"output {output} overlaps the input {given}; give a new folder")
    if target.is_file():
        raise MergeError(f"output {output} is a file; give a folder (or an s3:// prefix)")
    if target.is_dir() and any(target.iterdir()) and not (target / storage.MANIFEST_NAME).is_file():
        raise MergeError(f"output {output} is a folder holding other files (not a checkpoint); give a new folder")


def merge_checkpoint(base: str, adapter: str, output: str, cache_dir: str | Path, dtype: str = "auto",
                     unverified: bool = False) -> dict[str, Any]:
    """Merge the LoRA adapter `adapter` (a folder or ``s3://`` checkpoint) into the model `base` (any model
    reference: embedded:tiny, a folder, s3://, a hub id) and publish the merged model at `output` (a folder or an
    ``s3://`` prefix) as a checkpoint: manifest metadata ``{"kind": "model", "base_model", "adapter",
    "adapter_sha256"}``. `dtype`: the merged weights' dtype (auto: the base's). `unverified` admits folders
    (adapter or base) without a manifest. Returns ``{"model": output, "sha256": the output's manifest digest,
    "base_model", "adapter", "adapter_sha256"}``. MergeError (a ValueError) or ModelLoadError say what is wrong;
    the adapter's config is checked before the base model is loaded (`lora.read_adapter`), the whole adapter
    against the base model's modules before peft touches it (`lora.merge_adapter_dir`)."""
    from sao_core.training import lora

    if dtype not in MERGE_DTYPES:
        raise MergeError(f"dtype must be one of {', '.join(MERGE_DTYPES)}, got {dtype!r}")
    if not isinstance(output, str) or not output.strip():
        raise MergeError("output is empty: give a folder or an s3:// prefix for the merged model")
    if not isinstance(base, str) or not base.strip():
        raise MergeError("base is empty: give the model the adapter was trained on")
    adapter_dir, adapter_digest = fetch_adapter(adapter, cache_dir, unverified)
    resolved = resolve_model(base, cache_dir, unverified)
    if resolved.gguf_file:
        raise MergeError(f"base model {base} is a GGUF file; a LoRA adapter merges into a Hugging Face model")
    base_dir = Path(resolved.path) if resolved.source != "huggingface" else None
    _check_output(output, adapter_dir, *([base_dir] if base_dir is not None else []))
    base_digest = None
    if base_dir is not None and storage.is_complete_checkpoint(str(base_dir)):
        base_digest = storage.checkpoint_digest(str(base_dir))
    named = _named_base(adapter_dir)
    if named and named not in (base, resolved.path):
        log.info("adapter %s names %s as its base model; merging it into %s", adapter, named, base)

    # Merge into a scratch folder: next to a local output (then sealed there and renamed into place), or in the
    # cache for an s3:// output (then published).
    local_output = not storage.is_s3_uri(output)
    if local_output:
        target = Path(output).expanduser()
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = target.parent / f".{target.name}.merge-{uuid.uuid4().hex[:8]}"
    else:
        (Path(cache_dir) / "scratch").mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="merge-", dir=Path(cache_dir) / "scratch")) / "model"
    metadata = {"kind": "model", "base_model": base, "adapter": adapter, "adapter_sha256": adapter_digest,
                "base_sha256": base_digest, "dtype": dtype}
    try:
        try:
            with warnings.catch_warnings():   # peft's note that the adapter names another base path (logged above)
                warnings.filterwarnings("ignore", message=r"The PEFT config's `base_model_name_or_path` was renamed")
                lora.merge_adapter_dir(resolved.path, adapter_dir, scratch, dtype=dtype)
        except OSError as err:
            raise ModelLoadError(f"cannot merge adapter {adapter} into base model {base}: {err}") from err
        except (ValueError, RuntimeError, KeyError) as err:
            hint = f" (the adapter names {named} as its base)" if named and named not in (base, resolved.path) else ""
            raise MergeError(f"adapter {adapter} does not fit base model {base}{hint}: {_fit_error(err)}") from err
        if local_output:
            storage.seal_checkpoint(scratch, metadata)
            if target.exists():
                storage.delete_checkpoint(str(target))
            scratch.replace(target)
        else:
            storage.publish_checkpoint(scratch, output, metadata=metadata)
    finally:
        shutil.rmtree(scratch if local_output else scratch.parent, ignore_errors=True)
    log.info("merged adapter %s into %s: %s", adapter, base, output)
    return {"model": output, "sha256": storage.checkpoint_digest(output), "base_model": base, "adapter": adapter,
            "adapter_sha256": adapter_digest}
