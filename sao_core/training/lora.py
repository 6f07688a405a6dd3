"""LoRA adapters on the training core, with the `peft` library (wrapped, not re-implemented).

`apply_lora` wraps a causal LM in a peft LoRA model: only the adapter's weights train (the optimiser is built
over the parameters that require a gradient, so it holds the adapter's states only). Checkpoints hold the adapter
and its optimiser states only (`training.checkpointing`: the base comes back from the run's model), and a resume
is exact. `apply_critic_lora` gives SAO's critic a LoRA body (its value head trains fully). `plain_state_dict` gives the weights
of the model with the adapter merged in (peft's own merge), under the base model's names: what an export
writes, a Hugging Face model any engine loads without peft.

An adapter on its own is a folder in peft's format (``adapter_config.json`` + ``adapter_model.safetensors``,
what `PeftModel.from_pretrained` and vLLM's LoRA loader read): `write_adapter` writes it from a training model,
`load_adapter_into` puts it into a live (inference) model, `merge_adapter_into` merges it into a plain model
(peft's merge): the RL learner publishes adapters to the rollout engines, `sao checkpoint merge` merges one.
"""

from __future__ import annotations

from typing import Any

import torch

#: peft's prefix of the base model's parameter names inside a PeftModel
_PEFT_PREFIX = "base_model.model."
#: the files of an adapter folder (peft's names)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def lora_config(rank: int, alpha: float, dropout: float, target_modules: str, task_type: str | None = "CAUSAL_LM"):
    """peft's LoraConfig for a causal LM (`task_type` None: any module, e.g. a critic's body). `target_modules`:
    "" for peft's default for the model's architecture, "all-linear" for every linear layer but the output
    head, or comma-separated module names."""
    from peft import LoraConfig

    targets: Any = None
    if target_modules.strip() == "all-linear":
        targets = "all-linear"
    elif target_modules.strip():
        targets = [name.strip() for name in target_modules.split(",") if name.strip()]
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type=task_type)


def apply_lora(model: torch.nn.Module, rank: int, alpha: float, dropout: float, target_modules: str,
               task_type: str | None = "CAUSAL_LM"):
    """`model` wrapped with a new LoRA adapter (its B matrices start at zero, so the wrapped model computes what
    `model` did); ValueError naming the setting when peft refuses the target modules."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, lora_config(rank, alpha, dropout, target_modules, task_type))
    except ValueError as err:
        raise ValueError(f"lora_target_modules {target_modules!r}: {err}") from None


def apply_lora_settings(model: torch.nn.Module, config):
    """`model` with the LoRA adapter of a training-core config (`lora_rank` 0: `model` unchanged), and a summary
    (rank, alpha, targets, trainable / all parameters; None without LoRA). ValueError naming the setting when
    peft refuses the target modules. Apply it before `prepare_model`: under torchrun FSDP2 then shards the
    wrapped model (frozen base and adapter alike; only the adapter gets gradients)."""
    if not config.lora_rank:
        return model, None
    model = apply_lora(model, config.lora_rank, config.lora_alpha, config.lora_dropout, config.lora_target_modules)
    trained, total = trainable_parameters(model)
    return model, {"rank": config.lora_rank, "alpha": config.lora_alpha,
                   "target_modules": config.lora_target_modules or "(peft default)",
                   "trainable_parameters": trained, "parameters": total}


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def has_adapter(model: torch.nn.Module) -> bool:
    """True when `model` or a part of it carries a LoRA adapter (a LoRA policy, a critic with a LoRA body)."""
    return any(".lora_" in name for name, _ in model.named_parameters())


def apply_critic_lora(critic, config):
    """SAO's critic with a LoRA adapter of rank `critic_lora_rank` on its body (the policy's alpha, dropout and
    targets); its value head, new at the start, trains fully. `critic_lora_rank` 0: `critic` unchanged."""
    if not config.critic_lora_rank:
        return critic
    critic.backbone = apply_lora(critic.backbone, config.critic_lora_rank, config.lora_alpha, config.lora_dropout,
                                 config.lora_target_modules, task_type=None)
    return critic


def merged_critic(critic, full: dict[str, torch.Tensor], initial, config):
    """A plain critic (no LoRA layers) holding the gathered weights `full` of `critic`, its body's adapter merged
    in by peft: what `ValueModel.save_pretrained` writes. `initial`: the resolved model the critic was built from
    (`ValueModel.from_reference`)."""
    from sao_core.models.value import ValueModel

    plain = apply_critic_lora(ValueModel.from_reference(initial), config)
    plain.load_state_dict(full, strict=True)
    if config.critic_lora_rank:
        plain.backbone = plain.backbone.merge_and_unload()
    return plain


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters that train, all parameters)."""
    return (sum(p.numel() for p in model.parameters() if p.requires_grad),
            sum(p.numel() for p in model.parameters()))


