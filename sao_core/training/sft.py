"""Supervised fine-tuning on prepared chat data (single process).

The first training loop of the shared core: it reads the ``data.jsonl`` written by
`sao_core.data.prepare` (kind ``sft``), learns the assistant tokens, logs metrics to JSONL and publishes
the final model as a verified checkpoint (Hugging Face safetensors + manifest) to a local directory or
an ``s3://`` prefix.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sao_core import storage
from sao_core.training.schedule import SCHEDULES


@dataclass
class SFTConfig:
    """Settings of an SFT run. Steps count optimiser updates; lengths are in tokens."""

    data: str                                # prepared dataset: a data.jsonl file or the directory holding it
    output: str                              # run directory: local path or s3:// prefix
    model: str = "embedded:tiny"             # model reference (see sao_core.models.loading)
    steps: int = 200
    batch_size: int = 16
    lr: float = 1e-3
    schedule: str = "cosine"
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_tokens: int = 512                    # conversations are cut to this many tokens
    eval_fraction: float = 0.05              # share of rows held out for eval loss (at least 1 row)
    log_every: int = 10
    seed: int = 0
    cache_dir: str = field(default_factory=lambda: str(Path.home() / ".cache" / "sao"))

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        positive = {"steps": self.steps, "batch_size": self.batch_size, "max_tokens": self.max_tokens,
                    "log_every": self.log_every}
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"SFTConfig.{name} must be >= 1, got {value}")
        if not self.lr > 0:
            raise ValueError(f"SFTConfig.lr must be > 0, got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"SFTConfig.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"SFTConfig.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.warmup_steps < 0 or self.grad_clip < 0:
            raise ValueError("SFTConfig.warmup_steps and grad_clip must be >= 0")


def read_prepared_rows(data: str) -> list[dict]:
    """Rows of a prepared dataset (``data.jsonl``, or a directory / s3 prefix holding one)."""
    uri = data if data.endswith(".jsonl") else storage.join(data, "data.jsonl")
    rows = []
    for line_no, line in enumerate(storage.read_text(uri).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{uri}: line {line_no} is not JSON ({err.msg}); was it written by prepare-data?") from err
    if not rows:
        raise ValueError(f"{uri} holds no rows")
    return rows


def run_sft(config: SFTConfig, progress: Callable[[int, dict], None] | None = None) -> dict:
    """Train, evaluate and publish; return a summary (losses, tokens, seconds, checkpoint URI).

    `progress(step, metrics)` is called after every optimiser step.
    """
    import torch

    from sao_core.models import load_model_and_tokenizer
    from sao_core.objectives.common import token_logprobs
    from sao_core.objectives.sft import sft_loss
    from sao_core.training.chat_batch import encode_chat, pad_batch
    from sao_core.training.schedule import lr_factor

    config.validate()
    started = time.time()
    rows = read_prepared_rows(config.data)
    model, tokenizer = load_model_and_tokenizer(config.model, config.cache_dir)
    examples = []
    for index, row in enumerate(rows):
        if "messages" not in row:
            raise ValueError(f"{config.data}: row {index} has no 'messages' (prepare it with kind sft)")
        examples.append(encode_chat(tokenizer, row["messages"], config.max_tokens))
    rng = random.Random(config.seed)
    rng.shuffle(examples)
    n_eval = max(1, int(len(examples) * config.eval_fraction)) if len(examples) > 1 else 0
    eval_set, train_set = examples[:n_eval], examples[n_eval:]
    torch.manual_seed(config.seed)

    def batch_loss(batch_examples):
        batch = pad_batch(batch_examples, tokenizer.pad_token_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return sft_loss(token_logprobs(logits, batch["input_ids"]), batch["loss_mask"])

    def eval_loss() -> float | None:
        if not eval_set:
            return None
        model.eval()
        with torch.no_grad():
            total, tokens = 0.0, 0.0
            for i in range(0, len(eval_set), config.batch_size):
                _, m = batch_loss(eval_set[i:i + config.batch_size])
                total += m["loss"] * m["tokens"]
                tokens += m["tokens"]
        return total / max(tokens, 1.0)

    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, config.steps, config.warmup_steps, config.schedule)
    )
    staging_root = Path(tempfile.mkdtemp(prefix="sao-sft-"))
    local_run = Path(config.output) if not storage.is_s3_uri(config.output) else staging_root / "run"
    local_run.mkdir(parents=True, exist_ok=True)
    metrics_path = local_run / "metrics.jsonl"
    before = eval_loss()
    first_loss = last_loss = None
    trained_tokens = 0.0
    order: list[int] = []
    with metrics_path.open("w") as metrics_file:
        for step in range(config.steps):
            model.train()
            if len(order) < config.batch_size:
                fresh = list(range(len(train_set)))
                rng.shuffle(fresh)
                order.extend(fresh)
            picked = [train_set[i] for i in order[:config.batch_size]]
            del order[:config.batch_size]
            loss, m = batch_loss(picked)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip or float("inf"))
            optimizer.step()
            scheduler.step()
            trained_tokens += m["tokens"]
            first_loss = m["loss"] if first_loss is None else first_loss
            last_loss = m["loss"]
            record = {"step": step + 1, "loss": m["loss"], "tokens": m["tokens"], "grad_norm": float(grad_norm),
                      "lr": scheduler.get_last_lr()[0], "seconds": time.time() - started}
            if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
            if progress:
                progress(step + 1, record)
    after = eval_loss()
    export_dir = staging_root / "export"
    model.save_pretrained(export_dir, safe_serialization=True)
    tokenizer.save_pretrained(export_dir)
    checkpoint_uri = storage.join(config.output, "checkpoints", f"step-{config.steps:06d}")
    storage.publish_checkpoint(export_dir, checkpoint_uri,
                               metadata={"method": "sft", "step": config.steps, "base_model": config.model})
    summary = {
        "method": "sft",
        "steps": config.steps,
        "train_rows": len(train_set),
        "eval_rows": len(eval_set),
        "first_train_loss": first_loss,
        "last_train_loss": last_loss,
        "eval_loss_before": before,
        "eval_loss_after": after,
        "trained_tokens": trained_tokens,
        "seconds": time.time() - started,
        "checkpoint": checkpoint_uri,
        "config": asdict(config),
    }
    (local_run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if storage.is_s3_uri(config.output):
        storage.upload_file(metrics_path, storage.join(config.output, "metrics.jsonl"))
        storage.upload_file(local_run / "summary.json", storage.join(config.output, "summary.json"))
    return summary
