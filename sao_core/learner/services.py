"""The learner's view of its rollout services (one or several replicas): connect with a plan, take finished
trajectories from every live one in turn, acknowledge, push weights to all and check each serves the learner's
own version and digest; a service that stops answering is dropped with a warning, probed, and rejoins with the
current weights and its owed positions. Only when every service is down does the learner wait (up to
`retry_s`, then LearnerError)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from sao_core.learner.delivery import Probe, compare
from sao_core.learner.errors import LearnerError
from sao_core.rollout.client import RolloutAuthError, RolloutClient, RolloutRequestError, RolloutUnavailable
from sao_core.rollout.manager import RolloutError
from sao_core.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)


class ServiceSet:
    """The rollout services (replicas) of a run.

    Trajectories are taken from every live service in turn (round robin). Service i rolls out shard i of
    the prompt stream, so no two services roll out the same prompt. A service that stops answering is
    dropped from the set with a warning and the run goes on with the others; it is probed again every
    `probe_s` seconds and, once back, re-synced (current weights pushed, the plan restarted after the
    last trained stream position if it lost it, acknowledgements that failed while it was away re-sent)
    and rejoins. Only when every service is down does the learner wait, up to `retry_s`, then fail.

    `plan_for(index, num_shards)` gives the stream fields of a plan (re)started on service `index` (the owed
    positions of its shard, from the ledger); `on_restart(index)` is told first when a service had lost its plan,
    so what it delivered earlier and was not trained is rolled out again rather than held twice (and episodes
    lost after some of their fragments were trained are settled, not rolled out again). `on_plan(index,
    num_shards, stream)` is told after a service accepted a plan with those stream fields (the learner journals
    it, so `journal.audit` can prove every owed position was covered by a plan actually sent).

    Weights: after every push each service must answer with the learner's own version and digest, or the
    run stops (LearnerError naming the service): a service whose weights are not the learner's would hand
    out trajectories of another policy. A push is a plain "next version" update for a service known to
    hold the previous one, and a resync otherwise (a rejoining service, the first push after a resume).
    With a delivery probe (`push(..., probe)`), each service must then score the probe as the learner does
    (`learner/delivery.py`), or the run stops naming it; `delivery` holds the worst difference of the last push.
    `token`: the run's bearer token, sent with every request.

    `channel` (weight_transport collective): full weights reach the services over a collective weight channel
    (`sao_core.rollout.channel`), formed at the first push with every service (waited for up to `retry_s`). Each
    push is one step of the group: every service checks the announced tensors (receive), the learner
    broadcasts, every service applies and answers (commit). A service lost after the group formed (unreachable,
    restarted: it refuses the receive or the commit, or the broadcast fails) closes the group and is marked down
    like any service; the next push (or the retry of this one, once per push) forms a new group with every
    service, waiting for the missing ones up to `retry_s` (then LearnerError naming them). Every member's first
    update over a new group is a resync, so a restarted service gets the current version; its plan is restarted
    by `_sync` as for the file transport.
    """

    def __init__(self, urls: list[str], consumer: str, plan: dict, retry_s: float, probe_s: float = 2.0,
                 plan_for: Callable[[int, int], dict] | None = None,
                 on_restart: Callable[[int], None] | None = None, token: str | None = None,
                 on_plan: Callable[[int, int, dict], None] | None = None, local: dict[int, Any] | None = None,
                 channel: bool = False, channel_timeout_s: float = 300.0):
        self.clients = [RolloutClient(url, consumer=consumer, token=token) for url in urls]
        # `channel` (weight_transport collective): full weights reach every service by broadcast over a group of
        # their own (sao_core/rollout/channel.py), formed at the first push; `sender` is the learner's end.
        self.channel = channel
        self.channel_timeout_s = channel_timeout_s
        self.sender = None
        self.channel_groups = 0                            # groups formed so far (the first, then re-formed ones)
        # index -> the service object of a service running in this process (`RolloutServer`): full weights are
        # handed to it in memory (`update_in_memory`) instead of through files and HTTP.
        self.local = dict(local or {})
        self.update = None                                 # the WeightUpdate of `weights` when pushed in memory
        self.holds: dict[int, int] = {}                     # index -> weights version verified on that service
        self.plan = plan
        self.plan_for = plan_for
        self.on_restart = on_restart
        self.on_plan = on_plan
        self.retry_s = retry_s
        self.probe_s = probe_s
        self.down: dict[int, float] = {}                   # index -> monotonic time of the next probe
        self.weights: tuple[int, str, str] | None = None   # version, uri, digest currently wanted
        self.probe: Probe | None = None                    # the delivery probe of that version
        self.delivery: dict[str, float] = {}               # worst {"mean", "max"} difference of the last push
        self.delivery_seconds = 0.0                        # seconds the services took to score the last push's probe
        self.reconnecting: set[int] = set()
        self.unacked: dict[int, tuple[list[str], list[str], list[str]]] = {}  # acks that failed (service down)
        self._next = 0

    @property
    def live(self) -> list[int]:
        return [i for i in range(len(self.clients)) if i not in self.down]

    def live_urls(self) -> list[str]:
        """The URLs of the services that answer now, waiting (up to `retry_s`) while none does."""
        if not self.live:
            self._wait_for_any()
        return [self.clients[i].url for i in self.live]

    def _digest(self, version: int, digest: str | None) -> str:
        """`digest`, or (None) the digest of the in-memory update of `version`, which waits for the sender's
        hash: read it only where it is needed, so the hash runs while a local engine copies."""
        if digest is not None:
            return digest
        if self.update is None or self.update.version != version:
            raise LearnerError(f"weights version {version} has no digest: neither a published manifest nor an "
                               "in-memory update of that version")
        return self.update.digest

    def _push_one(self, index: int, version: int, uri: str, digest: str | None, resync: bool) -> None:
        """Push `version` to service `index` and check its answer (LearnerError unless it now serves it).
        `digest` None: that of the in-memory update (`_digest`)."""
        client = self.clients[index]
        if self.channel and self.update is not None and self.update.version == version:
            self._channel_push(version, digest, self.update)   # a group: all take part
            return
        if index in self.local and self.update is not None and self.update.version == version:
            try:
                answer = self.local[index].update_in_memory(self.update, resync=resync)
            except RolloutError as err:
                raise LearnerError(f"rollout service {client.url} (in this process) refused weights version "
                                   f"{version} handed over in memory: {err}; stopping rather than training on "
                                   "another policy's trajectories") from err
        else:
            answer = self._push_files(index, version, uri, self._digest(version, digest), resync)
        self._check_answer(client.url, answer, version, self._digest(version, digest))
        self._check_delivery(index, version)
        self.holds[index] = version

    def _push_files(self, index: int, version: int, uri: str | None, digest: str, resync: bool) -> dict:
        """POST /v1/weights of the published version at `uri` to service `index`: its answer."""
        client = self.clients[index]
        if uri is None:
            raise LearnerError(f"rollout service {client.url} needs weights version {version} from storage, but that "
                               "version was handed over in memory only (weight_transport); no durable copy exists")
        try:
            return client.push_weights(version, uri, digest, resync=resync)
        except RolloutAuthError as err:
            raise LearnerError(f"rollout service {client.url} refused the learner's token ({err}); give the run's "
                               "token (service_token_file, $SAO_ROLLOUT_TOKEN or $SAO_ROLLOUT_TOKEN_FILE)") from err
        except RolloutRequestError as err:
            raise LearnerError(f"rollout service {client.url} refused weights version {version} of this learner: "
                               f"{err}. Its weights are not the learner's (was it given weights by someone else?); "
                               "stopping rather than training on another policy's trajectories") from err

    @staticmethod
    def _check_answer(url: str, answer: dict, version: int, digest: str) -> None:
        """LearnerError unless a service answered a push with the version and digest pushed."""
        if answer.get("version") != version or answer.get("sha256", digest) != digest:
            raise LearnerError(f"rollout service {url} answered weights version {answer.get('version')} "
                               f"(digest {answer.get('sha256')}) to the learner's push of version {version} "
                               f"(digest {digest}); its weights are not the learner's, stopping")

    def _check_delivery(self, index: int, version: int) -> None:
        """The service's log-probs of the probe equal the learner's at `version` (LearnerError naming it)."""
        probe = self.probe
        if probe is None or probe.version != version:
            return
        client = self.clients[index]
        began = time.monotonic()
        try:
            answer = client.score(probe.token_ids, probe.start)
        except RolloutRequestError as err:
            raise LearnerError(f"delivery check: rollout service {client.url} could not score the probe: {err}") from err
        found = compare(answer, probe, client.url)
        self.delivery_seconds += time.monotonic() - began
        for key, value in found.items():
            self.delivery[key] = max(self.delivery.get(key, 0.0), value)

    def _sync(self, index: int) -> None:
        client = self.clients[index]
        self.holds.pop(index, None)
        try:
            status = client.status()
        except RolloutAuthError as err:
            raise LearnerError(f"rollout service {client.url} refused the learner's token ({err}); give the run's "
                               "token (service_token_file, $SAO_ROLLOUT_TOKEN or $SAO_ROLLOUT_TOKEN_FILE)") from err
        if self.weights is not None:
            version, uri, digest = self.weights
            digest = self._digest(version, digest)
            if status["version"] != version or status.get("weights_sha256", digest) != digest:
                self._push_one(index, version, uri, digest, resync=True)
            else:
                self._check_delivery(index, version)
                self.holds[index] = version
        elif status["version"] != 0:
            raise LearnerError(f"rollout service {client.url} serves weights version {status['version']}, but this "
                               "learner has pushed none yet (its policy is version 0): the service holds another "
                               "run's or someone else's weights; restart it")
        else:
            self.holds[index] = 0
        if status.get("plan") is None:
            n = len(self.clients)
            if self.on_restart:   # first: it may settle positions the new plan must then skip
                self.on_restart(index)
            stream = self.plan_for(index, n) if self.plan_for else {}
            client.start({**self.plan, "shard": index, "num_shards": n, **stream})
            if self.on_plan:
                self.on_plan(index, n, stream)
            self.unacked.pop(index, None)   # ids of its previous plan mean nothing to the new one
        else:  # its plan survived (learner restart, network blip): take back what we took but did not ack
            self.reconnecting.add(index)
        ids, gone, again = self.unacked.pop(index, ([], [], []))
        if ids or gone or again:
            client.ack(ids, gone, again)

    # ------------------------------------------------------------------ collective weight channel
    def channel_dtypes(self) -> dict:
        """name -> dtype of the services' engine weights (what the channel sends in), from the first live one."""
        from sao_core.rollout.channel import parse_dtype

        while True:
            self.live_urls()   # waits (up to retry_s) while no service answers
            for index in self.live:
                try:
                    ok, spec = self._try(index, lambda c: c.weight_spec())
                except RolloutRequestError as err:
                    raise LearnerError(f"weight_transport collective: rollout service {self.clients[index].url} "
                                       f"cannot take weights in memory: {err}") from err
                if ok:
                    return {name: parse_dtype(dtype) for name, _, dtype in spec["tensors"]}

    def _lose_channel(self, index: int | None, err: Exception, restarted: bool = False) -> None:
        """A member of the formed group is lost (`index`; None when the broadcast failed and the member is not
        known): the group is closed, so members waiting for a broadcast fail at once, and formed anew with every
        service at the next push (or the retry of this one). What each member applied is no longer known, so every
        member's next update is a resync. The lost service is marked down: `_try` re-syncs it (its plan, if it
        lost it) once it answers."""
        self.close_channel()
        self.holds.clear()
        who = "a member" if index is None else f"service {self.clients[index].url}"
        log.warning("collective weight channel lost %s (%s); the group is re-formed at the next push", who, err)
        if index is None:
            return
        if restarted:   # it answers, but lost its state: re-synced (plan) as soon as it is asked
            self.down[index] = 0.0
        else:
            self._mark_down(index, err)

    def close_channel(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None

    def _wait_for_members(self, deadline: float) -> None:
        """Block until every service answers (a group needs them all), probing every 0.5 s; LearnerError naming
        those still unreachable at `deadline`. A service that was down is left for `_try` to re-sync (its plan,
        if it lost it) after the push over the group gave it the current weights."""
        missing = set(range(len(self.clients)))
        while True:
            for index in sorted(missing):
                try:
                    self.clients[index].status()
                except RolloutUnavailable as err:
                    if index not in self.down:
                        self._mark_down(index, err)
                    continue
                except RolloutAuthError as err:
                    raise LearnerError(f"rollout service {self.clients[index].url} refused the learner's token "
                                       f"({err}); give the run's token (service_token_file, $SAO_ROLLOUT_TOKEN or "
                                       "$SAO_ROLLOUT_TOKEN_FILE)") from err
                missing.discard(index)
                if index in self.down:
                    self.down[index] = 0.0   # back: re-synced when next asked
            if not missing:
                return
            if time.monotonic() > deadline:
                raise LearnerError("collective weight channel: rollout services unreachable for "
                                   f"{self.retry_s:.0f} s: " + ", ".join(self.clients[i].url for i in sorted(missing)))
            time.sleep(0.5)

    def _form_channel(self, deadline: float | None = None) -> None:
        """Form the group: this learner (rank 0, the TCPStore master) and every service (rank index + 1). Every
        service must answer: those that do not are waited for until `deadline` (default: `retry_s` from now),
        then LearnerError. A service already in an earlier group leaves it to join this one."""
        import threading

        from sao_core.rollout.channel import Sender, advertised_host

        self._wait_for_members(time.monotonic() + self.retry_s if deadline is None else deadline)
        n, timeout = len(self.clients), self.channel_timeout_s
        host = advertised_host(self.clients[0].url)
        try:
            sender = Sender(n + 1, host, timeout_s=timeout)
        except (RuntimeError, OSError) as err:
            raise LearnerError(f"collective weight channel: cannot listen on {host}: {err}") from err
        outcome: dict[int, Any] = {}

        def run(key: int, fn: Callable[[], Any]) -> None:
            try:
                outcome[key] = (True, fn())
            except BaseException as err:   # read below
                outcome[key] = (False, err)

        # Each join returns only once the whole group formed: every service is told at once, in threads (daemon:
        # a refused join leaves the others waiting until `timeout`, never the process's exit).
        threads = [threading.Thread(target=run, args=(-1, sender.form), daemon=True)]
        threads += [threading.Thread(target=run, args=(i, lambda c=c, i=i: c.join_channel(host, sender.port, i + 1,
                                                                                          n + 1, timeout)),
                                     daemon=True) for i, c in enumerate(self.clients)]
        for thread in threads:
            thread.start()
        for index, thread in enumerate(threads[1:]):
            thread.join()
            ok, value = outcome[index]
            if not ok:
                sender.close()
                if isinstance(value, RolloutUnavailable):
                    raise LearnerError(f"collective weight channel: rollout service {self.clients[index].url} "
                                       f"unreachable ({value})") from value
                raise LearnerError(f"collective weight channel: rollout service {self.clients[index].url} could not "
                                   f"join: {value}; restart with weight_transport files or auto") from value
        threads[0].join()
        ok, value = outcome[-1]
        if not ok:
            raise LearnerError(f"collective weight channel: the group did not form: {value}") from value
        self.sender = sender
        self.channel_groups += 1
        log.info("collective weight channel %s on %s:%d with %d services",
                 "formed" if self.channel_groups == 1 else "re-formed", host, sender.port, n)

    def _channel_push(self, version: int, digest: str | None, update) -> None:
        """`version` to every service over the channel (formed first if it is not); `digest` None: the update's,
        read after the broadcast (the sender hashes while it sends). A member lost on the way
        (unreachable, restarted, or the broadcast failed) closes the group: it is re-formed once, its services
        waited for until `retry_s` after this push began, and the push retried over it; lost again: LearnerError."""
        deadline = time.monotonic() + self.retry_s
        for _ in range(2):
            if self.sender is None:
                self._form_channel(deadline)
            lost = self._channel_step(version, digest, update)
            if lost is None:
                return
            index, err, restarted = lost
            self._lose_channel(index, err, restarted)
        who = "a member" if index is None else f"service {self.clients[index].url}"
        raise LearnerError(f"collective weight channel lost {who} again ({err}) while pushing weights version "
                           f"{version} over a re-formed group; stopping (weight_transport files or auto take a "
                           "service that comes and goes)")

    def _channel_step(self, version: int, digest: str | None, update) -> tuple[int | None, Exception, bool] | None:
        """One push over the formed group: each service checks the announced tensors and gets ready (receive), the
        learner broadcasts, each applies and answers with the digest it recomputed (commit), then the delivery
        probe. `digest` None: the update's, read once the broadcast is done (its hash runs meanwhile) and given
        with the commit. None when done; (index of the lost member or None, the error, whether it restarted) when
        a member was lost. LearnerError when a service refuses the weights (not a lost member: another policy's)."""
        from sao_core.rollout.channel import update_spec

        spec = update_spec(update)
        for index, client in enumerate(self.clients):
            try:
                client.receive_weights(version, digest, spec, resync=self.holds.get(index) != version - 1,
                                       bucket_bytes=self.sender.bucket_bytes)
            except RolloutUnavailable as err:
                return index, err, False
            except RolloutRequestError as err:
                if "joined no weight channel" in str(err):   # it restarted since the group formed
                    return index, err, True
                self.close_channel()   # the services already waiting for the broadcast fail at once
                raise LearnerError(f"rollout service {client.url} refused weights version {version} over the "
                                   f"collective weight channel: {err}; stopping rather than training on another "
                                   "policy's trajectories") from err
        try:
            self.sender.broadcast(update)
        except RuntimeError as err:
            return None, err, False
        announced, digest = digest, self._digest(version, digest)
        for index, client in enumerate(self.clients):
            try:
                answer = client.commit_weights(version, None if announced is not None else digest)
            except RolloutUnavailable as err:
                return index, err, False
            except RolloutRequestError as err:
                if "no receive of version" in str(err):   # it restarted since its receive started
                    return index, err, True
                raise LearnerError(f"rollout service {client.url} refused weights version {version} received over "
                                   f"the collective weight channel: {err}; stopping rather than training on another "
                                   "policy's trajectories") from err
            self._check_answer(client.url, answer, version, digest)
            self.holds[index] = version
        for index in range(len(self.clients)):
            try:
                self._check_delivery(index, version)
            except RolloutUnavailable as err:
                return index, err, False
        return None

    def _mark_down(self, index: int, err: Exception) -> None:
        if self.sender is not None:   # a formed group needs every member: closed (and this one marked down)
            self._lose_channel(index, err)
            return
        if index not in self.down:
            others = len(self.live) - 1
            log.warning("rollout service %s unreachable (%s); %s", self.clients[index].url, err,
                        f"continuing with the other {others}" if others else "waiting for it")
        self.down[index] = time.monotonic() + self.probe_s

    def _try(self, index: int, fn: Callable[[RolloutClient], Any]) -> tuple[bool, Any]:
        """(True, fn(client)) if the service answers; (False, None) if it is down (marked, probed later)."""
        if index in self.down:
            if time.monotonic() < self.down[index]:
                return False, None
            try:
                self._sync(index)
            except RolloutUnavailable as err:
                self._mark_down(index, err)
                return False, None
            del self.down[index]
            log.info("rollout service %s is back; re-synced weights and plan", self.clients[index].url)
        try:
            return True, fn(self.clients[index])
        except RolloutUnavailable as err:
            self._mark_down(index, err)
            return False, None

    def _wait_for_any(self) -> None:
        """Block while every service is down, probing them; LearnerError after `retry_s`."""
        deadline = time.monotonic() + self.retry_s
        delay = 0.5
        while not self.live:
            for index in list(self.down):
                self.down[index] = 0.0  # probe now
                self._try(index, lambda c: None)
            if self.live:
                return
            if time.monotonic() > deadline:
                raise LearnerError(f"no rollout service reachable for {self.retry_s:.0f} s: "
                                   + ", ".join(c.url for c in self.clients))
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _each(self, fn: Callable[[RolloutClient], Any]) -> None:
        """`fn` on every service; the down ones are caught up by `_sync` when they rejoin."""
        for index in range(len(self.clients)):
            self._try(index, fn)
        if not self.live:
            self._wait_for_any()

    def connect(self) -> None:
        for index in range(len(self.clients)):
            self._try(index, lambda c, index=index: self._sync(index))
        if not self.live:
            self._wait_for_any()

    def take(self, wanted: int, wait_s: float) -> list[tuple[Trajectory, int]]:
        """Up to `wanted` trajectories, asking the live services in turn (round robin)."""
        out: list[tuple[Trajectory, int]] = []
        for _ in range(len(self.clients)):
            index = self._next
            self._next = (self._next + 1) % len(self.clients)
            need = max(1, wanted - len(out))
            again = index in self.reconnecting
            ok, answer = self._try(index, lambda c, need=need, again=again: c.take(
                max_items=need, wait_s=wait_s / max(1, len(self.live)), reconnect=again))
            if not ok:
                continue
            self.reconnecting.discard(index)
            out += [(t, index) for t in answer[0]]
            if len(out) >= wanted:
                break
        if not self.live:
            self._wait_for_any()
        return out

    def ack(self, by_service: dict[int, list[str]], dropped: dict[int, list[str]] | None = None,
            requeue: dict[int, list[str]] | None = None) -> None:
        dropped, requeue = dropped or {}, requeue or {}
        for index in set(by_service) | set(dropped) | set(requeue):
            ids, gone, again = by_service.get(index, []), dropped.get(index, []), requeue.get(index, [])
            ok, _ = self._try(index, lambda c, ids=ids, gone=gone, again=again: c.ack(ids, gone, again))
            if not ok:
                old_ids, old_gone, old_again = self.unacked.setdefault(index, ([], [], []))
                old_ids += ids
                old_gone += gone
                old_again += again

    def oldest_unfinished_version(self) -> tuple[bool, int | None]:
        """(True, the oldest admission version of an episode still running or not yet taken on any live
        service, None if there is none), or (False, None) when a service did not answer (ask again)."""
        oldest: list[int] = []
        for index in self.live:
            ok, status = self._try(index, lambda c: c.status())
            if not ok:
                return False, None
            if status.get("oldest_unfinished_version") is not None:
                oldest.append(status["oldest_unfinished_version"])
        return True, min(oldest, default=None)

    def push(self, version: int, uri: str | None, digest: str | None, probe: Probe | None = None,
             update=None) -> None:
        """Every live service loads `version`, confirms it and passes the delivery `probe` (LearnerError naming a
        service that does not). `update` (a `WeightUpdate`): the weights in memory, handed to the services in
        this process (`local`); its digest is `digest`, or with None read from it once needed (after a local
        engine's copy, which runs while the sender hashes); `uri` (None when there is no durable copy): where
        the others load them from."""
        self.weights = (version, uri, digest)
        self.update = update
        self.probe = probe
        self.delivery = {}
        self.delivery_seconds = 0.0
        if self.channel and update is not None:
            self._channel_push(version, digest, update)
            return
        def push_one(index: int) -> None:
            held = self.holds.get(index)
            if held != version:   # (a service that just rejoined was given `version` by its re-sync)
                self._push_one(index, version, uri, digest, resync=held != version - 1)

        for index in range(len(self.clients)):
            self._try(index, lambda c, index=index: push_one(index))
        if not self.live:
            self._wait_for_any()

    def pause(self) -> None:
        self._each(lambda c: c.pause())

    def resume(self) -> None:
        self._each(lambda c: c.resume())

    def idle_share(self) -> float:
        shares = []
        for i in self.live:
            try:
                shares.append(1.0 - self.clients[i].status()["engine"].get("busy_share", 0.0))
            except (RolloutUnavailable, RolloutRequestError, KeyError):
                continue
        return sum(shares) / len(shares) if shares else 0.0

    def stop(self, shutdown: bool = False) -> None:
        """Stop the plans (and, with `shutdown`, the service processes); unreachable services are skipped."""
        self.close_channel()
        for client in self.clients:
            try:
                client.stop()
            except (RolloutUnavailable, RolloutRequestError) as err:
                log.warning("could not stop the plan of rollout service %s: %s", client.url, err)
            if shutdown:
                # Tried even when stop failed: a replica left running keeps its TrainJob from ending.
                log.info("shutting rollout service %s down", client.url)
                try:
                    client.shutdown()
                except (RolloutUnavailable, RolloutRequestError) as err:
                    log.warning("could not shut rollout service %s down: %s", client.url, err)
            client.close()
