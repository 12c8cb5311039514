"""What every local S3 test endpoint shares (moto's server on 127.0.0.1): the test suite's
``tests/s3_server.py``, the fault suite and ``rl-ckpt bench s3`` build theirs with :func:`start_moto`.

    python -m rl_ckpt.tools.s3_endpoint [--port 0] [--in-memory] [--no-checksum-check]

serves one on 127.0.0.1 (printing ``listening 127.0.0.1:PORT``) until killed (``--in-memory``: objects are
never spooled to temporary files, :func:`keep_objects_in_memory`).

Plain moto differs from S3 in ways that would make the tests and figures about moto, not about our
code. :func:`behave_as_s3` makes the server, in its own process, do what S3 does:

- Conditional writes are atomic. moto checks ``If-None-Match: *`` and then stores the object in two
  steps (check-then-act) while its server handles requests on several threads, so two concurrent
  create-only PUTs of one key could both pass the check. Requests carrying ``If-None-Match`` run one
  at a time (:class:`SerializeConditionalWrites`); all other requests stay concurrent.
- Connections are kept alive. werkzeug's server closes every connection after one response, so each
  request would pay a new connection (and, behind a latency proxy, a new round trip). The server
  speaks HTTP/1.1 with keep-alive (:class:`KeepAliveHandler`), as S3 does.
- A ranged GET reads only its range. moto reads the whole object for every ``Range: bytes=a-b`` and
  then slices it, so N parallel ranged reads of one object cost N whole reads. The object's stored
  bytes are read from ``a`` to ``b`` instead (:func:`serve_ranges_from_storage`).
- A body whose checksum header is wrong is refused. moto stores a ``PutObject`` or ``UploadPart`` whose
  ``x-amz-checksum-crc32`` / ``-sha1`` / ``-sha256`` does not match its body; S3 answers
  ``400 BadDigest`` and stores nothing (:class:`CheckBodyChecksums`). ``check_checksums=False``
  (``--no-checksum-check``) leaves moto's behaviour, as some S3-compatible stores have it: clients must not
  trust a checksum there.

Nothing else changes: moto still does every S3 check it does (signatures, preconditions, part sizes).
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import sys
import threading

LOOPBACK = "127.0.0.1"
FAKE_KEY = "testing-access-key"
FAKE_SECRET = "testing-secret-key"
REGION = "us-east-1"


class SerializeConditionalWrites:
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


def _crc32(body: bytes) -> bytes:
    import zlib

    return zlib.crc32(body).to_bytes(4, "big")


def _digest(name: str):
    import hashlib

    return lambda body: hashlib.new(name, body).digest()


# x-amz-checksum-<name> header -> the raw checksum of a body (base64 on the wire)
CHECKED_CHECKSUMS = {"crc32": _crc32, "sha1": _digest("sha1"), "sha256": _digest("sha256")}


class CheckBodyChecksums:
    """WSGI middleware: a ``PUT`` (``PutObject``, ``UploadPart``) whose ``x-amz-checksum-*`` header does not match
    its body gets S3's ``400 BadDigest`` and never reaches moto. A body framed ``aws-chunked`` (the checksum in a
    trailer) is passed on unchecked. ``enabled`` switches the check (while the server runs)."""

    def __init__(self, app, enabled: bool = True) -> None:
        self.app = app
        self.enabled = enabled

    def __call__(self, environ, start_response):
        if not self.enabled or environ.get("REQUEST_METHOD") != "PUT":
            return self.app(environ, start_response)
        chunked = "aws-chunked" in environ.get("HTTP_CONTENT_ENCODING", "") or "HTTP_X_AMZ_TRAILER" in environ
        for name, compute in CHECKED_CHECKSUMS.items():
            sent = environ.get(f"HTTP_X_AMZ_CHECKSUM_{name.upper()}")
            if sent is None or chunked:
                continue
            length = int(environ.get("CONTENT_LENGTH") or 0)
            body = environ["wsgi.input"].read(length) if length else b""
            environ["wsgi.input"] = io.BytesIO(body)
            environ["CONTENT_LENGTH"] = str(len(body))
            if base64.b64encode(compute(body)).decode() != sent.strip():
                message = f"The {name.upper()} you specified did not match the calculated checksum."
                xml = (
                    '<?xml version="1.0" encoding="UTF-8"?>\n'
                    f"<Error><Code>BadDigest</Code><Message>{message}</Message><RequestId>rl-ckpt-test</RequestId></Error>"
                ).encode()
                start_response(
                    "400 Bad Request", [("Content-Type", "application/xml"), ("Content-Length", str(len(xml)))]
                )
                return [xml]
            break
        return self.app(environ, start_response)


def check_body_checksums(server, enabled: bool = True) -> None:
    """Wrap a started ``ThreadedMotoServer``'s WSGI app in :class:`CheckBodyChecksums` (or switch the check)."""
    wsgi = getattr(server, "_server", None)
    if wsgi is None or not hasattr(wsgi, "app"):
        return
    if isinstance(wsgi.app, CheckBodyChecksums):
        wsgi.app.enabled = enabled
    else:
        wsgi.app = CheckBodyChecksums(wsgi.app, enabled)


