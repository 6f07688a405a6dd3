"""The rollout service's HTTP API (FastAPI; OpenAPI at /openapi.json, docs at /docs).

    POST /v1/rollouts/start      start a rollout plan (prepared rl dataset + sampling plan)
    POST /v1/rollouts/stop       stop the plan (running episodes are dropped)
    GET  /v1/trajectories        long-poll: take up to `max` finished trajectories (leased to `consumer`)
    POST /v1/trajectories/ack    acknowledge (or drop) taken trajectories
    POST /v1/weights             load new weights {version, uri, sha256} (a full model or a LoRA adapter)
    GET  /v1/weights/spec        the engine's weights: [[name, shape, dtype], ...] (the weight channel's layout)
    POST /v1/weights/channel     join a learner's weight channel {host, port, rank, world_size} (rollout/channel.py)
    POST /v1/weights/receive     get ready for weights over the channel {version, digest?, resync, tensors}
    POST /v1/weights/commit      apply what the channel delivered {version, digest?}; answers like POST /v1/weights
    POST /v1/score               log-probs of given tokens under the weights in use {token_ids, start}
    POST /v1/pause | /v1/resume  pause or resume generation
    POST /v1/shutdown            graceful shutdown
    POST /v1/generate            evaluation: k samples per prompt, any sampling settings
    GET  /v1/status              counters, plan, weights version
    GET  /healthz | /metrics     open: liveness and Prometheus metrics (text)

Every /v1 endpoint needs ``Authorization: Bearer <token>`` when the service has a token (see
:mod:`sao_core.rollout.auth`); /healthz, /metrics, /openapi.json and /docs are open. Request bodies above
`max_body_bytes` get 413.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from sao_core.rollout.auth import REALM, is_loopback, same_token
from sao_core.rollout.engines.base import SEED_LIMIT, SamplingParams
from sao_core.rollout.manager import (
    SCORE_RETRY_AFTER_S,
    ConflictError,
    ForbiddenError,
    RolloutError,
    RolloutManager,
    RolloutPlan,
    ScoreBusyError,
)
from sao_core.rollout.plan import SEED_MAX, request_model

log = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _no_bool(value):
    if isinstance(value, bool):
        raise ValueError("a token id is an integer, not true / false")
    return value


#: a token id (JSON true / false are not integers, though pydantic's lax mode takes them)
TokenId = Annotated[int, BeforeValidator(_no_bool)]


#: bounds of a plan's free-form JSON options (env_options): nesting depth and encoded size. A plan that was
#: accepted must always be reportable (/v1/status echoes it), and a deep structure is what breaks encoders.
MAX_OPTIONS_DEPTH = 16
MAX_OPTIONS_BYTES = 256 * 1024


def _depth(value, limit: int) -> int:
    """Nesting depth of a JSON value, counting stops past `limit` (so a hostile one costs at most that)."""
    if limit < 0 or not isinstance(value, (dict, list)):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(v, limit - 1) for v in children), default=0)


def _bounded_options(value: dict) -> dict:
    if _depth(value, MAX_OPTIONS_DEPTH + 1) > MAX_OPTIONS_DEPTH:
        raise ValueError(f"nested more than {MAX_OPTIONS_DEPTH} levels deep")
    try:
        size = len(json.dumps(value, allow_nan=False).encode("utf-8"))
    except (ValueError, UnicodeEncodeError) as err:
        raise ValueError("not plain JSON (NaN, infinity or an unpaired surrogate)") from err
    if size > MAX_OPTIONS_BYTES:
        raise ValueError(f"{size} bytes as JSON; at most {MAX_OPTIONS_BYTES}")
    return value


#: a plan in POST /v1/rollouts/start: RolloutPlan's fields, defaults and HTTP bounds (rollout/plan.py)
PlanRequest = request_model("PlanRequest", _Strict, {"env_options": (AfterValidator(_bounded_options),)})


class AckRequest(_Strict):
    ids: list[str] = Field(default_factory=list, max_length=100_000)
    dropped: list[str] = Field(default_factory=list, max_length=100_000)
    requeue: list[str] = Field(default_factory=list, max_length=100_000,
                               description="dropped, and their position rolled out once more (admission requeue)")


class WeightsRequest(_Strict):
    version: int = Field(ge=0)
    uri: str = Field(min_length=1, description="checkpoint directory or s3:// prefix (published with a manifest)")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the checkpoint's manifest.json")
    resync: bool = Field(False, description="a learner re-syncing this service (e.g. after its own resume): any "
                                            "version is taken; without it only the current version + 1")


class ChannelRequest(_Strict):
    host: str = Field(min_length=1, max_length=253, description="the learner's address (the channel's TCPStore)")
    port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1, le=65535, description="this service's rank in the group (the learner is rank 0)")
    world_size: int = Field(ge=2, le=65536)
    timeout_s: float = Field(300.0, gt=0, le=3600, description="to join, and per broadcast bucket")


WireTensor = tuple[Annotated[str, Field(min_length=1, max_length=1000)],
                   Annotated[list[Annotated[int, Field(ge=0, le=2**40)]], Field(max_length=8)],
                   Annotated[str, Field(min_length=1, max_length=32)]]


class ReceiveRequest(_Strict):
    version: int = Field(ge=0)
    digest: str | None = Field(None, pattern=r"^xxh3-128:[0-9a-f]{32}$",
                               description="the sender's digest of the tensors (absent: it comes with the commit)")
    resync: bool = False
    tensors: list[WireTensor] = Field(min_length=1, max_length=100_000,
                                      description="[name, shape, dtype] of each tensor, in send order")
    bucket_bytes: int = Field(64 << 20, ge=1, le=1 << 34, description="the sender's bucket size (bytes)")


class CommitRequest(_Strict):
    version: int = Field(ge=0)
    digest: str | None = Field(None, pattern=r"^xxh3-128:[0-9a-f]{32}$",
                               description="the sender's digest of the tensors, where the receive did not announce it "
                                           "(the sender hashed while it broadcast)")


class ShutdownRequest(_Strict):
    grace_s: float = Field(30.0, ge=0, le=3600)


class GenerateRequest(_Strict):
    prompts: list[list[dict[str, Any]] | list[TokenId]] = Field(min_length=1, max_length=10_000,
                                                          description="chat messages or token ids per prompt")
    n: int = Field(1, ge=1, le=1024)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(256, ge=1, le=1_000_000)
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="sample k of prompt i uses seed + i * n + k "
                                                                     "(mod 2^63)")


class ScoreRequest(_Strict):
    token_ids: list[TokenId] = Field(min_length=2, max_length=1_000_000)
    start: int = Field(ge=1, description="the first position scored: log-probs of token_ids[start:] are returned")


class ErrorBody(BaseModel):
    detail: str


DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


def _error(description: str) -> dict:
    return {"model": ErrorBody, "description": description}


#: documented error responses (FastAPI adds 422 for request validation)
UNAUTHORIZED = {401: {**_error("missing or wrong bearer token"),
                      "headers": {"WWW-Authenticate": {"description": f'Bearer realm="{REALM}"',
                                                       "schema": {"type": "string"}}}}}
TOO_LARGE = {413: _error("request body above the service's max_body_bytes")}
BAD_REQUEST = {400: _error("the request cannot be honoured, or its body is not JSON (the message says why)")}
CONFLICT = {409: _error("the request conflicts with the service's state")}
FORBIDDEN = {403: _error("authenticated, but not allowed (e.g. weights outside the allowed roots)")}


class BodyLimit:
    """ASGI middleware: 413 for a request body above `max_bytes`, by its Content-Length or, for a body sent
    without one (chunked), as soon as the bytes received pass the bound."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return f"request body above the limit of {self.max_bytes} bytes"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    return await JSONResponse({"detail": self._message()}, status_code=413,
                                              headers={"Connection": "close"})(scope, receive, send)
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the route's body read: FastAPI turns an HTTPException there into its response.
                    raise HTTPException(status_code=413, detail=self._message())
            return message

        await self.app(scope, limited, send)


