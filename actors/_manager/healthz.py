"""``/healthz``: a tiny JSON HTTP endpoint, bound to 127.0.0.1 by default.

GET /healthz returns the manager's health dict (200 when ``status`` is "ok",
503 when degraded); GET /metrics the same facts as Prometheus text
(``actors/_manager/metrics.py``, always 200); anything else is 404. It runs on its own thread inside the
manager actor, so it answers even while a commit is in progress.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from .metrics import prometheus_text

log = logging.getLogger("rl_ckpt")


class HealthzServer:
    def __init__(self, health: Callable[[], dict], host: str = "127.0.0.1", port: int = 0) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                path = self.path.split("?", 1)[0].rstrip("/")
                if path not in ("/healthz", "/metrics"):
                    self.send_error(404, "try /healthz or /metrics")
                    return
                body = health()
                if path == "/metrics":
                    data, code, kind = prometheus_text(body).encode(), 200, "text/plain; version=0.0.4"
                else:
                    data, code = json.dumps(body, default=str).encode(), 200 if body.get("status") == "ok" else 503
                    kind = "application/json"
                self.send_response(code)
                self.send_header("Content-Type", kind)
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
