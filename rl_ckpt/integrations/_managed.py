"""A participant's link to the run's ``CheckpointManager`` actor: its manager client (decisions, plans,
failures, and the calls of the commit protocol), its heartbeat, and :func:`join_manager`, which registers a
process and hands it both plus its commit strategy (:class:`~rl_ckpt._commit.participant.ParticipantCommit`).

Every manager call is idempotent: a Ray call that failed after it took effect
(or was retried after a manager restart) does no harm.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from rl_ckpt._commit.participant import ParticipantCommit
from rl_ckpt.errors import CheckpointError, ManagerUnavailableError, UnknownParticipantError
from rl_ckpt._storage import Storage

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
            "then restart the participants.",
            manager=name,
        ) from None
    except ray.exceptions.GetTimeoutError as exc:
        raise CheckpointError(f"checkpoint manager did not answer within {timeout} s") from exc


class ManagerClient:
    """This participant's calls to the run's ``CheckpointManager``: the commit protocol's calls (for
    :class:`~rl_ckpt._commit.participant.ParticipantCommit`), the save/skip and cadence decisions, the recovery
    plan, failures. Separate from the commit strategy: deciding and planning are not committing.

    After a manager restart (registrations are not kept) a call that names this participant registers
    again, once, through the heartbeat.
    """

    def __init__(
        self,
        manager,
        participant: str,
        *,
        commit_timeout: float = 300.0,
        heartbeat: "Heartbeat | None" = None,
        name: str = "the checkpoint manager",
    ) -> None:
        self.manager = manager
        self.participant = participant
        self.commit_timeout = commit_timeout
        self.heartbeat = heartbeat
        self.name = name

    def call(self, method: str, *args: Any, timeout: float | None) -> Any:
        """A bound manager call; every failure comes back as a ``CheckpointError``."""
        try:
            return _ray_get(getattr(self.manager, method).remote(*args), timeout=timeout, name=self.name)
        except UnknownParticipantError:
            if self.heartbeat is None:
                raise
            self.heartbeat.register()
            return _ray_get(getattr(self.manager, method).remote(*args), timeout=timeout, name=self.name)

    def decide(self, snapshot_id: str, busy: bool) -> bool:
        """Whether every participant saves ``snapshot_id``: the first to ask decides for all."""
        return self.call("decide", snapshot_id, self.participant, busy, timeout=self.commit_timeout) == "save"

    def decide_step(
        self, global_step: int, kind: str | None, busy: bool, interval_seconds: float
    ) -> tuple[str | None, bool]:
        """Under a time cadence: ``(kind, save)`` for ``global_step``, by the manager's clock, the same for all.

        ``kind`` is what is due by step count alone; the answer's kind is None
        when nothing is due, and ``save`` False when the snapshot is skipped.
        """
        got = self.call(
            "decide_step", global_step, self.participant, kind, busy, interval_seconds, timeout=self.commit_timeout
        )
        return got["kind"], got["save"]

    def recovery_plan(self, failure: dict | None, light: bool = True) -> dict:
        """The manager's one recovery plan for every participant (JSON), after recording ``failure`` if given;
        ``light``: with the newest light layer on its target (the participants apply light layers)."""
        if failure is not None:
            _ray_get(self.manager.record_failure.remote(failure), timeout=60, name=self.name)
        return _ray_get(self.manager.plan.remote(light), timeout=self.commit_timeout, name=self.name)

    def unregister(self) -> None:
        """A clean exit, not a lost heartbeat (fire and forget)."""
        self.manager.unregister.remote(self.participant)


class Heartbeat:
    """Tells the manager this participant is alive and at which step.

    ``beat`` (from the training loop, at most ten times a second) sends the
    step; the manager calls a participant lost after 2 x ``interval`` seconds
    of silence once it has sent one. A daemon thread also sends a liveness
    beat every ``interval / 2`` seconds while the process lives, so a rank
    blocked in a collective, ``ray.train.report`` or a long save is not
    counted as lost; a frozen or dead process is. It stops on ``close``.
    """

    def __init__(
        self, manager, participant: str, interval: float, actor_handle: Any = None, name: str = "the checkpoint manager"
    ) -> None:
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
                known = _ray_get(
                    self.manager.heartbeat.remote(self.participant, None, None),
                    timeout=max(10.0, 4 * self.alive_interval),
                    name=self.name,
                )
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


def join_manager(
    manager,
    storage: Storage,
    config,
    role: str,
    rank: int,
    world_size: int,
    participants: list[str] | None,
    actor_handle: Any = None,
) -> tuple[str, ManagerClient, ParticipantCommit]:
    """Register this process with ``manager`` as ``<role>-<rank>``: its name, manager client (with its heartbeat)
    and commit strategy.

    ``participants``: every participant a snapshot waits for (default: the
    ``world_size`` participants of ``role``).
    """
    participant = participant_name(role, rank)
    expected = participants or [participant_name(role, r) for r in range(world_size)]
    label = f"CheckpointManager 'rl_ckpt:{config.run_name}'"
    heartbeat = Heartbeat(manager, participant, config.heartbeat_interval_seconds, actor_handle, name=label)
    client = ManagerClient(
        manager, participant, commit_timeout=config.commit_timeout_seconds, heartbeat=heartbeat, name=label
    )
    commit = ParticipantCommit(storage, client, participant, expected, commit_timeout=config.commit_timeout_seconds)
    return participant, client, commit
