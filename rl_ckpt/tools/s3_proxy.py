"""A TCP proxy on 127.0.0.1 that makes a local S3 endpoint behave like a remote one: every request waits
``latency`` seconds before it is forwarded, and each connection moves at most ``rate`` bytes per second in
each direction (as one TCP stream to real object storage does). Tests and ``rl-ckpt bench s3`` put it in
front of the moto server.

    python -m rl_ckpt.tools.s3_proxy --upstream 127.0.0.1:PORT [--latency-ms 30] [--mbps 40]

prints ``listening 127.0.0.1:PORT`` and proxies until killed. In a process, :class:`LatencyProxy` runs on
a thread of its own. It speaks just enough HTTP/1.1 to find where each request starts (the header block,
then ``Content-Length`` bytes or a chunked body); it never changes a byte it forwards. It counts requests
and the most it saw in flight at once, and can break chosen responses (:meth:`LatencyProxy.fail`) to
test how a client copes with a connection cut in the middle of a body, hold requests (:meth:`LatencyProxy.hold`),
or flip one byte of a request's body (:meth:`LatencyProxy.corrupt`: data damaged on the way). It binds and
connects to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import threading
import time
from typing import Callable

LOOPBACK = "127.0.0.1"
_READ = 256 * 1024


@dataclasses.dataclass
class Fault:
    """What to do to the requests ``match`` accepts (``times`` of them; None: all): cut the connection after
    ``after_bytes`` of the response, or (``hold``) keep the request until :meth:`release` (or for ever: a
    client killed meanwhile never gets an answer), or (``corrupt``) flip one byte in the middle of the request's
    body. ``reached`` is set when a request first matched."""

    match: Callable[[str, str, dict], bool]  # (method, path, lower-cased headers) -> bool
    after_bytes: int = 1024
    times: int | None = 1
    hold: bool = False
    corrupt: bool = False
    hits: int = 0
    reached: threading.Event = dataclasses.field(default_factory=threading.Event)
    released: threading.Event = dataclasses.field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


class LatencyProxy:
    """Forward 127.0.0.1:``port`` to ``upstream`` with ``latency`` seconds per request and ``rate`` bytes/s per
    connection and direction (None: no cap)."""

    def __init__(self, upstream: tuple[str, int], *, latency: float = 0.03, rate: float | None = 40e6) -> None:
        if upstream[0] != LOOPBACK:
            raise ValueError(f"the proxy forwards to {LOOPBACK} only, not {upstream[0]}")
        self.upstream = upstream
        self.latency = latency
        self.rate = rate
        self.port = 0
        self.requests = 0
        self.connections = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.log: list[tuple[str, str, str]] = []  # (method, path, range header) of every request, in order
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None

    # -- control (any thread) -------------------------------------------------
    def start(self) -> int:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, LOOPBACK, 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="rl-ckpt-s3-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the S3 proxy did not start")
        return self.port

    def stop(self) -> None:
        if self._loop is None:
            return

        async def close() -> None:
            self._server.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop = None

    def fail(self, match: Callable[[str, str, dict], bool], *, after_bytes: int = 1024, times: int | None = 1) -> Fault:
        """Cut the connection ``after_bytes`` into the response of the next ``times`` requests ``match`` accepts."""
        fault = Fault(match, after_bytes, times)
        with self._lock:
            self._faults.append(fault)
        return fault

    def hold(self, match: Callable[[str, str, dict], bool], *, times: int | None = 1) -> Fault:
        """Keep the next ``times`` requests ``match`` accepts from the server until ``fault.release()``."""
        fault = Fault(match, times=times, hold=True)
        with self._lock:
            self._faults.append(fault)
        return fault

    def corrupt(self, match: Callable[[str, str, dict], bool], *, times: int | None = 1) -> Fault:
        """Flip one byte in the body of the next ``times`` requests ``match`` accepts (their headers unchanged)."""
        fault = Fault(match, times=times, corrupt=True)
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            for fault in self._faults:
                fault.release()
            self._faults.clear()
            self.log.clear()
            self.requests = self.max_in_flight = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    # -- the proxy (its own thread) ----------------------------------------------
    def _fault_for(self, method: str, path: str, headers: dict) -> Fault | None:
        with self._lock:
            self.requests += 1
            self.log.append((method, path, headers.get("range", "")))
            for fault in self._faults:
                if (fault.times is None or fault.hits < fault.times) and fault.match(method, path, headers):
                    fault.hits += 1
                    fault.reached.set()
                    return fault
        return None

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            server_r, server_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        pending: asyncio.Queue = asyncio.Queue()  # (method, fault) of each request forwarded, in order
        up = asyncio.ensure_future(self._requests(client_r, server_w, pending))
        down = asyncio.ensure_future(self._responses(server_r, client_w, pending))
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        for task in (up, down):
            task.cancel()
        for w in (client_w, server_w):
            w.close()
        with self._lock:
            self.in_flight -= pending.qsize()

    async def _requests(self, reader, writer, pending: asyncio.Queue) -> None:
        """Client -> server: each request waits ``latency``, then its header block and body go through."""
        sink = _Sink(writer, self.rate)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            method, path, headers = _parse_head(head)
            fault = self._fault_for(method, path, headers)
            with self._lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if self.latency:
                await asyncio.sleep(self.latency)
            while fault is not None and fault.hold and not fault.released.is_set():
                await asyncio.sleep(0.01)
            pending.put_nowait((method, None if fault is not None and (fault.hold or fault.corrupt) else fault))
            await sink.write(head)
            if fault is not None and fault.corrupt and headers.get("content-length", "0") != "0":
                sink.flip_at = int(headers["content-length"]) // 2
            await _body(reader, sink, headers, None)
            sink.flip_at = None

    async def _responses(self, reader, writer, pending: asyncio.Queue) -> None:
        """Server -> client, capped; the response to a request a fault matched is cut short."""
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            _version, status_text, headers = _parse_head(head)
            status = int(status_text) if status_text.isdigit() else 0
            if 100 <= status < 200:  # "100 Continue" before the body of an upload: not the answer yet
                writer.write(head)
                await writer.drain()
                continue
            method, fault = await pending.get()
            sink = _Sink(writer, self.rate, budget=fault.after_bytes if fault is not None else None)
            try:
                await sink.write(head)
                no_body = method == "HEAD" or status in (204, 304)
                await _body(reader, sink, headers, 0 if no_body else -1)
            except _Cut:
                writer.transport.abort()  # the client sees the connection reset mid-response
                return
            with self._lock:
                self.in_flight -= 1


class _Cut(Exception):
    """A fault's byte budget is spent."""