def serialize_conditional_writes(server) -> None:
    """Wrap a started ``moto.server.ThreadedMotoServer``'s WSGI app in :class:`SerializeConditionalWrites`."""
    wsgi = getattr(server, "_server", None)
    if wsgi is not None and hasattr(wsgi, "app") and not isinstance(wsgi.app, SerializeConditionalWrites):
        wsgi.app = SerializeConditionalWrites(wsgi.app)


def _keep_alive_handler():
    from werkzeug.serving import WSGIRequestHandler

    class KeepAliveHandler(WSGIRequestHandler):
        """werkzeug's request handler with HTTP/1.1 keep-alive: the request body is read whole before the
        application runs (nothing of it is left for the next request line), every response carries its
        length, and the connection stays open unless the client asks to close it."""

        timeout = 300  # an idle connection's thread ends after this
        disable_nagle_algorithm = True  # headers and body leave at once, not after the client's delayed ACK

        def run_wsgi(self) -> None:
            if self.headers.get("Expect", "").lower().strip() == "100-continue":
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            environ = self.make_environ()
            body = environ["wsgi.input"].read() if environ.get("wsgi.input_terminated") else b""
            if not body and environ.get("CONTENT_LENGTH"):
                body = _read_exactly(self.rfile, int(environ["CONTENT_LENGTH"]))
            environ["wsgi.input"] = io.BytesIO(body)
            environ["CONTENT_LENGTH"] = str(len(body))
            environ.pop("HTTP_TRANSFER_ENCODING", None)
            environ.pop("wsgi.input_terminated", None)
            got: dict = {}

            def start_response(status, headers, exc_info=None):
                got["status"], got["headers"] = status, headers
                return lambda data: got.setdefault("early", []).append(data)

            try:
                result = self.server.app(environ, start_response)
                try:
                    data = b"".join([*got.get("early", []), *result])
                finally:
                    if hasattr(result, "close"):
                        result.close()
            except Exception as exc:  # noqa: BLE001 - answer 500, as werkzeug does, and keep serving
                self.server.log("error", f"Error on request: {type(exc).__name__}: {exc}")
                got, data = {"status": "500 INTERNAL SERVER ERROR", "headers": []}, b""
            code, _, message = got["status"].partition(" ")
            self.send_response(int(code), message)
            names = set()
            for name, value in got["headers"]:
                if name.lower() in ("connection", "transfer-encoding"):
                    continue
                names.add(name.lower())
                self.send_header(name, value)
            if "content-length" not in names and self.command != "HEAD":
                self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD" and data:
                self.wfile.write(data)
            self.wfile.flush()

    return KeepAliveHandler


def _read_exactly(f, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = f.read(n - got)
        if not part:
            raise ConnectionError("client closed the connection mid-body")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


_lazy = threading.local()
_RANGES_PATCHED = False


class _StoredRange:
    """A moto object's stored bytes, read only where sliced (what ``FakeKey.value`` returns while a ranged
    GET is answered)."""

    def __init__(self, key) -> None:
        self.key = key
        self.size = int(key.contentsize)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, item: slice) -> bytes:
        start, stop, _ = item.indices(self.size)
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return self.key._value_buffer.read(max(0, stop - start))