def base_names(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's weights out of a LoRA model's full state dict, under the base model's names."""
    return {name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", "."): tensor
            for name, tensor in full.items() if ".lora_" not in name}


def plain_model(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain causal LM (CPU) holding `full`, the gathered full state dict of `model`; for a LoRA model the
    adapter is merged in by peft and the names are the base model's. Built from the weights, not from the
    live model, so it works on sharded models too and leaves the live model as it was."""
    dtype = next(model.parameters()).dtype   # the training weights' (float32 master weights)
    if not is_lora(model):
        return model_holding(model.config, full, dtype)
    from peft import get_peft_model_state_dict

    adapter = get_peft_model_state_dict(model, state_dict=full)
    # Copies: the merge writes into the base weights, and `full` may hold the live model's own tensors.
    plain = model_holding(model.get_base_model().config, {k: v.clone() for k, v in base_names(full).items()}, dtype)
    return merge_adapter_into(plain, model.peft_config["default"], adapter)


def model_holding(config, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.nn.Module:
    """A causal LM of `config` whose weights are the tensors of `state` (assigned, not copied: the model shares
    them with `state`; those not in `dtype` converted). Built on the meta device: no random initialisation of weights that are replaced at
    once (at the Qwen3-1.7B shape that took 40 s of an 87 s push). For saving and merging: its non-persistent
    buffers (e.g. rotary frequencies) stay unallocated, so it cannot run a forward pass."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict({k: v if v.dtype == dtype or not v.is_floating_point() else v.to(dtype)
                           for k, v in state.items()}, strict=True, assign=True)
    if getattr(plain.config, "tie_word_embeddings", False):
        plain.tie_weights()
    return plain.eval()


def plain_state_dict(model: torch.nn.Module, state_dict_fn) -> dict[str, torch.Tensor]:
    """The model's full weights under the base model's names, the adapter merged in by peft for a LoRA model
    (`plain_model`). `state_dict_fn(model)` gathers the full state dict (FSDP-aware: a collective)."""
    full = state_dict_fn(model)
    if not is_lora(model):
        return full
    return {name: tensor.detach() for name, tensor in plain_model(model, full).state_dict().items()}


# ------------------------------------------------------------------------------------------ adapter folders
def adapter_state_dict(model: torch.nn.Module, state_dict_fn) -> dict[str, torch.Tensor]:
    """The adapter's weights of a LoRA training model under peft's file names (``base_model.model.…lora_A.weight``).
    `state_dict_fn(model)` gathers the parameters that train (FSDP-aware; a collective)."""
    from peft import get_peft_model_state_dict

    return {name: tensor.detach().contiguous()
            for name, tensor in get_peft_model_state_dict(model, state_dict=state_dict_fn(model)).items()}