def _host_of(value: str) -> str:
    """The host part of a Host header or of an Origin URL ("[::1]:8000" -> "::1", "http://a:1" -> "a")."""
    value = value.strip()
    if "://" in value:
        value = value.split("://", 1)[1].split("/", 1)[0]
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class LoopbackGuard:
    """ASGI middleware of a service without a token (loopback use): a web page open in a browser on the same
    host must not drive it. Any request whose Host is not a loopback name or address is refused (DNS
    rebinding: a page's own name resolving to 127.0.0.1), as is any request from a browser page of another
    origin (an Origin header that is not loopback, "null" included), and a POST must say Content-Type:
    application/json (a cross-origin page cannot send that without a CORS preflight, which this service never
    grants). With a token none of this is needed: a page cannot know the token."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope.get("headers", [])}
        refusal = None
        if not is_loopback(_host_of(headers.get("host", ""))):
            refusal = (421, "this service has no token and answers only requests addressed to a loopback host "
                            "(Host: 127.0.0.1, ::1 or localhost)")
        elif "origin" in headers and not is_loopback(_host_of(headers["origin"])):
            refusal = (403, "this service has no token and refuses requests from web pages of other origins")
        elif scope.get("method") == "POST" and not headers.get("content-type", "").lower().startswith(
                "application/json"):
            refusal = (415, "POST requests need Content-Type: application/json")
        if refusal is not None:
            return await JSONResponse({"detail": refusal[1]}, status_code=refusal[0],
                                      headers={"Connection": "close"})(scope, receive, send)
        await self.app(scope, receive, send)


@functools.lru_cache(maxsize=8)
def _longest_token_chars(tokenizer) -> int:
    """Characters of the tokenizer's longest vocabulary entry (at least 1; 81 for SmolLM2's 49,152 entries)."""
    return max((len(piece) for piece in tokenizer.get_vocab()), default=1) or 1


def create_app(manager: RolloutManager, on_shutdown=None, token: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, insecure: bool = False) -> FastAPI:
    """The FastAPI application around a manager. `on_shutdown()` is called after a graceful shutdown.

    `token`: the bearer token every /v1 endpoint needs (None: no authentication, loopback or insecure use).
    Without a token the service answers only loopback Hosts and same-host origins (`LoopbackGuard`), unless
    `insecure` (served without a token on purpose, on any address).
    """
    app = FastAPI(title="SAO rollout service", version="1")
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if token is None and not insecure:
        app.add_middleware(LoopbackGuard)
    _add_error_handlers(app)
    guarded = [Depends(_bearer_check(token))]
    metrics = _metrics_router(manager)   # built first: its tool-latency listener joins the manager now
    # In this order: the order of the paths in /openapi.json.
    app.include_router(_status_router(manager, guarded))
    app.include_router(_rollouts_router(manager, guarded))
    app.include_router(_weights_router(manager, guarded))
    app.include_router(_control_router(manager, guarded, on_shutdown))
    app.include_router(_sampling_router(manager, guarded))
    app.include_router(metrics)
    return app


def _bearer_check(token: str | None):
    """The dependency of every /v1 endpoint: 401 unless the request's bearer token is `token` (None: no check)."""
    bearer = HTTPBearer(auto_error=False, scheme_name="rolloutToken",
                        description="the run's rollout token ($SAO_ROLLOUT_TOKEN or a mounted Secret file)")

    async def authenticated(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if token is None:
            return
        if credentials is None or not same_token(credentials.credentials, token):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token (Authorization: Bearer ...)",
                                headers={"WWW-Authenticate": f'Bearer realm="{REALM}"'})

    return authenticated


