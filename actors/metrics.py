"""The manager's Prometheus metrics, through ``ray.util.metrics`` (no-ops outside Ray)."""

from __future__ import annotations


class ManagerMetrics:
    """Counters and gauges of one manager process: commits, aborts, commit latency, lost participants."""

    _lost_gauge = None  # one gauge per process, shared by every manager in it

    def __init__(self) -> None:
        try:
            from ray.util import metrics

            self._commits = metrics.Counter("rl_ckpt_snapshots_committed", description="Snapshots committed")
            self._aborts = metrics.Counter("rl_ckpt_snapshots_aborted", description="Sharded snapshots aborted")
            self._latency = metrics.Histogram("rl_ckpt_commit_seconds", description="Merge + commit time",
                                              boundaries=[0.01, 0.05, 0.1, 0.5, 1, 5, 30])
            self._step = metrics.Gauge("rl_ckpt_last_committed_step", description="Step of the newest snapshot")
            self._bytes = metrics.Gauge("rl_ckpt_manager_bytes_per_snapshot", description="Metadata bytes received")
        except ImportError:  # pragma: no cover - the manager always runs inside Ray
            self._commits = None

    def committed(self, seconds: float, step: int, nbytes: int) -> None:
        """One snapshot committed after ``seconds`` of merging and committing."""
        if self._commits is not None:
            self._commits.inc()
            self._latency.observe(seconds)
            self._step.set(step)
            self._bytes.set(nbytes)

    def aborted(self) -> None:
        """One sharded snapshot aborted."""
        if self._commits is not None:
            self._aborts.inc()

    @classmethod
    def lost(cls, count: int) -> None:
        """Participants lost right now (dead or silent); 0 when the group is healthy."""
        try:
            if cls._lost_gauge is None:
                from ray.util import metrics

                cls._lost_gauge = metrics.Gauge("rl_ckpt_participants_lost",
                                                description="Participants dead or silent (healthz degraded while > 0)")
            cls._lost_gauge.set(count)
        except ImportError:  # pragma: no cover - the manager always runs inside Ray
            pass
