"""The background half of a two-phase save: one writer thread, one save in flight.

``SaveHandle`` is what ``engine.save_async`` returns: ``done()``, ``wait()``
(returns the committed ``SnapshotInfo`` or re-raises the save's error) and
``add_done_callback``; ``warnings`` lists housekeeping after the commit that
failed (the save itself succeeded). A failed background save is also logged, so an error is
never lost even if nobody waits on the handle.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
from typing import Any, Callable

from rl_ckpt._run.catalog import SnapshotInfo

log = logging.getLogger("rl_ckpt")


class SaveHandle:
    """One background save. ``call_seconds``: how long the ``save_async`` call blocked; ``hook_wait_seconds``:
    how long the trainer waited since, in hooks before changing state not yet copied; ``stage_seconds``: both."""

    def __init__(self, future: cf.Future, global_step: int, kind: str, stage_seconds: float, stage: Any = None) -> None:
        self._future = future
        self._stage = stage  # the StageRound copying the state (core/stage_guard.py), if any
        self.global_step = global_step
        self.kind = kind
        self.call_seconds = stage_seconds

    @property
    def hook_wait_seconds(self) -> float:
        """Time the trainer waited in hooks (optimizer step, forward, load_state_dict) for this save's copy."""
        return self._stage.hook_wait_seconds if self._stage is not None else 0.0

    @property
    def stage_seconds(self) -> float:
        """How long the caller was blocked: the call plus any wait in a hook (grows until ``staged()``)."""
        return self.call_seconds + self.hook_wait_seconds

    @property
    def copy_seconds(self) -> float | None:
        """How long the background copy took (what a change right after the call would wait); None until staged."""
        return self._stage.copy_seconds if self._stage is not None else 0.0

    def staged(self) -> bool:
        """True once the state this save holds is copied: the trainer may change anything without waiting."""
        return self._stage is None or self._stage.staged

    def wait_staged(self) -> None:
        """Block until the state is copied (for state changed outside the guarded paths: see core/stage_guard.py)."""
        if self._stage is not None:
            self._stage.before_change()

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SnapshotInfo:
        """Block until committed; returns its SnapshotInfo or raises the save's error."""
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    @property
    def warnings(self) -> list[str]:
        """What failed after the commit point (best alias, retention); the snapshot itself is committed.

        Empty while the save runs or when it failed (then ``exception()`` says why)."""
        if not self._future.done() or self._future.exception() is not None:
            return []
        return list(self._future.result().warnings)

    def add_done_callback(self, fn: Callable[["SaveHandle"], None]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"SaveHandle(step={self.global_step}, kind={self.kind}, {state})"


class BackgroundWriter:
    """A single writer thread: persisting never overlaps, and fails loudly."""

    def __init__(self, nice: int = 0) -> None:
        self._pool = cf.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="rl_ckpt-writer", initializer=_lower_priority, initargs=(nice,)
        )
        self._lock = threading.Lock()
        self._current: SaveHandle | None = None

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._current is not None and not self._current.done()

    def wait_idle(self) -> None:
        """Wait for the save in flight (its error stays on its handle)."""
        with self._lock:
            current = self._current
        if current is not None:
            cf.wait([current._future])

    def submit(
        self, fn: Callable[[], SnapshotInfo], global_step: int, kind: str, stage_seconds: float, stage: Any = None
    ) -> SaveHandle:
        future = self._pool.submit(fn)
        handle = SaveHandle(future, global_step, kind, stage_seconds, stage)

        def report(f: cf.Future) -> None:
            exc = f.exception()
            if exc is not None:
                log.error("background save of step %d (%s) failed: %s", global_step, kind, exc)

        future.add_done_callback(report)
        with self._lock:
            self._current = handle
        return handle

    def close(self) -> None:
        self.wait_idle()
        self._pool.shutdown(wait=True)


def _lower_priority(nice: int) -> None:
    """Run this (writer) thread at a lower CPU priority, so training threads win a contended core."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:  # not permitted here: the save still runs, at normal priority
        log.debug("could not lower the writer thread's priority: %s", exc)
