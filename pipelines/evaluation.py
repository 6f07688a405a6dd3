"""evaluation: score one model on the benchmarks, one parallel step per benchmark, and one report.

The target of recurring runs (``sao kfp schedule``, e.g. every night at 02:00 with cron
``0 0 2 * * *``); ``previous_summary`` compares with an earlier run's summary.
"""

from kfp import dsl

from pipelines._stages import build_evaluation_stage
from sao_core.kfp import k8s

NAME = "sao-evaluation"
LITERALS = {"engine": ["vllm", "hf"], "sandbox": ["kubernetes", "local"]}
DEFAULT_BENCHMARKS = ["swe_verified", "beyond_aime", "imo_answerbench"]


def build_evaluation(settings: k8s.ClusterSettings | None = None):
    """The evaluation pipeline with these compile-time Kubernetes settings."""
    settings = settings or k8s.ClusterSettings()
    settings.validate()
    stage = build_evaluation_stage(settings)

    @dsl.pipeline(name=NAME)
    def evaluation(
        model: str,
        output_root: str,
        benchmarks: list = DEFAULT_BENCHMARKS,  # noqa: B006 (a pipeline parameter's default, never mutated)
        k: int = 4,
        limit: int = 0,
        engine: str = "vllm",
        max_new_tokens: int = 4096,
        max_total_tokens: int = 32768,
        temperature: float = 1.0,
        sandbox: str = "kubernetes",
        previous_summary: str = "",
        eval_options: dict = {},  # noqa: B006
        gpu_count: int = 1,
        accelerator_type: str = "nvidia.com/gpu",
        node_selector: dict = {},  # noqa: B006
        tolerations: list = [],  # noqa: B006
        s3_secret_name: str = "sao-s3",
    ) -> str:
        """Evaluate a model on SWE-Bench Verified, BeyondAIME and IMO-AnswerBench; one HTML report.

        Args:
            model: Model to evaluate: an s3:// checkpoint (e.g. a training run's OUTPUT_ROOT/RUN_ID/sao/model), a directory, embedded:tiny or a Hugging Face id.
            output_root: Where evaluation runs are written: s3://bucket/prefix in a cluster (a local directory for local runs). Each run writes OUTPUT_ROOT/RUN_ID/eval-BENCHMARK and OUTPUT_ROOT/RUN_ID/report.
            benchmarks: Benchmarks to run, each in its own parallel step: swe_verified, beyond_aime, imo_answerbench.
            k: Samples per problem (avg@k, pass@k, maj@k).
            limit: Evaluate only the first N problems of each benchmark (0 = all).
            engine: Generation engine: vllm (GPU) or hf (transformers).
            max_new_tokens: Tokens per model turn.
            max_total_tokens: Tokens of a whole episode (prompt, turns, tool output).
            temperature: Sampling temperature.
            sandbox: Where SWE-Bench agent commands and tests run: kubernetes (one pod per episode with the instance's image; needs a service account allowed to create pods) or local (bubblewrap inside the evaluation pod).
            previous_summary: summary.json of an earlier evaluation (path or s3://) to compare against in the report ('' = none).
            eval_options: Other evaluation settings as JSON (EvalConfig fields), e.g. {"concurrency": 32, "judge_url": "http://judge/v1", "judge_model": "..."}.
            gpu_count: GPUs of each evaluation pod (0 = none).
            accelerator_type: Kubernetes resource name of the GPUs, e.g. nvidia.com/gpu.
            node_selector: Node labels evaluation pods require, e.g. {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}.
            tolerations: Tolerations of evaluation pods, e.g. [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}].
            s3_secret_name: Kubernetes secret with the S3 credentials (keys AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL); optional.
        """
        result = stage(model=model, output_root=output_root, benchmarks=benchmarks, k=k, limit=limit, engine=engine,
                       max_new_tokens=max_new_tokens, max_total_tokens=max_total_tokens, temperature=temperature,
                       sandbox=sandbox, previous_summary=previous_summary, eval_options=eval_options,
                       gpu_count=gpu_count, accelerator_type=accelerator_type, node_selector=node_selector,
                       tolerations=tolerations, s3_secret_name=s3_secret_name).set_display_name("evaluation")
        return result.output

    return evaluation


evaluation = build_evaluation()
