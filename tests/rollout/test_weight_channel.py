"""The collective weight channel (sao_core/rollout/channel.py): full weights from a learner to a rollout service in
another process (`sao rollout serve`) over a gloo group of their own, controlled through the service's
authenticated HTTP API (POST /v1/weights/channel, /receive, /commit). Real processes; nothing here waits on a
clock (the group's timeouts are only a bound for a hang)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from rl_data import tool_arith_rl

from sao_core import storage
from sao_core.learner.config import RLConfig
from sao_core.learner.errors import LearnerError
from sao_core.learner.loop import train_rl
from sao_core.learner.services import ServiceSet
from sao_core.models import load_model
from sao_core.rollout import channel as channel_mod
from sao_core.rollout.client import RolloutAuthError, RolloutClient, RolloutRequestError
from sao_core.rollout.weights import WeightUpdate, WeightUpdateError

TOKEN = "channel-test-token-0123456789"
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """`sao rollout serve` of the embedded model in a process of its own, with the test's token."""

    def __init__(self, cache: Path, log: Path, port: int | None = None):
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "SAO_ROLLOUT_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sao_core.cli", "--quiet", "--threads", "1", "--log-level", "WARNING",
             "--cache-dir", str(cache), "rollout", "serve", "--model", "embedded:tiny", "--port", str(self.port),
             "--max-batch", "8"], cwd=str(ROOT), env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
            start_new_session=True)
        deadline = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(self.url + "/healthz", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the rollout service did not start"
            time.sleep(0.2)

    def client(self, token: str | None = TOKEN) -> RolloutClient:
        return RolloutClient(self.url, token=token)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture(scope="module")
def service(sao_cache, tiny_model_dir, tmp_path_factory):
    server = Service(sao_cache, tmp_path_factory.mktemp("channel") / "service.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def learner_model(tiny_model_dir, sao_cache):
    return load_model(tiny_model_dir, sao_cache, "float32")


def _services(service) -> ServiceSet:
    return ServiceSet([service.url], "test", {}, retry_s=30, token=TOKEN, channel=True, channel_timeout_s=60)


def _moved(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=generator))


def _next_update(service, services, model, seed: int) -> WeightUpdate:
    _moved(model, seed)
    version = service.client().status()["version"] + 1
    return WeightUpdate.build(version, model.state_dict(), services.channel_dtypes())


@contextlib.contextmanager
def _formed_channel(service, model, seed: int):
    """(the service set, the next update of `model`, its wire spec) with the channel to `service` formed; closed
    at the end."""
    services = _services(service)
    try:
        update = _next_update(service, services, model, seed=seed)
        services._form_channel()
        yield services, update, channel_mod.update_spec(update)
    finally:
        services.close_channel()


def _logprobs(model, ids: list[int], start: int) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, start - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[start:]).unsqueeze(1)).squeeze(1).tolist()


def test_a_push_through_the_channel_lands_in_the_other_process(service, learner_model):
    services = _services(service)
    try:
        dtypes = services.channel_dtypes()
        assert set(dtypes.values()) == {torch.float32}
        update = _next_update(service, services, learner_model, seed=1)
        services.push(update.version, None, update.digest, None, update)
        status = service.client().status()
        assert status["version"] == update.version and status["weights_sha256"] == update.digest
        ids = [1, 5, 9, 17, 33, 2, 8, 40]
        scored = service.client().score(ids, 2)
        assert scored["version"] == update.version
        assert max(abs(a - b) for a, b in zip(scored["logprobs"], _logprobs(learner_model, ids, 2),
                                              strict=True)) < 1e-5
        # A second version over the same group, as the next plain update.
        second = _next_update(service, services, learner_model, seed=2)
        services.push(second.version, None, second.digest, None, second)
        assert service.client().status()["version"] == second.version
    finally:
        services.close_channel()


