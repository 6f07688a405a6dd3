"""Benchmark specs and loaders: SWE-Bench Verified, BeyondAIME and IMO-AnswerBench.

Each benchmark is one :class:`BenchmarkSpec` in :data:`BENCHMARKS`. :func:`load_benchmark` reads its
source with the data-preparation code (:func:`sao_core.data.prepare.prepare`, the same normalisers as
``sao prepare-data``), so the records have the shapes documented in :mod:`sao_core.data.schemas`:

- ``swe_verified`` (kind ``swe_bench_verified``): ``id, repo, base_commit, problem_statement,
  gold_patch, test_patch, fail_to_pass, pass_to_pass, version, ...``;
- ``beyond_aime``: ``id, problem, answer`` (int);
- ``imo_answerbench``: ``id, problem, answer, category, subcategory, source``.

A source is a Hugging Face dataset id (``org/name``, with the spec's split unless overridden), a local
file (jsonl, json, csv, parquet), a ``save_to_disk`` folder, an ``s3://`` object, or a folder / ``s3://``
prefix already written by ``sao prepare-data`` with the benchmark's kind (its ``data.jsonl`` is used
as it is). The loader records which data were used (:class:`DatasetInfo`: the source, split, a
content fingerprint, row counts, rejects) so a summary says exactly what was evaluated.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sao_core import storage
from sao_core.data.prepare import DATA_FILE, FAILED_MARKER, REJECTS_FILE, STATS_FILE, PrepareConfig, prepare
from sao_core.data.prepared import failure_of, open_prepared
from sao_core.data.schemas import DataError
from sao_core.envs.base import Task
from sao_core.eval.config import BENCHMARK_NAMES, EvalError

IMO_ANSWERBENCH_CSV = Path(__file__).resolve().parents[1] / "data" / "assets" / "imo_answerbench_v2.csv"


@dataclass(frozen=True)
class BenchmarkSpec:
    """What defines one benchmark: where its data live, which environment plays a sample, how it is
    graded (`grader`: ``exact_int``, ``math_rule`` or ``swe_tests``), which record fields its scores
    are broken down by (`groups`), and whether maj@k applies (math answers can be voted on)."""

    name: str
    title: str
    kind: str                       # sao prepare-data kind of its records
    default_source: str
    default_split: str
    env: str                        # environment that plays a sample: math | swe
    grader: str
    groups: tuple[str, ...] = ()
    majority: bool = True
    citation: str = ""
    license: str = ""


BENCHMARKS: dict[str, BenchmarkSpec] = {
    "swe_verified": BenchmarkSpec(
        name="swe_verified", title="SWE-Bench Verified", kind="swe_bench_verified",
        default_source="SWE-bench/SWE-bench_Verified", default_split="test", env="swe", grader="swe_tests",
        groups=("repo",), majority=False,
        citation="Jimenez et al., SWE-bench (ICLR 2024); OpenAI, SWE-bench Verified (2024)",
        license="see the dataset card"),
    "beyond_aime": BenchmarkSpec(
        name="beyond_aime", title="BeyondAIME", kind="beyond_aime",
        default_source="ByteDance-Seed/BeyondAIME", default_split="test", env="math", grader="exact_int",
        citation="ByteDance Seed, BeyondAIME (2025)", license="see the dataset card"),
    "imo_answerbench": BenchmarkSpec(
        name="imo_answerbench", title="IMO-AnswerBench", kind="imo_answerbench",
        default_source=str(IMO_ANSWERBENCH_CSV), default_split="train", env="math", grader="math_rule",
        groups=("category", "subcategory"),
        citation="Luong et al., Towards Robust Mathematical Reasoning (EMNLP 2025); IMO-Bench, Google DeepMind",
        license="CC-BY-4.0"),
}
assert tuple(BENCHMARKS) == BENCHMARK_NAMES


def get_benchmark(name: str) -> BenchmarkSpec:
    """The spec named `name`; EvalError listing the known names otherwise."""
    try:
        return BENCHMARKS[name]
    except (KeyError, TypeError):
        raise EvalError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}") from None


@dataclass
class DatasetInfo:
    """Which data a benchmark was evaluated on. `version` is ``sha256:<hex>`` of a file or
    ``<id>@<fingerprint>`` of a Hugging Face dataset (from :mod:`sao_core.data.readers`)."""

    source: str
    split: str
    version: str
    rows_read: int
    rows_rejected: int
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    repaired: int = 0
    problems_available: int = 0
    problems_used: int = 0
    rejects: list[dict[str, Any]] = field(default_factory=list)   # the first rejected rows (file, row, field, ...)
    license: str = ""
    citation: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadedBenchmark:
    """A benchmark's spec, its records (in dataset order, `limit` applied) and where they came from."""

    spec: BenchmarkSpec
    records: list[dict[str, Any]]
    dataset: DatasetInfo


_MAX_LISTED_REJECTS = 50


