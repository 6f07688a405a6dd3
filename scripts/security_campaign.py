"""A longer hostile campaign against real rollout services (not in CI; README "Security model"): fuzzed headers,
weight URIs and JSON depth / size, sent to one service with a token and one without (loopback), while a
thread polls /healthz; half-sent requests to a learner's Prometheus port; a flood of full-context /v1/score
calls while the learner pushes weights; hostile LoRA adapters pushed to a third service. Counts requests, 5xx answers, attacks accepted and the slowest /healthz.

    .venv/bin/python scripts/security_campaign.py [--rounds 3] [--seed 0] [--output local_outputs/security]

An attack is "accepted" when the service did what it must refuse: loaded weights from outside its roots,
answered a tokenless request from a foreign Host / Origin or a non-JSON POST with anything but a refusal, let
half-sent requests hold a metrics-port thread each or stay open past the head timeout, or made a weight push
wait for more than the score running when it arrived (plus one), took a hostile adapter or changed a bit of
the log-probs it serves by refusing one, or refused the legitimate adapter afterwards. A 503 from a full connection cap and a 429 from
a full score queue are refusals by design, not 5xx findings.
Exit status 1 when any attack was accepted, any answer was a 5xx, or /healthz ever took 0.5 s or more.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOKEN = "campaign-" + "5d1e" * 8


class Tally:
    def __init__(self):
        self.requests = 0
        self.server_errors: list[str] = []
        self.accepted: list[str] = []
        self.by_family: dict[str, int] = {}

    def record(self, family: str, status: int | None, what: str, accepted: bool = False) -> None:
        self.requests += 1
        self.by_family[family] = self.by_family.get(family, 0) + 1
        if status is not None and status >= 500:
            self.server_errors.append(f"{family}: {what}: {status}")
        if accepted:
            self.accepted.append(f"{family}: {what}: {status}")


def raw_request(url: str, payload: bytes, timeout_s: float = 20.0) -> int | None:
    """Send bytes on a fresh connection; the status code of the answer (None: closed without one)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        try:
            sock.sendall(payload)
        except OSError:
            pass   # the server may close while a huge head is still being sent
        data = b""
        try:
            while b"\r\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
        except OSError:
            return None
    if not data.startswith(b"HTTP/1."):
        return None
    return int(data.split(b" ", 2)[1])


