"""Run the rollout service: in the foreground (`sao rollout serve`) or in a background thread of the
current process (tests, colocated learners)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn

from sao_core.http_limits import HeaderCount, HttpLimits, limited_protocol
from sao_core.rollout.auth import ENV_TOKEN, ENV_TOKEN_FILE, TokenError, is_loopback, resolve_token
from sao_core.rollout.manager import RolloutManager, RolloutPlan
from sao_core.rollout.service import DEFAULT_MAX_BODY_BYTES, create_app

log = logging.getLogger(__name__)

# Seconds the HTTP server gives open requests and connections once it is told to exit. Without a bound it
# waits for every connection to close: a long-poll take runs on for up to its wait_s, and a connection
# accepted in the instant of the exit is never asked to close, so a client polling on it keeps the process
# (and its TrainJob) alive indefinitely. The episodes' own grace period comes before this, in the manager.
HTTP_DRAIN_S = 5.0


@dataclass
class ServeConfig:
    """Settings of one rollout service process."""

    model: str = "embedded:tiny"            # model reference (embedded:*, directory, s3://, hub id)
    engine: str = "hf"                      # hf | vllm
    host: str = "127.0.0.1"
    port: int = 8000                        # 0: pick a free port
    max_batch: int = 32                     # hf engine: sequences per forward pass
    lease_seconds: float = 600.0            # taken-but-unacknowledged trajectories return after this
    seed: int = 0
    engine_options: dict = field(default_factory=dict)   # extra engine settings, e.g. vllm kv_cache_memory_bytes
    cache_dir: str = ""
    # vLLM scaling (engine vllm only). 0 means vLLM's own default.
    tensor_parallel_size: int = 1           # GPUs one model replica is split over
    data_parallel_size: int = 1             # engine replicas inside this service (one per TP group of GPUs)
    gpu_memory_utilization: float = 0.0     # share of GPU memory vLLM may take (weights + KV cache); 0: 0.5
    max_num_seqs: int = 0                   # concurrent sequences per engine step
    max_model_len: int = 0                  # context length in tokens; 0: the model's (config.json)
    prefix_caching: bool = True             # reuse the KV cache of shared prompt prefixes
    unverified: bool = False                # load a local model folder without a manifest.json as it is (weight pushes are always verified)
    # Security (README "Security model"). The token itself is never a field: it comes from token_file,
    # $SAO_ROLLOUT_TOKEN or $SAO_ROLLOUT_TOKEN_FILE (or a colocated learner hands its own in).
    token_file: str = ""                    # file holding the bearer token (a mounted Kubernetes Secret)
    insecure: bool = False                  # serve without a token on a non-loopback address
    allowed_weight_roots: list[str] = field(default_factory=list)  # weights load only from inside these (paths, s3:// prefixes)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES   # larger request bodies get 413
    # Connection limits (sao_core/rollout/http_limits.py): what a sender can cost before any endpoint runs.
    max_header_bytes: int = 65536           # request line + headers; above: 431
    max_headers: int = 100                  # header fields per request; above: 431
    header_timeout_s: float = 10.0          # to send a complete request head; else 408 and closed
    body_timeout_s: float = 60.0            # to send a complete body after its head; else closed
    keep_alive_s: float = 5.0               # idle keep-alive connections are closed after this
    max_connections: int = 1000             # open connections + running requests; above: 503

    def validate(self) -> None:
        if self.engine not in ("hf", "vllm"):
            raise ValueError(f"ServeConfig.engine must be hf or vllm, got {self.engine!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ServeConfig.port must be in [0, 65535], got {self.port}")
        if self.max_batch < 1:
            raise ValueError(f"ServeConfig.max_batch must be >= 1, got {self.max_batch}")
        if not self.lease_seconds > 0:
            raise ValueError(f"ServeConfig.lease_seconds must be > 0, got {self.lease_seconds}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"ServeConfig.seed must be in [0, 2^63), got {self.seed}")
        if not 1024 <= self.max_body_bytes <= 2**31:
            raise ValueError(f"ServeConfig.max_body_bytes must be in [1024, 2^31], got {self.max_body_bytes}")
        if not 1024 <= self.max_header_bytes <= 2**24:
            raise ValueError(f"ServeConfig.max_header_bytes must be in [1024, 2^24], got {self.max_header_bytes}")
        if not 8 <= self.max_headers <= 10_000:
            raise ValueError(f"ServeConfig.max_headers must be in [8, 10000], got {self.max_headers}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"ServeConfig.{name} must be in (0, 3600] seconds, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"ServeConfig.max_connections must be >= 1, got {self.max_connections}")
        if any(not str(root).strip() for root in self.allowed_weight_roots):
            raise ValueError("ServeConfig.allowed_weight_roots may not hold empty entries")
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_seqs < 0 or self.max_model_len < 0:
            raise ValueError("ServeConfig.max_num_seqs and max_model_len must be >= 0")
        if not 0.0 <= self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"ServeConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.engine == "hf" and self.vllm_options():
            raise ValueError(f"{', '.join(sorted(self.vllm_options()))} apply to the vllm engine only "
                             "(engine is hf)")

    def vllm_options(self) -> dict:
        """The vLLM engine arguments set by the scaling fields (only those that differ from the defaults)."""
        options: dict = {}
        if self.tensor_parallel_size != 1:
            options["tensor_parallel_size"] = self.tensor_parallel_size
        if self.data_parallel_size != 1:
            options["data_parallel_size"] = self.data_parallel_size
        if self.gpu_memory_utilization:
            options["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.max_num_seqs:
            options["max_num_seqs"] = self.max_num_seqs
        if self.max_model_len:
            options["max_model_len"] = self.max_model_len
        if not self.prefix_caching:
            options["enable_prefix_caching"] = False
        return options


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def service_token(config: ServeConfig, token: str | None = None) -> str | None:
    """The token the service will require (see sao_core.rollout.auth), or None when it may run without one:
    on a loopback address or with `insecure`. ValueError when it may not (the message never holds a token)."""
    try:
        resolved = resolve_token(token, config.token_file)
    except TokenError as err:
        raise ValueError(str(err)) from None
    if resolved is None and not config.insecure and not is_loopback(config.host):
        raise ValueError(f"refusing to serve on {config.host} without a token: set ${ENV_TOKEN}, "
                         f"${ENV_TOKEN_FILE} or token_file (a mounted Kubernetes Secret), or bind to 127.0.0.1; "
                         "insecure=true serves anyone who can reach the port")
    return resolved


#: how long `RolloutServer.start` waits for its engine, seconds: a vLLM engine loads the model, profiles memory and
#: (on a GPU) captures CUDA graphs first, minutes for a 7B+ model; on 2 busy CPU cores even the tiny model's vLLM
#: took up to 80 s (60 s was the old limit)
ENGINE_START_S = 900.0


class RolloutServer:
    """A rollout service on its own thread and event loop. `url` is ready once `start()` returns.

    `token`: the bearer token to require (default: from config.token_file or the environment)."""

    def __init__(self, config: ServeConfig, plan: RolloutPlan | None = None, token: str | None = None):
        config.validate()
        self._token = service_token(config, token)
        self.authenticated = self._token is not None
        self.config = config
        self.plan = plan
        self.port = config.port or _free_port(config.host)
        self.url = f"http://{config.host}:{self.port}"
        self._thread: threading.Thread | None = None
        self._server: uvicorn.Server | None = None
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.manager: RolloutManager | None = None

    def _build(self) -> tuple[RolloutManager, object]:
        from sao_core.rollout.engines import make_engine

        options = {"seed": self.config.seed}
        if self.config.engine == "hf":
            options["max_batch"] = self.config.max_batch
        else:
            options["enable_prefix_caching"] = True
            options.update(self.config.vllm_options())
        options.update(self.config.engine_options)
        options["unverified"] = self.config.unverified or bool(options.get("unverified"))
        engine = make_engine(self.config.engine, self.config.model, self.config.cache_dir, **options)
        manager = RolloutManager(engine, engine.tokenizer, self.config.cache_dir, self.config.lease_seconds,
                                 allowed_weight_roots=self.config.allowed_weight_roots)
        app = create_app(manager, on_shutdown=self._request_exit, token=self._token,
                         max_body_bytes=self.config.max_body_bytes, insecure=self.config.insecure)
        return manager, app

    def _request_exit(self) -> None:
        if self._server is not None:
            self._server.should_exit = True

    async def serve_async(self) -> None:
        """Serve until shutdown (foreground use)."""
        self._loop = asyncio.get_running_loop()
        self.manager, app = self._build()
        if self.plan is not None:
            self.manager.start(self.plan)
        limits = HttpLimits(max_header_bytes=self.config.max_header_bytes, max_headers=self.config.max_headers,
                            header_timeout_s=self.config.header_timeout_s, body_timeout_s=self.config.body_timeout_s,
                            keep_alive_s=self.config.keep_alive_s, max_connections=self.config.max_connections)
        app = HeaderCount(app, limits.max_headers)
        config = uvicorn.Config(app, host=self.config.host, port=self.port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=HTTP_DRAIN_S, http=limited_protocol(limits),
                                timeout_keep_alive=limits.keep_alive_s, limit_concurrency=limits.max_connections)
        self._server = uvicorn.Server(config)
        await self._server.serve()
        await self.manager.shutdown(grace_s=0)

    def start(self, timeout_s: float = ENGINE_START_S) -> RolloutServer:
        """Start in a background thread; return once /healthz answers (at most `timeout_s` seconds: the engine
        loads the model first; a start that fails raises at once)."""
        def run():
            try:
                asyncio.run(self.serve_async())
            except BaseException as err:  # surfaced by start() / stop()
                self._error = err

        self._thread = threading.Thread(target=run, name="rollout-service", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._error is not None:
                raise RuntimeError(f"rollout service failed to start: {self._error}") from self._error
            if self._server is not None and self._server.started:
                return self
            time.sleep(0.05)
        raise TimeoutError(f"rollout service did not start within {timeout_s} s")

    # ------------------------------------------------------------------ colocated learner (same process)
    def takes_weights_in_memory(self) -> bool:
        """Whether this service's engine can take weights handed over in memory (the HF engine; the vLLM engine:
        full weights through vLLM's weight-transfer API, LoRA adapters checked in memory then loaded as folders)."""
        return self.manager is not None and hasattr(self.manager.engine, "update_in_memory")

    def weight_dtypes(self) -> dict:
        """name -> dtype of the engine's weights: what `update_in_memory` must be sent in."""
        return self.manager.weight_dtypes()

    def update_in_memory(self, update, resync: bool = False, timeout_s: float = 600.0) -> dict:
        """Hand the engine a `WeightUpdate` from this process (no HTTP, no files): the manager's version rules and
        lock, the engine's copy and digest check. Blocks until the engine serves it; returns the manager's answer
        ({"version", "sha256": the digest the engine recomputed, "seconds"}); RolloutError when refused."""
        if self._loop is None or self.manager is None:
            raise RuntimeError("the rollout service is not running")
        future = asyncio.run_coroutine_threadsafe(self.manager.update_in_memory(update, resync), self._loop)
        return future.result(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        self._request_exit()
        if self._thread is not None:
            self._thread.join(timeout_s)


def serve(config: ServeConfig, plan: RolloutPlan | None = None) -> None:
    """Run the service in the foreground until it is shut down (POST /v1/shutdown or Ctrl-C)."""
    server = RolloutServer(config, plan)
    log.info("rollout service on %s (engine %s, model %s, %s, weights from %s)", server.url, config.engine,
             config.model, "bearer token required" if server.authenticated else "NO authentication",
             ", ".join(config.allowed_weight_roots) or "nowhere (no allowed_weight_roots)")
    asyncio.run(server.serve_async())
