"""One participant's side of a commit coordinated by the ``CheckpointManager`` (:mod:`rl_ckpt._commit.two_phase`).

Each learner rank and rollout worker writes its own shards *directly* to
storage, inside the attempt the manager assigned, under a folder named after
the participant (``learner-1/``, ``rollout-0/``) or ``shared/`` for state that
is identical on every learner rank (written once, by rank 0). It then writes
``<participant>.report.json`` (its part of the manifest) next to its files and
sends the same metadata to the manager, which commits the snapshot once every
expected participant has reported. Tensor bytes never go to the manager.

The calls go through a manager client (``rl_ckpt.integrations._managed.ManagerClient``:
any object with ``call(method, *args, timeout=...)``), so this module needs no Ray.
Every manager call is idempotent: a call that failed after it took effect (or
was retried after a manager restart) does no harm.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from rl_ckpt._commit.base import Attempt, CommitStrategy
from rl_ckpt.errors import CheckpointError
from rl_ckpt._format.manifest import Manifest
from rl_ckpt._run.layout import report_name
from rl_ckpt._storage import Storage, join

log = logging.getLogger("rl_ckpt")


class ManagerCalls(Protocol):
    """What a participant commit needs of its manager client."""

    def call(self, method: str, *args: Any, timeout: float | None) -> Any: ...


class ParticipantCommit(CommitStrategy):
    """The commit strategy of one participant of a sharded save: the manager is the commit point.

    ``commit`` reports this participant's part and returns the merged manifest the
    manager committed; ``fail`` (also before ``begin``) makes the manager abort the
    snapshot for every participant.
    """

    def __init__(
        self,
        storage: Storage,
        client: ManagerCalls,
        participant: str,
        expected: list[str],
        *,
        commit_timeout: float = 300.0,
    ) -> None:
        super().__init__(storage)
        self.client = client
        self.participant = participant
        self.expected = list(expected)
        self.commit_timeout = commit_timeout
        self.bytes_sent = 0

    def begin(self, snapshot_id: str, attempt_id: str | None = None) -> Attempt:
        got = self.client.call("begin", snapshot_id, self.expected, self.participant, timeout=self.commit_timeout)
        return Attempt(**got)

    def commit(self, attempt: Attempt, manifest: bytes) -> Manifest:
        """Report this participant's part; returns the merged manifest once the manager committed it."""
        self.storage.write(join(attempt.data_prefix, report_name(self.participant)), [manifest], durable=True)
        self.bytes_sent += len(manifest)
        final = self.client.call(
            "report",
            attempt.snapshot_id,
            attempt.attempt_id,
            self.participant,
            manifest,
            timeout=self.commit_timeout + 30,
        )
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
            self.client.call(
                "abort",
                snapshot_id,
                attempt.attempt_id if attempt else None,
                self.participant,
                reason[:2000],
                timeout=30,
            )
        except CheckpointError as exc:
            log.warning("could not tell the manager to abort %s: %s", snapshot_id, exc)

    def abort(self, attempt: Attempt) -> None:
        """Abort this participant's attempt: the manager aborts the snapshot for everyone."""
        self.fail(attempt.snapshot_id, attempt, CheckpointError("a participant's save failed"))