# ------------------------------------------------------------------------------------------ errors

def _add_error_handlers(app: FastAPI) -> None:
    """422 for an invalid request (where and what, never the input), and the manager's errors: ForbiddenError
    403, ConflictError 409, any other RolloutError 400; each as {"detail": ...}."""
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(ForbiddenError, _forbidden)
    app.add_exception_handler(ConflictError, _conflict)
    app.add_exception_handler(RolloutError, _bad)


def _clean(text) -> str:
    """`text` as a string that always encodes (unpaired surrogates escaped), at most 500 characters."""
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")[:500]


async def _invalid(_: Request, err: RequestValidationError):
    # Where and what, never the input itself: it may not be encodable (NaN, an unpaired surrogate) or be
    # large, and echoing it made FastAPI's own handler answer 500.
    detail = [{"loc": [_clean(x) if isinstance(x, str) else x for x in e.get("loc", ())],
               "msg": _clean(e.get("msg", "")), "type": _clean(e.get("type", ""))} for e in err.errors()[:20]]
    return JSONResponse(status_code=422, content={"detail": detail})


async def _forbidden(_: Request, err: ForbiddenError):
    return JSONResponse(status_code=403, content={"detail": str(err)})


async def _conflict(_: Request, err: ConflictError):
    return JSONResponse(status_code=409, content={"detail": str(err)})


