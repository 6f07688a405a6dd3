"""The KFP client (upload, upload a version, run, schedule, list / disable recurring runs) against a real
HTTP server on 127.0.0.1 that speaks the KFP v2beta1 REST paths kfp.Client uses. The server checks every
request against the official API specification (../shared/data/kubeflow/kfp_api_v2beta1.swagger.json):
the operation must exist, query parameters must be declared, and JSON bodies must validate against the
operation's body schema with unknown fields refused, so the client is held to the real contract. Bad
cron strings, bad arguments and unreachable hosts are refused before any request."""

from __future__ import annotations

import copy
import email.parser
import email.policy
import json
import re
import socket
import uuid
from pathlib import Path

import jsonschema
import pytest
import yaml
from fake_http import FakeServer, Request  # noqa: E402  (tests/fake_http.py: the stand-in servers' home)

from pipelines import commands
from sao_core.kfp import client as kfp_client
from sao_core.kfp.client import KFPError

SWAGGER_PATH = Path(__file__).resolve().parents[3] / "shared" / "data" / "kubeflow" / "kfp_api_v2beta1.swagger.json"
if not SWAGGER_PATH.is_file():  # a checkout elsewhere: the project keeps the file next to the repository
    SWAGGER_PATH = Path("/work/shared/data/kubeflow/kfp_api_v2beta1.swagger.json")
