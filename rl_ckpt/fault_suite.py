"""The fault-injection suite: crash, cut, corrupt, fill, break and race real storage; print the figures.

    python -m rl_ckpt.fault_suite [--quick | --long] [--json] [--base-dir DIR] [--only NAME ...]

Scenarios (each against real storage: the local disk under ``--base-dir``, and
an S3 endpoint served by moto on 127.0.0.1, started here):

1. ``sigkill``      a child process saves and SIGKILLs itself right before /
                    right after every storage operation of one save (dedup
                    on/off x staged-rename/manifest-last), plus kills at random
                    moments of a save loop;
2. ``power``        a power cut (``faults.PowerLossStorage``: what was not
                    fsynced is undone) before every operation of a save and
                    after it returned;
3. ``corruption``   bit flips, truncation and deletion of every kind of file of
                    a snapshot, plus a bit-flip sweep over the manifest;
4. ``errors``       ENOSPC, EIO and a timeout at every operation of a save
                    (write, commit, retention) and of ``gc``;
5. ``s3``           a 5xx-like error at every request of a save on S3;
6. ``concurrent``   2, 4 and 8 processes released together save the same step
                    (local rename, local manifest-last, S3);
7. ``malicious``    path traversal, absolute paths, symlinks, pickles, bad
                    safetensors headers, corrupt Arrow, unknown schema versions.

After every case: the restored state is exactly one complete snapshot, no
acknowledged snapshot is lost, every listed snapshot verifies, ``rl-ckpt gc
--grace 0`` leaves everything verifiable, a later save succeeds, and nothing
outside the run folder changed. Exit status 1 if any invariant is violated.

Python API: ``report = run_suite("quick")``; ``report.ok``, ``report.table()``,
``report.to_json()``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime as _dt
import errno
import hashlib
import io
import json
import logging
import multiprocessing as mp
import os
import pickle
import platform
import random
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Callable

import numpy as np
import torch

from .checksum import digest_bytes
from .errors import CheckpointError, CommitConflictError, StorageError
from .testing.s3_endpoint import serialize_conditional_writes

SCENARIOS = ("sigkill", "power", "corruption", "errors", "s3", "concurrent", "malicious")
VALUE_BASE = 1000  # every saved value is step * VALUE_BASE + writer: a mixed or partial snapshot shows
VARIANTS = ((False, True), (False, False), (True, True), (True, False))  # (dedup, atomic_write)


def variant_name(dedup: bool, atomic_write: bool) -> str:
    return f"{'dedup' if dedup else 'plain'}/{'rename' if atomic_write else 'manifest-last'}"


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    kill_when: tuple[str, ...] = ("before", "after")
    # "after op k" leaves the disk as "before op k+1" does; quick runs it where the phase changes meaning
    kill_after_phases: tuple[str, ...] = ("commit", "after-commit")
    random_kills: int = 48
    random_kill_max_delay: float = 0.3  # a child's first save takes ~0.1 s (fsyncs): kills land 0-3 saves in
    power_mixes: int = 0  # random keep/undo mixes per cut point, besides the full rollback
    flips: tuple[str, ...] = ("middle",)
    truncations: tuple[str, ...] = ("tail",)
    manifest_flips: int | None = 48  # positions of the manifest bit-flip sweep (None: every byte)
    manifest_sweep_variants: tuple[tuple[bool, bool], ...] = ((False, True),)
    error_kinds: tuple[str, ...] = ("ENOSPC", "EIO", "ETIMEDOUT")
    error_when: tuple[str, ...] = ("before",)
    s3_variants: tuple[bool, ...] = (False,)  # dedup off / on
    s3_when: tuple[str, ...] = ("before",)
    s3_stride: int = 3  # every n-th request of the write phase, and every request after it (all in --long)
    race_writers: tuple[int, ...] = (2, 4, 8)
    race_rounds: int = 1
    every_error_kind: bool = False  # quick: one error kind per operation, in rotation; long: all of them
    power_save_after: bool = False
    workers: int = 4
    hostile_types_per_path: int | None = 2  # wrong JSON types tried on each manifest field (None: every one)


PROFILES = {
    "quick": Profile("quick"),
    "long": Profile(
        "long", kill_after_phases=("write", "commit", "after-commit"), random_kills=400, random_kill_max_delay=0.4,
        power_mixes=4, power_save_after=True, s3_variants=(False, True),
        flips=("first", "middle", "last", "random", "random"), truncations=("tail", "half", "empty"),
        manifest_flips=None, manifest_sweep_variants=((False, True), (True, True), (False, False)),
        error_when=("before", "after"), every_error_kind=True, s3_when=("before", "after"), s3_stride=1, race_rounds=8,
        hostile_types_per_path=None,
    ),
}

ERRORS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO, "ETIMEDOUT": errno.ETIMEDOUT}


# -- the saved state: every value is a function of (step, writer) ---------------------------


def stamp(step: int, writer: int = 0) -> int:
    return step * VALUE_BASE + writer


class Mixed(AssertionError):
    """The restored state is not one snapshot's: values from several steps or writers."""


FROZEN_N = 32768  # float32: 128 KiB, above the size below which dedup keeps tensors in the snapshot file


class SuiteModel:
    """Tensors (one changing, one frozen: shared by dedup) and JSON. With dedup, ``weight`` and ``frozen``
    (128 KiB each) are objects and ``counts`` stays in the snapshot's safetensors file (small tensors do)."""

    def __init__(self, n: int = 16384) -> None:
        self.step, self.writer = -1, 0
        self.weight = torch.zeros(n, dtype=torch.float64)
        self.counts = torch.zeros(64, dtype=torch.int64)
        self.frozen = torch.arange(FROZEN_N, dtype=torch.float32)

    def set(self, step: int, writer: int = 0) -> None:
        self.step, self.writer = step, writer
        self.weight.fill_(stamp(step, writer))
        self.counts.fill_(stamp(step, writer))

    def state_dict(self) -> dict:
        return {"weight": self.weight, "counts": self.counts, "frozen": self.frozen, "step": self.step,
                "writer": self.writer, "info": {"stamp": stamp(self.step, self.writer), "tag": f"s{self.step}"}}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.writer = state["step"], state["writer"]
        self.weight, self.counts, self.frozen = state["weight"].clone(), state["counts"].clone(), state["frozen"].clone()
        self.info = state["info"]


class SuiteBuffer:
    """A NumPy array and an Arrow table."""

    def __init__(self) -> None:
        self.step, self.writer = -1, 0
        self.obs = np.zeros(512, dtype=np.int64)

    def set(self, step: int, writer: int = 0) -> None:
        self.step, self.writer = step, writer
        self.obs.fill(stamp(step, writer))

    def state_dict(self) -> dict:
        import pyarrow as pa

        value = stamp(self.step, self.writer)
        table = pa.table({"stamp": pa.array([value] * 32, type=pa.int64()), "episode": pa.array(range(32), type=pa.int64()),
                          "rewards": pa.array([[float(value)] * (i % 3) for i in range(32)], type=pa.list_(pa.float64()))})
        return {"obs": self.obs, "episodes": table, "step": self.step, "writer": self.writer}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.writer = state["step"], state["writer"]
        self.obs = np.array(state["obs"])
        self.table = state["episodes"]


def observed(model: SuiteModel, buf: SuiteBuffer) -> tuple[int, int]:
    """(step, writer) of a restored state; :class:`Mixed` if its parts disagree."""
    step, writer = model.step, model.writer
    value = stamp(step, writer)
    checks = {
        "model.weight": bool((model.weight == value).all()),
        "model.counts": bool((model.counts == value).all()),
        "model.frozen": bool(torch.equal(model.frozen, torch.arange(FROZEN_N, dtype=torch.float32))),
        "model.info": getattr(model, "info", {}).get("stamp") == value,
        "buffer.step/writer": (buf.step, buf.writer) == (step, writer),
        "buffer.obs": bool((buf.obs == value).all()),
        "buffer.table": getattr(buf, "table", None) is not None
        and set(buf.table.column("stamp").to_pylist()) == {value},
    }
    bad = [k for k, good in checks.items() if not good]
    if bad:
        raise Mixed(f"restored state is not one snapshot's (step {step}, writer {writer}): {', '.join(bad)} disagree")
    return step, writer


def engine_cfg(base_dir: str, *, dedup: bool = False, atomic_write: bool = True, run_name: str = "run",
               storage_options: dict | None = None, **extra: Any) -> dict:
    cfg = {"base_dir": base_dir, "run_name": run_name, "dedup": dedup, "atomic_write": atomic_write,
           "keep_latest": 2, "keep_best": 1, "best_metric": "avg_reward", "best_mode": "max"}
    if storage_options:
        cfg["storage_options"] = storage_options
    cfg.update(extra)
    return cfg


def run_url(cfg: dict) -> str:
    return cfg["base_dir"].rstrip("/") + "/" + cfg["run_name"]


def build(cfg: dict, storage=None, **kwargs: Any):
    """(engine, model, buffer): an engine with the suite's two components registered."""
    from .engine import CheckpointEngine

    engine = CheckpointEngine(**cfg, storage=storage, **kwargs)
    model, buf = SuiteModel(), SuiteBuffer()
    engine.register("model", model)
    engine.register("replay_buffer", buf)
    return engine, model, buf


def save_step(engine, model: SuiteModel, buf: SuiteBuffer, step: int, writer: int = 0):
    model.set(step, writer)
    buf.set(step, writer)
    return engine.save(step, metrics={"avg_reward": float(step)})


# -- children (run in a forkserver process) --------------------------------------------------


def _child_init(env: dict | None = None) -> None:
    torch.set_num_threads(1)
    logging.getLogger("rl_ckpt").setLevel(logging.CRITICAL)
    logging.getLogger("rl_ckpt").propagate = False
    if env:
        os.environ.update(env)


def _child_kill_at(cfg: dict, step: int, nth: int, expect_op: str, when: str, conn) -> None:
    """Save ``step``; SIGKILL ourselves right before/after the nth storage call (of any kind)."""
    _child_init()
    from .faults import FaultyStorage
    from .storage import open_storage

    storage = FaultyStorage(open_storage(run_url(cfg)))
    engine, model, buf = build(cfg, storage)
    engine.catalog.refresh()  # as when the ops were recorded: kill points are the save's own calls

    def die() -> None:
        if storage.ops[-1][0] != expect_op:
            os._exit(3)  # the save took another path than the recorded one
        os.kill(os.getpid(), signal.SIGKILL)

    (storage.before if when == "before" else storage.after)("*", die, nth=nth)
    save_step(engine, model, buf, step)
    conn.send_bytes(b"%d" % step)
    os._exit(0)


def _child_save_loop(cfg: dict, start: int, conn) -> None:
    """Save start, start+1, ... until killed; ACK each step after save() returned."""
    _child_init()
    engine, model, buf = build(cfg)
    conn.send_bytes(b"ready")
    step = start
    while True:
        save_step(engine, model, buf, step)
        conn.send_bytes(b"%d" % step)  # a pipe write: the ACK survives our death
        step += 1