async def _bad(_: Request, err: RolloutError):
    return JSONResponse(status_code=400, content={"detail": str(err)})


# ------------------------------------------------------------------------------------------ routers

def _status_router(manager: RolloutManager, guarded: list) -> APIRouter:
    """GET /healthz (open) and GET /v1/status."""
    router = APIRouter()

    @router.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True, "version": manager.engine.version}

    @router.get("/v1/status", dependencies=guarded, responses={**UNAUTHORIZED})
    async def status() -> dict:
        return manager.status()

    return router


def _rollouts_router(manager: RolloutManager, guarded: list) -> APIRouter:
    """The plan and its trajectories: POST /v1/rollouts/start and /stop, GET /v1/trajectories, POST /ack."""
    router = APIRouter()

    @router.post("/v1/rollouts/start", dependencies=guarded,
                 responses={**BAD_REQUEST, **UNAUTHORIZED, **CONFLICT, **TOO_LARGE})
    async def start(plan: PlanRequest) -> dict:
        rollout_plan = RolloutPlan(**plan.model_dump())
        tasks = await asyncio.to_thread(manager.load_tasks, rollout_plan)   # reading a dataset: off the loop
        return manager.start(rollout_plan, tasks)

    @router.post("/v1/rollouts/stop", dependencies=guarded, responses={**UNAUTHORIZED})
    async def stop() -> dict:
        await manager.stop()
        return manager.status()

    @router.get("/v1/trajectories", dependencies=guarded, responses={**BAD_REQUEST, **UNAUTHORIZED})
    async def take(consumer: str = Query(min_length=1, max_length=200),
                   max: int = Query(1, ge=1, le=10_000),  # noqa: A002 - the wire name
                   wait_s: float = Query(0.0, ge=0, le=300),
                   reconnect: bool = False) -> dict:
        redelivered = manager.reconnect(consumer) if reconnect else 0
        items = await manager.take(consumer, max, wait_s)
        return {"trajectories": [t.to_dict() for t in items], "redelivered": redelivered,
                "version": manager.engine.version, "plan_done": manager.plan_done and not manager.status()["ready"]}

    @router.post("/v1/trajectories/ack", dependencies=guarded, responses={**BAD_REQUEST, **UNAUTHORIZED, **TOO_LARGE})
    async def ack(body: AckRequest) -> dict:
        return manager.ack(body.ids, body.dropped, body.requeue)

    return router


