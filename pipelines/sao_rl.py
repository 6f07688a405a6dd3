"""sao_rl: prepare -> optional SFT warm start -> SAO (in one pod or as a TrainJob) -> evaluation -> report.

The SAO path with SAO's everyday settings in the run form and the others in ``b_options`` (post_training has
them all in ``method_options``). The run form is grouped for the KFP UI, which lists fields alphabetically:
``a0_`` the two required fields (first in the form), ``a_`` what else to train on, ``b_`` SAO settings,
``c_`` evaluation, ``d_`` cluster (TrainJob shape as ``d_trainjob_*``). Past the prefix each name is the setting's
own (``b_max_staleness`` is RLConfig ``max_staleness``). The first step checks every argument as the steps
will (``check_sao_rl_arguments``): an unknown ``b_options`` key fails it, by name, before data preparation.
The RL data is prepared next; ``dsl.If(placement == "trainjob")`` picks where SAO runs: one pod with
the rollout service and the learner (``single_pod``), or one Kubeflow Trainer TrainJob with rollout
replicas and a multi-node learner, launched from a CPU pod and deleted by an ExitHandler step
(``trainjob``). Inside either, ``dsl.If(warm_start_steps > 0)`` fine-tunes the base model (in one pod)
before SAO. The trained policy is evaluated on the chosen benchmarks (one parallel step each) and one
HTML report is written. The pipeline's output is the report's URI.
"""

from kfp import dsl

from components.check_arguments import check_sao_rl_arguments
from components.prepare_data import prepare_data
from components.sao import sao_train
from pipelines._form import Field, pick, pipeline_of, shared_fields
from pipelines._stages import (
    GPU_PODS,
    RUN_ID,
    SAO_PARAMETERS,
    TRAINING_PODS,
    TRAINJOB_SHAPE,
    build_evaluation_stage,
    build_trainjob_stage,
    pod_params,
    stage_pipeline,
    warm_start_sft,
)
from sao_core.kfp import k8s
from sao_core.kfp.params import PLACEMENTS, sao_rl_description
from sao_core.learner.config import ADMISSION_RULES, ENGINES

NAME = "sao-rl"
#: Parameters whose allowed values become dropdowns in the KFP UI.
LITERALS = {"b_admission": list(ADMISSION_RULES), "d_placement": list(PLACEMENTS), "b_engine": list(ENGINES),
            "c_eval_sandbox": ["kubernetes", "local"]}
#: The run form's fields that are RLConfig settings under their own name (the description lists the others).
TOP_LEVEL_SETTINGS = {"steps", "batch_size", "policy_lr", "max_staleness", "admission", "eps_low", "eps_high",
                      "engine"}
