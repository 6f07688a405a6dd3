"""gkd_train: generalised knowledge distillation from a teacher sharing the tokenizer; data kind sft.

Calls :func:`sao_core.training.trainer.train` with a :class:`sao_core.training.config.GKDConfig`. The
run (resumable checkpoints, the exported model, metrics.jsonl) goes to ``OUTPUT_ROOT/RUN_ID/gkd``; a
restarted pod resumes from its newest checkpoint. The Model artifact points at the exported model
(method, step, sha256 of its manifest); ``model_uri`` is the same URI as a string for later steps.
"""

from typing import NamedTuple, Optional

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Markdown, Metrics, Model, Output

from sao_core.images import image


@dsl.component(base_image=image("train"), install_kfp_package=False)
def gkd_train(
    data: Input[Dataset],
    output_root: str,
    model: Output[Model],
    metrics: Output[Metrics],
    summary: Output[Markdown],
    report: Output[HTML],
    teacher_model: str,
    base_model: str = "embedded:tiny",
    steps: int = 100,
    batch_size: int = 16,
    lr: float = 1e-5,
    max_tokens: int = 512,
    options: Optional[dict] = None,  # noqa: UP045 (KFP reads typing.Optional, not X | None)
    run_id: str = "",
) -> NamedTuple("TrainOutputs", model_uri=str, checkpoint_uri=str):
    """Generalised knowledge distillation from a teacher sharing the tokenizer; data kind sft.

    Args:
        data: Prepared dataset of kind sft.
        output_root: Where runs are written: s3://bucket/prefix in a cluster, a local directory for local runs.
        model: Pointer to the exported model (checkpoint_uri, sha256, method, step).
        metrics: Summary numbers (losses before and after, steps, tokens, seconds).
        summary: Markdown page with the summary and the loss curve.
        report: The training report (HTML): loss / reward curves with moving averages (RL: DIS masks, staleness, drops, critic, throughput), the config and the checkpoints.
        teacher_model: Model reference of the teacher (required).
        base_model: Model to start from: embedded:tiny, a directory, an s3:// checkpoint or a hub id.
        steps: Optimiser steps (RL: learner steps) in total.
        batch_size: Examples per optimiser step, over all ranks.
        lr: Learning rate (peak, after the warm-up).
        max_tokens: Examples are cut (or packed) to this many tokens.
        options: Any other GKDConfig field, e.g. {"beta": 0.5, "temperature": 1.0, "on_policy_fraction": 0.5} (beta 0 = forward KL, 1 = reverse KL).
        run_id: Run folder name under output_root (pipelines pass the run id; empty: a timestamp).
    """
    from sao_core.kfp import artifacts, params
    from sao_core.training.trainer import train

    run = artifacts.run_dir(output_root, run_id, "gkd")
    config = params.training_config("gkd", data=data.path, output=run, model=base_model, steps=steps,
                                    batch_size=batch_size, lr=lr, max_tokens=max_tokens, options=options,
                                    teacher_model=teacher_model)
    result = train("gkd", config)
    model_uri, checkpoint_uri = artifacts.finish_training(result, "gkd", base_model, run, model, metrics, summary,
                                                          curve_key="loss", report_artifact=report)
    return (model_uri, checkpoint_uri)  # the NamedTuple outputs, in order