def _weights_router(manager: RolloutManager, guarded: list) -> APIRouter:
    """Weight updates: POST /v1/weights (from a checkpoint), and over a learner's weight channel GET
    /v1/weights/spec, POST /v1/weights/channel, /receive and /commit."""
    from sao_core.rollout.channel import ChannelError, ServiceChannel, check_spec, dtype_name, parse_dtype

    router = APIRouter()
    channel = ServiceChannel()

    @router.post("/v1/weights", dependencies=guarded,
                 responses={**BAD_REQUEST, **UNAUTHORIZED, **FORBIDDEN, **CONFLICT, **TOO_LARGE})
    async def weights(body: WeightsRequest) -> dict:
        return await manager.update_weights(body.version, body.uri, body.sha256, resync=body.resync)

    @router.get("/v1/weights/spec", dependencies=guarded, responses={**BAD_REQUEST, **UNAUTHORIZED})
    async def weights_spec() -> dict:
        model = manager.weight_model()
        return {"tensors": [[name, list(t.shape), dtype_name(t.dtype)]
                            for name, t in model.state_dict(keep_vars=True).items()],
                "version": manager.engine.version}

    @router.post("/v1/weights/channel", dependencies=guarded,
                 responses={**BAD_REQUEST, **UNAUTHORIZED, **CONFLICT, **TOO_LARGE})
    async def weights_channel(body: ChannelRequest) -> dict:
        """Join a learner's weight channel (leaving any earlier one, after a receive still waiting on it ended);
        answers once the whole group is formed."""
        manager.weight_model()
        if body.rank >= body.world_size:
            raise RolloutError(f"rank {body.rank} is outside a group of {body.world_size}")
        if channel.joining:
            raise ConflictError("a join of a weight channel is in progress")
        channel.joining = True
        try:
            return await asyncio.to_thread(channel.join, body.host, body.port, body.rank, body.world_size,
                                           body.timeout_s)
        except ChannelError as err:
            raise RolloutError(str(err)) from err
        finally:
            channel.joining = False

    @router.post("/v1/weights/receive", dependencies=guarded,
                 responses={**BAD_REQUEST, **UNAUTHORIZED, **CONFLICT, **TOO_LARGE})
    async def weights_receive(body: ReceiveRequest) -> dict:
        """Check an announced update against the engine and the version rules, then start receiving it: the
        learner broadcasts only after every service answered ready."""
        model = manager.weight_model()
        if channel.receiver is None or channel.joining:
            raise ConflictError("this service has joined no weight channel (POST /v1/weights/channel first)")
        if channel.receiving():
            raise ConflictError("a weight receive is already in progress")
        try:
            spec = [(name, tuple(shape), parse_dtype(dtype)) for name, shape, dtype in body.tensors]
            check_spec(model, spec)
        except ValueError as err:
            raise RolloutError(f"weights version {body.version} do not fit this engine: {err}; nothing was "
                               "received") from err
        manager._check_next_version(body.version, body.digest, body.resync)
        channel.start(body.version, body.resync, spec, body.digest, body.bucket_bytes)
        return {"ready": True, "version": body.version}

    @router.post("/v1/weights/commit", dependencies=guarded,
                 responses={**BAD_REQUEST, **UNAUTHORIZED, **CONFLICT, **TOO_LARGE})
    async def weights_commit(body: CommitRequest) -> dict:
        """Wait for the receive of `version` and apply it (the manager's version rules and lock, the engine's
        digest check); answers like POST /v1/weights with the digest the engine recomputed."""
        return await _commit_received(manager, channel, body.version, body.digest)

    return router


async def _commit_received(manager: RolloutManager, channel, version: int, digest: str | None) -> dict:
    """The commit of `version` over the weight channel (`ServiceChannel`): wait for its receive, then apply it with
    the sender's digest (the manager's version rules and lock, the engine's digest check). Its buffers go back to
    the channel once the engine is done with them (applied or refused; not on a cancel, where the engine may
    still be copying: the next receive then takes new ones)."""
    try:
        resync, thread, outcome = channel.take(version)
    except LookupError as err:
        raise ConflictError(str(err)) from err
    await asyncio.to_thread(thread.join)
    try:
        update = channel.received(version, outcome, digest)
    except ValueError as err:   # not received, or no digest
        channel.release(outcome)
        raise RolloutError(f"{err}; the current weights (version {manager.engine.version}) stay") from err
    try:
        answer = await manager.update_in_memory(update, resync)
    except Exception:
        channel.release(outcome)
        raise
    channel.release(outcome)
    return answer


def _control_router(manager: RolloutManager, guarded: list, on_shutdown) -> APIRouter:
    """POST /v1/pause, /v1/resume and /v1/shutdown (graceful; then `on_shutdown()`)."""
    router = APIRouter()
    shutdown_tasks: set[asyncio.Task] = set()

    @router.post("/v1/pause", dependencies=guarded, responses={**UNAUTHORIZED})
    async def pause() -> dict:
        await manager.pause()
        return {"paused": True}

    @router.post("/v1/resume", dependencies=guarded, responses={**UNAUTHORIZED})
    async def resume() -> dict:
        await manager.resume()
        return {"paused": False}

    @router.post("/v1/shutdown", dependencies=guarded, responses={**BAD_REQUEST, **UNAUTHORIZED, **TOO_LARGE})
    async def shutdown(body: ShutdownRequest | None = None) -> dict:
        grace = body.grace_s if body else 30.0
        # The loop keeps only a weak reference to a task: without this one it can be collected mid-shutdown.
        task = asyncio.get_running_loop().create_task(_shut_down(manager, grace, on_shutdown))
        shutdown_tasks.add(task)
        task.add_done_callback(shutdown_tasks.discard)
        return {"shutting_down": True, "grace_s": grace}

    return router


