"""The shared trainer: one loop for every method (sft, cpt, dpo, gkd; the RL learners build on it).

Single process, or FSDP2 under torchrun (gloo on CPU, NCCL on GPU). Per optimiser step: the next
`batch_size` examples of a seeded, epoch-wise shuffled order (the data cursor is all that is needed to
resume it), split over ranks and `grad_accum` micro-batches; the core's precision (`training.core`); gradient clipping;
schedule with warm-up. Resumable checkpoints every `checkpoint_every` steps and at the end; the final
model is exported in Hugging Face format to ``<output>/model``; metrics go to ``<output>/metrics.jsonl``, and
the training report (``<output>/training_report.html``) is refreshed every `report_every` steps and at the end.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sao_core import storage
from sao_core.data.prepared import open_prepared
from sao_core.data.schemas import DataError
from sao_core.reporting.training import write_training_report
from sao_core.training.checkpointing import (
    export_hf_model,
    load_training_checkpoint,
    prune_checkpoints,
    save_training_checkpoint,
    step_name,
)
from sao_core.training.config import METHOD_CONFIGS, TrainConfig
from sao_core.training.core import autocast, build_optimizer, build_scheduler, clip_and_step, prepare_model
from sao_core.training.distributed import all_reduce_mean, barrier, init_distributed
from sao_core.training.live import run_sinks
from sao_core.training.lora import apply_lora_settings
from sao_core.training.metrics_log import MetricsLog

log = logging.getLogger(__name__)


class TrainingError(ValueError):
    """The job cannot start or continue; the message says what to change."""


class DataOrder:
    """Example indices in a seeded order that is reshuffled every epoch; position p is global."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed = size, seed
        self._epoch, self._perm = -1, None

    def take(self, cursor: int, count: int) -> list[int]:
        out = []
        for position in range(cursor, cursor + count):
            epoch = position // self.size
            if epoch != self._epoch:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._epoch, self._perm = epoch, torch.randperm(self.size, generator=g).tolist()
            out.append(self._perm[position % self.size])
        return out


def _local_run_dir(config: TrainConfig) -> Path:
    """Where metrics and staging live: the output itself, or a cache folder for s3:// outputs."""
    if storage.is_s3_uri(config.output):
        digest = hashlib.sha256(config.output.encode()).hexdigest()[:16]
        return Path(config.cache_dir) / "runs" / digest
    return Path(config.output)


def _check_config(method: str, config: TrainConfig) -> None:
    if method not in METHOD_CONFIGS:
        raise TrainingError(f"unknown method {method!r}; choose one of {', '.join(METHOD_CONFIGS)}")
    expected = METHOD_CONFIGS[method]
    if type(config) is not expected:
        raise TrainingError(f"method {method!r} takes a {expected.__name__}, got {type(config).__name__}")
    try:
        config.validate()
    except ValueError as err:
        raise TrainingError(str(err)) from err


