"""The rollout service's HTTP API (FastAPI; OpenAPI at /openapi.json, docs at /docs).

    POST /v1/rollouts/start      start a rollout plan (prepared rl dataset + sampling plan)
    POST /v1/rollouts/stop       stop the plan (running episodes are dropped)
    GET  /v1/trajectories        long-poll: take up to `max` finished trajectories (leased to `consumer`)
    POST /v1/trajectories/ack    acknowledge (or drop) taken trajectories
    POST /v1/weights             load new weights {version, uri, sha256}
    POST /v1/pause | /v1/resume  pause or resume generation
    POST /v1/shutdown            graceful shutdown
    POST /v1/generate            evaluation: k samples per prompt, any sampling settings
    GET  /v1/status | /healthz | /metrics
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from sao_core.rollout.engines.base import SamplingParams
from sao_core.rollout.manager import ConflictError, RolloutError, RolloutManager, RolloutPlan

log = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PlanRequest(_Strict):
    dataset: str = Field(min_length=1, description="prepared rl dataset: directory, data.jsonl or s3:// URI")
    rollouts_per_prompt: int = Field(1, ge=1, le=1024)
    epochs: int = Field(1, ge=0)
    shuffle: bool = True
    seed: int = 0
    limit: int | None = Field(None, ge=1)
    max_in_flight: int = Field(64, ge=1, le=100_000)
    env_concurrency: dict[str, int] = Field(default_factory=dict)
    env_options: dict[str, dict[str, Any]] = Field(default_factory=dict)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_new_tokens_per_turn: int = Field(256, ge=1, le=1_000_000)
    max_total_tokens: int = Field(4096, ge=1, le=10_000_000)
    episode_timeout_s: float = Field(0.0, ge=0)
    abandon_after_versions: int | None = Field(None, ge=0, description="end an episode before its next turn once "
                                               "its first token is more than this many versions behind the "
                                               "weights (a learner's max_staleness: it could not be trained)")
    training: bool = True
    start_position: int = Field(0, ge=0, description="skip prompt slots before this stream position")
    skip_positions: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, max_length=1_000_000,
        description="stream positions at or after start_position a resumed learner has settled already")
    admission: Literal["window", "version_order", "requeue"] = Field(
        "window", description="the learner's admission rule; requeue lets acks re-queue a dropped position once")
    shard: int = Field(0, ge=0, description="this service's share of the prompt stream (0-based)")
    num_shards: int = Field(1, ge=1, le=100_000, description="services sharing one prompt stream")


class AckRequest(_Strict):
    ids: list[str] = Field(default_factory=list, max_length=100_000)
    dropped: list[str] = Field(default_factory=list, max_length=100_000)
    requeue: list[str] = Field(default_factory=list, max_length=100_000,
                               description="dropped, and their position rolled out once more (admission requeue)")


class WeightsRequest(_Strict):
    version: int = Field(ge=0)
    uri: str = Field(min_length=1, description="checkpoint directory or s3:// prefix (published with a manifest)")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the checkpoint's manifest.json")


class ShutdownRequest(_Strict):
    grace_s: float = Field(30.0, ge=0, le=3600)


class GenerateRequest(_Strict):
    prompts: list[list[dict[str, Any]] | list[int]] = Field(min_length=1, max_length=10_000,
                                                          description="chat messages or token ids per prompt")
    n: int = Field(1, ge=1, le=1024)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(256, ge=1, le=1_000_000)
    seed: int | None = None


def create_app(manager: RolloutManager, on_shutdown=None) -> FastAPI:
    """The FastAPI application around a manager. `on_shutdown()` is called after a graceful shutdown."""
    from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

    app = FastAPI(title="SAO rollout service", version="1")
    shutdown_tasks: set[asyncio.Task] = set()
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

    @app.exception_handler(ConflictError)
    async def _conflict(_: Request, err: ConflictError):
        return JSONResponse(status_code=409, content={"detail": str(err)})

    @app.exception_handler(RolloutError)
    async def _bad(_: Request, err: RolloutError):
        return JSONResponse(status_code=400, content={"detail": str(err)})

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True, "version": manager.engine.version}

    @app.get("/v1/status")
    async def status() -> dict:
        return manager.status()

    @app.post("/v1/rollouts/start")
    async def start(plan: PlanRequest) -> dict:
        return manager.start(RolloutPlan(**plan.model_dump()))

    @app.post("/v1/rollouts/stop")
    async def stop() -> dict:
        await manager.stop()
        return manager.status()

    @app.get("/v1/trajectories")
    async def take(consumer: str = Query(min_length=1, max_length=200),
                   max: int = Query(1, ge=1, le=10_000),  # noqa: A002 - the wire name
                   wait_s: float = Query(0.0, ge=0, le=300),
                   reconnect: bool = False) -> dict:
        redelivered = manager.reconnect(consumer) if reconnect else 0
        items = await manager.take(consumer, max, wait_s)
        return {"trajectories": [t.to_dict() for t in items], "redelivered": redelivered,
                "version": manager.engine.version, "plan_done": manager.plan_done and not manager.status()["ready"]}

    @app.post("/v1/trajectories/ack")
    async def ack(body: AckRequest) -> dict:
        return manager.ack(body.ids, body.dropped, body.requeue)

    @app.post("/v1/weights")
    async def weights(body: WeightsRequest) -> dict:
        return await manager.update_weights(body.version, body.uri, body.sha256)

    @app.post("/v1/pause")
    async def pause() -> dict:
        await manager.pause()
        return {"paused": True}

    @app.post("/v1/resume")
    async def resume() -> dict:
        await manager.resume()
        return {"paused": False}

    @app.post("/v1/shutdown")
    async def shutdown(body: ShutdownRequest | None = None) -> dict:
        grace = body.grace_s if body else 30.0

        async def finish():
            log.info("shutdown requested: running episodes get %.0f s to finish", grace)
            try:
                await manager.shutdown(grace)
                log.info("rollout service stopped; exiting")
            except Exception:  # the process must still exit, or its TrainJob never ends
                log.exception("graceful shutdown failed; exiting anyway")
            finally:
                if on_shutdown is not None:
                    on_shutdown()

        # The loop keeps only a weak reference to a task: without this one it can be collected mid-shutdown.
        task = asyncio.get_running_loop().create_task(finish())
        shutdown_tasks.add(task)
        task.add_done_callback(shutdown_tasks.discard)
        return {"shutting_down": True, "grace_s": grace}

    @app.post("/v1/generate")
    async def generate(body: GenerateRequest) -> dict:
        params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                max_new_tokens=body.max_new_tokens, seed=body.seed)
        tokenizer = manager.tokenizer
        from sao_core.rollout.episode import prompt_tokens

        prompt_ids = []
        for i, prompt in enumerate(body.prompts):
            if prompt and all(isinstance(x, int) for x in prompt):
                if any(x < 0 or x >= len(tokenizer) for x in prompt):
                    raise RolloutError(f"prompts[{i}]: token id out of range [0, {len(tokenizer)})")
                prompt_ids.append(list(prompt))
            else:
                try:
                    prompt_ids.append(prompt_tokens(tokenizer, prompt))
                except Exception as err:
                    raise RolloutError(f"prompts[{i}]: not valid chat messages ({err})") from err
        jobs = []
        for i, ids in enumerate(prompt_ids):
            for k in range(body.n):
                seeded = params if body.seed is None else SamplingParams(**{**params.__dict__,
                                                                           "seed": body.seed + i * body.n + k})
                jobs.append(manager.engine.generate(ids, seeded))
        results = await asyncio.gather(*jobs)
        out = []
        for i in range(len(prompt_ids)):
            samples = results[i * body.n:(i + 1) * body.n]
            out.append([{"text": tokenizer.decode(g.token_ids, skip_special_tokens=True), "token_ids": g.token_ids,
                         "logprobs": g.logprobs, "finish_reason": g.finish_reason, "version": g.versions[-1]
                         if g.versions else manager.engine.version} for g in samples])
        return {"results": out}

    @app.get("/metrics")
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

    return app