async def _shut_down(manager: RolloutManager, grace_s: float, on_shutdown) -> None:
    """Stop the manager, running episodes getting `grace_s` seconds, then call `on_shutdown()` whatever happened."""
    log.info("shutdown requested: running episodes get %.0f s to finish", grace_s)
    try:
        await manager.shutdown(grace_s)
        log.info("rollout service stopped; exiting")
    except Exception:  # the process must still exit, or its TrainJob never ends
        log.exception("graceful shutdown failed; exiting anyway")
    finally:
        if on_shutdown is not None:
            on_shutdown()


#: POST /v1/score's answer when too many scores run or wait
SCORE_BUSY = {429: {**_error("too many scores running or waiting; retry after Retry-After seconds"),
                    "headers": {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}}}}


def _sampling_router(manager: RolloutManager, guarded: list) -> APIRouter:
    """Sampling and scoring under the weights in use: POST /v1/generate (evaluation) and POST /v1/score."""
    router = APIRouter()

    @router.post("/v1/generate", dependencies=guarded, responses={**BAD_REQUEST, **UNAUTHORIZED, **TOO_LARGE})
    async def generate(body: GenerateRequest) -> dict:
        params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                max_new_tokens=body.max_new_tokens, seed=body.seed)
        tokenizer = manager.tokenizer
        limit = getattr(manager.engine, "context_length", None)
        if limit is not None:
            _check_prompt_chars(body.prompts, limit, tokenizer)
        # off the event loop: health checks and acks go on
        prompt_ids = await asyncio.to_thread(_tokenise_prompts, body.prompts, tokenizer)
        if limit is not None:
            _check_prompt_tokens(prompt_ids, limit, getattr(manager.engine, "context_source", "max_model_len"))
        jobs = [manager.engine.generate(ids, sample_params)
                for ids, sample_params in _sample_params(prompt_ids, params, body.n, body.seed, limit)]
        results = await asyncio.gather(*jobs)
        out = []
        for i in range(len(prompt_ids)):
            samples = results[i * body.n:(i + 1) * body.n]
            out.append([{"text": tokenizer.decode(g.token_ids, skip_special_tokens=True), "token_ids": g.token_ids,
                         "logprobs": g.logprobs, "finish_reason": g.finish_reason, "version": g.versions[-1]
                         if g.versions else manager.engine.version} for g in samples])
        return {"results": out}

    @router.post("/v1/score", dependencies=guarded,
                 responses={**BAD_REQUEST, **UNAUTHORIZED, **TOO_LARGE, **SCORE_BUSY})
    async def score(body: ScoreRequest) -> dict:
        """Log-probs of token_ids[start:] under the weights in use and their version (the learner's delivery
        check after a weight push). Scores run one at a time and a weight update goes before those waiting; above
        the manager's `max_queued_scores` running or waiting, 429 with Retry-After."""
        vocab = len(manager.tokenizer)
        if any(x < 0 or x >= vocab for x in body.token_ids):
            raise RolloutError(f"token_ids: token id out of range [0, {vocab})")
        if body.start >= len(body.token_ids):
            raise RolloutError(f"start {body.start} must be below the number of token_ids ({len(body.token_ids)})")
        limit = getattr(manager.engine, "context_length", None)
        if limit is not None and len(body.token_ids) > limit:
            raise RolloutError(f"token_ids: {len(body.token_ids)} tokens exceed the engine's context of {limit}")
        try:
            return await manager.score(body.token_ids, body.start)
        except ScoreBusyError as err:
            raise HTTPException(status_code=429, detail=str(err),
                                headers={"Retry-After": str(SCORE_RETRY_AFTER_S)}) from err

    return router


def _is_token_ids(prompt: list) -> bool:
    """Whether a /v1/generate prompt is token ids (else chat messages)."""
    return bool(prompt) and all(isinstance(x, int) for x in prompt)