def load_benchmark(
    spec: BenchmarkSpec,
    source: str | None = None,
    split: str | None = None,
    limit: int | None = None,
    max_reject_fraction: float = 0.0,
    workdir: str | Path | None = None,
) -> LoadedBenchmark:
    """Read and normalise a benchmark's data set.

    `source` defaults to the spec's (a Hugging Face id, or the bundled CSV for IMO-AnswerBench);
    `split` to the spec's. Malformed rows are rejected with the file, row, line and field; more than
    `max_reject_fraction` of them (default: any) stops with an EvalError that names the first. `limit`
    keeps the first N problems. `workdir` (a local folder) receives the normalised ``data.jsonl``,
    ``rejects.jsonl`` and ``stats.json``; without it a temporary folder is used and removed.
    """
    src = source or spec.default_source
    chosen_split = split or spec.default_split
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix=f"sao-eval-{spec.name}-") as tmp:
            return load_benchmark(spec, src, chosen_split, limit, max_reject_fraction, tmp)
    out = Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    prepared = _prepared_folder(src, spec)
    if prepared is not None:
        records, stats = prepared
        (out / DATA_FILE).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                                     encoding="utf-8")
        (out / STATS_FILE).write_text(json.dumps(stats, indent=2, ensure_ascii=False, default=str) + "\n",
                                      encoding="utf-8")
        rejects: list[dict[str, Any]] = []
    else:
        config = PrepareConfig(source=src, kind=spec.kind, output=str(out), split=chosen_split,
                               max_reject_fraction=max_reject_fraction, dedup=False)
        try:
            prepare(config)
        except DataError as err:
            raise EvalError(f"benchmark {spec.name}: cannot load dataset {src}: {err}") from err
        stats = json.loads((out / STATS_FILE).read_text(encoding="utf-8"))
        records = _read_jsonl(out / DATA_FILE)
        rejects = _read_jsonl(out / REJECTS_FILE)[:_MAX_LISTED_REJECTS]
    if not records:
        raise EvalError(f"benchmark {spec.name}: dataset {src} holds no usable problems")
    used = records[:limit] if limit is not None else records
    info = DatasetInfo(
        source=src, split=chosen_split, version=str(stats.get("dataset_version") or ""),
        rows_read=int(stats.get("rows_read", len(records))), rows_rejected=int(stats.get("rows_rejected", 0)),
        rejected_by_reason=dict(stats.get("rejected_by_reason") or {}), repaired=int(stats.get("repaired", 0)),
        problems_available=len(records), problems_used=len(used), rejects=rejects,
        license=spec.license, citation=spec.citation)
    return LoadedBenchmark(spec, used, info)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _prepared_folder(source: str, spec: BenchmarkSpec) -> tuple[list[dict], dict] | None:
    """Records and stats of a folder (or s3:// prefix) written by ``sao prepare-data``, else None. A folder
    whose preparation failed (``FAILED`` marker, failed status) or that holds no rows is refused."""
    is_file = (Path(source.rstrip("/").rsplit("/", 1)[-1]).suffix != "" if storage.is_s3_uri(source)
               else not Path(source).expanduser().is_dir())
    if is_file:
        # A file (read as a raw source) must not be the data of a prepared folder whose preparation failed.
        folder = source.rsplit("/", 1)[0] if "/" in source else "."
        try:
            reason = failure_of(folder) if storage.is_s3_uri(folder) or Path(folder).expanduser().is_dir() else None
        except storage.StorageError as err:
            raise EvalError(f"benchmark {spec.name}: cannot read {source}'s folder {folder}: {err}") from err
        if reason is not None:
            raise EvalError(f"benchmark {spec.name}: {source} lies in the prepared folder {folder}, which is marked "
                            f"unusable ({storage.join(folder, FAILED_MARKER)}: {reason}); prepare it again")
        return None
    stats_uri = storage.join(source, STATS_FILE)
    try:
        if failure_of(source) is None:                    # a FAILED folder is ours (and refused below)
            if not storage.exists(stats_uri):
                return None
            stats = json.loads(storage.read_text(stats_uri))
            if not isinstance(stats, dict) or "kind" not in stats:
                return None                               # some other stats.json: not ours
        prepared = open_prepared(source)
    except (storage.StorageError, ValueError) as err:     # PreparedDataError is a ValueError
        raise EvalError(f"benchmark {spec.name}: cannot use prepared dataset {source}: {err}") from err
    stats = prepared.stats or {}
    if stats.get("kind") != spec.kind:
        raise EvalError(f"benchmark {spec.name}: {source} was prepared with --kind {stats.get('kind')}; "
                        f"this benchmark needs --kind {spec.kind}")
    for line_no, record in enumerate(prepared.rows, start=1):
        if "id" not in record:
            raise EvalError(f"benchmark {spec.name}: {prepared.data_uri} row {line_no - 1} is not a prepared "
                            "record (no id)")
    return prepared.rows, stats


# --------------------------------------------------------------------------------------- tasks

def math_messages(problem: str, prompt: str, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The opening chat messages of a math sample: `prompt` with ``{problem}`` replaced (literally; other
    braces such as ``\\boxed{}`` stay as written), after an optional system message."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt.replace("{problem}", problem)})
    return messages


def task_for(spec: BenchmarkSpec, record: dict[str, Any], prompt: str, system_prompt: str | None = None) -> Task:
    """The environment task that plays one sample of `record` (env ``math`` or ``swe``)."""
    if spec.env == "swe":
        from sao_core.envs.swe import task_from_swe_record

        return task_from_swe_record(record)
    metadata = {key: record.get(key) for key in spec.groups}
    metadata["benchmark"] = spec.name
    return Task(id=str(record["id"]), env=spec.env, prompt=math_messages(str(record["problem"]), prompt, system_prompt),
                answer=str(record["answer"]), metadata=metadata)


def group_values(spec: BenchmarkSpec, record: dict[str, Any]) -> dict[str, str]:
    """The record's value of each of the spec's group fields (missing: ``"(none)"``)."""
    return {key: str(record.get(key) or "(none)") for key in spec.groups}
