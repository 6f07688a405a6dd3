"""Sub-pipelines shared by the pipelines: RL training with an optional SFT warm start, in one pod or as a
Kubeflow Trainer TrainJob, and the evaluation stage.

KFP's ``dsl.OneOf`` cannot be nested and the local runner only resolves it for parameters, so every
choice is its own small pipeline whose output is the trained model's URI (a string):

- ``single_pod`` RL stage: ``If(warm_start_steps > 0)``: prepare the SFT data, fine-tune, then RL from
  the fine-tuned model; ``Else``: RL from ``base_model`` (the rollout service and the learner share one
  pod);
- ``trainjob`` RL stage: the same warm start, but the RL step is :func:`build_trainjob_stage`: a CPU pod
  launches one TrainJob (rollout replicas + torchrun learner, one Kueue workload) and follows it, inside
  a ``dsl.ExitHandler`` whose exit step deletes the TrainJob whatever happens;
- the RL stage the pipelines call: ``If(placement == "trainjob")`` runs the TrainJob stage, ``Else`` the
  single-pod stage. Local runs (``placement=single_pod``) never enter the TrainJob branch, so they need
  no cluster.
"""

from typing import Any

from kfp import dsl, kubernetes
from kfp.dsl import Dataset, Input

from components.grpo import grpo_train
from components.prepare_data import prepare_data
from components.sao import sao_train
from components.sft import sft_train
from pipelines._form import REQUIRED, Field, pick, pipeline_of
from sao_core.cluster.launcher import LaunchConfig
from sao_core.config import settings_of
from sao_core.kfp import k8s
from sao_core.kfp.docs import described, setting_description
from sao_core.learner.config import RLConfig

RUN_ID = dsl.PIPELINE_JOB_ID_PLACEHOLDER
#: SAO settings that sao_rl passes as parameters of their own (post_training passes them in method_options).
SAO_PARAMETERS = ("max_staleness", "admission", "eps_low", "eps_high")

#: The type of every input of the stage pipelines, by name (the stages' signatures are made from it).
STAGE_TYPES: dict[str, Any] = {
    "data": Input[Dataset], "output_root": str, "base_model": str, "method": str, "steps": int, "batch_size": int,
    "learning_rate": float, "policy_lr": float, "max_staleness": int, "admission": str, "eps_low": float,
    "eps_high": float, "engine": str, "method_options": dict, "sao_options": dict, "warm_start_source": str,
    "warm_start_steps": int, "warm_start_lr": float, "warm_start_options": dict, "max_tokens": int, "placement": str,
    "num_nodes": int, "gpus_per_node": int, "rollout_replicas": int, "rollout_gpus": int, "tensor_parallel_size": int,
    "gpu_count": int, "accelerator_type": str, "node_selector": dict, "tolerations": list, "s3_secret_name": str,
}
#: Descriptions of the stage inputs that are not RLConfig / LaunchConfig settings under their own name.
STAGE_DESCRIPTIONS = {
    "data": "Prepared rl dataset.",
    "output_root": "Where runs are written (OUTPUT_ROOT/RUN_ID/STAGE): s3://bucket/prefix (placement trainjob needs "
                   "s3://), or a local directory for single_pod local runs.",
    "base_model": "Model to start from: embedded:tiny, a directory, an s3:// checkpoint or a hub id (placement "
                  "trainjob: one the pods can reach).",
    "method_options": "Other RLConfig fields.",
    "sao_options": "Other RLConfig fields.",
    "warm_start_source": "SFT data source of the warm start.",
    "warm_start_steps": "SFT steps before RL (0 = no warm start).",
    "warm_start_lr": "Learning rate of the warm start.",
    "warm_start_options": "SFTConfig settings of the warm start.",
    "max_tokens": "Token limit of warm-start examples.",
    "placement": "single_pod (rollout service and learner in one pod) or trainjob (one Kubeflow Trainer TrainJob).",
    "gpu_count": "GPUs of each training pod: the warm-start SFT and, with placement single_pod, RL.",
}
#: Stage inputs carrying a setting under another name (input -> (config, setting)).
_ALIASES = {"learning_rate": (RLConfig, "policy_lr"), "accelerator_type": (LaunchConfig, "accelerator")}

