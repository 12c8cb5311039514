"""The commit interface: how one writer's files become a committed snapshot, in every topology.

A save calls a :class:`CommitStrategy` in this order (the engine's save pipeline, the manager's
two-phase protocol and the memory tier's flush all do)::

    attempt = strategy.begin(snapshot_id)        # a place for the files; CommitConflictError if committed
    ... write every file under attempt.data_prefix (storage.write, fsynced), verify them ...
    merged = strategy.commit(attempt, manifest)  # publish: the commit point; returns the manifest as
                                                 # committed when it differs (several participants' parts)
    # on any error before or inside commit:
    strategy.fail(snapshot_id, attempt_or_None, error)   # abort this attempt (and tell the other participants)

``begin`` and ``commit`` are each called once per attempt; ``fail`` instead of ``commit`` when the save
failed (also before ``begin``: ``attempt`` is None then). What a ``kill -9`` between two calls leaves is
debris that no reader trusts: nothing is visible until ``commit`` returns, and ``rl-ckpt gc`` removes
the rest.

Strategies (one module each): :class:`~rl_ckpt._commit.local.StagedRenameCommit` (one no-replace rename
of a staging folder: local disks, NFS), :class:`~rl_ckpt._commit.object_store.ManifestLastCommit` (data
first, then a create-only manifest: object stores), :class:`~rl_ckpt._commit.participant.ParticipantCommit`
(one participant of a commit coordinated by the ``CheckpointManager``, :mod:`rl_ckpt._commit.two_phase`)
and :class:`~rl_ckpt._commit.collective.DistributedCommit` (torch.distributed ranks, rank 0 coordinates).
"""

from __future__ import annotations

import abc

from rl_ckpt.errors import CommitConflictError
from rl_ckpt._format.manifest import MANIFEST_NAME, Manifest
from rl_ckpt._run.layout import Attempt
from rl_ckpt._storage import Storage, join

__all__ = ["Attempt", "CommitStrategy"]


class CommitStrategy(abc.ABC):
    """How one writer's files become a committed snapshot: ``begin``, write files, then ``commit`` or ``fail``."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    @abc.abstractmethod
    def begin(self, snapshot_id: str, attempt_id: str | None = None) -> Attempt:
        """Prepare a place for the files; ``CommitConflictError`` if the snapshot is committed."""

    @abc.abstractmethod
    def commit(self, attempt: Attempt, manifest: bytes) -> Manifest | None:
        """Publish the snapshot with its manifest; ``CommitConflictError`` if someone else did.

        Returns the manifest as committed when it is not ``manifest`` (a save of several
        participants commits their parts merged into one), else None.
        """

    @abc.abstractmethod
    def abort(self, attempt: Attempt) -> None:
        """Remove what this attempt wrote (best effort; ``gc`` removes what is left)."""

    def fail(self, snapshot_id: str, attempt: Attempt | None, error: BaseException) -> None:
        """This writer's save of ``snapshot_id`` failed with ``error``; ``attempt`` is None before ``begin``.

        A single writer removes what it wrote; a strategy with several participants also
        tells the others, so that they fail with it instead of waiting.
        """
        if attempt is not None:
            self.abort(attempt)

    def check_free(self, snapshot_id: str) -> None:
        """``CommitConflictError`` if ``snapshot_id`` is committed already."""
        if self.storage.exists(join(snapshot_id, MANIFEST_NAME)):
            raise CommitConflictError(
                f"snapshot {snapshot_id} is already committed; a committed snapshot is never overwritten. "
                "Save under a new step, or delete the old snapshot first (rl-ckpt gc / retention).",
                snapshot_id=snapshot_id,
            )
