"""prepare_data: normalise a dataset (Hugging Face id, local file or s3:// object) for one data kind.

Calls :func:`sao_core.data.prepare.prepare`. The Dataset artifact is the prepared folder
(``data.jsonl``, ``rejects.jsonl``, ``stats.json``); its metadata and the Metrics artifact carry the
row counts, rejects by reason and the dataset version. Fails (and the task is retried by the
pipelines) when the source cannot be read; fails for good when the rejected share is above
``max_reject_fraction`` or no row is written. A failed preparation publishes nothing: the folder gets a
``FAILED`` marker (and the failed attempt's reports under ``failed/``), which every reader refuses.
Prompts of sft/dpo/rl rows longer than ``max_prompt_tokens`` are rejected (tokens with
``tokenizer_model``, else characters at 8 a token).
"""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Dataset, Metrics, Output

from sao_core.images import image


@dsl.component(base_image=image("cpu"), install_kfp_package=False)
def prepare_data(
    source: str,
    kind: str,
    dataset: Output[Dataset],
    stats: Output[Metrics],
    split: str = "train",
    limit: int = 0,
    max_reject_fraction: float = 0.05,
    tokenizer_model: str = "",
    max_tokens: int = 0,
    max_prompt_tokens: int = 4096,
    dedup: bool = True,
) -> NamedTuple("PrepareOutputs", rows_written=int, dataset_version=str):
    """Normalise a dataset for one data kind, with rejects and stats.

    Args:
        source: Dataset to read: a Hugging Face id (org/name), a local jsonl/json/parquet/csv file or an s3:// URI.
        kind: Data kind: sft, cpt, dpo, rl, or a benchmark (swe_bench_verified, beyond_aime, imo_answerbench).
        dataset: The prepared folder (data.jsonl, rejects.jsonl, stats.json).
        stats: Row counts, rejects and duplicates.
        split: Split of a Hugging Face dataset.
        limit: Read at most this many rows (0 = all).
        max_reject_fraction: Fail when more than this share of the rows is malformed (0 to 1).
        tokenizer_model: Model reference whose tokenizer counts tokens for max_tokens ('' = no length filter).
        max_tokens: Drop rows longer than this many tokens (0 = no length filter; needs tokenizer_model).
        max_prompt_tokens: Prompt budget of sft, dpo and rl rows, in tokens (chat template of tokenizer_model), or without a tokenizer 8 characters a token (0 = no budget).
        dedup: Drop exact duplicate rows.
    """
    from sao_core.config import build_config
    from sao_core.data.prepare import PrepareConfig, prepare
    from sao_core.kfp import artifacts

    config = build_config(PrepareConfig, {
        "source": source, "kind": kind, "output": dataset.path, "split": split, "limit": limit or None,
        "max_reject_fraction": max_reject_fraction, "tokenizer": tokenizer_model or None,
        "max_tokens": max_tokens or None, "max_prompt_tokens": max_prompt_tokens or None, "dedup": dedup},
        source="prepare_data")
    if config.tokenizer:
        from sao_core.models import resolve_model

        config.tokenizer = str(resolve_model(config.tokenizer, artifacts.cache_dir()).path)
    result = prepare(config)
    dataset.metadata.update({"kind": kind, "source": source, "split": split, "rows": result.rows_written,
                             "rows_rejected": result.rows_rejected, "duplicates": result.duplicates,
                             "dataset_version": result.dataset_version})
    artifacts.log_numbers(stats, {"rows_read": result.rows_read, "rows_written": result.rows_written,
                                  "rows_rejected": result.rows_rejected, "duplicates": result.duplicates,
                                  "rejected": result.rejected_by_reason})
    return (result.rows_written, result.dataset_version)  # the NamedTuple outputs, in order
