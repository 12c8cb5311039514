"""An in-process S3 endpoint for tests: moto's ThreadedMotoServer on 127.0.0.1.

``start_s3_server()`` binds an OS-chosen free port (``port=0``) on the loopback
address only, so tests need no server running beforehand and never touch a
real AWS endpoint or any other address.

One honest deviation from plain moto: moto checks ``If-None-Match: *`` and then
stores the object in two steps (check-then-act) while its server handles
requests on several threads, so two concurrent create-only PUTs of one key can
both pass the check. Real S3 makes that check atomic. To test *our* code
against S3's guarantee (and not flake on moto's race), requests carrying
``If-None-Match`` are run one at a time by a tiny WSGI wrapper. All other
requests stay concurrent.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

LOOPBACK = "127.0.0.1"
FAKE_KEY = "testing-access-key"
FAKE_SECRET = "testing-secret-key"
REGION = "us-east-1"


class _SerializeConditionalWrites:
    """WSGI middleware: one request with an ``If-None-Match`` header at a time."""

    def __init__(self, app) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ, start_response):
        if "HTTP_IF_NONE_MATCH" in environ and environ.get("REQUEST_METHOD") in ("PUT", "POST"):
            with self.lock:
                # moto builds the whole response inside the call; materialise it
                # under the lock so the check and the store happen together.
                return list(self.app(environ, start_response))
        return self.app(environ, start_response)


@dataclasses.dataclass
class S3Server:
    server: object  # moto.server.ThreadedMotoServer
    host: str
    port: int

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def storage_options(self) -> dict:
        """Options for ``s3fs.S3FileSystem`` / ``open_storage(url, storage_options)``."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": FAKE_KEY,
            "secret": FAKE_SECRET,
            "client_kwargs": {"region_name": REGION},
            # An IP endpoint cannot do virtual-host buckets: force path-style URLs.
            "config_kwargs": {"s3": {"addressing_style": "path"}},
        }

    def stop(self) -> None:
        self.server.stop()


def start_s3_server(timeout: float = 30.0) -> S3Server:
    """Start moto's S3 server on 127.0.0.1 with a free port and return where it listens."""
    from moto.server import ThreadedMotoServer

    # werkzeug logs every request at INFO through its own stderr handler; keep warnings only.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address=LOOPBACK, port=0, verbose=False)
    # ThreadedMotoServer.start() waits without a timeout for its thread to bind;
    # if binding failed it would hang forever, so start it from a helper thread.
    starter = threading.Thread(target=server.start, daemon=True, name="moto-start")
    starter.start()
    starter.join(timeout)
    if starter.is_alive():
        raise RuntimeError(f"moto S3 server did not start on {LOOPBACK} within {timeout:.0f}s")
    # port=0 lets the OS pick; the werkzeug server knows the bound port.
    host, port = server.get_host_and_port()
    if host != LOOPBACK or not port:
        server.stop()
        raise RuntimeError(f"moto S3 server bound to {host}:{port}, expected {LOOPBACK}:<free port>")
    wsgi = getattr(server, "_server", None)
    if wsgi is not None and hasattr(wsgi, "app"):
        wsgi.app = _SerializeConditionalWrites(wsgi.app)
    return S3Server(server, host, int(port))
