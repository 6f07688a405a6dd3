"""Connection-level limits of the rollout service's HTTP server: what an unauthenticated sender can make the
server spend before any endpoint (or the bearer-token check) runs.

uvicorn's h11 protocol, extended (`limited_protocol`) with:

- a header-size limit: a request whose head (request line + headers) passes `max_header_bytes` before it is
  complete gets 431 and the connection is closed (uvicorn's default parser had no limit: a 64 MiB header cost
  seconds of CPU before the 401);
- a header read timeout: a connection that has not completed a request head within `header_timeout_s` of its
  first byte (or of the end of its previous response) gets 408 and is closed (slow-header connections);
- a body read timeout: a request whose body has not fully arrived `body_timeout_s` after its head is cut off;
- the header count (`max_headers`) is checked by `HeaderCount` (ASGI middleware, 431).

uvicorn's own settings give the rest: `timeout_keep_alive` closes idle keep-alive connections, and
`limit_concurrency` answers 503 above that many open connections and tasks.

`LimitedServer` serves any ASGI app this way on a thread of its own (one event loop for all connections, so
open connections cost no thread each): the learner's Prometheus port uses it with `METRICS_LIMITS`.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass

import h11
import uvicorn
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class HttpLimits:
    """The limits, as `ServeConfig` defines them (names, defaults, help): units in the names."""

    max_header_bytes: int
    max_headers: int
    header_timeout_s: float
    body_timeout_s: float
    keep_alive_s: float
    max_connections: int


# The defaults of ServeConfig's connection limits (sao_core/rollout/server.py), for servers that have no
# settings of their own.
DEFAULT_MAX_HEADER_BYTES = 65536
DEFAULT_MAX_HEADERS = 100
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_KEEP_ALIVE_S = 5.0

#: the learner's Prometheus port (`sao_core.training.live.PrometheusSink`): the rollout service's head limits
#: and timeouts; a scrape is a bodiless GET, so a body gets the head's timeout; and a small connection cap,
#: as a few scrapers each hold one connection (above it: 503; a learner's file descriptors are for its run).
METRICS_LIMITS = HttpLimits(max_header_bytes=DEFAULT_MAX_HEADER_BYTES, max_headers=DEFAULT_MAX_HEADERS,
                            header_timeout_s=DEFAULT_HEADER_TIMEOUT_S, body_timeout_s=DEFAULT_HEADER_TIMEOUT_S,
                            keep_alive_s=DEFAULT_KEEP_ALIVE_S, max_connections=64)


def limited_protocol(limits: HttpLimits) -> type[H11Protocol]:
    """An h11 protocol class for uvicorn (`uvicorn.Config(http=...)`) that enforces `limits`."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head size limit and head / body read timeouts. Use the subclass
    `limited_protocol(limits)` makes: uvicorn builds the protocol itself, so the limits are a class attribute."""

    limits: HttpLimits

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # h11's own bound must not fire first (it answers a bare 400): ours is checked after each chunk.
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes + (1 << 20))
        self._head_bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_phase: str | None = None

    def connection_made(self, transport):
        super().connection_made(transport)
        self._arm("head")

    def connection_lost(self, exc):
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        waiting_for_head = self.conn.their_state is h11.IDLE
        if waiting_for_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:          # the head is still incomplete
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(431, f"request head above {self.limits.max_header_bytes} bytes")
                return
            self._arm("head")
        else:
            self._head_bytes = 0
            if state is h11.SEND_BODY:
                self._arm("body")
            else:
                self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The next request's head is timed from the end of this response (uvicorn's keep-alive timer
        # closes the connection earlier if nothing at all arrives).
        self._head_bytes = 0
        if not self.transport.is_closing():
            self._arm("head")

    # ---------------------------------------------------------------- timers
    def _arm(self, phase: str) -> None:
        if self._timer is not None and self._timer_phase == phase:
            return
        self._disarm()
        delay = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
        self._timer = self.loop.call_later(delay, self._expired, phase)
        self._timer_phase = phase

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_phase = None, None

    def _expired(self, phase: str) -> None:
        self._timer, self._timer_phase = None, None
        if self.transport.is_closing():
            return
        if phase == "head" and self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
            if self._head_bytes:
                self._refuse(408, f"request head not received within {self.limits.header_timeout_s} s")
            else:
                self.transport.close()
        elif phase == "body" and self.conn.their_state is h11.SEND_BODY:
            self.transport.close()   # the app sees a disconnect

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
        body = message.encode()
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % (status, reason, len(body)))
        self.transport.write(head + body)
        self.transport.close()


class HeaderCount:
    """ASGI middleware: 431 for a request with more than `max_headers` header fields."""

    def __init__(self, app, max_headers: int):
        self.app = app
        self.max_headers = max_headers

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and len(scope.get("headers", ())) > self.max_headers:
            return await JSONResponse({"detail": f"more than {self.max_headers} header fields"}, status_code=431,
                                      headers={"Connection": "close"})(scope, receive, send)
        await self.app(scope, receive, send)


# ------------------------------------------------------------------------------ a limited server on a thread

#: seconds a `LimitedServer` gives open requests once told to stop (its connections are then closed)
STOP_DRAIN_S = 2.0


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and listening (port 0: a free one). OSError when the port is taken,
    raised here, in the caller's thread, not later in the server's."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # A restarted process can take its port again while old connections linger in TIME_WAIT; a port another
        # socket listens on still fails.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


class LimitedServer:
    """An ASGI app served by uvicorn under `limits` (`limited_protocol`, `HeaderCount`, keep-alive and
    connection cap) on one daemon thread: however many connections are open, it costs that one thread.

    `start()` binds the port first (OSError when taken) and returns once the server accepts connections;
    `stop()` ends it (open requests get `STOP_DRAIN_S` seconds)."""

    def __init__(self, app, host: str, port: int, limits: HttpLimits, name: str = "limited-http"):
        self.app = HeaderCount(app, limits.max_headers)
        self.host, self.limits, self.name = host, limits, name
        self._socket = listening_socket(host, port)
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(self.app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                http=limited_protocol(limits), timeout_keep_alive=limits.keep_alive_s,
                                limit_concurrency=limits.max_connections, timeout_graceful_shutdown=STOP_DRAIN_S)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._socket]))
        except BaseException as err:  # noqa: BLE001  (surfaced by start())
            self._error = err

    def start(self, timeout_s: float = 30.0) -> LimitedServer:
        """Serve on a new thread; return once it accepts connections (RuntimeError when it failed to start)."""
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._error is not None or not self._thread.is_alive():
                self._socket.close()
                raise RuntimeError(f"{self.name} on {self.host}:{self.port} failed to start: {self._error}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} on {self.host}:{self.port} did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and wait (at most `timeout_s` seconds) for the thread to end."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._socket.close()