def _child_race(cfg: dict, env: dict, writer: int, step: int, barrier, conn) -> None:
    """Build an engine, wait for the others, then save ``step`` with this writer's values."""
    _child_init(env)
    try:
        engine, model, buf = build(cfg)
        model.set(step, writer)
        buf.set(step, writer)
        engine.catalog.refresh()
    except BaseException as exc:  # pragma: no cover - setup failure
        barrier.abort()
        conn.send(("error", f"setup: {type(exc).__name__}: {exc}"))
        return
    try:
        barrier.wait(60)
        engine.save(step, metrics={"avg_reward": float(step)})
        conn.send(("committed", ""))
    except CommitConflictError as exc:
        conn.send(("conflict", str(exc)))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        try:
            engine.close()
        except BaseException:
            pass


# -- results ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Violation:
    scenario: str
    variant: str
    case: str
    kind: str
    message: str

    def __str__(self) -> str:
        return f"[{self.scenario} {self.variant}] {self.case}: {self.kind}: {self.message}"


@dataclasses.dataclass
class ScenarioResult:
    key: str
    title: str
    tried: int = 0
    injected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    corrupt_loads: int = 0
    acked_lost: int = 0
    broken_listed: int = 0
    corruptions_injected: int = 0
    corruptions_detected: int = 0
    escapes: int = 0
    max_rolled_back: int = 0
    violations: list[Violation] = dataclasses.field(default_factory=list)
    notes: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    COUNTERS = {"corrupt_load": "corrupt_loads", "acked_lost": "acked_lost", "broken_listed": "broken_listed",
                "escape": "escapes"}

    @property
    def ok(self) -> bool:
        return not self.violations

    def violate(self, variant: str, case: str, kind: str, message: str, count: int = 1) -> None:
        attr = self.COUNTERS.get(kind)
        if attr:
            setattr(self, attr, getattr(self, attr) + count)
        self.violations.append(Violation(self.key, variant, case, kind, message[:600]))

    def note(self, key: str, n: int = 1) -> None:
        self.notes[key] = self.notes.get(key, 0) + n

    def merge(self, other: "ScenarioResult") -> None:
        for attr in ("tried", "corrupt_loads", "acked_lost", "broken_listed", "corruptions_injected",
                     "corruptions_detected", "escapes"):
            setattr(self, attr, getattr(self, attr) + getattr(other, attr))
        self.injected.update(other.injected)
        self.max_rolled_back = max(self.max_rolled_back, other.max_rolled_back)
        self.violations += other.violations
        for key, value in other.notes.items():
            if isinstance(value, int) and isinstance(self.notes.get(key, 0), int):
                self.notes[key] = self.notes.get(key, 0) + value
            else:
                self.notes[key] = value

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["injected"] = dict(self.injected)
        d["faults_injected"] = sum(self.injected.values())
        d["violations"] = [dataclasses.asdict(v) for v in self.violations]
        d["ok"] = self.ok
        d["seconds"] = round(self.seconds, 1)
        return d


