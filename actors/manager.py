"""``CheckpointManager``: the detached, named Ray actor that coordinates one run's snapshots.

It assigns attempts, commits a sharded snapshot once every expected
participant has reported its shards (two-phase commit), keeps the catalog,
applies retention, records failures and coordinator decisions, hands every
rank the same recovery plan, watches heartbeats, runs the health patrol and
serves ``/healthz``.

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
import json
import logging
import os
import threading
import time
from typing import Any

from rl_ckpt.run.catalog import SnapshotInfo
from rl_ckpt.run.commit import STAGING, Attempt
from rl_ckpt.config import CheckpointConfig
from rl_ckpt.recovery.coordinator import FailureInfo
from rl_ckpt.core.engine import CheckpointEngine
from rl_ckpt.errors import CheckpointError, CommitConflictError
from rl_ckpt.integrations.managed import SnapshotAbortedError, SnapshotSkippedError, UnknownParticipantError
from rl_ckpt.format.manifest import MANIFEST_NAME, Manifest, now_iso, parse_snapshot_id
from rl_ckpt.core.reader import read_manifest
from rl_ckpt.storage import join, open_storage
from rl_ckpt.sharded.layout import merge_components

from .decisions import SaveDecisions
from .healthz import HealthzServer

log = logging.getLogger("rl_ckpt")
FAILURES = "failures"
# Test hook: with this set to a folder, the manager pauses where ``<folder>/pause-<point>-<snapshot id>``
# exists (after writing ``paused-<point>-<snapshot id>`` there) until that file is removed.
PAUSE_DIR_ENV = "RL_CKPT_TEST_PAUSE_DIR"


@dataclasses.dataclass
class Pending:
    attempt: Attempt
    expected: list[str]
    deadline: float
    reports: dict[str, Manifest] = dataclasses.field(default_factory=dict)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: CheckpointError | None = None
    manifest: bytes | None = None
    bytes_received: int = 0
    begun: set = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class Refusal:
    """A snapshot a participant failed: the others are told at ``begin`` instead of waiting out the timeout."""

    error: SnapshotAbortedError
    by: str
    waiting: set | None  # participants still to be told; None: every participant but ``by``


@dataclasses.dataclass
class Participant:
    meta: dict
    handle: Any = None
    last_beat: float = 0.0
    step: int | None = None
    last_snapshot: str | None = None
    lost: bool = False
    beats: int = 0


class CheckpointManager:
    """The actor implementation. Use :meth:`get_or_create` to get a handle."""

    def __init__(self, config: dict, healthz_port: int | None = 0, healthz_host: str = "127.0.0.1",
                 kill_hung: bool = False, patrol_interval_seconds: float | None = None) -> None:
        logging.basicConfig(level=logging.INFO)
        self.config = CheckpointConfig(**config)
        self.storage = open_storage(self.config.run_url, self.config.storage_options)
        self.engine = CheckpointEngine(self.config, storage=self.storage)  # catalog, retention, plans, decisions
        # Participants reuse dedup chunks while the manager applies retention: unreferenced chunks
        # are left to `rl-ckpt gc` and its grace period instead of an immediate sweep.
        self.engine.sweep_in_gc_only = True
        self.strategy = self.engine.commit
        self.kill_hung = kill_hung
        self._lock = threading.RLock()
        self.pending: dict[str, Pending] = {}
        self.participants: dict[str, Participant] = {}
        self.bytes_received: dict[str, int] = {}
        self.committed = 0
        self.aborted = 0
        self._plan_cache: tuple[tuple, dict] | None = None
        self._last_metrics: dict = {}
        self._last_loss_record = float("-inf")
        self.started_at = now_iso()
        self.refused: dict[str, Refusal] = {}
        self.save_decisions = SaveDecisions(self.storage)  # kept on storage: the same answers after a restart
        self.abort_errors: dict[str, SnapshotAbortedError] = {}  # attempt id -> why (late reports hear it)
        self.unregistered: set[str] = set()  # finished cleanly: their liveness thread stops, not re-registers
        self._metrics = _Metrics()  # before anything that may commit
        # Whatever storage holds, the constructor must not raise: Ray never restarts an actor whose
        # constructor raised, and every later save would fail against a dead manager.
        try:
            self.engine.catalog.refresh()
        except Exception as exc:
            log.error("manager could not read the catalog of %s (it is read again later): %s", self.storage.url, exc)
        try:
            self._rebuild_pending()
        except Exception as exc:
            log.error("manager could not resume pending commits (aborted; their files are debris for gc): %s", exc)
            self.pending.clear()
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="rl_ckpt-manager-monitor", daemon=True)
        self._monitor.start()
        self.patrol = self.engine.start_patrol(patrol_interval_seconds) if patrol_interval_seconds else None
        self.healthz = HealthzServer(self.health, host=healthz_host, port=healthz_port) if healthz_port is not None else None

    # -- handle ----------------------------------------------------------------
    @staticmethod
    def get_or_create(run_name: str = "run", base_dir: str = "./checkpoints", storage_options: dict | None = None,
                      namespace: str = "rl_ckpt", config: CheckpointConfig | dict | None = None,
                      healthz_port: int | None = 0, kill_hung: bool = False,
                      patrol_interval_seconds: float | None = None, runtime_env: dict | None = None,
                      **overrides: Any):
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
        CheckpointConfig(**values)  # fail here, in the caller, on a bad key
        actor = ray.remote(CheckpointManager).options(
            name=f"rl_ckpt:{run_name}", namespace=namespace, lifetime="detached", max_restarts=-1,
            max_task_retries=-1, get_if_exists=True, num_cpus=0, max_concurrency=64,
            **({"runtime_env": runtime_env} if runtime_env else {}))
        return actor.remote(values, healthz_port, "127.0.0.1", kill_hung, patrol_interval_seconds)

    # -- two-phase commit ------------------------------------------------------
    def begin(self, snapshot_id: str, expected: list[str], participant: str) -> dict:
        """The attempt every participant of ``snapshot_id`` writes into (the same one for all).

        Raises the abort error at once when another participant already failed
        this snapshot, or the participants decided to skip it.
        """
        with self._lock:
            self._check_participant(participant)
            decision = self.save_decisions.get(snapshot_id)
            if decision is not None and decision[0] == "skip":
                raise SnapshotSkippedError(
                    f"snapshot {snapshot_id} was skipped by every participant: {decision[1]}'s previous save was "
                    "still running when it was due", snapshot_id=snapshot_id, participant=decision[1])
            refusal = self.refused.get(snapshot_id)
            if refusal is not None:
                if participant == refusal.by:  # the failed participant tries again: a new attempt for everyone
                    del self.refused[snapshot_id]
                elif refusal.waiting is None or participant in refusal.waiting:
                    if refusal.waiting is not None:
                        refusal.waiting.discard(participant)
                        if not refusal.waiting:
                            del self.refused[snapshot_id]
                    raise refusal.error
            pending = self.pending.get(snapshot_id)
            if pending is not None and pending.error is None and not pending.done.is_set():
                pending.begun.add(participant)
                return dataclasses.asdict(pending.attempt)
            attempt = self.strategy.begin(snapshot_id)
            body = {"expected": sorted(set(expected)), "created_at": now_iso()}
            self.storage.write_atomic(join(attempt.data_prefix, "attempt.json"), json.dumps(body).encode())
            pending = Pending(attempt, body["expected"], time.monotonic() + self.config.commit_timeout_seconds)
            pending.begun.add(participant)
            self.pending[snapshot_id] = pending
            return dataclasses.asdict(attempt)

    def decide(self, snapshot_id: str, participant: str, busy: bool) -> str:
        """``"save"`` or ``"skip"``: one decision for every participant of a due snapshot.

        The first participant to ask decides: ``"skip"`` when its previous save
        is still running, else ``"save"``; every later participant gets the same
        answer (a busy one told to save waits for its previous save first), also
        from a manager restarted in between (the decision is a record on storage).
        """
        with self._lock:
            self._check_participant(participant)
            decision = self.save_decisions.get(snapshot_id)
            if decision is None:  # recorded on storage before it is answered: a restarted manager answers the same
                proposal = "skip" if busy and not self._started(snapshot_id) else "save"
                decision = self.save_decisions.decide(snapshot_id, proposal, participant)
            return decision[0]

    def decide_step(self, global_step: int, participant: str, kind: str | None, busy: bool,
                    interval_seconds: float) -> dict:
        """Under a time cadence: whether ``global_step`` is a save step, by this manager's clock, the same
        answer for every participant (``{"kind": "full" | "light" | None, "save": bool}``; see actors/decisions.py)."""
        with self._lock:
            self._check_participant(participant)
            return self.save_decisions.step(global_step, participant, kind, busy, interval_seconds, self._started)

    def _started(self, snapshot_id: str) -> bool:
        return snapshot_id in self.pending or self.storage.exists(join(snapshot_id, MANIFEST_NAME))

    def report(self, snapshot_id: str, attempt_id: str, participant: str, part: bytes) -> bytes:
        """A participant's part (metadata only); returns the merged manifest once committed."""
        with self._lock:
            self._check_participant(participant)
            self.bytes_received[snapshot_id] = self.bytes_received.get(snapshot_id, 0) + len(part)
            done = self._committed_manifest(snapshot_id, attempt_id)
            if done is not None:
                return done
            pending = self.pending.get(snapshot_id)
            if attempt_id in self.abort_errors and (pending is None or pending.attempt.attempt_id != attempt_id):
                raise self.abort_errors[attempt_id]
            if pending is None or pending.attempt.attempt_id != attempt_id:
                raise CheckpointError(f"{snapshot_id}: attempt {attempt_id} is not pending (aborted or superseded)",
                                      snapshot_id=snapshot_id)
            if pending.error is not None:
                raise pending.error
            if participant not in pending.expected:
                raise CheckpointError(f"{snapshot_id}: {participant!r} is not one of the expected participants "
                                      f"{pending.expected}", snapshot_id=snapshot_id)
            manifest = Manifest.from_bytes(part, snapshot_id)
            self._check_files(pending, participant, manifest)
            pending.reports[participant] = manifest
            if set(pending.reports) >= set(pending.expected):
                _pause_point("before-commit", snapshot_id)
                self._commit(snapshot_id, pending)
        wait = max(0.0, pending.deadline - time.monotonic()) + 5.0
        if not pending.done.wait(wait):
            raise CheckpointError(f"{snapshot_id}: not committed within the commit timeout", snapshot_id=snapshot_id)
        if pending.error is not None:
            raise pending.error
        return pending.manifest

    def abort(self, snapshot_id: str, attempt_id: str | None, participant: str, reason: str) -> None:
        """``participant``'s save of ``snapshot_id`` failed: abort the snapshot for every participant.

        ``attempt_id`` is None when it failed before ``begin``: participants
        that begin the snapshot later are refused at once.
        """
        with self._lock:
            self._check_participant(participant)
            pending = self.pending.get(snapshot_id)
            if pending is not None and not pending.done.is_set() and attempt_id in (None, pending.attempt.attempt_id):
                self._abort(snapshot_id, pending, f"{participant} failed: {reason}", by=participant)
            elif attempt_id is None and not self.storage.exists(join(snapshot_id, MANIFEST_NAME)):
                error = self._abort_error(snapshot_id, f"{participant} failed: {reason}", participant)
                self.refused[snapshot_id] = Refusal(error, participant, None)
                self.aborted += 1
                self._metrics.aborted()
                log.warning("manager aborted %s before it began: %s failed: %s", snapshot_id, participant, reason)

    def _check_participant(self, participant: str) -> None:
        if participant not in self.participants:
            raise UnknownParticipantError(
                f"participant {participant!r} is not registered with the manager of run {self.config.run_name!r}: "
                "only registered participants (a CheckpointEngine built with manager=...) may begin, report or "
                f"abort snapshots. Registered: {sorted(self.participants)}.", participant=participant)

    def _check_files(self, pending: Pending, participant: str, part: Manifest) -> None:
        attempt = pending.attempt
        for f in part.files:
            rel = f.path[len(attempt.file_prefix):] if f.path.startswith(attempt.file_prefix) else f.path
            path = join(attempt.data_prefix, rel)
            size = self.storage.size(path) if self.storage.exists(path) else None
            if size != f.size:
                raise CheckpointError(f"{attempt.snapshot_id}: {participant} reported {f.path} ({f.size} bytes) but "
                                      f"storage has {size}", snapshot_id=attempt.snapshot_id)

    def _commit(self, snapshot_id: str, pending: Pending) -> None:
        started = time.monotonic()
        parts = [pending.reports[p] for p in sorted(pending.reports)]
        head = next((m for p, m in sorted(pending.reports.items()) if p.startswith("learner-0")), parts[0])
        steps = {(m.global_step, m.kind) for m in parts}
        if len(steps) != 1:
            self._abort(snapshot_id, pending, f"participants disagree on step/kind: {sorted(steps)}")
            return
        files, components, probes, metrics, tags = [], {}, {}, {}, {}
        for m in parts:
            files += m.files
            merge_components(components, m.components)  # sharded layouts of one component: unioned
            probes.update((m.extra or {}).get("probes") or {})
            tags.update(m.tags)
        reported = self._last_metrics  # from Ray Train's reports (after_report), when the engine had none
        if reported.get("step") is None or reported["step"] <= head.global_step:
            metrics.update({k: v for k, v in reported.items() if k != "step"})
        for m in parts:
            metrics.update(m.metrics)
        metrics.update(head.metrics)
        merged = dataclasses.replace(
            head, files=files, components=components, metrics=metrics, tags=tags, created_at=now_iso(),
            writer={"attempt": pending.attempt.attempt_id, "participants": pending.expected},
            extra={"probes": probes} if probes else {})
        data = merged.to_bytes()
        try:
            self.strategy.commit(pending.attempt, data)
        except CommitConflictError as exc:
            self._abort(snapshot_id, pending, str(exc))
            return
        except CheckpointError as exc:
            self._abort(snapshot_id, pending, f"commit failed: {exc}")
            return
        self._tidy(snapshot_id, pending)
        info = SnapshotInfo.from_manifest(merged)
        self.engine.catalog.add(info)
        try:
            self.engine._after_commit()
        except CheckpointError as exc:  # committed: aliases and retention must not fail the save
            log.warning("%s committed, but housekeeping after the commit failed: %s", snapshot_id, exc)
        self._forget_before(info.global_step)
        pending.manifest = data
        pending.done.set()
        del self.pending[snapshot_id]
        self.committed += 1
        self._metrics.committed(time.monotonic() - started, info.global_step, self.bytes_received.get(snapshot_id, 0))
        log.info("manager committed %s from %s", snapshot_id, ", ".join(pending.expected))

    def _tidy(self, snapshot_id: str, pending: Pending) -> None:
        """Coordination files are not part of the snapshot: remove them (gc would too)."""
        folder = snapshot_id if self.storage.supports_rename and pending.attempt.data_prefix.startswith(STAGING) \
            else pending.attempt.data_prefix
        for name in ["attempt.json"] + [f"{p}.report.json" for p in pending.expected]:
            try:
                self.storage.remove(join(folder, name))
            except CheckpointError as exc:
                log.warning("could not remove %s/%s: %s", folder, name, exc)

    @staticmethod
    def _abort_error(snapshot_id: str, reason: str, by: str | None) -> SnapshotAbortedError:
        return SnapshotAbortedError(f"snapshot {snapshot_id} aborted, not committed: {reason}. Its files are "
                                    "debris for `rl-ckpt gc`.", snapshot_id=snapshot_id, participant=by, reason=reason)

    def _abort(self, snapshot_id: str, pending: Pending, reason: str, by: str | None = None) -> None:
        pending.error = self._abort_error(snapshot_id, reason, by)
        self.abort_errors[pending.attempt.attempt_id] = pending.error
        while len(self.abort_errors) > 256:
            del self.abort_errors[next(iter(self.abort_errors))]
        if by is not None:  # participants that have not begun yet hear it at begin, not after the timeout
            waiting = set(pending.expected) - pending.begun - {by}
            if waiting:
                self.refused[snapshot_id] = Refusal(pending.error, by, waiting)
        pending.done.set()
        self.pending.pop(snapshot_id, None)
        self.aborted += 1
        self._metrics.aborted()
        log.warning("manager aborted %s: %s", snapshot_id, reason)
        try:  # a restarted manager must not resume (and commit) what was aborted, should every report land
            self.storage.remove(join(pending.attempt.data_prefix, "attempt.json"))
        except CheckpointError as exc:
            log.warning("could not remove attempt.json of aborted %s (gc removes it): %s", snapshot_id, exc)

    def _forget_before(self, step: int) -> None:
        """Once a step committed, every participant is past the older ones: drop their decisions and refusals."""
        self.save_decisions.forget_before(step)
        for sid in [sid for sid in self.refused if (parse_snapshot_id(sid) or (step,))[0] < step]:
            del self.refused[sid]

    def _committed_manifest(self, snapshot_id: str, attempt_id: str) -> bytes | None:
        if not self.storage.exists(join(snapshot_id, MANIFEST_NAME)):
            return None
        try:
            manifest = read_manifest(self.storage, snapshot_id)
        except CheckpointError:
            return None
        if manifest.writer.get("attempt") != attempt_id:
            raise CommitConflictError(f"{snapshot_id} was committed by another attempt", snapshot_id=snapshot_id)
        return manifest.to_bytes()

    def _rebuild_pending(self) -> None:
        """After a restart: pending commits from the attempt folders on storage."""
        folders = []
        for entry in self.storage.list(STAGING):
            sid = entry.name.split(".", 1)[0] if entry.name.startswith("step_") else None
            rest = entry.name[len(sid) + 1:] if sid else ""
            if sid and rest.startswith("light."):
                sid, rest = sid + ".light", rest[len("light."):]
            if sid and parse_snapshot_id(sid):
                folders.append((sid, rest, join(STAGING, entry.name), ""))
        for entry in self.storage.list(""):
            if entry.is_dir and parse_snapshot_id(entry.name) and not self.storage.exists(join(entry.name, MANIFEST_NAME)):
                for inner in self.storage.list(entry.name):
                    if inner.is_dir:
                        folders.append((entry.name, inner.name, join(entry.name, inner.name), inner.name + "/"))
        for sid, attempt_id, prefix, file_prefix in folders:
            # One folder that cannot be resumed is aborted (debris for gc); the others still are.
            try:
                if not self.storage.exists(join(prefix, "attempt.json")):
                    continue
                body = json.loads(bytes(self.storage.read(join(prefix, "attempt.json"))))
                pending = Pending(Attempt(sid, attempt_id, prefix, file_prefix), list(body["expected"]),
                                  time.monotonic() + self.config.commit_timeout_seconds)
                for p in pending.expected:
                    path = join(prefix, f"{p}.report.json")
                    if self.storage.exists(path):
                        report = Manifest.from_bytes(self.storage.read(path), sid)
                        self._check_files(pending, p, report)
                        pending.reports[p] = report
            except Exception as exc:
                log.warning("cannot resume pending commit in %s (aborted; debris for gc): %s", prefix, exc)
                continue
            self.pending[sid] = pending
            self.save_decisions.decide(sid, "save", "a commit resumed after a manager restart")
            log.info("resumed pending commit of %s (%d of %d reports)", sid, len(pending.reports), len(pending.expected))
            if set(pending.reports) >= set(pending.expected):
                try:
                    self._commit(sid, pending)
                except Exception as exc:
                    self._abort(sid, pending, f"could not finish the commit after a manager restart: {exc}")

    # -- catalog, failures, plans ---------------------------------------------
    def snapshots(self) -> list[dict]:
        return [{k: v for k, v in dataclasses.asdict(i).items() if k != "manifest"} for i in self.engine.catalog.snapshots()]

    def stats(self) -> dict:
        return {"committed": self.committed, "aborted": self.aborted, "pending": sorted(self.pending),
                "bytes_received": dict(self.bytes_received), "started_at": self.started_at, "pid": os.getpid(),
                "beats": {n: p.beats for n, p in self.participants.items()}}

    def record_metrics(self, metrics: dict, step: int | None = None) -> None:
        """Metrics reported to Ray Train (after_report), kept for health and the coordinator."""
        with self._lock:
            self._last_metrics = {"step": step, **metrics}

    def record_failure(self, failure: dict, dead: list[dict] | None = None) -> dict:
        """Write a failure (FailureInfo JSON) into the run folder; returns it as stored.

        ``dead``: processes Ray reported dead (``{"actor_id", "pid"}``, see
        ``integrations.ray_train.dead_processes``). The participant that ran in one
        of them is the one that failed: the record names it, and a failure without
        a step takes that participant's last reported step, i.e. where it was when
        it died (a survivor may have run on until its collective failed).
        The failed participant counts as lost (``/healthz`` degraded) until it
        registers again or beats (unless its restarted process registered already).
        """
        info = FailureInfo.from_json(failure)
        with self._lock:
            failed = self._participant_of(dead or []) or info.participant
            info.participant = failed
            p = self.participants.get(failed) if failed else None
            if info.step is None and p is not None:
                # None if it was restarted already (the new process has reported no step): unknown is honest,
                # a survivor's step would be wrong.
                info.step = p.step
            elif info.step is None:  # nobody identified: the furthest any participant got
                info.step = max((q.step for q in self.participants.values() if q.step is not None), default=None)
            dead_pids = {d.get("pid") for d in dead or []} - {None}
            if p is not None and (not dead_pids or p.meta.get("pid") in dead_pids | {None}):
                p.lost = True  # not when the registration is already its restarted process
            _Metrics.lost(sum(q.lost for q in self.participants.values()))
            if info.kind != "heartbeat_lost":
                for q in self.participants.values():  # the group is restarting: silence is expected now
                    q.step = None
            self._last_failure = info.to_json()
        self.storage.makedirs(FAILURES)
        name = f"{FAILURES}/{info.time.replace(':', '').replace('+', 'p')}-{info.kind}.json"
        self.storage.write_atomic(name, json.dumps(info.to_json(), allow_nan=False).encode())
        log.warning("failure recorded: %s of %s at step %s: %s", info.kind, info.participant, info.step, info.message)
        return info.to_json()

    _last_failure: dict | None = None  # the newest failure recorded by this manager process (for /healthz)

    def _participant_of(self, dead: list[dict]) -> str | None:
        """The registered participant that ran in one of the ``dead`` processes (actor id first, then pid)."""
        for d in dead:
            for name, p in self.participants.items():
                actor_id = getattr(getattr(p.handle, "_actor_id", None), "hex", lambda: None)()
                if d.get("actor_id") and actor_id == d["actor_id"]:
                    return name
        for d in dead:
            for name, p in self.participants.items():
                if d.get("pid") is not None and p.meta.get("pid") == d["pid"]:
                    return name
        return None

    def failures(self) -> list[dict]:
        out = []
        for entry in sorted(self.storage.list(FAILURES), key=lambda e: e.name):
            try:
                out.append(json.loads(bytes(self.storage.read(f"{FAILURES}/{entry.name}"))))
            except (CheckpointError, ValueError) as exc:
                log.warning("unreadable failure record %s: %s", entry.name, exc)
        return out

    def plan(self) -> dict:
        """The recovery plan every participant follows (the same for all until something changes).

        The newest failure not yet answered by a decision goes to the coordinator;
        its decision is recorded in the run folder once.
        """
        with self._lock:
            decisions = self.engine.decisions()
            failures = self.failures()
            answered = {d.failure.time for d in decisions}
            open_failures = [f for f in failures if f.get("time") not in answered]
            newest = self.engine.catalog.snapshots()
            key = (len(failures), len(decisions), newest[-1].snapshot_id if newest else None)
            if self._plan_cache is not None and self._plan_cache[0][0] == key[0] and self._plan_cache[0][2] == key[2]:
                return self._plan_cache[1]
            # Saves still pending belong to the timeline being recovered from: finishing one with the
            # restarted participants' reports would mix two timelines in one snapshot.
            for sid, pending in list(self.pending.items()):
                self._abort(sid, pending, "a recovery plan was made; this save belongs to the run that failed")
            self.refused.clear()  # training goes on from the plan's snapshot: its steps are saved anew
            self.save_decisions.clear()
            failure = FailureInfo.from_json(open_failures[-1]) if open_failures else None
            plan = self.engine.plan_recovery(failure, deep=True)
            if plan.decision is not None:
                self.engine.record_decision(plan.decision)
            body = plan.to_json()
            body["decision"] = plan.decision.to_json() if plan.decision else None
            self._plan_cache = (key, body)
            return body

    # -- liveness ----------------------------------------------------------------
    def register(self, participant: str, meta: dict, handle: Any = None) -> None:
        """A participant process announces itself (pid, node, actor handle).

        Calls run concurrently in this actor, so a heartbeat sent after ``register``
        may be handled before it: a registration from the same process merges.
        """
        with self._lock:
            known = self.participants.get(participant)
            if known is not None and known.meta.get("pid") in (None, meta.get("pid")):
                known.meta, known.handle = {**known.meta, **meta}, handle or known.handle
                return
            self.participants[participant] = Participant(meta, handle, time.monotonic())
            self.unregistered.discard(participant)

    def unregister(self, participant: str) -> None:
        """A participant finished cleanly: it is no longer expected to beat (nor lost when silent)."""
        with self._lock:
            self.participants.pop(participant, None)
            self.unregistered.add(participant)

    def heartbeat(self, participant: str, step: int | None, last_snapshot: str | None) -> bool | None:
        """A participant is alive (and at ``step``; None: alive only).

        False: it is not registered (it registers again, e.g. after a manager
        restart); None: it unregistered (its liveness thread stops).
        """
        with self._lock:
            p = self.participants.get(participant)
            if p is None:
                return None if participant in self.unregistered else False
            p.last_beat, p.lost = time.monotonic(), False
            p.beats += 1
            if step is not None:
                p.step, p.last_snapshot = step, last_snapshot
            return True

    def _watch(self) -> None:
        interval = self.config.heartbeat_interval_seconds
        while not self._stop.wait(min(1.0, interval / 2)):
            now = time.monotonic()
            with self._lock:
                for sid, pending in list(self.pending.items()):
                    if now > pending.deadline and not pending.done.is_set():
                        missing = sorted(set(pending.expected) - set(pending.reports))
                        self._abort(sid, pending, f"participants {missing} did not report within "
                                                  f"{self.config.commit_timeout_seconds:.0f} s")
                # Only participants that are training (have reported a step) can be lost: a worker idle
                # before training starts, or one already known to have failed, is not a new incident.
                lost = [(n, p) for n, p in self.participants.items()
                        if p.step is not None and not p.lost and now - p.last_beat > 2 * interval]
                for _, p in lost:
                    p.lost = True
            if lost:
                self._heartbeat_lost(lost, now)

    def _heartbeat_lost(self, lost: list, now: float) -> None:
        """One failure record per incident: participants that fell silent together are listed together.

        The record names the first of them and the step it last reported (where it stopped).
        """
        interval = self.config.heartbeat_interval_seconds
        with self._lock:
            _Metrics.lost(sum(p.lost for p in self.participants.values()))
        if now - self._last_loss_record < 2 * interval:
            return  # the same incident, noticed a watch cycle later for other participants
        self._last_loss_record = now
        names = ", ".join(name for name, _ in lost)
        ages = ", ".join(f"{now - p.last_beat:.1f}" for _, p in lost)
        msg = f"{names} sent no heartbeat for {ages} s (> 2 x {self.config.heartbeat_interval_seconds} s)"
        step = lost[0][1].step
        try:
            self.record_failure(FailureInfo(kind="heartbeat_lost", step=step, message=msg, participant=lost[0][0]).to_json())
        except CheckpointError as exc:
            log.error("could not record heartbeat loss of %s: %s", names, exc)
        if self.kill_hung:
            import ray

            for name, p in lost:
                if p.handle is not None:
                    log.warning("stopping hung participant %s so Ray restarts it", name)
                    ray.kill(p.handle, no_restart=False)

    def health(self) -> dict:
        """The run's health: ``status`` is "degraded" (``/healthz`` answers 503) while a participant is lost
        (dead or silent) or a snapshot is quarantined; ``failure`` is then the newest failure recorded."""
        now = time.monotonic()
        with self._lock:
            newest = self.engine.catalog.snapshots()
            parts = {n: {"heartbeat_age_s": round(now - p.last_beat, 3), "step": p.step, "lost": p.lost,
                         "last_snapshot": p.last_snapshot, **p.meta} for n, p in self.participants.items()}
            steps = [p.step for p in self.participants.values() if p.step is not None]
            lost = sorted(n for n, p in parts.items() if p["lost"])
            quarantined = bool(self.patrol and self.patrol.status()["quarantined"])
            failure = None
            if lost:
                failure = self._last_failure
                if failure is None:  # recorded before this manager process started
                    recorded = self.failures()
                    failure = recorded[-1] if recorded else None
            _Metrics.lost(len(lost))
            return {
                "status": "degraded" if lost or quarantined else "ok",
                "run": self.config.run_name, "storage": self.storage.url,
                "last_step": max(steps) if steps else (newest[-1].global_step if newest else None),
                "last_committed_snapshot": newest[-1].snapshot_id if newest else None,
                "participants": parts, "lost": lost, "failure": failure, "pending_commits": sorted(self.pending),
                "storage_free_bytes": self.storage.free_bytes(),
                "patrol": self.patrol.status() if self.patrol else {"enabled": False},
                "committed": self.committed, "aborted": self.aborted,
            }

    def healthz_url(self) -> str | None:
        return self.healthz.url if self.healthz else None

    def ping(self) -> str:
        return "ok"


class _Metrics:
    """Prometheus metrics through ray.util.metrics (no-ops outside Ray)."""

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
        if self._commits is not None:
            self._commits.inc()
            self._latency.observe(seconds)
            self._step.set(step)
            self._bytes.set(nbytes)

    def aborted(self) -> None:
        if self._commits is not None:
            self._aborts.inc()

    _lost_gauge = None

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

def _pause_point(point: str, snapshot_id: str) -> None:
    """The test hook (``RL_CKPT_TEST_PAUSE_DIR``): hold here while the test's pause file exists."""
    folder = os.environ.get(PAUSE_DIR_ENV)
    if not folder:
        return
    gate = os.path.join(folder, f"pause-{point}-{snapshot_id}")
    if not os.path.exists(gate):
        return
    with open(os.path.join(folder, f"paused-{point}-{snapshot_id}"), "w") as f:
        f.write(str(os.getpid()))
    log.warning("test hook: paused at %s of %s", point, snapshot_id)
    while os.path.exists(gate):
        time.sleep(0.05)
