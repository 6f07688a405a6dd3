"""Trust boundaries of the rollout service, over real HTTP on 127.0.0.1 (HF engine, embedded model): the bearer
token on every control endpoint, the weight hijack of issue 17 (a planted model with version 10^9), allowed
weight roots, the learner failing when a service's weights are not its own, bounded request bodies, prompts
and seeds, and the token never showing in logs, errors, reprs or answers."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import httpx
import pytest
from rl_data import prepared_rl  # noqa: E402  (tests/rl_data.py: the one builder of prepared rl datasets)

from sao_core import storage
from sao_core.learner.loop import LearnerError, ServiceSet
from sao_core.rollout import auth
from sao_core.rollout.client import RolloutAuthError, RolloutClient, RolloutRequestError
from sao_core.rollout.server import RolloutServer, ServeConfig

TOKEN = "tok-" + "9f3b1c7d2e8a4f60" * 3     # a recognisable string to look for in logs


@pytest.fixture(scope="module")
def secured(tmp_path_factory, sao_cache, tiny_model_dir):
    """One service with a token and allowed roots <root>/run/weights; its log records are captured."""
    root = tmp_path_factory.mktemp("auth")
    weights_root = root / "run" / "weights"
    weights_root.mkdir(parents=True)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    keep = Keep(level=logging.DEBUG)
    logging.getLogger().addHandler(keep)
    old_level = logging.getLogger().level
    logging.getLogger().setLevel(logging.DEBUG)
    config = ServeConfig(model=str(tiny_model_dir), port=0, cache_dir=str(sao_cache), max_batch=4,
                         allowed_weight_roots=[str(weights_root)], max_body_bytes=64 * 1024)
    server = RolloutServer(config, token=TOKEN).start()
    try:
        yield {"server": server, "root": root, "weights_root": weights_root, "records": records,
               "model": str(tiny_model_dir)}
    finally:
        server.stop()
        logging.getLogger().removeHandler(keep)
        logging.getLogger().setLevel(old_level)


def _headers(token: str | None) -> dict:
    return {"Authorization": f"Bearer {token}"} if token else {}


CONTROL = [("POST", "/v1/rollouts/start", {"dataset": "/nowhere"}), ("POST", "/v1/rollouts/stop", None),
           ("GET", "/v1/trajectories?consumer=x", None), ("POST", "/v1/trajectories/ack", {"ids": []}),
           ("POST", "/v1/weights", {"version": 1, "uri": "/tmp/x", "sha256": "0" * 64}),
           ("POST", "/v1/pause", None), ("POST", "/v1/resume", None),
           ("POST", "/v1/generate", {"prompts": [[1, 2]], "max_new_tokens": 1}),
           ("GET", "/v1/status", None), ("POST", "/v1/shutdown", {"grace_s": 0})]


def test_every_control_endpoint_needs_the_token_and_health_metrics_schema_stay_open(secured):
    url = secured["server"].url
    with httpx.Client(base_url=url, timeout=30) as http:
        for method, path, body in CONTROL:
            for token in (None, "wrong-" + TOKEN[6:], TOKEN[:-1], "x"):
                answer = http.request(method, path, json=body, headers=_headers(token))
                assert answer.status_code == 401, (method, path, token, answer.text)
                assert answer.headers["www-authenticate"].startswith("Bearer")
                assert TOKEN not in answer.text
            # A scheme other than Bearer is no token either.
            assert http.request(method, path, json=body, headers={"Authorization": f"Basic {TOKEN}"}
                                ).status_code == 401
        for path in ("/healthz", "/metrics", "/openapi.json"):
            assert http.get(path).status_code == 200
        # With the token the same requests get past authentication (shutdown left out: it would end the service).
        for method, path, body in CONTROL[:-1]:
            answer = http.request(method, path, json=body, headers=_headers(TOKEN))
            assert answer.status_code != 401, (method, path, answer.text)
    client = RolloutClient(url, token="y" * 20)
    with pytest.raises(RolloutAuthError, match="401"):
        client.status()
    client.close()


def test_the_weight_hijack_of_issue_17_is_refused(secured, tmp_path):
    """The planted model of the issue: its own manifest digest, version 10^9, somewhere in /tmp."""
    url, weights_root = secured["server"].url, secured["weights_root"]
    planted = tmp_path / "planted"
    storage.publish_checkpoint(secured["model"], str(planted), metadata={"evil": True})
    digest = storage.checkpoint_digest(str(planted))
    hijack = {"version": 10**9, "uri": str(planted), "sha256": digest}
    with httpx.Client(base_url=url, timeout=60) as http:
        before = http.get("/v1/status", headers=_headers(TOKEN)).json()["version"]
        assert http.post("/v1/weights", json=hijack).status_code == 401                      # no token
        assert http.post("/v1/weights", json=hijack, headers=_headers("z" * 32)).status_code == 401
        answer = http.post("/v1/weights", json=hijack, headers=_headers(TOKEN))               # outside the roots
        assert answer.status_code == 403 and "outside the allowed weight roots" in answer.json()["detail"]
        # Escapes: `..` out of the root, and a symlink inside the root that points at the planted model.
        dotted = {**hijack, "uri": str(weights_root / ".." / ".." / ".." / tmp_path.name / "planted")}
        assert http.post("/v1/weights", json=dotted, headers=_headers(TOKEN)).status_code == 403
        link = weights_root / "v-link"
        link.symlink_to(planted, target_is_directory=True)
        assert http.post("/v1/weights", json={**hijack, "uri": str(link)}, headers=_headers(TOKEN)).status_code == 403
        # Inside the roots, but not the next version: 409, and nothing changed.
        inside = weights_root / f"v{before + 1:06d}"
        storage.publish_checkpoint(secured["model"], str(inside), metadata={"step": 1})
        good = storage.checkpoint_digest(str(inside))
        answer = http.post("/v1/weights", json={"version": 10**9, "uri": str(inside), "sha256": good},
                           headers=_headers(TOKEN))
        assert answer.status_code == 409 and "skips versions" in answer.json()["detail"]
        assert f"takes only version {before + 1}" in answer.json()["detail"]
        answer = http.post("/v1/weights", json={"version": before, "uri": str(inside), "sha256": good},
                           headers=_headers(TOKEN))
        assert answer.status_code == 409 and "not newer" in answer.json()["detail"]
        assert http.get("/v1/status", headers=_headers(TOKEN)).json()["version"] == before
        # The next version from inside the roots loads; its digest shows in the status.
        answer = http.post("/v1/weights", json={"version": before + 1, "uri": str(inside), "sha256": good},
                           headers=_headers(TOKEN))
        assert answer.status_code == 200 and answer.json()["version"] == before + 1
        status = http.get("/v1/status", headers=_headers(TOKEN)).json()
        assert status["version"] == before + 1 and status["weights_sha256"] == good
        # A resync may jump (a resumed learner); the same version and digest again is a no-op.
        answer = http.post("/v1/weights", json={"version": before + 7, "uri": str(inside), "sha256": good,
                                                "resync": True}, headers=_headers(TOKEN))
        assert answer.status_code == 200 and answer.json()["version"] == before + 7
        answer = http.post("/v1/weights", json={"version": before + 7, "uri": str(inside), "sha256": good,
                                                "resync": True}, headers=_headers(TOKEN))
        assert answer.json().get("unchanged") is True


def test_a_service_without_allowed_roots_loads_no_weights(sao_cache, tiny_model_dir, tmp_path):
    server = RolloutServer(ServeConfig(model=str(tiny_model_dir), port=0, cache_dir=str(sao_cache),
                                       max_batch=2)).start()
    try:
        storage.publish_checkpoint(str(tiny_model_dir), str(tmp_path / "w"), metadata={})
        client = RolloutClient(server.url)
        with pytest.raises(RolloutRequestError, match="403.*without allowed_weight_roots"):
            client.push_weights(1, str(tmp_path / "w"), storage.checkpoint_digest(str(tmp_path / "w")))
        client.close()
    finally:
        server.stop()


def test_the_learner_fails_loudly_when_a_service_version_is_not_its_own(secured):
    url, weights_root = secured["server"].url, secured["weights_root"]
    other = RolloutClient(url, consumer="someone-else", token=TOKEN)
    current = other.status()["version"]
    uri = weights_root / "learner-v"
    storage.publish_checkpoint(secured["model"], str(uri), metadata={"who": "learner"})
    digest = storage.checkpoint_digest(str(uri))
    services = ServiceSet([url], consumer="learner-t", plan={}, retry_s=1, token=TOKEN)
    services.push(current + 3, str(uri), digest)          # first push of a (resumed) learner: a resync
    assert other.status()["version"] == current + 3
    services.push(current + 4, str(uri), digest)          # then plain next versions
    # Someone with the token moves the service on behind the learner's back: the learner's next push stops it.
    other.push_weights(current + 5, str(uri), digest)
    with pytest.raises(LearnerError, match=f"rollout service {url} refused weights version {current + 5}"):
        services.push(current + 5, str(uri), digest)
    # A learner that has pushed nothing finds the service on another version at connect: it stops too.
    fresh = ServiceSet([url], consumer="learner-u", plan={}, retry_s=1, token=TOKEN)
    with pytest.raises(LearnerError, match=f"rollout service {url} serves weights version {current + 5}"):
        fresh.connect()
    # A learner with the wrong token is told so, naming the service.
    wrong = ServiceSet([url], consumer="learner-w", plan={}, retry_s=1, token="w" * 24)
    with pytest.raises(LearnerError, match=f"rollout service {url} refused the learner's token"):
        wrong.push(current + 6, str(uri), digest)
    for s in (services, fresh, wrong):
        for c in s.clients:
            c.close()
    other.close()


def test_bodies_prompts_and_seeds_are_bounded(secured, tmp_path):
    url = secured["server"].url
    with httpx.Client(base_url=url, timeout=60, headers=_headers(TOKEN)) as http:
        big = {"prompts": [[1] * 40_000]}                       # ~120 kB > max_body_bytes 64 KiB
        answer = http.post("/v1/generate", json=big)
        assert answer.status_code == 413 and "65536 bytes" in answer.json()["detail"]
        # Sent without a Content-Length (chunked): refused once the bytes pass the bound.
        data = json.dumps(big).encode()
        answer = http.post("/v1/generate", content=(data[i:i + 8192] for i in range(0, len(data), 8192)),
                           headers={"Content-Type": "application/json"})
        assert answer.status_code == 413
        # A prompt longer than the engine's context (4096 tokens): 400 naming the prompt and the lengths.
        answer = http.post("/v1/generate", json={"prompts": [[1, 2], [1] * 5000], "max_new_tokens": 1})
        assert answer.status_code == 400
        assert "prompts[1]: 5000 tokens; the engine's context is 4096 tokens" in answer.json()["detail"]
        # Generation stops at the end of the context.
        answer = http.post("/v1/generate", json={"prompts": [[1] * 4094], "max_new_tokens": 50, "seed": 1})
        assert answer.status_code == 200 and len(answer.json()["results"][0][0]["token_ids"]) <= 2
        # Seeds: [0, 2^63); the derived seeds of the last samples wrap instead of crashing the engine.
        for seed in (2**53, 2**63, -1, 2**64):
            answer = http.post("/v1/generate", json={"prompts": [[1, 2]], "max_new_tokens": 1, "seed": seed})
            assert answer.status_code == 422, (seed, answer.text)
        answer = http.post("/v1/generate", json={"prompts": [[1, 2], [3, 4]], "n": 2, "max_new_tokens": 1,
                                                 "seed": 2**53 - 1})
        assert answer.status_code == 200
        assert http.post("/v1/rollouts/start", json={"dataset": "/x", "seed": 2**63}).status_code == 422


def test_a_plan_prompt_above_the_budget_ends_its_episode_with_the_reason(secured, tmp_path):
    prepared_rl(tmp_path / "rl", [{"id": "long", "prompt": "Compute 12 + 30. " * 20, "env": "tool_arith",
                                   "answer": "42"}])
    client = RolloutClient(secured["server"].url, consumer="plan-t", token=TOKEN)
    try:
        client.start({"dataset": str(tmp_path / "rl"), "max_total_tokens": 32, "max_new_tokens_per_turn": 8})
        got, _ = client.take(max_items=1, wait_s=30)
        assert len(got) == 1
        t = got[0]
        assert t.finish_reason == "env_error" and t.token_ids == [] and t.num_action_tokens == 0
        assert "prompt too long" in t.metadata["info"]["error"] and t.metadata["info"]["prompt_tokens"] >= 32
        client.ack([t.id])
    finally:
        client.stop()
        client.close()


def test_no_token_off_loopback_refuses_to_start_and_token_sources(tmp_path, monkeypatch, capsys):
    from sao_core.cli import main

    monkeypatch.delenv(auth.ENV_TOKEN, raising=False)
    monkeypatch.delenv(auth.ENV_TOKEN_FILE, raising=False)
    with pytest.raises(ValueError, match="refusing to serve on 0.0.0.0 without a token"):
        RolloutServer(ServeConfig(host="0.0.0.0", port=18000))
    assert not RolloutServer(ServeConfig(host="0.0.0.0", port=0, insecure=True)).authenticated
    assert not RolloutServer(ServeConfig(host="localhost", port=18000)).authenticated
    assert not RolloutServer(ServeConfig(host="::1", port=18000)).authenticated
    # The CLI: one clear line, exit 2, no traceback, before any model is loaded.
    assert main(["rollout", "serve", "--host", "0.0.0.0", "--port", "18000"]) == 2
    err = capsys.readouterr().err
    assert "refusing to serve on 0.0.0.0 without a token" in err and "Traceback" not in err
    # Sources: a file (a mounted Secret), the environment; errors name the source, never the token.
    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    assert RolloutServer(ServeConfig(host="0.0.0.0", port=0, token_file=str(secret))).authenticated
    assert auth.resolve_token(token_file=str(secret)) == TOKEN
    monkeypatch.setenv(auth.ENV_TOKEN_FILE, str(secret))
    assert RolloutServer(ServeConfig(host="0.0.0.0", port=18000)).authenticated
    monkeypatch.setenv(auth.ENV_TOKEN, "short-" + TOKEN[:4])
    with pytest.raises(ValueError, match=r"from \$SAO_ROLLOUT_TOKEN is too short") as err:
        RolloutServer(ServeConfig(host="0.0.0.0", port=18000))
    assert TOKEN[:4] not in str(err.value)
    monkeypatch.delenv(auth.ENV_TOKEN)
    with pytest.raises(ValueError, match=f"cannot read the rollout token file {tmp_path / 'none'}"):
        RolloutServer(ServeConfig(port=0, token_file=str(tmp_path / "none")))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        RolloutServer(ServeConfig(port=0, token_file=str(tmp_path / "empty")))
    for bad, message in (({"seed": 2**63}, "seed must be in"), ({"max_body_bytes": 10}, "max_body_bytes"),
                         ({"allowed_weight_roots": [" "]}, "empty entries")):
        with pytest.raises(ValueError, match=message):
            ServeConfig(**bad).validate()


def test_the_token_never_shows_in_logs_errors_reprs_or_answers(secured):
    """After every other test of this module ran against the service (the fixture captured its log records at
    DEBUG), nothing anywhere holds the token."""
    url = secured["server"].url
    client = RolloutClient(url, token=TOKEN)
    texts = [repr(client), repr(secured["server"].config), repr(secured["server"]), json.dumps(client.status())]
    try:
        client.push_weights(10**9, "/etc", "0" * 64)
    except RolloutRequestError as err:
        texts.append(str(err))
    texts.append(httpx.get(f"{url}/openapi.json").text)
    texts.append(httpx.get(f"{url}/metrics").text)
    client.close()
    records = secured["records"]
    assert records, "the fixture captured no log records"
    texts += [r.getMessage() for r in records]
    assert all(TOKEN not in text for text in texts)
    assert TOKEN not in repr(vars(secured["server"].config))
    assert TOKEN not in os.environ.get(auth.ENV_TOKEN, "")


def test_weight_roots_resolve_paths_and_compare_s3_by_segments(tmp_path):
    root = tmp_path / "run" / "weights"
    (root / "v1").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    roots = [str(root), "s3://bucket/run/weights"]
    assert auth.within_roots(str(root / "v1"), roots)
    assert auth.within_roots(f"file://{root / 'v1'}", roots)
    assert not auth.within_roots(str(root / ".." / "x"), roots)
    assert not auth.within_roots(str(root / "link"), roots)
    assert not auth.within_roots(str(tmp_path / "run" / "weights-evil"), roots)
    assert auth.within_roots("s3://bucket/run/weights/v000001", roots)
    assert auth.within_roots("s3://bucket/run/weights", roots)
    for uri in ("s3://bucket/run/weights-evil/v1", "s3://bucket/run/weights/../x", "s3://other/run/weights/v1",
                "s3://bucket/run", "http://bucket/run/weights/v1"):
        assert not auth.within_roots(uri, roots), uri
    assert not auth.within_roots(str(root / "v1"), ["s3://bucket/run/weights"])
    assert auth.is_loopback("127.0.0.2") and auth.is_loopback("[::1]") and not auth.is_loopback("0.0.0.0")


def test_openapi_documents_the_error_responses_and_metrics_as_text(secured):
    schema = httpx.get(f"{secured['server'].url}/openapi.json").json()
    paths = schema["paths"]
    for method, path, _ in CONTROL:
        operation = paths[path.split("?")[0]][method.lower()]
        assert "401" in operation["responses"], path
        assert operation["security"] == [{"rolloutToken": []}], path
    weights = paths["/v1/weights"]["post"]["responses"]
    assert {"400", "401", "403", "409", "413", "422"} <= set(weights)
    assert {"400", "401", "409", "413"} <= set(paths["/v1/rollouts/start"]["post"]["responses"])
    assert {"400", "401", "413"} <= set(paths["/v1/generate"]["post"]["responses"])
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "security" not in paths["/healthz"]["get"] and "security" not in paths["/metrics"]["get"]
    assert schema["components"]["securitySchemes"]["rolloutToken"]["scheme"] == "bearer"


def test_a_seed_at_the_top_of_the_range_does_not_crash_the_hf_engine():
    from sao_core.rollout.engines.base import SEED_LIMIT, SamplingParams

    SamplingParams(seed=SEED_LIMIT - 1).validate()
    for seed in (SEED_LIMIT, -1):
        with pytest.raises(ValueError, match=r"seed must be in \[0, 2\^63\)"):
            SamplingParams(seed=seed).validate()
    assert Path(auth.__file__).name == "auth.py"


def test_a_dataset_path_with_a_nul_byte_is_a_400_not_a_500(secured):
    """Found by the schemathesis run (scripts/fuzz_rollout_api.py): it was an unhandled ValueError."""
    answer = httpx.post(f"{secured['server'].url}/v1/rollouts/start", json={"dataset": "a\x00b"},
                        headers=_headers(TOKEN), timeout=30)
    assert answer.status_code == 400 and "cannot read the dataset" in answer.json()["detail"]