SWAGGER = json.loads(SWAGGER_PATH.read_text())
#: libyaml's loader where PyYAML has it: the server reads every uploaded package (post_training's is ~500 kB, ~1.3 s
#: in the pure-Python loader on 2 busy cores, 0.2 s here); the documents are the same
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# ------------------------------------------------------------------------------------ the contract
def _strict(node):
    """Definitions as JSON Schema draft 4 with unknown properties refused; int64 fields (strings in the
    spec) also accept JSON numbers, as the server's protojson decoder does."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: ({name: _strict(prop) for name, prop in v.items()} if k == "properties" else _strict(v))
           for k, v in node.items() if k not in ("title", "description", "readOnly")}
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if out.get("type") == "string" and out.get("format") in ("int64", "uint64"):
        out["type"] = ["string", "integer"]
        out.pop("format")
    return out


STRICT_DEFINITIONS = _strict(SWAGGER["definitions"])


#: Enum numbers of v2beta1PredicateOperation (backend/api/v2beta1/filter.proto); protojson accepts them.
OPERATION_NUMBERS = {0: "OPERATION_UNSPECIFIED", 1: "EQUALS", 2: "NOT_EQUALS", 3: "GREATER_THAN",
                     5: "GREATER_THAN_EQUALS", 6: "LESS_THAN", 7: "LESS_THAN_EQUALS", 8: "IN", 9: "IS_SUBSTRING"}


def parse_filter(text: str) -> dict:
    """A ``filter`` query value as v2beta1Filter (snake_case names, enum names); ValueError if invalid."""
    def snake(name: str) -> str:
        return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name)

    data = json.loads(text)
    predicates = []
    for predicate in data.get("predicates", []):
        converted = {snake(k): v for k, v in predicate.items()}
        if isinstance(converted.get("operation"), int):
            converted["operation"] = OPERATION_NUMBERS[converted["operation"]]
        predicates.append(converted)
    result = {**{snake(k): v for k, v in data.items()}, "predicates": predicates}
    schema = {"definitions": STRICT_DEFINITIONS, "$ref": "#/definitions/v2beta1Filter"}
    errors = [e.message for e in jsonschema.Draft4Validator(schema).iter_errors(result)]
    if errors:
        raise ValueError(f"filter {text!r}: {errors[0]}")
    return result


class Contract:
    """Routes of the swagger file and the checks of one request against its operation."""

    def __init__(self, swagger: dict):
        self.routes = []
        for template, methods in swagger["paths"].items():
            parts = re.split(r"\{([^}]+)\}", template)  # literal, name, literal, name, ...
            pattern = "".join(re.escape(part) if i % 2 == 0 else f"(?P<{part.replace('.', '_')}>[^/:]+)"
                              for i, part in enumerate(parts))
            for method, operation in methods.items():
                self.routes.append((method.upper(), re.compile(f"^{pattern}$"), template, operation))

    def match(self, method: str, path: str):
        for verb, pattern, template, operation in self.routes:
            found = pattern.match(path)
            if verb == method and found:
                return template, operation, found.groupdict()
        return None

    def check(self, operation: dict, query: dict[str, list[str]], body, content_type: str) -> list[str]:
        problems = []
        declared = {p["name"]: p for p in operation.get("parameters", [])}
        for name, values in query.items():
            spec = declared.get(name)
            if spec is None or spec["in"] != "query":
                problems.append(f"undeclared query parameter {name!r}")
            elif spec.get("type") == "integer" and not all(re.fullmatch(r"-?\d+", v) for v in values):
                problems.append(f"query parameter {name!r} must be an integer, got {values}")
            elif name == "filter" and values[0]:
                try:
                    parse_filter(values[0])
                except (ValueError, KeyError) as err:
                    problems.append(str(err))
        body_spec = next((p for p in declared.values() if p["in"] == "body"), None)
        form = [p for p in declared.values() if p["in"] == "formData"]
        if body_spec is not None:
            if not content_type.startswith("application/json"):
                problems.append(f"body must be JSON, got {content_type!r}")
            else:
                schema = {"definitions": STRICT_DEFINITIONS, **_strict(body_spec["schema"])}
                validator = jsonschema.Draft4Validator(schema, format_checker=jsonschema.FormatChecker())
                problems += [f"body{''.join(f'[{p!r}]' for p in e.absolute_path)}: {e.message}"
                             for e in validator.iter_errors(body)]
        elif form:
            if not content_type.startswith("multipart/form-data"):
                problems.append(f"upload must be multipart/form-data, got {content_type!r}")
            missing = [p["name"] for p in form if p.get("required") and p["name"] not in (body or {})]
            problems += [f"missing form field {m!r}" for m in missing]
        elif body not in (None, b"", {}):
            problems.append("operation takes no body")
        return problems


# ------------------------------------------------------------------------------------ the server
class FakeKFP:
    """A KFP API server on 127.0.0.1 with in-memory state; records every request and contract problem."""

    def __init__(self):
        self.contract = Contract(SWAGGER)
        self.requests: list[dict] = []
        self.violations: list[str] = []
        self.pipelines: dict[str, dict] = {}
        self.versions: dict[str, list[dict]] = {}
        self.experiments: dict[str, dict] = {}
        self.runs: dict[str, dict] = {}
        self.recurring: dict[str, dict] = {}
        self.server = FakeServer(lambda r: (*self.dispatch(r.method, r.route, r.query, r.body,
                                                           r.headers.get("Content-Type", "")), "application/json"))
        self.url = self.server.url

    def close(self):
        self.server.stop()

    # -- request parsing and checking
    def dispatch(self, method, path, query, raw, content_type):
        body = None
        if content_type.startswith("application/json") and raw:
            body = json.loads(raw)
        elif content_type.startswith("multipart/form-data"):
            message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + raw)
            body = {part.get_param("name", header="content-disposition"): part.get_payload(decode=True)
                    for part in message.iter_parts()}
        route = self.contract.match(method, path)
        record = {"method": method, "path": path, "query": {k: v[0] for k, v in query.items()}, "body": body,
                  "operation": route[1].get("operationId") if route else None}
        self.requests.append(record)
        if route is None:
            self.violations.append(f"{method} {path}: no such operation in the API specification")
            return 404, {"code": 5, "message": f"no route {method} {path}"}
        template, operation, path_params = route
        problems = self.contract.check(operation, query, body, content_type)
        if problems:
            self.violations += [f"{operation['operationId']}: {p}" for p in problems]
            return 400, {"code": 3, "message": "; ".join(problems)}
        handler = getattr(self, operation["operationId"].split("_")[-1], None)
        if handler is None:
            return 501, {"code": 12, "message": f"{operation['operationId']} not implemented by the test server"}
        status, answer = handler(record["query"], body, path_params)
        if status == 200:  # the test server holds itself to the specification too
            schema = operation["responses"]["200"].get("schema")
            if schema is not None:
                validator = jsonschema.Draft4Validator({"definitions": STRICT_DEFINITIONS, **_strict(schema)})
                self.violations += [f"{operation['operationId']} response: {e.message}"
                                    for e in validator.iter_errors(answer)]
        return status, answer

    @staticmethod
    def _filter(query, key="display_name"):
        """The names an EQUALS filter on `key` selects (None: no filter). The filter is JSON of v2beta1Filter
        read as the server's protojson decoder does (lowerCamelCase names and enum numbers allowed)."""
        if not query.get("filter"):
            return None
        predicates = parse_filter(query["filter"])["predicates"]
        return {p["string_value"] for p in predicates if p["key"] == key and p["operation"] == "EQUALS"}

    # -- operations (names from the swagger operationIds)
    def GetHealthz(self, query, body, params):
        return 200, {"multi_user": False, "pipeline_store": "database"}

    def ListPipelines(self, query, body, params):
        names = self._filter(query)
        found = [p for p in self.pipelines.values() if names is None or p["display_name"] in names]
        return 200, {"pipelines": found, "total_size": len(found)}

    def UploadPipeline(self, query, body, params):
        pipeline_id = str(uuid.uuid4())
        name = query.get("name") or query.get("display_name")
        pipeline = {"pipeline_id": pipeline_id, "display_name": name, "name": name,
                    "description": query.get("description", ""), "created_at": "2026-11-30T00:00:00Z"}
        self.pipelines[pipeline_id] = pipeline
        self.versions[pipeline_id] = []
        self._add_version(pipeline_id, name, body["uploadfile"])
        return 200, pipeline

    def UploadPipelineVersion(self, query, body, params):
        pipeline_id = query.get("pipelineid")
        if pipeline_id not in self.pipelines:
            return 404, {"code": 5, "message": f"pipeline {pipeline_id} not found"}
        return 200, self._add_version(pipeline_id, query.get("name"), body["uploadfile"])

    def _add_version(self, pipeline_id, name, package: bytes):
        docs = [d for d in yaml.load_all(package, Loader=YAML_LOADER) if d]
        spec = docs[0] if len(docs) == 1 else {"pipeline_spec": docs[0], "platform_spec": docs[1]}
        version = {"pipeline_id": pipeline_id, "pipeline_version_id": str(uuid.uuid4()), "display_name": name,
                   "name": name, "created_at": f"2026-11-30T00:00:{len(self.versions[pipeline_id]):02d}Z",
                   "pipeline_spec": spec}
        self.versions[pipeline_id].append(version)
        return version

    def ListPipelineVersions(self, query, body, params):
        found = list(reversed(self.versions.get(params["pipeline_id"], [])))
        size = int(query.get("page_size") or 10)
        return 200, {"pipeline_versions": found[:size], "total_size": len(found)}

    def GetPipelineVersion(self, query, body, params):
        for version in self.versions.get(params["pipeline_id"], []):
            if version["pipeline_version_id"] == params["pipeline_version_id"]:
                return 200, version
        return 404, {"code": 5, "message": "version not found"}

    def ListExperiments(self, query, body, params):
        names = self._filter(query)
        found = [e for e in self.experiments.values() if names is None or e["display_name"] in names]
        return 200, {"experiments": found, "total_size": len(found)}

    def CreateExperiment(self, query, body, params):
        experiment = {**body, "experiment_id": str(uuid.uuid4()), "storage_state": "AVAILABLE"}
        self.experiments[experiment["experiment_id"]] = experiment
        return 200, experiment

    def CreateRun(self, query, body, params):
        run = {**copy.deepcopy(body), "run_id": str(uuid.uuid4()), "state": "PENDING"}
        self.runs[run["run_id"]] = run
        return 200, run

    def CreateRecurringRun(self, query, body, params):
        job = {**copy.deepcopy(body), "recurring_run_id": str(uuid.uuid4()),
               "status": "ENABLED" if body.get("mode", "ENABLE") == "ENABLE" else "DISABLED"}
        self.recurring[job["recurring_run_id"]] = job
        return 200, job

    def ListRecurringRuns(self, query, body, params):
        found = [r for r in self.recurring.values()
                 if not query.get("experiment_id") or r.get("experiment_id") == query["experiment_id"]]
        start = int(query.get("page_token") or 0)
        size = int(query.get("page_size") or 10)
        page = found[start:start + size]
        token = str(start + size) if start + size < len(found) else ""
        return 200, {"recurringRuns": page, "total_size": len(found), "next_page_token": token}

    def DisableRecurringRun(self, query, body, params):
        self.recurring[params["recurring_run_id"]]["status"] = "DISABLED"
        return 200, {}

    def EnableRecurringRun(self, query, body, params):
        self.recurring[params["recurring_run_id"]]["status"] = "ENABLED"
        return 200, {}

    def of(self, operation_id: str) -> list[dict]:
        return [r for r in self.requests if r["operation"] == operation_id]


