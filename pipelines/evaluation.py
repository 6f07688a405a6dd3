"""evaluation: score one model on the benchmarks, one parallel step per benchmark, and one report.

The target of recurring runs (``sao kfp schedule``, e.g. every night at 02:00 with cron
``0 0 2 * * *``); ``c_previous_summary`` compares with an earlier run's summary. The run form's fields are
grouped by prefix for the KFP UI's alphabetical list: a0_ the two required fields (first), a_ what else,
c_ evaluation settings, d_ cluster.
"""

from pipelines._form import Field, pipeline_of, shared_fields
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
#: The run form (the KFP UI lists the fields alphabetically: the prefixes group them; a0_ ones are required).
FORM = (
    Field.required("a0_model",
                   "Model to evaluate: an `s3://` checkpoint (e.g. a training run's "
                   "`OUTPUT_ROOT/RUN_ID/sao/model`), a directory, `embedded:tiny` or a Hugging Face id."),
    Field.output_root("evaluation runs",
                      "`OUTPUT_ROOT/RUN_ID/eval-BENCHMARK` and `OUTPUT_ROOT/RUN_ID/report`"),
    Field.optional("a_adapter", "none, `a0_model` as it is",
                   "A LoRA adapter applied to `a0_model`: a peft folder with a manifest or an `s3://` "
                   "checkpoint (e.g. a LoRA run's `OUTPUT_ROOT/RUN_ID/sao/weights/vNNNNNN`); each "
                   "evaluation step merges it into `a0_model` and evaluates the merged model."),
    Field("c_benchmarks", list, DEFAULT_BENCHMARKS,
          "Benchmarks to run, each in its own parallel step: `swe_verified`, `beyond_aime`, `imo_answerbench`."),
    Field("c_engine", str, "vllm", "Generation engine: vllm (GPU) or hf (transformers)."),
    Field("c_eval_options", dict, {},
          'Other evaluation settings as JSON (EvalConfig fields), e.g. `{"concurrency": 32, "judge_url": '
          '"http://judge/v1", "judge_model": "..."}`.'),
    Field("c_k", int, 4, "Samples per problem (avg@k, pass@k, maj@k)."),
    Field("c_limit", int, 0, "Evaluate only the first N problems of each benchmark (0 = all)."),
    Field("c_max_new_tokens", int, 4096, "Tokens per model turn."),
    Field("c_max_total_tokens", int, 32768, "Tokens of a whole episode (prompt, turns, tool output)."),
    Field("c_sandbox", str, "kubernetes",
          "Where SWE-Bench agent commands and tests run: kubernetes (one pod per episode with the instance's "
          "image; needs a service account allowed to create pods) or local (bubblewrap inside the evaluation "
          "pod)."),
    Field("c_temperature", float, 1.0, "Sampling temperature."),
    Field("d_gpu_count", int, 1, "GPUs of each evaluation pod (0 = none)."),
    Field("d_node_selector", dict, {},
          'Node labels evaluation pods require, e.g. `{"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}`.'),
    Field("d_s3_secret_name", str, "sao-s3",
          "Kubernetes secret with the S3 credentials (keys `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, "
          "`AWS_ENDPOINT_URL`); optional."),
    Field("d_tolerations", list, [],
          'Tolerations of evaluation pods, e.g. `[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": '
          '"NoSchedule"}]`.'),
    *shared_fields("c_previous_summary", "d_accelerator_type"),
)




def build_evaluation(settings: k8s.ClusterSettings | None = None):
    """The evaluation pipeline with these compile-time Kubernetes settings."""
    settings = settings or k8s.ClusterSettings()
    settings.validate()
    stage = build_evaluation_stage(settings)

    @pipeline_of(NAME, "Evaluate a model on SWE-Bench Verified, BeyondAIME and IMO-AnswerBench; one HTML report.",
                 FORM, description=DESCRIPTION)
    def evaluation(form) -> str:
        result = stage(model=form.a0_model, adapter=form.a_adapter, output_root=form.a0_output_root,
                       benchmarks=form.c_benchmarks, k=form.c_k, limit=form.c_limit, engine=form.c_engine,
                       max_new_tokens=form.c_max_new_tokens, max_total_tokens=form.c_max_total_tokens,
                       temperature=form.c_temperature, sandbox=form.c_sandbox,
                       previous_summary=form.c_previous_summary, eval_options=form.c_eval_options,
                       gpu_count=form.d_gpu_count, accelerator_type=form.d_accelerator_type,
                       node_selector=form.d_node_selector, tolerations=form.d_tolerations,
                       s3_secret_name=form.d_s3_secret_name).set_display_name("evaluation")
        return result.output

    return evaluation


evaluation = build_evaluation()