#: Groups of stage inputs, in the order the signatures list them.
RL_TRAINING = ("steps", "batch_size", "learning_rate", "engine", "method_options")
RL_RUN = ("data", "output_root", "base_model", *RL_TRAINING)
WARM_START = ("warm_start_source", "warm_start_steps", "warm_start_lr", "max_tokens")
TRAINJOB_SHAPE = ("num_nodes", "gpus_per_node", "rollout_replicas", "rollout_gpus", "tensor_parallel_size")
#: Pod settings of the GPU pods, and of the training pods (with their GPU count).
GPU_PODS = ("accelerator_type", "node_selector", "tolerations", "s3_secret_name")
TRAINING_PODS = ("gpu_count", *GPU_PODS)


def stage_description(name: str) -> str:
    """The description of stage input `name`: :data:`STAGE_DESCRIPTIONS`, else its setting's help."""
    if name in STAGE_DESCRIPTIONS:
        return STAGE_DESCRIPTIONS[name]
    if name in _ALIASES:
        return setting_description(*_ALIASES[name])
    config = RLConfig if name in settings_of(RLConfig) else LaunchConfig
    return setting_description(config, name)


def stage_pipeline(name: str, summary: str, inputs: tuple[str, ...]):
    """Decorator: ``func(stage)`` as the stage pipeline `name` (:func:`pipelines._form.pipeline_of`) with the
    inputs `inputs`, typed by :data:`STAGE_TYPES` and described by :func:`stage_description`."""
    return pipeline_of(name, summary, [Field(n, STAGE_TYPES[n], REQUIRED, stage_description(n)) for n in inputs])


def pod_params(stage) -> k8s.ClusterParams:
    """The Kubernetes settings of a stage's training pods (inputs :data:`TRAINING_PODS`)."""
    return k8s.ClusterParams(gpu_count=stage.gpu_count, accelerator_type=stage.accelerator_type,
                             node_selector=stage.node_selector, tolerations=stage.tolerations,
                             s3_secret_name=stage.s3_secret_name)


def warm_start_sft(base_model, output_root, warm_start_source, warm_start_steps, params: k8s.ClusterParams,
                   settings: k8s.ClusterSettings, lr=None, max_tokens=None, batch_size=None, options=None):
    """The warm-start tasks (prepare the SFT data, fine-tune `base_model`); returns the SFT task.

    Call it inside a pipeline function (usually in ``dsl.If(warm_start_steps > 0)``); the SFT step runs
    in one training pod with ``params``' GPUs whatever the RL placement. `lr`, `max_tokens`, `batch_size`
    None: sft_train's defaults (which `options`, other SFTConfig settings, may replace).
    """
    warm_data = prepare_data(source=warm_start_source, kind="sft").set_display_name("prepare warm-start data")
    k8s.apply(warm_data, "data", params, settings, image_kind="cpu")
    given = {"lr": lr, "max_tokens": max_tokens, "batch_size": batch_size, "options": options}
    warm = sft_train(data=warm_data.outputs["dataset"], output_root=output_root, base_model=base_model,
                     steps=warm_start_steps, run_id=RUN_ID,
                     **{k: v for k, v in given.items() if v is not None}).set_display_name("warm-start SFT")
    return k8s.apply(warm, "training", params, settings, image_kind="train")


#: Inputs of the TrainJob stage (:func:`build_trainjob_stage`), without and with sao_rl's SAO settings.
TRAINJOB_STAGE = (*RL_RUN, "method", *TRAINJOB_SHAPE, *GPU_PODS)
SAO_TRAINJOB_STAGE = (*TRAINJOB_STAGE, *SAO_PARAMETERS)


