"""Deleting a committed snapshot (retention, a memory snapshot of an abandoned timeline) so that a reader sees
it complete or not at all. Not to be confused with *retiring* a snapshot (``run/retire.py``): that moves a
failed timeline's snapshot into ``history/retired/`` and keeps it."""

from __future__ import annotations

import logging

from rl_ckpt.errors import CheckpointError, StorageError
from rl_ckpt._format.manifest import MANIFEST_NAME, parse_snapshot_id
from rl_ckpt._run.layout import TRASH
from rl_ckpt._storage import Storage, join
from rl_ckpt._storage.base import unique_suffix

log = logging.getLogger("rl_ckpt")


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


def delete_committed_after(storage: Storage, step: int) -> list[str]:
    """Delete the committed snapshots of a step after ``step`` (a timeline that failed), each manifest first, then
    only the files that manifest names; returns their ids.

    Nothing else in a snapshot's folder is touched: while this runs, a participant of the timeline that goes on
    may already be saving a step after ``step`` into that folder or another, under file names of its own (it
    restored sooner and went on; its snapshot cannot commit before this process saves its own part). Folders
    without a manifest (such a save, or debris of the failed timeline) are left to the storage's budget or
    ``rl-ckpt gc``. A manifest that cannot be read is removed alone (it belongs to the failed timeline and would
    stop the save of its step); one snapshot that cannot be deleted is logged and the others go on.
    """
    from rl_ckpt._run.snapshot_files import read_manifest

    deleted = []
    for entry in storage.list(""):
        parsed = parse_snapshot_id(entry.name) if entry.is_dir else None
        manifest = storage.stat(join(entry.name, MANIFEST_NAME)) if parsed is not None and parsed[0] > step else None
        if manifest is None:
            continue
        sid = entry.name
        try:
            try:
                files = [join(sid, f.path) for f in read_manifest(storage, sid, size=manifest.size).files]
            except CheckpointError as exc:
                files = []
                log.warning(
                    "%s (newer than step %d): its manifest is unreadable (%s); removing it alone", sid, step, exc
                )
            storage.remove(join(sid, MANIFEST_NAME))  # no longer committed: nobody lists it
            for path in files:
                storage.remove(path)
            deleted.append(sid)
        except CheckpointError as exc:
            log.warning("could not delete %s (newer than step %d) of the failed timeline: %s", sid, step, exc)
    return deleted
