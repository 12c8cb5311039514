"""``ManifestLastCommit``: the commit of object stores (and of local disks with ``atomic_write: false``).

No rename: data files go to ``<id>/<attempt>/`` (a folder of this attempt only,
so concurrent writers never overwrite each other's data), then the manifest
``<id>/meta.json`` is written with a create-only write (``If-None-Match: *`` on
S3, ``link`` locally). Until it exists the folder is debris; the loser of a race
gets ``CommitConflictError``.
"""

from __future__ import annotations

from rl_ckpt._commit.base import CommitStrategy
from rl_ckpt._format.manifest import MANIFEST_NAME
from rl_ckpt._run.layout import Attempt, in_place_attempt
from rl_ckpt._storage import join
from rl_ckpt._storage.base import unique_suffix


class ManifestLastCommit(CommitStrategy):
    """Data files first, the manifest last as a create-only write: see the module docstring."""

    def begin(self, snapshot_id: str, attempt_id: str | None = None) -> Attempt:
        self.check_free(snapshot_id)
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
