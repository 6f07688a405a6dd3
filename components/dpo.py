"""dpo_train: direct preference optimisation (sigmoid DPO on summed response log-probs); data kind dpo.

Calls :func:`sao_core.training.trainer.train` with a :class:`sao_core.training.config.DPOConfig`. The
run (resumable checkpoints, the exported model, metrics.jsonl) goes to ``OUTPUT_ROOT/RUN_ID/dpo``; a
restarted pod resumes from its newest checkpoint. The Model artifact points at the exported model
(method, step, sha256 of its manifest); ``model_uri`` is the same URI as a string for later steps.
"""

from typing import NamedTuple, Optional

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Markdown, Metrics, Model, Output

from sao_core.images import image


@dsl.component(base_image=image("train"), install_kfp_package=False)
def dpo_train(
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
    reference_model: str = "",
    options: Optional[dict] = None,  # noqa: UP045 (KFP reads typing.Optional, not X | None)
    run_id: str = "",
) -> NamedTuple("TrainOutputs", model_uri=str, checkpoint_uri=str):
    """Direct preference optimisation (sigmoid DPO on summed response log-probs); data kind dpo.

    Args:
        data: Prepared dataset of kind dpo (prompt, chosen, rejected).
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
        reference_model: Reference model; empty: the initial policy (`model`).
        options: Any other DPOConfig field, e.g. {"beta": 0.1, "schedule": "cosine", "checkpoint_every": 100}.
        run_id: Run folder name under output_root (pipelines pass the run id; empty: a timestamp).
    """
    from sao_core.kfp import artifacts, params
    from sao_core.training.trainer import train

    run = artifacts.run_dir(output_root, run_id, "dpo")
    config = params.training_config("dpo", data=data.path, output=run, model=base_model, steps=steps,
                                    batch_size=batch_size, lr=lr, max_tokens=max_tokens, options=options,
                                    reference_model=reference_model)
    result = train("dpo", config)
    model_uri, checkpoint_uri = artifacts.finish_training(result, "dpo", base_model, run, model, metrics, summary,
                                                          curve_key="loss", report_artifact=report)
    return (model_uri, checkpoint_uri)  # the NamedTuple outputs, in order
