"""``CheckpointScheduler``: decides *when* to save, from the training loop (source article §3.2).

Call ``step(global_step, metrics)`` every training step. A full snapshot is
due every ``save_interval_steps`` OR ``save_interval_seconds``, whichever comes
first; a light one every ``light_interval_steps`` in between. Saves run in the
background (``engine.save_async``). When the previous save is still running, a
due save is *skipped*, not queued, so saving never piles up behind a slow disk.
With a ``CheckpointManager`` the skip is decided once for all participants of
the snapshot (the engine's topology: ``Topology.cadence``), so ranks never
save different steps.
So is, under a time cadence, whether a step is due at all: each rank's clock
would answer differently on a loaded machine, so every ``step`` asks the
manager, whose clock decides once for everyone (one small actor call per step;
a step-only cadence makes none until a save is due).
A failed save is logged and handed to ``on_error``; training goes on. So is a
failure after the commit point (``PostCommitError``: the snapshot is
committed, an alias or a retention step is not) and an error raised by
``on_commit``; those are counted in ``warnings``, not ``failures``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Mapping

from rl_ckpt._core.async_save import SaveHandle
from rl_ckpt.errors import CheckpointError, PostCommitError

log = logging.getLogger("rl_ckpt")


class CheckpointScheduler:
    """Cadence policy over an engine. Build it with ``engine.scheduler()``.

    Args:
        engine: the CheckpointEngine to save with.
        on_error: called with ``(exception, global_step)`` when a save fails, and also, with a
            :class:`PostCommitError`, when housekeeping after a commit failed (the snapshot is
            committed), or with the exception ``on_commit`` raised. Called from the training thread.
        on_commit: called with the committed ``SnapshotInfo`` (from the writer thread).
        clock: a monotonic clock in seconds (tests pass a fake one).
        start_step: the step training (re)starts from; the first interval counts from it.
    """

    def __init__(
        self,
        engine,
        *,
        on_error: Callable[[BaseException, int], None] | None = None,
        on_commit: Callable[[Any], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        start_step: int | None = None,
    ) -> None:
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
        self.warnings = 0  # errors after a commit (housekeeping, on_commit): the save itself succeeded
        self.last_error: BaseException | None = None
        self._handle_finished = threading.Event()
        self._lock = threading.Lock()
        self._callback_errors: list[tuple[BaseException, int]] = []

    @property
    def saves_every_step(self) -> bool:
        """A full snapshot is due at every step (``save_interval_steps=1``): a step that saves is followed by
        one that saves too."""
        return self.every_steps == 1

    def due(self, global_step: int) -> str | None:
        """``"full"``, ``"light"`` or None: what this step would save (by this process's clock)."""
        if self._last_full_step is None:
            return None
        kind = self._due_by_steps(global_step)
        if kind != "full" and self.every_seconds and self.clock() - self._last_full_time >= self.every_seconds:
            return "full"
        return kind

    def _due_by_steps(self, global_step: int) -> str | None:
        """What the step counts alone make due: the same on every rank."""
        if self.every_steps and global_step - self._last_full_step >= self.every_steps:
            return "full"
        if (
            self.light_every
            and self.engine.catalog.snapshots("full")
            and global_step - max(self._last_light_step, self._last_full_step) >= self.light_every
        ):
            return "light"
        return None

    def _agree(self, global_step: int) -> tuple[str | None, bool]:
        """``(kind due, go)``, as the engine's topology decides: alone, by this process's clock; with a manager,
        one answer for every participant (under a time cadence, by the manager's clock)."""
        return self.engine.topology.cadence(
            global_step,
            self.every_seconds,
            lambda: self._due_by_steps(global_step),
            lambda: self.due(global_step),
            self.engine.saving,
        )

    def step(self, global_step: int, metrics: Mapping[str, Any] | None = None) -> SaveHandle | None:
        """Call once per training step. Returns the handle of a save it started, else None."""
        self._collect()
        self.engine.beat(global_step)
        if self._last_full_step is None:
            self._last_full_step = self._last_light_step = global_step
            return None
        try:
            kind, go = self._agree(global_step)
        except CheckpointError as exc:  # e.g. the manager is unreachable: report, keep training
            self._report(exc, global_step)
            return None
        if kind is None:
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
        self._watch(handle)
        return handle

    def _watch(self, handle: SaveHandle) -> None:
        """Track ``handle``: ``on_commit`` runs on the writer thread when it commits; its error is kept for
        ``on_error`` (a pool's done-callback would swallow it)."""
        finished = threading.Event()

        def after(h: SaveHandle) -> None:
            try:
                if self.on_commit is not None and h.exception() is None:
                    self.on_commit(h.wait())
            except Exception as exc:  # the user's callback: report it, never lose it
                with self._lock:
                    self._callback_errors.append((exc, h.global_step))
            finally:
                finished.set()

        self._handle, self._handle_finished = handle, finished
        handle.add_done_callback(after)

    def _collect(self) -> None:
        handle = self._handle
        if handle is not None and handle.done():
            self._handle = None
            self._handle_finished.wait()  # the done-callback runs just after done(); wait for on_commit
            exc = handle.exception()
            if exc is not None:
                self._report(exc, handle.global_step)
            elif handle.warnings:
                info = handle.wait()
                err = PostCommitError(
                    f"{info.snapshot_id} is committed, but housekeeping after it failed: " + "; ".join(handle.warnings),
                    snapshot_id=info.snapshot_id,
                    problems=handle.warnings,
                )
                self._report(err, handle.global_step, failed=False)
        with self._lock:
            errors, self._callback_errors = self._callback_errors, []
        for exc, step in errors:
            self._report(exc, step, failed=False, what="on_commit callback")

    def _report(self, exc: BaseException, global_step: int, *, failed: bool = True, what: str = "") -> None:
        """Log ``exc`` and hand it to ``on_error``; ``failed`` counts it as a failed save (else the save committed)."""
        self.last_error = exc
        if failed:
            self.failures += 1
            log.error("checkpoint save at step %d failed: %s", global_step, exc)
        else:
            self.warnings += 1
            log.warning("checkpoint at step %d: %s%s", global_step, f"{what} failed: " if what else "", exc)
        if self.on_error is not None:
            self.on_error(exc, global_step)

    def close(self) -> None:
        """Wait for the save in flight and report its outcome."""
        self.engine.wait()
        self._collect()
