"""The participant side of a sharded save through the ``CheckpointManager`` actor.

Each learner rank and rollout worker writes its own shards *directly* to
storage, inside the attempt the manager assigned, under a folder named after
the participant (``learner-1/``, ``rollout-0/``) or ``shared/`` for state that
is identical on every learner rank (written once, by rank 0). It then writes
``<participant>.report.json`` (its part of the manifest) next to its files and
sends the same metadata to the manager, which commits the snapshot once every
expected participant has reported. Tensor bytes never go to the manager.

Every manager call is idempotent: a Ray call that failed after it took effect
(or was retried after a manager restart) does no harm.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from rl_ckpt.run.commit import Attempt, CommitStrategy
from rl_ckpt.run.layout import report_name
from rl_ckpt.errors import (  # noqa: F401  (importable from here too)
    CheckpointError,
    ManagerUnavailableError,
    SnapshotAbortedError,
    SnapshotSkippedError,
    UnknownParticipantError,
)
from rl_ckpt.format.manifest import Manifest
from rl_ckpt.storage import Storage, join

log = logging.getLogger("rl_ckpt")


def participant_name(role: str, rank: int) -> str:
    return f"{role}-{rank}"


def _ray_get(ref, timeout: float | None = None, name: str = "the checkpoint manager"):
    """``ray.get`` on a manager call; every failure comes back as a ``CheckpointError``."""
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:  # unwrap our own errors raised inside the manager
        cause = getattr(exc, "cause", None)  # the error itself, without Ray's traceback text around it
        if isinstance(cause, CheckpointError):
            raise cause from None
        cause = exc.as_instanceof_cause()
        if isinstance(cause, CheckpointError):
            raise cause from None
        raise CheckpointError(f"checkpoint manager call failed: {exc}") from exc
    except ray.exceptions.RayActorError as exc:  # died, unreachable, or its constructor raised
        raise ManagerUnavailableError(
            f"{name} is dead or unreachable ({type(exc).__name__}): nothing more can be committed through it. "
            "Check it with `ray list actors --detail` and its log; recreate it with "
            "CheckpointManager.get_or_create(...) (committed snapshots are on storage and are found again), "
            "then restart the participants.", manager=name) from None
    except ray.exceptions.GetTimeoutError as exc:
        raise CheckpointError(f"checkpoint manager did not answer within {timeout} s") from exc


class ManagedCommit(CommitStrategy):
    """The commit strategy of one participant of a sharded save: the manager is the commit point.

    ``commit`` reports this participant's part and returns the merged manifest the
    manager committed; ``fail`` (also before ``begin``) makes the manager abort the
    snapshot for every participant.
    """

    def __init__(self, storage: Storage, manager, participant: str, expected: list[str], *,
                 commit_timeout: float = 300.0, heartbeat: "Heartbeat | None" = None,
                 name: str = "the checkpoint manager") -> None:
        super().__init__(storage)
        self.name = name
        self.manager = manager
        self.participant = participant
        self.expected = list(expected)
        self.commit_timeout = commit_timeout
        self.heartbeat = heartbeat
        self.bytes_sent = 0

    def _call(self, method: str, *args: Any, timeout: float | None) -> Any:
        """A bound manager call; after a manager restart (registrations are not kept) register again, once."""
        try:
            return _ray_get(getattr(self.manager, method).remote(*args), timeout=timeout, name=self.name)
        except UnknownParticipantError:
            if self.heartbeat is None:
                raise
            self.heartbeat.register()
            return _ray_get(getattr(self.manager, method).remote(*args), timeout=timeout, name=self.name)

    def begin(self, snapshot_id: str, attempt_id: str | None = None) -> Attempt:
        got = self._call("begin", snapshot_id, self.expected, self.participant, timeout=self.commit_timeout)
        return Attempt(**got)

    def decide(self, snapshot_id: str, busy: bool) -> bool:
        """Whether every participant saves ``snapshot_id``: the first to ask decides for all."""
        return self._call("decide", snapshot_id, self.participant, busy, timeout=self.commit_timeout) == "save"

    def decide_step(self, global_step: int, kind: str | None, busy: bool, interval_seconds: float) -> tuple[str | None, bool]:
        """Under a time cadence: ``(kind, save)`` for ``global_step``, by the manager's clock, the same for all.

        ``kind`` is what is due by step count alone; the answer's kind is None
        when nothing is due, and ``save`` False when the snapshot is skipped.
        """
        got = self._call("decide_step", global_step, self.participant, kind, busy, interval_seconds,
                         timeout=self.commit_timeout)
        return got["kind"], got["save"]

    def commit(self, attempt: Attempt, manifest: bytes) -> Manifest:
        """Report this participant's part; returns the merged manifest once the manager committed it."""
        self.storage.write(join(attempt.data_prefix, report_name(self.participant)), [manifest], durable=True)
        self.bytes_sent += len(manifest)
        final = self._call("report", attempt.snapshot_id, attempt.attempt_id, self.participant, manifest,
                           timeout=self.commit_timeout + 30)
        return Manifest.from_bytes(final, attempt.snapshot_id)

    def fail(self, snapshot_id: str, attempt: Attempt | None, error: BaseException) -> None:
        """Tell the manager this participant's save of ``snapshot_id`` failed, so it aborts it for everyone.

        ``attempt`` is None when the save failed before ``begin`` (e.g. staging):
        the manager then refuses the snapshot to the participants that begin it later.
        """
        # Other participants' files live in the same attempt: the manager aborts the snapshot and
        # leaves the debris to gc, rather than each participant deleting pieces of it.
        reason = f"{type(error).__name__}: {error}"
        try:
            self._call("abort", snapshot_id, attempt.attempt_id if attempt else None, self.participant, reason[:2000],
                       timeout=30)
        except CheckpointError as exc:
            log.warning("could not tell the manager to abort %s: %s", snapshot_id, exc)

    def abort(self, attempt: Attempt) -> None:
        """Abort this participant's attempt: the manager aborts the snapshot for everyone."""
        self.fail(attempt.snapshot_id, attempt, CheckpointError("a participant's save failed"))

    def recovery_plan(self, failure: dict | None) -> dict:
        """The manager's one recovery plan for every participant (JSON), after recording ``failure`` if given."""
        if failure is not None:
            _ray_get(self.manager.record_failure.remote(failure), timeout=60, name=self.name)
        return _ray_get(self.manager.plan.remote(), timeout=self.commit_timeout, name=self.name)


