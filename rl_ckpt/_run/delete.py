"""Deleting a committed snapshot (retention, a memory snapshot of an abandoned timeline) so that a reader sees
it complete or not at all. Not to be confused with *retiring* a snapshot (``run/retire.py``): that moves a
failed timeline's snapshot into ``history/retired/`` and keeps it."""

from __future__ import annotations

from rl_ckpt.errors import StorageError
from rl_ckpt._format.manifest import MANIFEST_NAME
from rl_ckpt._run.layout import TRASH
from rl_ckpt._storage import Storage, join
from rl_ckpt._storage.base import unique_suffix


def delete_snapshot(storage: Storage, snapshot_id: str) -> bool:
    """Delete a committed snapshot so that it is either fully listed or not listed at all.

    With rename: move the folder into ``.trash/`` (one atomic step), then
    delete it. Without: remove the manifest first (the snapshot is no longer
    committed), then its data. A crash in between leaves debris for ``gc``,
    never a listed snapshot with missing files.

    Returns False when the snapshot was already gone (deleted by hand, or by
    another engine on the same run): deleting it again is not an error.
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
                return False  # someone else deleted it between the check and the rename
            raise
        storage.sync_dir("")
        storage.remove_tree(trash)
        return True
    gone = not storage.exists(join(snapshot_id, MANIFEST_NAME))
    storage.remove(join(snapshot_id, MANIFEST_NAME))
    storage.remove_tree(snapshot_id)
    return not gone
