"""Limits everywhere a socket is open (issue 38, part 5). Each test failed before the fix:

- the learner's Prometheus port (`PrometheusSink`, `metrics_port`) was prometheus_client's own server: one
  thread per connection and no header timeout, so 150 half-sent requests held 150 threads for ever;
- a weight push on the rollout service waited behind every authenticated /v1/score already queued for the
  weights lock (48 full-context scores: 10.6 s), and the queue of scores had no bound.

The metrics port is served with short limits (a parameter); the score tests hold the score running now at a
gate, so what they assert is order (which version each queued score saw), never wall time."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from sao_core import storage
from sao_core.http_limits import METRICS_LIMITS, HttpLimits
from sao_core.rollout.client import RolloutBusy, RolloutClient
from sao_core.rollout.server import RolloutServer, ServeConfig
from sao_core.training import live
from sao_core.training.metrics_log import MetricsLog

TOKEN = "socket-limits-" + "ab12" * 6
HALF_SENT = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"   # the head's blank line never comes


def _limits(header_timeout_s: float, max_connections: int) -> HttpLimits:
    return HttpLimits(max_header_bytes=8192, max_headers=20, header_timeout_s=header_timeout_s,
                      body_timeout_s=header_timeout_s, keep_alive_s=1.0, max_connections=max_connections)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _half_sent(port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(HALF_SENT)
        socks.append(sock)
    return socks


def _read_until_closed(sock: socket.socket, limit_s: float = 15.0) -> bytes:
    """What the server sends until it closes the connection; AssertionError if it is still open after `limit_s`
    seconds (generous: the timeouts under test are 1 s)."""
    sock.settimeout(limit_s)
    data, deadline = b"", time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the connection stayed open for {limit_s} s; received {data[:200]!r}")


def _scrape_status(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
            assert "sao_learner_step 7.0" in text
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


# ------------------------------------------------------------------------------------ the metrics port


@contextlib.contextmanager
def _metrics_port(tmp_path, max_connections: int):
    """A learner's metrics port on loopback (head timeout 1 s, at most `max_connections`) serving one logged
    step; yields its port."""
    port = _free_port()
    sink = live.PrometheusSink(port, host="127.0.0.1",
                               limits=_limits(header_timeout_s=1.0, max_connections=max_connections))
    with MetricsLog(str(tmp_path), tmp_path / "metrics.jsonl", resume=False, sinks=[sink]) as metrics:
        metrics.append({"step": 7, "version": 2})
        yield port


def test_half_sent_requests_to_the_metrics_port_are_closed_and_hold_no_thread_each(tmp_path):
    """40 half-sent requests: before, 40 more threads in the learner, none ever closed. Now the server stays one
    thread, a scrape still answers while they are open, and each gets 408 and is closed after the head timeout."""
    with _metrics_port(tmp_path, max_connections=64) as port:
        threads = threading.active_count()
        held = _half_sent(port, 40)
        try:
            assert _scrape_status(port) == 200       # answered after all 40 were accepted (one loop, in order)
            assert threading.active_count() <= threads + 2, "threads grew with the open connections"
            for sock in held:
                assert _read_until_closed(sock).startswith(b"HTTP/1.1 408 ")
        finally:
            for sock in held:
                sock.close()
        assert _scrape_status(port) == 200
        oversized = socket.create_connection(("127.0.0.1", port), timeout=10)   # the head-size limit holds too
        try:
            oversized.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20_000)
            assert _read_until_closed(oversized).startswith(b"HTTP/1.1 431 ")
        finally:
            oversized.close()


def test_connections_above_the_metrics_cap_get_503_until_they_time_out(tmp_path):
    """Before, every connection got a thread and none was refused. With a cap of 6, six open connections make a
    scrape a 503 (no thread added); once the head timeout closes them, scrapes answer again."""
    with _metrics_port(tmp_path, max_connections=6) as port:
        threads = threading.active_count()
        held = _half_sent(port, 6)
        try:
            assert _scrape_status(port) == 503
            assert threading.active_count() <= threads + 2
            for sock in held:
                _read_until_closed(sock)
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + 10
        while _scrape_status(port) != 200:
            assert time.monotonic() < deadline, "the metrics port did not answer again after the connections closed"
            time.sleep(0.05)


def test_the_metrics_port_defaults_to_the_rollout_services_head_limits():
    """One set of limits, not a second version: the metrics port's head and keep-alive limits are ServeConfig's
    defaults, and its connection cap is a bound."""
    serve = ServeConfig()
    assert (METRICS_LIMITS.max_header_bytes, METRICS_LIMITS.max_headers, METRICS_LIMITS.header_timeout_s,
            METRICS_LIMITS.keep_alive_s) == (serve.max_header_bytes, serve.max_headers, serve.header_timeout_s,
                                             serve.keep_alive_s)
    assert 1 <= METRICS_LIMITS.max_connections <= serve.max_connections
    assert live.PrometheusSink(9400).limits is None   # None: METRICS_LIMITS, resolved when the port opens


# ------------------------------------------------------------------------------- /v1/score and weight pushes


@pytest.fixture(scope="module")
def scoring_service(sao_cache, tiny_model_dir, tmp_path_factory):
    """A service with a token that loads weights from `root` (the embedded model)."""
    root = tmp_path_factory.mktemp("socket-limits") / "weights"
    root.mkdir()
    server = RolloutServer(ServeConfig(model=str(tiny_model_dir), port=0, cache_dir=str(sao_cache), max_batch=2,
                                       allowed_weight_roots=[str(root)]), token=TOKEN).start()
    try:
        yield server, root
    finally:
        server.stop()


class _Arrivals:
    """Counts the calls of a manager method as they reach it on the service's loop (before they wait for the
    weights lock: nothing in between yields to the loop)."""

    def __init__(self, manager, name: str):
        self.count = 0
        self.manager, self.name = manager, name
        self.original = getattr(manager, name)

        async def counted(*args, **kwargs):
            self.count += 1
            return await self.original(*args, **kwargs)

        setattr(manager, name, counted)

    def restore(self) -> None:
        delattr(self.manager, self.name)   # the instance attribute hid the method

    def wait_for(self, count: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.count < count:
            assert time.monotonic() < deadline, f"only {self.count} of {count} {self.name} calls arrived"
            time.sleep(0.01)


@contextlib.contextmanager
def _gated_scores(manager):
    """The engine's first score waits at a gate (a threading.Event the test sets); every score records the
    engine's weights version it ran under."""
    engine, gate, entered, seen = manager.engine, threading.Event(), threading.Event(), []
    original = engine.score

    async def gated(token_ids, start):
        if not entered.is_set():
            entered.set()
            await asyncio.to_thread(gate.wait, 120)
        seen.append(engine.version)
        return await original(token_ids, start)

    engine.score = gated
    try:
        yield gate, entered, seen
    finally:
        gate.set()
        del engine.score


