"""``RunHandle``: one opened run folder, the part of the engine that needs no registered state.

It holds the run's storage, its catalog of committed snapshots and its maintenance (retention and best
aliases), and answers about the run: the committed snapshots, their verification, the best one, the
recorded recovery decisions, the background health patrol. Closing it stops the patrol and releases the
storage. :class:`~rl_ckpt._core.engine.CheckpointEngine` is one, with registration, saving and restoring on
top.
"""

from __future__ import annotations

from typing import Any, TypeVar

from rl_ckpt.config import CheckpointConfig
from rl_ckpt.errors import CheckpointError
from rl_ckpt._recovery.coordinator import Decision
from rl_ckpt._recovery.history import load_decisions, record_decision
from rl_ckpt._run.catalog import Catalog, SnapshotInfo
from rl_ckpt._run.maintenance import RunMaintenance
from rl_ckpt._run.patrol import HealthPatrol
from rl_ckpt._run.retention import RetentionDecision, RetentionPolicy
from rl_ckpt._run.snapshot_files import VerifyReport
from rl_ckpt._run.verify import verify_run
from rl_ckpt._storage import Storage

_Handle = TypeVar("_Handle", bound="RunHandle")


class RunHandle:
    """One run folder, open: its committed snapshots, their verification, retention and best, recorded decisions.

    ``retention``: a :class:`RetentionPolicy` applied by ``maintenance`` after each commit (default: built from
    the config), or ``False`` to keep everything.
    """

    def __init__(
        self, config: CheckpointConfig, storage: Storage, *, retention: RetentionPolicy | bool | None = None
    ) -> None:
        self.config: CheckpointConfig = config
        self.storage = storage
        self.catalog = Catalog(storage)
        self.maintenance = RunMaintenance.from_config(storage, self.catalog, config, retention=retention)
        self._patrol: HealthPatrol | None = None
        self._closed = False

    # -- run maintenance -----------------------------------------------------
    @property
    def retention(self) -> RetentionPolicy | None:
        """The retention policy applied after each commit (None: keep everything, or the manager decides)."""
        return self.maintenance.retention

    @property
    def last_retention(self) -> RetentionDecision | None:
        """What the last retention pass kept and deleted, and why."""
        return self.maintenance.last_retention

    def best(self, metric: str | None = None) -> SnapshotInfo | None:
        """The best committed snapshot by ``metric`` (default: the first of best_metric)."""
        return self.maintenance.best(metric)

    # -- listing and verification -------------------------------------------
    def snapshots(self) -> list[SnapshotInfo]:
        """Committed snapshots, oldest first."""
        return self.catalog.snapshots()

    def verify(self, snapshot_id: str | None = None) -> VerifyReport:
        """Re-hash every file of one snapshot (or all of them) against its manifest."""
        self.catalog.refresh()
        return verify_run(self.catalog, None if snapshot_id is None else [snapshot_id])

    # -- recorded decisions ----------------------------------------------------
    def decisions(self) -> list[Decision]:
        """The coordinator decisions recorded in this run, oldest first (unreadable records are skipped)."""
        return load_decisions(self.storage)

    def record_decision(self, decision: Decision) -> None:
        """Write a coordinator decision into the run folder (one file each: atomic on every backend)."""
        record_decision(self.storage, decision)

    # -- health patrol -------------------------------------------------------
    def start_patrol(self, interval_seconds: float = 3600.0, **kwargs: Any) -> HealthPatrol:
        """Re-hash old snapshots in the background (rate-limited); corrupt ones are quarantined."""
        if self._patrol is None:
            cfg, refresh = self.config, lambda r: self.catalog.refresh()
            limits = {
                "bytes_per_second": cfg.scrub_bytes_per_second,
                "min_free_bytes": cfg.min_free_bytes,
                "on_report": refresh,
            }
            self._patrol = HealthPatrol(self.storage, interval_seconds=interval_seconds, **{**limits, **kwargs}).start()
        return self._patrol

    # -- lifecycle -----------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"this {type(self).__name__} is closed")

    def _stop_patrol(self) -> None:
        if self._patrol is not None:
            self._patrol.stop()

    def close(self) -> None:
        """Stop the patrol, then release the storage."""
        if not self._closed:
            self._stop_patrol()
            self._closed = True
            self.storage.close()

    def __enter__(self: _Handle) -> _Handle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["RunHandle"]