def build_trainjob_stage(settings: k8s.ClusterSettings, stage: str = "sao", sao_parameters: bool = False):
    """RL as one TrainJob (``placement=trainjob``), as a graph component returning the trained model's URI.

    ``delete_trainjob`` is the exit task and ``launch_trainjob`` runs inside ``dsl.ExitHandler(cleanup)``:
    the TrainJob is deleted when the run succeeds, fails or is cancelled. KFP lets no task outside an
    ExitHandler read an output of a task inside it, so the exit task hands the model on
    (``OUTPUT_ROOT/RUN_ID/STAGE/model``; it fails when that checkpoint is incomplete). The launcher runs
    on a small CPU pod (no GPU, no GPU node) with the training deadline (the cpu role's 1 h would kill
    it); neither step is cached. The TrainJob's pods get the Kueue queue, the images and the shape.

    `stage` must be the run-directory name the single-pod component uses ("sao" for SAO, the method
    name for the GRPO family) so both placements write OUTPUT_ROOT/RUN_ID/STAGE. `sao_parameters`
    adds sao_rl's explicit SAO settings (:data:`SAO_PARAMETERS`) as inputs, passed to the launcher as
    sao_train gets them.
    """
    from components.delete_trainjob import delete_trainjob
    from components.launch_trainjob import launch_trainjob

    if sao_parameters and stage != "sao":
        raise ValueError(f"sao_parameters applies to the sao stage only, got stage {stage!r}")
    what = "SAO" if sao_parameters else "RL"

    @stage_pipeline(f"{stage}-trainjob-stage", f"{what} as one TrainJob; the exit step deletes it whatever happens "
                    "and returns the trained model's URI.", SAO_TRAINJOB_STAGE if sao_parameters else TRAINJOB_STAGE)
    def trainjob_stage(job) -> str:
        params = k8s.ClusterParams(s3_secret_name=job.s3_secret_name)
        cleanup = delete_trainjob(run_id=RUN_ID, stage=stage, output_root=job.output_root).set_display_name(
            "delete trainjob")
        k8s.apply(cleanup, "cpu", params, settings, image_kind="cpu")
        cleanup.set_caching_options(False)  # it deletes a cluster object and checks the model: always run it
        sao = pick(job, SAO_PARAMETERS) if sao_parameters else {}
        with dsl.ExitHandler(cleanup, name="trainjob"):
            launch = launch_trainjob(
                data=job.data, output_root=job.output_root, method=job.method, base_model=job.base_model,
                steps=job.steps, batch_size=job.batch_size, policy_lr=job.learning_rate, engine=job.engine,
                options=job.method_options, run_id=RUN_ID, stage=stage, queue_name=settings.queue_name,
                learner_image=settings.image("train"), rollout_image=settings.image("rollout"),
                **pick(job, TRAINJOB_SHAPE), **pick(job, GPU_PODS), timeout_s=float(settings.training_timeout_s),
                **sao).set_display_name(f"{stage} trainjob")
            k8s.apply(launch, "cpu", params, settings, image_kind="cpu")  # a CPU pod: no GPU, no GPU node
            kubernetes.set_timeout(launch, settings.training_timeout_s)  # it lives as long as the training
            launch.set_caching_options(False)
        return cleanup.outputs["model_uri"]

    return trainjob_stage


def build_rl_stage(method: str, settings: k8s.ClusterSettings):
    """The `method` ('sao' or 'grpo') RL stage with an optional warm start and a placement, as a graph component."""
    if method not in ("sao", "grpo"):
        raise ValueError(f"RL stage method must be sao or grpo, got {method!r}")
    rl_component = sao_train if method == "sao" else grpo_train
    trainjob_stage = build_trainjob_stage(settings, stage=method)  # grpo_train writes to RUN_ID/<method>

    def rl_task(stage, base_model, params):
        kwargs = dict(data=stage.data, output_root=stage.output_root, base_model=base_model, steps=stage.steps,
                      batch_size=stage.batch_size, policy_lr=stage.learning_rate, engine=stage.engine,
                      options=stage.method_options, run_id=RUN_ID)
        if method == "grpo":
            kwargs["method"] = "grpo"
        task = rl_component(**kwargs).set_display_name(f"{method} training")
        return k8s.apply(task, "training", params, settings, image_kind="rollout")

    def warm_start(stage, params):
        return warm_start_sft(stage.base_model, stage.output_root, stage.warm_start_source, stage.warm_start_steps,
                              params, settings, lr=stage.warm_start_lr, max_tokens=stage.max_tokens)

    @stage_pipeline(f"{method}-single-pod-stage", "RL in one pod (colocated rollout service) with an optional SFT "
                    "warm start; returns the model's URI.", (*RL_RUN, *WARM_START, *TRAINING_PODS))
    def single_pod_rl_stage(stage) -> str:
        params = pod_params(stage)
        with dsl.If(stage.warm_start_steps > 0, name="warm-start"):
            after_warm = rl_task(stage, warm_start(stage, params).outputs["model_uri"], params)
        with dsl.Else(name="no-warm-start"):
            cold = rl_task(stage, stage.base_model, params)
        return dsl.OneOf(after_warm.outputs["model_uri"], cold.outputs["model_uri"])

    @stage_pipeline(f"{method}-trainjob-rl-stage", "RL as one TrainJob with an optional SFT warm start (in one pod); "
                    "returns the trained model's URI.", (*RL_RUN, *WARM_START, *TRAINJOB_SHAPE, *TRAINING_PODS))
    def trainjob_rl_stage(stage) -> str:
        rl = dict(pick(stage, ("data", "output_root", *RL_TRAINING, *TRAINJOB_SHAPE, *GPU_PODS)), method=method)
        with dsl.If(stage.warm_start_steps > 0, name="warm-start"):
            warm = warm_start(stage, pod_params(stage))
            after_warm = trainjob_stage(base_model=warm.outputs["model_uri"], **rl).set_display_name(
                f"{method} trainjob")
        with dsl.Else(name="no-warm-start"):
            cold = trainjob_stage(base_model=stage.base_model, **rl).set_display_name(f"{method} trainjob")
        return dsl.OneOf(after_warm.output, cold.output)

    @stage_pipeline(f"{method}-stage", "RL training with an optional SFT warm start, in one pod or as a TrainJob; "
                    "returns the model's URI.", (*RL_RUN, *WARM_START, "placement", *TRAINJOB_SHAPE, *TRAINING_PODS))
    def rl_stage(stage) -> str:
        common = pick(stage, (*RL_RUN, *WARM_START, *TRAINING_PODS))
        with dsl.If(stage.placement == "trainjob", name="trainjob"):
            multi = trainjob_rl_stage(**common, **pick(stage, TRAINJOB_SHAPE)).set_display_name(
                f"{method} as a TrainJob (optional warm start)")
        with dsl.Else(name="single-pod"):
            single = single_pod_rl_stage(**common).set_display_name(f"{method} in one pod (optional warm start)")
        return dsl.OneOf(multi.output, single.output)

    return rl_stage


