"""cpt_train: continued pre-training (next-token loss on raw text packed into max_tokens blocks); data kind cpt.

Calls :func:`sao_core.training.trainer.train` with a :class:`sao_core.training.config.CPTConfig`. The
run (resumable checkpoints, the exported model, metrics.jsonl) goes to ``OUTPUT_ROOT/RUN_ID/cpt``; a
restarted pod resumes from its newest checkpoint. The Model artifact points at the exported model
(method, step, sha256 of its manifest); ``model_uri`` is the same URI as a string for later steps.
"""

from typing import NamedTuple, Optional

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Markdown, Metrics, Model, Output

from sao_core.images import image


@dsl.component(base_image=image("train"), install_kfp_package=False)
def cpt_train(
    data: Input[Dataset],
    output_root: str,
    model: Output[Model],
    metrics: Output[Metrics],
    summary: Output[Markdown],
    report: Output[HTML],
    base_model: str = "embedded:tiny",
    steps: int = 100,
    batch_size: int = 16,
    lr: float = 1e-5,
    max_tokens: int = 512,
    options: Optional[dict] = None,  # noqa: UP045 (KFP reads typing.Optional, not X | None)
    run_id: str = "",
) -> NamedTuple("TrainOutputs", model_uri=str, checkpoint_uri=str):
    """Continued pre-training (next-token loss on raw text packed into max_tokens blocks); data kind cpt.

    Args:
        data: Prepared dataset of kind cpt.
        output_root: Where runs are written: s3://bucket/prefix in a cluster, a local directory for local runs.
        model: Pointer to the exported model (checkpoint_uri, sha256, method, step).
        metrics: Summary numbers (losses before and after, steps, tokens, seconds).
        summary: Markdown page with the summary and the loss curve.
        report: The training report (HTML): loss / reward curves with moving averages (RL: DIS masks, staleness, drops, critic, throughput), the config and the checkpoints.
        base_model: Model to start from: embedded:tiny, a directory, an s3:// checkpoint or a hub id.
        steps: Optimiser steps (RL: learner steps) in total.
        batch_size: Examples per optimiser step, over all ranks.
        lr: Learning rate (peak, after the warm-up).
        max_tokens: Examples are cut (or packed) to this many tokens.
        options: Any other CPTConfig field, e.g. {"schedule": "cosine", "warmup_steps": 10, "checkpoint_every": 100}.
        run_id: Run folder name under output_root (pipelines pass the run id; empty: a timestamp).
    """
    from sao_core.kfp import artifacts, params
    from sao_core.training.trainer import train

    run = artifacts.run_dir(output_root, run_id, "cpt")
    config = params.training_config("cpt", data=data.path, output=run, model=base_model, steps=steps,
                                    batch_size=batch_size, lr=lr, max_tokens=max_tokens, options=options)
    result = train("cpt", config)
    model_uri, checkpoint_uri = artifacts.finish_training(result, "cpt", base_model, run, model, metrics, summary,
                                                          curve_key="loss", report_artifact=report)
    return (model_uri, checkpoint_uri)  # the NamedTuple outputs, in order
