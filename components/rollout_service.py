"""rollout_service: a standalone rollout service (engine + environments over HTTP) until shut down.

Calls :func:`sao_core.rollout.server.serve`. The task runs until a client sends
``POST /v1/shutdown`` (or the pod is deleted). Learners reach it with ``services=["http://HOST:PORT"]``;
KFP 2.17 has no Service primitive, so in a cluster expose the pod with a Kubernetes Service (or use
the colocated service of ``sao_train`` / ``grpo_train``, or the multi-node TrainJob). With ``plan``
the service starts rolling out at once (RolloutPlan fields: dataset, rollouts_per_prompt,
max_in_flight, ...). On 0.0.0.0 it needs a bearer token: give the task the Secret as
``$SAO_ROLLOUT_TOKEN`` (``kubernetes.use_secret_as_env``) or ``$SAO_ROLLOUT_TOKEN_FILE`` (README "Security
model"); it loads no weights (no allowed_weight_roots).
"""

from typing import Optional

from kfp import dsl

from sao_core.images import image


@dsl.component(base_image=image("rollout"), install_kfp_package=False)
def rollout_service(
    model: str = "embedded:tiny",
    engine: str = "vllm",
    host: str = "0.0.0.0",
    port: int = 8000,
    max_batch: int = 32,
    lease_seconds: float = 600.0,
    seed: int = 0,
    engine_options: Optional[dict] = None,  # noqa: UP045 (KFP reads typing.Optional, not X | None)
    plan: Optional[dict] = None,  # noqa: UP045 (KFP reads typing.Optional, not X | None)
):
    """Serve rollouts over HTTP until POST /v1/shutdown.

    Args:
        model: Model reference: embedded:tiny, a directory, an s3:// checkpoint or a hub id.
        engine: vllm (GPU) or hf (transformers).
        host: Address to listen on (0.0.0.0: every interface of the pod).
        port: TCP port.
        max_batch: hf engine: sequences per forward pass.
        lease_seconds: Taken but unacknowledged trajectories are handed out again after this long.
        seed: Sampling seed.
        engine_options: Extra engine settings, e.g. {"gpu_memory_utilization": 0.8, "max_model_len": 32768}.
        plan: Start this rollout plan at once (RolloutPlan fields; 'dataset' is a prepared rl dataset URI).
    """
    from sao_core.config import build_config
    from sao_core.kfp import artifacts
    from sao_core.rollout.manager import RolloutPlan
    from sao_core.rollout.server import ServeConfig, serve

    config = build_config(ServeConfig, {
        "model": model, "engine": engine, "host": host, "port": port, "max_batch": max_batch,
        "lease_seconds": lease_seconds, "seed": seed, "engine_options": engine_options or {},
        "cache_dir": artifacts.cache_dir()}, source="rollout_service")
    rollout_plan = build_config(RolloutPlan, plan, source="rollout_service plan") if plan else None
    if rollout_plan is not None:
        rollout_plan.validate()
    serve(config, rollout_plan)
