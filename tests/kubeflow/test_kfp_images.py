"""The CPU image builds (buildah, chroot isolation, from a debootstrapped Debian base: no Docker engine
or registry needed) and the prepare_data and evaluate components run inside it from their compiled
commands, with the executor input KFP would give them, producing the same outputs as the local run.

Building takes minutes (pip installs the training stack), so this runs only with SAO_IMAGE_TESTS=1
(`make test-image`). SAO_TEST_IMAGE names an already built image to skip the build.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WHEELS = os.environ.get("SAO_WHEELS", "/opt/wheels")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("SAO_IMAGE_TESTS") != "1", reason="image build: set SAO_IMAGE_TESTS=1"),
    pytest.mark.skipif(shutil.which("buildah") is None, reason="needs buildah (apt-get install buildah debootstrap)"),
]


@pytest.fixture(scope="module")
def image() -> str:
    given = os.environ.get("SAO_TEST_IMAGE")
    if given:
        return given
    tag = "localhost/sao-kfp-cpu:test"
    command = [str(ROOT / "images" / "build.sh"), "cpu", "--tag", tag, "--debian-base"]
    if Path(WHEELS).is_dir():
        command += ["--wheels", WHEELS]
    subprocess.run(command, cwd=ROOT, check=True, timeout=3600)
    return tag


def run_in_image(image: str, component, arguments: dict, workdir: Path) -> dict:
    """Run `component` inside `image` the way a KFP pod would: the compiled command with the executor
    input placeholders filled (KFP's own helpers), host `workdir` mounted at /work. Returns the
    executor output (parameters and artifacts with their metadata)."""
    from google.protobuf import json_format
    from kfp.local import executor_input_utils, placeholder_utils
    from kfp.pipeline_spec import pipeline_spec_pb2

    spec = component.pipeline_spec
    component_spec = spec.components[spec.root.dag.tasks[component.name].component_ref.name]
    deployment = json_format.ParseDict(json_format.MessageToDict(spec.deployment_spec),
                                       pipeline_spec_pb2.PipelineDeploymentConfig())
    container_spec = deployment.executors[component_spec.executor_label].container
    executor_input = executor_input_utils.construct_executor_input(
        component_spec=component_spec, arguments=arguments, task_root=f"/work/root/{component.name}",
        block_input_artifact=False)
    executor_input_dict = executor_input_utils.executor_input_to_dict(executor_input, component_spec)
    command = placeholder_utils.replace_placeholders(
        full_command=list(container_spec.command) + list(container_spec.args),
        executor_input_dict=executor_input_dict, pipeline_resource_name="image-test",
        task_resource_name=component.name, pipeline_root="/work/root", unique_pipeline_id="img")
    container = subprocess.run(["buildah", "from", "--quiet", image], check=True, capture_output=True,
                               text=True).stdout.strip()
    try:
        result = subprocess.run(
            ["buildah", "run", "--isolation", "chroot", "-v", f"{workdir}:/work", "--env", "HF_HUB_OFFLINE=1",
             "--env", "HF_DATASETS_OFFLINE=1", container, "--", *command],
            capture_output=True, text=True, timeout=1200)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    output_file = executor_input_dict["outputs"]["outputFile"]
    return json.loads((workdir / Path(output_file).relative_to("/work")).read_text())


def test_prepare_data_in_the_image_matches_the_local_run(image, tmp_path):
    from components.prepare_data import prepare_data
    from sao_core.data.synthetic import tool_arith_sft_rows

    work = tmp_path / "work"
    (work / "in").mkdir(parents=True)
    rows = [*tool_arith_sft_rows(40, seed=2), {"messages": [{"role": "robot", "content": "x"}]}]
    (work / "in" / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = run_in_image(image, prepare_data, {"source": "/work/in/raw.jsonl", "kind": "sft"}, work)
    assert output["parameterValues"]["rows_written"] == 40
    in_image = work / "root" / "prepare-data" / "dataset"
    assert output["artifacts"]["dataset"]["artifacts"][0]["metadata"]["rows_rejected"] == 1

    local = run_local(prepare_data, {"source": str(work / "in" / "raw.jsonl"), "kind": "sft"}, tmp_path / "local")
    local_dir = Path(local.outputs["dataset"].path)
    assert (in_image / "data.jsonl").read_bytes() == (local_dir / "data.jsonl").read_bytes()
    strip = ("source", "output", "files", "seconds", "config")
    image_stats = {k: v for k, v in json.loads((in_image / "stats.json").read_text()).items() if k not in strip}
    local_stats = {k: v for k, v in json.loads((local_dir / "stats.json").read_text()).items() if k not in strip}
    assert image_stats == local_stats


def test_evaluate_in_the_image_matches_the_local_run(image, tmp_path, sao_cache):
    from components.evaluate import evaluate

    arguments = {"model": "embedded:tiny", "benchmarks": "imo_answerbench", "k": 2, "limit": 2, "engine": "hf",
                 "max_new_tokens": 16, "max_total_tokens": 256, "sandbox": "local", "run_id": "same",
                 "options": {"grader_workers": 1}}
    work = tmp_path / "work"
    work.mkdir()
    output = run_in_image(image, evaluate, {**arguments, "output_root": "/work/runs"}, work)
    in_image = json.loads((work / "runs" / "same" / "eval-imo_answerbench" / "summary.json").read_text())
    assert output["parameterValues"]["summary_uri"] == "/work/runs/same/eval-imo_answerbench/summary.json"
    assert "imo_answerbench/avg@2" in output["artifacts"]["metrics"]["artifacts"][0]["metadata"]

    os.environ["SAO_CACHE_DIR"] = str(sao_cache)
    run_local(evaluate, {**arguments, "output_root": str(tmp_path / "local-runs")}, tmp_path / "local")
    local = json.loads((tmp_path / "local-runs" / "same" / "eval-imo_answerbench" / "summary.json").read_text())
    assert in_image["metrics"] == local["metrics"]
    assert in_image["benchmarks"]["imo_answerbench"]["dataset"]["version"] == \
        local["benchmarks"]["imo_answerbench"]["dataset"]["version"]

    def samples(path: Path):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return sorted((r["id"], r["sample"], r["seed"], r["response"], r["answer"], r["tokens"], r["correct"]) for r in rows)

    assert samples(work / "runs" / "same" / "eval-imo_answerbench" / "samples.jsonl") == \
        samples(tmp_path / "local-runs" / "same" / "eval-imo_answerbench" / "samples.jsonl")


def run_local(component, arguments, root: Path):
    """The same component with KFP's local runner on this machine."""
    from kfp import local

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root))
    return component(**arguments)
