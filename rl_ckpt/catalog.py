"""The snapshot catalog: what is committed in a run folder, kept in memory.

Built once from storage (one listing plus one manifest read per snapshot) and
then updated in place on every commit and deletion, so listing, planning and
retention never rescan storage. ``refresh()`` rebuilds it from storage, the
single source of truth.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Iterable

from .commit import STAGING, TRASH
from .errors import CheckpointError
from .manifest import Manifest, parse_snapshot_id
from .reader import read_manifest
from .storage import Storage

log = logging.getLogger("rl_ckpt")


@dataclasses.dataclass
class SnapshotInfo:
    """A committed snapshot as listed by the catalog."""

    snapshot_id: str
    global_step: int
    kind: str
    created_at: str
    metrics: dict
    size_bytes: int
    tags: dict = dataclasses.field(default_factory=dict)
    base_snapshot_id: str | None = None
    branch: int = 0
    manifest: Manifest | None = dataclasses.field(default=None, repr=False, compare=False)
    quarantined: str | None = None  # why, when a check found it bad after commit

    @classmethod
    def from_manifest(cls, m: Manifest) -> "SnapshotInfo":
        parsed = parse_snapshot_id(m.snapshot_id)
        return cls(m.snapshot_id, m.global_step, m.kind, m.created_at, decode_metrics(m.metrics), m.size_bytes,
                   dict(m.tags), m.base_snapshot_id, parsed[1] if parsed else 0, m)

    def sort_key(self) -> tuple:
        return (self.global_step, self.kind == "light", self.branch, self.created_at)


def decode_metrics(metrics: dict) -> dict:
    """Manifest metrics back to numbers: non-finite floats are stored as 'nan', 'inf', '-inf'."""
    return {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in metrics.items()}


@dataclasses.dataclass
class Unreadable:
    """A snapshot folder whose manifest exists but cannot be trusted."""

    snapshot_id: str
    reason: str


LOST_MANIFEST = ("meta.json missing: data files are present but no manifest vouches for them "
                 "(deleted after commit?); not used, not deleted by gc")


def lost_manifest(storage: Storage, snapshot_id: str) -> bool:
    """A folder with data files at its top level but no manifest.

    Manifest-last saves keep their data in an attempt subfolder until the
    manifest lands, and staged saves appear only with their manifest, so top
    level files without a manifest mean a committed snapshot lost it.
    """
    return any(not e.is_dir and not e.name.startswith(".tmp-") for e in storage.list(snapshot_id))


class Catalog:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._lock = threading.RLock()
        self._infos: dict[str, SnapshotInfo] | None = None
        self._unreadable: dict[str, Unreadable] = {}
        self.version = 0  # bumped by every change other than an add (caches of derived facts key on it)

    def refresh(self) -> None:
        infos, bad = {}, {}
        for entry in self.storage.list(""):
            if not entry.is_dir or entry.name in (STAGING, TRASH) or parse_snapshot_id(entry.name) is None:
                continue
            if not self.storage.exists(f"{entry.name}/meta.json"):
                if lost_manifest(self.storage, entry.name):
                    bad[entry.name] = Unreadable(entry.name, LOST_MANIFEST)
                    log.warning("snapshot %s: %s", entry.name, LOST_MANIFEST)
                continue  # otherwise never committed: debris of a crashed save, for gc
            try:
                infos[entry.name] = SnapshotInfo.from_manifest(read_manifest(self.storage, entry.name))
            except CheckpointError as exc:
                bad[entry.name] = Unreadable(entry.name, str(exc))
                log.warning("snapshot %s is unreadable and will be skipped: %s", entry.name, exc)
        from .quarantine import quarantined

        fenced = quarantined(self.storage)
        for sid, why in fenced.items():
            if sid in infos:
                infos[sid].quarantined = why
        with self._lock:
            self._infos, self._unreadable = infos, bad
            self.version += 1

    def _ensure(self) -> dict[str, SnapshotInfo]:
        if self._infos is None:
            self.refresh()
        return self._infos  # type: ignore[return-value]

    def snapshots(self, kind: str | None = None, *, usable: bool = False) -> list[SnapshotInfo]:
        """Committed, readable snapshots, oldest first; ``usable`` leaves out quarantined ones."""
        with self._lock:
            infos = list(self._ensure().values())
        if kind:
            infos = [i for i in infos if i.kind == kind]
        if usable:
            infos = [i for i in infos if not i.quarantined]
        return sorted(infos, key=SnapshotInfo.sort_key)

    def mark_quarantined(self, snapshot_id: str, reason: str) -> None:
        with self._lock:
            info = self._ensure().get(snapshot_id)
            if info is not None:
                info.quarantined = reason
            self.version += 1

    def unreadable(self) -> list[Unreadable]:
        self._ensure()
        return sorted(self._unreadable.values(), key=lambda u: u.snapshot_id)

    def get(self, snapshot_id: str) -> SnapshotInfo | None:
        with self._lock:
            return self._ensure().get(snapshot_id)

    def add(self, info: SnapshotInfo) -> None:
        with self._lock:
            self._ensure()[info.snapshot_id] = info

    def discard(self, snapshot_ids: Iterable[str]) -> None:
        with self._lock:
            infos = self._ensure()
            for sid in snapshot_ids:
                infos.pop(sid, None)
                self._unreadable.pop(sid, None)
            self.version += 1
