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
DEFAULT_EVAL_BENCHMARKS = ["swe_verified", "beyond_aime", "imo_answerbench"]


def build_post_training(settings: k8s.ClusterSettings | None = None):
    """The post_training pipeline with these compile-time Kubernetes settings."""
    settings = settings or k8s.ClusterSettings()
    settings.validate()
    sao_stage = build_rl_stage("sao", settings)
    grpo_stage = build_rl_stage("grpo", settings)
    evaluation_stage = build_evaluation_stage(settings)

    @dsl.pipeline(name=NAME, description=DESCRIPTION)
    def post_training(
        a0_train_source: str,
        a0_output_root: str,
        a_base_model: str = "embedded:tiny",
        a_method: str = "sao",
        a_reference_model: str = "",
        a_teacher_model: str = "",
        a_train_limit: int = 0,
        a_train_split: str = "train",
        a_warm_start_source: str = "",
        b_batch_size: int = 16,
        b_engine: str = "vllm",
        b_learning_rate: float = 1e-5,
        b_max_tokens: int = 512,
        b_method_options: dict = {},  # noqa: B006 (a pipeline parameter's default, never mutated)
        b_steps: int = 100,
        b_warm_start_lr: float = 1e-5,
        b_warm_start_steps: int = 0,
        c_eval_benchmarks: list = DEFAULT_EVAL_BENCHMARKS,  # noqa: B006
        c_eval_k: int = 4,
        c_eval_limit: int = 0,
        c_eval_max_new_tokens: int = 4096,
        c_eval_max_total_tokens: int = 32768,
        c_eval_options: dict = {},  # noqa: B006
        c_eval_sandbox: str = "kubernetes",
        c_previous_summary: str = "",
        c_run_evaluation: bool = True,
        d_accelerator_type: str = "nvidia.com/gpu",
        d_eval_gpu_count: int = 1,
        d_gpu_count: int = 1,
        d_node_selector: dict = {},  # noqa: B006
        d_placement: str = "single_pod",
        d_s3_secret_name: str = "sao-s3",
        d_tolerations: list = [],  # noqa: B006
        d_trainjob_gpus_per_node: int = 8,
        d_trainjob_num_nodes: int = 1,
        d_trainjob_rollout_gpus: int = 1,
        d_trainjob_rollout_replicas: int = 2,
        d_trainjob_tensor_parallel_size: int = 1,
    ) -> str:
        """Post-train a model with the method picked in the run form: SFT, CPT, DPO, GKD, GRPO or SAO.

        Args:
            a0_train_source: Required. Training data: a Hugging Face id, a file, or an `s3://` URI; its rows must fit the method's kind (sft and gkd: chat messages; cpt: text; dpo: prompt/chosen/rejected; grpo and sao: rl prompts with answers or tests).
            a0_output_root: Required. Where checkpoints and models are written: `s3://bucket/prefix` in a cluster (a local directory for local runs). Each run writes `OUTPUT_ROOT/RUN_ID/METHOD`.
            a_base_model: Model to start from: `embedded:tiny`, an `s3://` checkpoint, a directory or a Hugging Face id.
            a_method: Training method: sft, cpt, dpo, gkd, grpo (synchronous GRPO baseline) or sao (Single-rollout Asynchronous Optimization).
            a_reference_model: Optional; empty = the initial policy. dpo only: the reference policy.
            a_teacher_model: Optional; empty = none, but gkd requires it: the teacher model, sharing the tokenizer.
            a_train_limit: Use at most this many training rows (0 = all).
            a_train_split: Split of a Hugging Face training dataset.
            a_warm_start_source: Optional; empty = no warm start. grpo and sao: SFT data for a warm start before RL (`b_warm_start_steps` sets its length).
            b_batch_size: Examples per step (sft, cpt, dpo, gkd) or trajectories per step (grpo, sao).
            b_engine: Rollout engine of grpo and sao: vllm (GPU) or hf (transformers).
            b_learning_rate: Peak learning rate; for grpo and sao the policy learning rate.
            b_max_tokens: Token limit of examples (sft, cpt, dpo, gkd and the warm start).
            b_method_options: Other settings of the chosen method as JSON (fields of its config), e.g. `{"beta": 0.1}` for dpo, `{"critic_lr": 5e-6, "max_staleness": 4}` or `{"admission": "version_order"}` for sao, `{"group_size": 8}` for grpo.
            b_steps: Optimiser steps (sft, cpt, dpo, gkd) or learner steps (grpo, sao).
            b_warm_start_lr: Learning rate of the warm-start SFT.
            b_warm_start_steps: grpo and sao: SFT steps of the warm start (0 = no warm start; needs `a_warm_start_source`).
            c_eval_benchmarks: Benchmarks of the final evaluation: `swe_verified`, `beyond_aime`, `imo_answerbench`.
            c_eval_k: Samples per problem in the evaluation.
            c_eval_limit: Evaluate only the first N problems of each benchmark (0 = all).
            c_eval_max_new_tokens: Evaluation: tokens per model turn.
            c_eval_max_total_tokens: Evaluation: tokens of a whole episode.
            c_eval_options: Other evaluation settings as JSON (EvalConfig fields), e.g. `{"concurrency": 32}`.
            c_eval_sandbox: Where SWE-Bench agent commands and tests run: kubernetes (one pod per episode) or local (bubblewrap in the evaluation pod).
            c_previous_summary: Optional; empty = no comparison. `summary.json` of an earlier evaluation (path or `s3://`) to compare against in the report.
            c_run_evaluation: Evaluate the trained model at the end (one step per benchmark, then a report).
            d_accelerator_type: Kubernetes resource name of the GPUs, e.g. `nvidia.com/gpu`.
            d_eval_gpu_count: GPUs of each evaluation pod (0 = none).
            d_gpu_count: GPUs of each training pod (0 = none).
            d_node_selector: Node labels the GPU pods require (a TrainJob: every pod), e.g. `{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}`.
            d_placement: grpo and sao: where the RL step runs: `single_pod` (rollout service and learner in one pod with `d_gpu_count` GPUs) or `trainjob` (one Kubeflow Trainer TrainJob shaped by `d_trainjob_*`: rollout replicas + a multi-node torchrun learner, admitted by Kueue as one workload; `a0_output_root` must be `s3://`; see deploy/README.md). The warm start runs in one pod either way.
            d_s3_secret_name: Kubernetes Secret with the S3 credentials: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (+ `AWS_ENDPOINT_URL`, `AWS_DEFAULT_REGION`).
            d_tolerations: Tolerations of the GPU pods (a TrainJob: every pod), e.g. `[{"key": "nvidia.com/gpu", "operator": "Exists"}]`.
            d_trainjob_gpus_per_node: `d_placement=trainjob`: GPUs per learner node = torchrun processes per node (0: one CPU process).
            d_trainjob_num_nodes: `d_placement=trainjob`: Learner nodes (pods of the node job); `torchrun --nnodes`.
            d_trainjob_rollout_gpus: `d_placement=trainjob`: GPUs per rollout replica (vllm: `tensor_parallel_size` x `data_parallel_size`).
            d_trainjob_rollout_replicas: `d_placement=trainjob`: Rollout service replicas (one pod and one Job each).
            d_trainjob_tensor_parallel_size: `d_placement=trainjob`: VLLM tensor-parallel size inside one replica.
        """
        # The run form's grouped names (a_ inputs, b_ method, c_ evaluation, d_ cluster), as the steps name them.
        train_source = a0_train_source
        output_root = a0_output_root
        method = a_method
        base_model = a_base_model
        train_split = a_train_split
        train_limit = a_train_limit
        reference_model = a_reference_model
        teacher_model = a_teacher_model
        warm_start_source = a_warm_start_source
        steps = b_steps
        batch_size = b_batch_size
        learning_rate = b_learning_rate
        max_tokens = b_max_tokens
        engine = b_engine
        method_options = b_method_options
        warm_start_steps = b_warm_start_steps
        warm_start_lr = b_warm_start_lr
        run_evaluation = c_run_evaluation
        eval_benchmarks = c_eval_benchmarks
        eval_k = c_eval_k
        eval_limit = c_eval_limit
        eval_max_new_tokens = c_eval_max_new_tokens
        eval_max_total_tokens = c_eval_max_total_tokens
        eval_sandbox = c_eval_sandbox
        eval_options = c_eval_options
        previous_summary = c_previous_summary
        placement = d_placement
        gpu_count = d_gpu_count
        eval_gpu_count = d_eval_gpu_count
        accelerator_type = d_accelerator_type
        node_selector = d_node_selector
        tolerations = d_tolerations
        s3_secret_name = d_s3_secret_name
        num_nodes = d_trainjob_num_nodes
        gpus_per_node = d_trainjob_gpus_per_node
        rollout_replicas = d_trainjob_rollout_replicas
        rollout_gpus = d_trainjob_rollout_gpus
        tensor_parallel_size = d_trainjob_tensor_parallel_size
        params = k8s.ClusterParams(gpu_count=gpu_count, accelerator_type=accelerator_type,
                                   node_selector=node_selector, tolerations=tolerations,
                                   s3_secret_name=s3_secret_name)
        check = check_post_training_arguments(
            method=method, output_root=output_root, steps=steps, batch_size=batch_size,
            learning_rate=learning_rate, max_tokens=max_tokens, engine=engine, warm_start_source=warm_start_source,
            warm_start_steps=warm_start_steps, method_options=method_options, placement=placement,
            num_nodes=num_nodes, gpus_per_node=gpus_per_node, rollout_replicas=rollout_replicas,
            rollout_gpus=rollout_gpus, tensor_parallel_size=tensor_parallel_size,
            s3_secret_name=s3_secret_name).set_display_name("check arguments")
        k8s.apply(check, "cpu", params, settings, image_kind="cpu")
        data = prepare_data(source=train_source, kind=check.outputs["data_kind"], split=train_split,
                            limit=train_limit).set_display_name("prepare training data")
        k8s.apply(data, "data", params, settings, image_kind="cpu")
        dataset = data.outputs["dataset"]
        common = dict(data=dataset, output_root=output_root, base_model=base_model, steps=steps,
                      batch_size=batch_size, lr=learning_rate, max_tokens=max_tokens, options=method_options,
                      run_id=RUN_ID)
        rl_common = dict(data=dataset, output_root=output_root, base_model=base_model, steps=steps,
                         batch_size=batch_size, learning_rate=learning_rate, engine=engine,
                         method_options=method_options, warm_start_source=warm_start_source,
                         warm_start_steps=warm_start_steps, warm_start_lr=warm_start_lr, max_tokens=max_tokens,
                         placement=placement, num_nodes=num_nodes, gpus_per_node=gpus_per_node,
                         rollout_replicas=rollout_replicas, rollout_gpus=rollout_gpus,
                         tensor_parallel_size=tensor_parallel_size, gpu_count=gpu_count, accelerator_type=accelerator_type, node_selector=node_selector,
                         tolerations=tolerations, s3_secret_name=s3_secret_name)
        with dsl.If(method == "sft", name="sft"):
            sft = k8s.apply(sft_train(**common).set_display_name("sft training"), "training", params, settings,
                            image_kind="train")
        with dsl.Elif(method == "cpt", name="cpt"):
            cpt = k8s.apply(cpt_train(**common).set_display_name("cpt training"), "training", params, settings,
                            image_kind="train")
        with dsl.Elif(method == "dpo", name="dpo"):
            dpo = k8s.apply(dpo_train(**common, reference_model=reference_model).set_display_name("dpo training"),
                            "training", params, settings, image_kind="train")
        with dsl.Elif(method == "gkd", name="gkd"):
            gkd = k8s.apply(gkd_train(**common, teacher_model=teacher_model).set_display_name("gkd training"),
                            "training", params, settings, image_kind="train")
        with dsl.Elif(method == "grpo", name="grpo"):
            grpo = grpo_stage(**rl_common).set_display_name("grpo (optional warm start)")
        with dsl.Else(name="sao"):  # the argument check has refused every other value
            sao = sao_stage(**rl_common).set_display_name("sao (optional warm start)")
        trained = dsl.OneOf(sft.outputs["model_uri"], cpt.outputs["model_uri"], dpo.outputs["model_uri"],
                            gkd.outputs["model_uri"], grpo.output, sao.output)
        with dsl.If(run_evaluation == True, name="evaluate"):  # noqa: E712 (a KFP condition, not a Python test)
            evaluation_stage(model=trained, output_root=output_root, benchmarks=eval_benchmarks, k=eval_k,
                             limit=eval_limit, engine=engine, max_new_tokens=eval_max_new_tokens,
                             max_total_tokens=eval_max_total_tokens, temperature=1.0, sandbox=eval_sandbox,
                             previous_summary=previous_summary, eval_options=eval_options,
                             gpu_count=eval_gpu_count, accelerator_type=accelerator_type,
                             node_selector=node_selector, tolerations=tolerations,
                             s3_secret_name=s3_secret_name, trained_model=trained).set_display_name("evaluation")
        return trained

    return post_training


post_training = build_post_training()
