"""``raymem://<key>``: a :class:`Storage` over the run's :class:`MemoryStore` actors, one per node.

A memory snapshot is an ordinary snapshot on this storage: the engine writes
it with the same manifest, per-file (per-block when sharded) checksums,
verify-after-write and create-only manifest commit as on disk, and reads it
back verified. What differs is where bytes live:

- a write goes to the store on the writer's node (created there on first use)
  and is queued there for a copy to ``replicas`` stores on other nodes (peers
  in node-id ring order), so the writer never waits for replication;
- reads, listings and stats see the union of every live store: a file counts
  as long as one store holding it lives; the local store is read first;
- a manifest is written create-only in the local store (no live store may
  hold it already), then copied to every store that holds files of its
  snapshot, so each store knows which of its snapshots are committed (its
  budget never evicts the newest committed one);
- removals reach every store.

Options (``storage_options``): ``namespace`` (Ray namespace of the stores,
default ``rl_ckpt``), ``replicas`` (peer copies per file, default 1; 0: none),
``budget_bytes`` (per-store memory budget, applied when a store is created),
``node_id`` (the node whose store takes writes, default this process's node).
"""

from __future__ import annotations

import io
import re
from typing import Any, BinaryIO, Callable, Iterable

from rl_ckpt.errors import CommitConflictError, ConfigError, StorageError
from rl_ckpt._format.manifest import MANIFEST_NAME
from rl_ckpt._storage.base import (
    Entry,
    Storage,
    check_max_bytes,
    check_pieces,
    check_range,
    check_relpath,
    range_past_end,
    too_large,
)
from rl_ckpt._storage.registry import register_storage

from .directory import StoreDirectory
from .reads import picked
from .directory import need_ray as _ray
from .view import COPY_STEP, ReadSessions, ViewReader, copy_into, copy_out, hash_in_place

PROTOCOL = "raymem"
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,200}$")
_INLINE_BYTES = 256 << 10  # smaller files travel inside the call; larger ones through the object store
_OPTIONS = ("namespace", "replicas", "budget_bytes", "node_id")


def parse_url(url: str, storage_options: dict | None) -> tuple[str, dict]:
    """The store key of a ``raymem://`` URL and its checked options (ConfigError naming the bad one)."""
    if not url.startswith(f"{PROTOCOL}://"):
        raise ConfigError(f"not a {PROTOCOL}:// URL: {url!r}", key="base_dir")
    key = url[len(PROTOCOL) + 3 :].strip("/")
    if not _KEY.match(key) or ".." in key.split("/"):
        raise ConfigError(
            f"{url!r}: the part after {PROTOCOL}:// must be a plain name like mem/run",
            key="base_dir",
            allowed=_KEY.pattern,
        )
    opts = dict(storage_options or {})
    unknown = sorted(set(opts) - set(_OPTIONS))
    if unknown:
        raise ConfigError(
            f"{PROTOCOL}:// storage option {unknown[0]!r} is unknown; allowed: {', '.join(_OPTIONS)}",
            key=unknown[0],
            allowed=list(_OPTIONS),
        )
    replicas = opts.get("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ConfigError(
            f"{PROTOCOL}:// option 'replicas': got {replicas!r}; allowed: an integer >= 0",
            key="replicas",
            allowed="int >= 0",
        )
    budget = opts.get("budget_bytes")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ConfigError(
            f"{PROTOCOL}:// option 'budget_bytes': got {budget!r}; allowed: an integer >= 1 or null",
            key="budget_bytes",
            allowed="int >= 1 | None",
        )
    return key, {**opts, "replicas": replicas, "budget_bytes": budget}


def first_answer(storage: "RayMemoryStorage", call: Callable[[Any], Any]) -> Any:
    """``call(store)`` on the stores of ``storage`` that may hold a file until one answers something other than
    None (None: none did). The stores already known are asked first, so a read costs one call to one store, not
    a listing of the cluster's named actors; only when none of them holds the file is the cluster listed again
    (a store started since, e.g. on a new node) and the others asked. A dead store is skipped."""
    ray = _ray()
    answered: set[str] = set()
    for fresh in (False, True):
        for node, handle in storage.holders(fresh):
            if node in answered:
                continue
            storage.calls["store_calls"] += 1
            try:
                got = call(handle)
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
                storage.forget(node)  # died (with its objects): another store may hold a copy
                continue
            answered.add(node)
            if got is not None:
                return got
    return None


