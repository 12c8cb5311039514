"""The manager's Prometheus metrics: through ``ray.util.metrics`` (no-ops outside Ray), and as Prometheus text
of the run's health (``prometheus_text``, served at ``/metrics`` next to ``/healthz``)."""

from __future__ import annotations


class ManagerMetrics:
    """Counters and gauges of one manager process: commits, aborts, commit latency, lost participants."""

    _lost_gauge = None  # one gauge per process, shared by every manager in it

    def __init__(self) -> None:
        try:
            from ray.util import metrics

            self._commits = metrics.Counter("rl_ckpt_snapshots_committed", description="Snapshots committed")
            self._aborts = metrics.Counter("rl_ckpt_snapshots_aborted", description="Sharded snapshots aborted")
            self._latency = metrics.Histogram(
                "rl_ckpt_commit_seconds", description="Merge + commit time", boundaries=[0.01, 0.05, 0.1, 0.5, 1, 5, 30]
            )
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

                cls._lost_gauge = metrics.Gauge(
                    "rl_ckpt_participants_lost", description="Participants dead or silent (healthz degraded while > 0)"
                )
            cls._lost_gauge.set(count)
        except ImportError:  # pragma: no cover - the manager always runs inside Ray
            pass


def _line(name: str, value: float | int | None, labels: dict | None = None) -> str | None:
    if value is None:
        return None
    number = str(int(value)) if isinstance(value, (bool, int)) else repr(float(value))
    text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in (labels or {}).items())
    return f"{name}{{{text}}} {number}" if text else f"{name} {number}"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# name -> (help, how to read it from the health dict); every one a gauge of the run's current state
_GAUGES = {
    "rl_ckpt_healthy": ("1 when /healthz answers 200, 0 when degraded", lambda h: h["status"] == "ok"),
    "rl_ckpt_last_step": (
        "Furthest step a participant reported (or the newest snapshot's)",
        lambda h: h.get("last_step"),
    ),
    "rl_ckpt_participants_lost": ("Participants dead or silent", lambda h: len(h.get("lost", []))),
    "rl_ckpt_pending_commits": ("Sharded snapshots waiting for reports", lambda h: len(h.get("pending_commits", []))),
    "rl_ckpt_committed_total": ("Snapshots this manager process committed", lambda h: h.get("committed")),
    "rl_ckpt_aborted_total": ("Sharded snapshots this manager process aborted", lambda h: h.get("aborted")),
    "rl_ckpt_storage_free_bytes": ("Free space of the run's storage", lambda h: h.get("storage_free_bytes")),
}
_MEMORY_GAUGES = {
    "rl_ckpt_memory_tier_reachable": ("1 when the memory tier service answered", lambda m: m["reachable"]),
    "rl_ckpt_memory_tier_degraded": (
        "1 when the memory tier is degraded or unreachable (see /healthz)",
        lambda m: m["status"] != "ok",
    ),
    "rl_ckpt_memory_snapshots": ("Snapshots complete in memory", lambda m: m.get("snapshots")),
    "rl_ckpt_memory_newest_step": ("Step of the newest memory snapshot", lambda m: m.get("newest_step")),
    "rl_ckpt_memory_replication_lag_seconds": (
        "Age of the oldest copy still queued for a peer store",
        lambda m: m.get("replication_lag_s"),
    ),
    "rl_ckpt_memory_flush_lag_seconds": (
        "Age of the oldest memory snapshot newer than durable storage's",
        lambda m: m.get("flush_lag_s"),
    ),
}


def prometheus_text(health: dict) -> str:
    """The manager's health dict as Prometheus text exposition (``GET /metrics``), labelled with the run.

    The ``rl_ckpt_memory_*`` gauges appear only when the run has a memory tier service
    (``health["memory_tier"]`` not None); ``rl_ckpt_memory_bytes`` has one line per node."""
    run = {"run": health.get("run", "")}
    out: list[str] = []

    def gauge(name: str, help_text: str, lines: list) -> None:
        lines = [ln for ln in lines if ln is not None]
        if lines:
            out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} gauge", *lines])

    for name, (help_text, read) in _GAUGES.items():
        gauge(name, help_text, [_line(name, read(health), run)])
    memory = health.get("memory_tier")
    if memory is not None:
        for name, (help_text, read) in _MEMORY_GAUGES.items():
            gauge(name, help_text, [_line(name, read(memory), run)])
        gauge(
            "rl_ckpt_memory_bytes",
            "Bytes held by a node's memory store",
            [
                _line("rl_ckpt_memory_bytes", held, {**run, "node": node})
                for node, held in sorted(memory.get("bytes_per_node", {}).items())
            ],
        )
    return "\n".join(out) + "\n"
