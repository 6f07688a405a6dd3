"""Sub-pipelines shared by the pipelines: RL training with an optional SFT warm start.

KFP's ``dsl.OneOf`` cannot be nested and the local runner only resolves it for parameters, so a stage
that may or may not run a warm start is its own small pipeline whose output is the trained model's
URI (a string): ``If(warm_start_steps > 0)``: prepare the SFT data, fine-tune, then RL from the
fine-tuned model; ``Else``: RL from ``base_model``.
"""

from kfp import dsl
from kfp.dsl import Dataset, Input

from components.grpo import grpo_train
from components.prepare_data import prepare_data
from components.sao import sao_train
from components.sft import sft_train
from sao_core.kfp import k8s

RUN_ID = dsl.PIPELINE_JOB_ID_PLACEHOLDER


def build_rl_stage(method: str, settings: k8s.ClusterSettings):
    """The `method` ('sao' or 'grpo') RL stage with an optional warm start, as a graph component."""
    if method not in ("sao", "grpo"):
        raise ValueError(f"RL stage method must be sao or grpo, got {method!r}")
    rl_component = sao_train if method == "sao" else grpo_train

    def rl_task(data, base_model, output_root, steps, batch_size, learning_rate, engine, method_options, params):
        kwargs = dict(data=data, output_root=output_root, base_model=base_model, steps=steps, batch_size=batch_size,
                      policy_lr=learning_rate, engine=engine, options=method_options, run_id=RUN_ID)
        if method == "grpo":
            kwargs["method"] = "grpo"
        task = rl_component(**kwargs).set_display_name(f"{method} training")
        return k8s.apply(task, "training", params, settings, image_kind="rollout")

    @dsl.pipeline(name=f"{method}-stage")
    def rl_stage(
        data: Input[Dataset],
        output_root: str,
        base_model: str,
        steps: int,
        batch_size: int,
        learning_rate: float,
        engine: str,
        method_options: dict,
        warm_start_source: str,
        warm_start_steps: int,
        warm_start_lr: float,
        max_tokens: int,
        gpu_count: int,
        accelerator_type: str,
        node_selector: dict,
        tolerations: list,
        s3_secret_name: str,
    ) -> str:
        """RL training with an optional SFT warm start; returns the trained model's URI.

        Args:
            data: Prepared rl dataset.
            output_root: Where runs are written (s3://bucket/prefix or a local directory).
            base_model: Model to start from.
            steps: RL learner steps.
            batch_size: Trajectories per step.
            learning_rate: Policy learning rate.
            engine: Rollout engine: vllm or hf.
            method_options: Other RLConfig fields.
            warm_start_source: SFT data source of the warm start.
            warm_start_steps: SFT steps before RL (0 = no warm start).
            warm_start_lr: Learning rate of the warm start.
            max_tokens: Token limit of warm-start examples.
            gpu_count: GPUs of the training pods.
            accelerator_type: Kubernetes resource name of the GPUs.
            node_selector: Node labels the training pods require.
            tolerations: Tolerations of the training pods.
            s3_secret_name: Secret with the S3 credentials.
        """
        params = k8s.ClusterParams(gpu_count=gpu_count, accelerator_type=accelerator_type,
                                   node_selector=node_selector, tolerations=tolerations,
                                   s3_secret_name=s3_secret_name)
        with dsl.If(warm_start_steps > 0, name="warm-start"):
            warm_data = prepare_data(source=warm_start_source, kind="sft").set_display_name("prepare warm-start data")
            k8s.apply(warm_data, "data", params, settings, image_kind="cpu")
            warm = sft_train(data=warm_data.outputs["dataset"], output_root=output_root, base_model=base_model,
                             steps=warm_start_steps, lr=warm_start_lr, max_tokens=max_tokens,
                             run_id=RUN_ID).set_display_name("warm-start SFT")
            k8s.apply(warm, "training", params, settings, image_kind="train")
            after_warm = rl_task(data, warm.outputs["model_uri"], output_root, steps, batch_size, learning_rate,
                                 engine, method_options, params)
        with dsl.Else(name="no-warm-start"):
            cold = rl_task(data, base_model, output_root, steps, batch_size, learning_rate, engine, method_options,
                           params)
        return dsl.OneOf(after_warm.outputs["model_uri"], cold.outputs["model_uri"])

    return rl_stage


def build_evaluation_stage(settings: k8s.ClusterSettings):
    """Evaluation of one model on a list of benchmarks (one parallel step each) and one report."""
    from components.evaluate import evaluate
    from components.report import report

    @dsl.pipeline(name="evaluation-stage")
    def evaluation_stage(
        model: str,
        output_root: str,
        benchmarks: list,
        k: int,
        limit: int,
        engine: str,
        max_new_tokens: int,
        max_total_tokens: int,
        temperature: float,
        sandbox: str,
        previous_summary: str,
        eval_options: dict,
        gpu_count: int,
        accelerator_type: str,
        node_selector: dict,
        tolerations: list,
        s3_secret_name: str,
    ) -> str:
        """Evaluate `model` on each benchmark in parallel, then write one report; returns the report's URI.

        Args:
            model: Model reference to evaluate.
            output_root: Where runs are written.
            benchmarks: Benchmark names.
            k: Samples per problem.
            limit: First N problems of each benchmark (0 = all).
            engine: vllm or hf.
            max_new_tokens: Tokens per model turn.
            max_total_tokens: Tokens of a whole episode.
            temperature: Sampling temperature.
            sandbox: SWE sandbox: kubernetes or local.
            previous_summary: Earlier summary.json to compare against ('' = none).
            eval_options: Other EvalConfig fields.
            gpu_count: GPUs of each evaluation pod.
            accelerator_type: Kubernetes resource name of the GPUs.
            node_selector: Node labels the evaluation pods require.
            tolerations: Tolerations of the evaluation pods.
            s3_secret_name: Secret with the S3 credentials.
        """
        params = k8s.ClusterParams(gpu_count=gpu_count, accelerator_type=accelerator_type,
                                   node_selector=node_selector, tolerations=tolerations,
                                   s3_secret_name=s3_secret_name)
        with dsl.ParallelFor(benchmarks, name="benchmarks") as benchmark:
            step = evaluate(model=model, output_root=output_root, benchmarks=benchmark, k=k, limit=limit,
                            engine=engine, max_new_tokens=max_new_tokens, max_total_tokens=max_total_tokens,
                            temperature=temperature, sandbox=sandbox, previous_summary=previous_summary,
                            options=eval_options, run_id=RUN_ID).set_display_name("evaluate")
            k8s.apply(step, "evaluation", params, settings, image_kind="rollout")
        final = report(summaries=dsl.Collected(step.outputs["summary"]), output_root=output_root,
                       previous_summary=previous_summary, run_id=RUN_ID).set_display_name("report")
        k8s.apply(final, "cpu", params, settings, image_kind="cpu")
        return final.outputs["report_uri"]

    return evaluation_stage
