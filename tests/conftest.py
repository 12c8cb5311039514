"""Shared fixtures: an in-process S3 endpoint (moto on 127.0.0.1) and fresh buckets.

``s3_endpoint`` (session): starts moto's S3 server once, yields s3fs
``storage_options`` for it. Nothing needs to run beforehand.

``s3_url`` (function): a new bucket with a unique name; yields
``(url, storage_options)``, e.g. ``("s3://rlckpt-1a2b.../runs/r1", {...})``,
ready for ``open_storage(url, storage_options)``. The bucket is emptied and
deleted afterwards.

``s3_proxy`` (session): the latency proxy (``rl_ckpt.tools.s3_proxy``: 30 ms per
request, 40 MB/s per connection) in front of that server, as a remote object store
behaves. ``s3_proxy_url`` (function): like ``s3_url``, with options that go through
it (and 5 MiB parts, 4 in flight, so a few MiB make several parts); yields
``(url, storage_options, proxy)``; the proxy's faults and counters are cleared.

``ray_cluster`` (session): one local Ray cluster for every Ray test.

The suite runs on two pytest-xdist workers (``-n 2 --dist loadfile`` in
pyproject.toml, with the scheduler below): every file using ``ray_cluster``
goes to one worker, which runs them one after another on its one session
cluster, while the other worker runs the other files; a file's tests stay
together, so a module-scoped fixture runs once. ``-n 0`` runs everything in
one process, in file order.
"""

from __future__ import annotations

import copy
import os
import uuid

import pytest


@pytest.fixture(scope="session")
def s3_endpoint():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from s3_server import LOOPBACK, start_s3_server

    with pytest.MonkeyPatch.context() as mp:
        # Credentials are passed explicitly (key/secret), so no AWS env vars are
        # needed. These only make sure nothing but 127.0.0.1 is ever contacted:
        # no EC2 metadata probe, no HTTP proxy for the loopback endpoint, and no
        # named profile from the environment that botocore would try to load.
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        for var in ("NO_PROXY", "no_proxy"):
            current = os.environ.get(var, "")
            if LOOPBACK not in current.split(","):
                mp.setenv(var, ",".join(p for p in (current, LOOPBACK) if p))
        for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
            mp.delenv(var, raising=False)
        server = start_s3_server()
        try:
            yield server.storage_options()
        finally:
            server.stop()


def _s3fs(storage_options: dict):
    import s3fs

    return s3fs.S3FileSystem(**storage_options)  # cached instance: one botocore client for the session


@pytest.fixture
def s3_url(s3_endpoint):
    bucket = f"rlckpt-{uuid.uuid4().hex[:20]}"
    fs = _s3fs(s3_endpoint)
    # create_bucket directly: s3fs.mkdir adds a LocationConstraint, which
    # us-east-1 rejects.
    fs.call_s3("create_bucket", Bucket=bucket)
    try:
        yield f"s3://{bucket}/runs/r1", copy.deepcopy(s3_endpoint)
    finally:
        try:
            keys = [o["Key"] for o in fs.call_s3("list_objects_v2", Bucket=bucket).get("Contents", [])]
            if keys:
                fs.call_s3(
                    "delete_objects", Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True}
                )
            fs.call_s3("delete_bucket", Bucket=bucket)
        except Exception:  # cleanup is best effort; the server dies with the session
            pass


@pytest.fixture(scope="session")
def s3_proxy(s3_endpoint):
    from urllib.parse import urlparse

    from s3_server import LatencyProxy

    where = urlparse(s3_endpoint["endpoint_url"])
    proxy = LatencyProxy((where.hostname, where.port), latency=0.03, rate=40e6)
    proxy.start()
    yield proxy
    proxy.stop()


S3_TEST_PART = 5 * 1024 * 1024  # S3's smallest part: a few MiB make several


@pytest.fixture
def s3_proxy_url(s3_url, s3_proxy):
    url, options = s3_url
    s3_proxy.clear()
    through = {**options, "endpoint_url": s3_proxy.endpoint_url, "default_block_size": S3_TEST_PART}
    yield url, {**through, "max_concurrency": 4}, s3_proxy
    s3_proxy.clear()


def _marks(path) -> tuple[bool, bool]:
    """(uses the session's Ray cluster, long-running) for a test file, from its text: the ``ray_cluster``
    fixture; the ``slow`` marker, or the ``ray`` marker on a file that starts a cluster of its own."""
    try:
        text = path.read_text()
    except OSError:
        return False, False
    session_ray = "ray_cluster" in text
    return session_ray, "pytest.mark.slow" in text or ("pytest.mark.ray" in text and not session_ray)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, except that every file using the session's Ray cluster is one unit: one worker runs
    them all, one after another, on its one cluster, while the other runs the rest file by file (files that
    start a Ray cluster of their own, in a subprocess, among them). Units go out longest first: the Ray unit,
    then long-running files, then the rest (most tests first)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    marks: dict[str, tuple[bool, bool]] = {}

    def marks_of(file: str) -> tuple[bool, bool]:
        if file not in marks:
            marks[file] = _marks(config.rootpath / file)
        return marks[file]

    class RayFilesInOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return "ray" if marks_of(file)[0] else file

        def _assign_work_unit(self, node) -> None:
            for scope in [s for s in self.workqueue if s != "ray" and marks_of(s)[1]][::-1]:
                self.workqueue.move_to_end(scope, last=False)
            if "ray" in self.workqueue:
                self.workqueue.move_to_end("ray", last=False)
            super()._assign_work_unit(node)

    return RayFilesInOneWorker(config, log)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One local Ray cluster for the whole session (2 CPUs, token authentication left on)."""
    ray = pytest.importorskip("ray")
    import os

    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    if not ray.is_initialized():
        # address="local": always a new cluster of this session's own, never one another process started
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            logging_level="ERROR",
            namespace="rl_ckpt_tests",
            runtime_env={"env_vars": {"PYTHONPATH": os.path.dirname(__file__)}},
        )
    import ray_train_cleaner

    ray_train_cleaner.install()  # Ray Train's cleaner must not take "no record" for a dead controller under load
    yield ray
    ray.shutdown()