#: The run form (the KFP UI lists the fields alphabetically: the prefixes group them; a0_ ones are required).
FORM = (
    Field.required("a0_rl_source",
                   "RL prompts (prompt, reference answer or tests, environment): a Hugging Face id, a "
                   "file, or an `s3://` URI."),
    Field.output_root("checkpoints, models and evaluations", "`OUTPUT_ROOT/RUN_ID/{sft,sao,eval-*,report}`"),
    Field("a_rl_split", str, "train", "Split of a Hugging Face RL dataset."),
    Field("a_rl_limit", int, 0, "Use at most this many RL prompts (0 = all)."),
    Field.optional("a_warm_start_source", "no warm start",
                   "SFT data (chat messages) for a warm start before SAO (`b_warm_start_steps` "
                   "sets its length)."),
    Field("b_steps", int, 100, "Optimiser steps (RL: learner steps) in total."),
    Field("b_batch_size", int, 32,
          "Trajectories per step (B), one per prompt (GRPO: groups of `group_size`)."),
    Field("b_policy_lr", float, 1e-6, "Policy learning rate (peak, after the warm-up)."),
    Field("b_max_staleness", int, 4,
          "S, the most weights versions a trained token may lag (`window` / `version_order` / `requeue` drop "
          "trajectories beyond it; `no_drop` / `fragments` drop only past the safety bound)."),
    Field("b_admission", str, "no_drop",
          "How the run admits episodes and batches them: `no_drop`, `window`, `version_order`, `requeue` or "
          "`fragments`. `no_drop` (the default): arrival order, nothing dropped or waited for, the early tokens "
          "of long episodes may lag more than S (DIS guards them; an episode older than the safety bound "
          "`hard_staleness`, default 4·S, is dropped); `window`: (S+1)·B episodes in flight, trained in arrival "
          "order, stale ones dropped; `version_order`: the oldest admission cohort first, never an episode "
          "admitted after one still running (nothing stale; the learner waits for each cohort); `requeue`: "
          "window, and a prompt dropped as stale is rolled out once more; `fragments` (sao only): long episodes "
          "are trained in pieces cut at turn boundaries, advantages bootstrapped from the critic (fewer tokens "
          "beyond S than `no_drop`, at a lower throughput)."),
    Field("b_eps_low", float, 0.3,
          "DIS band lower width: tokens with ratio <= 1 - `eps_low` are masked (0.3 math with tools, 0.8 "
          "agentic coding)."),
    Field("b_eps_high", float, 5.0,
          "DIS band upper width: tokens with ratio >= 1 + `eps_high` are masked (5.0 math with tools, 3.0 "
          "agentic coding)."),
    Field("b_engine", str, "vllm", "Rollout engine: vllm (GPU) or hf (transformers; small models, CPU)."),
    Field("b_options", dict, {},
          'Any other RLConfig setting as JSON, e.g. `{"critic_lr": 5e-6, "critic_warmup_steps": 10, '
          "\"max_total_tokens\": 32768, \"checkpoint_every\": 50}`; the pipeline's description lists every key and "
          "its default (an unknown key fails the first step)."),
    Field("b_warm_start_steps", int, 0,
          "SFT steps of the warm start (0 = no warm start; needs `a_warm_start_source`). RL from a model whose "
          "sampled reward is near 0 learns little: warm-start until it is about 0.2."),
    Field("b_warm_start_options", dict, {},
          'SFTConfig settings of the warm start as JSON (defaults `{"lr": 1e-5, "batch_size": 16, "max_tokens": '
          "512}`)."),
    Field("c_eval_options", dict, {},
          'Other evaluation settings as JSON (EvalConfig fields), e.g. `{"max_new_tokens": 4096, '
          '"max_total_tokens": 32768, "imo_answerbench_source": "s3://..."}`.'),
    Field("d_placement", str, "single_pod",
          "Where SAO runs: `single_pod` (rollout service and learner in one pod with `d_gpu_count` GPUs) or "
          "`trainjob` (one Kubeflow Trainer TrainJob shaped by `d_trainjob_*`: rollout replicas + a multi-node "
          "torchrun learner, admitted by Kueue as one workload; `a0_output_root` must be `s3://`; see "
          "deploy/README.md). The warm start runs in one pod either way."),
    Field("d_gpu_count", int, 1, "GPUs of the SFT and (`single_pod`) SAO pods (0 = none)."),
    *shared_fields("a_base_model", "c_eval_benchmarks", "c_eval_k", "c_eval_limit", "c_eval_sandbox",
                   "c_previous_summary", "d_accelerator_type", "d_eval_gpu_count",
                   "d_node_selector", "d_tolerations", "d_s3_secret_name",
                   "d_trainjob_gpus_per_node", "d_trainjob_num_nodes", "d_trainjob_rollout_gpus",
                   "d_trainjob_rollout_replicas", "d_trainjob_tensor_parallel_size"),
)



#: Inputs of sao_rl's SAO stages: the run, the warm start and (single pod) the training pods or (TrainJob) its shape.
SAO_RUN = ("data", "output_root", "base_model", "warm_start_source", "warm_start_steps", "warm_start_options",
           "steps", "batch_size", "policy_lr", *SAO_PARAMETERS, "engine", "sao_options")
SAO_SINGLE_POD = (*SAO_RUN, *TRAINING_PODS)
SAO_TRAINJOB = (*SAO_RUN, *TRAINJOB_SHAPE, *TRAINING_PODS)


def build_sao_stages(settings: k8s.ClusterSettings):
    """sao_rl's two SAO stages (single pod, TrainJob), each with the optional warm start, as graph components."""
    trainjob_stage = build_trainjob_stage(settings, "sao", sao_parameters=True)

    def warm_start(stage):
        return warm_start_sft(stage.base_model, stage.output_root, stage.warm_start_source, stage.warm_start_steps,
                              pod_params(stage), settings, options=stage.warm_start_options)

    @stage_pipeline("sao-single-pod-stage", "SAO in one pod (colocated rollout service) with an optional SFT warm "
                    "start; returns the model's URI.", SAO_SINGLE_POD)
    def sao_single_pod(stage) -> str:
        params = pod_params(stage)
        sao = dict(pick(stage, ("data", "output_root", "steps", "batch_size", "policy_lr", *SAO_PARAMETERS, "engine")),
                   options=stage.sao_options, run_id=RUN_ID)
        with dsl.If(stage.warm_start_steps > 0, name="warm-start"):
            after_warm = sao_train(base_model=warm_start(stage).outputs["model_uri"], **sao)
            k8s.apply(after_warm.set_display_name("sao training"), "training", params, settings,
                      image_kind="rollout")
        with dsl.Else(name="no-warm-start"):
            cold = sao_train(base_model=stage.base_model, **sao)
            k8s.apply(cold.set_display_name("sao training"), "training", params, settings, image_kind="rollout")
        return dsl.OneOf(after_warm.outputs["model_uri"], cold.outputs["model_uri"])

    @stage_pipeline("sao-trainjob-rl-stage", "SAO as one TrainJob with an optional SFT warm start (in one pod); "
                    "returns the trained model's URI.", SAO_TRAINJOB)
    def sao_trainjob(stage) -> str:
        sao = dict(pick(stage, ("data", "output_root", "steps", "batch_size", *SAO_PARAMETERS, "engine",
                                *TRAINJOB_SHAPE, *GPU_PODS)),
                   method="sao", learning_rate=stage.policy_lr, method_options=stage.sao_options)
        with dsl.If(stage.warm_start_steps > 0, name="warm-start"):
            after_warm = trainjob_stage(base_model=warm_start(stage).outputs["model_uri"], **sao).set_display_name(
                "sao trainjob")
        with dsl.Else(name="no-warm-start"):
            cold = trainjob_stage(base_model=stage.base_model, **sao).set_display_name("sao trainjob")
        return dsl.OneOf(after_warm.output, cold.output)

    return sao_single_pod, sao_trainjob


