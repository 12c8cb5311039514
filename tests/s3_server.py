"""An in-process S3 endpoint for tests: moto's ThreadedMotoServer on 127.0.0.1, optionally behind a latency
proxy.

``start_s3_server()`` binds an OS-chosen free port (``port=0``) on the loopback
address only, so tests need no server running beforehand and never touch a
real AWS endpoint or any other address. The server behaves as S3 does where
plain moto does not (atomic conditional writes, keep-alive connections, ranged
GETs that read only their range: ``rl_ckpt.tools.s3_endpoint`` says why).

``start_proxy(server)`` puts ``rl_ckpt.tools.s3_proxy.LatencyProxy`` in front of
it: per-request latency and a per-connection bandwidth cap, as a remote object
store has, and responses it can cut short on purpose.
"""

from __future__ import annotations

import dataclasses

from rl_ckpt.tools.s3_endpoint import LOOPBACK, client_options, start_moto
from rl_ckpt.tools.s3_proxy import LatencyProxy

__all__ = ["LOOPBACK", "LatencyProxy", "S3Server", "start_proxy", "start_s3_server"]


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
    server, port = start_moto(timeout=timeout)
    return S3Server(server, LOOPBACK, port)


def start_proxy(server: S3Server, *, latency: float = 0.03, rate: float | None = 40e6) -> LatencyProxy:
    """A started :class:`LatencyProxy` in front of ``server`` (``proxy.endpoint_url`` is where to connect)."""
    proxy = LatencyProxy((server.host, server.port), latency=latency, rate=rate)
    proxy.start()
    return proxy
