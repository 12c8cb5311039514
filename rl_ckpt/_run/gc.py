"""Find and remove the debris of crashed saves. Never touches a committed snapshot's files.

Debris is anything no manifest vouches for:
- ``.staging/<id>.<attempt>/`` folders (a staged save that never renamed);
- snapshot folders without ``meta.json`` (a manifest-last save that never committed);
- inside a committed snapshot, entries its manifest does not list (a losing
  writer's attempt folder, a stray temp file);
- ``.tmp-*`` files left by an interrupted ``write_atomic``.
Only entries older than ``grace_seconds`` are debris, so a save in progress
is left alone. A snapshot whose manifest is unreadable is *not* debris: it is
reported by ``verify``/``ls`` and kept for a person to look at.
"""

from __future__ import annotations

import dataclasses
import time

from rl_ckpt._run.catalog import lost_manifest
from rl_ckpt._run.layout import (
    MANIFEST_NAME,
    OBJECTS,
    STAGING,
    TRASH,
    is_snapshot_name,
    manifest_path,
    snapshot_folders,
)
from rl_ckpt.errors import CheckpointError
from rl_ckpt._run.dedup import manifest_objects
from rl_ckpt._run.snapshot_files import read_manifest
from rl_ckpt._storage import Storage, join

DEFAULT_GRACE_SECONDS = 3600.0


@dataclasses.dataclass
class Debris:
    path: str
    reason: str
    is_dir: bool


def _newest_mtime(storage: Storage, path: str, depth: int = 3) -> float | None:
    """Newest mtime under ``path`` (object stores have no folder mtimes)."""
    newest = None
    for entry in storage.list(path):
        m = entry.mtime
        if entry.is_dir and depth > 0:
            inner = _newest_mtime(storage, join(path, entry.name), depth - 1)
            m = max(filter(None, [m, inner]), default=None)
        if m is not None and (newest is None or m > newest):
            newest = m
    return newest


def find_debris(
    storage: Storage, grace_seconds: float = DEFAULT_GRACE_SECONDS, now: float | None = None
) -> list[Debris]:
    now = time.time() if now is None else now

    def old(path: str, entry_mtime: float | None, is_dir: bool) -> bool:
        m = _newest_mtime(storage, path) if is_dir else entry_mtime
        if is_dir and entry_mtime is not None:
            m = max(filter(None, [m, entry_mtime]), default=None)
        return m is None or now - m >= grace_seconds

    found: list[Debris] = []
    for entry in storage.list(""):
        name = entry.name
        if name == STAGING and entry.is_dir:
            for staged in storage.list(STAGING):
                path = join(STAGING, staged.name)
                if old(path, staged.mtime, staged.is_dir):
                    found.append(Debris(path, "staged save that never committed", staged.is_dir))
            continue
        if name == TRASH and entry.is_dir:
            found += [
                Debris(join(TRASH, t.name), "retired snapshot whose deletion was interrupted", t.is_dir)
                for t in storage.list(TRASH)
            ]
            continue
        if name.startswith(".tmp-") and not entry.is_dir:
            if old(name, entry.mtime, False):
                found.append(Debris(name, "temp file of an interrupted write", False))
            continue
        if not entry.is_dir or not is_snapshot_name(name):
            continue
        if not storage.exists(manifest_path(name)):
            if lost_manifest(storage, name):
                continue  # a committed snapshot that lost its manifest: reported by verify, kept for a person
            if old(name, entry.mtime, True):
                found.append(Debris(name, "snapshot folder without a manifest (save never committed)", True))
            continue
        try:
            manifest = read_manifest(storage, name)
        except CheckpointError:
            continue  # unreadable committed snapshot: reported by verify, never deleted here
        listed = {f.path.split("/", 1)[0] for f in manifest.files} | {MANIFEST_NAME}
        for inner in storage.list(name):
            if inner.name not in listed:
                path = join(name, inner.name)
                if old(path, inner.mtime, inner.is_dir):
                    found.append(
                        Debris(path, "not listed in the snapshot's manifest (losing or crashed writer)", inner.is_dir)
                    )
    return found


def remove_debris(storage: Storage, debris: list[Debris]) -> int:
    """Delete ``debris``; returns how many entries were removed."""
    for d in debris:
        if d.is_dir:
            storage.remove_tree(d.path)
        else:
            storage.remove(d.path)
    return len(debris)


def find_unreferenced_objects(
    storage: Storage, grace_seconds: float = DEFAULT_GRACE_SECONDS, now: float | None = None
) -> tuple[list[Debris], str | None]:
    """Mark-and-sweep for dedup objects: those no committed manifest references.

    Returns ``(debris, refusal)``. When any snapshot's manifest cannot be read,
    its references are unknown, so nothing is swept and ``refusal`` says why.
    """
    now = time.time() if now is None else now
    if not storage.exists(OBJECTS):
        return [], None
    live: set[str] = set()
    for entry in snapshot_folders(storage):
        if not storage.exists(manifest_path(entry.name)):
            if lost_manifest(storage, entry.name):
                return [], f"{entry.name} has lost its manifest: its objects cannot be told apart, nothing swept"
            continue
        try:
            live.update(manifest_objects(read_manifest(storage, entry.name)))
        except CheckpointError as exc:
            return [], f"{entry.name} is unreadable ({exc}); its objects may be live, nothing swept"
    found = []
    for algo in storage.list(OBJECTS):
        for prefix in storage.list(join(OBJECTS, algo.name)):
            for obj in storage.list(join(OBJECTS, algo.name, prefix.name)):
                path = join(OBJECTS, algo.name, prefix.name, obj.name)
                if obj.name.startswith(".tmp-"):
                    if obj.mtime is None or now - obj.mtime >= grace_seconds:
                        found.append(Debris(path, "temp file of an interrupted object write", False))
                    continue
                if obj.name not in live and (obj.mtime is None or now - obj.mtime >= grace_seconds):
                    found.append(Debris(path, "dedup object no committed snapshot references", False))
    return found, None
