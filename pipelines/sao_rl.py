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
from kfp.dsl import Dataset, Input

from components.check_arguments import check_sao_rl_arguments
from components.prepare_data import prepare_data
from components.sao import sao_train
from pipelines._stages import RUN_ID, build_evaluation_stage, build_trainjob_stage, warm_start_sft
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
DEFAULT_EVAL_BENCHMARKS = ["swe_verified", "beyond_aime", "imo_answerbench"]


def build_sao_stages(settings: k8s.ClusterSettings):
    """sao_rl's two SAO stages (single pod, TrainJob), each with the optional warm start, as graph components."""
    trainjob_stage = build_trainjob_stage(settings, "sao", sao_parameters=True)

    @dsl.pipeline(name="sao-single-pod-stage")
    def sao_single_pod(
        data: Input[Dataset],
        output_root: str,
        base_model: str,
        warm_start_source: str,
        warm_start_steps: int,
        warm_start_options: dict,
        steps: int,
        batch_size: int,
        policy_lr: float,
        max_staleness: int,
        admission: str,
        eps_low: float,
        eps_high: float,
        engine: str,
        sao_options: dict,
        gpu_count: int,
        accelerator_type: str,
        node_selector: dict,
        tolerations: list,
        s3_secret_name: str,
    ) -> str:
        """SAO in one pod (colocated rollout service) with an optional SFT warm start; returns the model's URI.

        Args:
            data: Prepared rl dataset.
            output_root: Where runs are written (s3://bucket/prefix or a local directory).
            base_model: Model to start from.
            warm_start_source: SFT data of the warm start.
            warm_start_steps: SFT steps before SAO (0 = no warm start).
            warm_start_options: SFTConfig settings of the warm start.
            steps: Optimiser steps (RL: learner steps) in total.
            batch_size: Trajectories per step (B), one per prompt (GRPO: groups of group_size).
            policy_lr: Policy learning rate (peak, after the warm-up).
            max_staleness: S, the most weights versions a trained token may lag (window / version_order / requeue drop trajectories beyond it; no_drop / fragments drop only past the safety bound).
            admission: How the run admits episodes and batches them: no_drop, window, version_order, requeue or fragments. no_drop (the default): arrival order, nothing dropped or waited for, the early tokens of long episodes may lag more than S (DIS guards them; an episode older than the safety bound hard_staleness, default 4·S, is dropped); window: (S+1)·B episodes in flight, trained in arrival order, stale ones dropped; version_order: the oldest admission cohort first, never an episode admitted after one still running (nothing stale; the learner waits for each cohort); requeue: window, and a prompt dropped as stale is rolled out once more; fragments (sao only): long episodes are trained in pieces cut at turn boundaries, advantages bootstrapped from the critic (fewer tokens beyond S than no_drop, at a lower throughput).
            eps_low: DIS band lower width: tokens with ratio <= 1 - eps_low are masked (0.3 math with tools, 0.8 agentic coding).
            eps_high: DIS band upper width: tokens with ratio >= 1 + eps_high are masked (5.0 math with tools, 3.0 agentic coding).
            engine: Rollout engine: vllm (GPU) or hf (transformers; small models, CPU).
            sao_options: Other RLConfig fields.
            gpu_count: GPUs of the training pods.
            accelerator_type: Kubernetes resource name of the GPUs, e.g. nvidia.com/gpu.
            node_selector: Node labels the GPU pods require (a TrainJob: every pod), e.g. {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}.
            tolerations: Tolerations of the GPU pods (a TrainJob: every pod), e.g. [{"key": "nvidia.com/gpu", "operator": "Exists"}].
            s3_secret_name: Kubernetes Secret with the S3 credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (+ AWS_ENDPOINT_URL, AWS_DEFAULT_REGION).
        """
        params = k8s.ClusterParams(gpu_count=gpu_count, accelerator_type=accelerator_type,
                                   node_selector=node_selector, tolerations=tolerations,
                                   s3_secret_name=s3_secret_name)
        sao = dict(data=data, output_root=output_root, steps=steps, batch_size=batch_size, policy_lr=policy_lr,
                   max_staleness=max_staleness, admission=admission, eps_low=eps_low, eps_high=eps_high,
                   engine=engine, options=sao_options, run_id=RUN_ID)
        with dsl.If(warm_start_steps > 0, name="warm-start"):
            warm = warm_start_sft(base_model, output_root, warm_start_source, warm_start_steps, params, settings,
                                  options=warm_start_options)
            after_warm = sao_train(base_model=warm.outputs["model_uri"], **sao)
            k8s.apply(after_warm.set_display_name("sao training"), "training", params, settings,
                      image_kind="rollout")
        with dsl.Else(name="no-warm-start"):
            cold = sao_train(base_model=base_model, **sao)
            k8s.apply(cold.set_display_name("sao training"), "training", params, settings, image_kind="rollout")
        return dsl.OneOf(after_warm.outputs["model_uri"], cold.outputs["model_uri"])

    @dsl.pipeline(name="sao-trainjob-rl-stage")
    def sao_trainjob(
        data: Input[Dataset],
        output_root: str,
        base_model: str,
        warm_start_source: str,
        warm_start_steps: int,
        warm_start_options: dict,
        steps: int,
        batch_size: int,
        policy_lr: float,
        max_staleness: int,
        admission: str,
        eps_low: float,
        eps_high: float,
        engine: str,
        sao_options: dict,
        num_nodes: int,
        gpus_per_node: int,
        rollout_replicas: int,
        rollout_gpus: int,
        tensor_parallel_size: int,
        gpu_count: int,
        accelerator_type: str,
        node_selector: dict,
        tolerations: list,
        s3_secret_name: str,
    ) -> str:
        """SAO as one TrainJob with an optional SFT warm start (in one pod); returns the trained model's URI.

        Args:
            data: Prepared rl dataset.
            output_root: s3://bucket/prefix where runs are written.
            base_model: Model to start from.
            warm_start_source: SFT data of the warm start.
            warm_start_steps: SFT steps before SAO (0 = no warm start).
            warm_start_options: SFTConfig settings of the warm start.
            steps: Optimiser steps (RL: learner steps) in total.
            batch_size: Trajectories per step (B), one per prompt (GRPO: groups of group_size).
            policy_lr: Policy learning rate (peak, after the warm-up).
            max_staleness: S, the most weights versions a trained token may lag (window / version_order / requeue drop trajectories beyond it; no_drop / fragments drop only past the safety bound).
            admission: How the run admits episodes and batches them: no_drop, window, version_order, requeue or fragments. no_drop (the default): arrival order, nothing dropped or waited for, the early tokens of long episodes may lag more than S (DIS guards them; an episode older than the safety bound hard_staleness, default 4·S, is dropped); window: (S+1)·B episodes in flight, trained in arrival order, stale ones dropped; version_order: the oldest admission cohort first, never an episode admitted after one still running (nothing stale; the learner waits for each cohort); requeue: window, and a prompt dropped as stale is rolled out once more; fragments (sao only): long episodes are trained in pieces cut at turn boundaries, advantages bootstrapped from the critic (fewer tokens beyond S than no_drop, at a lower throughput).
            eps_low: DIS band lower width: tokens with ratio <= 1 - eps_low are masked (0.3 math with tools, 0.8 agentic coding).
            eps_high: DIS band upper width: tokens with ratio >= 1 + eps_high are masked (5.0 math with tools, 3.0 agentic coding).
            engine: Rollout engine: vllm (GPU) or hf (transformers; small models, CPU).
            sao_options: Other RLConfig fields.
            num_nodes: Learner nodes (pods of the node job); torchrun --nnodes.
            gpus_per_node: GPUs per learner node = torchrun processes per node (0: one CPU process).
            rollout_replicas: Rollout service replicas (one pod and one Job each).
            rollout_gpus: GPUs per rollout replica (vllm: tensor_parallel_size x data_parallel_size).
            tensor_parallel_size: VLLM tensor-parallel size inside one replica.
            gpu_count: GPUs of the warm-start SFT pod.
            accelerator_type: Kubernetes resource name of the GPUs, e.g. nvidia.com/gpu.
            node_selector: Node labels the GPU pods require (a TrainJob: every pod), e.g. {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}.
            tolerations: Tolerations of the GPU pods (a TrainJob: every pod), e.g. [{"key": "nvidia.com/gpu", "operator": "Exists"}].
            s3_secret_name: Kubernetes Secret with the S3 credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (+ AWS_ENDPOINT_URL, AWS_DEFAULT_REGION).
        """
        params = k8s.ClusterParams(gpu_count=gpu_count, accelerator_type=accelerator_type,
                                   node_selector=node_selector, tolerations=tolerations,
                                   s3_secret_name=s3_secret_name)
        sao = dict(data=data, output_root=output_root, method="sao", steps=steps, batch_size=batch_size,
                   learning_rate=policy_lr, max_staleness=max_staleness, admission=admission,
                   eps_low=eps_low, eps_high=eps_high, engine=engine, method_options=sao_options, num_nodes=num_nodes,
                   gpus_per_node=gpus_per_node, rollout_replicas=rollout_replicas, rollout_gpus=rollout_gpus,
                   tensor_parallel_size=tensor_parallel_size, accelerator_type=accelerator_type,
                   node_selector=node_selector, tolerations=tolerations, s3_secret_name=s3_secret_name)
        with dsl.If(warm_start_steps > 0, name="warm-start"):
            warm = warm_start_sft(base_model, output_root, warm_start_source, warm_start_steps, params, settings,
                                  options=warm_start_options)
            after_warm = trainjob_stage(base_model=warm.outputs["model_uri"], **sao).set_display_name("sao trainjob")
        with dsl.Else(name="no-warm-start"):
            cold = trainjob_stage(base_model=base_model, **sao).set_display_name("sao trainjob")
        return dsl.OneOf(after_warm.output, cold.output)

    return sao_single_pod, sao_trainjob