def test_a_tensor_corrupted_on_the_way_is_refused_naming_the_service(service, learner_model, monkeypatch):
    broadcast = channel_mod.Sender.broadcast

    def corrupting(self, update):
        name, tensor = update.tensors[-1]
        bad = WeightUpdate(update.version, update.tensors[:-1] + ((name, tensor.clone() + 1.0),), update.dtypes,
                           digest=update.digest)   # the sender's digest of the true tensors
        return broadcast(self, bad)

    services = _services(service)
    try:
        update = _next_update(service, services, learner_model, seed=3)
        monkeypatch.setattr(channel_mod.Sender, "broadcast", corrupting)
        with pytest.raises(LearnerError, match=rf"rollout service {service.url} refused weights version "
                                               rf"{update.version} received over the collective weight channel: "
                                               r".*-> 400: .*did not arrive intact"):
            services.push(update.version, None, update.digest, None, update)
        monkeypatch.setattr(channel_mod.Sender, "broadcast", broadcast)
        # The engine refuses to serve the mixture until good weights arrive: the next push (a resync) repairs it.
        with pytest.raises(RolloutRequestError, match="unusable"):
            service.client().score([1, 2, 3], 1)
        services.holds.clear()
        good = _next_update(service, services, learner_model, seed=4)
        services.push(good.version, None, good.digest, None, good)
        assert service.client().status()["version"] == good.version
        service.client().score([1, 2, 3], 1)
    finally:
        services.close_channel()


def test_bad_announcements_are_refused_before_anything_is_broadcast(service, learner_model):
    client = service.client()
    with _formed_channel(service, learner_model, seed=5) as (services, update, spec):
        with pytest.raises(RolloutRequestError, match=r"-> 400: .*lacks 1 of the model's tensors \(first: "
                                                      rf"{spec[0][0]}\).*nothing was received"):
            client.receive_weights(update.version, update.digest, spec[1:])
        wrong = [[spec[0][0], spec[0][1], "bfloat16"], *spec[1:]]
        with pytest.raises(RolloutRequestError, match=r"-> 400: .* is \(.*\) bfloat16, the model's is .* float32"):
            client.receive_weights(update.version, update.digest, wrong)
        current = client.status()["version"]
        with pytest.raises(RolloutRequestError, match=rf"-> 409: version {current} is not newer"):
            client.receive_weights(current, update.digest, spec)
        with pytest.raises(RolloutRequestError, match="-> 409: no receive of version"):
            client.commit_weights(update.version)
        with pytest.raises(RolloutRequestError, match="-> 422"):
            client.receive_weights(update.version, "sha256:0", spec)
        assert client.status()["version"] == current
        # Nothing was left waiting for a broadcast: the same version goes through at once.
        services.push(update.version, None, update.digest, None, update)
        assert client.status()["version"] == update.version


def test_a_join_replaces_a_group_whose_receive_still_waits():
    """A learner that lost a member closes its group while the others wait for its broadcast, then forms a new one:
    a service's join waits for that receive to fail (at once: the group is closed), drops it and joins."""
    channel = channel_mod.ServiceChannel()
    spec = [("w", (4,), torch.float32)]
    digest = "xxh3-128:" + "0" * 32

    def form_group() -> channel_mod.Sender:
        sender = channel_mod.Sender(2, timeout_s=30)
        joiner = threading.Thread(target=channel.join, args=("127.0.0.1", sender.port, 1, 2, 30.0))
        joiner.start()
        sender.form()
        joiner.join()
        return sender

    first = form_group()
    channel.start(1, False, spec, digest, channel_mod.BUCKET_BYTES)
    first.close()
    second = form_group()
    assert channel.receiver is not None and channel.pending is None and not channel.receiving()
    with pytest.raises(LookupError, match="no receive of version 1"):
        channel.take(1)
    # The new group carries the next update.
    channel.start(2, True, spec, digest, channel_mod.BUCKET_BYTES)
    weights = torch.arange(4.0)
    second.broadcast(WeightUpdate(2, [("w", weights)], [torch.float32], digest=digest))
    resync, thread, outcome = channel.take(2)
    thread.join()
    assert resync and torch.equal(outcome["update"].tensors[0][1], weights)
    second.close()
    channel.leave()


def _joined(channel: channel_mod.ServiceChannel, bucket_bytes: int = channel_mod.BUCKET_BYTES) -> channel_mod.Sender:
    sender = channel_mod.Sender(2, timeout_s=30, bucket_bytes=bucket_bytes)
    joiner = threading.Thread(target=channel.join, args=("127.0.0.1", sender.port, 1, 2, 30.0))
    joiner.start()
    sender.form()
    joiner.join()
    return sender