#: Descriptions of the evaluation stage's inputs that the other stages lack (or describe otherwise).
EVALUATION_DESCRIPTIONS = {
    "model": "Model reference to evaluate.",
    "benchmarks": "Benchmark names.",
    "k": "Samples per problem.",
    "limit": "First N problems of each benchmark (0 = all).",
    "engine": "vllm or hf.",
    "max_new_tokens": "Tokens per model turn.",
    "max_total_tokens": "Tokens of a whole episode.",
    "temperature": "Sampling temperature.",
    "sandbox": "SWE sandbox: kubernetes or local.",
    "previous_summary": "Earlier summary.json to compare against ('' = none).",
    "eval_options": "Other EvalConfig fields.",
    "gpu_count": "GPUs of each evaluation pod.",
    "trained_model": "The model the pipeline trained (= model), whose training run the report shows ('' = none).",
    "adapter": "LoRA adapter merged into model before it is evaluated ('' = none).",
}


def build_evaluation_stage(settings: k8s.ClusterSettings):
    """Evaluation of one model on a list of benchmarks (one parallel step each) and one report."""
    from components.evaluate import evaluate
    from components.report import report

    def describe(name: str) -> str:
        return EVALUATION_DESCRIPTIONS.get(name) or stage_description(name)

    @dsl.pipeline(name="evaluation-stage")
    @described("Evaluate `model` on each benchmark in parallel, then write one report; returns the report's URI.",
               describe)
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
        trained_model: str = "",
        adapter: str = "",
    ) -> str:
        params = k8s.ClusterParams(gpu_count=gpu_count, accelerator_type=accelerator_type,
                                   node_selector=node_selector, tolerations=tolerations,
                                   s3_secret_name=s3_secret_name)
        with dsl.ParallelFor(benchmarks, name="benchmarks") as benchmark:
            step = evaluate(model=model, adapter=adapter, output_root=output_root, benchmarks=benchmark, k=k,
                            limit=limit, engine=engine, max_new_tokens=max_new_tokens,
                            max_total_tokens=max_total_tokens, temperature=temperature, sandbox=sandbox,
                            previous_summary=previous_summary, options=eval_options,
                            run_id=RUN_ID).set_display_name("evaluate")
            k8s.apply(step, "evaluation", params, settings, image_kind="rollout")
        final = report(summaries=dsl.Collected(step.outputs["summary"]), output_root=output_root,
                       previous_summary=previous_summary, run_id=RUN_ID,
                       trained_model=trained_model).set_display_name("report")
        k8s.apply(final, "cpu", params, settings, image_kind="cpu")
        return final.outputs["report_uri"]

    return evaluation_stage
