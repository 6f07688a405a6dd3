"""Model building and loading: the embedded tiny model and loaders for paths, s3:// URIs and hub ids."""

from sao_core.models.embedded import TinyModelSpec, build_tiny_model
from sao_core.models.loading import (
    EMBEDDED_SMOLLM2,
    EMBEDDED_TINY,
    ENGINE_DTYPES,
    ModelLoadError,
    ResolvedModel,
    check_model_context,
    context_length_of,
    load_model,
    load_model_and_tokenizer,
    load_tokenizer,
    model_context_length,
    pad_token_id,
    resolve_dtype,
    resolve_model,
    verify_model_dir,
)

__all__ = [
    "EMBEDDED_SMOLLM2",
    "EMBEDDED_TINY",
    "ENGINE_DTYPES",
    "ModelLoadError",
    "ResolvedModel",
    "TinyModelSpec",
    "build_tiny_model",
    "check_model_context",
    "context_length_of",
    "load_model",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "model_context_length",
    "pad_token_id",
    "resolve_dtype",
    "resolve_model",
    "verify_model_dir",
]
