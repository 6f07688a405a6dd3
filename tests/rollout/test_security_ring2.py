"""Trust, the second ring (issue 27): each class of attack that got through a real `sao rollout serve` and the
CLIs, as a test that failed before the fix. Real services over HTTP on 127.0.0.1 (HF engine, embedded model);
the weight-path race at the manager, where the wait for the weights lock can be held deterministically."""

from __future__ import annotations

import asyncio
import json
import logging
import os

import httpx
import pytest

from sao_core import storage
from sao_core.rollout import auth
from sao_core.rollout.client import RolloutClient
from sao_core.rollout.manager import ForbiddenError, RolloutManager
from sao_core.rollout.server import RolloutServer, ServeConfig


@pytest.fixture(scope="module")
def open_service(sao_cache, tiny_model_dir):
    """A service without a token on loopback (allowed there), as `sao rollout serve` starts by default."""
    server = RolloutServer(ServeConfig(model=str(tiny_model_dir), port=0, cache_dir=str(sao_cache),
                                       max_batch=2)).start()
    try:
        yield server
    finally:
        server.stop()


# ---------------------------------------------------------------------------------- 1, 9: weight paths


def _manager(sao_cache, model_dir, root) -> RolloutManager:
    from sao_core.rollout.engines import make_engine

    engine = make_engine("hf", str(model_dir), str(sao_cache), max_batch=2)
    return RolloutManager(engine, engine.tokenizer, str(sao_cache), allowed_weight_roots=[str(root)])


def test_a_symlink_swapped_while_a_weight_push_waits_for_the_lock_is_refused(sao_cache, tiny_model_dir, tmp_path):
    """Class 1: the request's URI passed the roots check, then waited for the weights lock; a symlink inside the
    root was pointed outside meanwhile. Before: the load read the URI again and took the outside checkpoint
    (its digest is what the attacker sent). Now the URI is resolved once more under the lock and only that
    resolved form is read."""
    root = tmp_path / "run" / "weights"
    good, outside = root / "v000001", tmp_path / "planted"
    storage.publish_checkpoint(str(tiny_model_dir), str(good), metadata={"step": 1})
    storage.publish_checkpoint(str(tiny_model_dir), str(outside), metadata={"evil": True})
    link = root / "current"
    link.symlink_to(good, target_is_directory=True)

    async def scenario():
        manager = _manager(sao_cache, tiny_model_dir, root)
        try:
            await manager._weights_lock.acquire()            # another push in progress
            push = asyncio.create_task(manager.update_weights(1, str(link), storage.checkpoint_digest(str(outside))))
            await asyncio.sleep(0)                            # it passes the first check and waits for the lock
            assert not push.done()
            link.unlink()
            link.symlink_to(outside, target_is_directory=True)   # the swap
            manager._weights_lock.release()
            with pytest.raises(ForbiddenError, match="outside the allowed weight roots"):
                await push
            assert manager.engine.version == 0 and manager.weights_sha256 is None
            # The same link, pointed back inside, loads.
            link.unlink()
            link.symlink_to(good, target_is_directory=True)
            answer = await manager.update_weights(1, str(link), storage.checkpoint_digest(str(good)))
            assert answer["version"] == 1
        finally:
            await manager.engine.close()

    asyncio.run(scenario())


def test_a_file_inside_a_checkpoint_that_links_outside_the_roots_is_refused(sao_cache, tiny_model_dir, tmp_path):
    """Class 9: a checkpoint inside the root whose weights file is a symlink to identical bytes elsewhere (so its
    manifest still verifies) no longer loads."""
    root = tmp_path / "run" / "weights"
    ckpt = root / "v000001"
    storage.publish_checkpoint(str(tiny_model_dir), str(ckpt), metadata={"step": 1})
    weights = next(p for p in ckpt.iterdir() if p.suffix == ".safetensors")
    elsewhere = tmp_path / "elsewhere.safetensors"
    weights.rename(elsewhere)
    weights.symlink_to(elsewhere)

    async def scenario():
        manager = _manager(sao_cache, tiny_model_dir, root)
        try:
            with pytest.raises(ForbiddenError, match=f"{weights.name} is a link to a place outside"):
                await manager.update_weights(1, str(ckpt), storage.checkpoint_digest(str(ckpt)))
            assert manager.engine.version == 0
        finally:
            await manager.engine.close()

    asyncio.run(scenario())


