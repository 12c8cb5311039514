"""``CheckpointManager``: the detached, named Ray actor that coordinates one run's snapshots.

It assigns attempts, commits a sharded snapshot once every expected
participant has reported its shards (two-phase commit), keeps the catalog,
applies retention, records failures and coordinator decisions, hands every
rank the same recovery plan, watches heartbeats, runs the health patrol and
serves ``/healthz``.

The actor front (this module) delegates to the commit protocol
(``_manager/commits.py``), the participant registry (``_manager/participants.py``),
failures and recovery plans (``_manager/recovery.py``) and, after each commit, run maintenance
(``rl_ckpt/_run/maintenance.py``); plans come from ``rl_ckpt/_recovery/plan.py``
and the run's recorded history.

It holds no state that storage does not. The catalog is rebuilt from
committed manifests; a pending commit is rebuilt from the ``attempt.json``
and ``<participant>.report.json`` files the attempt folder holds; failures and
decisions are files in the run folder. After a restart (``max_restarts=-1``)
retried calls find everything again, and every call is idempotent. The
constructor never raises because of what storage holds: a pending commit it
cannot finish is logged and aborted (its files are debris for gc), since an
actor whose constructor raised is never restarted.

``begin``/``report``/``abort``/``decide`` are bound to registered participants
(engines register on construction and again after a manager restart). That
catches a stale or misconfigured process, not an attacker: any code that can
call actors on the cluster can also register, so the cluster itself (Ray's
token authentication, its network) is the trust boundary.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

from rl_ckpt._commit import strategy_for
from rl_ckpt._commit.two_phase import PAUSE_DIR_ENV, CommitProtocol
from rl_ckpt.config import CheckpointConfig
from rl_ckpt.errors import ConfigError
from rl_ckpt._format.manifest import MANIFEST_NAME, now_iso, parse_snapshot_id
from rl_ckpt._run.catalog import Catalog
from rl_ckpt._run.maintenance import RunMaintenance
from rl_ckpt._run.patrol import HealthPatrol
from rl_ckpt._storage import join, open_storage

from ._manager.commits import ManagerCommits
from ._manager.decisions import SaveDecisions
from ._manager.healthz import HealthzServer
from ._versions.health import health_sections
from ._manager.metrics import ManagerMetrics
from ._manager.participants import LivenessWatch, ParticipantRegistry
from ._manager.recovery import ManagerRecovery

log = logging.getLogger("rl_ckpt")
__all__ = ["CheckpointManager", "PAUSE_DIR_ENV"]


def get_or_create(
    run_name: str = "run",
    base_dir: str = "./checkpoints",
    storage_options: dict | None = None,
    namespace: str = "rl_ckpt",
    config: CheckpointConfig | dict | None = None,
    healthz_port: int | None = 0,
    kill_hung: bool = False,
    patrol_interval_seconds: float | None = None,
    runtime_env: dict | None = None,
    **overrides: Any,
):
    """The run's manager actor handle, created (detached, restartable) or attached to.

    Args:
        run_name, base_dir, storage_options: where the run's snapshots live.
        namespace: the Ray namespace of the named actor.
        config: other CheckpointConfig keys (retention, checksums, timeouts...).
        healthz_port: serve /healthz on 127.0.0.1 at this port (0: any free port; None: off).
        kill_hung: stop participants whose heartbeats stopped, so Ray restarts them.
        runtime_env: the actor's Ray runtime environment (e.g. ``{"env_vars": {...}}``).
    """
    import ray

    values = config.to_dict() if isinstance(config, CheckpointConfig) else dict(config or {})
    if "://" not in base_dir:
        base_dir = os.path.abspath(base_dir)  # the actor's working directory is not the driver's
    values.update(overrides, base_dir=base_dir, run_name=run_name, storage_options=storage_options or {})
    run_url = CheckpointConfig(**values).run_url  # fail here, in the caller, on a bad key
    _check_existing(f"rl_ckpt:{run_name}", namespace, run_url)
    actor = ray.remote(CheckpointManager).options(
        name=f"rl_ckpt:{run_name}",
        namespace=namespace,
        lifetime="detached",
        max_restarts=-1,
        max_task_retries=-1,
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=64,
        **({"runtime_env": runtime_env} if runtime_env else {}),
    )
    return actor.remote(values, healthz_port, "127.0.0.1", kill_hung, patrol_interval_seconds)


def _check_existing(name: str, namespace: str, run_url: str) -> None:
    """A manager already running under ``name`` must serve ``run_url``: attaching to one that serves another
    folder (the same run name, another ``base_dir``) would commit into, and restore from, that folder."""
    import ray

    try:
        existing = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return  # none yet: get_or_create starts it
    try:
        serves = ray.get(existing.run_url.remote(), timeout=60)
    except Exception as exc:  # restarting or lost: the caller's first call says so, with its own timeout
        log.warning("could not ask the running manager %r which run it serves: %s", name, exc)
        return
    if serves != run_url:
        raise ConfigError(
            f"a CheckpointManager for run {name.split(':', 1)[1]!r} is already running and serves {serves}, not "
            f"{run_url}: give this run another run_name, or stop that manager first (ray.kill of the actor "
            f"{name!r} in namespace {namespace!r}) if its run is over",
            key="base_dir",
        )


class CheckpointManager:
    """The actor implementation. Use :meth:`get_or_create` to get a handle."""

    def __init__(
        self,
        config: dict,
        healthz_port: int | None = 0,
        healthz_host: str = "127.0.0.1",
        kill_hung: bool = False,
        patrol_interval_seconds: float | None = None,
    ) -> None:
        logging.basicConfig(level=logging.INFO)
        self.config = CheckpointConfig(**config)
        self.storage = open_storage(self.config.run_url, self.config.storage_options)
        self.catalog = Catalog(self.storage)
        # Participants reuse dedup chunks while the manager applies retention: unreferenced chunks
        # are left to `rl-ckpt gc` and its grace period instead of an immediate sweep.
        self.maintenance = RunMaintenance.from_config(self.storage, self.catalog, self.config, sweep_objects=False)
        self._lock = threading.RLock()
        self.registry = ParticipantRegistry(self.config.run_name, self.config.heartbeat_interval_seconds)
        self.commits = CommitProtocol(
            self.storage,
            strategy_for(self.storage, self.config.atomic_write),
            self.catalog,
            self.maintenance,
            self.config.commit_timeout_seconds,
            ManagerMetrics(),
            on_commit=self._committed,
        )
        self.pending = self.commits.pending  # the same dicts: decide() and the watch read them under the lock
        self.refused = self.commits.refused
        self.save_decisions = SaveDecisions(self.storage)  # kept on storage: the same answers after a restart
        self.calls = ManagerCommits(self.commits, self._lock, self.registry, self.save_decisions)
        self.recovery = ManagerRecovery(
            self.config, self.storage, self.catalog, self._lock, self.registry, self.commits, self.save_decisions
        )
        self.started_at = now_iso()
        # Whatever storage holds, the constructor must not raise: Ray never restarts an actor whose
        # constructor raised, and every later save would fail against a dead manager.
        try:
            self.catalog.refresh()
        except Exception as exc:
            log.error("manager could not read the catalog of %s (it is read again later): %s", self.storage.url, exc)
        try:
            self.commits.resume(on_resumed=self._resumed)
        except Exception as exc:
            log.error("manager could not resume pending commits (aborted; their files are debris for gc): %s", exc)
            self.pending.clear()
        self._monitor = LivenessWatch(
            self.registry,
            self._lock,
            tick=self.commits.expire,
            record=self.recovery.record_failure,
            kill_hung=kill_hung,
        ).start()
        self.patrol = None
        if patrol_interval_seconds:
            self.patrol = HealthPatrol(
                self.storage,
                interval_seconds=patrol_interval_seconds,
                bytes_per_second=self.config.scrub_bytes_per_second,
                min_free_bytes=self.config.min_free_bytes,
                on_report=lambda r: self.catalog.refresh(),
            ).start()
        self.healthz = (
            HealthzServer(self.health, host=healthz_host, port=healthz_port) if healthz_port is not None else None
        )

    # -- handle ----------------------------------------------------------------
    get_or_create = staticmethod(get_or_create)

    # -- two-phase commit (rl_ckpt/_commit/two_phase.py, through _commits.py) ---
    def begin(self, snapshot_id: str, expected: list[str], participant: str) -> dict:
        """The attempt every participant of ``snapshot_id`` writes into (the same one for all).

        Raises the abort error at once when another participant already failed
        this snapshot, or the participants decided to skip it.
        """
        return self.calls.begin(snapshot_id, expected, participant)

    def decide(self, snapshot_id: str, participant: str, busy: bool) -> str:
        """``"save"`` or ``"skip"``: one decision for every participant of a due snapshot.

        The first participant to ask decides: ``"skip"`` when its previous save
        is still running, else ``"save"``; every later participant gets the same
        answer (a busy one told to save waits for its previous save first), also
        from a manager restarted in between (the decision is a record on storage).
        """
        with self._lock:
            self._check_participant(participant)
            return self.save_decisions.save_or_skip(snapshot_id, participant, busy, self._started)

    def decide_step(
        self, global_step: int, participant: str, kind: str | None, busy: bool, interval_seconds: float
    ) -> dict:
        """Under a time cadence: ``{"kind": "full" | "light" | None, "save": bool}`` for ``global_step``, by
        this manager's clock, the same for every participant (actors/_manager/decisions.py)."""
        with self._lock:
            self._check_participant(participant)
            return self.save_decisions.step(global_step, participant, kind, busy, interval_seconds, self._started)

    def _started(self, snapshot_id: str) -> bool:
        return snapshot_id in self.pending or self.storage.exists(join(snapshot_id, MANIFEST_NAME))

    def report(self, snapshot_id: str, attempt_id: str, participant: str, part: bytes) -> bytes:
        """A participant's part (metadata only); returns the merged manifest once committed."""
        return self.calls.report(snapshot_id, attempt_id, participant, part)

    def abort(self, snapshot_id: str, attempt_id: str | None, participant: str, reason: str) -> None:
        """``participant``'s save of ``snapshot_id`` failed: abort the snapshot for every participant.

        ``attempt_id`` is None when it failed before ``begin``: participants
        that begin the snapshot later are refused at once.
        """
        self.calls.abort(snapshot_id, attempt_id, participant, reason)

    def _check_participant(self, participant: str) -> None:
        self.registry.check(participant)

    def _resumed(self, snapshot_id: str) -> None:
        self.save_decisions.decide(snapshot_id, "save", "a commit resumed after a manager restart")

    def _committed(self, info) -> None:
        self._forget_before(info.global_step)
        self.recovery.committed(info)  # the versions its files have now (the memory tier)

    def _forget_before(self, step: int) -> None:
        """Once a step committed, every participant is past the older ones: drop their decisions and refusals."""
        self.save_decisions.forget_before(step)
        for sid in [sid for sid in self.refused if (parse_snapshot_id(sid) or (step,))[0] < step]:
            del self.refused[sid]

    # -- catalog, failures, plans ---------------------------------------------
    def participant_handles(self, names: list[str]) -> dict[str, Any]:
        """The actor handles the named participants registered with (those registered from an actor): where a
        participant replaced by a standby is reached now (a restarted learner group finds it here)."""
        with self._lock:
            known = self.registry.participants
            return {n: known[n].handle for n in names if n in known and known[n].handle is not None}

    def awaiting(self, participant: str) -> list[str]:
        """Snapshot ids pending that still wait for ``participant``'s part: a participant replaced mid-run takes them
        back up as it catches up (``actors.rollout_pool``), instead of leaving them to time out."""
        with self._lock:
            return self.commits.awaiting(participant)

    def snapshots(self) -> list[dict]:
        return [{k: v for k, v in dataclasses.asdict(i).items() if k != "manifest"} for i in self.catalog.snapshots()]

    def stats(self) -> dict:
        c = self.commits
        return {
            "committed": c.committed,
            "aborted": c.aborted,
            "pending": sorted(self.pending),
            "bytes_received": dict(c.bytes_received),
            "started_at": self.started_at,
            "pid": os.getpid(),
            "beats": {n: p.beats for n, p in self.registry.participants.items()},
            "maintenance_warnings": dict(c.maintenance_warnings),
        }

    def record_metrics(self, metrics: dict, step: int | None = None) -> None:
        """Metrics reported to Ray Train (after_report), kept for health and the coordinator."""
        with self._lock:
            self.commits.reported_metrics = {"step": step, **metrics}

    def record_failure(self, failure: dict, dead: list[dict] | None = None) -> dict:
        """Write a failure (FailureInfo JSON) into the run folder; returns it as stored (_manager/recovery.py)."""
        return self.recovery.record_failure(failure, dead)

    def failures(self) -> list[dict]:
        return self.recovery.failures()

    def plan(self, light: bool = True) -> dict:
        """The recovery plan every participant follows (the same for all until something changes;
        actors/_manager/recovery.py); ``light=False``: participants that apply no light layer (none is chosen, and
        light layers newer than the target are retired with the rest of the failed timeline)."""
        return self.recovery.plan(light)

    # -- liveness (_participants.py) ---------------------------------------------
    def register(self, participant: str, meta: dict, handle: Any = None) -> None:
        """A participant process announces itself (pid, node, actor handle).

        Calls run concurrently in this actor, so a heartbeat sent after ``register``
        may be handled before it: a registration from the same process merges.
        """
        with self._lock:
            self.registry.register(participant, meta, handle, time.monotonic())

    def unregister(self, participant: str) -> None:
        """A participant finished cleanly: it is no longer expected to beat (nor lost when silent)."""
        with self._lock:
            self.registry.unregister(participant)

    def heartbeat(self, participant: str, step: int | None, last_snapshot: str | None) -> bool | None:
        """A participant is alive (and at ``step``; None: alive only).

        False: it is not registered (it registers again, e.g. after a manager
        restart); None: it unregistered (its liveness thread stops).
        """
        with self._lock:
            return self.registry.heartbeat(participant, step, last_snapshot, time.monotonic())

    def health(self) -> dict:
        """The run's health: ``status`` is "degraded" (``/healthz`` answers 503) while a participant is lost
        (dead or silent) or a snapshot is quarantined; ``failure`` is then the newest failure recorded.
        ``maintenance_warnings``: what housekeeping after the newest commit could not do (the commit stands)."""
        (memory, versions), now = health_sections(self.config.run_name), time.monotonic()  # (bounded, outside the lock)
        with self._lock:
            newest = self.catalog.snapshots()
            parts = self.registry.status(now)
            furthest = self.registry.furthest_step()
            lost = sorted(n for n, p in parts.items() if p["lost"])
            quarantined = bool(self.patrol and self.patrol.status()["quarantined"])
            failure = self.recovery.newest_failure() if lost else None
            ManagerMetrics.lost(len(lost))
            return {
                "status": "degraded" if lost or quarantined else "ok",
                "run": self.config.run_name,
                "storage": self.storage.url,
                "last_step": furthest if furthest is not None else (newest[-1].global_step if newest else None),
                "last_committed_snapshot": newest[-1].snapshot_id if newest else None,
                "participants": parts,
                "lost": lost,
                "failure": failure,
                "pending_commits": sorted(self.pending),
                "storage_free_bytes": self.storage.free_bytes(),
                "patrol": self.patrol.status() if self.patrol else {"enabled": False},
                "committed": self.commits.committed,
                "aborted": self.commits.aborted,
                "policy_versions": versions,
                "maintenance_warnings": dict(self.commits.maintenance_warnings),
                "memory_tier": memory,
            }

    def healthz_url(self) -> str | None:
        return self.healthz.url if self.healthz else None

    def ping(self) -> str:
        return "ok"

    def run_url(self) -> str:
        """The run folder this manager serves (``get_or_create`` checks it before attaching)."""
        return self.config.run_url
