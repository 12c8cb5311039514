"""How a snapshot becomes visible: two commit strategies behind one interface.

``StagedRenameCommit`` (local disks, NFS; ``atomic_write: true``)
    Files go to ``.staging/<id>.<host-pid-...>/``; each is fsynced. The
    manifest is written there last and fsynced, the staging folder fsynced,
    then one ``rename`` (no-replace) publishes ``<id>/`` and the run folder is
    fsynced. A kill -9 at any line leaves either nothing visible (debris under
    ``.staging/`` for ``gc``) or the complete snapshot. Two writers of one
    step: the second rename fails, so exactly one commits.

``ManifestLastCommit`` (object stores; local with ``atomic_write: false``)
    No rename: data files go to ``<id>/<attempt>/`` (a folder of this attempt
    only, so concurrent writers never overwrite each other's data), then the
    manifest ``<id>/meta.json`` is written with a create-only write
    (``If-None-Match: *`` on S3, ``link`` locally). Until it exists the folder
    is debris; the loser of a race gets ``CommitConflictError``.
"""

from __future__ import annotations

import abc

from rl_ckpt.errors import CommitConflictError, StorageError
from rl_ckpt.format.manifest import MANIFEST_NAME, Manifest
from rl_ckpt.run.layout import STAGING, TRASH, Attempt, in_place_attempt, staged_attempt
from rl_ckpt.storage import Storage, join
from rl_ckpt.storage.base import unique_suffix

__all__ = ["STAGING", "TRASH", "Attempt", "CommitStrategy", "StagedRenameCommit", "ManifestLastCommit",
           "strategy_for", "retire_snapshot", "post_commit_text"]


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

    def _check_free(self, snapshot_id: str) -> None:
        if self.storage.exists(join(snapshot_id, MANIFEST_NAME)):
            raise CommitConflictError(
                f"snapshot {snapshot_id} is already committed; a committed snapshot is never overwritten. "
                "Save under a new step, or delete the old snapshot first (rl-ckpt gc / retention).",
                snapshot_id=snapshot_id,
            )


class StagedRenameCommit(CommitStrategy):
    def begin(self, snapshot_id: str, attempt_id: str | None = None) -> Attempt:
        self._check_free(snapshot_id)
        attempt = staged_attempt(snapshot_id, attempt_id or unique_suffix())
        self.storage.makedirs(attempt.data_prefix)
        return attempt

    def commit(self, attempt: Attempt, manifest: bytes) -> None:
        self.storage.write(join(attempt.data_prefix, MANIFEST_NAME), [manifest], durable=True)
        self.storage.sync_dir(attempt.data_prefix)
        self.storage.rename_dir(attempt.data_prefix, attempt.snapshot_id)
        # The rename is durable only once both folders' entries are on disk.
        self.storage.sync_dir("")
        self.storage.sync_dir(STAGING)

    def abort(self, attempt: Attempt) -> None:
        self.storage.remove_tree(attempt.data_prefix)


class ManifestLastCommit(CommitStrategy):
    def begin(self, snapshot_id: str, attempt_id: str | None = None) -> Attempt:
        self._check_free(snapshot_id)
        attempt = in_place_attempt(snapshot_id, attempt_id or unique_suffix())
        self.storage.makedirs(attempt.data_prefix)
        return attempt

    def commit(self, attempt: Attempt, manifest: bytes) -> None:
        # On a filesystem, the data files' names must be durable before the manifest that vouches
        # for them, and the snapshot folder's name after it. Object stores have no folders to sync.
        filesystem = self.storage.supports_rename
        if filesystem:
            self.storage.sync_dir(attempt.data_prefix)
        self.storage.write(join(attempt.snapshot_id, MANIFEST_NAME), [manifest], create_only=True, durable=True)
        if filesystem:
            self.storage.sync_dir(attempt.snapshot_id)
            self.storage.sync_dir("")

    def abort(self, attempt: Attempt) -> None:
        self.storage.remove_tree(attempt.data_prefix)


def strategy_for(storage: Storage, atomic_write: bool = True) -> CommitStrategy:
    """Staged rename where the backend can rename folders atomically, else manifest-last."""
    if atomic_write and storage.supports_rename:
        return StagedRenameCommit(storage)
    return ManifestLastCommit(storage)


def retire_snapshot(storage: Storage, snapshot_id: str) -> bool:
    """Delete a committed snapshot so that it is either fully listed or not listed at all.

    With rename: move the folder into ``.trash/`` (one atomic step), then
    delete it. Without: remove the manifest first (the snapshot is no longer
    committed), then its data. A crash in between leaves debris for ``gc``,
    never a listed snapshot with missing files.

    Returns False when the snapshot was already gone (deleted by hand, or by
    another engine on the same run): retiring it again is not an error.
    """
    if storage.supports_rename:
        if not storage.exists(snapshot_id):
            return False
        trash = join(TRASH, f"{snapshot_id}.{unique_suffix()}")
        storage.makedirs(TRASH)
        try:
            storage.rename_dir(snapshot_id, trash)
        except StorageError:
            if not storage.exists(snapshot_id):
                return False  # someone else retired it between the check and the rename
            raise
        storage.sync_dir("")
        storage.remove_tree(trash)
        return True
    gone = not storage.exists(join(snapshot_id, MANIFEST_NAME))
    storage.remove(join(snapshot_id, MANIFEST_NAME))
    storage.remove_tree(snapshot_id)
    return not gone


def post_commit_text(exc: BaseException) -> str:
    """An error's text as seen after the commit point: a storage hint that nothing was committed is untrue here."""
    return str(exc).replace("; nothing was committed by this save", "")