def test_one_reading_of_an_s3_uri_empty_and_dot_segments_are_refused_not_dropped():
    """Class 2: `s3://bucket//weights/evil` passed the root `s3://bucket/weights` (empty segments were dropped
    by the check) but S3 reads the key `/weights/evil/...`, outside the prefix."""
    roots = ["s3://bucket/weights"]
    for uri in ("s3://bucket//weights/evil", "s3://bucket/weights//evil", "s3://bucket/weights/./v1",
                "s3://bucket/weights/../x", "s3://bucket/./weights/v1"):
        assert auth.resolve_within_roots(uri, roots) is None, uri
        assert not auth.within_roots(uri, roots), uri
    assert auth.resolve_within_roots("s3://bucket/weights/v000001/", roots) == "s3://bucket/weights/v000001"
    assert auth.resolve_within_roots("s3://bucket/weights", roots) == "s3://bucket/weights"


def test_a_token_file_readable_by_others_is_warned_about(tmp_path, caplog):
    """Class 9: a token file every user can read was accepted without a word."""
    path = tmp_path / "token"
    path.write_text("t" * 32)
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="sao_core.rollout.auth"):
        assert auth.resolve_token(token_file=str(path), environ={}) == "t" * 32
    assert "readable by other users (mode 644); chmod 600 it" in caplog.text
    assert "t" * 32 not in caplog.text
    caplog.clear()
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="sao_core.rollout.auth"):
        auth.resolve_token(token_file=str(path), environ={})
    assert "readable by other users" not in caplog.text


# ---------------------------------------------------------------------------------- 3: web pages


def test_a_tokenless_loopback_service_refuses_web_pages_and_rebound_hosts(open_service):
    """Class 3: with no token, a cross-origin `text/plain` POST to /v1/shutdown ended the process and a
    DNS-rebinding Host read /v1/status. Now: a non-loopback Host is refused (421), a foreign Origin (403), a
    POST without Content-Type: application/json (415); the service is still up and its own client works."""
    url = open_service.url
    with httpx.Client(base_url=url, timeout=30) as http:
        rebound = http.get("/v1/status", headers={"Host": "attacker.example:8000"})
        assert rebound.status_code == 421 and "loopback host" in rebound.json()["detail"]
        assert "dataset" not in rebound.text
        page = http.post("/v1/shutdown", content='{"grace_s": 0}',
                         headers={"Origin": "http://attacker.example", "Content-Type": "text/plain"})
        assert page.status_code == 403
        assert http.post("/v1/shutdown", content='{"grace_s": 0}', headers={"Origin": "null",
                                                                            "Content-Type": "application/json"}
                         ).status_code == 403
        for path in ("/v1/shutdown", "/v1/pause", "/v1/resume", "/v1/rollouts/stop"):
            simple = http.post(path, content='{"grace_s": 0}', headers={"Content-Type": "text/plain"})
            assert simple.status_code == 415, path
        assert http.get("/healthz").status_code == 200                      # still up
        assert http.get("/healthz", headers={"Host": "localhost:1"}).status_code == 200
        assert http.get("/v1/status", headers={"Origin": f"http://127.0.0.1:{url.rsplit(':', 1)[1]}"}
                        ).status_code == 200
    client = RolloutClient(url)
    try:
        assert client.pause() == {"paused": True} and client.resume() == {"paused": False}
        assert "version" in client.stop()
    finally:
        client.close()


def test_an_insecure_service_is_not_limited_to_loopback_hosts(sao_cache, tiny_model_dir):
    """`insecure` serves without a token on purpose (any address); the loopback guard is not applied there."""
    from sao_core.rollout.service import create_app

    class Engine:
        version = 0

    app = create_app(RolloutManager(Engine(), None, str(sao_cache)), insecure=True)
    assert not any(m.cls.__name__ == "LoopbackGuard" for m in app.user_middleware)
    app = create_app(RolloutManager(Engine(), None, str(sao_cache)))
    assert any(m.cls.__name__ == "LoopbackGuard" for m in app.user_middleware)
    app = create_app(RolloutManager(Engine(), None, str(sao_cache)), token="t" * 32)
    assert not any(m.cls.__name__ == "LoopbackGuard" for m in app.user_middleware)


# ---------------------------------------------------------------------------------- 5, 6: invalid input