def _score(url: str) -> dict:
    client = RolloutClient(url, token=TOKEN, timeout_s=120)
    try:
        return client.score([1, 2, 3, 4, 5, 6], 1)
    finally:
        client.close()


def test_a_weight_push_waits_for_the_score_running_now_not_for_the_queued_ones(scoring_service):
    """Before, the weights lock was FIFO: a push arriving behind 7 queued scores ran after all of them (every
    score answered the old version). Now the push runs as soon as the score holding the lock finishes: the
    first score saw the old version, the 7 queued ones the new, and each answered the version it ran under."""
    server, root = scoring_service
    manager = server.manager
    current = manager.engine.version
    weights = root / f"v{current + 1:06d}"
    storage.publish_checkpoint(str(server.config.model), str(weights), metadata={"step": current + 1})
    digest = storage.checkpoint_digest(str(weights))
    scores, pushes = _Arrivals(manager, "score"), _Arrivals(manager, "update_weights")
    try:
        with _gated_scores(manager) as (gate, entered, seen), ThreadPoolExecutor(9) as pool:
            first = pool.submit(_score, server.url)
            assert entered.wait(60), "the first score never reached the engine"
            queued = [pool.submit(_score, server.url) for _ in range(7)]
            scores.wait_for(8)                                  # all 8 hold the lock or wait for it
            client = RolloutClient(server.url, token=TOKEN, timeout_s=120)
            push = pool.submit(client.push_weights, current + 1, str(weights), digest)
            pushes.wait_for(1)                                  # the push waits for the lock too
            gate.set()
            assert push.result(120)["version"] == current + 1
            client.close()
            assert first.result(120)["version"] == current
            answers = [f.result(120) for f in queued]
        assert [a["version"] for a in answers] == [current + 1] * 7, "queued scores ran before the push"
        assert sorted(seen) == sorted([current] + [a["version"] for a in answers])   # each ran under its version
        assert all(a["sha256"] == digest for a in answers)
    finally:
        scores.restore()
        pushes.restore()


