"""The SAO critic: a causal-LM backbone (without its LM head) and a zero-initialised scalar value head.

Position alignment: ``values[:, t]`` is the value of the state *before* token t, i.e. the head applied to
the hidden state at position t − 1, and ``values[:, 0]`` is 0. This is the alignment of `token_logprobs`
(the log-prob at position t is predicted from position t − 1), so values, log-probs and advantages of one
token share an index.

On disk a critic is a Hugging Face directory of the backbone (``config.json`` and weights, loadable with
``transformers.AutoModel``) plus ``value_head.safetensors`` and ``sao_value_model.json``. A plain causal-LM
directory (the policy's initial checkpoint) also loads: the backbone comes from it, the head is fresh; so does
a GGUF file in a directory (`gguf_file`). `ValueModel.from_reference` builds the critic from any model reference
(`sao_core.models.resolve_model`: embedded, GGUF, local, s3://, Hugging Face id).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from sao_core.models.loading import ResolvedModel

HEAD_FILE = "value_head.safetensors"
META_FILE = "sao_value_model.json"
FORMAT_VERSION = 1
ATTENTION_MARKER = "self_attn"


class ValueModel(nn.Module):
    """Backbone + ``value_head = nn.Linear(hidden_size, 1)`` (weight and bias zero at initialisation).

    The head always runs in float32 on float32 hidden states, whatever the backbone's dtype.
    """

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        hidden_size = getattr(getattr(backbone, "config", None), "hidden_size", None)
        if not isinstance(hidden_size, int):
            raise ValueError("the backbone has no config.hidden_size")
        self.backbone = backbone
        self.hidden_size = hidden_size
        self.value_head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):
        """The backbone's `transformers` config."""
        return self.backbone.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Values of the states before each token.

        Args:
            input_ids: [B, T] token ids.
            attention_mask: [B, T] 1 on real tokens (None: all ones).

        Returns:
            [B, T] float32; position 0 is 0 and position t ≥ 1 is head(hidden[:, t − 1]), which depends only
            on tokens before t.
        """
        if input_ids.dim() != 2 or (attention_mask is not None and attention_mask.shape != input_ids.shape):
            raise ValueError(f"expected input_ids [B, T] and attention_mask [B, T], got {tuple(input_ids.shape)} "
                             f"and {None if attention_mask is None else tuple(attention_mask.shape)}")
        outputs = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        hidden = outputs.last_hidden_state[:, :-1].float()
        values = self.value_head(hidden).squeeze(-1)
        return torch.cat([values.new_zeros(values.shape[0], 1), values], dim=1)

    def freeze_attention(self) -> int:
        """Freeze the attention blocks (the paper trains only the non-attention weights of the critic).

        Attention parameters are those whose name contains ``self_attn`` (q/k/v/o projections and any
        attention norms in Llama, Qwen2/3, Mistral and similar; layer norms around the block and the MLPs
        stay trainable). Returns the number of parameter tensors frozen; raises ValueError when the
        backbone has none, rather than silently freezing nothing.
        """
        frozen = 0
        for name, parameter in self.backbone.named_parameters():
            if ATTENTION_MARKER in name:
                parameter.requires_grad_(False)
                frozen += 1
        if frozen == 0:
            raise ValueError(f"no parameter name contains {ATTENTION_MARKER!r}; cannot freeze attention of "
                             f"{type(self.backbone).__name__}")
        return frozen

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        """Passthrough to the backbone's `gradient_checkpointing_enable`."""
        self.backbone.gradient_checkpointing_enable(**kwargs)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write the backbone (Hugging Face format), ``value_head.safetensors`` and ``sao_value_model.json``."""
        from safetensors.torch import save_file

        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(path)
        head = {name: tensor.detach().to("cpu", torch.float32).contiguous()
                for name, tensor in self.value_head.state_dict().items()}
        save_file(head, str(path / HEAD_FILE))
        (path / META_FILE).write_text(json.dumps({"format": FORMAT_VERSION, "hidden_size": self.hidden_size},
                                                 indent=2) + "\n")
        return path

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype | str = torch.float32,
                        gguf_file: str | None = None) -> ValueModel:
        """Load a saved critic, or a plain causal-LM directory with a fresh zero head.

        Args:
            directory: a directory written by `save_pretrained`, or a Hugging Face causal-LM directory.
            dtype: backbone dtype (a torch dtype or its name, e.g. "bfloat16"); the head stays float32.
            gguf_file: the name of a GGUF file in `directory` to take the backbone from (config and weights,
                dequantised by transformers); the directory then needs no config.json.

        Raises:
            ValueError: the directory is missing, is neither kind, or its value head does not fit.
        """
        return cls._load(str(directory), dtype, gguf_file, local=True)

    @classmethod
    def from_reference(cls, model: ResolvedModel, dtype: torch.dtype | str = torch.float32) -> ValueModel:
        """SAO's initial critic from a resolved model reference (`sao_core.models.resolve_model`): the body of
        the causal LM it names with a fresh zero head (or a saved critic), whatever the source: the embedded
        tiny model, SmolLM2's GGUF (its `gguf_file`), a local or an ``s3://`` checkpoint (fetched into the cache
        by `resolve_model`), a Hugging Face id (resolved by transformers: its local cache or the hub). The same
        files the policy is loaded from (`load_model`), so the critic's body starts equal to the policy's.

        Raises:
            ValueError: as `from_pretrained`; for a hub id also when transformers cannot get it.
        """
        return cls._load(model.path, dtype, model.gguf_file, local=model.source != "huggingface")

    @classmethod
    def _load(cls, location: str, dtype: torch.dtype | str, gguf_file: str | None, local: bool) -> ValueModel:
        """The one loader: `location` a local directory (`local`) or a Hugging Face id."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        from transformers import AutoModel

        path = Path(location)
        if isinstance(dtype, str):
            resolved = getattr(torch, dtype, None)
            if not isinstance(resolved, torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
            dtype = resolved
        meta_path = path / META_FILE
        is_critic = local and meta_path.is_file()
        weights = gguf_file or "config.json"
        if local and (not path.is_dir() or not (is_critic or (path / weights).is_file())):
            raise ValueError(f"{path} is neither a saved ValueModel directory ({META_FILE}) nor a Hugging Face "
                             f"causal-LM directory ({weights})")
        meta = None
        if is_critic:
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise ValueError(f"{meta_path}: unreadable value-model metadata: {err}") from err
            if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
                raise ValueError(f"{meta_path}: unsupported value-model format {meta!r} (expected format "
                                 f"{FORMAT_VERSION})")
        kwargs = {"dtype": dtype, **({"gguf_file": gguf_file} if gguf_file else {})}
        try:
            backbone = AutoModel.from_pretrained(location, **kwargs)
        except (OSError, ValueError, KeyError) as err:
            source = f"{gguf_file} in {location}" if gguf_file else location
            raise ValueError(f"cannot load a backbone from {source}: {err}") from err
        if gguf_file:
            backbone = _dense(backbone, dtype, f"{gguf_file} in {location}")
        model = cls(backbone)
        if meta is not None:
            if meta.get("hidden_size") != model.hidden_size:
                raise ValueError(f"{path}: value head hidden_size {meta.get('hidden_size')} does not match the "
                                 f"backbone's {model.hidden_size}")
            try:
                head = load_file(str(path / HEAD_FILE))
                model.value_head.load_state_dict(head)
            except (OSError, RuntimeError, SafetensorError) as err:
                raise ValueError(f"{path}: cannot load {HEAD_FILE}: {err}") from err
        return model


def _dense(model: nn.Module, dtype: torch.dtype, source: str) -> nn.Module:
    """`model`, loaded from a GGUF file, as a plain model of its architecture holding the same tensors. transformers
    5.18 and 5.19 mark a model they loaded from a GGUF file as quantised (`hf_quantizer`,
    `config.quantization_config`) even when every weight was dequantised, and then refuse to save it (5.16 and
    5.17 do not); the critic is trained and saved, so it must be a plain model. Built on the meta device and given
    `model`'s tensors (no random initialisation of weights that are replaced at once). Raises ValueError when the
    weights are not dense (left in GGUF blocks)."""
    import copy
    from itertools import chain

    from transformers import AutoModel

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    with torch.device("meta"):
        plain = AutoModel.from_config(config, dtype=dtype)
    try:
        plain.load_state_dict(model.state_dict(), strict=True, assign=True)
    except RuntimeError as err:
        raise ValueError(f"the weights of {source} did not load as dense weights, which the critic trains: {err}") \
            from err
    for name, buffer in model.named_buffers():   # the non-persistent ones (rotary frequencies) are not in the state dict
        owner, _, leaf = name.rpartition(".")
        setattr(plain.get_submodule(owner), leaf, buffer)
    if any(t.is_meta for t in chain(plain.parameters(), plain.buffers())):
        raise ValueError(f"{source}: the critic's body has tensors that {type(model).__name__} did not provide")
    return plain.train(model.training)
