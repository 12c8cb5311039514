"""``CheckpointScheduler``: decides *when* to save, from the training loop (source article §3.2).

Call ``step(global_step, metrics)`` every training step. A full snapshot is
due every ``save_interval_steps`` OR ``save_interval_seconds``, whichever comes
first; a light one every ``light_interval_steps`` in between. Saves run in the
background (``engine.save_async``). When the previous save is still running, a
due save is *skipped*, not queued, so saving never piles up behind a slow disk.
With a ``CheckpointManager`` the skip is decided once for all participants of
the snapshot (``engine.agree_to_save``), so ranks never save different steps.
A failed save is logged and handed to ``on_error``; training goes on.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from .async_save import SaveHandle
from .errors import CheckpointError

log = logging.getLogger("rl_ckpt")


class CheckpointScheduler:
    """Cadence policy over an engine. Build it with ``engine.scheduler()``.

    Args:
        engine: the CheckpointEngine to save with.
        on_error: called with ``(exception, global_step)`` when a save fails.
        on_commit: called with the committed ``SnapshotInfo`` (from the writer thread).
        clock: a monotonic clock in seconds (tests pass a fake one).
        start_step: the step training (re)starts from; the first interval counts from it.
    """

    def __init__(self, engine, *, on_error: Callable[[BaseException, int], None] | None = None,
                 on_commit: Callable[[Any], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 start_step: int | None = None) -> None:
        cfg = engine.config
        self.engine = engine
        self.on_error = on_error
        self.on_commit = on_commit
        self.clock = clock
        self.every_steps = cfg.save_interval_steps or None
        self.every_seconds = cfg.save_interval_seconds or None
        self.light_every = cfg.light_interval_steps or None
        self._last_full_step = start_step
        self._last_light_step = start_step
        self._last_full_time = clock()
        self._handle: SaveHandle | None = None
        self.saves_started = 0
        self.skipped = 0
        self.failures = 0
        self.last_error: BaseException | None = None

    def due(self, global_step: int) -> str | None:
        """``"full"``, ``"light"`` or None: what this step would save."""
        if self._last_full_step is None:
            return None
        if self.every_steps and global_step - self._last_full_step >= self.every_steps:
            return "full"
        if self.every_seconds and self.clock() - self._last_full_time >= self.every_seconds:
            return "full"
        if (self.light_every and self.engine.catalog.snapshots("full")
                and global_step - max(self._last_light_step, self._last_full_step) >= self.light_every):
            return "light"
        return None

    def step(self, global_step: int, metrics: Mapping[str, Any] | None = None) -> SaveHandle | None:
        """Call once per training step. Returns the handle of a save it started, else None."""
        self._collect()
        self.engine.beat(global_step)
        if self._last_full_step is None:
            self._last_full_step = self._last_light_step = global_step
            return None
        kind = self.due(global_step)
        if kind is None:
            return None
        try:
            go = self.engine.agree_to_save(global_step, kind)
        except CheckpointError as exc:  # e.g. the manager is unreachable: report, keep training
            self._report(exc, global_step)
            return None
        if not go:
            # With a manager this is one decision for every participant of the snapshot.
            self.skipped += 1
            log.info("step %d: %s save due but a previous save is still running; skipped", global_step, kind)
            return None
        try:
            handle = self.engine.save_async(global_step, metrics, kind=kind)
        except CheckpointError as exc:  # staging failed (e.g. a value that cannot be saved): report, keep training
            self._report(exc, global_step)
            return None
        self.saves_started += 1
        if kind == "full":
            self._last_full_step = global_step
            self._last_full_time = self.clock()
        self._last_light_step = global_step
        if self.on_commit is not None:
            handle.add_done_callback(lambda h: h.exception() is None and self.on_commit(h.wait()))
        self._handle = handle
        return handle

    def _collect(self) -> None:
        handle = self._handle
        if handle is not None and handle.done():
            self._handle = None
            exc = handle.exception()
            if exc is not None:
                self._report(exc, handle.global_step)

    def _report(self, exc: BaseException, global_step: int) -> None:
        self.failures += 1
        self.last_error = exc
        log.error("checkpoint save at step %d failed: %s", global_step, exc)
        if self.on_error is not None:
            self.on_error(exc, global_step)

    def close(self) -> None:
        """Wait for the save in flight and report its outcome."""
        self.engine.wait()
        self._collect()
