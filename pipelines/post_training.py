"""post_training: pick a method (sft | cpt | dpo | gkd | grpo | sao) in the run form and train.

Steps: check the arguments for the chosen method (seconds, CPU) -> prepare the training data with the
method's data kind -> one ``dsl.If``/``dsl.Elif``/``dsl.Else`` branch per method (grpo and sao with
an optional SFT warm start, in one pod or, with ``placement=trainjob``, as one Kubeflow Trainer
TrainJob) -> evaluation of the trained model (one parallel step per benchmark) and
a report. The pipeline's output is the trained model's URI. ``method`` is a dropdown in the KFP
UI (and ``placement``): :func:`sao_core.kfp.spec.compile_pipeline` patches their ``literals`` into the
compiled spec.
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

NAME = "sao-post-training"
#: Parameters whose allowed values become dropdowns in the KFP UI.
LITERALS = {"method": list(POST_TRAINING_METHODS), "placement": list(PLACEMENTS), "engine": ["vllm", "hf"],
            "eval_sandbox": ["kubernetes", "local"]}
DEFAULT_EVAL_BENCHMARKS = ["swe_verified", "beyond_aime", "imo_answerbench"]


def build_post_training(settings: k8s.ClusterSettings | None = None):
    """The post_training pipeline with these compile-time Kubernetes settings."""
    settings = settings or k8s.ClusterSettings()
    settings.validate()
    sao_stage = build_rl_stage("sao", settings)
    grpo_stage = build_rl_stage("grpo", settings)
    evaluation_stage = build_evaluation_stage(settings)

    @dsl.pipeline(name=NAME)
    def post_training(
        train_source: str,
        output_root: str,
        method: str = "sao",
        base_model: str = "embedded:tiny",
        train_split: str = "train",
        train_limit: int = 0,
        steps: int = 100,
        batch_size: int = 16,
        learning_rate: float = 1e-5,
        max_tokens: int = 512,
        engine: str = "vllm",
        method_options: dict = {},  # noqa: B006 (a pipeline parameter's default, never mutated)
        reference_model: str = "",
        teacher_model: str = "",
        warm_start_source: str = "",
        warm_start_steps: int = 0,
        warm_start_lr: float = 1e-5,
        placement: str = "single_pod",
        num_nodes: int = 1,
        gpus_per_node: int = 8,
        rollout_replicas: int = 2,
        rollout_gpus: int = 1,
        tensor_parallel_size: int = 1,
        run_evaluation: bool = True,
        eval_benchmarks: list = DEFAULT_EVAL_BENCHMARKS,  # noqa: B006
        eval_k: int = 4,
        eval_limit: int = 0,
        eval_max_new_tokens: int = 4096,
        eval_max_total_tokens: int = 32768,
        eval_sandbox: str = "kubernetes",
        eval_options: dict = {},  # noqa: B006
        previous_summary: str = "",
        gpu_count: int = 1,
        eval_gpu_count: int = 1,
        accelerator_type: str = "nvidia.com/gpu",
        node_selector: dict = {},  # noqa: B006
        tolerations: list = [],  # noqa: B006
        s3_secret_name: str = "sao-s3",
    ) -> str:
        """Post-train a model with the method picked in the run form: SFT, CPT, DPO, GKD, GRPO or SAO.

        Args:
            train_source: Training data: a Hugging Face id, a file, or an s3:// URI; its rows must fit the method's kind (sft and gkd: chat messages; cpt: text; dpo: prompt/chosen/rejected; grpo and sao: rl prompts with answers or tests).
            output_root: Where checkpoints and models are written: s3://bucket/prefix in a cluster (a local directory for local runs). Each run writes OUTPUT_ROOT/RUN_ID/METHOD.
            method: Training method: sft, cpt, dpo, gkd, grpo (synchronous GRPO baseline) or sao (Single-rollout Asynchronous Optimization).
            base_model: Model to start from: embedded:tiny, an s3:// checkpoint, a directory or a Hugging Face id.
            train_split: Split of a Hugging Face training dataset.
            train_limit: Use at most this many training rows (0 = all).
            steps: Optimiser steps (sft, cpt, dpo, gkd) or learner steps (grpo, sao).
            batch_size: Examples per step (sft, cpt, dpo, gkd) or trajectories per step (grpo, sao).
            learning_rate: Peak learning rate; for grpo and sao the policy learning rate.
            max_tokens: Token limit of examples (sft, cpt, dpo, gkd and the warm start).
            engine: Rollout engine of grpo and sao: vllm (GPU) or hf (transformers).
            method_options: Other settings of the chosen method as JSON (fields of its config), e.g. {"beta": 0.1} for dpo, {"critic_lr": 5e-6, "max_staleness": 4} or {"admission": "version_order"} for sao, {"group_size": 8} for grpo.
            reference_model: dpo only: reference policy ('' = the initial policy).
            teacher_model: gkd only (required there): teacher model reference sharing the tokenizer.
            warm_start_source: grpo and sao: SFT data for a warm start before RL ('' = none).
            warm_start_steps: grpo and sao: SFT steps of the warm start (0 = no warm start).
            warm_start_lr: Learning rate of the warm-start SFT.
            placement: grpo and sao: where the RL step runs: single_pod (rollout service and learner in one pod with gpu_count GPUs) or trainjob (one Kubeflow Trainer TrainJob: rollout replicas + a multi-node torchrun learner, admitted by Kueue as one workload; output_root must be s3://; see deploy/README.md). The warm start runs in one pod either way.
            num_nodes: placement=trainjob: Learner nodes (pods of the node job); torchrun --nnodes.
            gpus_per_node: placement=trainjob: GPUs per learner node = torchrun processes per node (0: one CPU process).
            rollout_replicas: placement=trainjob: Rollout service replicas (one pod and one Job each).
            rollout_gpus: placement=trainjob: GPUs per rollout replica (vllm: tensor_parallel_size x data_parallel_size).
            tensor_parallel_size: placement=trainjob: VLLM tensor-parallel size inside one replica.
            run_evaluation: Evaluate the trained model at the end (one step per benchmark, then a report).
            eval_benchmarks: Benchmarks of the final evaluation: swe_verified, beyond_aime, imo_answerbench.
            eval_k: Samples per problem in the evaluation.
            eval_limit: Evaluate only the first N problems of each benchmark (0 = all).
            eval_max_new_tokens: Evaluation: tokens per model turn.
            eval_max_total_tokens: Evaluation: tokens of a whole episode.
            eval_sandbox: Where SWE-Bench agent commands and tests run: kubernetes (one pod per episode) or local (bubblewrap in the evaluation pod).
            eval_options: Other evaluation settings as JSON (EvalConfig fields), e.g. {"concurrency": 32}.
            previous_summary: summary.json of an earlier evaluation (path or s3://) to compare against in the report ('' = none).
            gpu_count: GPUs of each training pod (0 = none).
            eval_gpu_count: GPUs of each evaluation pod (0 = none).
            accelerator_type: Kubernetes resource name of the GPUs, e.g. nvidia.com/gpu.
            node_selector: Node labels the GPU pods require (a TrainJob: every pod), e.g. {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}.
            tolerations: Tolerations of the GPU pods (a TrainJob: every pod), e.g. [{"key": "nvidia.com/gpu", "operator": "Exists"}].
            s3_secret_name: Kubernetes Secret with the S3 credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (+ AWS_ENDPOINT_URL, AWS_DEFAULT_REGION).
        """
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