def test_buckets_in_flight_arrive_intact_in_the_wire_dtype_and_reuse_their_buffers():
    """Several buckets in flight at once (small tensors packed together, big ones alone, one not contiguous), each
    converted to its wire dtype on the way; a second update reuses the sender's staging and the receiver's buffers
    (no fresh memory), and a receive whose commit has not released its buffers gets new ones."""
    bucket_bytes = 64 << 10   # alone from 1 KB
    channel = channel_mod.ServiceChannel()
    sender = _joined(channel, bucket_bytes)
    generator = torch.Generator().manual_seed(0)
    tensors = [(f"w{i}", torch.randn(shape, generator=generator))
               for i, shape in enumerate([(3,), (5, 2), (40, 30), (4,), (7,), (600,)])]
    tensors.append(("t", torch.randn(30, 40, generator=generator).t()))
    dtypes = [torch.bfloat16] * (len(tensors) - 1) + [torch.float32]
    spec = [(name, tuple(t.shape), d) for (name, t), d in zip(tensors, dtypes, strict=True)]
    layout = channel_mod.buckets(spec, bucket_bytes)
    assert len(layout) >= channel_mod.IN_FLIGHT + 2 and any(len(b) > 1 for b in layout)
    digest = "xxh3-128:" + "0" * 32

    def transfer(version: int, bucket_bytes: int) -> dict:
        sender.bucket_bytes = bucket_bytes
        channel.start(version, True, spec, digest, bucket_bytes)
        sender.broadcast(WeightUpdate(version, tensors, dtypes, digest=digest))
        _, thread, outcome = channel.take(version)
        thread.join()
        got = outcome["update"].tensors
        assert [name for name, _ in got] == [name for name, _ in tensors]
        for (_, received), (_, sent), dtype in zip(got, tensors, dtypes, strict=True):
            assert received.dtype == dtype and torch.equal(received, sent.to(dtype))
        return outcome

    def pointers(buffers: dict) -> dict:
        return {dtype: buffer.data_ptr() for dtype, buffer in buffers.items()}

    try:
        first = transfer(1, bucket_bytes)
        staged = [pointers(slot) for slot in sender.staging]
        channel.release(first)
        second = transfer(2, bucket_bytes)
        assert pointers(second["buffers"]) == pointers(first["buffers"])
        assert [pointers(slot) for slot in sender.staging] == staged
        channel.release(second)
        third = transfer(3, 1)   # another layout (one tensor per bucket): the same buffers
        assert pointers(third["buffers"]) == pointers(first["buffers"])
        fourth = transfer(4, bucket_bytes)   # the third's commit has not released its buffers: new ones
        assert not set(pointers(fourth["buffers"]).values()) & set(pointers(first["buffers"]).values())
        channel.release({**third, "error": channel_mod.ChannelError("lost")})   # a failed receive's: not reused
        assert channel.spare is None
        channel.release(fourth)
        assert channel.spare is fourth["buffers"]
    finally:
        sender.close()
        channel.leave()