class _Sink:
    """Write to ``writer`` at most ``rate`` bytes per second (token bucket, one second of burst at most), and
    raise :class:`_Cut` once ``budget`` bytes were written."""

    def __init__(self, writer, rate: float | None, budget: int | None = None) -> None:
        self.writer, self.rate, self.budget = writer, rate, budget
        self.start = time.monotonic()
        self.sent = 0.0
        self.flip_at: int | None = None  # flip the byte this far into the body being written

    async def write(self, data: bytes) -> None:
        if self.flip_at is not None:
            if self.flip_at < len(data):
                data = data[: self.flip_at] + bytes([data[self.flip_at] ^ 0xFF]) + data[self.flip_at + 1 :]
                self.flip_at = None
            else:
                self.flip_at -= len(data)
        if self.budget is not None:
            if len(data) >= self.budget:
                self.writer.write(data[: self.budget])
                await self.writer.drain()
                raise _Cut()
            self.budget -= len(data)
        self.writer.write(data)
        if self.rate:
            now = time.monotonic()
            if self.sent / self.rate < now - self.start - 1.0:  # idle for a while: no credit beyond 1 s
                self.start, self.sent = now - 1.0, 0.0
            self.sent += len(data)
            wait = self.start + self.sent / self.rate - now
            if wait > 0:
                await asyncio.sleep(wait)
        await self.writer.drain()


def _parse_head(head: bytes) -> tuple[str, str, dict]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return (parts[0] if parts else ""), (parts[1] if len(parts) > 1 else ""), headers


async def _body(reader, sink: _Sink, headers: dict, length: int | None) -> None:
    """Forward one message body: ``length`` bytes (0: none), else as ``headers`` frame it (-1: a response
    without framing runs to the end of the connection)."""
    if length != 0 and "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            line = await reader.readuntil(b"\r\n")
            await sink.write(line)
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:  # trailers, then the empty line
                while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                    await sink.write(trailer)
                await sink.write(b"\r\n")
                return
            await _copy(reader, sink, size + 2)
        return
    if length == 0:
        return
    if "content-length" in headers:
        await _copy(reader, sink, int(headers["content-length"]))
    elif length == -1:
        while data := await reader.read(_READ):
            await sink.write(data)


async def _copy(reader, sink: _Sink, n: int) -> None:
    while n > 0:
        data = await reader.read(min(n, _READ))
        if not data:
            raise ConnectionError("connection closed mid-body")
        await sink.write(data)
        n -= len(data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl_ckpt.tools.s3_proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="127.0.0.1:PORT of the S3 endpoint")
    p.add_argument("--latency-ms", type=float, default=30.0, help="added before each request (default 30)")
    p.add_argument("--mbps", type=float, default=40.0, help="cap per connection and direction, MB/s (0: none)")
    args = p.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    proxy = LatencyProxy((host, int(port)), latency=args.latency_ms / 1000, rate=args.mbps * 1e6 or None)
    proxy.start()
    print(f"listening {LOOPBACK}:{proxy.port}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