@dataclasses.dataclass
class SuiteReport:
    mode: str
    started: str
    machine: dict
    scenarios: list[ScenarioResult]
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.scenarios)

    def get(self, key: str) -> ScenarioResult:
        return next(s for s in self.scenarios if s.key == key)

    @property
    def violations(self) -> list[Violation]:
        return [v for s in self.scenarios for v in s.violations]

    def totals(self) -> dict:
        out = {k: sum(getattr(s, k) for s in self.scenarios) for k in
               ("tried", "corrupt_loads", "acked_lost", "broken_listed", "corruptions_injected", "corruptions_detected",
                "escapes")}
        out["faults_injected"] = sum(sum(s.injected.values()) for s in self.scenarios)
        out["max_rolled_back"] = max((s.max_rolled_back for s in self.scenarios), default=0)
        out["violations"] = len(self.violations)
        return out

    def to_json(self) -> dict:
        return {"mode": self.mode, "started": self.started, "machine": self.machine, "seconds": round(self.seconds, 1),
                "ok": self.ok, "totals": self.totals(), "scenarios": [s.to_json() for s in self.scenarios]}

    def table(self) -> str:
        head = ["scenario", "tried", "faults", "corrupt loads", "acked lost", "broken listed", "detected/injected",
                "escapes", "max rollback", "violations", "time"]
        rows = []
        for s in self.scenarios:
            det = f"{s.corruptions_detected}/{s.corruptions_injected}" if s.corruptions_injected else "-"
            rows.append([s.key, str(s.tried), str(sum(s.injected.values())), str(s.corrupt_loads), str(s.acked_lost),
                         str(s.broken_listed), det, str(s.escapes), str(s.max_rolled_back), str(len(s.violations)),
                         f"{s.seconds:.0f}s"])
        t = self.totals()
        det = f"{t['corruptions_detected']}/{t['corruptions_injected']}"
        rows.append(["TOTAL", str(t["tried"]), str(t["faults_injected"]), str(t["corrupt_loads"]), str(t["acked_lost"]),
                     str(t["broken_listed"]), det, str(t["escapes"]), str(t["max_rolled_back"]), str(t["violations"]),
                     f"{self.seconds:.0f}s"])
        widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]

        def line(cells):
            return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"

        out = [line(head), "|" + "|".join(("-" * (w + 1) + ":") if i else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|"]
        out += [line(r) for r in rows]
        out.append("")
        out.append("Faults injected, by kind:")
        for s in self.scenarios:
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(s.injected.items()))
            out.append(f"  {s.key}: {kinds or '-'}")
        out.append("")
        out.append("Other figures:")
        for s in self.scenarios:
            if s.notes:
                out.append(f"  {s.key}: " + ", ".join(f"{k} {v}" for k, v in s.notes.items()))
        if self.violations:
            out.append("")
            out.append(f"VIOLATIONS ({len(self.violations)}):")
            out += [f"  {v}" for v in self.violations[:40]]
            if len(self.violations) > 40:
                out.append(f"  ... {len(self.violations) - 40} more (see --json)")
        out.append("")
        out.append(f"{'OK' if self.ok else 'FAILED'}: {self.mode} suite, {t['tried']} cases, {self.seconds:.0f}s "
                   f"on {self.machine['cpus']} cores")
        return "\n".join(out)


# -- targets: where a case's run lives, and how to look at it -----------------------------------


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


_CLI_LOCK = threading.Lock()


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
        from .storage import LocalStorage

        return LocalStorage(self.run)

    def outside(self) -> dict:
        return _tree_listing(self.parent, skip=self.run)

    def gc(self) -> int:
        """``rl-ckpt gc <run> --grace 0``; returns how many entries it removed (output swallowed; one at a
        time, as stdout is process-wide)."""
        from .cli import main as cli

        out, err = io.StringIO(), io.StringIO()
        with _CLI_LOCK, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
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
        from .storage import open_storage

        return open_storage(run_url(self.cfg), self.s3.options)

    def outside(self) -> dict:
        return {k: v for k, v in self.s3.keys(self.bucket).items()
                if not k.startswith(self.run_key + "/") and (k.startswith(self.prefix + "/") or not k.startswith("case-"))}

    def gc(self) -> int:
        return run_gc(self.storage())


def run_gc(storage) -> int:
    """What ``rl-ckpt gc --grace 0`` does, on a given storage object."""
    from .gc import find_debris, find_unreferenced_objects, remove_debris

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
        return {"endpoint_url": f"http://{LOOPBACK}:{value}", "key": "testing-access-key", "secret": "testing-secret-key",
                "client_kwargs": {"region_name": "us-east-1"}, "config_kwargs": {"s3": {"addressing_style": "path"}}}

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
                self.fs.call_s3("delete_objects", Bucket=bucket,
                                Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
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


class Suite:
    """Runs the scenarios. Cases are independent jobs (own folder or prefix), run on a few threads:
    most of a case's time is fsync, child processes and HTTP, which do not hold the GIL."""

    def __init__(self, mode: str = "quick", base_dir: str | None = None, *, s3_storage_options: dict | None = None,
                 progress: Callable[[str], None] | None = None, keep_failed: int = 20, workers: int | None = None) -> None:
        if mode not in PROFILES:
            raise ValueError(f"mode must be one of {sorted(PROFILES)}")
        self.profile = PROFILES[mode]
        self.workers = workers or self.profile.workers
        parent = base_dir or tempfile.gettempdir()
        os.makedirs(parent, exist_ok=True)
        self.root = tempfile.mkdtemp(prefix=f"rlckpt-faults-{mode}-", dir=parent)
        self.journal_dir = os.path.join(self.root, "_powerloss-journal")
        self.progress = progress or (lambda msg: None)
        self.keep_failed = keep_failed
        self.kept: list[str] = []
        self._case_no = 0
        self._lock = threading.Lock()
        self._templates: dict[str, str] = {}
        self._s3: S3Endpoint | None = None
        self._s3_options = s3_storage_options
        self._ctx = None

    @property
    def ctx(self):
        """The forkserver context, its preloads set when the first child is about to start (the preload
        list is process-wide; it only matters if this process has not started its forkserver yet)."""
        if self._ctx is None:
            ctx = mp.get_context("forkserver")
            # pandas: pyarrow imports it on the first array it builds (0.2 s in every child otherwise);
            # s3fs/botocore: every S3 writer process would import them again
            ctx.set_forkserver_preload(["torch", "numpy", "pyarrow", "pandas", "s3fs", "rl_ckpt", "rl_ckpt.engine",
                                        "rl_ckpt.fault_suite"])
            self._ctx = ctx
        return self._ctx

    # -- plumbing --------------------------------------------------------------------------
    def s3(self) -> S3Endpoint:
        with self._lock:
            if self._s3 is None:
                self._s3 = S3Endpoint(self._s3_options, self.ctx)
            return self._s3

    def close(self) -> None:
        if self._s3 is not None:
            self._s3.close()
            self._s3 = None
        if not self.kept:
            shutil.rmtree(self.root, ignore_errors=True)
        else:  # keep the failed cases (listed in the report) for a person to look at
            shutil.rmtree(os.path.join(self.root, "_templates"), ignore_errors=True)
            shutil.rmtree(self.journal_dir, ignore_errors=True)

    def run_jobs(self, res: ScenarioResult, jobs: list[Callable[[ScenarioResult], None]]) -> None:
        """Run ``jobs`` (each fills its own part of the result) on the worker threads; merge into ``res``."""
        from concurrent.futures import ThreadPoolExecutor

        def one(job) -> ScenarioResult:
            part = ScenarioResult(res.key, res.title)
            try:
                job(part)
            except Exception as exc:  # a suite bug must show, not hide a case
                part.violate("?", getattr(job, "__name__", "job"), "crash", f"{type(exc).__name__}: {exc}")
            return part

        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            for part in pool.map(one, jobs):
                res.merge(part)

    def case(self, label: str, cfg_kwargs: dict | None = None, template: str | None = None) -> LocalTarget:
        with self._lock:
            self._case_no += 1
            number = self._case_no
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[:80]
        target = LocalTarget(os.path.join(self.root, f"{number:05d}-{safe}"), cfg_kwargs)
        if template is not None:
            shutil.copytree(template, target.run, symlinks=True)
        return target

    def done(self, target: LocalTarget, ok: bool) -> None:
        with self._lock:
            keep = not ok and len(self.kept) < self.keep_failed
            if keep:
                self.kept.append(target.parent)
        if not keep:
            shutil.rmtree(target.parent, ignore_errors=True)

    def template(self, name: str, cfg_kwargs: dict, steps=(1, 2)) -> str:
        """A run folder with ``steps`` committed; cases copy it (call from the main thread)."""
        key = f"{name}:{sorted(cfg_kwargs.items())}:{steps}"
        if key not in self._templates:
            parent = os.path.join(self.root, "_templates", f"{len(self._templates):02d}-{name.replace('/', '-')}")
            cfg = engine_cfg(parent, **cfg_kwargs)
            os.makedirs(run_url(cfg), exist_ok=True)
            engine, model, buf = build(cfg)
            for step in steps:
                save_step(engine, model, buf, step)
            engine.close()
            self._templates[key] = run_url(cfg)
        return self._templates[key]

    def record_ops(self, template: str, cfg_kwargs: dict, step: int) -> list[tuple[str, str]]:
        """The storage calls of one save of ``step`` on a copy of ``template``."""
        from .faults import FaultyStorage
        from .storage import LocalStorage

        target = self.case("record", cfg_kwargs, template)
        storage = FaultyStorage(LocalStorage(target.run))
        engine, model, buf = build(target.cfg, storage)
        engine.catalog.refresh()
        storage.ops.clear()
        save_step(engine, model, buf, step)
        ops = list(storage.ops)
        self.done(target, True)
        return ops

    def run_child(self, fn, args: tuple, *, timeout: float = 120.0) -> tuple[int | None, list[int]]:
        recv, send = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=fn, args=(*args, send), daemon=True)
        proc.start()
        send.close()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        acks = []
        while recv.poll(0):
            try:
                acks.append(int(recv.recv_bytes()))
            except (EOFError, ValueError):
                break
        recv.close()
        return proc.exitcode, acks

    # -- the common invariant check ----------------------------------------------------------
    def check(self, res: ScenarioResult, variant: str, label: str, target, *, must_list: set[int], allowed: set[int],
              acked_max: int | None, in_flight: int | None, save_after: int | None = None, gc: bool = True,
              writer: int | None = None, outside_before: dict | None = None,
              damaged: frozenset = frozenset(), retention_keeps: int | None = None) -> tuple[bool, int | None]:
        """Every invariant after a fault; violations go into ``res``. Returns (all held, restored step).

        ``damaged``: snapshot ids the case broke on purpose (they may fail verify and be skipped).
        ``retention_keeps``: an acknowledged step may be gone only if at least this many newer snapshots
        are listed (retention retired it in their favour: keep_latest).
        """
        from .gc import find_debris, find_unreferenced_objects

        n_before = len(res.violations)
        restored = None
        seen: set[str] = set()

        def bad(kind: str, msg: str, count: int = 1) -> None:
            # one record per kind and case; a later echo of a snapshot already found broken is not a new finding
            if kind in seen or (kind in ("gc", "broken_listed") and "broken_listed" in seen and "verif" in msg):
                return
            seen.add(kind)
            res.violate(variant, label, kind, msg, count)

        try:
            engine, model, buf = build(target.cfg, target.storage())
            listed = sorted(i.global_step for i in engine.snapshots())
            missing = must_list - set(listed)
            if retention_keeps:
                retired = {s for s in missing if sum(1 for x in listed if x > s) >= retention_keeps}
                if retired:
                    res.note("acknowledged snapshots retired by retention in favour of newer ones", len(retired))
                missing -= retired
            if missing:
                bad("acked_lost", f"acknowledged step(s) {sorted(missing)} not listed (listed: {listed})", len(missing))
            if set(listed) - allowed:
                bad("unexpected", f"snapshots {sorted(set(listed) - allowed)} listed; only {sorted(allowed)} may be")
            report = engine.verify()
            broken = set(report.bad_snapshots) - damaged
            if broken:
                bad("broken_listed", f"verify: {report}", len(broken))
            try:
                result = engine.restore()
            except CheckpointError as exc:
                intact = [i.snapshot_id for i in engine.snapshots()
                          if i.snapshot_id not in damaged and i.snapshot_id not in report.bad_snapshots]
                if intact:
                    bad("restore_failed", f"restore raised {type(exc).__name__} with {intact} intact: {exc}")
            else:
                if result.fresh:
                    if listed or must_list:
                        bad("acked_lost" if must_list else "restore_failed", f"restore started fresh with {listed} listed")
                else:
                    try:
                        step, who = observed(model, buf)
                    except Mixed as exc:
                        bad("corrupt_load", str(exc))
                    else:
                        restored = step
                        if result.global_step != step:
                            bad("corrupt_load", f"restore says step {result.global_step}, the state is step {step}")
                        elif writer is not None and who != writer:
                            bad("corrupt_load", f"restored writer {who}'s state, but writer {writer} committed")
                        if acked_max is not None and step < acked_max and not missing:
                            bad("acked_lost", f"restored step {step} < acknowledged step {acked_max}")
                        if in_flight is not None:
                            res.max_rolled_back = max(res.max_rolled_back, in_flight - step)
                    if set(result.skipped) - damaged:
                        bad("broken_listed", f"restore skipped {result.skipped}")
            engine.close()
            if gc:
                removed = target.gc()
                engine, model, buf = build(target.cfg, target.storage())
                after = sorted(i.global_step for i in engine.snapshots())
                if after != listed:
                    bad("gc", f"gc changed the listing: {listed} -> {after}")
                if removed:  # (nothing removed: nothing to verify again)
                    report = engine.verify()
                    if set(report.bad_snapshots) - damaged:
                        bad("gc", f"verify after gc removed {removed} entries: {report}")
                storage = target.storage()
                left = [d.path for d in find_debris(storage, grace_seconds=0)]
                left += [d.path for d in find_unreferenced_objects(storage, grace_seconds=0)[0]]
                if left:
                    bad("gc", f"gc left debris: {left[:5]}")
                engine.close()
            if save_after is not None:
                engine, model, buf = build(target.cfg, target.storage())
                try:
                    save_step(engine, model, buf, save_after)
                except CheckpointError as exc:
                    bad("later_save", f"a later save of step {save_after} failed: {type(exc).__name__}: {exc}")
                else:
                    report = engine.verify()
                    if set(report.bad_snapshots) - damaged:
                        bad("broken_listed", f"a later save (step {save_after}) returned, but verify then says: {report}",
                            len(set(report.bad_snapshots) - damaged))
                engine.close()
        except Exception as exc:  # anything that is not a CheckpointError where one was due, or a suite bug
            bad("crash", f"{type(exc).__name__}: {exc}")
        if outside_before is not None and target.outside() != outside_before:
            bad("escape", "something outside the run folder changed")
        return len(res.violations) == n_before, restored

    # == 1. SIGKILL ===============================================================================
    def sigkill(self) -> ScenarioResult:
        res = ScenarioResult("sigkill", "SIGKILL before/after every storage operation of a save, and at random moments")
        jobs = []
        for dedup, aw in VARIANTS:
            variant = variant_name(dedup, aw)
            kw = {"dedup": dedup, "atomic_write": aw}
            tpl = self.template(variant, kw)
            ops = self.record_ops(tpl, kw, 3)
            marks = op_phases(ops)
            for k, (op, _path) in enumerate(ops):
                for when in self.profile.kill_when:
                    if when == "after" and marks[k] not in self.profile.kill_after_phases:
                        continue
                    jobs.append(lambda part, variant=variant, kw=kw, tpl=tpl, k=k, op=op, when=when, mark=marks[k]:
                                self._kill_point(part, variant, kw, tpl, k, op, when, mark))
            self.progress(f"  sigkill {variant}: {len(ops)} operations x {len(self.profile.kill_when)}")
        self.run_jobs(res, jobs)
        self.run_jobs(res, [lambda part, v=v: self._random_kills(part, *v) for v in VARIANTS])
        self.progress(f"  sigkill: {self.profile.random_kills} random-moment kills")
        return res

    def _kill_point(self, part: ScenarioResult, variant: str, kw: dict, tpl: str, k: int, op: str, when: str,
                    mark: str) -> None:
        target = self.case(f"kill-{variant}-{k}-{when}", kw, tpl)
        before = target.outside()
        code, acks = self.run_child(_child_kill_at, (target.cfg, 3, k + 1, op, when))
        if code not in (-signal.SIGKILL, 0, 3):  # 255: the forkserver lost the child (host trouble), not our kill
            part.note(f"harness: child lost (exit {code}), case run again")
            self.done(target, True)
            target = self.case(f"kill-{variant}-{k}-{when}-again", kw, tpl)
            before = target.outside()
            code, acks = self.run_child(_child_kill_at, (target.cfg, 3, k + 1, op, when))
        part.tried += 1
        part.injected[f"SIGKILL {when} op"] += 1
        part.note(f"kill points in phase {mark}")
        label = f"kill {when} op {k} ({op}, {mark})"
        if code != -signal.SIGKILL:
            why = {0: "the save finished without reaching it", 3: "the save took another path"}.get(code, f"exit {code}")
            part.violate(variant, label, "harness", f"kill point not reached: {why}")
        acked = 3 in acks
        ok, _ = self.check(part, variant, label, target, must_list={2} | ({3} if acked else set()), allowed={1, 2, 3},
                           acked_max=3 if acked else 2, in_flight=3, outside_before=before)
        self.done(target, ok)

    def _random_kills(self, res: ScenarioResult, dedup: bool, aw: bool) -> None:
        """One run folder; a child saves steps in a loop and is SIGKILLed at a random moment, over and over.
        Like a trainer, each new child resumes from the step that was restored."""
        variant = variant_name(dedup, aw)
        rnd = random.Random(20240611 + 2 * dedup + aw)
        target = self.case(f"random-kills-{variant}", {"dedup": dedup, "atomic_write": aw})
        outside = target.outside()
        last_ack, start, all_ok = -1, 0, True
        for i in range(self.profile.random_kills // len(VARIANTS)):
            recv, send = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(target=_child_save_loop, args=(target.cfg, start, send), daemon=True)
            proc.start()
            send.close()
            if recv.poll(60) and recv.recv_bytes() == b"ready":
                time.sleep(rnd.uniform(0.0, self.profile.random_kill_max_delay))
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
            acks: list[int] = []
            while recv.poll(0):
                try:
                    acks.append(int(recv.recv_bytes()))
                except (EOFError, ValueError):
                    break
            recv.close()
            res.tried += 1
            res.injected["SIGKILL at a random moment"] += 1
            if acks:
                last_ack = max(last_ack, acks[-1])
                res.note("random kills: saves acknowledged", len(acks))
                res.note("random kills after at least one acknowledged save")
            in_flight = (acks[-1] + 1) if acks else start  # the save that was running when the kill came
            ok, restored = self.check(res, variant, f"random kill {i}", target,
                                      must_list={last_ack} if last_ack >= 0 else set(), allowed=set(range(in_flight + 1)),
                                      acked_max=last_ack if last_ack >= 0 else None, in_flight=in_flight,
                                      outside_before=outside, retention_keeps=target.cfg["keep_latest"])
            all_ok &= ok
            start = 0 if restored is None else restored + 1
        self.done(target, all_ok)

    # == 2. power loss ============================================================================
    def power(self) -> ScenarioResult:
        res = ScenarioResult("power", "power cut (unsynced effects undone) before every operation of a save and after it")
        jobs = []
        for dedup, aw in VARIANTS:
            for stage in ("first", "third"):
                variant = f"{variant_name(dedup, aw)}/{stage} save"
                kw = {"dedup": dedup, "atomic_write": aw}
                step = 1 if stage == "first" else 3
                tpl = self.template(variant_name(dedup, aw), kw, steps=() if stage == "first" else (1, 2))
                ops = self.record_ops(tpl, kw, step)
                marks = op_phases(ops) + ["after the save returned"]
                for k in range(len(ops) + 1):
                    for mix in range(1 + self.profile.power_mixes):
                        jobs.append(lambda part, variant=variant, kw=kw, tpl=tpl, step=step, k=k, n=len(ops),
                                    op=ops[k][0] if k < len(ops) else "", mark=marks[k], mix=mix:
                                    self._power_cut(part, variant, kw, tpl, step, k, n, op, mark, mix))
                self.progress(f"  power {variant}: {len(ops) + 1} cut points x {1 + self.profile.power_mixes}")
        self.run_jobs(res, jobs)
        return res

    def _power_cut(self, part: ScenarioResult, variant: str, kw: dict, tpl: str, step: int, k: int, n: int, op: str,
                   mark: str, mix: int) -> None:
        from .faults import FaultyStorage, PowerCut, PowerLossStorage

        rng = random.Random(k * 1000 + mix) if mix else None
        target = self.case(f"power-{variant}-{k}-{mix}", kw, tpl)
        before = target.outside()
        storage = PowerLossStorage(target.run, journal_dir=self.journal_dir)
        faulty = FaultyStorage(storage)
        engine, model, buf = build(target.cfg, faulty)
        engine.catalog.refresh()

        def cut() -> None:
            storage.power_cut(rng)
            raise PowerCut("power cut")

        if k < n:
            faulty.before("*", cut, nth=k + 1)
            label = f"cut before op {k} ({op}, {mark})"
        else:
            label = "cut after the save returned"
        label += " (random mix)" if mix else ""
        acked = False
        try:
            save_step(engine, model, buf, step)
            acked = True
        except PowerCut:
            pass
        except CheckpointError as exc:
            part.violate(variant, label, "harness", f"save failed without a fault: {exc}")
        if acked and k < n:
            part.violate(variant, label, "harness", "cut point not reached")
        if acked:
            storage.power_cut(rng)
        storage.close()
        part.tried += 1
        part.injected["power cut, random mix of unsynced effects undone" if mix else
                      ("power cut after the save returned" if k == n else "power cut before op")] += 1
        must = ({2} if step == 3 else set()) | ({step} if acked else set())
        ok, _ = self.check(part, variant, label, target, must_list=must, allowed={1, 2, 3},
                           acked_max=max(must) if must else None, in_flight=step,
                           save_after=step + 1 if self.profile.power_save_after else None, outside_before=before)
        self.done(target, ok)

    # == 3. corruption ============================================================================
    def corruption(self) -> ScenarioResult:
        from .dedup import manifest_objects, object_path
        from .reader import read_manifest
        from .storage import LocalStorage

        res = ScenarioResult("corruption", "bit flips, truncation, deletion in every kind of file of a snapshot")
        jobs = []
        for dedup, aw in VARIANTS:
            variant = variant_name(dedup, aw)
            kw = {"dedup": dedup, "atomic_write": aw}
            tpl = self.template(variant, kw)
            store = LocalStorage(tpl)
            m1, m2 = read_manifest(store, "step_000000001"), read_manifest(store, "step_000000002")
            role_kind = {"tensors": "safetensors shard", "json": "JSON", "table": "Arrow table"}
            files = [(f"step_000000002/{f.path}", role_kind.get(f.role, f.role)) for f in m2.files]
            files.append(("step_000000002/meta.json", "manifest"))
            shared = manifest_objects(m1)
            for digest, (algo, _size) in sorted(manifest_objects(m2).items()):
                files.append((object_path(algo, digest), "dedup object (shared)" if digest in shared else "dedup object"))
            corruptions = [f"flip {w}" for w in self.profile.flips] + [f"truncate {w}" for w in self.profile.truncations]
            corruptions.append("delete")
            for i, (rel, kind) in enumerate(files):
                for j, how in enumerate(corruptions):
                    jobs.append(lambda part, variant=variant, kw=kw, tpl=tpl, rel=rel, kind=kind, how=how, aw=aw,
                                seed=i * 100 + j: self._corrupt_one(part, variant, kw, tpl, rel, kind, how, aw, seed))
            self.progress(f"  corruption {variant}: {len(files)} files x {len(corruptions)}")
        self.run_jobs(res, jobs)
        kinds = sorted({k.split(": ")[0] for k in res.notes if k.endswith(": injected")})
        for kind in kinds:
            res.notes[f"{kind} detected"] = f"{res.notes.pop(kind + ': detected', 0)}/{res.notes.pop(kind + ': injected')}"
        self._manifest_sweep(res)
        return res

    def _corrupt_one(self, part: ScenarioResult, variant: str, kw: dict, tpl: str, rel: str, kind: str, how: str,
                     aw: bool, seed: int) -> None:
        target = self.case(f"corrupt-{variant}-{kind}-{how}", kw, tpl)
        before = target.outside()
        corrupt_file(os.path.join(target.run, *rel.split("/")), how, random.Random(seed))
        part.tried += 1
        part.injected[how.split()[0]] += 1
        label = f"{how} {rel} ({kind})"
        by_design = kind == "manifest" and how == "delete" and not aw
        expect = None if kind == "dedup object (shared)" else 1
        outcome = self._judge_corruption(part, variant, label, target, expect, by_design)
        if by_design:
            part.note("manifest deleted on manifest-last: reads as never committed (by design)")
        else:
            part.corruptions_injected += 1
            part.note(f"{kind}: injected")
            if outcome == "detected":
                part.corruptions_detected += 1
                part.note(f"{kind}: detected")
            elif outcome != "corrupt load":
                part.violate(variant, label, "undetected", outcome)
        hit = {"step_000000001", "step_000000002"} if kind == "dedup object (shared)" else {"step_000000002"}
        ok, _ = self.check(part, variant, label, target, must_list=set(), allowed={1, 2, 3}, acked_max=None,
                           in_flight=None, save_after=3, outside_before=before, damaged=frozenset(hit))
        self.done(target, ok and outcome == "detected")

    def _judge_corruption(self, res: ScenarioResult, variant: str, label: str, target, expect: int | None,
                          by_design: bool) -> str:
        """'detected' when verify flags step 2 and restore neither loads it nor gives up needlessly."""
        engine, model, buf = build(target.cfg, target.storage())
        report = engine.verify()
        flagged = "step_000000002" in report.bad_snapshots
        try:
            result = engine.restore()
        except CheckpointError as exc:
            engine.close()
            if expect is None:
                return "detected" if flagged else "restore refused, verify silent"
            return f"restore gave up although step {expect} is intact: {exc}"
        engine.close()
        try:
            step, _ = observed(model, buf)
        except Mixed as exc:
            res.violate(variant, label, "corrupt_load", str(exc))
            return "corrupt load"
        if result.global_step != step:
            res.violate(variant, label, "corrupt_load", f"restore says step {result.global_step}, state is step {step}")
            return "corrupt load"
        if step == 2:
            return "undetected: restore loaded the damaged snapshot" + ("" if flagged else "; verify silent")
        if by_design:
            return "detected"
        if not flagged:
            return "verify silent (restore fell back)"
        if expect is not None and step != expect:
            return f"restore fell back to step {step}, expected {expect}"
        if "step_000000002" not in result.skipped:
            return "restore fell back without saying why"
        return "detected"

    def _manifest_sweep(self, res: ScenarioResult) -> None:
        """Flip the lowest bit of manifest bytes (digit -> digit, letter -> letter: the flips that still parse).

        The manifest has no checksum of its own, so this measures what a flip in it does: caught by
        verify, caught by restore only, unnoticed and harmless, or a corrupt load (a violation).
        """
        jobs = []
        for dedup, aw in self.profile.manifest_sweep_variants:
            variant = variant_name(dedup, aw)
            kw = {"dedup": dedup, "atomic_write": aw}
            tpl = self.template(variant, kw)
            with open(os.path.join(tpl, "step_000000002", "meta.json"), "rb") as f:
                original = f.read()
            positions = list(range(len(original)))
            if self.profile.manifest_flips is not None:
                chosen = set(random.Random(11).sample(positions, min(self.profile.manifest_flips, len(positions))))
                for key in MANIFEST_KEY_FIELDS:  # always: every byte of the values that say what a snapshot is
                    chosen.update(json_value_span(original, key))
                positions = sorted(chosen)
            jobs += [lambda part, variant=variant, kw=kw, tpl=tpl, original=original, pos=pos:
                     self._flip_manifest(part, variant, kw, tpl, original, pos) for pos in positions]
        sweep = ScenarioResult(res.key, res.title)
        self.run_jobs(sweep, jobs)
        notes = sweep.notes
        sweep.notes = {}
        res.merge(sweep)
        res.notes["manifest bit flips"] = sum(notes.get(f"sweep: {k}", 0) for k in SWEEP_OUTCOMES)
        for key in SWEEP_OUTCOMES:
            res.notes[f"manifest flips {key}"] = notes.get(f"sweep: {key}", 0)
        missed = {k.split(": ", 1)[1]: v for k, v in notes.items() if k.startswith("verify missed: ")}
        if missed:
            res.notes["manifest flips verify missed, by field"] = dict(sorted(missed.items(), key=lambda kv: -kv[1]))
        self.progress(f"  corruption: manifest sweep, {res.notes['manifest bit flips']} flips")

    def _flip_manifest(self, part: ScenarioResult, variant: str, kw: dict, tpl: str, original: bytes, pos: int) -> None:
        target = self.case(f"manifest-flip-{variant}-{pos}", kw, tpl)
        data = bytearray(original)
        data[pos] ^= 0x01
        with open(os.path.join(target.run, "step_000000002", "meta.json"), "wb") as f:
            f.write(data)
        part.tried += 1
        part.injected["manifest bit flip"] += 1
        field = manifest_field(original, pos)
        label = f"manifest bit flip at byte {pos} ({field}: {original[pos:pos + 1]!r} -> {bytes(data[pos:pos + 1])!r})"
        outcome = self._judge_corruption(part, variant, label, target, expect=1, by_design=False)
        if outcome == "corrupt load":
            part.note("sweep: corrupt load")
        elif outcome == "detected":
            part.note("sweep: caught by verify")
        elif outcome.startswith("verify silent"):
            part.note("sweep: caught by restore only")
            part.note(f"verify missed: {field}")
        elif outcome.startswith("undetected: restore loaded"):
            part.note("sweep: unnoticed, load unaffected")
            part.note(f"verify missed: {field}")
        elif outcome.startswith("restore gave up"):  # safe (nothing loaded), but no fallback to the intact step
            part.note("sweep: restore refused, no fallback")
            part.note(f"verify missed: {field}")
        else:
            part.violate(variant, label, "undetected", outcome)
        self.done(target, part.ok)

    # == 4. disk full / I/O errors ==================================================================
    def errors(self) -> ScenarioResult:
        res = ScenarioResult("errors", "ENOSPC, EIO and timeouts at every operation of a save, a retention pass and gc")
        jobs = []
        kinds = self.profile.error_kinds
        for dedup, aw in VARIANTS:
            variant = variant_name(dedup, aw)
            kw = {"dedup": dedup, "atomic_write": aw}
            tpl = self.template(variant, kw)
            ops = self.record_ops(tpl, kw, 3)
            marks = op_phases(ops)
            for k, (op, _path) in enumerate(ops):
                names = kinds if self.profile.every_error_kind else (kinds[(k + len(jobs)) % len(kinds)],)
                for name in names:
                    for when in self.profile.error_when:
                        jobs.append(lambda part, variant=variant, kw=kw, tpl=tpl, k=k, op=op, name=name, when=when,
                                    mark=marks[k]: self._error_at(part, variant, kw, tpl, k, op, name, when, mark))
            self.progress(f"  errors {variant}: {len(ops)} operations")
        jobs += self._gc_error_jobs()
        self.run_jobs(res, jobs)
        return res

    def _error_at(self, part: ScenarioResult, variant: str, kw: dict, tpl: str, k: int, op: str, name: str, when: str,
                  mark: str) -> None:
        from .faults import FaultyStorage
        from .storage import LocalStorage

        target = self.case(f"error-{variant}-{k}-{name}-{when}", kw, tpl)
        before = target.outside()
        faulty = FaultyStorage(LocalStorage(target.run))
        engine, model, buf = build(target.cfg, faulty)
        engine.catalog.refresh()
        faulty.fail("*", nth=k + 1, error=ERRORS[name], after=when == "after")
        label = f"{name} {when} op {k} ({op}, {mark})"
        part.tried += 1
        part.injected[f"{name} ({when} the call)"] += 1
        part.note(f"faults in phase {mark}")
        acked = self._expect_error(part, variant, label, lambda: save_step(engine, model, buf, 3), op)
        ok, _ = self.check(part, variant, label, target, must_list={2} | ({3} if acked else set()), allowed={1, 2, 3},
                           acked_max=3 if acked else 2, in_flight=3, save_after=4, outside_before=before)
        self.done(target, ok)

    def _expect_error(self, res: ScenarioResult, variant: str, label: str, fn: Callable, op: str) -> bool:
        """Run ``fn`` with a fault armed: a CheckpointError naming a path, or a fault absorbed. True if fn returned."""
        try:
            fn()
        except CheckpointError as exc:
            path = getattr(exc, "path", None)
            if not path and "/" not in str(exc):
                res.violate(variant, label, "error_without_path", f"{type(exc).__name__} names no path: {exc}")
            return False
        except Exception as exc:
            res.violate(variant, label, "not_a_checkpoint_error", f"{type(exc).__name__}: {exc}")
            return False
        res.note(f"faults absorbed (optional {op})")
        return True

    def _gc_error_jobs(self) -> list:
        from .faults import FaultyStorage
        from .storage import LocalStorage

        kw = {"dedup": True, "atomic_write": True}
        tpl_clean = self.template(variant_name(True, True), kw)
        tpl = os.path.join(self.root, "_templates", "gc-debris", "run")
        if not os.path.exists(tpl):
            shutil.copytree(tpl_clean, tpl, symlinks=True)
            plant_debris(tpl)
        probe = self.case("gc-record", kw, tpl)
        faulty = FaultyStorage(LocalStorage(probe.run))
        removed = run_gc(faulty)
        ops = list(faulty.ops)
        self.done(probe, True)
        self.progress(f"  errors gc: {len(ops)} operations ({removed} debris entries)")
        jobs = []
        kinds = self.profile.error_kinds
        for k, (op, _path) in enumerate(ops):
            names = kinds if self.profile.every_error_kind else (kinds[k % len(kinds)],)
            for name in names:
                for when in self.profile.error_when:
                    jobs.append(lambda part, k=k, op=op, name=name, when=when: self._gc_error_at(part, kw, tpl, k, op, name, when))
        return jobs

    def _gc_error_at(self, part: ScenarioResult, kw: dict, tpl: str, k: int, op: str, name: str, when: str) -> None:
        from .faults import FaultyStorage
        from .storage import LocalStorage

        variant = "gc/" + variant_name(True, True)
        target = self.case(f"gc-error-{k}-{name}-{when}", kw, tpl)
        before = target.outside()
        faulty = FaultyStorage(LocalStorage(target.run))
        faulty.fail("*", nth=k + 1, error=ERRORS[name], after=when == "after")
        label = f"gc: {name} {when} op {k} ({op})"
        part.tried += 1
        part.injected[f"{name} ({when} the call)"] += 1
        part.note("faults in gc")
        self._expect_error(part, variant, label, lambda: run_gc(faulty), op)
        ok, _ = self.check(part, variant, label, target, must_list={1, 2}, allowed={1, 2}, acked_max=2, in_flight=None,
                           save_after=3, outside_before=before)
        self.done(target, ok)

    # == 5. S3 ====================================================================================
    def s3_errors(self) -> ScenarioResult:
        from .faults import FaultyStorage
        from .storage import open_storage

        res = ScenarioResult("s3", "5xx-like errors at every request of a save on S3 (moto on 127.0.0.1)")
        s3 = self.s3()
        buckets, jobs = [], []
        for dedup in self.profile.s3_variants:
            variant = f"s3/{'dedup' if dedup else 'plain'}"
            kw = {"dedup": dedup}
            bucket = s3.bucket()
            buckets.append(bucket)
            probe = S3Target(s3, bucket, "record", kw)
            faulty = FaultyStorage(open_storage(run_url(probe.cfg), s3.options))
            engine, model, buf = build(probe.cfg, faulty)
            for step in (1, 2):
                save_step(engine, model, buf, step)
            faulty.ops.clear()
            save_step(engine, model, buf, 3)
            ops = list(faulty.ops)
            marks = op_phases(ops)
            indices = [k for k in range(len(ops)) if k % self.profile.s3_stride == 0 or marks[k] != "write"]
            for k in indices:
                for when in self.profile.s3_when:
                    jobs.append(lambda part, variant=variant, kw=kw, bucket=bucket, k=k, op=ops[k], when=when,
                                mark=marks[k]: self._s3_error_at(part, variant, kw, bucket, k, op, when, mark))
            self.progress(f"  s3 {variant}: {len(indices)} of {len(ops)} requests x {len(self.profile.s3_when)}")
        self.run_jobs(res, jobs)
        for bucket in buckets:
            s3.drop_bucket(bucket)
        return res

    def _s3_error_at(self, part: ScenarioResult, variant: str, kw: dict, bucket: str, k: int, op: tuple, when: str,
                     mark: str) -> None:
        from .faults import FaultyStorage

        target = S3Target(self.s3(), bucket, f"{k}-{when}", kw)
        faulty = FaultyStorage(target.storage())
        engine, model, buf = build(target.cfg, faulty)
        for step in (1, 2):
            save_step(engine, model, buf, step)
        before = target.outside()
        shown = op[1] or "."  # the run folder itself
        err = StorageError(f"injected fault: HTTP 503 SlowDown on {op[0]} {shown} (retries exhausted)", path=shown)
        faulty.fail("*", nth=k + 1, error=err, after=when == "after")
        label = f"503 {when} request {k} ({op[0]}, {mark})"
        part.tried += 1
        part.injected[f"S3 5xx ({when} the request)"] += 1
        part.note(f"faults in phase {mark}")
        acked = self._expect_error(part, variant, label, lambda: save_step(engine, model, buf, 3), op[0])
        self.check(part, variant, label, target, must_list={2} | ({3} if acked else set()), allowed={1, 2, 3},
                   acked_max=3 if acked else 2, in_flight=3, save_after=4, outside_before=before)

    # == 6. concurrent writers ======================================================================
    def concurrent(self) -> ScenarioResult:
        res = ScenarioResult("concurrent", "2, 4, 8 writers of the same step released together")
        for backend in ("local/rename", "local/manifest-last", "s3"):
            for n in self.profile.race_writers:
                for rnd in range(self.profile.race_rounds):
                    self._race(res, backend, n, rnd)
            self.progress(f"  concurrent {backend}: {len(self.profile.race_writers) * self.profile.race_rounds} races")
        return res

    def _race(self, res: ScenarioResult, backend: str, n: int, rnd: int) -> None:
        label = f"{n} writers, round {rnd}"
        env: dict = {}
        bucket = None
        if backend == "s3":
            s3 = self.s3()
            bucket = s3.bucket()
            target = S3Target(s3, bucket, "race")
            env = dict(s3.env)
        else:
            target = self.case(f"race-{backend}-{n}-{rnd}", {"atomic_write": backend == "local/rename"})
            os.makedirs(target.run, exist_ok=True)
        before = target.outside()
        step = 7
        barrier = self.ctx.Barrier(n)
        procs, pipes = [], []
        for writer in range(1, n + 1):
            recv, send = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(target=_child_race, args=(target.cfg, env, writer, step, barrier, send), daemon=True)
            proc.start()
            send.close()
            procs.append(proc)
            pipes.append(recv)
        outcomes = {}
        for writer, (proc, recv) in enumerate(zip(procs, pipes), start=1):
            try:
                outcomes[writer] = recv.recv() if recv.poll(180) else ("error", "no answer")
            except EOFError:
                outcomes[writer] = ("error", f"died (exit {proc.exitcode})")
            proc.join(30)
            recv.close()
        res.tried += 1
        res.injected[f"race of {n} writers"] += 1
        committed = [w for w, (what, _) in outcomes.items() if what == "committed"]
        errors = {w: msg for w, (what, msg) in outcomes.items() if what == "error"}
        res.note(f"{backend}: races")
        if errors:
            res.violate(backend, label, "race_error", f"writers failed with other errors: {errors}")
        if len(committed) != 1:
            res.violate(backend, label, "race", f"{len(committed)} writers committed: {committed}")
        else:
            res.note(f"{backend}: exactly one committed")
        res.note(f"{backend}: losers got CommitConflictError",
                 sum(1 for what, _ in outcomes.values() if what == "conflict"))
        ok, _ = self.check(res, backend, label, target, must_list={step}, allowed={step}, acked_max=step, in_flight=None,
                           writer=committed[0] if len(committed) == 1 else None, outside_before=before,
                           save_after=step + 1)
        if bucket is not None:
            self.s3().drop_bucket(bucket)
        else:
            self.done(target, ok)

    # == 7. malicious input ===========================================================================
    def malicious(self) -> ScenarioResult:
        res = ScenarioResult("malicious", "hostile snapshots: traversal, links, pickles, bad headers, bad Arrow, schema")
        for name, (dedup, fn) in MALICIOUS.items():
            variant = variant_name(dedup, True)
            kw = {"dedup": dedup}
            target = self.case(f"malicious-{name}", kw, self.template(variant, kw, steps=(1,)))
            marker = os.path.join(target.parent, "outside", "PWNED")
            expect = fn(target, marker)  # mutates the snapshot
            before = target.outside()
            res.tried += 1
            res.injected[name] += 1
            n = len(res.violations)
            engine, model, buf = build(target.cfg, target.storage())
            try:
                listed = [i.snapshot_id for i in engine.snapshots()] + [u.snapshot_id for u in engine.catalog.unreadable()]
                report = engine.verify()
                if expect == "flagged" and report.ok:
                    res.violate(variant, name, "undetected", "verify reports the hostile snapshot as OK")
                if expect == "unlisted" and listed:
                    res.violate(variant, name, "unexpected", f"{listed} listed")
                try:
                    result = engine.restore()
                except CheckpointError as exc:
                    res.note("refused with a CheckpointError")
                    if expect == "unlisted":
                        res.violate(variant, name, "restore_failed", f"restore failed on an unlisted snapshot: {exc}")
                else:
                    if not result.fresh:
                        res.violate(variant, name, "corrupt_load", f"restore loaded the hostile snapshot {result.snapshot_id}")
                    elif expect != "unlisted":
                        res.violate(variant, name, "unexpected", f"restore started fresh with {listed} listed")
                    else:
                        res.note("refused: never listed")
            except Exception as exc:
                res.violate(variant, name, "not_a_checkpoint_error", f"{type(exc).__name__}: {exc}")
            engine.close()
            try:
                target.gc()  # gc must not follow links or delete outside either
            except GcRefused as exc:
                res.note("gc refused to walk through it (exit 1, names the path)")
                if "link" not in str(exc) and "refused" not in str(exc):
                    res.violate(variant, name, "gc", f"gc failed without saying why: {exc}")
            except Exception as exc:
                res.violate(variant, name, "not_a_checkpoint_error", f"gc: {type(exc).__name__}: {exc}")
            if os.path.exists(marker):
                res.violate(variant, name, "unpickled", "a pickle payload was executed (marker file exists)")
            if target.outside() != before:
                res.violate(variant, name, "escape", "something outside the run folder changed")
            self.done(target, len(res.violations) == n)
        self.progress(f"  malicious: {len(MALICIOUS)} hand-made cases")
        self.malicious_generated(res)
        return res

    def malicious_generated(self, res: ScenarioResult) -> None:
        """The generated classes (:func:`hostile_cases`) against a run of steps 1 and 2: each must leave
        restore loading step 1, or step 2 exactly; the CLI exits 0 or 1 with at most one line of error."""
        templates, manifests = {}, {}
        for dedup in (False, True):
            templates[dedup] = self.template(variant_name(dedup, True), {"dedup": dedup}, steps=(1, 2))
            with open(os.path.join(templates[dedup], NEWEST, "meta.json")) as f:
                manifests[dedup] = json.load(f)
        cases = hostile_cases(manifests, self.profile.hostile_types_per_path)
        self.run_jobs(res, [self._hostile_job(case, templates[case.dedup]) for case in cases])
        families = collections.Counter(c.family for c in cases)
        self.progress("  malicious: " + ", ".join(f"{n} {family}" for family, n in families.items()) + " generated")

    def _hostile_job(self, case: HostileCase, template: str) -> Callable[[ScenarioResult], None]:
        def job(res: ScenarioResult) -> None:
            target = self.case(f"hostile-{case.family}", {"dedup": case.dedup}, template)
            case.mutate(target)
            res.tried += 1
            res.injected[case.family] += 1
            n = len(res.violations)
            check_hostile(res, target, case)
            self.done(target, len(res.violations) == n)
        job.__name__ = f"{case.family}: {case.name}"
        return job


SWEEP_OUTCOMES = ("caught by verify", "caught by restore only", "restore refused, no fallback",
                  "unnoticed, load unaffected", "corrupt load")


# -- helpers for the scenarios ---------------------------------------------------------------------


def op_phases(ops: list[tuple[str, str]]) -> list[str]:
    """Label each call of a save: 'write' (before the commit), 'commit', 'after-commit' (aliases, retention)."""
    commit = None
    for i, (op, path) in enumerate(ops):
        if op == "rename_dir" and not path.split(" -> ")[-1].startswith("."):
            commit = i
            break
        if op == "write" and path.count("/") == 1 and path.endswith("/meta.json"):
            commit = i
            break
    if commit is None:
        return ["write"] * len(ops)
    out = []
    for i, (op, _path) in enumerate(ops):
        if i < commit:
            out.append("write")
        elif i == commit or (op == "sync_dir" and all(o == "sync_dir" for o, _ in ops[commit + 1:i + 1])):
            out.append("commit")
        else:
            out.append("after-commit")
    return out


def corrupt_file(path: str, how: str, rnd: random.Random) -> None:
    if how == "delete":
        os.unlink(path)
        return
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if how.startswith("flip"):
        where = how.split()[1]
        pos = {"first": 0, "middle": len(data) // 2, "last": len(data) - 1}.get(where)
        if pos is None:
            pos = rnd.randrange(len(data))
        data[pos] ^= 0x10
    else:
        where = how.split()[1]
        data = {"tail": data[: max(0, len(data) - 7)], "half": data[: len(data) // 2], "empty": bytearray()}[where]
    with open(path, "wb") as f:
        f.write(data)


MANIFEST_KEY_FIELDS = ("global_step", "kind", "snapshot_id", "schema_version", "state_schema_version", "base_snapshot_id")


def json_value_span(manifest: bytes, key: str) -> range:
    """Byte positions of the value of top-level ``key`` in an indent=1 manifest (empty if absent)."""
    marker = b'\n "' + key.encode() + b'": '
    i = manifest.find(marker)
    if i < 0:
        return range(0)
    start = i + len(marker)
    end = manifest.find(b"\n", start)
    end = len(manifest) if end < 0 else end
    if manifest[end - 1:end] == b",":
        end -= 1
    return range(start, end)


def manifest_field(manifest: bytes, pos: int) -> str:
    """The top-level manifest key whose line holds byte ``pos`` (the manifest is indent=1 JSON)."""
    start = manifest.rfind(b"\n", 0, pos) + 1
    for line_start in _line_starts_backwards(manifest, start):
        line = manifest[line_start:manifest.find(b"\n", line_start) if manifest.find(b"\n", line_start) != -1 else None]
        if line.startswith(b' "'):
            return line[2:line.find(b'"', 2)].decode(errors="replace")
    return "(structure)"


def _line_starts_backwards(data: bytes, start: int):
    pos = start
    while pos >= 0:
        yield pos
        if pos == 0:
            return
        pos = data.rfind(b"\n", 0, pos - 1) + 1


def plant_debris(run: str) -> None:
    """Everything gc must remove, beside committed snapshots 1 and 2 (dedup)."""
    def put(rel: str, data: bytes = b"debris") -> None:
        full = os.path.join(run, *rel.split("/"))
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)

    shutil.copytree(os.path.join(run, "step_000000002"), os.path.join(run, ".staging", "step_000000005.host-1-2-dead0001"))
    put("step_000000006/host-1-2-dead0002/model.json")  # manifest-last attempt that never committed
    put(".trash/step_000000000.host-1-2-dead0003/model.json")  # an interrupted retirement
    put(".tmp-host-1-2-dead0004-meta.json")  # an interrupted write_atomic
    put("step_000000002/host-1-2-dead0005/model.json")  # a losing writer's attempt inside a committed snapshot
    algo = sorted(os.listdir(os.path.join(run, "objects")))[0]  # the checksum algorithm the objects are named by
    put(f"objects/{algo}/ff/ff" + "0" * 30)  # an object no manifest references
    put(f"objects/{algo}/ff/.tmp-host-1-2-dead0006-ff00")  # an interrupted object write


class Payload:
    """Unpickling this creates a marker file: proof that something unpickled our data."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _snap(target: LocalTarget, sid: str = "step_000000001") -> str:
    return os.path.join(target.run, sid)


def forge_json(doc: Any, raw: dict[str, str] | None = None) -> str:
    """JSON text of ``doc``, with each string value ``"<key>"`` of ``raw`` replaced by raw text: what Python's
    json cannot write itself (5000-digit numbers, nesting 100 000 deep)."""
    text = json.dumps(doc)
    for key, value in (raw or {}).items():
        text = text.replace(json.dumps(key), value)
    return text


def reseal(text: str) -> str:
    """Manifest text with its ``manifest_checksum`` recomputed, as anyone who can write the storage can.
    When Python cannot parse it (too deep, too many digits) no checksum can be computed: a dummy is put
    in, and the parser must refuse the file before it looks at the checksum."""
    from .manifest import manifest_checksum

    try:
        doc = json.loads(text)
        doc.pop("manifest_checksum", None)
        checksum = manifest_checksum(doc)
    except (ValueError, RecursionError, TypeError, AttributeError):
        checksum = "xxh3_128:" + "0" * 32
    body = text.rstrip()
    if not body.endswith("}"):
        return body
    body = body[:-1].rstrip()
    return body + ("" if body.endswith("{") else ", ") + json.dumps("manifest_checksum") + ": " + json.dumps(checksum) + "}"


def _manifest(target: LocalTarget, mutate: Callable[[dict], None], sid: str = "step_000000001",
              raw: dict[str, str] | None = None) -> None:
    path = os.path.join(_snap(target, sid), "meta.json")
    with open(path) as f:
        meta = json.load(f)
    meta.pop("manifest_checksum", None)
    mutate(meta)
    with open(path, "w") as f:
        f.write(reseal(forge_json(meta, raw)))


def _replace_file(target: LocalTarget, name: str, data: bytes, fix_checksum: bool = True,
                  sid: str = "step_000000001") -> None:
    """Put ``data`` in place of a snapshot file and (as an attacker would) make the manifest agree."""
    with open(os.path.join(_snap(target, sid), name), "wb") as f:
        f.write(data)
    if fix_checksum:
        def fix(meta: dict) -> None:
            for f in meta["files"]:
                if f["path"] == name:
                    f["size"], f["checksum"] = len(data), digest_bytes(f["algo"], data)
        _manifest(target, fix, sid)


def _read(target: LocalTarget, name: str, sid: str = "step_000000001") -> bytes:
    with open(os.path.join(_snap(target, sid), name), "rb") as f:
        return f.read()


def _secret(target: LocalTarget) -> str:
    return os.path.join(target.parent, "outside", "secret.txt")


def _mal_path(path_of: Callable[[LocalTarget], str]):
    def fn(target: LocalTarget, marker: str) -> str:
        _manifest(target, lambda m: m["files"][0].update(path=path_of(target)))
        return "flagged"
    return fn


def _mal_symlink_shard(target: LocalTarget, marker: str) -> str:
    shard = os.path.join(_snap(target), "model.safetensors")
    copy = os.path.join(target.parent, "outside", "model.safetensors")
    shutil.copy2(shard, copy)  # identical bytes: only the link itself is wrong
    os.unlink(shard)
    os.symlink(copy, shard)
    return "flagged"


def _mal_symlink_manifest(target: LocalTarget, marker: str) -> str:
    meta = os.path.join(_snap(target), "meta.json")
    copy = os.path.join(target.parent, "outside", "meta.json")
    shutil.copy2(meta, copy)
    os.unlink(meta)
    os.symlink(copy, meta)
    return "flagged"


def _mal_symlink_snapshot(target: LocalTarget, marker: str) -> str:
    moved = os.path.join(target.parent, "outside", "moved-snapshot")
    os.rename(_snap(target), moved)
    os.symlink(moved, _snap(target))
    return "unlisted"  # a linked snapshot folder is never listed


def _mal_symlink_object(target: LocalTarget, marker: str) -> str:
    objects = os.path.join(target.run, "objects")
    objects = os.path.join(objects, sorted(os.listdir(objects))[0])  # objects/<algo>
    prefix = sorted(os.listdir(objects))[0]
    copy = os.path.join(target.parent, "outside", "objects-" + prefix)
    shutil.copytree(os.path.join(objects, prefix), copy)
    shutil.rmtree(os.path.join(objects, prefix))
    os.symlink(copy, os.path.join(objects, prefix))
    return "flagged"


def _mal_pickle_shard(target: LocalTarget, marker: str) -> str:
    _replace_file(target, "model.safetensors", pickle.dumps({"weight": Payload(marker)}))
    return "refused"


def _mal_torch_save_shard(target: LocalTarget, marker: str) -> str:
    buf = io.BytesIO()
    torch.save({"weight": Payload(marker)}, buf)  # a zip-pickle, what torch.load would execute
    _replace_file(target, "model.safetensors", buf.getvalue())
    return "refused"


def _mal_pickle_json(target: LocalTarget, marker: str) -> str:
    _replace_file(target, "model.json", pickle.dumps(Payload(marker)))
    return "refused"


def _mal_safetensors_header(kind: str):
    def fn(target: LocalTarget, marker: str) -> str:
        good = _read(target, "model.safetensors")
        (n,) = struct.unpack("<Q", good[:8])
        header = json.loads(good[8:8 + n])
        if kind == "huge":
            data = struct.pack("<Q", 2**40) + good[8:]
        elif kind == "past-end":
            data = struct.pack("<Q", len(good) + 10) + good[8:]
        else:
            key = next(k for k in header if k != "__metadata__")
            header[key]["data_offsets"] = [0, 10**12]
            blob = json.dumps(header).encode()
            data = struct.pack("<Q", len(blob)) + blob + good[8 + n:]
        _replace_file(target, "model.safetensors", data)
        return "refused"
    return fn


def _mal_arrow(where: str):
    def fn(target: LocalTarget, marker: str) -> str:
        name = "replay_buffer.t0.arrow"
        data = bytearray(_read(target, name))
        (footer,) = struct.unpack("<i", data[-10:-6])
        if where == "footer-length":
            data[-10:-6] = struct.pack("<i", 10**8)  # the footer "starts" before the file does
        elif where == "footer":
            start = len(data) - 10 - footer
            data[start + 4:start + 36] = b"\xff" * 32
        else:  # the first record batch's metadata
            first = data.find(b"\xff\xff\xff\xff", 16)
            data[first + 8:first + 40] = b"\x7f" * 32
        _replace_file(target, name, bytes(data))
        return "refused"
    return fn


def _mal_schema(version: int):
    def fn(target: LocalTarget, marker: str) -> str:
        _manifest(target, lambda m: m.update(schema_version=version))
        return "flagged"
    return fn


def _mal_state_schema(target: LocalTarget, marker: str) -> str:
    _manifest(target, lambda m: m.update(state_schema_version=7))
    return "refused"  # intact bytes (verify may pass), but restore must refuse the layout


def _mal_objects_algo(algo: str):
    def fn(target: LocalTarget, marker: str) -> str:
        def mutate(m: dict) -> None:
            m["components"]["model"]["objects_algo"] = algo
        _manifest(target, mutate)
        return "flagged"
    return fn


def _mal_object_digest(target: LocalTarget, marker: str) -> str:
    def mutate(m: dict) -> None:
        chunks = m["components"]["model"]["objects"]["weight"]
        chunks[0][0] = "../../../outside/secret.txt"
    _manifest(target, mutate)
    return "flagged"


def _mal_nested_json(target: LocalTarget, marker: str) -> str:
    _replace_file(target, "model.json", b"[" * 200000 + b"]" * 200000)
    return "refused"


def _mal_missing_tensor(target: LocalTarget, marker: str) -> str:
    tree = json.loads(_read(target, "model.json"))
    tree_text = json.dumps(tree).replace('"weight"', '"no_such_tensor"', 1)
    _replace_file(target, "model.json", tree_text.encode())
    return "refused"


def _mal_listed_twice(target: LocalTarget, marker: str) -> str:
    _manifest(target, lambda m: m["files"].append(dict(m["files"][0])))
    return "flagged"


def _mal_renamed_copy(target: LocalTarget, marker: str) -> str:
    os.rename(_snap(target), _snap(target, "step_000000005"))
    return "flagged"


def _mal_manifest_not_json(target: LocalTarget, marker: str) -> str:
    with open(os.path.join(_snap(target), "meta.json"), "wb") as f:
        f.write(pickle.dumps(Payload(marker)))
    return "flagged"


# name -> (dedup, mutate(target, marker) -> expectation): "flagged" (listed; verify flags it; restore refuses),
# "refused" (listed; restore refuses; verify may pass: the attacker made the checksums agree, so only
# decoding can tell), "unlisted" (never listed, never read)
MALICIOUS: dict[str, tuple[bool, Callable[[LocalTarget, str], str]]] = {
    "path traversal ../../outside/secret.txt": (False, _mal_path(lambda t: "../../outside/secret.txt")),
    "path traversal a/../../x": (False, _mal_path(lambda t: "a/../../x")),
    "absolute path to a file outside": (False, _mal_path(_secret)),
    "absolute path /etc/passwd": (False, _mal_path(lambda t: "/etc/passwd")),
    "empty path part a//b": (False, _mal_path(lambda t: "a//b")),
    "symlinked shard (identical bytes)": (False, _mal_symlink_shard),
    "symlinked manifest": (False, _mal_symlink_manifest),
    "symlinked snapshot folder": (False, _mal_symlink_snapshot),
    "symlinked dedup object folder": (True, _mal_symlink_object),
    "pickle payload as shard (checksum fixed)": (False, _mal_pickle_shard),
    "torch.save zip-pickle as shard (checksum fixed)": (False, _mal_torch_save_shard),
    "pickle payload as JSON structure file": (False, _mal_pickle_json),
    "pickle payload as manifest": (False, _mal_manifest_not_json),
    "safetensors header length 2^40": (False, _mal_safetensors_header("huge")),
    "safetensors header past end of file": (False, _mal_safetensors_header("past-end")),
    "safetensors offsets beyond the data": (False, _mal_safetensors_header("offsets")),
    "Arrow footer length past the file (checksum fixed)": (False, _mal_arrow("footer-length")),
    "Arrow footer garbage (checksum fixed)": (False, _mal_arrow("footer")),
    "Arrow record batch metadata garbage (checksum fixed)": (False, _mal_arrow("batch")),
    "manifest schema_version 99": (False, _mal_schema(99)),
    "manifest schema_version 0": (False, _mal_schema(0)),
    "state schema_version mismatch": (False, _mal_state_schema),
    "dedup objects_algo with traversal": (True, _mal_objects_algo("../../../outside")),
    "dedup unknown objects_algo": (True, _mal_objects_algo("md5")),
    "dedup object digest with traversal": (True, _mal_object_digest),
    "JSON nested 200000 deep": (False, _mal_nested_json),
    "JSON references a missing tensor": (False, _mal_missing_tensor),
    "manifest lists a file twice": (False, _mal_listed_twice),
    "snapshot copied under another step's name": (False, _mal_renamed_copy),
}


# -- generated hostile inputs: classes of input, swept, not hand-listed ----------------------------

NEWEST = "step_000000002"
HOSTILE_DEPTHS = (8, 62, 66, 900, 1000, 100000)  # nesting around the manifest's limit (64) and Python's (~1000)
HOSTILE_DIGITS = (18, 19, 20, 300, 4300, 4301, 5000)  # around int64 and Python's int-parsing limit (4300)
# one value of every JSON type, plus integers out of the ranges the core accepts
HOSTILE_TYPES: tuple = (None, True, 7, -1, 2**64, 1.5, "x", [], {}, [["x", 1]])
# names a careless parser reads as step 2 or 3; only the canonical ``step_000000002`` is a snapshot
FOREIGN_NAMES = ("step_0000000002", "step_\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0663",
                 "step_\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff13", "step_000000003\n",
                 "step_000000003.b0", "step_000000003.b01", " step_000000003", "step_000000003.light ", "STEP_000000003",
                 "step_00000003", "step_000000003.b1.light.light")
RECORD_FOLDERS = ("decisions", "quarantine", "failures", "history/retired", "best")


@dataclasses.dataclass
class HostileCase:
    """One generated hostile input, applied to the newest snapshot of a run holding steps 1 and 2."""

    family: str
    name: str
    dedup: bool
    mutate: Callable[[LocalTarget], None]
    must_refuse: bool = False  # restore must fall back to step 1 (else: step 1, or step 2 loaded exactly)
    foreign: str | None = None  # a folder that must never be listed, restored or removed by gc


def json_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a parsed JSON document (object keys and list indexes), containers and leaves."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        out.append(prefix + (key,))
        out += json_paths(child, prefix + (key,))
    return out


def _set_path(doc: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _show_path(path: tuple) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _in_manifest(path: tuple, raw_text: str):
    def mutate(target: LocalTarget) -> None:
        _manifest(target, lambda m: _set_path(m, path, "@RAW@"), NEWEST, raw={"@RAW@": raw_text})
    return mutate


def _in_model_json(raw_text: str):
    def mutate(target: LocalTarget) -> None:
        tree = _read(target, "model.json", NEWEST).decode()
        assert '"s2"' in tree, "the suite model's tag is no longer in model.json"
        _replace_file(target, "model.json", tree.replace('"s2"', raw_text, 1).encode(), sid=NEWEST)
    return mutate


def _in_safetensors_header(where: str, raw_text: str):
    def mutate(target: LocalTarget) -> None:
        good = _read(target, "model.safetensors", NEWEST)
        (n,) = struct.unpack("<Q", good[:8])
        header = json.loads(good[8:8 + n])
        if where == "__metadata__":
            header["__metadata__"] = {"x": "@RAW@"}
        elif where == "empty tensor":  # a tensor of no bytes at the end: only its shape can be wrong
            end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
            header["extra"] = {"dtype": "F32", "shape": "@RAW@", "data_offsets": [end, end]}
        else:
            key, field, index = where.split(":")
            header[key][field][int(index)] = "@RAW@"
        blob = forge_json(header, {"@RAW@": raw_text}).encode()
        blob += b" " * (-(len(blob) + 8) % 8)
        _replace_file(target, "model.safetensors", struct.pack("<Q", len(blob)) + blob + good[8 + n:], sid=NEWEST)
    return mutate


def _plant_record(folder: str, raw_text: str):
    def mutate(target: LocalTarget) -> None:
        os.makedirs(os.path.join(target.run, folder), exist_ok=True)
        name = f"{NEWEST}.json" if folder in ("quarantine", "history/retired") else "avg_reward.json" \
            if folder == "best" else "2026-01-01T000000.000000p0000-restore.json"
        with open(os.path.join(target.run, folder, name), "w") as f:
            f.write(raw_text)
    return mutate


def _plant_foreign(name: str):
    def mutate(target: LocalTarget) -> None:
        # a copy of step 2 whose manifest (checksum recomputed) claims the name's step: a newer snapshot
        # to anyone who reads the name carelessly
        dst = os.path.join(target.run, name)
        shutil.copytree(_snap(target, NEWEST), dst)
        path = os.path.join(dst, "meta.json")
        with open(path) as f:
            meta = json.load(f)
        meta.pop("manifest_checksum", None)
        meta.update(snapshot_id="step_000000003", global_step=3)
        with open(path, "w") as f:
            f.write(reseal(json.dumps(meta)))
    return mutate


def _cli_run(argv: list[str]) -> tuple[int, str, str]:
    """``rl-ckpt ARGV`` in this process: (exit status, stdout, stderr); one at a time (stdout is process-wide)."""
    from .cli import main as cli

    out, err = io.StringIO(), io.StringIO()
    with _CLI_LOCK, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli(argv)
    return rc, out.getvalue(), err.getvalue()


def check_hostile(res: ScenarioResult, target: LocalTarget, case: HostileCase) -> None:
    """Restore falls back to step 1 (or loads step 2 exactly), the CLI answers with an exit status and at
    most one line of error, gc leaves foreign folders alone."""
    from .manifest import parse_snapshot_id
    from .reader import read_manifest

    variant, label = variant_name(case.dedup, True), f"{case.family}: {case.name}"
    engine, model, buf = build(target.cfg, target.storage())
    try:
        listed = [i.snapshot_id for i in engine.snapshots()]
        if case.foreign is not None and listed != ["step_000000001", NEWEST]:
            res.violate(variant, label, "unexpected", f"listed {listed}")
        result = engine.restore()
        step = observed(model, buf)[0]
        parsed = parse_snapshot_id(result.snapshot_id or "")
        if result.snapshot_id not in ("step_000000001", NEWEST) or parsed is None or parsed[0] != step:
            res.violate(variant, label, "corrupt_load", f"restored {result.snapshot_id!r} holding step {step}")
        elif result.snapshot_id == NEWEST and case.must_refuse:
            res.violate(variant, label, "not_refused", "restore loaded a snapshot it had to refuse")
        else:
            res.note("refused: restore fell back to step 1" if step == 1 else "harmless: step 2 loaded exactly")
    except Mixed as exc:
        res.violate(variant, label, "corrupt_load", str(exc))
    except CheckpointError as exc:
        res.violate(variant, label, "no_fallback", f"restore did not fall back to step 1: {exc}")
    except Exception as exc:
        res.violate(variant, label, "not_a_checkpoint_error", f"restore: {type(exc).__name__}: {exc}")
    finally:
        engine.close()
    manifest_refused = True
    try:
        read_manifest(target.storage(), NEWEST)
        manifest_refused = False
    except CheckpointError:
        pass
    except Exception as exc:
        res.violate(variant, label, "not_a_checkpoint_error", f"read_manifest: {type(exc).__name__}: {exc}")
    export = os.path.join(target.parent, "export.safetensors")
    for argv in (["ls", target.run], ["ls", target.run, "--deep"], ["verify", target.run], ["plan", target.run],
                 ["inspect", target.run, NEWEST], ["export", target.run, NEWEST, "model", "-o", export]):
        command = " ".join(argv[:1] + argv[2:3])
        try:
            rc, out, err = _cli_run(argv)
        except Exception as exc:
            res.violate(variant, label, "not_a_checkpoint_error", f"rl-ckpt {command}: {type(exc).__name__}: {exc}")
            continue
        errors = [line for line in err.splitlines() if line.startswith("rl-ckpt ")]  # log records aside
        if rc not in (0, 1) or "Traceback" in err or len(errors) > 1:
            res.violate(variant, label, "cli", f"rl-ckpt {command} exited {rc} with {len(errors)} error lines: {err[-300:]}")
        elif manifest_refused and argv[0] in ("ls", "verify", "inspect", "export") and rc != 1:
            res.violate(variant, label, "cli", f"rl-ckpt {command} exited {rc} though {NEWEST}'s manifest is refused")
        elif case.foreign is not None and argv[1:] == [target.run, "--deep"] and (rc != 1 or "FOREIGN" not in out):
            res.violate(variant, label, "cli", f"rl-ckpt ls --deep does not show the foreign folder (exit {rc})")
    try:
        target.gc()
    except Exception as exc:
        res.violate(variant, label, "not_a_checkpoint_error", f"gc: {type(exc).__name__}: {exc}")
    if case.foreign is not None and not os.path.isdir(os.path.join(target.run, case.foreign)):
        res.violate(variant, label, "gc", "gc removed a foreign folder as if it were a snapshot's debris")


def hostile_cases(manifests: dict[bool, dict], types_per_path: int | None) -> list[HostileCase]:
    """Every generated case. ``manifests``: the newest manifest of the dedup off/on templates, whose every
    field gets values of the wrong JSON type (``types_per_path`` of them in rotation; None: all)."""
    cases = []
    for dedup, meta in manifests.items():
        meta = {k: v for k, v in meta.items() if k != "manifest_checksum"}
        for i, path in enumerate(json_paths(meta)):
            original = meta
            for key in path:
                original = original[key]
            wrong = [v for v in HOSTILE_TYPES if type(v) is not type(original)
                     or (type(v) is int and not 0 <= v < 2**63)]
            if types_per_path is not None:
                wrong = [wrong[(i + j) % len(wrong)] for j in range(min(types_per_path, len(wrong)))]
            for value in wrong:
                cases.append(HostileCase("wrong JSON type", f"{_show_path(path)} = {json.dumps(value)}", dedup,
                                         _in_manifest(path, json.dumps(value))))
    free = {"manifest tags.x": ("tags", "x"), "manifest config.x": ("config", "x"), "manifest extra.x": ("extra", "x"),
            "manifest components.model.x (a key the core does not know)": ("components", "model", "x")}
    core = {"manifest global_step": ("global_step",), "manifest files[0].size": ("files", 0, "size"),
            "manifest tensor shape": ("components", "model", "tensors", "weight", "shape", 0)}
    for depth in HOSTILE_DEPTHS:
        text = _nested(depth)
        for label, path in free.items():
            cases.append(HostileCase("nesting depth", f"{label} nested {depth}", False, _in_manifest(path, text),
                                     must_refuse=depth > 64))
        cases.append(HostileCase("nesting depth", f"model.json value nested {depth}", False, _in_model_json(text),
                                 must_refuse=depth >= 1000))
        cases.append(HostileCase("nesting depth", f"safetensors __metadata__ nested {depth}", False,
                                 _in_safetensors_header("__metadata__", text), must_refuse=depth >= 1000))
        for folder in RECORD_FOLDERS:
            cases.append(HostileCase("nesting depth", f"{folder}/ record nested {depth}", False, _plant_record(folder, text)))
    for digits in HOSTILE_DIGITS:
        text = "9" * digits
        for label, path in {**free, **core}.items():
            cases.append(HostileCase("number size", f"{label} of {digits} digits", False, _in_manifest(path, text),
                                     must_refuse=label in core or digits > 4300))
        cases.append(HostileCase("number size", f"model.json value of {digits} digits", False, _in_model_json(text),
                                 must_refuse=digits > 4300))
        for where in ("__metadata__", "weight:shape:0", "weight:data_offsets:1"):
            cases.append(HostileCase("number size", f"safetensors {where} of {digits} digits", False,
                                     _in_safetensors_header(where, text), must_refuse=where != "__metadata__" or digits > 4300))
        for folder in RECORD_FOLDERS:
            cases.append(HostileCase("number size", f"{folder}/ record of {digits} digits", False,
                                     _plant_record(folder, f'{{"snapshot_id": "{NEWEST}", "step": {text}, "global_step": {text}}}')))
    for shape in ([0, 2**64], [0, 2**62, 2**62], [0] + [2**40] * 3, [0] * 65):
        cases.append(HostileCase("number size", f"safetensors empty tensor of shape {shape[:5]}", False,
                                 _in_safetensors_header("empty tensor", json.dumps(shape)), must_refuse=True))
    for folder in RECORD_FOLDERS:
        for value in HOSTILE_TYPES + ({"snapshot_id": [1], "global_step": "x", "kind": 5, "metric": []},):
            cases.append(HostileCase("wrong JSON type", f"{folder}/ record = {json.dumps(value)}", False,
                                     _plant_record(folder, json.dumps(value))))
    for name in FOREIGN_NAMES:
        cases.append(HostileCase("non-canonical name", f"folder {name!r}", False, _plant_foreign(name), foreign=name))
    return cases


# -- entry points ------------------------------------------------------------------------------------


def machine_info() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__}


def run_suite(mode: str = "quick", base_dir: str | None = None, *, scenarios: tuple[str, ...] | list[str] | None = None,
              s3_storage_options: dict | None = None, progress: Callable[[str], None] | None = None) -> SuiteReport:
    """Run the suite; returns a :class:`SuiteReport` (``.ok``, ``.table()``, ``.to_json()``)."""
    chosen = list(scenarios or SCENARIOS)
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenario(s) {sorted(unknown)}; choose from {SCENARIOS}")
    logger = logging.getLogger("rl_ckpt")
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.CRITICAL)
    logger.propagate = False
    started = time.perf_counter()
    report = SuiteReport(mode, _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), machine_info(), [])
    suite = Suite(mode, base_dir, s3_storage_options=s3_storage_options, progress=progress)
    methods = {"sigkill": suite.sigkill, "power": suite.power, "corruption": suite.corruption, "errors": suite.errors,
               "s3": suite.s3_errors, "concurrent": suite.concurrent, "malicious": suite.malicious}
    try:
        for key in chosen:
            t0 = time.perf_counter()
            suite.progress(f"{key} ...")
            result = methods[key]()
            result.seconds = time.perf_counter() - t0
            report.scenarios.append(result)
            suite.progress(f"{key}: {result.tried} cases, {len(result.violations)} violations, {result.seconds:.1f}s")
    finally:
        suite.close()
        logger.setLevel(level)
        logger.propagate = propagate
    report.seconds = time.perf_counter() - started
    if suite.kept:
        report.machine["kept_failed_cases"] = suite.kept
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl_ckpt.fault_suite", description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="mode", action="store_const", const="quick", help="the quick suite (default, < 90 s)")
    g.add_argument("--long", dest="mode", action="store_const", const="long", help="the long suite (10-20 minutes)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    p.add_argument("--base-dir", default=None,
                   help="where the suite's working folder goes (default: the temp dir); removed after the run "
                        "unless a case failed (failed cases are kept there and listed in the report)")
    p.add_argument("--only", nargs="+", choices=SCENARIOS, help="run only these scenarios")
    p.add_argument("-q", "--no-progress", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    progress = None if args.no_progress else (lambda msg: print(msg, file=sys.stderr, flush=True))
    report = run_suite(args.mode or "quick", args.base_dir, scenarios=args.only, progress=progress)
    if args.json:
        print(json.dumps(report.to_json(), indent=1, default=str))
    else:
        print(report.table())
    return 0 if report.ok else 1


if __name__ == "__main__":
    # Child processes find their targets in the importable rl_ckpt.fault_suite; without a spec and a file
    # for __main__, multiprocessing does not re-run this file as each child's __main__.
    _this = sys.modules["__main__"]
    _this.__spec__ = None
    del _this.__file__
    from rl_ckpt.fault_suite import main as _main

    sys.exit(_main())