def train(method: str, config: TrainConfig, progress: Callable[[int, dict], None] | None = None) -> dict[str, Any]:
    """Run a training job from a prepared dataset to an exported model; return its summary.

    Every check that can fail (method, config, dataset kind and rows, model, resume checkpoint) runs
    before the first step. `progress(step, metrics)` is called on rank 0 after every optimiser step.
    """
    from sao_core.models import load_model_and_tokenizer
    from sao_core.training.methods import METHODS

    _check_config(method, config)
    started = time.time()
    ctx = init_distributed()
    if config.batch_size % (ctx.world_size * config.grad_accum):
        raise TrainingError(f"batch_size {config.batch_size} must be a multiple of world_size × grad_accum "
                            f"= {ctx.world_size} × {config.grad_accum}")
    impl_cls = METHODS[method]
    try:
        prepared = open_prepared(config.data)
    except DataError as err:
        raise TrainingError(str(err)) from err
    rows, kind, data_uri = prepared.rows, prepared.kind, prepared.data_uri
    if kind is not None and kind != impl_cls.dataset_kind:
        raise TrainingError(f"method {method!r} needs a dataset prepared with --kind {impl_cls.dataset_kind}, "
                            f"but {data_uri} was prepared with --kind {kind}")

    checkpoints_uri = storage.join(config.output, "checkpoints")
    resume_from = storage.latest_checkpoint(checkpoints_uri)
    if resume_from and not config.resume:
        raise TrainingError(f"{config.output} already holds checkpoints (newest {resume_from}); pass resume=true "
                            "(--resume) to continue that run, or choose another output")
    local_resume = None
    if resume_from:
        try:
            local_resume = storage.fetch_checkpoint(resume_from, Path(config.cache_dir) / "s3")
        except storage.StorageError as err:
            raise TrainingError(f"cannot resume from {resume_from}: {err}") from err
        resume_state = json.loads((local_resume / "trainer_state.json").read_text())
        if resume_state.get("method") != method:
            raise TrainingError(f"{resume_from} belongs to a {resume_state.get('method')!r} run, not {method!r}")

    # Rank 0 resolves the model first so concurrent ranks never build or download the same cache entry.
    if ctx.is_main:
        model, tokenizer = load_model_and_tokenizer(config.model, config.cache_dir, unverified=config.unverified)
    barrier(ctx)
    if not ctx.is_main:
        model, tokenizer = load_model_and_tokenizer(config.model, config.cache_dir, unverified=config.unverified)

    torch.manual_seed(config.seed)
    impl = impl_cls(config, tokenizer, ctx)
    try:
        examples = impl.build_examples(rows, data_uri)
    except ValueError as err:
        raise TrainingError(str(err)) from err
    if not examples:
        raise TrainingError(f"{data_uri}: no trainable examples")
    n_eval = min(max(1, len(examples) // 20), 64) if len(examples) > 1 else 0
    eval_set, train_set = examples[:n_eval], examples[n_eval:] or examples

    model.to(ctx.device)
    precision = autocast(config.precision, ctx.device)
    with precision:  # reference log-probs (DPO) in the precision the policy trains in
        impl.setup(model, examples)
    # After setup: DPO's reference log-probs come from the base weights (the adapter starts at zero, so the base
    # model is the initial policy), and no second copy of the model is kept.
    try:
        model, lora_summary = apply_lora_settings(model, config)
    except ValueError as err:
        raise TrainingError(str(err)) from err
    if lora_summary:
        log.info("LoRA rank %d: %d of %d parameters train", config.lora_rank, lora_summary["trainable_parameters"],
                 lora_summary["parameters"])
    model = prepare_model(model, ctx, config.gradient_checkpointing)
    model.train()
    optimizer = build_optimizer(model.parameters(), config.lr, config.weight_decay)
    scheduler = build_scheduler(optimizer, config, config.steps)
    step, cursor = 0, 0
    if local_resume is not None:
        state = load_training_checkpoint(local_resume, {"model": (model, optimizer)}, ctx)
        scheduler.load_state_dict(state["scheduler"])
        step, cursor = int(state["step"]), int(state["cursor"])
        if ctx.is_main:
            log.info("resumed from %s at step %d", resume_from, step)

    local_run = _local_run_dir(config)
    local_run.mkdir(parents=True, exist_ok=True)
    order = DataOrder(len(train_set), config.seed)
    per_rank = config.batch_size // ctx.world_size
    micro = per_rank // config.grad_accum

    def evaluate() -> float | None:
        if not eval_set:
            return None
        model.eval()
        total = 0.0
        with torch.no_grad(), precision:
            for start in range(0, len(eval_set), micro):
                loss, _ = impl.loss(model, eval_set[start:start + micro], step, training=False)
                total += float(loss) * len(eval_set[start:start + micro])
        model.train()
        return total / len(eval_set)

    def trainer_state() -> dict[str, Any]:
        return {"method": method, "step": step, "cursor": cursor, "scheduler": scheduler.state_dict(),
                "config": dataclasses.asdict(config)}

    def checkpoint() -> str:
        uri = save_training_checkpoint(local_run / ".staging" / step_name(step),
                                       storage.join(checkpoints_uri, step_name(step)),
                                       {"model": (model, optimizer)}, trainer_state(), ctx)
        if ctx.is_main:   # only now, with a newer one complete, may older ones go
            prune_checkpoints(checkpoints_uri, config.keep_checkpoints, config.pin_checkpoints)
        return uri

    eval_before = evaluate()
    metrics_path = local_run / "metrics.jsonl"
    first_loss = last_loss = None
    tokens_total = 0.0
    # Resumed: the steps after the checkpoint are trained again, so their lines from the killed run go.
    with MetricsLog(config.output, metrics_path, resume=local_resume is not None, enabled=ctx.is_main,
                    keep_through=step, sinks=run_sinks(config, method)) as metrics_log:
        while step < config.steps:
            picked = order.take(cursor, config.batch_size)
            mine = picked[ctx.rank * per_rank:(ctx.rank + 1) * per_rank]
            optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            for i in range(config.grad_accum):
                batch = [train_set[j] for j in mine[i * micro:(i + 1) * micro]]
                with precision:
                    loss, metrics = impl.loss(model, batch, step, training=True, micro=i)
                (loss / config.grad_accum).backward()
                for key, value in {"loss": float(loss.detach()), **metrics}.items():
                    sums[key] = sums.get(key, 0.0) + value / config.grad_accum
            lr = scheduler.get_last_lr()[0]
            grad_norm = clip_and_step(optimizer, model.parameters(), config.grad_clip, scheduler)
            step += 1
            cursor += config.batch_size
            record = all_reduce_mean(sums, ctx)
            tokens_total += record.get("tokens", 0.0) * ctx.world_size
            record.update(step=step, lr=lr, seconds=time.time() - started, grad_norm=grad_norm)
            first_loss = record["loss"] if first_loss is None else first_loss
            last_loss = record["loss"]
            if ctx.is_main and (step % config.log_every == 0 or step == config.steps):
                metrics_log.append(record)
                metrics_log.sync()
            if ctx.is_main:   # every report_every steps (a failure only warns)
                write_training_report(config.output, metrics=metrics_path, config=config, method=method, step=step,
                                      every=config.report_every)
            if config.checkpoint_every and step % config.checkpoint_every == 0 and step < config.steps:
                checkpoint()
            if ctx.is_main and progress:
                progress(step, record)
    eval_after = evaluate()
    last_checkpoint = checkpoint()
    model_uri = storage.join(config.output, "model")
    export_hf_model(model, tokenizer, local_run / ".staging" / "model", model_uri,
                    {"method": method, "step": step, "base_model": config.model}, ctx)
    summary = {
        "method": method, "steps": step, "examples": len(train_set), "eval_examples": len(eval_set),
        "world_size": ctx.world_size, "first_train_loss": first_loss, "last_train_loss": last_loss,
        "eval_loss_before": eval_before, "eval_loss_after": eval_after, "trained_tokens": tokens_total,
        "resumed_from": resume_from, "checkpoint": last_checkpoint, "model": model_uri,
        "seconds": time.time() - started, "lora": lora_summary,
    }
    if ctx.is_main:
        (local_run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if storage.is_s3_uri(config.output):
            storage.upload_file(local_run / "summary.json", storage.join(config.output, "summary.json"))
        write_training_report(config.output, metrics=metrics_path, config=config, method=method, summary=summary)
    barrier(ctx)
    return summary