def serve_ranges_from_storage() -> None:
    """Patch moto (in this process) so a GET with one ``Range: bytes=a-b`` reads only bytes a..b of the object."""
    from moto.s3.models import FakeKey
    from moto.s3.responses import S3Response

    global _RANGES_PATCHED
    if _RANGES_PATCHED:
        return
    whole = FakeKey.value

    def value(self):
        return _StoredRange(self) if getattr(_lazy, "on", False) else whole.fget(self)

    FakeKey.value = property(value, whole.fset)
    key_response = S3Response.key_response

    def ranged_key_response(self, request, full_url, headers):
        spec = request.headers.get("range") or ""
        _lazy.on = request.method == "GET" and spec.startswith("bytes=") and "," not in spec
        try:
            status, out_headers, body = key_response(self, request, full_url, headers)
        finally:
            _lazy.on = False
        if isinstance(body, _StoredRange):  # an answer that is not a range after all: the whole object
            body = body[0 : len(body)]
        return status, out_headers, body

    S3Response.key_response = ranged_key_response
    _RANGES_PATCHED = True


def behave_as_s3(server, *, check_checksums: bool = True) -> None:
    """Make a started ``ThreadedMotoServer`` behave as S3 does (the module docstring says how)."""
    serialize_conditional_writes(server)
    check_body_checksums(server, check_checksums)
    serve_ranges_from_storage()
    wsgi = getattr(server, "_server", None)
    if wsgi is not None:
        wsgi.RequestHandlerClass = _keep_alive_handler()  # used for every connection accepted from now on


def start_moto(port: int = 0, timeout: float = 30.0, *, check_checksums: bool = True):
    """moto's ``ThreadedMotoServer`` on 127.0.0.1 (``port=0``: a free one), behaving as S3 does; returns
    ``(server, port)``. ``check_checksums=False``: bodies with a wrong checksum header are stored (plain moto)."""
    import logging

    from moto.server import ThreadedMotoServer

    # werkzeug logs every request at INFO through its own stderr handler; keep warnings only.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address=LOOPBACK, port=port, verbose=False)
    # ThreadedMotoServer.start() waits without a timeout for its thread to bind;
    # if binding failed it would hang forever, so start it from a helper thread.
    starter = threading.Thread(target=server.start, daemon=True, name="moto-start")
    starter.start()
    starter.join(timeout)
    if starter.is_alive():
        raise RuntimeError(f"moto S3 server did not start on {LOOPBACK} within {timeout:.0f}s")
    host, bound = server.get_host_and_port()
    if host != LOOPBACK or not bound:
        server.stop()
        raise RuntimeError(f"moto S3 server bound to {host}:{bound}, expected {LOOPBACK}:<free port>")
    behave_as_s3(server, check_checksums=check_checksums)
    return server, int(bound)


def client_options(endpoint_url: str) -> dict:
    """s3fs options (``open_storage(url, storage_options)``) for a local endpoint with fake credentials."""
    return {
        "endpoint_url": endpoint_url,
        "key": FAKE_KEY,
        "secret": FAKE_SECRET,
        "client_kwargs": {"region_name": REGION},
        # An IP endpoint cannot do virtual-host buckets: force path-style URLs.
        "config_kwargs": {"s3": {"addressing_style": "path"}},
    }


def keep_objects_in_memory() -> None:
    """Keep every object's bytes in this process's memory, as a store that is not this machine's disk would.

    moto spools an object larger than 5 MiB to a temporary file on the local disk (and copies a completed
    multipart upload's parts into another): measured through it, a large transfer times this machine's disk
    and page cache, not the protocol. Set before the first object is stored."""
    os.environ["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(1 << 40)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl_ckpt.tools.s3_endpoint", description="moto's S3 on 127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="port to bind (default: a free one)")
    p.add_argument("--in-memory", action="store_true", help="keep objects in memory, never in temporary files")
    p.add_argument(
        "--no-checksum-check", action="store_true", help="store bodies whose checksum header is wrong (plain moto)"
    )
    args = p.parse_args(argv)
    if args.in_memory:
        keep_objects_in_memory()
    _server, port = start_moto(args.port, check_checksums=not args.no_checksum_check)
    print(f"listening {LOOPBACK}:{port}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