def build_sao_rl(settings: k8s.ClusterSettings | None = None):
    """The sao_rl pipeline with these compile-time Kubernetes settings."""
    settings = settings or k8s.ClusterSettings()
    settings.validate()
    evaluation_stage = build_evaluation_stage(settings)
    sao_single_pod, sao_trainjob = build_sao_stages(settings)

    @dsl.pipeline(name=NAME, description=sao_rl_description(TOP_LEVEL_SETTINGS))
    def sao_rl(
        a0_rl_source: str,
        a0_output_root: str,
        a_base_model: str = "embedded:tiny",
        a_rl_split: str = "train",
        a_rl_limit: int = 0,
        a_warm_start_source: str = "",
        b_steps: int = 100,
        b_batch_size: int = 32,
        b_policy_lr: float = 1e-6,
        b_max_staleness: int = 4,
        b_admission: str = "no_drop",
        b_eps_low: float = 0.3,
        b_eps_high: float = 5.0,
        b_engine: str = "vllm",
        b_options: dict = {},  # noqa: B006 (a pipeline parameter's default, never mutated)
        b_warm_start_steps: int = 0,
        b_warm_start_options: dict = {},  # noqa: B006
        c_eval_benchmarks: list = DEFAULT_EVAL_BENCHMARKS,  # noqa: B006
        c_eval_k: int = 4,
        c_eval_limit: int = 0,
        c_eval_sandbox: str = "kubernetes",
        c_eval_options: dict = {},  # noqa: B006
        c_previous_summary: str = "",
        d_placement: str = "single_pod",
        d_gpu_count: int = 1,
        d_eval_gpu_count: int = 1,
        d_accelerator_type: str = "nvidia.com/gpu",
        d_node_selector: dict = {},  # noqa: B006
        d_tolerations: list = [],  # noqa: B006
        d_s3_secret_name: str = "sao-s3",
        d_trainjob_num_nodes: int = 1,
        d_trainjob_gpus_per_node: int = 8,
        d_trainjob_rollout_replicas: int = 2,
        d_trainjob_rollout_gpus: int = 1,
        d_trainjob_tensor_parallel_size: int = 1,
    ) -> str:
        """SAO end to end: data preparation, optional SFT warm start, SAO training, evaluation and a report.

        Args:
            a0_rl_source: Required. RL prompts (prompt, reference answer or tests, environment): a Hugging Face id, a file, or an `s3://` URI.
            a0_output_root: Required. Where checkpoints, models and evaluations are written: `s3://bucket/prefix` in a cluster (a local directory for local runs). Each run writes `OUTPUT_ROOT/RUN_ID/{sft,sao,eval-*,report}`.
            a_base_model: Model to start from: `embedded:tiny`, an `s3://` checkpoint, a directory or a Hugging Face id.
            a_rl_split: Split of a Hugging Face RL dataset.
            a_rl_limit: Use at most this many RL prompts (0 = all).
            a_warm_start_source: Optional; empty = no warm start. SFT data (chat messages) for a warm start before SAO (`b_warm_start_steps` sets its length).
            b_steps: Optimiser steps (RL: learner steps) in total.
            b_batch_size: Trajectories per step (B), one per prompt (GRPO: groups of `group_size`).
            b_policy_lr: Policy learning rate (peak, after the warm-up).
            b_max_staleness: S, the most weights versions a trained token may lag (`window` / `version_order` / `requeue` drop trajectories beyond it; `no_drop` / `fragments` drop only past the safety bound).
            b_admission: How the run admits episodes and batches them: `no_drop`, `window`, `version_order`, `requeue` or `fragments`. `no_drop` (the default): arrival order, nothing dropped or waited for, the early tokens of long episodes may lag more than S (DIS guards them; an episode older than the safety bound `hard_staleness`, default 4·S, is dropped); `window`: (S+1)·B episodes in flight, trained in arrival order, stale ones dropped; `version_order`: the oldest admission cohort first, never an episode admitted after one still running (nothing stale; the learner waits for each cohort); `requeue`: window, and a prompt dropped as stale is rolled out once more; `fragments` (sao only): long episodes are trained in pieces cut at turn boundaries, advantages bootstrapped from the critic (fewer tokens beyond S than `no_drop`, at a lower throughput).
            b_eps_low: DIS band lower width: tokens with ratio <= 1 - `eps_low` are masked (0.3 math with tools, 0.8 agentic coding).
            b_eps_high: DIS band upper width: tokens with ratio >= 1 + `eps_high` are masked (5.0 math with tools, 3.0 agentic coding).
            b_engine: Rollout engine: vllm (GPU) or hf (transformers; small models, CPU).
            b_options: Any other RLConfig setting as JSON, e.g. `{"critic_lr": 5e-6, "critic_warmup_steps": 10, "max_total_tokens": 32768, "checkpoint_every": 50}`; the pipeline's description lists every key and its default (an unknown key fails the first step).
            b_warm_start_steps: SFT steps of the warm start (0 = no warm start; needs `a_warm_start_source`). RL from a model whose sampled reward is near 0 learns little: warm-start until it is about 0.2.
            b_warm_start_options: SFTConfig settings of the warm start as JSON (defaults `{"lr": 1e-5, "batch_size": 16, "max_tokens": 512}`).
            c_eval_benchmarks: Benchmarks of the final evaluation: `swe_verified`, `beyond_aime`, `imo_answerbench`.
            c_eval_k: Samples per problem in the evaluation.
            c_eval_limit: Evaluate only the first N problems of each benchmark (0 = all).
            c_eval_sandbox: Where SWE-Bench agent commands and tests run: kubernetes (one pod per episode) or local (bubblewrap in the evaluation pod).
            c_eval_options: Other evaluation settings as JSON (EvalConfig fields), e.g. `{"max_new_tokens": 4096, "max_total_tokens": 32768, "imo_answerbench_source": "s3://..."}`.
            c_previous_summary: Optional; empty = no comparison. `summary.json` of an earlier evaluation (path or `s3://`) to compare against in the report.
            d_placement: Where SAO runs: `single_pod` (rollout service and learner in one pod with `d_gpu_count` GPUs) or `trainjob` (one Kubeflow Trainer TrainJob shaped by `d_trainjob_*`: rollout replicas + a multi-node torchrun learner, admitted by Kueue as one workload; `a0_output_root` must be `s3://`; see deploy/README.md). The warm start runs in one pod either way.
            d_gpu_count: GPUs of the SFT and (`single_pod`) SAO pods (0 = none).
            d_eval_gpu_count: GPUs of each evaluation pod (0 = none).
            d_accelerator_type: Kubernetes resource name of the GPUs, e.g. `nvidia.com/gpu`.
            d_node_selector: Node labels the GPU pods require (a TrainJob: every pod), e.g. `{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}`.
            d_tolerations: Tolerations of the GPU pods (a TrainJob: every pod), e.g. `[{"key": "nvidia.com/gpu", "operator": "Exists"}]`.
            d_s3_secret_name: Kubernetes Secret with the S3 credentials: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` (+ `AWS_ENDPOINT_URL`, `AWS_DEFAULT_REGION`).
            d_trainjob_num_nodes: `d_placement=trainjob`: Learner nodes (pods of the node job); `torchrun --nnodes`.
            d_trainjob_gpus_per_node: `d_placement=trainjob`: GPUs per learner node = torchrun processes per node (0: one CPU process).
            d_trainjob_rollout_replicas: `d_placement=trainjob`: Rollout service replicas (one pod and one Job each).
            d_trainjob_rollout_gpus: `d_placement=trainjob`: GPUs per rollout replica (vllm: `tensor_parallel_size` x `data_parallel_size`).
            d_trainjob_tensor_parallel_size: `d_placement=trainjob`: VLLM tensor-parallel size inside one replica.
        """
        params = k8s.ClusterParams(gpu_count=d_gpu_count, accelerator_type=d_accelerator_type,
                                   node_selector=d_node_selector, tolerations=d_tolerations,
                                   s3_secret_name=d_s3_secret_name)
        check = check_sao_rl_arguments(
            output_root=a0_output_root, steps=b_steps, batch_size=b_batch_size, policy_lr=b_policy_lr,
            max_staleness=b_max_staleness, admission=b_admission, eps_low=b_eps_low, eps_high=b_eps_high,
            engine=b_engine, warm_start_source=a_warm_start_source, warm_start_steps=b_warm_start_steps,
            options=b_options, warm_start_options=b_warm_start_options, eval_options=c_eval_options,
            placement=d_placement, num_nodes=d_trainjob_num_nodes, gpus_per_node=d_trainjob_gpus_per_node,
            rollout_replicas=d_trainjob_rollout_replicas, rollout_gpus=d_trainjob_rollout_gpus,
            tensor_parallel_size=d_trainjob_tensor_parallel_size, s3_secret_name=d_s3_secret_name)
        k8s.apply(check.set_display_name("check arguments"), "cpu", params, settings, image_kind="cpu")
        rl_data = prepare_data(source=a0_rl_source, kind="rl", split=a_rl_split, limit=a_rl_limit).after(check)
        k8s.apply(rl_data.set_display_name("prepare rl data"), "data", params, settings, image_kind="cpu")
        stage = dict(data=rl_data.outputs["dataset"], output_root=a0_output_root, base_model=a_base_model,
                     warm_start_source=a_warm_start_source, warm_start_steps=b_warm_start_steps,
                     warm_start_options=b_warm_start_options, steps=b_steps, batch_size=b_batch_size,
                     policy_lr=b_policy_lr, max_staleness=b_max_staleness, admission=b_admission, eps_low=b_eps_low,
                     eps_high=b_eps_high, engine=b_engine, sao_options=b_options, gpu_count=d_gpu_count,
                     accelerator_type=d_accelerator_type, node_selector=d_node_selector, tolerations=d_tolerations,
                     s3_secret_name=d_s3_secret_name)
        with dsl.If(d_placement == "trainjob", name="trainjob"):
            multi = sao_trainjob(**stage, num_nodes=d_trainjob_num_nodes, gpus_per_node=d_trainjob_gpus_per_node,
                                 rollout_replicas=d_trainjob_rollout_replicas, rollout_gpus=d_trainjob_rollout_gpus,
                                 tensor_parallel_size=d_trainjob_tensor_parallel_size).set_display_name(
                "sao as a TrainJob (optional warm start)")
        with dsl.Else(name="single-pod"):
            single = sao_single_pod(**stage).set_display_name("sao in one pod (optional warm start)")
        trained = dsl.OneOf(multi.output, single.output)
        # max_new_tokens / max_total_tokens at the evaluate component's defaults: c_eval_options may set them.
        evaluation = evaluation_stage(
            model=trained, output_root=a0_output_root, benchmarks=c_eval_benchmarks, k=c_eval_k, limit=c_eval_limit,
            engine=b_engine, max_new_tokens=4096, max_total_tokens=32768, temperature=1.0, sandbox=c_eval_sandbox,
            previous_summary=c_previous_summary, eval_options=c_eval_options, gpu_count=d_eval_gpu_count,
            accelerator_type=d_accelerator_type, node_selector=d_node_selector, tolerations=d_tolerations,
            s3_secret_name=d_s3_secret_name, trained_model=trained).set_display_name("evaluation")
        return evaluation.output

    return sao_rl


sao_rl = build_sao_rl()