def test_unencodable_input_and_deep_options_get_a_4xx_and_the_service_still_reports(open_service):
    """Class 6: NaN for a float and an unpaired surrogate in a string answered 500 (the validation error echoed
    input the JSON encoder cannot write); a plan whose env_options nest 400 deep started and then made every
    /v1/status answer 500."""
    headers = {"Content-Type": "application/json"}
    with httpx.Client(base_url=open_service.url, timeout=30) as http:
        nan = http.post("/v1/generate", content='{"prompts": [[1, 2]], "temperature": NaN}', headers=headers)
        assert nan.status_code == 422 and nan.json()["detail"][0]["loc"] == ["body", "temperature"]
        surrogate = http.post("/v1/rollouts/start", content='{"dataset": "x", "admission": "\\ud800"}',
                              headers=headers)
        assert surrogate.status_code == 422
        assert any(d["loc"] == ["body", "admission"] for d in surrogate.json()["detail"])
        deep: dict = {}
        node = deep
        for _ in range(400):
            node["a"] = {}
            node = node["a"]
        plan = http.post("/v1/rollouts/start", content=json.dumps({"dataset": "x", "env_options": {"e": deep}}),
                         headers=headers)
        assert plan.status_code == 422 and "nested more than 16 levels deep" in plan.text
        assert http.get("/v1/status").status_code == 200
        big = http.post("/v1/rollouts/start", headers=headers, content=json.dumps(
            {"dataset": "x", "env_options": {"e": {"k": "x" * 300_000}}}))
        assert big.status_code == 422 and "at most 262144" in big.text
        nan_option = http.post("/v1/rollouts/start", headers=headers,
                               content='{"dataset": "x", "env_options": {"e": {"k": NaN}}}')
        assert nan_option.status_code == 422 and "not plain JSON" in nan_option.text


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenised(open_service):
    """Class 5: a 7 M-character prompt was tokenised inside the handler, stalling /healthz and every other
    request for seconds. Now a prompt of more characters than context x longest token is refused at once (the
    bound needs no tokenising), and the rest is tokenised off the event loop."""
    import threading
    import time

    from sao_core.rollout.service import _longest_token_chars

    manager = open_service.manager
    most = manager.engine.context_length * _longest_token_chars(manager.tokenizer)
    text = "7" * max(most + 1, 7_000_000)    # 7 M characters, as in the report (within the 8 MiB body limit)
    slowest, done = [0.0], threading.Event()

    def poll_health():
        with httpx.Client(base_url=open_service.url, timeout=30) as http:
            while not done.is_set():
                began = time.monotonic()
                assert http.get("/healthz").status_code == 200
                slowest[0] = max(slowest[0], time.monotonic() - began)
                time.sleep(0.02)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        with httpx.Client(base_url=open_service.url, timeout=60) as http:
            for _ in range(3):
                answer = http.post("/v1/generate", json={"prompts": [[{"role": "user", "content": text}]],
                                                         "max_new_tokens": 1})
                assert answer.status_code == 400
                assert f"{len(text)} characters cannot fit the engine's context" in answer.json()["detail"]
    finally:
        done.set()
        poller.join()
    print(f"slowest /healthz while 7 M-character prompts were refused: {slowest[0]:.3f} s")
    assert slowest[0] < 0.5
    with httpx.Client(base_url=open_service.url, timeout=60) as http:
        fits = http.post("/v1/generate", json={"prompts": [[{"role": "user", "content": "7 + 1"}]],
                                               "max_new_tokens": 2})
        assert fits.status_code == 200


# ---------------------------------------------------------------------------------- 7: prepared data


def test_the_evaluator_refuses_the_data_file_of_a_failed_prepared_folder(tmp_path):
    """Class 7: `sao evaluate` given the data.jsonl inside a FAILED prepared folder read it as a raw source."""
    from sao_core.eval.benchmarks import BENCHMARKS, EvalError, load_benchmark

    folder = tmp_path / "prepared"
    folder.mkdir()
    (folder / "data.jsonl").write_text(json.dumps({"id": "1", "problem": "1 + 1", "answer": "2"}) + "\n")
    (folder / "FAILED").write_text("row 3: answer missing\n")
    spec = BENCHMARKS["imo_answerbench"]
    with pytest.raises(EvalError, match=r"lies in the prepared folder .* marked unusable .*FAILED: row 3: answer "
                                        r"missing"):
        load_benchmark(spec, str(folder / "data.jsonl"), workdir=tmp_path / "work")
    with pytest.raises(EvalError, match="FAILED"):   # the folder itself was refused already
        load_benchmark(spec, str(folder), workdir=tmp_path / "work2")


# ---------------------------------------------------------------------------------- 8: CLI secrets


