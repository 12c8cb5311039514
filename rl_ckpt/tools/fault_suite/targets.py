"""Where a case runs: a local run folder or an S3 prefix (moto on 127.0.0.1), and gc on it."""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import multiprocessing as mp
import os
import threading
import uuid

from rl_ckpt.tools.s3_endpoint import serialize_conditional_writes
from rl_ckpt.tools.fault_suite.common import engine_cfg, run_url


def _tree_listing(top: str, skip: str | None = None) -> dict:
    """Every entry under ``top`` but ``skip`` (links not followed): type, size, mtime and content digest."""
    skip = os.path.normpath(skip) if skip else None
    out = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        dirnames[:] = [d for d in dirnames if os.path.normpath(os.path.join(dirpath, d)) != skip]
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, top)
            st = os.lstat(full)
            if os.path.islink(full):
                out[rel] = ("link", os.readlink(full))
            elif os.path.isdir(full):
                out[rel] = ("dir", st.st_mode)
            else:
                with open(full, "rb") as f:
                    out[rel] = ("file", st.st_size, st.st_mtime_ns, hashlib.sha256(f.read()).hexdigest())
    return out


CLI_LOCK = threading.Lock()  # the CLI redirects the process's stdout/stderr: one call at a time


class GcRefused(RuntimeError):
    """``rl-ckpt gc`` exited non-zero."""


class LocalTarget:
    """A case folder: ``<parent>/run`` is the run; ``<parent>/outside`` and a neighbour run must never change."""

    def __init__(self, parent: str, cfg_kwargs: dict | None = None) -> None:
        self.parent = parent
        self.run = os.path.join(parent, "run")
        os.makedirs(os.path.join(parent, "outside"), exist_ok=True)
        with open(os.path.join(parent, "outside", "secret.txt"), "w") as f:
            f.write("outside the run: never touched\n")
        neighbour = os.path.join(parent, "neighbour", "step_000000001")
        os.makedirs(neighbour, exist_ok=True)
        with open(os.path.join(neighbour, "meta.json"), "w") as f:
            f.write('{"not": "ours"}\n')
        self.cfg = engine_cfg(parent, **(cfg_kwargs or {}))

    def storage(self):
        from rl_ckpt._storage import LocalStorage

        return LocalStorage(self.run)

    def outside(self) -> dict:
        return _tree_listing(self.parent, skip=self.run)

    def gc(self) -> int:
        """``rl-ckpt gc <run> --grace 0``; returns how many entries it removed (output swallowed; one at a
        time, as stdout is process-wide)."""
        from rl_ckpt.cli import main as cli

        out, err = io.StringIO(), io.StringIO()
        with CLI_LOCK, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli(["gc", self.run, "--grace", "0"])
        if rc != 0:
            raise GcRefused(f"rl-ckpt gc exited {rc}: {(out.getvalue() + err.getvalue())[-300:]}")
        return sum(1 for line in out.getvalue().splitlines() if line.startswith("removing "))


class S3Target:
    """A run under ``s3://<bucket>/case-<name>/run``; sentinel keys beside it must never change.

    Cases of one bucket run side by side, so "outside" is this case's prefix (but its run) plus every
    key that belongs to no case at all.
    """

    def __init__(self, s3: "S3Endpoint", bucket: str, name: str, cfg_kwargs: dict | None = None) -> None:
        prefix = f"case-{name}"
        self.s3, self.bucket, self.prefix = s3, bucket, prefix
        self.run_key = f"{prefix}/run"
        s3.fs.call_s3("put_object", Bucket=bucket, Key=f"{prefix}/outside/secret.txt", Body=b"outside the run")
        s3.fs.call_s3("put_object", Bucket=bucket, Key=f"{prefix}/run-neighbour/step_000000001/meta.json", Body=b"{}")
        self.cfg = engine_cfg(f"s3://{bucket}/{prefix}", storage_options=s3.options, **(cfg_kwargs or {}))

    def storage(self):
        from rl_ckpt._storage import open_storage

        return open_storage(run_url(self.cfg), self.s3.options)

    def outside(self) -> dict:
        return {
            k: v
            for k, v in self.s3.keys(self.bucket).items()
            if not k.startswith(self.run_key + "/") and (k.startswith(self.prefix + "/") or not k.startswith("case-"))
        }

    def gc(self) -> int:
        return run_gc(self.storage())