def write_adapter(model: torch.nn.Module, adapter: dict[str, torch.Tensor], directory) -> None:
    """Write `adapter` (from `adapter_state_dict`) and the model's LoRA config as a peft adapter folder."""
    from pathlib import Path

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.peft_config["default"].save_pretrained(str(directory))
    save_file({k: v.cpu() for k, v in adapter.items()}, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def is_adapter_dir(directory) -> bool:
    """True for a peft adapter folder (it has ``adapter_config.json``)."""
    from pathlib import Path

    return (Path(directory) / ADAPTER_CONFIG).is_file()


def read_adapter(directory):
    """(LoraConfig, weights under peft's file names) of an adapter folder; ValueError saying what is wrong."""
    from pathlib import Path

    from peft import LoraConfig
    from safetensors.torch import load_file

    directory = Path(directory)
    if not is_adapter_dir(directory) or not (directory / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{directory} is not a LoRA adapter folder ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} expected)")
    try:
        config = LoraConfig.from_pretrained(str(directory))
    except Exception as err:   # peft raises several kinds for a config it cannot read
        raise ValueError(f"{directory / ADAPTER_CONFIG}: not a LoRA config ({err})") from None
    if getattr(config, "peft_type", None) is None or str(config.peft_type) not in ("LORA", "PeftType.LORA"):
        raise ValueError(f"{directory / ADAPTER_CONFIG}: peft_type {config.peft_type!r} is not LORA")
    return config, load_file(str(directory / ADAPTER_WEIGHTS))


def _set_adapter(model: torch.nn.Module, adapter: dict[str, torch.Tensor], where: str) -> None:
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, adapter)
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if result.unexpected_keys or missing:
        raise ValueError(f"{where}: the adapter does not fit this model: unexpected weights "
                         f"{result.unexpected_keys[:3]}, missing adapter weights {missing[:3]}")


def load_adapter_into(model: torch.nn.Module, directory) -> torch.nn.Module:
    """Put the adapter of `directory` into `model`, a plain causal LM used for inference: the first call
    injects LoRA layers with the adapter's config (peft's `inject_adapter_in_model`; the module stays the same
    object), later calls with the same config only copy the new adapter weights in (a few megabytes). The
    adapter is applied unmerged, as the learner computes it. ValueError when the config differs from the
    injected one or the weights do not fit the model."""
    from peft import inject_adapter_in_model

    config, weights = read_adapter(directory)
    adapter = {name.removeprefix(_PEFT_PREFIX): tensor for name, tensor in weights.items()}
    injected = getattr(model, "_sao_lora_config", None)
    if injected is None:
        inject_adapter_in_model(config, model)
        model._sao_lora_config = config.to_dict()
    elif _comparable(injected) != _comparable(config.to_dict()):
        raise ValueError(f"{directory}: its LoRA config differs from the adapter this model already carries "
                         f"(rank / alpha / targets must stay the same within a run)")
    _set_adapter(model, adapter, str(directory))
    return model


def _comparable(config: dict) -> dict:
    keys = ("r", "lora_alpha", "target_modules", "use_rslora", "bias", "modules_to_save")
    return {k: (sorted(v) if isinstance(v, list | set | tuple) else v) for k, v in config.items() if k in keys}


def merge_adapter_into(plain: torch.nn.Module, config, adapter: dict[str, torch.Tensor]) -> torch.nn.Module:
    """`plain` (a causal LM with the base weights) with the adapter merged into its weights by peft
    (`merge_and_unload`); the returned model has the base model's names and no LoRA layers."""
    from peft import get_peft_model

    wrapped = get_peft_model(plain, config)
    _set_adapter(wrapped, adapter, "adapter")
    return wrapped.merge_and_unload()


def merge_adapter_dir(base_dir, adapter_dir, output_dir, dtype: str = "auto") -> None:
    """Write the merged model (base + adapter, peft's merge) as a Hugging Face folder at `output_dir`
    (safetensors, config, the base's tokenizer files). `base_dir` a local model folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config, adapter = read_adapter(adapter_dir)
    kwargs = {} if dtype == "auto" else {"dtype": getattr(torch, dtype)}
    plain = AutoModelForCausalLM.from_pretrained(str(base_dir), **kwargs)
    merged = merge_adapter_into(plain, config, adapter)
    merged.save_pretrained(str(output_dir), safe_serialization=True)
    try:
        AutoTokenizer.from_pretrained(str(base_dir)).save_pretrained(str(output_dir))
    except (OSError, ValueError):   # a base without tokenizer files: the merged model has none either
        pass
