"""``MemoryStore``: a detached Ray actor per (run, node) that holds snapshot files in its own heap.

Why an actor of its own: a trainer process that dies (OOM, a crashed env, a
collective error) takes its heap and every Ray object it owns with it. The
store copies each file it receives into memory it owns, so the bytes outlive
the writer as long as the node lives: a small file into its heap, a larger one
(from ``PLASMA_MIN_BYTES``) into an object of the node's shared-memory object
store that the store itself ``ray.put`` (so the store is its owner). A reader
on the node gets that object's ``ObjectRef`` (inside a list, so Ray does not
resolve it in the reply) and maps the bytes read-only, without a copy. It is pinned to its node
(``NodeAffinitySchedulingStrategy(soft=False)``) and never restarted
(``max_restarts=0``): a restarted store would be empty, and an empty store that
answers is worse than a dead one, which every reader sees as gone.

Files are keyed by run-relative paths, as on any ``Storage``; folders are
implied. A put is create-only when asked (manifests), so exactly one writer
commits a snapshot in a store. ``replicate_to`` on a put queues the file for a
store-to-store copy to peers on other nodes, done by a thread of this actor:
the writer never waits for replication. A snapshot's manifest follows its data
to every peer that received the data.

Budget: with ``budget_bytes`` set, a put that would exceed it first evicts
whole snapshots, oldest step first: aborted leftovers older than the newest
committed snapshot, then committed ones, never the newest committed one (nor
anything newer, which may be a save in progress). When that is not enough the
put is refused with :class:`MemoryBudgetError` and nothing already held is lost.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import threading
from typing import Any, Iterable

from rl_ckpt.errors import CommitConflictError, MemoryBudgetError, StorageError
from rl_ckpt._format.manifest import MANIFEST_NAME, parse_snapshot_id

from .borrow import StoreBorrowing
from .landing import StoreLanding
from .pins import PinsAndFetch
from .reads import StoreReads, answer_of, resolved, snapshot_of
from .replication import StoreReplication

log = logging.getLogger("rl_ckpt")

STORE_PREFIX = "rl_ckpt-mem"
PLASMA_MIN_BYTES = 256 << 10  # files from this size are held in the object store, owned by the store actor


CONCURRENCY_GROUPS = {"placing": 16, "committing": 8}  # besides the default group (``max_concurrency``: 16)
CONCURRENCY_OF = {"borrow": "placing", "borrow_many": "placing", "commit_after": "committing"}


def store_name(key: str, node_id: str) -> str:
    """The Ray actor name of the store of run ``key`` on node ``node_id``."""
    return f"{STORE_PREFIX}:{key}:{node_id}"


def _owned(data: Any) -> tuple[Any, int]:
    """A copy of ``data`` (bytes-like, or a list of bytes-like pieces) that this process owns, and its size:
    ``bytes`` below ``PLASMA_MIN_BYTES``, else the ``ObjectRef`` of an object this actor put.

    What Ray hands an actor may be a view of the shared object store that the
    sender owns: keeping that view would lose the bytes with the sender."""
    import numpy as np

    pieces = data if isinstance(data, (list, tuple)) else [data]
    views = [memoryview(p).cast("B") for p in pieces]
    views = [v for v in views if v.nbytes]
    size = sum(v.nbytes for v in views)
    if size < PLASMA_MIN_BYTES:
        return b"".join(views), size
    import ray

    if len(views) == 1:
        array = np.frombuffer(views[0], dtype=np.uint8)
    else:  # several pieces: one contiguous array first (a reader maps one buffer)
        array = np.empty(size, dtype=np.uint8)
        pos = 0
        for v in views:
            array[pos : pos + v.nbytes] = np.frombuffer(v, dtype=np.uint8)
            pos += v.nbytes
    try:
        return ray.put(array), size
    except ray.exceptions.ObjectStoreFullError as exc:
        raise StorageError(
            f"the node's Ray object store cannot hold {size} more bytes ({exc}); give Ray a "
            "larger object_store_memory or lower memory_budget_bytes",
            path="",
        ) from None


class MemoryStore(StoreBorrowing, StoreLanding, PinsAndFetch, StoreReads, StoreReplication):
    """The store's implementation (plain class: the actor is ``ray.remote(MemoryStore)``, see :func:`store_actor`)."""

    def __init__(self, key: str, node_id: str, budget_bytes: int | None = None) -> None:
        self.key = key
        self.node_id = node_id
        self.budget_bytes = budget_bytes
        self._files: dict[str, Any] = {}  # path -> bytes (small) or the ObjectRef of an object this actor put
        self._sizes: dict[str, int] = {}
        self._versions: dict[str, int] = {}
        # Versions count up from a random start: a store restarted on the node (its files gone) never hands out a
        # version an earlier incarnation gave, so a version seen once names those bytes (``versions_name_content``).
        self._counter = secrets.randbits(60)
        self._held = 0
        self._lock = threading.RLock()
        self._queue: collections.deque = collections.deque()  # (path, [peer handles], queued at)
        self._queued = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._busy = 0
        self.evicted: list[str] = []
        self.replicated_bytes = 0
        self.replication_errors: list[str] = []
        self._pins: dict[tuple[str, str], tuple[float, frozenset]] = {}  # (snapshot, holder) -> (until, paths)
        self._fetching: set[str] = set()
        self._fetched = threading.Condition(self._lock)
        self.fetched_bytes = 0
        self.copied_bytes = 0  # bytes this store copied into objects it owns (puts, replicas, fetches, owning)
        self._init_landing()
        self._init_borrowing()
        self._thread = threading.Thread(target=self._replicate_loop, name="rl_ckpt-mem-replicate", daemon=True)
        self._thread.start()

    # -- writes -----------------------------------------------------------------
    def put(self, path: str, data: Any, create_only: bool = False, replicate_to: Iterable = ()) -> int:
        """Hold a copy of ``data`` at ``path``; returns its size. ``create_only``: ``CommitConflictError`` if
        ``path`` is held already. ``replicate_to``: peer store handles to copy it to (in the background)."""
        owned, size = self.take(data)
        with self._lock:
            if create_only and path in self._files:
                raise CommitConflictError(
                    f"{path} already exists in the memory store on node {self.node_id[:12]}: "
                    "another writer committed it first",
                    path=path,
                    snapshot_id=path,
                )
            self._store(path, owned, size)
            peers = list(replicate_to)
            if peers:
                self._enqueue(path, peers)
        return size

    def take(self, data: Any) -> tuple[Any, int]:
        """A copy of ``data`` this store owns, and its size (bytes, or the ref of an object it put)."""
        owned, size = _owned(data)
        if not isinstance(owned, bytes):
            with self._lock:
                self.copied_bytes += size
        return owned, size

    def put_replica(self, path: str, data: Any, source_node: str) -> bool:
        """A peer's copy of ``path``: kept unless this store holds it already (replicas are idempotent)."""
        with self._lock:
            if path in self._files:
                return False
        stored = False
        try:
            owned, size = self.take(data)
            with self._lock:
                if path in self._files:
                    return False
                self._store(path, owned, size)
                stored = True
                return True
        finally:
            if not stored:  # (taking it failed, or another copy came first) whoever waits for it stops waiting
                self._not_landing([path])

    def _store(self, path: str, owned: Any, size: int) -> None:
        old = self._sizes.get(path, 0)
        self._make_room(path, size - old)
        self._files[path] = owned
        self._borrowed.pop(path, None)  # replaced: what was borrowed there is not owned any more
        self._vouched.pop(path, None)  # (nor vouched for: another object than the one read back)
        self._sizes[path] = size
        self._held += size - old
        self._counter += 1
        self._versions[path] = self._counter
        self._landed_here(path)

    def _make_room(self, path: str, extra: int) -> None:
        if self.budget_bytes is None or self._held + extra <= self.budget_bytes:
            return
        order = self._eviction_order(protect=snapshot_of(path))
        freeable = sum(n for p, n in self._sizes.items() if snapshot_of(p) in order)
        if self._held + extra - freeable > self.budget_bytes:
            order = []  # evicting everything allowed would not be enough: refuse, and keep what is held
        for sid in order:
            self._drop_snapshot(sid)
            self.evicted.append(sid)
            log.info("memory store %s: evicted %s to stay within %d bytes", self.node_id[:12], sid, self.budget_bytes)
            if self._held + extra <= self.budget_bytes:
                return
        raise MemoryBudgetError(
            f"memory store on node {self.node_id[:12]} cannot hold {path} ({extra} bytes more): it holds "
            f"{self._held} bytes of a {self.budget_bytes}-byte budget and nothing more may be evicted (the newest "
            "committed snapshot and saves in progress are kept). Raise memory_budget_bytes or lower the snapshot "
            "size; nothing already held was lost",
            path=path,
            size=extra,
            budget=self.budget_bytes,
            node=self.node_id,
        )

    def _eviction_order(self, protect: str | None) -> list[str]:
        """Snapshots that may go, first to last: leftovers older than the newest committed one, then committed
        ones oldest first; never the newest committed one, anything newer, nor ``protect`` (being written)."""
        folders = {}
        for p in self._files:
            sid = snapshot_of(p)
            if sid is not None:
                folders.setdefault(sid, False)
                if p == f"{sid}/{MANIFEST_NAME}":
                    folders[sid] = True
        committed = sorted((s for s, done in folders.items() if done), key=parse_snapshot_id)
        if not committed:
            return []
        newest = parse_snapshot_id(committed[-1])
        pinned = self._pinned_snapshots()
        older = [s for s in folders if parse_snapshot_id(s) < newest and s != protect and s not in pinned]
        leftovers = sorted((s for s in older if not folders[s]), key=parse_snapshot_id)
        return leftovers + sorted((s for s in older if folders[s]), key=parse_snapshot_id)

    def _drop_snapshot(self, sid: str) -> None:
        # The manifest goes first, as on disk: a reader never sees a committed snapshot with files missing.
        self._drop(f"{sid}/{MANIFEST_NAME}")
        self.remove_prefix(sid)

    def _drop(self, path: str) -> None:
        if self._files.pop(path, None) is not None:
            self._borrowed.pop(path, None)
            self._vouched.pop(path, None)
            self._held -= self._sizes.pop(path)
            self._versions.pop(path, None)

    def remove(self, path: str) -> None:
        """Forget one file (missing is fine; a pinned one is kept until its pin ends)."""
        self.remove_many([path])

    def remove_many(self, paths: list[str]) -> int:
        """:meth:`remove` of each of ``paths`` in one call (a sweep of many objects pays one round trip and one look
        at the pins, not one each); returns how many were held and are now forgotten."""
        with self._lock:
            pinned = self._pinned_paths()
            gone = [p for p in paths if p in self._files and p not in pinned]
            for p in gone:
                self._drop(p)
            return len(gone)

    def remove_prefix(self, prefix: str) -> int:
        """Forget every file under the folder ``prefix`` ("" : everything) but pinned ones; returns how many."""
        with self._lock:
            pinned = self._pinned_paths()
            if prefix and f"{prefix}/{MANIFEST_NAME}" in self._files and f"{prefix}/{MANIFEST_NAME}" not in pinned:
                self._drop(f"{prefix}/{MANIFEST_NAME}")
            gone = [
                p for p in self._files if (not prefix or p == prefix or p.startswith(prefix + "/")) and p not in pinned
            ]
            for p in gone:
                self._drop(p)
            return len(gone)

    # -- reads ------------------------------------------------------------------
    def get(self, path: str, max_bytes: int | None = None):
        """``path``'s bytes: ``bytes`` for a small file, else ``[ObjectRef]`` of the object this store owns, or
        ``[ObjectRef, index]`` of a borrowed batch object whose item ``index`` it is (``answer_of``; in a list, so
        the reply does not copy it: ``ray.get`` of the ref maps it read-only on this node); None if absent.
        Larger than ``max_bytes``: its size (an int), so the caller refuses it without the bytes moving."""
        with self._lock:
            data, size = self._files.get(path), self._sizes.get(path)
        if data is None:
            return None
        if max_bytes is not None and size > max_bytes:
            return size
        return answer_of(data)

    def get_range(self, path: str, start: int, length: int):
        """``length`` bytes of ``path`` from ``start`` (None: absent; an int: the file's size, when too short)."""
        with self._lock:
            data, size = self._files.get(path), self._sizes.get(path)
        if data is None:
            return None
        if start + length > size:
            return size
        return bytes(memoryview(resolved(data)).cast("B")[start : start + length])

    def stat(self, path: str) -> tuple[int, int] | None:
        """(size, version) of ``path``; the version changes whenever the file is replaced."""
        with self._lock:
            size = self._sizes.get(path)
            return None if size is None else (size, self._versions[path])

    def inventory(self, prefix: str = "") -> dict[str, int]:
        """Every held path under ``prefix`` -> its size."""
        with self._lock:
            return {
                p: n
                for p, n in self._sizes.items()
                if not prefix or p == prefix or p.startswith(prefix.rstrip("/") + "/")
            }

    def bytes_held(self) -> int:
        with self._lock:
            return self._held

    def info(self) -> dict:
        """What the store holds and how replication is doing (for /healthz and metrics)."""
        with self._lock:
            snaps = sorted({s for s in map(snapshot_of, self._files) if s is not None}, key=parse_snapshot_id)
            committed = [s for s in snaps if f"{s}/{MANIFEST_NAME}" in self._files]
            return {
                "node_id": self.node_id,
                "key": self.key,
                "pid": os.getpid(),
                "bytes_held": self._held,
                "budget_bytes": self.budget_bytes,
                "files": len(self._files),
                "snapshots": committed,
                "replication_queue": len(self._queue) + self._busy,
                "replication_lag_s": self.replication_lag(),
                "replicated_bytes": self.replicated_bytes,
                "fetched_bytes": self.fetched_bytes,
                "copied_bytes": self.copied_bytes,
                "borrowed_bytes": sum(self._sizes[p] for p in self._borrowed),
                "borrowed_files": len(self._borrowed),
                "owned_bytes": self.owned_bytes,
                "lost": list(self.lost[-20:]),
                "lost_versions": list(self.lost_versions[-20:]),
                "expected_files": len(self._awaited(list(self._expected))),
                "refused_commits": list(self.refused_commits[-5:]),
                "replication_errors": list(self.replication_errors[-5:]),
                "evicted": list(self.evicted[-20:]),
            }

    def ping(self) -> str:
        return self.node_id


def store_actor(key: str, node_id: str, budget_bytes: int | None, namespace: str):
    """The store of run ``key`` on node ``node_id``: created there (detached, never restarted) or attached to."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # A publisher's placement transfers (``borrow_many`` of another node's objects: each holds a thread until they land)
    # and the commits waiting for them have threads of their own: the announcements, listings, pins and reads
    # of the pulls that overlap them are never queued behind them.
    for method, group in CONCURRENCY_OF.items():
        ray.method(concurrency_group=group)(getattr(MemoryStore, method))
    cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(MemoryStore)
    return cls.options(
        name=store_name(key, node_id),
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=0,
        max_task_retries=0,
        num_cpus=0,
        max_concurrency=16,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(key, node_id, budget_bytes)
