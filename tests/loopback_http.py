"""A test HTTP server on 127.0.0.1 (a free port) serving a handler class from a daemon thread."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


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
