"""post_training: pick a method (sft | cpt | dpo | gkd | grpo | sao) in the run form and train.

Steps: check the arguments for the chosen method (seconds, CPU) -> prepare the training data with the
method's data kind -> one ``dsl.If``/``dsl.Elif``/``dsl.Else`` branch per method (grpo and sao with
an optional SFT warm start, in one pod or, with ``placement=trainjob``, as one Kubeflow Trainer
TrainJob) -> evaluation of the trained model (one parallel step per benchmark) and
a report. The pipeline's output is the trained model's URI. ``a_method`` is a dropdown in the KFP
UI (and ``d_placement``): :func:`sao_core.kfp.spec.compile_pipeline` patches their ``literals`` into the
compiled spec. The run form's fields are grouped by prefix because the UI lists them alphabetically: a0_
the two required fields (first), a_ inputs and method, b_ method settings, c_ evaluation, d_ cluster.
"""

from kfp import dsl

from components.check_arguments import check_post_training_arguments
from components.cpt import cpt_train
from components.dpo import dpo_train
from components.gkd import gkd_train
from components.prepare_data import prepare_data
from components.sft import sft_train
from pipelines._form import Field, pipeline_of, shared_fields
from pipelines._stages import RUN_ID, build_evaluation_stage, build_rl_stage
from sao_core.kfp import k8s
from sao_core.kfp.params import PLACEMENTS, POST_TRAINING_METHODS
from sao_core.learner.config import ENGINES

NAME = "sao-post-training"
#: Parameters whose allowed values become dropdowns in the KFP UI.
LITERALS = {"a_method": list(POST_TRAINING_METHODS), "d_placement": list(PLACEMENTS), "b_engine": list(ENGINES),
            "c_eval_sandbox": ["kubernetes", "local"]}
#: The pipeline's description in the KFP UI (the fields' own descriptions are in the IR and pipelines/README.md).
DESCRIPTION = (
    "Required: `a0_train_source` and `a0_output_root`; the method: `a_method`.\n\n"
    "Post-train a model with the method picked in `a_method`: sft, cpt, dpo, gkd, grpo or sao. The two `a0_` fields "
    "come first in the form; every other field has a default. Fields are grouped by prefix, in the order listed: "
    "`a0_` required, `a_` what to train on, how and where to write; `b_` method settings; `c_` evaluation; `d_` "
    "cluster (TrainJob shape `d_trainjob_*`). `b_method_options` takes the chosen method's other settings as JSON "
    "(SFTConfig / CPTConfig / DPOConfig / GKDConfig / RLConfig fields, each listed with its default in "
    "components/README.md, Settings reference); an unknown key fails the first step, naming it. Every field is "
    "described in pipelines/README.md.")