def stat_paths(storage: "RayMemoryStorage", paths) -> list[Entry | None]:
    """``stat`` of each path with one call to the local store, then (for those it lacks) one per other store."""
    ray = _ray()
    paths = [check_relpath(p) for p in paths]
    out: list[Entry | None] = [None] * len(paths)
    asked: set[str] = set()
    for fresh in (False, True):  # as first_answer: the known stores, then the cluster listed again
        if all(e is not None for e in out):
            break
        for node, handle in storage.holders(fresh):
            todo = [i for i, e in enumerate(out) if e is None]
            if not todo:
                return out
            if node in asked:
                continue
            storage.calls["store_calls"] += 1
            try:
                got = ray.get(handle.stat_many.remote([paths[i] for i in todo]))
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
                storage.forget(node)
                continue
            asked.add(node)
            for i, st in zip(todo, got):
                if st is not None:
                    out[i] = Entry(paths[i].rsplit("/", 1)[-1], False, st[1], version=f"{st[0][:12]}:{st[2]}")
    return out


def local_views(
    storage: "RayMemoryStorage", paths: list[str], vouched: set[str] | None = None
) -> dict[str, memoryview]:
    """Read-only views of those of ``paths`` this node's store holds, in one call to it and one ``ray.get`` (the
    rest are left out: read one by one later, from another store). Nothing is verified here: the caller hashes
    each view before using it, but for those added to ``vouched`` (when given): files the publisher on this node
    read back whole as the very object the store still holds (``MemoryStore.get_many_vouched``), whose views map
    those same bytes. An object lost (e.g. a chunk still borrowed from a publisher that died) is
    left out."""
    ray = _ray()
    if not paths:
        return {}
    storage.calls["store_calls"] += 1
    store = storage.store_of(storage.node_id)
    try:
        if vouched is None:
            answers = ray.get(store.get_many.remote(list(paths)))
        else:
            answers, good = ray.get(store.get_many_vouched.remote(list(paths)))
    except ray.exceptions.RayActorError:
        storage.forget(storage.node_id)
        return {}
    refs = [(p, a) for p, a in zip(paths, answers) if isinstance(a, list)]
    out = {p: memoryview(a).toreadonly() for p, a in zip(paths, answers) if isinstance(a, bytes)}
    unique = list({a[0]: None for _p, a in refs})  # a batch object once for all its files
    try:
        datas = ray.get(unique)
    except ray.exceptions.ObjectLostError:  # one by one: only the lost ones are left out
        datas = [_readable(ray, r) for r in unique]
    values = dict(zip(unique, datas))
    for p, a in refs:
        data = values[a[0]]
        if data is not None:
            out[p] = memoryview(picked(a, data)).cast("B").toreadonly()
    if vouched is not None:
        vouched.update(p for p in good if p in out)
    return out


def _readable(ray, ref):
    """The object behind ``ref``, or None when it is lost (its owner died: ``OwnerDiedError``, ``ObjectLostError``)."""
    try:
        return ray.get(ref)
    except ray.exceptions.ObjectLostError:
        return None


def read_ranges_of(storage: "RayMemoryStorage", path: str, ranges) -> list[bytes]:
    """Every ``(start, length)`` range of ``path`` with one call to one store (a resharding restore reads
    each stored file once, not once per tensor)."""
    ray = _ray()
    ranges = [(start, length) for start, length in ranges]
    for start, length in ranges:
        check_range(start, length)
    path = check_relpath(path)
    got = first_answer(storage, lambda handle: ray.get(handle.get_ranges.remote(path, ranges)))
    if got is None:
        raise storage.missing(path)
    if isinstance(got, int):
        start, length = next((a, n) for a, n in ranges if a + n > got)
        raise range_past_end(path, start, length, got)
    return got


def spread_manifest(storage: "RayMemoryStorage", path: str, payload: Any, written_on: str, skip=()) -> None:
    """A committed manifest also goes to every other store holding files of its snapshot (but those of ``skip``)."""
    sid = path.split("/", 1)[0]
    stores = {n: h for n, h in storage.stores().items() if n not in skip and n != written_on}
    if not stores:  # (e.g. one node, or every other store a placement target: no call at all)
        return
    held = storage.each("inventory", sid, stores=stores)
    for node, files in held.items():
        if files:
            try:
                _ray().get(stores[node].put_replica.remote(path, payload, written_on))
            except Exception:  # that store died meanwhile: its files are gone with it
                pass


