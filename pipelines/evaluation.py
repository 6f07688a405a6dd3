"""evaluation: score one model on the benchmarks, one parallel step per benchmark, and one report.

The target of recurring runs (``sao kfp schedule``, e.g. every night at 02:00 with cron
``0 0 2 * * *``); ``c_previous_summary`` compares with an earlier run's summary. The run form's fields are
grouped by prefix for the KFP UI's alphabetical list: a0_ the two required fields (first), a_ what else,
c_ evaluation settings, d_ cluster.
"""

from kfp import dsl

from pipelines._stages import build_evaluation_stage
from sao_core.kfp import k8s

NAME = "sao-evaluation"
LITERALS = {"c_engine": ["vllm", "hf"], "c_sandbox": ["kubernetes", "local"]}
#: The pipeline's description in the KFP UI.
DESCRIPTION = (
    "Required: `a0_model` (what to evaluate) and `a0_output_root` (where to).\n\n"
    "Evaluate a model on SWE-Bench Verified, BeyondAIME and IMO-AnswerBench (one parallel step each) and write one "
    "HTML report; the target of recurring runs. The two `a0_` fields come first in the form; every other field has "
    "a default (`a_adapter`: an optional LoRA adapter merged into `a0_model`). Fields are grouped by prefix: `a0_` "
    "required, `a_` what else to evaluate; `c_` evaluation settings (`c_eval_options`: other EvalConfig fields); "
    "`d_` cluster. Every field is described in pipelines/README.md.")
DEFAULT_BENCHMARKS = ["swe_verified", "beyond_aime", "imo_answerbench"]


def build_evaluation(settings: k8s.ClusterSettings | None = None):
    """The evaluation pipeline with these compile-time Kubernetes settings."""
    settings = settings or k8s.ClusterSettings()
    settings.validate()
    stage = build_evaluation_stage(settings)

    @dsl.pipeline(name=NAME, description=DESCRIPTION)
    def evaluation(
        a0_model: str,
        a0_output_root: str,
        a_adapter: str = "",
        c_benchmarks: list = DEFAULT_BENCHMARKS,  # noqa: B006 (a pipeline parameter's default, never mutated)
        c_engine: str = "vllm",
        c_eval_options: dict = {},  # noqa: B006
        c_k: int = 4,
        c_limit: int = 0,
        c_max_new_tokens: int = 4096,
        c_max_total_tokens: int = 32768,
        c_previous_summary: str = "",
        c_sandbox: str = "kubernetes",
        c_temperature: float = 1.0,
        d_accelerator_type: str = "nvidia.com/gpu",
        d_gpu_count: int = 1,
        d_node_selector: dict = {},  # noqa: B006
        d_s3_secret_name: str = "sao-s3",
        d_tolerations: list = [],  # noqa: B006
    ) -> str:
        """Evaluate a model on SWE-Bench Verified, BeyondAIME and IMO-AnswerBench; one HTML report.

        Args:
            a0_model: Required. Model to evaluate: an `s3://` checkpoint (e.g. a training run's `OUTPUT_ROOT/RUN_ID/sao/model`), a directory, `embedded:tiny` or a Hugging Face id.
            a0_output_root: Required. Where evaluation runs are written: `s3://bucket/prefix` in a cluster (a local directory for local runs). Each run writes `OUTPUT_ROOT/RUN_ID/eval-BENCHMARK` and `OUTPUT_ROOT/RUN_ID/report`.
            a_adapter: Optional; empty = none, `a0_model` as it is. A LoRA adapter applied to `a0_model`: a peft folder with a manifest or an `s3://` checkpoint (e.g. a LoRA run's `OUTPUT_ROOT/RUN_ID/sao/weights/vNNNNNN`); each evaluation step merges it into `a0_model` and evaluates the merged model.
            c_benchmarks: Benchmarks to run, each in its own parallel step: `swe_verified`, `beyond_aime`, `imo_answerbench`.
            c_engine: Generation engine: vllm (GPU) or hf (transformers).
            c_eval_options: Other evaluation settings as JSON (EvalConfig fields), e.g. `{"concurrency": 32, "judge_url": "http://judge/v1", "judge_model": "..."}`.
            c_k: Samples per problem (avg@k, pass@k, maj@k).
            c_limit: Evaluate only the first N problems of each benchmark (0 = all).
            c_max_new_tokens: Tokens per model turn.
            c_max_total_tokens: Tokens of a whole episode (prompt, turns, tool output).
            c_previous_summary: Optional; empty = no comparison. `summary.json` of an earlier evaluation (path or `s3://`) to compare against in the report.
            c_sandbox: Where SWE-Bench agent commands and tests run: kubernetes (one pod per episode with the instance's image; needs a service account allowed to create pods) or local (bubblewrap inside the evaluation pod).
            c_temperature: Sampling temperature.
            d_accelerator_type: Kubernetes resource name of the GPUs, e.g. `nvidia.com/gpu`.
            d_gpu_count: GPUs of each evaluation pod (0 = none).
            d_node_selector: Node labels evaluation pods require, e.g. `{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}`.
            d_s3_secret_name: Kubernetes secret with the S3 credentials (keys `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`); optional.
            d_tolerations: Tolerations of evaluation pods, e.g. `[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]`.
        """
        # The run form's grouped names (a_ inputs, b_ method, c_ evaluation, d_ cluster), as the steps name them.
        model = a0_model
        adapter = a_adapter
        output_root = a0_output_root
        benchmarks = c_benchmarks
        k = c_k
        limit = c_limit
        engine = c_engine
        max_new_tokens = c_max_new_tokens
        max_total_tokens = c_max_total_tokens
        temperature = c_temperature
        sandbox = c_sandbox
        previous_summary = c_previous_summary
        eval_options = c_eval_options
        gpu_count = d_gpu_count
        accelerator_type = d_accelerator_type
        node_selector = d_node_selector
        tolerations = d_tolerations
        s3_secret_name = d_s3_secret_name
        result = stage(model=model, adapter=adapter, output_root=output_root, benchmarks=benchmarks, k=k,
                       limit=limit, engine=engine, max_new_tokens=max_new_tokens, max_total_tokens=max_total_tokens,
                       temperature=temperature, sandbox=sandbox, previous_summary=previous_summary,
                       eval_options=eval_options, gpu_count=gpu_count, accelerator_type=accelerator_type, node_selector=node_selector,
                       tolerations=tolerations, s3_secret_name=s3_secret_name).set_display_name("evaluation")
        return result.output

    return evaluation


evaluation = build_evaluation()
