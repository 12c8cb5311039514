"""The ``CheckpointManager``'s side of the two-phase commit: the actor's calls (begin, report, abort) over the
Ray-free :class:`~rl_ckpt._commit.two_phase.CommitProtocol`, adding what only the actor has: its lock, the
participant registry (a call must come from a registered participant) and the save/skip decisions (a snapshot
every participant skipped is refused at ``begin``). ``report`` waits for the commit outside the lock, so the
other participants' reports get in.
"""

from __future__ import annotations

import threading
import time

from rl_ckpt._commit.two_phase import CommitProtocol
from rl_ckpt.errors import CheckpointError, SnapshotSkippedError

from .decisions import SaveDecisions
from .participants import ParticipantRegistry


class ManagerCommits:
    """The actor's commit calls: checks, then the protocol under the manager's lock."""

    def __init__(
        self,
        protocol: CommitProtocol,
        lock: threading.RLock,
        registry: ParticipantRegistry,
        save_decisions: SaveDecisions,
    ) -> None:
        self.protocol = protocol
        self.lock = lock
        self.registry = registry
        self.save_decisions = save_decisions

    def begin(self, snapshot_id: str, expected: list[str], participant: str) -> dict:
        """The attempt every participant of ``snapshot_id`` writes into (the same one for all).

        Raises the abort error at once when another participant already failed
        this snapshot, or the participants decided to skip it.
        """
        with self.lock:
            self.registry.check(participant)
            decision = self.save_decisions.get(snapshot_id)
            if decision is not None and decision[0] == "skip":
                raise SnapshotSkippedError(
                    f"snapshot {snapshot_id} was skipped by every participant: {decision[1]}'s previous save was "
                    "still running when it was due",
                    snapshot_id=snapshot_id,
                    participant=decision[1],
                )
            return self.protocol.begin(snapshot_id, expected, participant)

    def report(self, snapshot_id: str, attempt_id: str, participant: str, part: bytes) -> bytes:
        """A participant's part (metadata only); returns the merged manifest once committed."""
        with self.lock:
            self.registry.check(participant)
            pending = self.protocol.report(snapshot_id, attempt_id, participant, part)
        if isinstance(pending, bytes):
            return pending  # committed already (a retried call)
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
        with self.lock:
            self.registry.check(participant)
            self.protocol.abort(snapshot_id, attempt_id, participant, reason)
