"""``MemoryTierService``: the detached actor that watches a run's memory tier and flushes it to durable storage.

One per run (named ``rl_ckpt-memtier:<run>``, ``num_cpus=0``). A thread wakes
when a trainer says a memory snapshot committed (``notify``) or every
``interval`` seconds, and then:

1. asks every live memory store what it holds and builds the tier view
   (``rl_ckpt._run.tiers``): a store killed or a node lost takes exactly its
   copies with it, and a memory snapshot that lost the last copy of a file is
   retired from memory (no reader lists it any more);
2. flushes the memory snapshot that is due (``memory_flush_every`` /
   ``memory_flush_interval_seconds``) to durable storage *from memory*, with the
   durable storage's ordinary commit strategy, then applies durable retention;
3. publishes the figures: memory snapshots, bytes per node, replication lag,
   flush lag (``status()``, and Prometheus gauges through ``ray.util.metrics``).

The service holds nothing that the stores and durable storage do not: killed
and restarted (``max_restarts=-1``), it finds everything again.
"""

from __future__ import annotations

import logging
import threading
import time

from rl_ckpt.config import CheckpointConfig
from rl_ckpt._format.manifest import parse_snapshot_id
from rl_ckpt._run.catalog import Catalog, SnapshotInfo
from rl_ckpt._commit.flush import FlushPolicy, flush_snapshot
from rl_ckpt._run.tiers import DURABLE, MEMORY, MEMORY_BASE, drop_incomplete, memory_config, memory_options, tier_view

from ._memory.release import MANAGER_NAMESPACE, memory_runs, release_run
from ._memory.storage import RayMemoryStorage

log = logging.getLogger("rl_ckpt")
__all__ = ["MANAGER_NAMESPACE", "MemoryTierService", "memory_manager", "memory_runs", "release_run"]


def memory_manager(config: CheckpointConfig, namespace: str = "rl_ckpt", runtime_env: dict | None = None):
    """The memory tier's ``CheckpointManager`` (two-phase commit of memory snapshots with several participants),
    created or attached to. It lives in its own Ray namespace, so its name never clashes with the durable one's."""
    from .manager import CheckpointManager

    cfg = memory_config(config)
    return CheckpointManager.get_or_create(
        run_name=cfg.run_name,
        base_dir=MEMORY_BASE,
        storage_options=memory_options(config, namespace),
        namespace=MANAGER_NAMESPACE,
        config=cfg,
        healthz_port=None,
        runtime_env=runtime_env,
    )