#: The run form (the KFP UI lists the fields alphabetically: the prefixes group them; a0_ ones are required).
FORM = (
    Field.required("a0_train_source",
                   "Training data: a Hugging Face id, a file, or an `s3://` URI; its rows must fit the "
                   "method's kind (sft and gkd: chat messages; cpt: text; dpo: prompt/chosen/rejected; "
                   "grpo and sao: rl prompts with answers or tests)."),
    Field.output_root("checkpoints and models", "`OUTPUT_ROOT/RUN_ID/METHOD`"),
    Field("a_method", str, "sao",
          "Training method: sft, cpt, dpo, gkd, grpo (synchronous GRPO baseline) or sao (Single-rollout "
          "Asynchronous Optimization)."),
    Field.optional("a_reference_model", "the initial policy", "dpo only: the reference policy."),
    Field("a_teacher_model", str, "",
          "Optional; empty = none, but gkd requires it: the teacher model, sharing the tokenizer."),
    Field("a_train_limit", int, 0, "Use at most this many training rows (0 = all)."),
    Field("a_train_split", str, "train", "Split of a Hugging Face training dataset."),
    Field.optional("a_warm_start_source", "no warm start",
                   "grpo and sao: SFT data for a warm start before RL (`b_warm_start_steps` sets "
                   "its length)."),
    Field("b_batch_size", int, 16,
          "Examples per step (sft, cpt, dpo, gkd) or trajectories per step (grpo, sao)."),
    Field("b_engine", str, "vllm", "Rollout engine of grpo and sao: vllm (GPU) or hf (transformers)."),
    Field("b_learning_rate", float, 1e-5, "Peak learning rate; for grpo and sao the policy learning rate."),
    Field("b_max_tokens", int, 512, "Token limit of examples (sft, cpt, dpo, gkd and the warm start)."),
    Field("b_method_options", dict, {},
          'Other settings of the chosen method as JSON (fields of its config), e.g. `{"beta": 0.1}` for dpo, '
          '`{"critic_lr": 5e-6, "max_staleness": 4}` or `{"admission": "version_order"}` for sao, '
          '`{"group_size": 8}` for grpo.'),
    Field("b_steps", int, 100, "Optimiser steps (sft, cpt, dpo, gkd) or learner steps (grpo, sao)."),
    Field("b_warm_start_lr", float, 1e-5, "Learning rate of the warm-start SFT."),
    Field("b_warm_start_steps", int, 0,
          "grpo and sao: SFT steps of the warm start (0 = no warm start; needs `a_warm_start_source`)."),
    Field("c_eval_max_new_tokens", int, 4096, "Evaluation: tokens per model turn."),
    Field("c_eval_max_total_tokens", int, 32768, "Evaluation: tokens of a whole episode."),
    Field("c_eval_options", dict, {},
          'Other evaluation settings as JSON (EvalConfig fields), e.g. `{"concurrency": 32}`.'),
    Field("c_run_evaluation", bool, True,
          "Evaluate the trained model at the end (one step per benchmark, then a report)."),
    Field("d_gpu_count", int, 1, "GPUs of each training pod (0 = none)."),
    Field("d_placement", str, "single_pod",
          "grpo and sao: where the RL step runs: `single_pod` (rollout service and learner in one pod with "
          "`d_gpu_count` GPUs) or `trainjob` (one Kubeflow Trainer TrainJob shaped by `d_trainjob_*`: rollout "
          "replicas + a multi-node torchrun learner, admitted by Kueue as one workload; `a0_output_root` must "
          "be `s3://`; see deploy/README.md). The warm start runs in one pod either way."),
    *shared_fields("a_base_model", "c_eval_benchmarks", "c_eval_k", "c_eval_limit", "c_eval_sandbox",
                   "c_previous_summary", "d_accelerator_type", "d_eval_gpu_count",
                   "d_node_selector", "d_tolerations", "d_s3_secret_name",
                   "d_trainjob_gpus_per_node", "d_trainjob_num_nodes", "d_trainjob_rollout_gpus",
                   "d_trainjob_rollout_replicas", "d_trainjob_tensor_parallel_size"),
)