@pytest.fixture
def server():
    fake = FakeKFP()
    yield fake
    fake.close()
    assert not fake.violations, fake.violations


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    out = tmp_path_factory.mktemp("packages")
    return {p.stem: p for p in commands.compile_pipelines(["evaluation", "post_training", "sao_rl"], out)}


def _api(server):
    return kfp_client.connect(server.url)


# ------------------------------------------------------------------------------------ the contract is real
def test_the_contract_refuses_what_the_real_server_would(server):
    contract = server.contract
    _, operation, _ = contract.match("POST", "/apis/v2beta1/recurringruns")
    good = {"display_name": "x", "max_concurrency": "1", "trigger": {"cron_schedule": {"cron": "0 0 2 * * *"}},
            "mode": "ENABLE", "no_catchup": True, "pipeline_spec": {"a": 1}}
    assert contract.check(operation, {}, good, "application/json") == []
    assert any("additional" in p.lower() for p in
               contract.check(operation, {}, {**good, "cron": "x"}, "application/json"))
    assert contract.check(operation, {}, {**good, "mode": "SOMETIMES"}, "application/json")
    assert contract.check(operation, {}, {**good, "no_catchup": "yes"}, "application/json")
    assert contract.check(operation, {"bogus": ["1"]}, good, "application/json")
    assert contract.match("POST", "/apis/v2beta1/recurringruns/abc:pause") is None
    _, upload, _ = contract.match("POST", "/apis/v2beta1/pipelines/upload")
    assert contract.check(upload, {"name": ["p"]}, {}, "multipart/form-data; boundary=x") == [
        "missing form field 'uploadfile'"]