def test_the_sender_hashes_what_it_broadcasts(monkeypatch):
    """An update nobody hashed yet: the broadcast computes its digest on the way (a packed or converted chunk as it
    is written, a tensor sent as it is while gloo sends it, one not contiguous through its packed copy), the same
    value as `tensors_digest`. A broadcast that fails part-way still leaves the digest, from the tensors, to
    whoever reads it next (a push retried over a re-formed group)."""
    from sao_core.rollout import weights as weights_mod
    from sao_core.rollout.weights import tensors_digest

    monkeypatch.setattr(weights_mod, "CHUNK", 7)   # many chunks per tensor, a partial one at the end
    bucket_bytes = 64 << 10   # alone from 1 KB
    channel = channel_mod.ServiceChannel()
    sender = _joined(channel, bucket_bytes)
    generator = torch.Generator().manual_seed(1)
    tensors = [(f"w{i}", torch.randn(shape, generator=generator))
               for i, shape in enumerate([(3,), (5, 2), (40, 30), (4,), (600,), (50, 30)])]
    tensors.append(("t", torch.randn(30, 40, generator=generator).t()))
    dtypes = [torch.bfloat16] * 5 + [torch.float32] * 2   # w5 goes as it is; t is packed (not contiguous)
    spec = [(name, tuple(t.shape), d) for (name, t), d in zip(tensors, dtypes, strict=True)]
    try:
        channel.start(1, True, spec, None, bucket_bytes)
        update = WeightUpdate(1, tensors, dtypes)
        sender.broadcast(update)
        assert update.digest == tensors_digest(tensors, dtypes)
        _, thread, outcome = channel.take(1)
        thread.join()
        for (_, received), (_, sent), dtype in zip(outcome["tensors"], tensors, dtypes, strict=True):
            assert torch.equal(received, sent.to(dtype))
        channel.release(outcome)

        def failing(target, source):
            raise RuntimeError("packing failed")

        monkeypatch.setattr(channel_mod, "copy_chunks", failing)
        channel.start(2, True, spec, None, bucket_bytes)
        moved = [(name, t + 1.0) for name, t in tensors]
        failed = WeightUpdate(2, moved, dtypes)
        with pytest.raises(RuntimeError, match="packing failed"):
            sender.broadcast(failed)
        assert failed.digest == tensors_digest(moved, dtypes)

        def no_digest(*_):
            raise RuntimeError("digest failed")

        monkeypatch.setattr(channel_mod, "tensors_digest", no_digest)   # the fallback fails too: a reader is told
        unhashed = WeightUpdate(3, moved, dtypes)
        with pytest.raises(RuntimeError, match="packing failed"):
            sender.broadcast(unhashed)
        with pytest.raises(WeightUpdateError, match="v3: the sender's digest failed: digest failed"):
            _ = unhashed.digest
    finally:
        sender.close()   # the receive of version 2 waiting for its first bucket fails at once
        channel.leave()


def test_the_digest_may_come_with_the_commit(service, learner_model):
    """A learner may announce an update without its digest and give it with the commit (it hashes while it
    broadcasts); a commit with no digest at all, or one that contradicts the announced one, is refused and the
    weights stay."""
    client = service.client()
    with _formed_channel(service, learner_model, seed=8) as (services, update, spec):
        current = client.status()["version"]
        client.receive_weights(update.version, None, spec)
        services.sender.broadcast(update)
        with pytest.raises(RolloutRequestError, match=rf"-> 400: .*version {update.version} has no digest: the "
                                                      rf"sender gave it neither .*\(version {current}\) stay"):
            client.commit_weights(update.version)
        client.receive_weights(update.version, update.digest, spec)
        services.sender.broadcast(update)
        with pytest.raises(RolloutRequestError, match=rf"-> 400: .*names digest xxh3-128:0+, the receive announced "
                                                      rf"{update.digest}"):
            client.commit_weights(update.version, "xxh3-128:" + "0" * 32)
        with pytest.raises(RolloutRequestError, match="-> 422"):
            client.commit_weights(update.version, "sha256:0")
        assert client.status()["version"] == current
        client.receive_weights(update.version, None, spec)
        services.sender.broadcast(update)
        answer = client.commit_weights(update.version, update.digest)
        assert answer["version"] == update.version and answer["sha256"] == update.digest
        assert client.status()["weights_sha256"] == update.digest


def test_the_channel_endpoints_need_the_token(service):
    anonymous = service.client(token=None)
    for call in (lambda: anonymous.weight_spec(), lambda: anonymous.join_channel("127.0.0.1", 1, 1, 2),
                 lambda: anonymous.receive_weights(1, "xxh3-128:" + "0" * 32, [["a", [1], "float32"]]),
                 lambda: anonymous.commit_weights(1)):
        with pytest.raises(RolloutAuthError, match="-> 401"):
            call()
    wrong = service.client(token="not-the-token")
    with pytest.raises(RolloutAuthError, match="-> 401"):
        wrong.commit_weights(1)
    services = ServiceSet([service.url], "test", {}, retry_s=1, token="not-the-token", channel=True)
    with pytest.raises(LearnerError, match=rf"rollout service {service.url} refused the learner's token"):
        services._form_channel()
    assert services.sender is None


