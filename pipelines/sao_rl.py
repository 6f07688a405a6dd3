"""sao_rl: prepare -> optional SFT warm start -> SAO (in one pod or as a TrainJob) -> evaluation -> report.

The SAO path with every SAO setting in the run form (post_training has them in ``method_options``).
The RL data is prepared first; ``dsl.If(placement == "trainjob")`` picks where SAO runs: one pod with
the rollout service and the learner (``single_pod``), or one Kubeflow Trainer TrainJob with rollout
replicas and a multi-node learner, launched from a CPU pod and deleted by an ExitHandler step
(``trainjob``). Inside either, ``dsl.If(warm_start_steps > 0)`` fine-tunes the base model (in one pod)
before SAO. The trained policy is evaluated on the chosen benchmarks (one parallel step each) and one
HTML report is written. The pipeline's output is the report's URI.
"""

from kfp import dsl
from kfp.dsl import Dataset, Input

from components.prepare_data import prepare_data
from components.sao import sao_train
from pipelines._stages import RUN_ID, build_evaluation_stage, build_trainjob_stage, warm_start_sft
from sao_core.kfp import k8s
from sao_core.kfp.params import PLACEMENTS
from sao_core.learner.config import ADMISSION_RULES

NAME = "sao-rl"
#: Parameters whose allowed values become dropdowns in the KFP UI.
LITERALS = {"admission": list(ADMISSION_RULES), "placement": list(PLACEMENTS), "engine": ["vllm", "hf"],
            "eval_sandbox": ["kubernetes", "local"]}
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
        warm_start_lr: float,
        warm_start_batch_size: int,
        max_tokens: int,
        steps: int,
        batch_size: int,
        policy_lr: float,
        critic_lr: float,
        critic_updates: int,
        critic_warmup_steps: int,
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
            warm_start_lr: Learning rate of the warm start.
            warm_start_batch_size: Examples per warm-start step.
            max_tokens: Token limit of warm-start examples.
            steps: Optimiser steps (RL: learner steps) in total.
            batch_size: Trajectories per step (B), one per prompt (GRPO: groups of group_size).
            policy_lr: Policy learning rate (peak, after the warm-up).
            critic_lr: Critic learning rate.
            critic_updates: Critic updates per policy update (K).
            critic_warmup_steps: Critic-only steps before the first policy update.
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
                   critic_lr=critic_lr, critic_updates=critic_updates, critic_warmup_steps=critic_warmup_steps,
                   max_staleness=max_staleness, admission=admission, eps_low=eps_low, eps_high=eps_high,
                   engine=engine, options=sao_options, run_id=RUN_ID)
        with dsl.If(warm_start_steps > 0, name="warm-start"):
            warm = warm_start_sft(base_model, output_root, warm_start_source, warm_start_steps, warm_start_lr,
                                  max_tokens, params, settings, batch_size=warm_start_batch_size)
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
        warm_start_lr: float,
        warm_start_batch_size: int,
        max_tokens: int,
        steps: int,
        batch_size: int,
        policy_lr: float,
        critic_lr: float,
        critic_updates: int,
        critic_warmup_steps: int,
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
            warm_start_lr: Learning rate of the warm start.
            warm_start_batch_size: Examples per warm-start step.
            max_tokens: Token limit of warm-start examples.
            steps: Optimiser steps (RL: learner steps) in total.
            batch_size: Trajectories per step (B), one per prompt (GRPO: groups of group_size).
            policy_lr: Policy learning rate (peak, after the warm-up).
            critic_lr: Critic learning rate.
            critic_updates: Critic updates per policy update (K).
            critic_warmup_steps: Critic-only steps before the first policy update.
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
                   learning_rate=policy_lr, critic_lr=critic_lr, critic_updates=critic_updates,
                   critic_warmup_steps=critic_warmup_steps, max_staleness=max_staleness, admission=admission,
                   eps_low=eps_low, eps_high=eps_high, engine=engine, method_options=sao_options, num_nodes=num_nodes,
                   gpus_per_node=gpus_per_node, rollout_replicas=rollout_replicas, rollout_gpus=rollout_gpus,
                   tensor_parallel_size=tensor_parallel_size, accelerator_type=accelerator_type,
                   node_selector=node_selector, tolerations=tolerations, s3_secret_name=s3_secret_name)
        with dsl.If(warm_start_steps > 0, name="warm-start"):
            warm = warm_start_sft(base_model, output_root, warm_start_source, warm_start_steps, warm_start_lr,
                                  max_tokens, params, settings, batch_size=warm_start_batch_size)
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

    @dsl.pipeline(name=NAME)
    def sao_rl(
        rl_source: str,
        output_root: str,
        base_model: str = "embedded:tiny",
        rl_split: str = "train",
        rl_limit: int = 0,
        warm_start_source: str = "",
        warm_start_steps: int = 0,
        warm_start_lr: float = 1e-5,
        warm_start_batch_size: int = 16,
        max_tokens: int = 512,
        steps: int = 100,
        batch_size: int = 32,
        policy_lr: float = 1e-6,
        critic_lr: float = 5e-6,
        critic_updates: int = 2,
        critic_warmup_steps: int = 10,
        max_staleness: int = 4,
        admission: str = "no_drop",
        eps_low: float = 0.3,
        eps_high: float = 5.0,
        engine: str = "vllm",
        placement: str = "single_pod",
        num_nodes: int = 1,
        gpus_per_node: int = 8,
        rollout_replicas: int = 2,
        rollout_gpus: int = 1,
        tensor_parallel_size: int = 1,
        sao_options: dict = {},  # noqa: B006 (a pipeline parameter's default, never mutated)
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
        """SAO end to end: data preparation, optional SFT warm start, SAO training, evaluation and a report.

        Args:
            rl_source: RL prompts (prompt, reference answer or tests, environment): a Hugging Face id, a file, or an s3:// URI.
            output_root: Where checkpoints, models and evaluations are written: s3://bucket/prefix in a cluster (a local directory for local runs). Each run writes OUTPUT_ROOT/RUN_ID/{sft,sao,eval-*,report}.
            base_model: Model to start from: embedded:tiny, an s3:// checkpoint, a directory or a Hugging Face id.
            rl_split: Split of a Hugging Face RL dataset.
            rl_limit: Use at most this many RL prompts (0 = all).
            warm_start_source: SFT data (chat messages) for a warm start before SAO ('' = none).
            warm_start_steps: SFT steps of the warm start (0 = no warm start). RL from a model whose sampled reward is near 0 learns little: warm-start until it is about 0.2.
            warm_start_lr: Learning rate of the warm-start SFT.
            warm_start_batch_size: Examples per warm-start SFT step.
            max_tokens: Token limit of warm-start examples.
            steps: Optimiser steps (RL: learner steps) in total.
            batch_size: Trajectories per step (B), one per prompt (GRPO: groups of group_size).
            policy_lr: Policy learning rate (peak, after the warm-up).
            critic_lr: Critic learning rate.
            critic_updates: Critic updates per policy update (K).
            critic_warmup_steps: Critic-only steps before the first policy update.
            max_staleness: S, the most weights versions a trained token may lag (window / version_order / requeue drop trajectories beyond it; no_drop / fragments drop only past the safety bound).
            admission: How the run admits episodes and batches them: no_drop, window, version_order, requeue or fragments. no_drop (the default): arrival order, nothing dropped or waited for, the early tokens of long episodes may lag more than S (DIS guards them; an episode older than the safety bound hard_staleness, default 4·S, is dropped); window: (S+1)·B episodes in flight, trained in arrival order, stale ones dropped; version_order: the oldest admission cohort first, never an episode admitted after one still running (nothing stale; the learner waits for each cohort); requeue: window, and a prompt dropped as stale is rolled out once more; fragments (sao only): long episodes are trained in pieces cut at turn boundaries, advantages bootstrapped from the critic (fewer tokens beyond S than no_drop, at a lower throughput).
            eps_low: DIS band lower width: tokens with ratio <= 1 - eps_low are masked (0.3 math with tools, 0.8 agentic coding).
            eps_high: DIS band upper width: tokens with ratio >= 1 + eps_high are masked (5.0 math with tools, 3.0 agentic coding).
            engine: Rollout engine: vllm (GPU) or hf (transformers; small models, CPU).
            placement: Where SAO runs: single_pod (rollout service and learner in one pod with gpu_count GPUs) or trainjob (one Kubeflow Trainer TrainJob: rollout replicas + a multi-node torchrun learner, admitted by Kueue as one workload; output_root must be s3://; see deploy/README.md). The warm start runs in one pod either way.
            num_nodes: placement=trainjob: Learner nodes (pods of the node job); torchrun --nnodes.
            gpus_per_node: placement=trainjob: GPUs per learner node = torchrun processes per node (0: one CPU process).
            rollout_replicas: placement=trainjob: Rollout service replicas (one pod and one Job each).
            rollout_gpus: placement=trainjob: GPUs per rollout replica (vllm: tensor_parallel_size x data_parallel_size).
            tensor_parallel_size: placement=trainjob: VLLM tensor-parallel size inside one replica.
            sao_options: Other SAO settings as JSON (RLConfig fields), e.g. {"max_total_tokens": 32768, "checkpoint_every": 50, "env_options": {"math_python": {}}}.
            eval_benchmarks: Benchmarks of the final evaluation: swe_verified, beyond_aime, imo_answerbench.
            eval_k: Samples per problem in the evaluation.
            eval_limit: Evaluate only the first N problems of each benchmark (0 = all).
            eval_max_new_tokens: Evaluation: tokens per model turn.
            eval_max_total_tokens: Evaluation: tokens of a whole episode.
            eval_sandbox: Where SWE-Bench agent commands and tests run: kubernetes (one pod per episode) or local (bubblewrap in the evaluation pod).
            eval_options: Other evaluation settings as JSON (EvalConfig fields), e.g. {"imo_answerbench_source": "s3://..."}.
            previous_summary: summary.json of an earlier evaluation (path or s3://) to compare against in the report ('' = none).
            gpu_count: GPUs of the SFT and (single_pod) SAO pods (0 = none).
            eval_gpu_count: GPUs of each evaluation pod (0 = none).
            accelerator_type: Kubernetes resource name of the GPUs, e.g. nvidia.com/gpu.
            node_selector: Node labels the GPU pods require (a TrainJob: every pod), e.g. {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}.
            tolerations: Tolerations of the GPU pods (a TrainJob: every pod), e.g. [{"key": "nvidia.com/gpu", "operator": "Exists"}].
            s3_secret_name: Kubernetes Secret with the S3 credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (+ AWS_ENDPOINT_URL, AWS_DEFAULT_REGION).
        """
        params = k8s.ClusterParams(gpu_count=gpu_count, accelerator_type=accelerator_type,
                                   node_selector=node_selector, tolerations=tolerations,
                                   s3_secret_name=s3_secret_name)
        rl_data = prepare_data(source=rl_source, kind="rl", split=rl_split, limit=rl_limit)
        k8s.apply(rl_data.set_display_name("prepare rl data"), "data", params, settings, image_kind="cpu")
        stage = dict(data=rl_data.outputs["dataset"], output_root=output_root, base_model=base_model,
                     warm_start_source=warm_start_source, warm_start_steps=warm_start_steps,
                     warm_start_lr=warm_start_lr, warm_start_batch_size=warm_start_batch_size, max_tokens=max_tokens,
                     steps=steps, batch_size=batch_size, policy_lr=policy_lr, critic_lr=critic_lr,
                     critic_updates=critic_updates, critic_warmup_steps=critic_warmup_steps,
                     max_staleness=max_staleness, admission=admission, eps_low=eps_low, eps_high=eps_high,
                     engine=engine, sao_options=sao_options, gpu_count=gpu_count, accelerator_type=accelerator_type,
                     node_selector=node_selector, tolerations=tolerations, s3_secret_name=s3_secret_name)
        with dsl.If(placement == "trainjob", name="trainjob"):
            multi = sao_trainjob(**stage, num_nodes=num_nodes, gpus_per_node=gpus_per_node,
                                 rollout_replicas=rollout_replicas, rollout_gpus=rollout_gpus,
                                 tensor_parallel_size=tensor_parallel_size).set_display_name(
                "sao as a TrainJob (optional warm start)")
        with dsl.Else(name="single-pod"):
            single = sao_single_pod(**stage).set_display_name("sao in one pod (optional warm start)")
        trained = dsl.OneOf(multi.output, single.output)
        evaluation = evaluation_stage(
            model=trained, output_root=output_root, benchmarks=eval_benchmarks, k=eval_k, limit=eval_limit,
            engine=engine, max_new_tokens=eval_max_new_tokens, max_total_tokens=eval_max_total_tokens,
            temperature=1.0, sandbox=eval_sandbox, previous_summary=previous_summary, eval_options=eval_options,
            gpu_count=eval_gpu_count, accelerator_type=accelerator_type, node_selector=node_selector,
            tolerations=tolerations, s3_secret_name=s3_secret_name, trained_model=trained).set_display_name("evaluation")
        return evaluation.output

    return sao_rl


sao_rl = build_sao_rl()