class MemoryTierService:
    """The actor implementation; get a handle with :meth:`get_or_create`."""

    def __init__(self, config: dict, namespace: str = "rl_ckpt", interval: float = 2.0) -> None:
        logging.basicConfig(level=logging.INFO)
        self.config = CheckpointConfig(**config)
        self.memory = RayMemoryStorage(f"{MEMORY_BASE}/{self.config.run_name}", memory_options(self.config, namespace))
        self.memory_catalog = Catalog(self.memory)
        # (imported here, not with the module: the manager loads this class, with its imports, when it deserializes
        # the service's handle for /healthz, and the engine imports torch)
        from rl_ckpt._core.engine import CheckpointEngine

        self.durable = CheckpointEngine(self.config)  # durable catalog, commit strategy and retention
        self.policy = FlushPolicy(self.config.memory_flush_every, self.config.memory_flush_interval_seconds)
        self.interval = interval
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.last_flush: float | None = None
        self.flushed: list[str] = []
        self.dropped: list[str] = []
        self.errors: list[str] = []
        self._status: dict = {}
        self._metrics = _Metrics()
        self._thread = threading.Thread(target=self._loop, name="rl_ckpt-memtier", daemon=True)
        self._thread.start()

    @staticmethod
    def get_or_create(
        config: CheckpointConfig | dict,
        namespace: str = "rl_ckpt",
        interval: float = 2.0,
        runtime_env: dict | None = None,
    ):
        """The run's service actor (detached, restartable), created or attached to."""
        import os

        import ray

        values = config.to_dict() if isinstance(config, CheckpointConfig) else dict(config)
        if "://" not in values.get("base_dir", "://"):
            values["base_dir"] = os.path.abspath(values["base_dir"])  # the actor's working directory is not ours
        cfg = CheckpointConfig(**values)
        return (
            ray.remote(MemoryTierService)
            .options(
                name=f"rl_ckpt-memtier:{cfg.run_name}",
                namespace=namespace,
                lifetime="detached",
                get_if_exists=True,
                max_restarts=-1,
                max_task_retries=-1,
                num_cpus=0,
                max_concurrency=8,
                **({"runtime_env": runtime_env} if runtime_env else {}),
            )
            .remote(values, namespace, interval)
        )

    # -- the loop ---------------------------------------------------------------------
    def notify(self) -> None:
        """A memory snapshot committed: look now rather than at the next interval."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            try:
                self.tick()
            except Exception as exc:  # the loop must survive anything storage does
                log.warning("memory tier service: %s", exc)
                self._error(f"{type(exc).__name__}: {exc}")

    def _error(self, text: str) -> None:
        self.errors.append(text[:500])
        del self.errors[:-20]

    def tick(self) -> dict:
        """Watch the stores, drop what lost its copies, flush what is due; returns ``status()``."""
        with self._lock:
            view = tier_view(
                self.memory_catalog, self.memory.inventory(), self.durable.catalog, self.config.memory_replicas
            )
            dropped = drop_incomplete(self.memory, view)
            if dropped:
                self.dropped += dropped
                view = tier_view(
                    self.memory_catalog, self.memory.inventory(), self.durable.catalog, self.config.memory_replicas
                )
            memory_ids = [s.snapshot_id for s in view if MEMORY in s.tiers and s.kind == "full"]
            durable_ids = [s.snapshot_id for s in view if DURABLE in s.tiers and s.kind == "full"]
            due = self.policy.due(memory_ids, durable_ids, self.last_flush)
            if due is not None:
                self._flush(due)
                view = tier_view(
                    self.memory_catalog, self.memory.inventory(), self.durable.catalog, self.config.memory_replicas
                )
            self._status = self._figures(view)
            return self._status

    def flush_now(self, snapshot_id: str | None = None) -> str | None:
        """Flush ``snapshot_id`` (default: the newest complete memory snapshot) now; returns its id, or None
        when there was nothing to flush."""
        with self._lock:
            view = tier_view(
                self.memory_catalog, self.memory.inventory(), self.durable.catalog, self.config.memory_replicas
            )
            ids = [s.snapshot_id for s in view if MEMORY in s.tiers and DURABLE not in s.tiers and s.kind == "full"]
            sid = snapshot_id or (ids[-1] if ids else None)
            if sid is None:
                return None
            self._flush(sid)
            return sid

    def _flush(self, sid: str) -> None:
        started = time.monotonic()
        manifest = flush_snapshot(
            self.memory, self.durable.storage, sid, self.durable.commit, verify=self.config.verify_after_write
        )
        self.last_flush = time.monotonic()
        if manifest is None:
            return
        self.durable.catalog.add(SnapshotInfo.from_manifest(manifest))
        self.durable.maintenance.after_commit()  # retention and best aliases (never raises: logs warnings)
        self.flushed.append(sid)
        del self.flushed[:-100]
        self._metrics.flushed(time.monotonic() - started)
        log.info("memory tier: flushed %s to %s in %.2f s", sid, self.durable.storage.url, time.monotonic() - started)

    # -- figures --------------------------------------------------------------------
    def _figures(self, view: list) -> dict:
        stores = self.memory.store_info()
        newest_durable = max((parse_snapshot_id(s.snapshot_id) for s in view if DURABLE in s.tiers), default=None)
        waiting = [
            s
            for s in view
            if MEMORY in s.tiers
            and s.kind == "full"
            and (newest_durable is None or parse_snapshot_id(s.snapshot_id) > newest_durable)
        ]
        flush_lag = 0.0
        if waiting:
            info = self.memory_catalog.get(waiting[0].snapshot_id)
            flush_lag = _age_seconds(info.created_at) if info is not None else 0.0
        body = {
            "memory_snapshots": [s.snapshot_id for s in view if MEMORY in s.tiers],
            "durable_snapshots": [s.snapshot_id for s in view if DURABLE in s.tiers],
            "replicated": [s.snapshot_id for s in view if s.replicated],
            "bytes_per_node": {n: i["bytes_held"] for n, i in stores.items()},
            "replication_lag_s": max((i["replication_lag_s"] for i in stores.values()), default=0.0),
            "flush_lag_s": flush_lag,
            "not_flushed": [s.snapshot_id for s in waiting],
            "flushed": list(self.flushed[-10:]),
            "dropped": list(self.dropped[-10:]),
            "errors": list(self.errors[-5:]),
            "stores": stores,
            "tiers": [s.to_json() for s in view],
            "replicas": self.config.memory_replicas,
            "updated_at": time.time(),
        }
        self._metrics.update(body)
        return body

    def status(self) -> dict:
        """The latest figures (as of the last tick; ``tick()`` for fresh ones)."""
        return self._status or self.tick()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def ping(self) -> str:
        return "ok"


def _age_seconds(created_at: str) -> float:
    from datetime import datetime, timezone

    try:
        then = datetime.fromisoformat(created_at)
    except ValueError:
        return 0.0
    if then.tzinfo is None:
        then = then.replace(tzinfo=timezone.utc)
    return max(0.0, (datetime.now(timezone.utc) - then).total_seconds())


class _Metrics:
    """Prometheus gauges through ray.util.metrics (no-ops outside Ray)."""

    def __init__(self) -> None:
        try:
            from ray.util import metrics

            self._snapshots = metrics.Gauge("rl_ckpt_memory_snapshots", description="Snapshots complete in memory")
            self._bytes = metrics.Gauge(
                "rl_ckpt_memory_bytes", description="Bytes held by a node's memory store", tag_keys=("node",)
            )
            self._repl = metrics.Gauge(
                "rl_ckpt_memory_replication_lag_seconds",
                description="Age of the oldest copy still queued for a peer store",
            )
            self._flush = metrics.Gauge(
                "rl_ckpt_memory_flush_lag_seconds",
                description="Age of the oldest memory snapshot newer than durable storage's",
            )
            self._flush_time = metrics.Histogram(
                "rl_ckpt_memory_flush_seconds", description="Time to flush one", boundaries=[0.1, 0.5, 1, 5, 30, 120]
            )
        except ImportError:  # pragma: no cover - the service always runs inside Ray
            self._snapshots = None

    def update(self, body: dict) -> None:
        if self._snapshots is None:
            return
        self._snapshots.set(len(body["memory_snapshots"]))
        for node, held in body["bytes_per_node"].items():
            self._bytes.set(held, tags={"node": node[:12]})
        self._repl.set(body["replication_lag_s"])
        self._flush.set(body["flush_lag_s"])

    def flushed(self, seconds: float) -> None:
        if self._snapshots is not None:
            self._flush_time.observe(seconds)