def test_a_token_given_on_the_command_line_is_not_echoed(capsys):
    """Class 8: `--token VALUE` was taken as an abbreviation of `--token-file`, and the error printed the value
    as a file name. Now options are never abbreviated and unrecognised values are not shown."""
    from sao_core.cli import build_parser

    secret = "s3cr3t-" + "a1b2c3d4" * 4
    for argv in (["rollout", "serve", "--token", secret], ["rollout", "serve", f"--token={secret}"],
                 ["train-rl", "--data", "d", "--output", "o", "--service-token", secret]):
        with pytest.raises(SystemExit) as exit_info:
            build_parser(argv).parse_args(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert secret not in err and "unrecognized arguments" in err and "values not shown" in err, argv
    assert os.environ.get("SAO_ROLLOUT_TOKEN", "") != secret


# ---------------------------------------------------------------------------------- 4: connection limits


@pytest.fixture(scope="module")
def limited_service(sao_cache, tiny_model_dir):
    """A service with small connection limits, so that each can be hit quickly."""
    config = ServeConfig(model=str(tiny_model_dir), port=0, cache_dir=str(sao_cache), max_batch=2,
                         max_header_bytes=8192, max_headers=20, header_timeout_s=0.5, body_timeout_s=0.5,
                         keep_alive_s=0.5, max_connections=6)
    server = RolloutServer(config).start()
    try:
        yield server
    finally:
        server.stop()


def _connect(url: str):
    import socket

    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _read_until_closed(sock, limit_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (at most `limit_s`: a generous bound, the
    limits under test are 0.5 s)."""
    import time

    sock.settimeout(limit_s)
    data, deadline = b"", time.monotonic() + limit_s
    while time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the connection stayed open for {limit_s} s; received {data[:200]!r}")


def test_an_oversized_request_head_gets_431_before_any_endpoint_runs(limited_service):
    """Class 4: one 64 MiB header cost 4.2 s of server CPU before the 401 (no header-size limit)."""
    sock = _connect(limited_service.url)
    try:
        sock.sendall(b"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20_000)
        answer = _read_until_closed(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 431 ") and b"request head above 8192 bytes" in answer
    many = {f"x-h{i}": "1" for i in range(30)}
    with httpx.Client(base_url=limited_service.url, timeout=30) as http:
        too_many = http.get("/healthz", headers=many)
        assert too_many.status_code == 431 and "more than 20 header fields" in too_many.text
        assert http.get("/healthz", headers={"x-one": "1"}).status_code == 200


def test_slow_heads_slow_bodies_and_idle_connections_are_closed(limited_service):
    """Class 4: idle and slow connections were never closed."""
    slow_head = _connect(limited_service.url)
    slow_body = _connect(limited_service.url)
    idle = _connect(limited_service.url)
    try:
        slow_head.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")          # never finished
        slow_body.sendall(b"POST /v1/trajectories/ack HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                          b"application/json\r\nContent-Length: 100\r\n\r\n{")          # 1 of 100 bytes
        idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")         # one request, then nothing
        assert _read_until_closed(slow_head).startswith(b"HTTP/1.1 408 ")
        assert _read_until_closed(slow_body) == b""                                # cut off, unanswered
        assert _read_until_closed(idle).startswith(b"HTTP/1.1 200 ")               # answered, then closed
    finally:
        for sock in (slow_head, slow_body, idle):
            sock.close()


def test_connections_above_the_cap_get_503(limited_service):
    """Class 4: no cap on concurrent connections. With max_connections 6, six open connections make the
    seventh's request a 503; once they close, requests are served again."""
    import time

    held = [_connect(limited_service.url) for _ in range(6)]
    try:
        time.sleep(0.1)    # the server has accepted them (the asserts below do not depend on this)
        with httpx.Client(base_url=limited_service.url, timeout=30) as http:
            assert http.get("/healthz").status_code == 503
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while True:
        with httpx.Client(base_url=limited_service.url, timeout=30) as http:
            if http.get("/healthz").status_code == 200:
                break
        assert time.monotonic() < deadline, "the service did not serve again after the connections closed"
        time.sleep(0.05)


def test_connection_limits_are_validated():
    for field, value in (("max_header_bytes", 10), ("max_headers", 2), ("header_timeout_s", 0),
                         ("body_timeout_s", -1), ("keep_alive_s", 10_000), ("max_connections", 0)):
        with pytest.raises(ValueError, match=f"ServeConfig.{field} must be"):
            ServeConfig(**{field: value}).validate()


def test_a_weight_path_too_long_for_the_file_system_is_a_400_not_a_500(tmp_path):
    """Found by scripts/security_campaign.py: a 5,000-character path component inside the root raised a bare
    OSError (ENAMETOOLONG) from the existence check, answered 500."""
    with pytest.raises(storage.StorageError, match="local I/O error while checking"):
        storage.exists(str(tmp_path / ("a" * 5000)))