# ------------------------------------------------------------------------------------ upload
def test_upload_then_upload_a_new_version(server, packages):
    api = _api(server)
    first = kfp_client.upload(api, packages["evaluation"], "sao-evaluation", description="nightly")
    assert first["new_pipeline"] is True and first["pipeline_id"] in server.pipelines
    assert first["version_id"] == server.versions[first["pipeline_id"]][0]["pipeline_version_id"]
    (upload,) = server.of("UploadPipeline")
    assert upload["query"]["name"] == "sao-evaluation" and upload["query"]["description"] == "nightly"
    assert upload["body"]["uploadfile"] == packages["evaluation"].read_bytes()

    second = kfp_client.upload(api, packages["evaluation"], "sao-evaluation", version_name="v2")
    assert second == {"pipeline_id": first["pipeline_id"], "version_id": second["version_id"], "version_name": "v2",
                      "new_pipeline": False}
    (version,) = server.of("UploadPipelineVersion")
    assert version["query"]["pipelineid"] == first["pipeline_id"] and version["query"]["name"] == "v2"
    assert len(server.versions[first["pipeline_id"]]) == 2


def test_upload_sends_the_packages_own_description_by_default(server, packages):
    """sao_rl's description (its required fields, groups and every b_options key) reaches the KFP pipeline, whose
    page shows it; an explicit description still wins."""
    api = _api(server)
    kfp_client.upload(api, packages["sao_rl"], "sao-rl")
    (upload,) = server.of("UploadPipeline")
    said = upload["query"]["description"]
    assert said == kfp_client.package_description(packages["sao_rl"])
    assert said.startswith("Required: `a0_rl_source`") and "`critic_lr=5e-06`" in said
    assert kfp_client.package_description(packages["sao_rl"].parent / "missing.yaml") is None


