"""The one home of the tests' stand-in HTTP servers (a Kubernetes API, a KFP API, an LLM judge, a rollout
replica, a server that is not KFP): a real server on 127.0.0.1 in a daemon thread that hands every request to
one function and writes back what it returns."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


@dataclass
class Request:
    method: str
    path: str                  # the whole target, query included
    headers: dict[str, str]
    body: bytes

    @property
    def route(self) -> str:
        return urlsplit(self.path).path

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(urlsplit(self.path).query, keep_blank_values=True)

    def json(self):
        return json.loads(self.body or b"{}")


#: how often the serving thread checks whether stop() was called (seconds)
SHUTDOWN_POLL_S = 0.05

#: what an answer function returns: (status, payload) or (status, payload, content type); a dict or list payload
#: is sent as JSON, str and bytes as they are; None instead of a tuple drops the connection unanswered
Answer = tuple | None


class FakeServer:
    """Serve `answer(request)` on 127.0.0.1 (a free port) until `stop()`; `url` is ready at once. With
    `keep_alive`, HTTP/1.1 connections stay open between requests (as real API servers do)."""

    def __init__(self, answer: Callable[[Request], Answer], keep_alive: bool = False):
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

            def log_message(self, *args):   # quiet
                pass

            def _serve(self):
                length = int(self.headers.get("Content-Length") or 0)
                request = Request(self.command, self.path, dict(self.headers),
                                  self.rfile.read(length) if length else b"")
                result = answer(request)
                if result is None:
                    self.close_connection = True
                    return
                status, payload, *rest = result
                if isinstance(payload, (dict, list)):
                    data, ctype = json.dumps(payload).encode(), "application/json"
                else:
                    data = payload.encode() if isinstance(payload, str) else payload
                    ctype = "text/plain" if isinstance(payload, str) else "application/octet-stream"
                self.send_response(status)
                self.send_header("Content-Type", rest[0] if rest else ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PATCH = do_PUT = _serve

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        # stop() waits for the serving loop to look at its shutdown flag, which it does once per poll: the default
        # 0.5 s poll made every test that stops a server wait up to half a second in its teardown
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_S},
                                       daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
