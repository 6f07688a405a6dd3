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
    from sao_core.training.methods import METHODS

    _check_config(method, config)
    started = time.time()
    ctx = init_distributed()
    _check_batch_split(config, ctx.world_size)
    impl_cls = METHODS[method]
    rows, data_uri = _open_data(method, config, impl_cls.dataset_kind)
    resume_from, local_resume = _find_resume(method, config)
    model, tokenizer = _load_model(config, ctx)
    torch.manual_seed(config.seed)
    impl = impl_cls(config, tokenizer, ctx)
    examples = _build_examples(impl, rows, data_uri)
    run = _TrainingRun(method, config, ctx, impl, tokenizer, started, progress)
    run.place_model(model, examples)
    if local_resume is not None:
        run.resume(resume_from, local_resume)
    return run.run()


def _check_batch_split(config: TrainConfig, world_size: int) -> None:
    if config.batch_size % (world_size * config.grad_accum):
        raise TrainingError(f"batch_size {config.batch_size} must be a multiple of world_size × grad_accum "
                            f"= {world_size} × {config.grad_accum}")


def _open_data(method: str, config: TrainConfig, dataset_kind: str) -> tuple[list, str]:
    """(rows, data URI) of the prepared dataset, which must have been prepared for this method's kind."""
    try:
        prepared = open_prepared(config.data)
    except DataError as err:
        raise TrainingError(str(err)) from err
    rows, kind, data_uri = prepared.rows, prepared.kind, prepared.data_uri
    if kind is not None and kind != dataset_kind:
        raise TrainingError(f"method {method!r} needs a dataset prepared with --kind {dataset_kind}, "
                            f"but {data_uri} was prepared with --kind {kind}")
    return rows, data_uri


def _find_resume(method: str, config: TrainConfig) -> tuple[str | None, Path | None]:
    """(URI, local copy) of the newest checkpoint of this output to resume from, or (None, None) for a fresh
    run. Checkpoints without `resume` are an error (a second run must not overwrite them), as is another
    method's checkpoint."""
    resume_from = storage.latest_checkpoint(storage.join(config.output, "checkpoints"))
    if resume_from and not config.resume:
        raise TrainingError(f"{config.output} already holds checkpoints (newest {resume_from}); pass resume=true "
                            "(--resume) to continue that run, or choose another output")
    if not resume_from:
        return resume_from, None
    try:
        local_resume = storage.fetch_checkpoint(resume_from, Path(config.cache_dir) / "s3")
    except storage.StorageError as err:
        raise TrainingError(f"cannot resume from {resume_from}: {err}") from err
    resume_state = json.loads((local_resume / "trainer_state.json").read_text())
    if resume_state.get("method") != method:
        raise TrainingError(f"{resume_from} belongs to a {resume_state.get('method')!r} run, not {method!r}")
    return resume_from, local_resume


def _load_model(config: TrainConfig, ctx) -> tuple[Any, Any]:
    """(model, tokenizer). Rank 0 resolves the model first so concurrent ranks never build or download the same
    cache entry."""
    from sao_core.models import load_model_and_tokenizer

    if ctx.is_main:
        loaded = load_model_and_tokenizer(config.model, config.cache_dir, unverified=config.unverified)
    barrier(ctx)
    if not ctx.is_main:
        loaded = load_model_and_tokenizer(config.model, config.cache_dir, unverified=config.unverified)
    return loaded


def _build_examples(impl, rows: list, data_uri: str) -> list:
    try:
        examples = impl.build_examples(rows, data_uri)
    except ValueError as err:
        raise TrainingError(str(err)) from err
    if not examples:
        raise TrainingError(f"{data_uri}: no trainable examples")
    return examples