def header_attacks(rng: random.Random, url: str, tally: Tally, tokenless: bool) -> None:
    family = "headers-tokenless" if tokenless else "headers"
    auth = b"" if tokenless else f"Authorization: Bearer {TOKEN}\r\n".encode()
    for size in (1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22):
        head = b"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth + b"X-Big: " + b"a" * size + b"\r\n\r\n"
        tally.record(family, raw_request(url, head), f"one header of {size} bytes")
    for count in (50, 101, 500, 5000):
        fields = b"".join(b"X-H%d: %d\r\n" % (i, i) for i in range(count))
        tally.record(family, raw_request(url, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + fields + b"\r\n"),
                     f"{count} header fields")
    for _ in range(40):
        name = "".join(rng.choice("abcXYZ-_:\x01\x7f é") for _ in range(rng.randint(1, 30)))
        value = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
        head = (b"POST /v1/pause HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth + name.encode("utf-8", "replace")
                + b": " + value + b"\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        status = raw_request(url, head)
        tally.record(family, status, f"random header {name!r}")
    if tokenless:
        forged = [("Host", "attacker.example"), ("Host", "127.0.0.1.attacker.example"), ("Host", "localhost.evil"),
                  ("Host", "[::ffff:7f00:1]"), ("Host", ""), ("Origin", "http://attacker.example"),
                  ("Origin", "null"), ("Origin", "http://127.0.0.1.attacker.example")]
        for name, value in forged:
            host = value if name == "Host" else "127.0.0.1"
            extra = f"Origin: {value}\r\n" if name == "Origin" else ""
            head = (f"POST /v1/shutdown HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Type: application/json\r\n"
                    "Content-Length: 13\r\n\r\n{\"grace_s\":0}").encode()
            status = raw_request(url, head)
            tally.record(family, status, f"{name}: {value!r} -> shutdown", accepted=status is not None and status < 400)
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            head = (f"POST /v1/pause HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
                    "Content-Length: 2\r\n\r\n{}").encode()
            status = raw_request(url, head)
            tally.record(family, status, f"simple request {content_type}", accepted=status is not None and status < 400)


def uri_attacks(url: str, tally: Tally, weights_root: Path, planted: Path, digest: str, version: int) -> None:
    import httpx

    root = str(weights_root)
    uris = [str(planted), f"{root}/../../{planted.parent.name}/{planted.name}", f"{root}/./../x",
            f"file://{planted}", f"file://localhost{planted}", f"{root}/%2e%2e/x", f"{root}/\u2024\u2024/x",
            f"{root}/link-out", f"{root}/link-chain", f"{root}/ok/../../{planted.name}", root + "/" + "a" * 5000,
            "s3://bucket//weights/evil", "s3://bucket/weights//evil", "s3://bucket/weights/./v1",
            "s3://bucket/weights/../evil", "s3://bucket/weights/%2e%2e/evil", "s3://BUCKET/weights/v1",
            "s3:///weights/v1", "s3://bucket", "http://127.0.0.1/weights", "\\\\host\\share", "", " ", "\x00",
            f"{root}\x00/x", f"{root}/v1\n", "~/x", "~root/x"]
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for uri in uris:
            try:
                answer = http.post("/v1/weights", json={"version": version + 1, "uri": uri, "sha256": digest})
                status = answer.status_code
            except httpx.HTTPError:
                status = None
            tally.record("weight-uris", status, repr(uri[:80]), accepted=status == 200)


def json_attacks(url: str, tally: Tally) -> None:
    import httpx

    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    bodies = []
    for depth in (10, 17, 100, 400, 1000, 5000, 50_000):
        bodies.append((f"env_options depth {depth}",
                       '{"dataset": "x", "env_options": {"e": ' + '{"a": ' * depth + "1" + "}" * depth + "}}"))
        bodies.append((f"array depth {depth}", '{"dataset": "x", "skip_positions": ' + "[" * depth + "]" * depth + "}"))
    for text in ("NaN", "Infinity", "-Infinity", "1e999", '"\\ud800"', '"\\udfff\\ud800"', "123456789" * 40):
        bodies.append((f"temperature {text[:20]}", '{"prompts": [[1]], "temperature": ' + text + "}"))
        bodies.append((f"dataset {text[:20]}", '{"dataset": ' + text + "}"))
    bodies.append(("env_options 300 KB", json.dumps({"dataset": "x", "env_options": {"e": {"k": "x" * 300_000}}})))
    bodies.append(("not JSON", "{" * 10))
    with httpx.Client(base_url=url, timeout=60, headers=headers) as http:
        for name, body in bodies:
            for path in ("/v1/rollouts/start", "/v1/generate", "/v1/trajectories/ack"):
                try:
                    status = http.post(path, content=body).status_code
                except httpx.HTTPError:
                    status = None
                tally.record("json", status, f"{path} {name}")
            status = http.get("/v1/status").status_code   # an accepted plan must stay reportable
            tally.record("json", status, f"status after {name}", accepted=status != 200)
            http.post("/v1/rollouts/stop", json={})


#: the metrics-port family: half-sent requests opened at once (the review held 150), and the head timeout its
#: learner port is started with (seconds; short so that a round does not wait the default 10 s)
METRICS_FLOOD = 150
METRICS_HEAD_TIMEOUT_S = 2.0
#: threads the metrics port may add however many connections are open (its server is one thread)
METRICS_THREAD_BOUND = 5


def _status_of(data: bytes) -> int | None:
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.") else None


def _closed_within(sock: socket.socket, limit_s: float) -> tuple[bool, bytes]:
    """(whether the server closed `sock` within `limit_s` seconds, what it sent before)."""
    sock.settimeout(limit_s)
    data, deadline = b"", time.monotonic() + limit_s
    try:
        while time.monotonic() < deadline:
            chunk = sock.recv(4096)
            if not chunk:
                return True, data
            data += chunk
    except TimeoutError:
        pass
    except OSError:
        return True, data   # reset: closed as well
    return False, data


def metrics_port_attacks(tally: Tally) -> None:
    """Half-sent requests to a learner's Prometheus port (`PrometheusSink`, the run's metrics_port): accepted when
    they add a thread each, or one stays open past the head timeout (plus a margin)."""
    from sao_core.http_limits import METRICS_LIMITS
    from sao_core.training.live import PrometheusSink

    family = "metrics-port"
    limits = dataclasses.replace(METRICS_LIMITS, header_timeout_s=METRICS_HEAD_TIMEOUT_S,
                                 body_timeout_s=METRICS_HEAD_TIMEOUT_S)
    sink = PrometheusSink(0, host="127.0.0.1", limits=limits)
    sink.open(None)
    url = f"http://127.0.0.1:{sink.server.port}"
    threads = threading.active_count()
    held = []
    try:
        for _ in range(METRICS_FLOOD):
            sock = socket.create_connection(("127.0.0.1", sink.server.port), timeout=10)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            held.append(sock)
        time.sleep(0.5)   # the server has accepted them
        grown = threading.active_count() - threads
        tally.record(family, None, f"{METRICS_FLOOD} half-sent requests added {grown} threads",
                     accepted=grown > METRICS_THREAD_BOUND)
        # During the flood a scrape meets the connection cap (503 by design); after it, it must answer.
        status = raw_request(url, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        tally.record(family, None if status == 503 else status, "scrape during the flood")
        for i, sock in enumerate(held):
            closed, data = _closed_within(sock, METRICS_HEAD_TIMEOUT_S + 5.0)
            tally.record(family, _status_of(data), f"half-sent request {i}", accepted=not closed)
        status = raw_request(url, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        tally.record(family, status, "scrape after the flood", accepted=status != 200)
    finally:
        for sock in held:
            sock.close()
        sink.close(failed=False)


#: the score-flood family: full-context /v1/score calls sent at once before a weight push (the review sent 48),
#: and how many of them may finish while the push waits (the one running when it arrived, plus one for the race
#: between sending the push and its arrival)
SCORE_FLOOD = 48
SCORES_BEFORE_PUSH = 2


def score_flood(server, tally: Tally, rng: random.Random, checkpoint: Path, digest: str) -> None:
    """A flood of full-context /v1/score calls, then a legitimate weight push (the next version of `checkpoint`,
    inside the service's roots): accepted when more than SCORES_BEFORE_PUSH scores finish between the push's
    sending and its answer (it queued behind them), or the push fails. A 429 (the score queue is full) is a
    refusal by design."""
    import httpx

    family = "score-flood"
    manager = server.manager
    context = getattr(manager.engine, "context_length", None) or 2048
    vocab = len(manager.tokenizer)
    ids = [rng.randrange(vocab) for _ in range(context)]
    scored: list[float] = []   # when each score answered 200 (a 429 is answered at once, not run)
    headers = {"Authorization": f"Bearer {TOKEN}"}

    def one_score() -> int | None:
        with httpx.Client(base_url=server.url, timeout=600, headers=headers) as http:
            try:
                status = http.post("/v1/score", json={"token_ids": ids, "start": 1}).status_code
            except httpx.HTTPError:
                status = None
        if status == 200:
            scored.append(time.monotonic())
        return status

    with ThreadPoolExecutor(SCORE_FLOOD) as pool:
        scores = [pool.submit(one_score) for _ in range(SCORE_FLOOD)]
        deadline = time.monotonic() + 30
        bound = min(SCORE_FLOOD, getattr(manager, "max_queued_scores", SCORE_FLOOD))
        while getattr(manager, "scores_queued", bound) < bound and time.monotonic() < deadline:
            time.sleep(0.01)   # the flood is queued (or refused) before the push is sent
        version = manager.engine.version + 1
        sent = time.monotonic()
        with httpx.Client(base_url=server.url, timeout=600, headers=headers) as http:
            try:
                status = http.post("/v1/weights", json={"version": version, "uri": str(checkpoint),
                                                        "sha256": digest}).status_code
            except httpx.HTTPError:
                status = None
        answered = time.monotonic()
        ahead = sum(sent <= t <= answered for t in scored)
        tally.record(family, status, f"weight push behind {SCORE_FLOOD} scores: {answered - sent:.2f} s, "
                     f"{ahead} scores finished meanwhile", accepted=status != 200 or ahead > SCORES_BEFORE_PUSH)
        for future in scores:
            status = future.result()
            tally.record(family, status, "full-context score", accepted=status not in (200, 429))


#: the adapter family (issue 38): hostile LoRA adapters, each published with a valid manifest inside the
#: service's roots (someone who can write there), as (name, adapter_config changes, weight changes)
def _hostile_adapters():
    import torch

    def drop_b(t):
        return {k: v for k, v in t.items() if not (k.endswith("lora_B.weight") and ".1." in k)}

    def smuggle(t):
        name = next(k for k in sorted(t) if "lora_A" in k).replace("lora_A.weight", "base_layer.weight")
        return {**t, name: torch.zeros(8, 8)}

    def nan(t):
        name = next(k for k in sorted(t) if "lora_A" in k)
        poisoned = t[name].clone()
        poisoned.view(-1)[0] = float("nan")
        return {**t, name: poisoned}

    return [("use_dora", {"use_dora": True}, None),
            ("init_false_missing_weight", {"init_lora_weights": False}, drop_b),
            ("layer_replication", {"layer_replication": [[0, 2], [1, 2]]}, None),
            ("huge_rank", {"r": 200000}, None),
            ("pissa", {"init_lora_weights": "pissa"}, None),
            ("olora", {"init_lora_weights": "olora"}, None),
            ("many_targets", {"target_modules": ["q_proj", "v_proj"] + [f"m{i}" for i in range(100_000)]}, None),
            ("regex_targets", {"target_modules": "(.|.)*Z"}, None),
            ("modules_to_save", {"modules_to_save": ["lm_head"]}, None),
            ("rank_pattern", {"rank_pattern": {"q_proj": 64}}, None),
            ("smuggled_base_weight", None, smuggle),
            ("nan_weight", None, nan)]


def adapter_attacks(server, tally: Tally, weights_root: Path, model_dir: str, cache: str) -> None:
    """Hostile adapters pushed as the service's next version: accepted when one is not refused with a 4xx, or
    when the log-probs the service serves afterwards differ in any bit from before; then a legitimate adapter
    must still be taken (a refused one left nothing behind)."""
    import httpx
    import torch
    from safetensors.torch import load_file, save_file

    from sao_core import storage
    from sao_core.models import load_model
    from sao_core.training import lora

    family = "adapter"
    root = weights_root / f"adapters-{time.monotonic_ns()}"
    model = lora.apply_lora(load_model(model_dir, cache), rank=4, alpha=8.0, dropout=0.0,
                            target_modules="q_proj,v_proj")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    good = root / "good"
    lora.write_adapter(model, lora.adapter_state_dict(model, lambda m: m.state_dict()), good)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    probe = {"token_ids": [3, 17, 5, 42, 9, 11, 28, 7, 64, 2, 33, 19], "start": 1}
    with httpx.Client(base_url=server.url, timeout=120, headers=headers) as http:
        before = http.post("/v1/score", json=probe).json()["logprobs"]
        for name, config, weights in _hostile_adapters():
            folder = root / name
            shutil.copytree(good, folder)
            if config:
                data = json.loads((folder / lora.ADAPTER_CONFIG).read_text())
                (folder / lora.ADAPTER_CONFIG).write_text(json.dumps({**data, **config}))
            if weights:
                save_file(weights(load_file(str(folder / lora.ADAPTER_WEIGHTS))), str(folder / lora.ADAPTER_WEIGHTS))
            published = root / f"{name}-published"
            storage.publish_checkpoint(str(folder), str(published), metadata={"adapter": name})
            version = server.manager.engine.version + 1
            try:
                status = http.post("/v1/weights", json={"version": version, "uri": str(published),
                                                        "sha256": storage.checkpoint_digest(str(published))},
                                   timeout=60).status_code
            except httpx.HTTPError:
                status = None
            tally.record(family, status, f"hostile adapter {name}", accepted=status is None or status < 400)
            after = http.post("/v1/score", json=probe).json()["logprobs"]
            tally.record(family, None, f"log-probs after {name}", accepted=after != before)
        published = root / "good-published"
        storage.publish_checkpoint(str(good), str(published), metadata={"adapter": "good"})
        status = http.post("/v1/weights", json={"version": server.manager.engine.version + 1, "uri": str(published),
                                                "sha256": storage.checkpoint_digest(str(published))}).status_code
        tally.record(family, status, "the legitimate adapter after the hostile ones", accepted=status != 200)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="local_outputs/security")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import httpx

    from sao_core import storage
    from sao_core.models import EMBEDDED_TINY, resolve_model
    from sao_core.rollout.server import RolloutServer, ServeConfig

    cache = os.environ.get("SAO_CACHE_DIR", str(Path.home() / ".cache" / "sao"))
    model = resolve_model(EMBEDDED_TINY, cache).path
    scratch = Path(tempfile.mkdtemp(prefix="sao-campaign-"))
    weights_root = scratch / "run" / "weights"
    weights_root.mkdir(parents=True)
    planted = scratch / "planted"
    storage.publish_checkpoint(model, str(planted), metadata={"evil": True})
    digest = storage.checkpoint_digest(str(planted))
    (weights_root / "link-out").symlink_to(planted, target_is_directory=True)
    (weights_root / "link-chain").symlink_to(weights_root / "link-out", target_is_directory=True)
    legit = weights_root / "legit"   # the learner's own weights, pushed during the score flood
    storage.publish_checkpoint(model, str(legit), metadata={"step": 1})
    legit_digest = storage.checkpoint_digest(str(legit))
    secured = RolloutServer(ServeConfig(model=model, port=0, cache_dir=cache, max_batch=2,
                                        allowed_weight_roots=[str(weights_root)]), token=TOKEN).start()
    tokenless = RolloutServer(ServeConfig(model=model, port=0, cache_dir=cache, max_batch=2)).start()
    # its own service: a legitimate adapter it takes becomes its policy, which the other families must not see
    adapters = RolloutServer(ServeConfig(model=model, port=0, cache_dir=cache, max_batch=2,
                                         allowed_weight_roots=[str(weights_root)]), token=TOKEN).start()
    tally, slowest, done = Tally(), [0.0], threading.Event()

    def poll():
        with httpx.Client(timeout=30) as http:
            while not done.is_set():
                for server in (secured, tokenless, adapters):
                    began = time.monotonic()
                    try:
                        http.get(f"{server.url}/healthz")
                    except httpx.HTTPError:
                        pass
                    slowest[0] = max(slowest[0], time.monotonic() - began)
                time.sleep(0.05)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    began = time.time()
    rng = random.Random(args.seed)
    try:
        for round_ in range(args.rounds):
            header_attacks(rng, secured.url, tally, tokenless=False)
            header_attacks(rng, tokenless.url, tally, tokenless=True)
            uri_attacks(secured.url, tally, weights_root, planted, digest, secured.manager.engine.version)
            json_attacks(secured.url, tally)
            metrics_port_attacks(tally)
            score_flood(secured, tally, rng, legit, legit_digest)
            adapter_attacks(adapters, tally, weights_root, model, cache)
            print(f"round {round_ + 1}: {tally.requests} requests, {len(tally.server_errors)} 5xx, "
                  f"{len(tally.accepted)} accepted, slowest /healthz {slowest[0]:.3f} s", flush=True)
    finally:
        done.set()
        poller.join()
        secured.stop()
        tokenless.stop()
        adapters.stop()
    result = {"requests": tally.requests, "by_family": tally.by_family, "server_errors": tally.server_errors,
              "accepted": tally.accepted, "slowest_healthz_s": round(slowest[0], 4),
              "seconds": round(time.time() - began, 1), "rounds": args.rounds, "seed": args.seed}
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "security_campaign.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("server_errors", "accepted")}, indent=2))
    for line in (tally.server_errors + tally.accepted)[:20]:
        print("  FOUND", line)
    ok = not tally.server_errors and not tally.accepted and slowest[0] < 0.5
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
