"""``StagedRenameCommit``: the commit of local disks and NFS (``atomic_write: true``).

Files go to ``.staging/<id>.<host-pid-...>/``; each is fsynced. The manifest is
written there last and fsynced, the staging folder fsynced, then one ``rename``
(no-replace) publishes ``<id>/`` and the run folder is fsynced. A kill -9 at any
line leaves either nothing visible (debris under ``.staging/`` for ``gc``) or the
complete snapshot. Two writers of one step: the second rename fails, so exactly
one commits.
"""

from __future__ import annotations

from rl_ckpt._commit.base import CommitStrategy
from rl_ckpt._format.manifest import MANIFEST_NAME
from rl_ckpt._run.layout import STAGING, Attempt, staged_attempt
from rl_ckpt._storage import join
from rl_ckpt._storage.base import unique_suffix


class StagedRenameCommit(CommitStrategy):
    """Staging folder, manifest last inside it, one no-replace rename: see the module docstring."""

    def begin(self, snapshot_id: str, attempt_id: str | None = None) -> Attempt:
        self.check_free(snapshot_id)
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
