"""Shared pieces of the fault suite: profiles, the saved state, engine set-up and the child-process targets."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
from typing import Any

import numpy as np
import torch

from rl_ckpt.errors import CommitConflictError


SCENARIOS = ("sigkill", "power", "corruption", "errors", "s3", "concurrent", "malicious", "sharded")
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
    sharded_kill_stride: int = 3  # the 2-rank sharded save: a kill before every n-th storage call of each rank


PROFILES = {
    "quick": Profile("quick"),
    "long": Profile(
        "long",
        kill_after_phases=("write", "commit", "after-commit"),
        random_kills=400,
        random_kill_max_delay=0.4,
        power_mixes=4,
        power_save_after=True,
        s3_variants=(False, True),
        flips=("first", "middle", "last", "random", "random"),
        truncations=("tail", "half", "empty"),
        manifest_flips=None,
        manifest_sweep_variants=((False, True), (True, True), (False, False)),
        error_when=("before", "after"),
        every_error_kind=True,
        s3_when=("before", "after"),
        s3_stride=1,
        race_rounds=8,
        hostile_types_per_path=None,
        sharded_kill_stride=1,
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
        return {
            "weight": self.weight,
            "counts": self.counts,
            "frozen": self.frozen,
            "step": self.step,
            "writer": self.writer,
            "info": {"stamp": stamp(self.step, self.writer), "tag": f"s{self.step}"},
        }

    def load_state_dict(self, state: dict) -> None:
        self.step, self.writer = state["step"], state["writer"]
        self.weight, self.counts, self.frozen = (
            state["weight"].clone(),
            state["counts"].clone(),
            state["frozen"].clone(),
        )
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
        table = pa.table(
            {
                "stamp": pa.array([value] * 32, type=pa.int64()),
                "episode": pa.array(range(32), type=pa.int64()),
                "rewards": pa.array([[float(value)] * (i % 3) for i in range(32)], type=pa.list_(pa.float64())),
            }
        )
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


def engine_cfg(
    base_dir: str,
    *,
    dedup: bool = False,
    atomic_write: bool = True,
    run_name: str = "run",
    storage_options: dict | None = None,
    **extra: Any,
) -> dict:
    cfg = {
        "base_dir": base_dir,
        "run_name": run_name,
        "dedup": dedup,
        "atomic_write": atomic_write,
        "keep_latest": 2,
        "keep_best": 1,
        "best_metric": "avg_reward",
        "best_mode": "max",
    }
    if storage_options:
        cfg["storage_options"] = storage_options
    cfg.update(extra)
    return cfg


def run_url(cfg: dict) -> str:
    return cfg["base_dir"].rstrip("/") + "/" + cfg["run_name"]


def build(cfg: dict, storage=None, **kwargs: Any):
    """(engine, model, buffer): an engine with the suite's two components registered."""
    from rl_ckpt._core.engine import CheckpointEngine

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


def child_init(env: dict | None = None) -> None:
    torch.set_num_threads(1)
    logging.getLogger("rl_ckpt").setLevel(logging.CRITICAL)
    logging.getLogger("rl_ckpt").propagate = False
    if env:
        os.environ.update(env)


def child_kill_at(cfg: dict, step: int, nth: int, expect_op: str, when: str, conn) -> None:
    """Save ``step``; SIGKILL ourselves right before/after the nth storage call (of any kind)."""
    child_init()
    from rl_ckpt.tools.faults import FaultyStorage
    from rl_ckpt._storage import open_storage

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


def child_save_loop(cfg: dict, start: int, conn) -> None:
    """Save start, start+1, ... until killed; ACK each step after save() returned."""
    child_init()
    engine, model, buf = build(cfg)
    conn.send_bytes(b"ready")
    step = start
    while True:
        save_step(engine, model, buf, step)
        conn.send_bytes(b"%d" % step)  # a pipe write: the ACK survives our death
        step += 1


def child_race(cfg: dict, env: dict, writer: int, step: int, barrier, conn) -> None:
    """Build an engine, wait for the others, then save ``step`` with this writer's values."""
    child_init(env)
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
        elif i == commit or (op == "sync_dir" and all(o == "sync_dir" for o, _ in ops[commit + 1 : i + 1])):
            out.append("commit")
        else:
            out.append("after-commit")
    return out
