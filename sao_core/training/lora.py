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
An adapter from outside is checked before it touches a model (`check_adapter`: plain LoRA only, against the base
model's module names and shapes, nothing injected); the engines and the merge call it first.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    `state_dict_fn(model)` gathers the parameters that train (FSDP-aware; a collective). Only the adapter's own
    weights: peft would add the (frozen) base embedding when an embedding layer is targeted, which is the base's,
    not the adapter's, and which `check_adapter` refuses in an adapter."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, state_dict=state_dict_fn(model), save_embedding_layers=False)
    return {name: tensor.detach().contiguous() for name, tensor in state.items()}


def write_adapter(model: torch.nn.Module, adapter: dict[str, torch.Tensor], directory) -> None:
    """Write `adapter` (from `adapter_state_dict`) and the model's LoRA config as a peft adapter folder."""
    from pathlib import Path

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.peft_config["default"].save_pretrained(str(directory))
    save_file({k: v.cpu() for k, v in adapter.items()}, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def adapter_config(model: torch.nn.Module) -> dict:
    """The model's LoRA config as its adapter folder's ``adapter_config.json`` holds it (`write_adapter`): plain
    JSON values, a set of target modules as a sorted list."""
    import json

    config = model.peft_config["default"].to_dict()
    return json.loads(json.dumps({key: sorted(value) if isinstance(value, set) else value
                                  for key, value in config.items()}))


def is_adapter_dir(directory) -> bool:
    """True for a peft adapter folder (it has ``adapter_config.json``)."""
    from pathlib import Path

    return (Path(directory) / ADAPTER_CONFIG).is_file()


# ------------------------------------------------------------------------------- checking an adapter first
# An adapter comes from outside (a learner's push, a published checkpoint, a user's folder). peft trusts its
# config: some options rewrite the base weights or the architecture when the adapter is injected (PiSSA / OLoRA /
# LoftQ / EVA / CorDA initialisation, DoRA, layer replication, modules_to_save, trainable tokens), some strings
# are regular expressions peft matches against every module name (a catastrophic pattern freezes the process),
# and peft's matching of a list of target names is quadratic. So an adapter is checked against the base model's
# module names and shapes, without injecting anything, before it touches a model (`check_adapter`): only plain
# LoRA on Linear / Embedding layers, with exactly the weights those layers need, passes.

#: the largest LoRA rank an adapter may have (also bounded by the smallest dimension of each layer it adapts)
MAX_LORA_RANK = 1024
#: the largest lora_alpha (it must be > 0; the adapter's scale is alpha / r, or alpha / sqrt(r) with use_rslora)
MAX_LORA_ALPHA = 4096.0
#: the most names `target_modules` may list. peft's injection is quadratic in it (measured, peft 0.21 on the
#: embedded model: 1024 names 0.1 s, 4096 1.5 s, 16384 31 s); 1024 covers "all-linear" (which peft saves as every
#: linear layer's full name, 7 a layer) on a dense model of up to 146 layers
MAX_TARGET_MODULES = 1024
#: the longest module name `target_modules` may give
MAX_MODULE_NAME = 200
#: a plain module name (dotted identifiers): linear to match even where peft reads it as a regular expression
_PLAIN_NAME = r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*"
#: `init_lora_weights` values that only initialise the adapter's own matrices (overwritten by its weights)
_PLAIN_INITS = (True, False, "gaussian")
#: dtypes of adapter weights (safetensors' names and torch's)
_ADAPTER_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
#: config keys that describe the adapter and change nothing when it is applied (peft ignores runtime_config
#: when it reads a file)
_METADATA_KEYS = ("base_model_name_or_path", "revision", "peft_version", "auto_mapping", "inference_mode",
                  "runtime_config")
#: options refused when set, and why (every other unknown option is refused when set, too)
_REFUSED = {
    "use_dora": "DoRA adds magnitude vectors that rewrite every adapted layer; the engines and the merge apply "
                "plain LoRA only",
    "layer_replication": "it duplicates layers of the base model (another architecture)",
    "modules_to_save": "it replaces whole modules of the base model with the adapter's copies",
    "trainable_token_indices": "it replaces rows of the base model's embedding",
    "target_parameters": "it adapts raw parameters, not layers",
    "rank_pattern": "per-module ranks are not supported (and peft reads its keys as regular expressions)",
    "alpha_pattern": "per-module alphas are not supported (and peft reads its keys as regular expressions)",
    "exclude_modules": "peft reads it as a regular expression; give target_modules as a list of names instead",
    "layers_to_transform": "give the adapted modules in target_modules instead",
    "layers_pattern": "peft reads it as a regular expression; give target_modules as a list of names instead",
    "lora_bias": "it adds a bias to the adapted layers, which the adapter's weights do not describe",
    "use_qalora": "QA-LoRA is for quantised base models",
    "alora_invocation_tokens": "activated LoRA changes how the model runs, not only its weights",
    "megatron_config": "Megatron layers are not supported",
    "loftq_config": "LoftQ rewrites the base weights",
    "eva_config": "EVA initialisation is computed from data on the live model",
    "corda_config": "CorDA rewrites the base weights",
}


class AdapterMismatch(ValueError):
    """An adapter whose weights (or targets) do not fit the base model: `problems` lists them, `where` the file."""

    def __init__(self, where: str, problems: list[str]):
        self.where, self.problems = where, problems
        super().__init__(f"{where}: the adapter does not fit the base model: {self.summary()}")

    def summary(self) -> str:
        """The first problem, and how many more there are."""
        more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return self.problems[0] + more


@dataclass(frozen=True)
class BaseModule:
    """A module of the base model as an adapter sees it. `kind`: "linear" (torch's Linear), "conv1d"
    (transformers' Conv1D, its weight stored transposed), "embedding", or the class name of anything else (which
    no adapter may target). `in_features` / `out_features`: an embedding's vocabulary size / width."""

    kind: str
    in_features: int = 0
    out_features: int = 0


def _describe(module: torch.nn.Module) -> BaseModule:
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, torch.nn.Linear):
        return BaseModule("linear", module.in_features, module.out_features)
    if isinstance(module, Conv1D):   # GPT-2 style: weight (in, out)
        return BaseModule("conv1d", module.weight.shape[0], module.weight.shape[1])
    if isinstance(module, torch.nn.Embedding):
        return BaseModule("embedding", module.num_embeddings, module.embedding_dim)
    return BaseModule(type(module).__name__)


def base_modules(model: torch.nn.Module) -> dict[str, BaseModule]:
    """name -> `BaseModule` of every module of `model` (the names peft matches `target_modules` against). A model
    already carrying LoRA layers is described as its base: each LoRA layer as the layer it wraps, its own
    sub-modules left out. Reads names and shapes only (works on the meta device)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    table: dict[str, BaseModule] = {}
    inside: str | None = None   # the prefix of the LoRA layer being walked (named_modules is depth-first)
    for name, module in model.named_modules():
        if inside is not None and name.startswith(inside):
            continue
        inside = None
        if isinstance(module, BaseTunerLayer):
            inside = name + "."
            module = module.get_base_layer()
        table[name] = _describe(module)
    return table


def base_modules_of_folder(model_dir) -> dict[str, BaseModule]:
    """`base_modules` of the model in the Hugging Face folder `model_dir`, built from its config on the meta
    device (no weights read: fast at any size)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return base_modules(model)


def _refuse(where: str, field: str, value, why: str):
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise ValueError(f"{where}: {field} {shown} is refused: {why}")


def _is_number(value) -> bool:
    import math

    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_unset(value) -> bool:
    """None, False, or empty: how an option that is not used is written."""
    return value is None or value is False or (isinstance(value, str | list | dict | tuple) and not value)


def _check_target_modules(where: str, targets) -> None:
    """A list (at most MAX_TARGET_MODULES) of plain module names, or one plain name; never a regular expression
    (peft matches a string as one against every module name)."""
    import re

    if isinstance(targets, str):
        if len(targets) > MAX_MODULE_NAME or not re.fullmatch(_PLAIN_NAME, targets):
            _refuse(where, "target_modules", targets, "a string is read by peft as a regular expression; give a "
                                                      "list of module names")
        return
    if not isinstance(targets, list) or not targets:
        _refuse(where, "target_modules", targets, "give the adapted modules as a non-empty list of module names")
    if len(targets) > MAX_TARGET_MODULES:
        raise ValueError(f"{where}: target_modules lists {len(targets)} names, more than {MAX_TARGET_MODULES} "
                         "(MAX_TARGET_MODULES)")
    for name in targets:
        if not isinstance(name, str) or len(name) > MAX_MODULE_NAME or not re.fullmatch(_PLAIN_NAME, name):
            _refuse(where, "target_modules entry", name, "not a plain module name")


def check_adapter_config(config: dict, where: str = ADAPTER_CONFIG):
    """peft's `LoraConfig` of the parsed ``adapter_config.json`` `config` after checking it on its own (no base
    model needed): plain LoRA only, bounded sizes, nothing that rewrites base weights or the architecture, no
    regular expressions; every option this check does not know must be unset. ValueError naming the field and
    `where` (the file) otherwise. The raw dict is checked before peft builds its config from it, so a hostile
    value never reaches peft."""
    import dataclasses

    from peft import LoraConfig

    if not isinstance(config, dict):
        raise ValueError(f"{where}: not a LoRA config (a JSON object expected)")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not LORA")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        _refuse(where, "task_type", config["task_type"], "only CAUSAL_LM adapters apply to a causal LM")
    _check_target_modules(where, config.get("target_modules"))
    r = config.get("r", 8)
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= MAX_LORA_RANK:
        _refuse(where, "r", r, f"the rank must be an integer in [1, {MAX_LORA_RANK}] (MAX_LORA_RANK)")
    alpha = config.get("lora_alpha", 8)
    if not _is_number(alpha) or not 0 < alpha <= MAX_LORA_ALPHA:
        _refuse(where, "lora_alpha", alpha, f"must be a number in (0, {MAX_LORA_ALPHA:g}] (MAX_LORA_ALPHA)")
    dropout = config.get("lora_dropout", 0.0)
    if not _is_number(dropout) or not 0 <= dropout < 1:
        _refuse(where, "lora_dropout", dropout, "must be a number in [0, 1)")
    init = config.get("init_lora_weights", True)
    if not any(init is plain or (isinstance(plain, str) and init == plain) for plain in _PLAIN_INITS):
        _refuse(where, "init_lora_weights", init, "only true, false or \"gaussian\" (which initialise the adapter's "
                                                  "own matrices) are accepted; other methods rewrite the base weights")
    if config.get("bias", "none") != "none":
        _refuse(where, "bias", config["bias"], "an adapter may not train the base model's biases (\"none\" only)")
    for flag in ("use_rslora", "fan_in_fan_out"):
        if not isinstance(config.get(flag, False), bool):
            _refuse(where, flag, config[flag], "must be true or false")

    fields = {f.name: f for f in dataclasses.fields(LoraConfig)}
    checked = {"peft_type", "task_type", "target_modules", "r", "lora_alpha", "lora_dropout", "init_lora_weights",
               "bias", "use_rslora", "fan_in_fan_out"}
    for key, value in config.items():
        if key in checked or key in _METADATA_KEYS:
            continue
        if key in _REFUSED:
            if not _is_unset(value):
                _refuse(where, key, value, _REFUSED[key])
            continue
        if key not in fields:
            if not _is_unset(value):
                _refuse(where, key, value, "an option this version does not know")
            continue
        field = fields[key]
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        if value != default and not (_is_unset(value) and _is_unset(default)):
            _refuse(where, key, value, f"an option this check does not support (only its default {default!r})")
    try:
        return LoraConfig(**{k: v for k, v in config.items() if k in fields and k != "runtime_config"})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: not a LoRA config ({err})") from None


def _targeted(config, base: dict[str, BaseModule]) -> dict[str, BaseModule]:
    """The modules of `base` peft would adapt with `config` (peft's own matching, safe on a checked config)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    return {name: module for name, module in base.items() if name and check_target_module_exists(config, name)}


def expected_weights(config, base: dict[str, BaseModule]) -> dict[str, tuple[int, ...]]:
    """name (peft's file names) -> shape of every weight an adapter with `config` must hold for `base`."""
    r, shapes = int(config.r), {}
    for name, module in _targeted(config, base).items():
        prefix = _PEFT_PREFIX + name
        if module.kind == "embedding":
            shapes[prefix + ".lora_embedding_A"] = (r, module.in_features)
            shapes[prefix + ".lora_embedding_B"] = (module.out_features, r)
        else:
            shapes[prefix + ".lora_A.weight"] = (r, module.in_features)
            shapes[prefix + ".lora_B.weight"] = (module.out_features, r)
    return shapes


def _check_against_base(config, base: dict[str, BaseModule], where: str) -> None:
    """The config's targets exist in `base`, are layers LoRA adapts (Linear, Conv1D, Embedding), take its rank
    and its fan_in_fan_out."""
    targeted = _targeted(config, base)
    if not targeted:
        names = sorted(config.target_modules) if isinstance(config.target_modules, set | list) \
            else [config.target_modules]
        raise AdapterMismatch(where, ["Target modules {" + ", ".join(repr(n) for n in names) + "} not found in "
                                      "the base model"])
    problems = []
    for name, module in targeted.items():
        if module.kind not in ("linear", "conv1d", "embedding"):
            problems.append(f"target module {name} is a {module.kind}, not a Linear or Embedding layer")
        elif config.r > min(module.in_features, module.out_features):
            problems.append(f"r {config.r} exceeds the smallest dimension "
                            f"({min(module.in_features, module.out_features)}) of the target module {name}")
        elif config.fan_in_fan_out != (module.kind == "conv1d"):
            problems.append(f"fan_in_fan_out {config.fan_in_fan_out} does not fit the target module {name} (a "
                            f"{module.kind}: fan_in_fan_out must be {module.kind == 'conv1d'})")
    if problems:
        raise AdapterMismatch(where, problems)


def _check_layout(config, layout: dict[str, tuple[tuple[int, ...], Any]], base: dict[str, BaseModule] | None,
                  where: str) -> None:
    """The adapter's weights (name -> (shape, dtype)): floating point; with `base`, exactly the names and shapes
    `expected_weights` gives (shape problems first, in name order)."""
    problems = [f"{name} has dtype {dtype}, not a floating point type" for name, (_, dtype) in sorted(layout.items())
                if dtype not in _ADAPTER_DTYPES.values()]
    if base is not None:
        expected = expected_weights(config, base)
        for name in sorted(set(expected) & set(layout)):
            if tuple(layout[name][0]) != expected[name]:
                problems.append(f"size mismatch for {name}: the adapter has torch.Size({list(layout[name][0])}), "
                                f"the base model needs torch.Size({list(expected[name])})")
        problems += [f"missing adapter weight {name}" for name in sorted(set(expected) - set(layout))]
        problems += [f"unexpected weight {name} (not a LoRA weight of a targeted module)"
                     for name in sorted(set(layout) - set(expected))]
    if problems:
        raise AdapterMismatch(where, problems)


def check_adapter(config: dict, tensors: dict[str, torch.Tensor], base, where: str = "adapter"):
    """peft's `LoraConfig` of an adapter after checking it, before it touches any model: `config` the parsed
    ``adapter_config.json`` (`check_adapter_config`), `tensors` its weights under peft's file names, `base` the
    base model (a module, or its `base_modules`; None: the checks that need no base model only). With a base:
    the targets exist and are Linear / Embedding layers the rank fits, and the weights are exactly the LoRA
    weights of the targeted modules, with their shapes. Always: floating point weights, no NaN / inf. ValueError
    (AdapterMismatch for weights that do not fit) naming the field or tensor and `where`."""
    lora = check_adapter_config(config, f"{where}/{ADAPTER_CONFIG}")
    if isinstance(base, torch.nn.Module):
        base = base_modules(base)
    if base is not None:
        _check_against_base(lora, base, f"{where}/{ADAPTER_CONFIG}")
    weights_file = f"{where}/{ADAPTER_WEIGHTS}"
    _check_layout(lora, {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}, base, weights_file)
    bad = [name for name, tensor in sorted(tensors.items()) if not bool(torch.isfinite(tensor).all())]
    if bad:
        raise ValueError(f"{weights_file}: the adapter weight {bad[0]} holds NaN or inf"
                         + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    return lora


def _read_config(directory) -> dict:
    import json

    path = directory / ADAPTER_CONFIG
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:   # unreadable, not UTF-8, not JSON
        raise ValueError(f"{path}: not a LoRA config ({err})") from None


def _header_layout(path) -> dict[str, tuple[tuple[int, ...], Any]]:
    """name -> (shape, dtype) of the tensors of a safetensors file, from its header (no weights read)."""
    from safetensors import safe_open

    layout = {}
    with safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118  (safe_open is not a mapping)
            part = handle.get_slice(name)
            layout[name] = (tuple(part.get_shape()), _ADAPTER_DTYPES.get(part.get_dtype(), part.get_dtype()))
    return layout


def check_adapter_dir(directory, base) -> tuple[Any, dict[str, torch.Tensor]]:
    """(LoraConfig, weights under peft's file names) of the adapter folder `directory` after `check_adapter`
    against `base` (a module, its `base_modules`, or None). The config is checked before the weights file is
    opened, and the weights' names and shapes (from the file's header) before they are read. ValueError saying
    what is wrong and where."""
    from pathlib import Path

    from safetensors.torch import load_file

    directory = Path(directory)
    if not is_adapter_dir(directory) or not (directory / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{directory} is not a LoRA adapter folder ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} expected)")
    raw = _read_config(directory)
    config = check_adapter_config(raw, str(directory / ADAPTER_CONFIG))
    if isinstance(base, torch.nn.Module):
        base = base_modules(base)
    if base is not None:
        _check_against_base(config, base, str(directory / ADAPTER_CONFIG))
    try:
        _check_layout(config, _header_layout(directory / ADAPTER_WEIGHTS), base, str(directory / ADAPTER_WEIGHTS))
        weights = load_file(str(directory / ADAPTER_WEIGHTS))
    except ValueError:
        raise
    except Exception as err:   # safetensors' own errors for a damaged file
        raise ValueError(f"{directory / ADAPTER_WEIGHTS}: not a readable safetensors file ({type(err).__name__}: "
                         f"{err})") from None
    # again on what was read: the file may have changed since its header was read
    return check_adapter(raw, weights, base, str(directory)), weights


def read_adapter(directory):
    """(LoraConfig, weights under peft's file names) of an adapter folder, checked on its own (`check_adapter`
    without a base model: the config, floating point and finite weights); ValueError saying what is wrong."""
    return check_adapter_dir(directory, None)


# ------------------------------------------------------------------------------- applying a checked adapter
def _set_adapter(model: torch.nn.Module, adapter: dict[str, torch.Tensor], where: str) -> None:
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, adapter)
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if result.unexpected_keys or missing:
        raise ValueError(f"{where}: the adapter does not fit this model: unexpected weights "
                         f"{result.unexpected_keys[:3]}, missing adapter weights {missing[:3]}")


def _remove_lora_layers(model: torch.nn.Module) -> None:
    """Put back the layer each LoRA layer of `model` wraps (undoes peft's injection; the base layers are the
    same objects, untouched)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if name and isinstance(module, BaseTunerLayer):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            if getattr(parent, child, None) is module:   # not inside another LoRA layer already removed
                setattr(parent, child, module.get_base_layer())


def _inject(model: torch.nn.Module, config, adapter: dict[str, torch.Tensor], where: str) -> None:
    """First adapter: inject LoRA layers and fill them; on any failure the model gets its own layers, attributes
    and requires_grad flags back (injection only adds layers around the untouched base layers)."""
    from peft import inject_adapter_in_model

    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    had_peft_config = hasattr(model, "peft_config")
    try:
        inject_adapter_in_model(config, model)
        _set_adapter(model, adapter, where)
    except BaseException:
        _remove_lora_layers(model)
        if not had_peft_config and hasattr(model, "peft_config"):
            del model.peft_config
        for name, p in model.named_parameters():
            p.requires_grad_(flags.get(name, p.requires_grad))
        raise
    model._sao_lora_config = config.to_dict()


def _replace_weights(model: torch.nn.Module, adapter: dict[str, torch.Tensor], where: str) -> None:
    """Later adapters: copy the new weights in; on any failure (a copy may stop half way) the previous adapter's
    weights are copied back."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    previous = {name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(model).items()}
    try:
        _set_adapter(model, adapter, where)
    except BaseException:
        set_peft_model_state_dict(model, previous)
        raise


def put_adapter_into(model: torch.nn.Module, config, weights: dict[str, torch.Tensor], where: str) -> None:
    """Put a checked adapter (`check_adapter_dir`: its LoraConfig and weights) into `model`, a plain causal LM
    used for inference, transactionally: when this raises, `model` is as it was. The first adapter injects
    LoRA layers (peft's `inject_adapter_in_model`; the module stays the same object), later ones with the same
    config only copy their weights in. ValueError when the config differs from the injected one."""
    adapter = {name.removeprefix(_PEFT_PREFIX): tensor for name, tensor in weights.items()}
    injected = getattr(model, "_sao_lora_config", None)
    if injected is None:
        _inject(model, config, adapter, where)
    elif _comparable(injected) != _comparable(config.to_dict()):
        raise ValueError(f"{where}: its LoRA config differs from the adapter this model already carries "
                         f"(rank / alpha / targets must stay the same within a run)")
    else:
        _replace_weights(model, adapter, where)


def load_adapter_into(model: torch.nn.Module, directory) -> torch.nn.Module:
    """Put the adapter of `directory` into `model`, a plain causal LM used for inference, after checking it
    against the model's base modules (`check_adapter_dir`); applied unmerged, as the learner computes it
    (`put_adapter_into`). ValueError, `model` unchanged, when the adapter is refused or does not fit."""
    config, weights = check_adapter_dir(directory, base_modules(model))
    put_adapter_into(model, config, weights, str(directory))
    return model


def _comparable(config: dict) -> dict:
    keys = ("r", "lora_alpha", "target_modules", "use_rslora", "bias", "modules_to_save", "fan_in_fan_out")
    return {k: (sorted(v) if isinstance(v, list | set | tuple) else v) for k, v in config.items() if k in keys}


def merge_adapter_into(plain: torch.nn.Module, config, adapter: dict[str, torch.Tensor]) -> torch.nn.Module:
    """`plain` (a causal LM with the base weights) with the adapter merged into its weights by peft
    (`merge_and_unload`); the returned model has the base model's names and no LoRA layers. For an adapter from
    outside, check it first (`merge_adapter_dir` does)."""
    from peft import get_peft_model

    wrapped = get_peft_model(plain, config)
    _set_adapter(wrapped, adapter, "adapter")
    return wrapped.merge_and_unload()


def merge_adapter_dir(base_dir, adapter_dir, output_dir, dtype: str = "auto") -> None:
    """Write the merged model (base + adapter, peft's merge) as a Hugging Face folder at `output_dir`
    (safetensors, config, the base's tokenizer files). `base_dir` a local model folder. The adapter is checked
    against the base model's modules (`check_adapter_dir`) before peft wraps the base; ValueError if refused."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {} if dtype == "auto" else {"dtype": getattr(torch, dtype)}
    plain = AutoModelForCausalLM.from_pretrained(str(base_dir), **kwargs)
    config, adapter = check_adapter_dir(adapter_dir, base_modules(plain))
    merged = merge_adapter_into(plain, config, adapter)
    merged.save_pretrained(str(output_dir), safe_serialization=True)
    try:
        AutoTokenizer.from_pretrained(str(base_dir)).save_pretrained(str(output_dir))
    except (OSError, ValueError):   # a base without tokenizer files: the merged model has none either
        pass