def build_post_training(settings: k8s.ClusterSettings | None = None):
    """The post_training pipeline with these compile-time Kubernetes settings."""
    settings = settings or k8s.ClusterSettings()
    settings.validate()
    sao_stage = build_rl_stage("sao", settings)
    grpo_stage = build_rl_stage("grpo", settings)
    evaluation_stage = build_evaluation_stage(settings)

    def train(form, dataset, params):
        """One branch per method (the argument check has refused every other value); the trained model's URI."""
        common = dict(data=dataset, output_root=form.a0_output_root, base_model=form.a_base_model,
                      steps=form.b_steps, batch_size=form.b_batch_size, lr=form.b_learning_rate,
                      max_tokens=form.b_max_tokens, options=form.b_method_options, run_id=RUN_ID)
        rl_common = dict(
            data=dataset, output_root=form.a0_output_root, base_model=form.a_base_model, steps=form.b_steps,
            batch_size=form.b_batch_size, learning_rate=form.b_learning_rate, engine=form.b_engine,
            method_options=form.b_method_options, warm_start_source=form.a_warm_start_source,
            warm_start_steps=form.b_warm_start_steps, warm_start_lr=form.b_warm_start_lr,
            max_tokens=form.b_max_tokens, placement=form.d_placement, num_nodes=form.d_trainjob_num_nodes,
            gpus_per_node=form.d_trainjob_gpus_per_node, rollout_replicas=form.d_trainjob_rollout_replicas,
            rollout_gpus=form.d_trainjob_rollout_gpus, tensor_parallel_size=form.d_trainjob_tensor_parallel_size,
            gpu_count=form.d_gpu_count, accelerator_type=form.d_accelerator_type,
            node_selector=form.d_node_selector, tolerations=form.d_tolerations, s3_secret_name=form.d_s3_secret_name)
        with dsl.If(form.a_method == "sft", name="sft"):
            sft = k8s.apply(sft_train(**common).set_display_name("sft training"), "training", params, settings,
                            image_kind="train")
        with dsl.Elif(form.a_method == "cpt", name="cpt"):
            cpt = k8s.apply(cpt_train(**common).set_display_name("cpt training"), "training", params, settings,
                            image_kind="train")
        with dsl.Elif(form.a_method == "dpo", name="dpo"):
            dpo = k8s.apply(dpo_train(**common, reference_model=form.a_reference_model).set_display_name(
                "dpo training"), "training", params, settings, image_kind="train")
        with dsl.Elif(form.a_method == "gkd", name="gkd"):
            gkd = k8s.apply(gkd_train(**common, teacher_model=form.a_teacher_model).set_display_name(
                "gkd training"), "training", params, settings, image_kind="train")
        with dsl.Elif(form.a_method == "grpo", name="grpo"):
            grpo = grpo_stage(**rl_common).set_display_name("grpo (optional warm start)")
        with dsl.Else(name="sao"):  # the argument check has refused every other value
            sao = sao_stage(**rl_common).set_display_name("sao (optional warm start)")
        return dsl.OneOf(sft.outputs["model_uri"], cpt.outputs["model_uri"], dpo.outputs["model_uri"],
                         gkd.outputs["model_uri"], grpo.output, sao.output)

    @pipeline_of(NAME, "Post-train a model with the method picked in the run form: SFT, CPT, DPO, GKD, GRPO or SAO.",
                 FORM, description=DESCRIPTION)
    def post_training(form) -> str:
        params = k8s.ClusterParams(gpu_count=form.d_gpu_count, accelerator_type=form.d_accelerator_type,
                                   node_selector=form.d_node_selector, tolerations=form.d_tolerations,
                                   s3_secret_name=form.d_s3_secret_name)
        check = check_post_training_arguments(
            method=form.a_method, output_root=form.a0_output_root, steps=form.b_steps, batch_size=form.b_batch_size,
            learning_rate=form.b_learning_rate, max_tokens=form.b_max_tokens, engine=form.b_engine,
            warm_start_source=form.a_warm_start_source, warm_start_steps=form.b_warm_start_steps,
            method_options=form.b_method_options, placement=form.d_placement, num_nodes=form.d_trainjob_num_nodes,
            gpus_per_node=form.d_trainjob_gpus_per_node, rollout_replicas=form.d_trainjob_rollout_replicas,
            rollout_gpus=form.d_trainjob_rollout_gpus, tensor_parallel_size=form.d_trainjob_tensor_parallel_size,
            s3_secret_name=form.d_s3_secret_name).set_display_name("check arguments")
        k8s.apply(check, "cpu", params, settings, image_kind="cpu")
        data = prepare_data(source=form.a0_train_source, kind=check.outputs["data_kind"], split=form.a_train_split,
                            limit=form.a_train_limit).set_display_name("prepare training data")
        k8s.apply(data, "data", params, settings, image_kind="cpu")
        trained = train(form, data.outputs["dataset"], params)
        with dsl.If(form.c_run_evaluation == True, name="evaluate"):  # noqa: E712 (a KFP condition, not a Python test)
            evaluation_stage(
                model=trained, output_root=form.a0_output_root, benchmarks=form.c_eval_benchmarks, k=form.c_eval_k,
                limit=form.c_eval_limit, engine=form.b_engine, max_new_tokens=form.c_eval_max_new_tokens,
                max_total_tokens=form.c_eval_max_total_tokens, temperature=1.0, sandbox=form.c_eval_sandbox,
                previous_summary=form.c_previous_summary, eval_options=form.c_eval_options,
                gpu_count=form.d_eval_gpu_count, accelerator_type=form.d_accelerator_type,
                node_selector=form.d_node_selector, tolerations=form.d_tolerations,
                s3_secret_name=form.d_s3_secret_name, trained_model=trained).set_display_name("evaluation")
        return trained

    return post_training


post_training = build_post_training()
