"""What every local S3 test endpoint shares (moto's server on 127.0.0.1): the test suite's
``tests/s3_server.py`` and the fault suite both build theirs with it.

One honest deviation from plain moto: moto checks ``If-None-Match: *`` and then
stores the object in two steps (check-then-act) while its server handles
requests on several threads, so two concurrent create-only PUTs of one key can
both pass the check. Real S3 makes that check atomic. To test *our* code
against S3's guarantee (and not flake on moto's race), requests carrying
``If-None-Match`` are run one at a time by a tiny WSGI wrapper. All other
requests stay concurrent.
"""

from __future__ import annotations

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


def serialize_conditional_writes(server) -> None:
    """Wrap a started ``moto.server.ThreadedMotoServer``'s WSGI app in :class:`SerializeConditionalWrites`."""
    wsgi = getattr(server, "_server", None)
    if wsgi is not None and hasattr(wsgi, "app") and not isinstance(wsgi.app, SerializeConditionalWrites):
        wsgi.app = SerializeConditionalWrites(wsgi.app)


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
