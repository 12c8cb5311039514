"""An in-process S3 endpoint for tests: moto's ThreadedMotoServer on 127.0.0.1.

``start_s3_server()`` binds an OS-chosen free port (``port=0``) on the loopback
address only, so tests need no server running beforehand and never touch a
real AWS endpoint or any other address.

Requests carrying ``If-None-Match`` run one at a time, as on real S3
(``rl_ckpt.tools.s3_endpoint`` says why).
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from rl_ckpt.tools.s3_endpoint import LOOPBACK, client_options, serialize_conditional_writes


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
        return client_options(self.endpoint_url)

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
    serialize_conditional_writes(server)
    return S3Server(server, host, int(port))
