"""sao_rl: prepare -> optional SFT warm start -> SAO -> evaluation -> report.

The SAO path with every SAO setting in the run form (post_training has them in ``method_options``).
The RL data and the warm-start data are prepared first; ``dsl.If(warm_start_steps > 0)`` fine-tunes
the base model before SAO; the trained policy is evaluated on the chosen benchmarks (one parallel
step each) and one HTML report is written. The pipeline's output is the report's URI.
"""

from kfp import dsl

from components.prepare_data import prepare_data
from components.sao import sao_train
from components.sft import sft_train
from pipelines._stages import RUN_ID, build_evaluation_stage
from sao_core.kfp import k8s

NAME = "sao-rl"
LITERALS = {"engine": ["vllm", "hf"], "eval_sandbox": ["kubernetes", "local"]}
DEFAULT_EVAL_BENCHMARKS = ["swe_verified", "beyond_aime", "imo_answerbench"]


def build_sao_rl(settings: k8s.ClusterSettings | None = None):
    """The sao_rl pipeline with these compile-time Kubernetes settings."""
    settings = settings or k8s.ClusterSettings()
    settings.validate()
    evaluation_stage = build_evaluation_stage(settings)

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
        eps_low: float = 0.3,
        eps_high: float = 5.0,
        engine: str = "vllm",
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
            steps: SAO learner steps (critic warm-up steps included).
            batch_size: Trajectories per SAO step (B), one rollout per prompt.
            policy_lr: Policy learning rate (constant).
            critic_lr: Critic learning rate (constant).
            critic_updates: Critic updates per policy update (K).
            critic_warmup_steps: Critic-only steps before the first policy update.
            max_staleness: Drop trajectories older than this many policy versions.
            eps_low: DIS band lower width: tokens with ratio <= 1 - eps_low are masked (0.3 math with tools, 0.8 agentic coding).
            eps_high: DIS band upper width: tokens with ratio >= 1 + eps_high are masked (5.0 math with tools, 3.0 agentic coding).
            engine: Rollout and evaluation engine: vllm (GPU) or hf (transformers).
            sao_options: Other SAO settings as JSON (RLConfig fields), e.g. {"max_total_tokens": 32768, "checkpoint_every": 50, "env_options": {"math_python": {}}}.
            eval_benchmarks: Benchmarks of the final evaluation: swe_verified, beyond_aime, imo_answerbench.
            eval_k: Samples per problem in the evaluation.
            eval_limit: Evaluate only the first N problems of each benchmark (0 = all).
            eval_max_new_tokens: Evaluation: tokens per model turn.
            eval_max_total_tokens: Evaluation: tokens of a whole episode.
            eval_sandbox: Where SWE-Bench agent commands and tests run: kubernetes (one pod per episode) or local (bubblewrap in the evaluation pod).
            eval_options: Other evaluation settings as JSON (EvalConfig fields), e.g. {"imo_answerbench_source": "s3://..."}.
            previous_summary: summary.json of an earlier evaluation (path or s3://) to compare against in the report ('' = none).
            gpu_count: GPUs of the SFT and SAO pods (0 = none).
            eval_gpu_count: GPUs of each evaluation pod (0 = none).
            accelerator_type: Kubernetes resource name of the GPUs, e.g. nvidia.com/gpu.
            node_selector: Node labels GPU pods require, e.g. {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}.
            tolerations: Tolerations of GPU pods, e.g. [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}].
            s3_secret_name: Kubernetes secret with the S3 credentials (keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL); optional.
        """
        params = k8s.ClusterParams(gpu_count=gpu_count, accelerator_type=accelerator_type,
                                   node_selector=node_selector, tolerations=tolerations,
                                   s3_secret_name=s3_secret_name)
        rl_data = prepare_data(source=rl_source, kind="rl", split=rl_split, limit=rl_limit)
        k8s.apply(rl_data.set_display_name("prepare rl data"), "data", params, settings, image_kind="cpu")
        sao = dict(data=rl_data.outputs["dataset"], output_root=output_root, steps=steps, batch_size=batch_size,
                   policy_lr=policy_lr, critic_lr=critic_lr, critic_updates=critic_updates,
                   critic_warmup_steps=critic_warmup_steps, max_staleness=max_staleness, eps_low=eps_low,
                   eps_high=eps_high, engine=engine, options=sao_options, run_id=RUN_ID)
        with dsl.If(warm_start_steps > 0, name="warm-start"):
            warm_data = prepare_data(source=warm_start_source, kind="sft")
            k8s.apply(warm_data.set_display_name("prepare warm-start data"), "data", params, settings,
                      image_kind="cpu")
            warm = sft_train(data=warm_data.outputs["dataset"], output_root=output_root, base_model=base_model,
                             steps=warm_start_steps, batch_size=warm_start_batch_size, lr=warm_start_lr,
                             max_tokens=max_tokens, run_id=RUN_ID)
            k8s.apply(warm.set_display_name("warm-start SFT"), "training", params, settings, image_kind="train")
            after_warm = sao_train(base_model=warm.outputs["model_uri"], **sao)
            k8s.apply(after_warm.set_display_name("sao training"), "training", params, settings,
                      image_kind="rollout")
        with dsl.Else(name="no-warm-start"):
            cold = sao_train(base_model=base_model, **sao)
            k8s.apply(cold.set_display_name("sao training"), "training", params, settings, image_kind="rollout")
        trained = dsl.OneOf(after_warm.outputs["model_uri"], cold.outputs["model_uri"])
        evaluation = evaluation_stage(
            model=trained, output_root=output_root, benchmarks=eval_benchmarks, k=eval_k, limit=eval_limit,
            engine=engine, max_new_tokens=eval_max_new_tokens, max_total_tokens=eval_max_total_tokens,
            temperature=1.0, sandbox=eval_sandbox, previous_summary=previous_summary, eval_options=eval_options,
            gpu_count=eval_gpu_count, accelerator_type=accelerator_type, node_selector=node_selector,
            tolerations=tolerations, s3_secret_name=s3_secret_name).set_display_name("evaluation")
        return evaluation.output

    return sao_rl


sao_rl = build_sao_rl()