def test_upload_refuses_a_missing_package_before_any_request(server, tmp_path):
    api = _api(server)
    before = len(server.requests)
    with pytest.raises(KFPError, match="does not exist"):
        kfp_client.upload(api, tmp_path / "nope.yaml", "x")
    assert len(server.requests) == before


# ------------------------------------------------------------------------------------ runs
def test_run_sends_the_exact_body(server, packages):
    api = _api(server)
    result = kfp_client.run(api, "nightly", "eval-1", {"a0_model": "s3://b/m", "a0_output_root": "s3://b/runs", "c_k": 8,
                                                        "c_benchmarks": ["imo_answerbench"]},
                            package_path=packages["evaluation"])
    (create,) = server.of("RunService_CreateRun")
    experiment_id = server.of("ExperimentService_CreateExperiment")[0]
    assert result == {"run_id": next(iter(server.runs)), "experiment_id": next(iter(server.experiments))}
    body = create["body"]
    assert body["display_name"] == "eval-1" and body["experiment_id"] == result["experiment_id"]
    assert body["runtime_config"] == {"parameters": {"a0_model": "s3://b/m", "a0_output_root": "s3://b/runs", "c_k": 8,
                                                     "c_benchmarks": ["imo_answerbench"]}}
    # The package has two documents, so the Kubernetes platform spec travels with the pipeline spec.
    assert body["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "sao-evaluation"
    assert "kubernetes" in body["pipeline_spec"]["platform_spec"]["platforms"]
    assert experiment_id["body"] == {"display_name": "nightly", "namespace": ""}
    # A second run reuses the experiment.
    kfp_client.run(api, "nightly", "eval-2", {"a0_model": "m", "a0_output_root": "r"}, package_path=packages["evaluation"])
    assert len(server.of("ExperimentService_CreateExperiment")) == 1 and len(server.runs) == 2


def test_run_of_an_uploaded_version_checks_arguments_against_the_server_spec(server, packages):
    """The evaluation pipeline (34 kB; post_training's 500 kB package cost ~4 s more of YAML here): what is tested is
    that a run of an uploaded version reads the parameters (and the dropdown) from the server's copy. post_training's
    method dropdown has its own test (test_kfp_spec::test_method_dropdown_lists_every_method_and_round_trips), and
    test_kfp_docs uploads and runs post_training as the README does."""
    api = _api(server)
    uploaded = kfp_client.upload(api, packages["evaluation"], "sao-evaluation")
    kfp_client.run(api, "exp", "ev-1", {"a0_model": "s3://b/m", "a0_output_root": "s3://b/r", "c_engine": "hf"},
                   pipeline_id=uploaded["pipeline_id"], version_id=uploaded["version_id"])
    body = server.of("RunService_CreateRun")[0]["body"]
    assert body["pipeline_version_reference"] == {"pipeline_id": uploaded["pipeline_id"],
                                                  "pipeline_version_id": uploaded["version_id"]}
    assert "pipeline_spec" not in body
    count = len(server.requests)
    with pytest.raises(KFPError, match="'c_engine' must be one of vllm, hf"):
        kfp_client.run(api, "exp", "ev-2", {"a0_model": "x", "a0_output_root": "y", "c_engine": "trt"},
                       pipeline_id=uploaded["pipeline_id"], version_id=uploaded["version_id"])
    assert [r["operation"] for r in server.requests[count:]] == ["PipelineService_GetPipelineVersion"]


@pytest.mark.parametrize("arguments, message", [
    ({"a0_model": "m"}, "missing required pipeline parameter\\(s\\): a0_output_root"),
    ({"a0_model": "m", "a0_output_root": "r", "kk": 1}, "unknown pipeline parameter\\(s\\) kk"),
    ({"a0_model": "m", "a0_output_root": "r", "c_k": "four"}, "'c_k' must be integer"),
    ({"a0_model": "m", "a0_output_root": "r", "c_k": True}, "'c_k' must be integer"),
    ({"a0_model": "m", "a0_output_root": "r", "c_benchmarks": "imo_answerbench"}, "'c_benchmarks' must be list"),
    ({"a0_model": "m", "a0_output_root": "r", "c_engine": "trt"}, "'c_engine' must be one of vllm, hf"),
])
def test_bad_arguments_are_refused_before_any_request(server, packages, arguments, message):
    api = _api(server)
    before = len(server.requests)
    with pytest.raises(KFPError, match=message):
        kfp_client.run(api, "exp", "r", arguments, package_path=packages["evaluation"])
    with pytest.raises(KFPError, match=message):
        kfp_client.schedule(api, "exp", "s", "0 0 2 * * *", arguments, package_path=packages["evaluation"])
    assert len(server.requests) == before


# ------------------------------------------------------------------------------------ recurring runs
def test_schedule_sends_the_exact_body_then_list_and_disable(server, packages):
    api = _api(server)
    import datetime as dt

    created = kfp_client.schedule(api, "nightly", "nightly-eval", "0  0 2 * * *",
                                  {"a0_model": "s3://b/m", "a0_output_root": "s3://b/runs"},
                                  package_path=packages["evaluation"], max_concurrency=2,
                                  start_time=dt.datetime(2026, 12, 1, 3, 0, tzinfo=dt.timezone(dt.timedelta(hours=1))))
    (request,) = server.of("RecurringRunService_CreateRecurringRun")
    body = request["body"]
    assert created["cron"] == "0 0 2 * * *" and created["recurring_run_id"] in server.recurring
    spec = body.pop("pipeline_spec")
    assert spec["pipeline_spec"]["pipelineInfo"]["name"] == "sao-evaluation"
    assert body == {
        "display_name": "nightly-eval", "experiment_id": created["experiment_id"],
        "max_concurrency": 2, "mode": "ENABLE", "no_catchup": True,
        "runtime_config": {"parameters": {"a0_model": "s3://b/m", "a0_output_root": "s3://b/runs"}},
        "trigger": {"cron_schedule": {"cron": "0 0 2 * * *", "start_time": "2026-12-01T02:00:00Z"}},
    }

    for i in range(3):  # enough for two pages of two
        kfp_client.schedule(api, "other", f"job-{i}", "0 30 * * * MON-FRI", {"a0_model": "m", "a0_output_root": "r"},
                            package_path=packages["evaluation"], enabled=False, no_catchup=False)
    everything = kfp_client.list_recurring_runs(api, page_size=2)
    assert [r["name"] for r in everything] == ["nightly-eval", "job-0", "job-1", "job-2"]
    assert len(server.of("RecurringRunService_ListRecurringRuns")) == 2
    mine = kfp_client.list_recurring_runs(api, experiment="nightly")
    assert [(r["name"], r["cron"], r["status"], r["no_catchup"]) for r in mine] == [
        ("nightly-eval", "0 0 2 * * *", "ENABLED", True)]
    assert server.of("RecurringRunService_ListRecurringRuns")[-1]["query"]["experiment_id"] == created["experiment_id"]
    disabled = [r for r in everything if r["name"] == "job-0"][0]
    assert disabled["status"] == "DISABLED" and disabled["no_catchup"] is False

    kfp_client.set_recurring_run_enabled(api, created["recurring_run_id"], False)
    assert server.of("RecurringRunService_DisableRecurringRun")[0]["path"].endswith(
        f"/recurringruns/{created['recurring_run_id']}:disable")
    assert kfp_client.list_recurring_runs(api, experiment="nightly")[0]["status"] == "DISABLED"
    kfp_client.set_recurring_run_enabled(api, created["recurring_run_id"], True)
    assert kfp_client.list_recurring_runs(api, experiment="nightly")[0]["status"] == "ENABLED"


@pytest.mark.parametrize("cron, message", [
    ("0 2 * * *", "Did you mean '0 0 2 \\* \\* \\*'"),
    ("0 0 25 * * *", "field 3 \\(hours\\)"),
    ("@daily", "descriptors"),
    ("0 0 2 * * * *", "7 fields"),
])
def test_bad_cron_is_refused_before_any_request(server, packages, cron, message):
    api = _api(server)
    before = len(server.requests)
    with pytest.raises(KFPError, match=message):
        kfp_client.schedule(api, "exp", "s", cron, {"a0_model": "m", "a0_output_root": "r"},
                            package_path=packages["evaluation"])
    assert len(server.requests) == before


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_concurrency=0), "max_concurrency must be an integer from 1 to 10"),
    (dict(max_concurrency=11), "from 1 to 10"),
    (dict(name=""), "name is required"),
    (dict(package_path=None), "give a pipeline package, or both the pipeline id and the version id"),
])
def test_bad_schedule_settings_are_refused_before_any_request(server, packages, kwargs, message):
    api = _api(server)
    before = len(server.requests)
    arguments = dict(experiment="exp", name="s", cron="0 0 2 * * *", arguments={"a0_model": "m", "a0_output_root": "r"},
                     package_path=packages["evaluation"])
    arguments.update(kwargs)
    with pytest.raises(KFPError, match=message):
        kfp_client.schedule(api, **arguments)
    assert len(server.requests) == before