class RayMemoryStorage(StoreDirectory, ReadSessions, Storage):
    """A run folder held in the memory of the cluster's nodes (see the module docstring)."""

    supports_rename = False
    shares_views = True
    reads_into = True
    versions_name_content = True  # a store's objects are immutable; a replaced file is a new one, a new version

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        key, opts = parse_url(url, storage_options)
        self.key = key
        self.url = f"{PROTOCOL}://{key}"
        self.namespace = opts.get("namespace", "rl_ckpt")
        self.replicas = opts["replicas"]
        self.budget_bytes = opts["budget_bytes"]
        self._node = opts.get("node_id")
        self._handles: dict[str, Any] = {}
        self._generation = 0  # bumped by every write and removal: a read session's view is retaken after one
        self._sessions: dict[int, list] = {}  # thread id -> [depth, RunView | None]
        self.calls = {"store_listings": 0, "store_calls": 0}  # Ray round trips made (bench, tests)
        self.view_seconds = 0.0  # spent taking read sessions' views (``RunView``): a restore's timings report it
        self._warming = None  # the first contact's thread (``warm_up``)

    # -- writes -------------------------------------------------------------------
    def write(self, path: str, chunks: Iterable, *, create_only: bool = False, durable: bool = True) -> int:
        import numpy as np

        ray = _ray()
        path = check_relpath(path)
        self.changed()
        pieces = [memoryview(c).cast("B") for c in chunks]  # every chunk first: a failing iterator publishes nothing
        size = sum(p.nbytes for p in pieces)
        if size <= _INLINE_BYTES:
            payload: Any = b"".join(pieces)
        else:  # one copy into the object store; the store copies it into its own heap
            payload = ray.put([np.frombuffer(p, dtype=np.uint8) for p in pieces if p.nbytes])
        if create_only:
            held = [n for n, st in self.each("stat", path).items() if st is not None]
            if held:
                raise CommitConflictError(
                    f"{self.url}/{path} already exists (in the memory store of node "
                    f"{held[0][:12]}): another writer committed it first",
                    path=path,
                    snapshot_id=path.split("/", 1)[0],
                )
        local = self.node_id
        peers = [self.store_of(n) for n in self.peers(local)]
        try:
            got = ray.get(self.store_of(local).put.remote(path, payload, create_only, peers))
        except ray.exceptions.RayActorError:
            # The store of this node died: whatever it held is gone; a new one takes this write.
            self._handles.pop(local, None)
            got = ray.get(self.store_of(local).put.remote(path, payload, create_only, peers))
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, StorageError):
                raise cause from None
            raise StorageError(f"cannot write {self.url}/{path}: {exc}", path=path) from exc
        if path.endswith("/" + MANIFEST_NAME):
            self.spread_manifest(path, payload, local)
        return got

    def spread_manifest(self, path: str, payload: Any, written_on: str) -> None:
        """After a manifest's commit in ``written_on``'s store: its copies to the others (:func:`spread_manifest`)."""
        spread_manifest(self, path, payload, written_on)

    def write_atomic(self, path: str, data: bytes, *, create_only: bool = False) -> None:
        self.write(path, [data], create_only=create_only)

    # -- reads --------------------------------------------------------------------
    def read(self, path: str, *, on_chunk: Callable[[memoryview], object] | None = None, max_bytes: int | None = None):
        """The file in a fresh writable buffer (one copy out of the object store, hashed as it fills)."""
        return copy_out(self.read_view(path, max_bytes=max_bytes), on_chunk)

    def read_view(
        self, path: str, *, on_chunk: Callable[[memoryview], object] | None = None, max_bytes: int | None = None
    ) -> memoryview:
        """The file as a READ-ONLY memoryview, without a copy when its store is on this node (the object store's
        shared memory; another node's object is moved here once). ``on_chunk`` sees the very bytes returned.
        Never write through it (the store's copy lives there): a caller needing writable memory copies it."""
        ray = _ray()
        check_max_bytes(max_bytes)
        path = check_relpath(path)
        view = self.session_view()
        got = view.bytes_of(self, path) if view is not None else None
        if got is not None:
            data = memoryview(got).cast("B")
            if max_bytes is not None and data.nbytes > max_bytes:
                raise too_large(path, data.nbytes, max_bytes)
            return hash_in_place(data.toreadonly(), on_chunk)

        def get(handle):
            got = ray.get(handle.get.remote(path, max_bytes))
            return picked(got, ray.get(got[0])) if isinstance(got, list) else got  # [ObjectRef(, index)]

        got = first_answer(self, get)
        if got is None:
            raise self.missing(path)
        if isinstance(got, int):
            raise too_large(path, got, max_bytes)
        view = memoryview(got).cast("B")
        return hash_in_place(view.toreadonly(), on_chunk)

    def read_into(self, path: str, pieces, *, on_chunk=None) -> None:
        """The file copied once from where it is mapped (``read_view``: no copy on this node) into the caller's
        pieces, each step handed to ``on_chunk`` right after it landed (hashed while in the CPU cache)."""
        total, views = check_pieces(path, pieces)
        got = self.read_view(path, max_bytes=total)
        if got.nbytes != total:
            raise StorageError(f"short read of {self.url}/{path}: {got.nbytes} bytes, {total} expected", path=path)
        copy_into(got, views, on_chunk)

    def views_many(self, paths) -> dict[str, memoryview]:
        """The files of ``paths`` this node's store holds, mapped read-only with one call to it (``local_views``)."""
        return local_views(self, [check_relpath(p) for p in paths])

    def read_range(self, path: str, start: int, length: int) -> bytes:
        return self._ranges(path, [(start, length)])[0]

    def read_ranges(self, path: str, ranges) -> list[bytes]:
        return self._ranges(path, ranges)

    def _ranges(self, path: str, ranges) -> list[bytes]:
        """Every ``(start, length)`` of ``path``: sliced from the read session's view when it holds the file here
        already, else with one call to one store (``read_ranges_of``)."""
        ranges = [(start, length) for start, length in ranges]
        for start, length in ranges:
            check_range(start, length)
        path = check_relpath(path)
        view = self.session_view()
        held = view.bytes_of(self, path, mapped_only=True) if view is not None else None
        if held is None:
            return read_ranges_of(self, path, ranges)
        data = memoryview(held).cast("B")
        for start, length in ranges:
            if start + length > data.nbytes:
                raise range_past_end(path, start, length, data.nbytes)
        return [bytes(data[start : start + length]) for start, length in ranges]

    def open_read(self, path: str) -> BinaryIO:
        return io.BufferedReader(ViewReader(self.read_view(path)), buffer_size=COPY_STEP)

    def missing(self, path: str) -> StorageError:
        return StorageError(
            f"cannot read {self.url}/{path}: no live memory store holds it (never written, removed, "
            "evicted, its store and every replica are gone, or its object was lost: a policy version's chunk "
            "whose publisher died before the stores owned it)",
            path=path,
        )

    def inventory(self, prefix: str = "") -> dict[str, dict[str, int]]:
        """What every live store holds under ``prefix``: node id -> {path: size}."""
        if prefix:
            check_relpath(prefix)
        return self.each("inventory", prefix)

    def list(self, path: str = "") -> list[Entry]:
        if path:
            path = check_relpath(path)
        view = self.session_view()
        if view is not None:
            return view.list(path)
        base = path + "/" if path else ""
        entries: dict[str, Entry] = {}
        for files in self.inventory(path).values():
            for p, size in files.items():
                if not p.startswith(base):
                    continue
                rest = p[len(base) :]
                name, _, deeper = rest.partition("/")
                if deeper:
                    entries.setdefault(name, Entry(name, True))
                else:
                    entries[name] = Entry(name, False, size)
        return sorted(entries.values(), key=lambda e: e.name)

    def exists(self, path: str) -> bool:
        """Whether a file or a folder with files is at ``path`` (asked as a read is: see first_answer)."""
        path = check_relpath(path)
        view = self.session_view()
        if view is not None:
            return view.exists(path)
        return first_answer(self, lambda handle: _ray().get(handle.holds.remote(path))) is not None

    def stat(self, path: str) -> Entry | None:
        """``path``'s entry from the first store holding it (asked as a read is); its version names that store."""
        return self.stat_many([path])[0]

    def stat_many(self, paths) -> list[Entry | None]:
        view = self.session_view()
        if view is not None:
            return [view.entry(check_relpath(p)) for p in paths]
        return stat_paths(self, paths)

    def size(self, path: str) -> int:
        entry = self.stat(path)
        if entry is None:
            raise self.missing(path)
        return entry.size

    # -- removal --------------------------------------------------------------------
    def remove(self, path: str) -> None:
        self.changed()
        self.each("remove", check_relpath(path))

    def remove_tree(self, path: str) -> None:
        self.changed()
        self.each("remove_prefix", check_relpath(path))

    def makedirs(self, path: str) -> None:
        check_relpath(path)  # folders are implied by the files in them

    def free_bytes(self) -> int | None:
        """Room left in this node's store within its budget (None: no budget)."""
        if self.budget_bytes is None:
            return None
        held = self.each("bytes_held", stores={self.node_id: self.store_of(self.node_id)})
        return self.budget_bytes - held.get(self.node_id, 0)

    def wait_replicated(self, timeout: float | None = None) -> bool:
        """Block until every store's queued copies are done (True), or ``timeout`` passed (False)."""
        return all(self.each("wait_replicated", timeout).values())

    def store_info(self) -> dict[str, dict]:
        """node id -> what its store holds and its replication state (``MemoryStore.info``)."""
        return self.each("info")

    def destroy(self) -> None:
        """Kill every store of this run (their memory is freed; nothing is flushed)."""
        ray = _ray()
        for handle in self.stores().values():
            ray.kill(handle, no_restart=True)
        self._handles.clear()


register_storage(PROTOCOL, RayMemoryStorage)