def _check_prompt_chars(prompts: list[list], limit: int, tokenizer) -> None:
    """RolloutError for a chat prompt of more characters than `limit` tokens of the tokenizer's longest entry can
    hold: bounded before any work in proportion to the input, so such a prompt is refused without tokenising it."""
    most = limit * _longest_token_chars(tokenizer)
    for i, prompt in enumerate(prompts):
        if not _is_token_ids(prompt):
            chars = sum(len(str(m.get("content", ""))) for m in prompt if isinstance(m, dict))
            if chars > most:
                raise RolloutError(f"prompts[{i}]: {chars} characters cannot fit the engine's context of "
                                   f"{limit} tokens")


def _tokenise_prompts(prompts: list[list], tokenizer) -> list[list[int]]:
    """Token ids of each prompt: token ids as given (checked against the vocabulary), chat messages through the
    tokenizer's chat template (RolloutError naming the prompt otherwise)."""
    from sao_core.rollout.episode import prompt_tokens

    out = []
    for i, prompt in enumerate(prompts):
        if _is_token_ids(prompt):
            if any(x < 0 or x >= len(tokenizer) for x in prompt):
                raise RolloutError(f"prompts[{i}]: token id out of range [0, {len(tokenizer)})")
            out.append(list(prompt))
        else:
            try:
                out.append(prompt_tokens(tokenizer, prompt))
            except Exception as err:
                raise RolloutError(f"prompts[{i}]: not valid chat messages ({err})") from err
    return out


def _check_prompt_tokens(prompt_ids: list[list[int]], limit: int, context_source: str) -> None:
    """RolloutError for a prompt that leaves no room to generate within the engine's context of `limit` tokens."""
    for i, ids in enumerate(prompt_ids):
        if len(ids) >= limit:
            raise RolloutError(f"prompts[{i}]: {len(ids)} tokens; the engine's context is {limit} tokens "
                               f"({context_source}), which leaves no room to generate")


def _sample_params(prompt_ids: list[list[int]], params: SamplingParams, n: int, seed: int | None,
                   limit: int | None) -> list[tuple[list[int], SamplingParams]]:
    """(prompt, sampling) of each of the `n` samples per prompt, prompt by prompt: sample k of prompt i is seeded
    seed + i * n + k (mod 2^63), and stops at the end of the context of `limit` tokens (finish_reason "length")."""
    out = []
    for i, ids in enumerate(prompt_ids):
        room = params.max_new_tokens if limit is None else min(params.max_new_tokens, limit - len(ids))
        for k in range(n):
            sample_seed = None if seed is None else (seed + i * n + k) % SEED_LIMIT
            out.append((ids, SamplingParams(**{**params.__dict__, "seed": sample_seed, "max_new_tokens": room})))
    return out


def _metrics_router(manager: RolloutManager) -> APIRouter:
    """GET /metrics (open): the service's Prometheus gauges and its tool-latency histogram, which starts listening
    to the manager's finished trajectories here."""
    from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    gauges = {name: Gauge(f"sao_rollout_{name}", doc, registry=registry) for name, doc in {
        "tokens_generated": "tokens sampled by the engine since start",
        "in_flight": "episodes started and not yet acknowledged",
        "tokens_per_second": "tokens sampled per second since start",
        "weight_load_seconds": "seconds the last weight update took",
        "policy_version": "policy version of the weights in use",
    }.items()}
    episodes = Gauge("sao_rollout_episodes", "finished episodes by finish reason", ["finish_reason"], registry=registry)
    tool_latency = Histogram("sao_rollout_tool_seconds", "tool seconds per episode", registry=registry,
                             buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
    manager.listeners.append(lambda t: tool_latency.observe(t.timings.tool_seconds))
    router = APIRouter()

    @router.get("/metrics", response_class=PlainTextResponse, responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"}})
    async def metrics() -> PlainTextResponse:
        stats = manager.engine.stats()
        elapsed = max(time.time() - manager.started_at, 1e-9)
        gauges["tokens_generated"].set(stats.get("tokens_generated", 0))
        gauges["tokens_per_second"].set(stats.get("tokens_generated", 0) / elapsed)
        gauges["in_flight"].set(manager.status()["in_flight"])
        gauges["weight_load_seconds"].set(manager.last_weight_load_seconds)
        gauges["policy_version"].set(manager.engine.version)
        for reason, count in manager.finish_reasons.items():
            episodes.labels(finish_reason=reason).set(count)
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    return router
