"""A local HTTP server for the webhook tests: every POST is recorded and answered by a
function the test gives."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: Given the request (path, headers, a handler to write to) and its body: the status
#: to answer with, or None when it wrote its own answer (or none at all).
Respond = Callable[[BaseHTTPRequestHandler, bytes], "int | None"]


class _Server(ThreadingHTTPServer):
    # The listen backlog: socketserver's 5 overflows when a relay opens its 8 parallel
    # POSTs at once on a loaded machine, and a connection whose SYN is dropped waits a
    # second for its retransmission, past a short connect timeout.
    request_queue_size = 64


class Receiver:
    """Listens on 127.0.0.1 at a free port until :meth:`close`."""

    def __init__(self, respond: Respond) -> None:
        self.requests: list[tuple[str, bytes, dict[str, str]]] = []   # (path, body, headers), in arrival order
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"     # one request per connection, the body ends at close

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver.lock:
                    receiver.requests.append((self.path, body, dict(self.headers)))
                status = respond(self, body)
                if status is not None:
                    self.send_response(status)
                    self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