class Heartbeat:
    """Tells the manager this participant is alive and at which step.

    ``beat`` (from the training loop, at most ten times a second) sends the
    step; the manager calls a participant lost after 2 x ``interval`` seconds
    of silence once it has sent one. A daemon thread also sends a liveness
    beat every ``interval / 2`` seconds while the process lives, so a rank
    blocked in a collective, ``ray.train.report`` or a long save is not
    counted as lost; a frozen or dead process is. It stops on ``close``.
    """

    def __init__(self, manager, participant: str, interval: float, actor_handle: Any = None,
                 name: str = "the checkpoint manager") -> None:
        self.manager = manager
        self.name = name
        self.participant = participant
        self.interval = min(interval, 0.1)
        self.alive_interval = interval / 2
        self.actor_handle = actor_handle
        self._last = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Synchronous: the manager binds begin/report/abort to registered participants.
        self.register()
        self._thread = threading.Thread(target=self._run, name=f"rl_ckpt-heartbeat-{participant}", daemon=True)
        self._thread.start()

    def register(self) -> None:
        """Announce this process to the manager (again after a manager restart)."""
        meta = {"pid": os.getpid(), "node": os.uname().nodename}
        _ray_get(self.manager.register.remote(self.participant, meta, self.actor_handle), timeout=60, name=self.name)

    def beat(self, step: int, last_snapshot: str | None, *, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last < self.interval:
                return
            self._last = now
        self.manager.heartbeat.remote(self.participant, step, last_snapshot)  # fire and forget

    def _run(self) -> None:
        while not self._stop.wait(self.alive_interval):
            try:
                # A step of None only says "alive": it neither moves the step nor re-arms loss detection
                # for a participant whose group is restarting.
                known = _ray_get(self.manager.heartbeat.remote(self.participant, None, None),
                                 timeout=max(10.0, 4 * self.alive_interval), name=self.name)
                if known is None:  # unregistered (finished): nothing more to say
                    return
                if known is False and not self._stop.is_set():
                    self.register()
            except CheckpointError as exc:  # the manager restarting: keep trying at the interval
                log.debug("heartbeat of %s not delivered: %s", self.participant, exc)

    def close(self) -> None:
        """Stop the liveness thread (before unregistering, so no beat follows the unregistration)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)


def join_manager(manager, storage: Storage, config, role: str, rank: int, world_size: int,
                 participants: list[str] | None, actor_handle: Any = None) -> tuple[str, "Heartbeat", ManagedCommit]:
    """Register this process with ``manager`` as ``<role>-<rank>``: its name, heartbeat and commit strategy.

    ``participants``: every participant a snapshot waits for (default: the
    ``world_size`` participants of ``role``).
    """
    participant = participant_name(role, rank)
    expected = participants or [participant_name(role, r) for r in range(world_size)]
    label = f"CheckpointManager 'rl_ckpt:{config.run_name}'"
    heartbeat = Heartbeat(manager, participant, config.heartbeat_interval_seconds, actor_handle, name=label)
    commit = ManagedCommit(storage, manager, participant, expected, commit_timeout=config.commit_timeout_seconds,
                           heartbeat=heartbeat, name=label)
    return participant, heartbeat, commit