def build_sao_rl(settings: k8s.ClusterSettings | None = None):
    """The sao_rl pipeline with these compile-time Kubernetes settings."""
    settings = settings or k8s.ClusterSettings()
    settings.validate()
    evaluation_stage = build_evaluation_stage(settings)
    sao_single_pod, sao_trainjob = build_sao_stages(settings)

    @pipeline_of(NAME, "SAO end to end: data preparation, optional SFT warm start, SAO training, evaluation and a "
                 "report.", FORM, description=sao_rl_description(TOP_LEVEL_SETTINGS))
    def sao_rl(form) -> str:
        params = k8s.ClusterParams(gpu_count=form.d_gpu_count, accelerator_type=form.d_accelerator_type,
                                   node_selector=form.d_node_selector, tolerations=form.d_tolerations,
                                   s3_secret_name=form.d_s3_secret_name)
        shape = dict(num_nodes=form.d_trainjob_num_nodes, gpus_per_node=form.d_trainjob_gpus_per_node,
                     rollout_replicas=form.d_trainjob_rollout_replicas, rollout_gpus=form.d_trainjob_rollout_gpus,
                     tensor_parallel_size=form.d_trainjob_tensor_parallel_size)
        check = check_sao_rl_arguments(
            output_root=form.a0_output_root, steps=form.b_steps, batch_size=form.b_batch_size,
            policy_lr=form.b_policy_lr, max_staleness=form.b_max_staleness, admission=form.b_admission,
            eps_low=form.b_eps_low, eps_high=form.b_eps_high, engine=form.b_engine,
            warm_start_source=form.a_warm_start_source, warm_start_steps=form.b_warm_start_steps,
            options=form.b_options, warm_start_options=form.b_warm_start_options, eval_options=form.c_eval_options,
            placement=form.d_placement, **shape, s3_secret_name=form.d_s3_secret_name)
        k8s.apply(check.set_display_name("check arguments"), "cpu", params, settings, image_kind="cpu")
        rl_data = prepare_data(source=form.a0_rl_source, kind="rl", split=form.a_rl_split,
                               limit=form.a_rl_limit).after(check)
        k8s.apply(rl_data.set_display_name("prepare rl data"), "data", params, settings, image_kind="cpu")
        stage = dict(
            data=rl_data.outputs["dataset"], output_root=form.a0_output_root, base_model=form.a_base_model,
            warm_start_source=form.a_warm_start_source, warm_start_steps=form.b_warm_start_steps,
            warm_start_options=form.b_warm_start_options, steps=form.b_steps, batch_size=form.b_batch_size,
            policy_lr=form.b_policy_lr, max_staleness=form.b_max_staleness, admission=form.b_admission,
            eps_low=form.b_eps_low, eps_high=form.b_eps_high, engine=form.b_engine, sao_options=form.b_options,
            gpu_count=form.d_gpu_count, accelerator_type=form.d_accelerator_type, node_selector=form.d_node_selector,
            tolerations=form.d_tolerations, s3_secret_name=form.d_s3_secret_name)
        with dsl.If(form.d_placement == "trainjob", name="trainjob"):
            multi = sao_trainjob(**stage, **shape).set_display_name("sao as a TrainJob (optional warm start)")
        with dsl.Else(name="single-pod"):
            single = sao_single_pod(**stage).set_display_name("sao in one pod (optional warm start)")
        trained = dsl.OneOf(multi.output, single.output)
        # max_new_tokens / max_total_tokens at the evaluate component's defaults: c_eval_options may set them.
        evaluation = evaluation_stage(
            model=trained, output_root=form.a0_output_root, benchmarks=form.c_eval_benchmarks, k=form.c_eval_k,
            limit=form.c_eval_limit, engine=form.b_engine, max_new_tokens=4096, max_total_tokens=32768,
            temperature=1.0, sandbox=form.c_eval_sandbox, previous_summary=form.c_previous_summary,
            eval_options=form.c_eval_options, gpu_count=form.d_eval_gpu_count,
            accelerator_type=form.d_accelerator_type, node_selector=form.d_node_selector,
            tolerations=form.d_tolerations, s3_secret_name=form.d_s3_secret_name,
            trained_model=trained).set_display_name("evaluation")
        return evaluation.output

    return sao_rl


sao_rl = build_sao_rl()
