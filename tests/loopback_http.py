"""A test HTTP server on 127.0.0.1 (a free port) serving a handler class from a daemon thread, and the JSON
endpoint the comparator tests script or back with a model."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SERVER_SLEEP = time.sleep  # the server's own delays: a test may record the client's time.sleep instead


class LoopbackServer:
    """Subclasses build their handler and call :meth:`serve`; ``url`` is ``http://127.0.0.1:PORT/v1``."""

    def serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@dataclass(frozen=True)
class Reply:
    """An answer: ``status`` and the body's bytes, sent after ``delay`` seconds; ``cut`` announces 100 bytes
    more than it sends and closes the connection (a body that ends early)."""

    status: int
    data: bytes
    delay: float = 0.0
    cut: bool = False

    @classmethod
    def json(cls, payload: Any, status: int = 200) -> "Reply":
        return cls(status, json.dumps(payload).encode())


class JSONEndpoint(LoopbackServer):
    """Answers each POST of a JSON body with :meth:`answer`; subclasses call :meth:`start`."""

    def answer(self, path: str, headers: dict[str, str], body: Any) -> Reply:
        raise NotImplementedError

    def start(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                reply = server.answer(self.path, dict(self.headers), body)
                SERVER_SLEEP(reply.delay)
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(reply.data) + (100 if reply.cut else 0)))
                    self.end_headers()
                    self.wfile.write(reply.data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout test)
                if reply.cut:
                    self.close_connection = True

        self.serve(Handler)