def run_gc(storage) -> int:
    """What ``rl-ckpt gc --grace 0`` does, on a given storage object."""
    from rl_ckpt._run.gc import find_debris, find_unreferenced_objects, remove_debris

    debris = find_debris(storage, grace_seconds=0)
    objects, _refusal = find_unreferenced_objects(storage, grace_seconds=0)
    return remove_debris(storage, debris + objects)


# -- S3 endpoint (moto on 127.0.0.1; the same setup as tests/s3_server.py) --------------------------

LOOPBACK = "127.0.0.1"


def _serve_s3(conn) -> None:
    """Child: run moto's S3 server on 127.0.0.1 (free port), send ("ok", port), serve until killed."""
    try:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        server = ThreadedMotoServer(ip_address=LOOPBACK, port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        if host != LOOPBACK or not port:
            raise RuntimeError(f"bound to {host}:{port}")
        serialize_conditional_writes(server)  # create-only PUTs atomic, as on real S3
        conn.send(("ok", int(port)))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.close()
    threading.Event().wait()


class S3Endpoint:
    """moto's S3 server on 127.0.0.1 (free port), with s3fs options and helpers."""

    ENV = {"AWS_EC2_METADATA_DISABLED": "true"}

    def __init__(self, options: dict | None = None, ctx=None) -> None:
        self.process = None
        self._saved_env: dict[str, str | None] = {}
        env = dict(self.ENV)
        no_proxy = os.environ.get("NO_PROXY", "")
        if LOOPBACK not in no_proxy.split(","):
            env["NO_PROXY"] = env["no_proxy"] = ",".join(p for p in (no_proxy, LOOPBACK) if p)
        self.env = env
        for key, value in env.items():
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        for key in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
            self._saved_env[key] = os.environ.pop(key, None)
        if options is None:
            options = self._start(ctx or mp.get_context("forkserver"))
        self.options = options
        import s3fs

        self.fs = s3fs.S3FileSystem(**options)

    def _start(self, ctx, timeout: float = 60.0) -> dict:
        """moto in a process of its own: its request threads do not compete for our GIL."""
        recv, send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_serve_s3, args=(send,), daemon=True, name="rl-ckpt-moto")
        self.process.start()
        send.close()
        if not recv.poll(timeout):
            self.process.kill()
            raise RuntimeError(f"moto S3 server did not start on {LOOPBACK} within {timeout:.0f}s")
        what, value = recv.recv()
        recv.close()
        if what != "ok":
            raise RuntimeError(f"moto S3 server failed to start: {value}")
        return {
            "endpoint_url": f"http://{LOOPBACK}:{value}",
            "key": "testing-access-key",
            "secret": "testing-secret-key",
            "client_kwargs": {"region_name": "us-east-1"},
            "config_kwargs": {"s3": {"addressing_style": "path"}},
        }

    def bucket(self) -> str:
        name = f"rlckpt-faults-{uuid.uuid4().hex[:16]}"
        self.fs.call_s3("create_bucket", Bucket=name)
        self.fs.call_s3("put_object", Bucket=name, Key="sentinel.txt", Body=b"belongs to no run")
        return name

    def keys(self, bucket: str) -> dict:
        out, token = {}, None
        while True:
            kw = {"Bucket": bucket}
            if token:
                kw["ContinuationToken"] = token
            page = self.fs.call_s3("list_objects_v2", **kw)
            out.update({o["Key"]: (o["Size"], o["ETag"]) for o in page.get("Contents", [])})
            if not page.get("IsTruncated"):
                return out
            token = page["NextContinuationToken"]

    def drop_bucket(self, bucket: str) -> None:
        try:
            keys = list(self.keys(bucket))
            for i in range(0, len(keys), 1000):
                self.fs.call_s3(
                    "delete_objects",
                    Bucket=bucket,
                    Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True},
                )
            self.fs.call_s3("delete_bucket", Bucket=bucket)
        except Exception:  # best effort: the server goes away with the suite
            pass

    def close(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join(10)
            self.process = None
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# -- the suite -----------------------------------------------------------------------------------