class _CountingClient(RolloutClient):
    """A RolloutClient that counts the 429s it was answered (and then waited out)."""

    busy = 0

    def _call(self, *args, **kwargs):
        try:
            return super()._call(*args, **kwargs)
        except RolloutBusy:
            self.busy += 1
            raise


def test_scores_above_the_queue_bound_get_429_with_retry_after(scoring_service):
    """Before, any number of scores queued for the weights lock. With a bound of 3 (running or waiting), a
    fourth gets 429 and Retry-After at once; the three are answered, and scoring works again afterwards."""
    server, _ = scoring_service
    manager = server.manager
    scores = _Arrivals(manager, "score")
    bound = getattr(manager, "max_queued_scores", None)
    manager.max_queued_scores = 3
    try:
        with _gated_scores(manager) as (gate, entered, _), ThreadPoolExecutor(3) as pool:
            held = [pool.submit(_score, server.url) for _ in range(3)]
            scores.wait_for(3)
            # A short timeout: before the fix this request queued behind the gate instead of being refused.
            with httpx.Client(base_url=server.url, timeout=10, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
                refused = http.post("/v1/score", json={"token_ids": [1, 2, 3], "start": 1})
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["Retry-After"]) >= 1
            assert "scores are running or waiting" in refused.json()["detail"]
            # The project's own client (the learner's delivery check) waits a 429 out instead of failing.
            client = _CountingClient(server.url, token=TOKEN)
            with ThreadPoolExecutor(1) as waiting_pool:
                waiting = waiting_pool.submit(client.score, [1, 2, 3], 1, 120.0)
                deadline = time.monotonic() + 60
                while client.busy == 0 and not waiting.done() and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert client.busy >= 1, "the client's score was not refused while the queue was full"
                gate.set()
                assert waiting.result(120)["logprobs"]
            assert all(f.result(120)["logprobs"] for f in held)
        assert _score(server.url)["logprobs"]
        assert manager.scores_queued == 0
    finally:
        scores.restore()
        if bound is None:
            del manager.max_queued_scores
        else:
            manager.max_queued_scores = bound


def test_the_weights_lock_passes_over_cancelled_waiters():
    """The writer-preferring lock under cancellation (a client that hangs up while its request waits): a
    cancelled waiter is skipped, and one cancelled in the instant it was handed the lock passes it on."""
    from sao_core.rollout.manager import WeightsLock

    async def scenario():
        lock = WeightsLock()
        await lock.acquire()
        score = asyncio.create_task(lock.acquire_for_score())
        update = asyncio.create_task(lock.acquire())
        await asyncio.sleep(0)
        assert lock.waiting() == {"updates": 1, "scores": 1}
        update.cancel()
        with pytest.raises(asyncio.CancelledError):
            await update
        lock.release()                      # the cancelled update is skipped: the score gets it
        await score
        assert lock.locked() and lock.waiting() == {"updates": 0, "scores": 0}
        late = asyncio.create_task(lock.acquire())
        await asyncio.sleep(0)
        lock.release()                      # handed to `late`...
        late.cancel()                       # ...which is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await late
        assert not lock.locked()            # passed on (no one waits): free
        async with lock.for_score():
            assert lock.locked()
        assert not lock.locked()

    asyncio.run(scenario())


def test_retry_after_is_read_as_bounded_seconds():
    """The client's reading of a 429's Retry-After: delta seconds bounded to [0.1, 30]; absent, an HTTP date or
    garbage: 1 s (the service sends whole seconds)."""
    from sao_core.rollout.client import _retry_after_s

    assert _retry_after_s("2") == 2.0
    assert _retry_after_s("0") == 0.1 and _retry_after_s("-5") == 0.1
    assert _retry_after_s("3600") == 30.0
    assert _retry_after_s(None) == 1.0
    assert _retry_after_s("Wed, 21 Oct 2026 07:28:00 GMT") == 1.0
