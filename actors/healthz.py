"""``/healthz``: a tiny JSON HTTP endpoint, bound to 127.0.0.1 by default.

GET /healthz returns the manager's health dict (200 when ``status`` is "ok",
503 when degraded); anything else is 404. It runs on its own thread inside the
manager actor, so it answers even while a commit is in progress.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

log = logging.getLogger("rl_ckpt")


class HealthzServer:
    def __init__(self, health: Callable[[], dict], host: str = "127.0.0.1", port: int = 0) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.split("?", 1)[0] not in ("/healthz", "/healthz/"):
                    self.send_error(404, "try /healthz")
                    return
                body = health()
                data = json.dumps(body, default=str).encode()
                self.send_response(200 if body.get("status") == "ok" else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, fmt: str, *args) -> None:
                log.debug("healthz: " + fmt, *args)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.host, self.port = self.server.server_address[:2]
        self.url = f"http://{self.host}:{self.port}/healthz"
        self._thread = threading.Thread(target=self.server.serve_forever, name="rl_ckpt-healthz", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
