"""The snapshot catalog: what is committed in a run folder, kept in memory.

Built once from storage (one listing plus one manifest read per snapshot) and
then updated in place on every commit and deletion, so listing, planning and
retention never rescan storage. ``refresh()`` rebuilds it from storage, the
single source of truth.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
from typing import Iterable

from rl_ckpt._run.layout import RESERVED, manifest_path, snapshot_folders
from rl_ckpt._run.quarantine import quarantined
from rl_ckpt.errors import CheckpointError
from rl_ckpt._format.manifest import Manifest, parse_snapshot_id
from rl_ckpt._format.metrics import decode_metrics
from rl_ckpt._run.snapshot_files import read_manifest
from rl_ckpt._storage import Storage

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
    # Housekeeping after this process committed it (alias, retention) that failed; the snapshot is committed.
    warnings: list[str] = dataclasses.field(default_factory=list, repr=False, compare=False)

    @classmethod
    def from_manifest(cls, m: Manifest) -> "SnapshotInfo":
        parsed = parse_snapshot_id(m.snapshot_id)
        return cls(
            m.snapshot_id,
            m.global_step,
            m.kind,
            m.created_at,
            decode_metrics(m.metrics),
            m.size_bytes,
            dict(m.tags),
            m.base_snapshot_id,
            parsed[1] if parsed else 0,
            m,
        )

    def sort_key(self) -> tuple:
        return (self.global_step, self.kind == "light", self.branch, self.created_at)


@dataclasses.dataclass
class Unreadable:
    """A snapshot folder whose manifest exists but cannot be trusted."""

    snapshot_id: str
    reason: str


LOST_MANIFEST = (
    "meta.json missing: data files are present but no manifest vouches for them "
    "(deleted after commit?); not used, not deleted by gc"
)
LINKED_FOLDER = (
    "a symbolic link, not a folder of the run: a snapshot's files must be regular files inside the "
    "run; not used (remove the link, or copy the snapshot in)"
)


def lost_manifest(storage: Storage, snapshot_id: str) -> bool:
    """A folder with data files at its top level but no manifest.

    Manifest-last saves keep their data in an attempt subfolder until the
    manifest lands, and staged saves appear only with their manifest, so top
    level files without a manifest mean a committed snapshot lost it.
    """
    return any(not e.is_dir and not e.name.startswith(".tmp-") for e in storage.list(snapshot_id))


def foreign_names(storage: Storage) -> list[str]:
    """Top-level folders named like snapshots but not in the canonical form ``snapshot_id()`` writes
    (other digits, padding, ``.b0``, a trailing newline...). They are no snapshots: never listed, restored
    or deleted by gc; ``rl-ckpt ls --deep`` shows them so a person can look."""
    import unicodedata

    out = []
    for entry in storage.list(""):
        if parse_snapshot_id(entry.name) is not None or entry.name in RESERVED:
            continue
        if unicodedata.normalize("NFKC", entry.name).strip().lower().startswith("step"):
            out.append(entry.name)
    return sorted(out)


class Catalog:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._lock = threading.RLock()
        self._infos: dict[str, SnapshotInfo] | None = None
        self._unreadable: dict[str, Unreadable] = {}
        self._versions: dict[str, str | None] = {}  # snapshot id -> Storage.stat version of its manifest when read
        self.version = 0  # bumped by every change other than an add (caches of derived facts key on it)
        self.manifest_reads = 0  # manifests parsed by refresh() (the rest came from the cache)
        self._sorted: list[SnapshotInfo] | None = None  # the infos in sort_key order, kept across adds

    def refresh(self) -> None:
        """Re-list storage. Manifests unchanged since the last look (same ``Storage.stat`` version) are not
        re-read, so a refresh costs one listing plus one stat per snapshot. A recovery plan refreshes first and
        then uses the manifests held here (each parsed once per restore); verification reads its own afresh."""
        with self._lock:
            known, known_versions = dict(self._infos or {}), dict(self._versions)
        infos, bad, versions, links = {}, {}, {}, []
        folders = list(snapshot_folders(self.storage, links))
        try:  # one request for every manifest where the storage can (the memory tier)
            stats = self.storage.stat_many([manifest_path(e.name) for e in folders])
        except CheckpointError:  # one cannot be stat'ed (e.g. a planted link): one by one below, to name it
            stats = None
        for i, entry in enumerate(folders):
            try:
                meta = stats[i] if stats is not None else self.storage.stat(manifest_path(entry.name))
            except CheckpointError as exc:  # e.g. a planted link in place of the manifest
                bad[entry.name] = Unreadable(entry.name, str(exc))
                log.warning("snapshot %s is unreadable and will be skipped: %s", entry.name, exc)
                continue
            if meta is None:
                if lost_manifest(self.storage, entry.name):
                    bad[entry.name] = Unreadable(entry.name, LOST_MANIFEST)
                    log.warning("snapshot %s: %s", entry.name, LOST_MANIFEST)
                continue  # otherwise never committed: debris of a crashed save, for gc
            cached = known.get(entry.name)
            if cached is not None and meta.version is not None and known_versions.get(entry.name) == meta.version:
                infos[entry.name], versions[entry.name] = cached, meta.version
                continue
            try:
                infos[entry.name] = SnapshotInfo.from_manifest(read_manifest(self.storage, entry.name, size=meta.size))
                versions[entry.name] = meta.version
                self.manifest_reads += 1
            except CheckpointError as exc:
                bad[entry.name] = Unreadable(entry.name, str(exc))
                log.warning("snapshot %s is unreadable and will be skipped: %s", entry.name, exc)
        for name in links:
            bad[name] = Unreadable(name, LINKED_FOLDER)
            log.warning("snapshot %s: %s", name, LINKED_FOLDER)
        fenced = quarantined(self.storage)
        was = {sid: info.quarantined for sid, info in known.items()}
        for sid, info in infos.items():
            info.quarantined = fenced.get(sid)
        only_added = (
            all(infos.get(sid) is info for sid, info in known.items())
            and all(infos[sid].quarantined == q for sid, q in was.items())
            and not bad
        )
        with self._lock:
            self._infos, self._unreadable, self._versions = infos, bad, versions
            self._sorted = None
            if not only_added:
                self.version += 1

    def _ensure(self) -> dict[str, SnapshotInfo]:
        if self._infos is None:
            self.refresh()
        return self._infos  # type: ignore[return-value]

    def snapshots(self, kind: str | None = None, *, usable: bool = False) -> list[SnapshotInfo]:
        """Committed, readable snapshots, oldest first; ``usable`` leaves out quarantined ones."""
        with self._lock:
            if self._sorted is None:
                self._sorted = sorted(self._ensure().values(), key=SnapshotInfo.sort_key)
            infos = list(self._sorted)
        if kind:
            infos = [i for i in infos if i.kind == kind]
        if usable:
            infos = [i for i in infos if not i.quarantined]
        return infos

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

    def known(self, snapshot_id: str) -> SnapshotInfo | None:
        """``snapshot_id``'s entry if the catalog was built already (None otherwise: nothing is listed or read)."""
        with self._lock:
            return None if self._infos is None else self._infos.get(snapshot_id)

    def add(self, info: SnapshotInfo) -> None:
        """Record a snapshot this process just committed (its manifest is stat-ed, not re-read)."""
        try:
            meta = self.storage.stat(manifest_path(info.snapshot_id))
        except CheckpointError:
            meta = None
        with self._lock:
            infos = self._ensure()
            old = infos.get(info.snapshot_id)
            infos[info.snapshot_id] = info
            if self._sorted is not None:
                if old is not None:
                    self._sorted.remove(old)
                bisect.insort(self._sorted, info, key=SnapshotInfo.sort_key)  # usually the newest: O(1) moves
            self._versions[info.snapshot_id] = meta.version if meta is not None else None

    def discard(self, snapshot_ids: Iterable[str]) -> None:
        with self._lock:
            infos = self._ensure()
            for sid in snapshot_ids:
                infos.pop(sid, None)
                self._unreadable.pop(sid, None)
                self._versions.pop(sid, None)
            self._sorted = None
            self.version += 1
