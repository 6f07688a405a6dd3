"""HTTP client of the rollout service (used by learners, the evaluator and tests)."""

from __future__ import annotations

import time

import httpx

from sao_core.rollout.trajectory import Trajectory


class RolloutUnavailable(ConnectionError):
    """The service cannot be reached (not started, restarting, wrong URL)."""


class RolloutRequestError(ValueError):
    """The service refused a request (4xx); the message is the service's."""


class RolloutAuthError(RolloutRequestError):
    """The service refused the token (401): none was given, or not the run's."""


class RolloutBusy(RolloutRequestError):
    """The service's queue for this kind of call is full (429); `retry_after_s`: when it said to try again."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def _retry_after_s(header: str | None) -> float:
    """Seconds from a Retry-After header (delta seconds), bounded to [0.1, 30]; 1 s when absent or a date."""
    try:
        return min(max(float(header), 0.1), 30.0) if header is not None else 1.0
    except ValueError:
        return 1.0


class RolloutClient:
    """Talks to one rollout service as one consumer (a learner's identity for leases). `token`: the run's
    bearer token (see sao_core.rollout.auth.resolve_token), sent with every request; None sends none."""

    def __init__(self, url: str, consumer: str = "learner", timeout_s: float = 30.0, token: str | None = None):
        self.url = url.rstrip("/")
        self.consumer = consumer
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers)

    def __repr__(self) -> str:
        return f"RolloutClient({self.url!r}, consumer={self.consumer!r})"

    def _call(self, method: str, path: str, timeout_s: float | None = None, **kwargs) -> dict:
        try:
            response = self._http.request(method, path, timeout=timeout_s or self._http.timeout, **kwargs)
        except httpx.TransportError as err:
            raise RolloutUnavailable(f"rollout service {self.url} unreachable ({type(err).__name__}: {err})") from err
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail")
            except ValueError:
                detail = response.text
            message = f"{method} {path} -> {response.status_code}: {detail}"
            if response.status_code == 429:
                raise RolloutBusy(message, _retry_after_s(response.headers.get("retry-after")))
            error = RolloutAuthError if response.status_code == 401 else RolloutRequestError
            raise error(message)
        return response.json()

    def health(self) -> dict:
        return self._call("GET", "/healthz")

    def status(self) -> dict:
        return self._call("GET", "/v1/status")

    def start(self, plan: dict) -> dict:
        return self._call("POST", "/v1/rollouts/start", json=plan)

    def stop(self) -> dict:
        return self._call("POST", "/v1/rollouts/stop", json={})

    def take(self, max_items: int = 1, wait_s: float = 0.0, reconnect: bool = False) -> tuple[list[Trajectory], dict]:
        """Finished trajectories (validated) and the response's other fields."""
        body = self._call("GET", "/v1/trajectories", timeout_s=wait_s + 30.0,
                          params={"consumer": self.consumer, "max": max_items, "wait_s": wait_s,
                                  "reconnect": str(reconnect).lower()})
        return [Trajectory.from_dict(t) for t in body.pop("trajectories")], body

    def ack(self, ids: list[str], dropped: list[str] | None = None, requeue: list[str] | None = None) -> dict:
        body = {"ids": list(ids), "dropped": list(dropped or [])}
        if requeue:
            body["requeue"] = list(requeue)
        return self._call("POST", "/v1/trajectories/ack", json=body)

    def push_weights(self, version: int, uri: str, sha256: str, resync: bool = False) -> dict:
        """Load `version` (the service's next one, or any with `resync`); the answer holds the version and
        the manifest digest the service now serves."""
        body = {"version": version, "uri": uri, "sha256": sha256}
        if resync:
            body["resync"] = True
        return self._call("POST", "/v1/weights", timeout_s=600.0, json=body)

    def weight_spec(self) -> dict:
        """{"tensors": [[name, shape, dtype], ...]} of the engine's weights (the weight channel's layout)."""
        return self._call("GET", "/v1/weights/spec")

    def join_channel(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0) -> dict:
        """Have the service join a weight channel (sao_core/rollout/channel.py); returns once the group formed."""
        return self._call("POST", "/v1/weights/channel", timeout_s=timeout_s + 30.0,
                          json={"host": host, "port": port, "rank": rank, "world_size": world_size,
                                "timeout_s": timeout_s})

    def receive_weights(self, version: int, digest: str | None, tensors: list, resync: bool = False,
                        bucket_bytes: int | None = None) -> dict:
        """Announce `version` ([name, shape, dtype] per tensor, the sender's digest, or None: given with the
        commit): {"ready": true} once the service checked it and waits for the broadcast; RolloutRequestError
        (nothing to broadcast) otherwise."""
        body = {"version": version, "resync": resync, "tensors": tensors}
        if digest is not None:
            body["digest"] = digest
        if bucket_bytes is not None:
            body["bucket_bytes"] = bucket_bytes
        return self._call("POST", "/v1/weights/receive", json=body)

    def commit_weights(self, version: int, digest: str | None = None) -> dict:
        """Apply the `version` received over the channel (`digest`: the sender's, where the receive did not
        announce it); answers like `push_weights` (the digest the engine recomputed)."""
        body = {"version": version} if digest is None else {"version": version, "digest": digest}
        return self._call("POST", "/v1/weights/commit", timeout_s=600.0, json=body)

    def score(self, token_ids: list[int], start: int, deadline_s: float = 120.0) -> dict:
        """{"logprobs": of token_ids[start:] under the service's weights in use, "version", "sha256"}. A service
        whose score queue is full answers 429 with Retry-After: waited out and retried until `deadline_s`
        (seconds from now) has passed, then the 429 is raised like any refusal."""
        deadline = time.monotonic() + deadline_s
        while True:
            left = deadline - time.monotonic()
            try:
                return self._call("POST", "/v1/score", timeout_s=max(left, 1.0),
                                  json={"token_ids": token_ids, "start": start})
            except RolloutBusy as err:
                if time.monotonic() + err.retry_after_s >= deadline:
                    raise
                time.sleep(err.retry_after_s)

    def pause(self) -> dict:
        return self._call("POST", "/v1/pause", json={})

    def resume(self) -> dict:
        return self._call("POST", "/v1/resume", json={})

    def generate(self, prompts: list, **sampling) -> list[list[dict]]:
        return self._call("POST", "/v1/generate", timeout_s=600.0, json={"prompts": prompts, **sampling})["results"]

    def shutdown(self, grace_s: float = 30.0) -> dict:
        return self._call("POST", "/v1/shutdown", json={"grace_s": grace_s})

    def close(self) -> None:
        self._http.close()
