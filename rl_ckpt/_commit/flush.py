"""Durable copies of memory snapshots, made from memory (never from the trainer).

``flush_snapshot`` reads a committed memory snapshot file by file, each
verified against its manifest on the way out of memory, writes it to durable
storage inside an attempt of the durable storage's own commit strategy
(staged rename on local disks and NFS, manifest-last on object stores),
re-reads it there when ``verify_after_write`` is on, and publishes it with the
very manifest bytes the memory snapshot was committed with. File paths in a
manifest are relative to the snapshot folder, so the same manifest vouches for
both copies; a kill at any point leaves debris for ``gc``, never a durable
snapshot with missing files.

``FlushPolicy`` says which memory snapshot is due for a durable copy: every
K-th memory snapshot and/or every T seconds.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from rl_ckpt._run.snapshot_files import read_manifest, read_verified
from rl_ckpt._format.hashed_io import verify_written
from rl_ckpt.errors import CheckpointError
from rl_ckpt._format.manifest import MANIFEST_NAME, Manifest, parse_snapshot_id
from rl_ckpt._commit.base import CommitStrategy
from rl_ckpt._storage import Storage, join

log = logging.getLogger("rl_ckpt")


def flush_snapshot(
    memory: Storage, durable: Storage, snapshot_id: str, strategy: CommitStrategy, *, verify: bool = True
) -> Manifest | None:
    """Copy the committed memory snapshot ``snapshot_id`` to ``durable`` and commit it there.

    Returns its manifest, or None when ``durable`` holds it already. Raises
    ``CorruptSnapshotError`` (nothing committed) when a memory file does not
    match its manifest, and refuses snapshots whose data lives outside the
    snapshot folder (dedup objects), which the memory tier does not keep.
    """
    if durable.exists(join(snapshot_id, MANIFEST_NAME)):
        return None
    manifest = read_manifest(memory, snapshot_id)
    if any((sec or {}).get("objects") for sec in manifest.components.values()):
        raise CheckpointError(
            f"{snapshot_id}: its tensors are dedup objects outside the snapshot folder; the memory "
            "tier keeps whole snapshots only (turn dedup off for memory snapshots)",
            snapshot_id=snapshot_id,
        )
    raw = bytes(memory.read(join(snapshot_id, MANIFEST_NAME)))
    prefix = _common_prefix(manifest)
    attempt = strategy.begin(snapshot_id, prefix.rstrip("/") or None)
    try:
        made: set[str] = set()
        for entry in manifest.files:
            rel = entry.path[len(attempt.file_prefix) :] if entry.path.startswith(attempt.file_prefix) else None
            if rel is None:
                raise CheckpointError(
                    f"{snapshot_id}: file {entry.path} lies outside the attempt folder "
                    f"{attempt.file_prefix!r} of the durable commit",
                    snapshot_id=snapshot_id,
                )
            path = attempt.data_path(rel)
            parent = path.rsplit("/", 1)[0]
            if parent not in made:
                durable.makedirs(parent)
                made.add(parent)
            data = read_verified(memory, snapshot_id, entry, readonly_ok=True)  # verified, no copy out of memory
            durable.write(path, [data], durable=True)
            del data
            if verify:
                verify_written(durable, path, entry)
        strategy.commit(attempt, raw)
    except BaseException:
        try:
            strategy.abort(attempt)
        except CheckpointError as exc:
            log.warning("could not clean up the failed flush of %s (gc removes it): %s", snapshot_id, exc)
        raise
    return manifest


def _common_prefix(manifest: Manifest) -> str:
    """The attempt folder every file of a manifest-last snapshot lives in (``""`` when they are not all in one)."""
    tops = {f.path.split("/", 1)[0] + "/" for f in manifest.files if "/" in f.path}
    if len(tops) == 1 and all("/" in f.path for f in manifest.files):
        return tops.pop()
    return ""


@dataclasses.dataclass
class FlushPolicy:
    """Which memory snapshot gets a durable copy: the newest one, once ``every_snapshots`` memory snapshots
    were taken since the newest durable one, or ``every_seconds`` passed since the last flush (either may be
    None: off; both None: memory only, no durable copies)."""

    every_snapshots: int | None = 1
    every_seconds: float | None = None

    def due(
        self, memory_ids: list[str], durable_ids: list[str], last_flush: float | None, now: float | None = None
    ) -> str | None:
        """The memory snapshot to flush now, or None. Ids are full snapshot ids, any order."""
        now = time.monotonic() if now is None else now
        newest_durable = max((parse_snapshot_id(s) for s in durable_ids), default=None)
        newer = sorted(
            (s for s in memory_ids if newest_durable is None or parse_snapshot_id(s) > newest_durable),
            key=parse_snapshot_id,
        )
        if not newer:
            return None
        if self.every_snapshots is not None and len(newer) >= self.every_snapshots:
            return newer[-1]
        if self.every_seconds is not None and (last_flush is None or now - last_flush >= self.every_seconds):
            return newer[-1]
        return None