class _TrainingRun:
    """One training job past its checks: the held-out split, the wrapped model, optimiser and schedule, the data
    order, and the counters a checkpoint saves (`step`; `cursor`, the global position in the data order)."""

    def __init__(self, method: str, config: TrainConfig, ctx, impl, tokenizer, started: float,
                 progress: Callable[[int, dict], None] | None):
        self.method, self.config, self.ctx, self.impl, self.tokenizer = method, config, ctx, impl, tokenizer
        self.started, self.progress = started, progress
        self.checkpoints_uri = storage.join(config.output, "checkpoints")
        self.precision = autocast(config.precision, ctx.device)
        self.per_rank = config.batch_size // ctx.world_size
        self.micro = self.per_rank // config.grad_accum            # examples per micro-batch on this rank
        self.step, self.cursor = 0, 0
        self.resumed_from: str | None = None
        self.local_run = _local_run_dir(config)
        self.first_loss = self.last_loss = None
        self.tokens_total = 0.0

    def place_model(self, model, examples: list) -> None:
        """Hold out up to 64 examples (1 in 20) for evaluation; move the model to the device, let the method
        set up (DPO's reference log-probs), apply LoRA, wrap the model (FSDP2 under torchrun) and build the
        optimiser and schedule."""
        config = self.config
        n_eval = min(max(1, len(examples) // 20), 64) if len(examples) > 1 else 0
        self.eval_set, self.train_set = examples[:n_eval], examples[n_eval:] or examples
        self.order = DataOrder(len(self.train_set), config.seed)
        model.to(self.ctx.device)
        with self.precision:  # reference log-probs (DPO) in the precision the policy trains in
            self.impl.setup(model, examples)
        # After setup: DPO's reference log-probs come from the base weights (the adapter starts at zero, so the
        # base model is the initial policy), and no second copy of the model is kept.
        try:
            model, self.lora_summary = apply_lora_settings(model, config)
        except ValueError as err:
            raise TrainingError(str(err)) from err
        if self.lora_summary:
            log.info("LoRA rank %d: %d of %d parameters train", config.lora_rank,
                     self.lora_summary["trainable_parameters"], self.lora_summary["parameters"])
        self.model = prepare_model(model, self.ctx, config.gradient_checkpointing)
        self.model.train()
        self.optimizer = build_optimizer(self.model.parameters(), config.lr, config.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, config, config.steps)

    def resume(self, resume_from: str, local_resume: Path) -> None:
        """Load the model, optimiser, schedule, step and data cursor of a checkpoint."""
        state = load_training_checkpoint(local_resume, {"model": (self.model, self.optimizer)}, self.ctx)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.cursor = int(state["step"]), int(state["cursor"])
        self.resumed_from = resume_from
        if self.ctx.is_main:
            log.info("resumed from %s at step %d", resume_from, self.step)

    def run(self) -> dict[str, Any]:
        """Evaluate, train to `config.steps`, evaluate again; checkpoint, export the model, write the summary."""
        self.local_run.mkdir(parents=True, exist_ok=True)
        eval_before = self.evaluate()
        # Resumed: the steps after the checkpoint are trained again, so their lines from the killed run go.
        with MetricsLog(self.config.output, self.metrics_path, resume=self.resumed_from is not None,
                        enabled=self.ctx.is_main, keep_through=self.step,
                        sinks=run_sinks(self.config, self.method)) as metrics_log:
            while self.step < self.config.steps:
                record = self.train_step()
                self.after_step(record, metrics_log)
        eval_after = self.evaluate()
        return self.finish(eval_before, eval_after)

    @property
    def metrics_path(self) -> Path:
        return self.local_run / "metrics.jsonl"

    def evaluate(self) -> float | None:
        """Mean loss per example over the held-out set (None without one)."""
        if not self.eval_set:
            return None
        self.model.eval()
        total = 0.0
        with torch.no_grad(), self.precision:
            for start in range(0, len(self.eval_set), self.micro):
                chunk = self.eval_set[start:start + self.micro]
                loss, _ = self.impl.loss(self.model, chunk, self.step, training=False)
                total += float(loss) * len(chunk)
        self.model.train()
        return total / len(self.eval_set)

    def train_step(self) -> dict[str, float]:
        """One optimiser step on the next `batch_size` examples; its metrics, averaged over ranks, with step, lr,
        seconds since the start and the gradient norm before clipping."""
        config, ctx = self.config, self.ctx
        picked = self.order.take(self.cursor, config.batch_size)
        mine = picked[ctx.rank * self.per_rank:(ctx.rank + 1) * self.per_rank]
        self.optimizer.zero_grad(set_to_none=True)
        sums = self.accumulate_gradients(mine)
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = clip_and_step(self.optimizer, self.model.parameters(), config.grad_clip, self.scheduler)
        self.step += 1
        self.cursor += config.batch_size
        record = all_reduce_mean(sums, ctx)
        self.tokens_total += record.get("tokens", 0.0) * ctx.world_size
        record.update(step=self.step, lr=lr, seconds=time.time() - self.started, grad_norm=grad_norm)
        self.first_loss = record["loss"] if self.first_loss is None else self.first_loss
        self.last_loss = record["loss"]
        return record

    def accumulate_gradients(self, mine: list[int]) -> dict[str, float]:
        """Backward over this rank's examples in `grad_accum` micro-batches; the loss and the method's metrics,
        averaged over the micro-batches."""
        accum = self.config.grad_accum
        sums: dict[str, float] = {}
        for i in range(accum):
            batch = [self.train_set[j] for j in mine[i * self.micro:(i + 1) * self.micro]]
            with self.precision:
                loss, metrics = self.impl.loss(self.model, batch, self.step, training=True, micro=i)
            (loss / accum).backward()
            for key, value in {"loss": float(loss.detach()), **metrics}.items():
                sums[key] = sums.get(key, 0.0) + value / accum
        return sums

    def after_step(self, record: dict[str, float], metrics_log: MetricsLog) -> None:
        """Log the step (every `log_every` and the last), refresh the report, checkpoint every
        `checkpoint_every` steps (the last one is saved by `finish`), report progress."""
        config, step, is_main = self.config, self.step, self.ctx.is_main
        if is_main and (step % config.log_every == 0 or step == config.steps):
            metrics_log.append(record)
            metrics_log.sync()
        if is_main:   # every report_every steps (a failure only warns)
            write_training_report(config.output, metrics=self.metrics_path, config=config, method=self.method,
                                  step=step, every=config.report_every)
        if config.checkpoint_every and step % config.checkpoint_every == 0 and step < config.steps:
            self.checkpoint()
        if is_main and self.progress:
            self.progress(step, record)

    def checkpoint(self) -> str:
        """Save a resumable checkpoint of this step; return its URI."""
        state = {"method": self.method, "step": self.step, "cursor": self.cursor,
                 "scheduler": self.scheduler.state_dict(), "config": dataclasses.asdict(self.config)}
        name = step_name(self.step)
        uri = save_training_checkpoint(self.local_run / ".staging" / name, storage.join(self.checkpoints_uri, name),
                                       {"model": (self.model, self.optimizer)}, state, self.ctx)
        if self.ctx.is_main:   # only now, with a newer one complete, may older ones go
            prune_checkpoints(self.checkpoints_uri, self.config.keep_checkpoints, self.config.pin_checkpoints)
        return uri

    def finish(self, eval_before: float | None, eval_after: float | None) -> dict[str, Any]:
        """The last checkpoint, the exported model (``<output>/model``), the summary and the final report."""
        config, ctx = self.config, self.ctx
        last_checkpoint = self.checkpoint()
        model_uri = storage.join(config.output, "model")
        export_hf_model(self.model, self.tokenizer, self.local_run / ".staging" / "model", model_uri,
                        {"method": self.method, "step": self.step, "base_model": config.model}, ctx)
        summary = {
            "method": self.method, "steps": self.step, "examples": len(self.train_set),
            "eval_examples": len(self.eval_set), "world_size": ctx.world_size, "first_train_loss": self.first_loss,
            "last_train_loss": self.last_loss, "eval_loss_before": eval_before, "eval_loss_after": eval_after,
            "trained_tokens": self.tokens_total, "resumed_from": self.resumed_from, "checkpoint": last_checkpoint,
            "model": model_uri, "seconds": time.time() - self.started, "lora": self.lora_summary,
        }
        if ctx.is_main:
            (self.local_run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            if storage.is_s3_uri(config.output):
                storage.upload_file(self.local_run / "summary.json", storage.join(config.output, "summary.json"))
            write_training_report(config.output, metrics=self.metrics_path, config=config, method=self.method,
                                  summary=summary)
        barrier(ctx)
        return summary