# ------------------------------------------------------------------------------------ connection errors
def test_unreachable_host_fails_fast_with_one_line():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import time

    began = time.monotonic()
    with pytest.raises(KFPError, match=f"cannot reach the KFP API at http://127.0.0.1:{port}"):
        kfp_client.connect(f"http://127.0.0.1:{port}", timeout_s=3)
    assert time.monotonic() - began < 5


@pytest.mark.parametrize("host", ["localhost:8080", "ftp://x", ""])
def test_host_must_be_an_http_url(host):
    with pytest.raises(KFPError, match="must be an http:// or https:// URL"):
        kfp_client.connect(host)


def test_a_server_that_is_not_kfp_is_named():
    def not_kfp(request: Request):
        return (401 if "auth" in request.headers.get("Authorization", "") else 200), b"<html>hello</html>", "text/html"

    server = FakeServer(not_kfp)
    try:
        url = server.url
        with pytest.raises(KFPError, match="did not answer JSON"):
            kfp_client.connect(url)
        with pytest.raises(KFPError, match="HTTP 401 .*token"):
            kfp_client.probe(url, token="auth-token")
    finally:
        server.stop()


def test_server_errors_become_one_line(server, packages):
    api = _api(server)
    with pytest.raises(KFPError, match="reading pipeline version v-missing failed: HTTP 404"):
        kfp_client.run(api, "exp", "r", {}, pipeline_id="p", version_id="v-missing")


def test_argument_strings_are_typed_by_the_pipeline(packages):
    parameters = kfp_client.parameters_of(packages["post_training"])
    assert kfp_client.parse_argument_strings(parameters, [
        "a_method=sao", "b_steps=200", "b_learning_rate=1", "b_method_options={\"critic_lr\": 1e-5}", "c_run_evaluation=false",
        "c_eval_benchmarks=[\"imo_answerbench\"]", "a0_train_source=s3://b/x.jsonl"]) == {
        "a_method": "sao", "b_steps": 200, "b_learning_rate": 1.0, "b_method_options": {"critic_lr": 1e-5},
        "c_run_evaluation": False, "c_eval_benchmarks": ["imo_answerbench"], "a0_train_source": "s3://b/x.jsonl"}
    with pytest.raises(KFPError, match="needs a JSON value"):
        kfp_client.parse_argument_strings(parameters, ["b_steps=many"])
    with pytest.raises(KFPError, match="name=value"):
        kfp_client.parse_argument_strings(parameters, ["b_steps"])
    with pytest.raises(KFPError, match="unknown pipeline parameter 'stepz'"):
        kfp_client.parse_argument_strings(parameters, ["stepz=1"])
