"""A longer hostile campaign against real rollout services (not in CI; README "Security model"): fuzzed headers,
weight URIs and JSON depth / size, sent to one service with a token and one without (loopback), while a
thread polls /healthz. Counts requests, 5xx answers, attacks accepted and the slowest /healthz.

    .venv/bin/python scripts/security_campaign.py [--rounds 3] [--seed 0] [--output local_outputs/security]

An attack is "accepted" when the service did what it must refuse: loaded weights from outside its roots, or
answered a tokenless request from a foreign Host / Origin or a non-JSON POST with anything but a refusal.
Exit status 1 when any attack was accepted, any answer was a 5xx, or /healthz ever took 0.5 s or more.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
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
    secured = RolloutServer(ServeConfig(model=model, port=0, cache_dir=cache, max_batch=2,
                                        allowed_weight_roots=[str(weights_root)]), token=TOKEN).start()
    tokenless = RolloutServer(ServeConfig(model=model, port=0, cache_dir=cache, max_batch=2)).start()
    tally, slowest, done = Tally(), [0.0], threading.Event()

    def poll():
        with httpx.Client(timeout=30) as http:
            while not done.is_set():
                for server in (secured, tokenless):
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
            print(f"round {round_ + 1}: {tally.requests} requests, {len(tally.server_errors)} 5xx, "
                  f"{len(tally.accepted)} accepted, slowest /healthz {slowest[0]:.3f} s", flush=True)
    finally:
        done.set()
        poller.join()
        secured.stop()
        tokenless.stop()
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