def test_a_run_pushes_through_the_channel_to_an_external_service(sao_cache, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SAO_ROLLOUT_TOKEN", TOKEN)
    server = Service(sao_cache, tmp_path / "service.log")
    try:
        data = tool_arith_rl(tmp_path / "rl", 60, seed=3)
        out = tmp_path / "run"
        summary = train_rl(RLConfig(data=data, output=str(out), model=tiny_model_dir, steps=3, batch_size=8,
                                    policy_lr=3e-4, critic_lr=3e-4, critic_warmup_steps=1, max_new_tokens_per_turn=12,
                                    max_total_tokens=80, cache_dir=str(sao_cache), services=(server.url,),
                                    weight_transport="collective", service_retry_s=60))
        assert summary["version"] == 2
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        pushed = [r for r in lines if r.get("weight_push_s")]
        assert len(pushed) == 2 and all(r["delivery_logp_diff_mean"] < 1e-4 for r in pushed)
        assert all("durable_wait_s" in r for r in lines)
        status = server.client().status()
        assert status["version"] == 2 and status["weights_sha256"].startswith("xxh3-128:")
        # Durable: only the end's version (publish_every 0), written in the background, verified.
        assert storage.list_dirs(str(out / "weights")) == ["v000002"]
        storage.verify_checkpoint(out / "weights" / "v000002")

        # A service restarted unseen between two pushes refuses the next receive ("joined no weight channel"):
        # the push closes the group, forms a new one and resyncs it (its engine restarted at version 0).
        model = load_model(summary["model"], sao_cache, "float32")
        services = ServiceSet([server.url], "after", {}, retry_s=1, token=TOKEN, channel=True, channel_timeout_s=60)
        dtypes = services.channel_dtypes()
        update = WeightUpdate.build(3, model.state_dict(), dtypes)
        services.push(3, None, update.digest, None, update)
        assert server.client().status()["version"] == 3
        server.stop()
        server = Service(sao_cache, tmp_path / "service-2.log", port=server.port)
        assert server.client().status()["version"] == 0
        _moved(model, seed=6)
        update = WeightUpdate.build(4, model.state_dict(), dtypes)
        services.push(4, None, update.digest, None, update)
        assert services.channel_groups == 2 and server.client().status()["version"] == 4
        # One that does not come back within retry_s stops the push that would re-form the group, naming it.
        server.stop()
        _moved(model, seed=7)
        update = WeightUpdate.build(5, model.state_dict(), dtypes)
        with pytest.raises(LearnerError, match=r"collective weight channel: rollout services unreachable for 1 s: "
                                               rf"{server.url}$"):
            services.push(5, None, update.digest, None, update)
        assert services.sender is None and 0 in services.down
    finally:
        server.stop()


def test_a_restarted_service_rejoins_a_re_formed_channel(sao_cache, tiny_model_dir, tmp_path, monkeypatch, caplog):
    """The service is killed after two steps and restarted on its port: the learner closes the group, waits for it,
    forms a new one, resyncs it to the current version and restarts its plan; the run ends with nothing skipped or
    trained twice."""
    from sao_core.learner.journal import audit

    monkeypatch.setenv("SAO_ROLLOUT_TOKEN", TOKEN)
    caplog.set_level(logging.INFO, logger="sao_core.learner")
    server = Service(sao_cache, tmp_path / "service.log")
    steps_seen: list[int] = []
    result: dict = {}
    data = tool_arith_rl(tmp_path / "rl", 60, seed=4)
    config = RLConfig(data=data, output=str(tmp_path / "run"), model=tiny_model_dir, steps=5, batch_size=8,
                      policy_lr=3e-4, critic_lr=3e-4, critic_warmup_steps=1, max_new_tokens_per_turn=12,
                      max_total_tokens=80, cache_dir=str(sao_cache), services=(server.url,),
                      weight_transport="collective", service_retry_s=120)

    def run():
        try:
            result["summary"] = train_rl(config, progress=lambda step, metrics: steps_seen.append(step))
        except BaseException as err:  # reported by the assertion below
            result["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        while len(steps_seen) < 2 and thread.is_alive():   # bounded by the join below
            time.sleep(0.05)
        server.stop()
        server = Service(sao_cache, tmp_path / "service-2.log", port=server.port)
        thread.join(300)
        assert not thread.is_alive()
        assert "error" not in result, result.get("error")
        assert result["summary"]["steps"] == 5
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert "collective weight channel lost" in messages   # (the service, or "a member" mid-broadcast)
        assert "collective weight channel re-formed" in messages
        status = server.client().status()
        assert status["version"] == result["summary"]["version"] and status["weights_sha256"].startswith("xxh3-128:")
        report = audit(str(tmp_path / "run"))
        assert report["ok"] and not report["skipped"], report["problems"]
    finally:
        server.stop()
