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

from .commit import Attempt
from .errors import CheckpointError
from .manifest import Manifest
from .storage import Storage, join

log = logging.getLogger("rl_ckpt")

REPLICATED_KINDS = ("module", "optimizer", "scheduler", "progress")


def participant_name(role: str, rank: int) -> str:
    return f"{role}-{rank}"


def _ray_get(ref, timeout: float | None = None):
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:  # unwrap our own errors raised inside the manager
        cause = exc.as_instanceof_cause()
        if isinstance(cause, CheckpointError):
            raise cause from None
        raise CheckpointError(f"checkpoint manager call failed: {exc}") from exc
    except ray.exceptions.GetTimeoutError as exc:
        raise CheckpointError(f"checkpoint manager did not answer within {timeout} s") from exc


class ManagedCommit:
    """A commit strategy whose commit point is the manager (same interface as ``rl_ckpt.commit``)."""

    def __init__(self, storage: Storage, manager, participant: str, expected: list[str], *,
                 commit_timeout: float = 300.0) -> None:
        self.storage = storage
        self.manager = manager
        self.participant = participant
        self.expected = list(expected)
        self.commit_timeout = commit_timeout
        self.bytes_sent = 0

    def begin(self, snapshot_id: str, attempt_id: str | None = None) -> Attempt:
        got = _ray_get(self.manager.begin.remote(snapshot_id, self.expected), timeout=self.commit_timeout)
        return Attempt(**got)

    def commit(self, attempt: Attempt, manifest: bytes) -> Manifest:
        """Report this participant's part; returns the merged manifest once the manager committed it."""
        self.storage.write(join(attempt.data_prefix, f"{self.participant}.report.json"), [manifest], durable=True)
        self.bytes_sent += len(manifest)
        final = _ray_get(self.manager.report.remote(attempt.snapshot_id, attempt.attempt_id, self.participant, manifest),
                         timeout=self.commit_timeout + 30)
        return Manifest.from_bytes(final, attempt.snapshot_id)

    def abort(self, attempt: Attempt) -> None:
        # Other participants' files live in the same attempt: the manager aborts the snapshot and
        # leaves the debris to gc, rather than each participant deleting pieces of it.
        try:
            _ray_get(self.manager.abort.remote(attempt.snapshot_id, attempt.attempt_id, self.participant,
                                               "a participant's save failed"), timeout=30)
        except CheckpointError as exc:
            log.warning("could not tell the manager to abort %s: %s", attempt.snapshot_id, exc)


class Heartbeat:
    """Sends (step, last committed snapshot) to the manager, at most ten times a second.

    The manager calls a participant lost after 2 x ``interval`` seconds of
    silence; sending more often than that keeps its view of the step current
    (a failure is recorded at about the right step) for the cost of one small
    fire-and-forget call per 100 ms.
    """

    def __init__(self, manager, participant: str, interval: float, actor_handle: Any = None) -> None:
        self.manager = manager
        self.participant = participant
        self.interval = min(interval, 0.1)
        self._last = 0.0
        self._lock = threading.Lock()
        node = os.uname().nodename
        manager.register.remote(participant, {"pid": os.getpid(), "node": node}, actor_handle)

    def beat(self, step: int, last_snapshot: str | None, *, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last < self.interval:
                return
            self._last = now
        self.manager.heartbeat.remote(self.participant, step, last_snapshot)  # fire and forget

