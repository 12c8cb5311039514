"""Read sessions of ``raymem://``: one view of the run's stores for a restore (``RayMemoryStorage.read_session``).

Outside a session every listing asks every live store and every read asks a store, each a Ray round trip of
about a millisecond (a 1 MiB restore made 3 listings of the cluster's stores and 9 store calls, against ~4 ms
for the whole restore from a warm local disk). Inside a session the first listing, stat or read takes one view
of the run: each store already known is asked for its ``view`` (``StoreReads.view``: every path it holds with
size and version, and the newest committed snapshot's files) while the cluster's stores are listed, and a store
the listing adds is asked too. Listings, stats and existence are then answered from the view; a read takes the
file from it (a file in this node's object store is mapped with the others of its folder, one ``ray.get``), and
a file the view did not carry is fetched with the rest of its folder in one call.

What a session sees is the run as it was when its view was taken, as a listing taken then would: a write or a
removal through the same storage object (from any thread) drops the view, and the next use takes a new one;
another process's writes during the session are not seen. Nothing is trusted more for it: a reader checks every
byte it reads against the manifest as before (the engine hashes what ``read``/``read_view`` return), and a file
the view names but cannot deliver (gone since, its store dead) is asked of the stores as outside a session.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
from typing import Any, Callable

from rl_ckpt._storage.base import Entry
from rl_ckpt._storage.buffers import COPY_STEP, alloc_bytes, copy_pieces, prefault

from .reads import picked
from .store import PLASMA_MIN_BYTES

VIEW_INLINE_BYTES = 4 << 20  # small files' bytes a store puts into one view or one folder fetch
VIEW_REFS = 64  # refs of object-store files a store puts into one view or one folder fetch
VIEW_ARGS = ("", VIEW_INLINE_BYTES, VIEW_REFS)  # a store's ``view`` of the whole run


def _ray():
    import ray

    return ray


def parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def copy_out(got: memoryview, on_chunk: Callable[[memoryview], object] | None) -> Any:
    """A read-only view of the object store copied into a fresh writable buffer, piece by piece, each
    handed to ``on_chunk`` (hashed) while still in the CPU cache (as LocalStorage.read does with the disk); the
    buffer's pages are faulted in ahead by a helper thread."""
    out = alloc_bytes(got.nbytes)
    stop_prefault = prefault(out)
    try:
        copy_pieces(got, [memoryview(out)], on_chunk)
    finally:
        stop_prefault()
    return out


def copy_into(got: memoryview, views: list[memoryview], on_chunk: Callable[[memoryview], object] | None) -> None:
    """The bytes of ``got`` copied into ``views`` (which cover them in order), ``COPY_STEP`` at a time, each step
    handed to ``on_chunk`` right after it landed (``copy_pieces``: the next step copied meanwhile)."""
    copy_pieces(got, views, on_chunk)


def hash_in_place(view: memoryview, on_chunk: Callable[[memoryview], object] | None) -> memoryview:
    """``view`` itself, after handing it to ``on_chunk`` piece by piece (no copy)."""
    if on_chunk is not None:
        for start in range(0, view.nbytes, COPY_STEP):
            on_chunk(view[start : start + COPY_STEP])
    return view


class ViewReader(io.RawIOBase):
    """A read-only file over a memoryview (``open_read`` without copying the file first)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        out = memoryview(buf).cast("B")
        n = min(out.nbytes, self._view.nbytes - self._pos)
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


class RunView:
    """What the run's live stores held when the view was taken, and the file contents gathered since."""

    def __init__(self, storage: Any, generation: int, *, deferred: bool = False) -> None:
        self.generation = generation
        self.local = storage.node_id
        self.holders: dict[str, list[tuple[str, int, int]]] = {}  # path -> [(node, size, version)], local first
        self.data: dict[str, Any] = {}  # path -> bytes, [ObjectRef] (not mapped yet) or the mapped object
        self.source: dict[str, str] = {}  # path -> the node whose store gave data[path]
        self._asked: dict[str, Any] | None = None  # node -> its view call in flight (``deferred``: until ``ready``)
        started = time.perf_counter()
        try:
            self._asked = self._ask(storage)
            if not deferred:
                self.ready(storage)
        finally:
            storage.view_seconds += time.perf_counter() - started

    def ready(self, storage: Any) -> "RunView":
        """The view, its answers gathered (a deferred view's calls were sent when it was made)."""
        if self._asked is not None:
            started = time.perf_counter()
            try:
                asked, self._asked = self._asked, None
                self._take(storage, asked)
            finally:
                storage.view_seconds += time.perf_counter() - started
        return self

    @staticmethod
    def _ask(storage: Any) -> dict[str, Any]:
        """Ask each store already known for its view (sent, not awaited)."""
        known = storage.known_stores()
        refs = {node: handle.view.remote(*VIEW_ARGS) for node, handle in known.items()}
        storage.calls["store_calls"] += len(refs)
        return refs

    def _take(self, storage: Any, refs: dict[str, Any]) -> None:
        ray = _ray()
        live = storage.stores()  # listed while the known stores answer
        added = {node: handle.view.remote(*VIEW_ARGS) for node, handle in live.items() if node not in refs}
        storage.calls["store_calls"] += len(added)
        refs = {**refs, **added}
        answers = {}
        for node, ref in refs.items():
            if node not in live:
                continue  # no longer listed: gone, with its files
            try:
                answers[node] = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
                storage.forget(node)
                again = storage.lookup(node)  # the handle known may be of an earlier store of that node
                if again is not None:
                    try:
                        storage.calls["store_calls"] += 1
                        answers[node] = ray.get(again.view.remote(*VIEW_ARGS))
                        storage.remember(node, again)
                    except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
                        pass
        order = ([self.local] if self.local in answers else []) + sorted(n for n in answers if n != self.local)
        for node in order:
            for path, (size, version) in answers[node]["files"].items():
                self.holders.setdefault(path, []).append((node, size, version))
            for path, got in answers[node]["data"].items():
                if path not in self.data:
                    self.data[path], self.source[path] = got, node

    # -- listings and stats ----------------------------------------------------------
    def entry(self, path: str) -> Entry | None:
        held = self.holders.get(path)
        if not held:
            return None
        node, size, version = held[0]
        return Entry(path.rsplit("/", 1)[-1], False, size, version=f"{node[:12]}:{version}")

    def exists(self, path: str) -> bool:
        if not path:
            return bool(self.holders)
        folder = path + "/"
        return path in self.holders or any(p.startswith(folder) for p in self.holders)

    def list(self, path: str) -> list[Entry]:
        base = path + "/" if path else ""
        entries: dict[str, Entry] = {}
        for p, held in self.holders.items():
            if not p.startswith(base):
                continue
            name, _, deeper = p[len(base) :].partition("/")
            if deeper:
                entries.setdefault(name, Entry(name, True))
            else:
                entries[name] = Entry(name, False, held[0][1])
        return sorted(entries.values(), key=lambda e: e.name)

    # -- reads ------------------------------------------------------------------------
    def bytes_of(self, storage: Any, path: str, *, mapped_only: bool = False) -> Any:
        """``path``'s bytes (bytes or a read-only object-store buffer), or None: the caller asks the stores as
        outside a session. ``mapped_only``: only what is here already (no call, no mapping)."""
        got = self.data.get(path)
        if mapped_only:
            return None if got is None or isinstance(got, list) else got
        if got is None and path in self.holders:
            self._fetch_folder(storage, path)
            got = self.data.get(path)
        if isinstance(got, list):
            self._map(storage, path)
            got = self.data.get(path)
        return got

    def _fetch_folder(self, storage: Any, path: str) -> None:
        """``path`` and the other files of its folder that its store holds and the view lacks, in one call."""
        ray = _ray()
        node = self.holders[path][0][0]
        folder, room, refs = parent(path), VIEW_INLINE_BYTES, VIEW_REFS
        wanted = [path]
        for p, held in sorted(self.holders.items()):
            if p == path or p in self.data or parent(p) != folder or held[0][0] != node:
                continue
            size = held[0][1]
            if size < PLASMA_MIN_BYTES and size <= room:
                room -= size
                wanted.append(p)
            elif size >= PLASMA_MIN_BYTES and refs > 0:
                refs -= 1
                wanted.append(p)
        handle = storage.known_stores().get(node)
        if handle is None:
            return
        storage.calls["store_calls"] += 1
        try:
            answers = ray.get(handle.get_many.remote(wanted))
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
            storage.forget(node)
            return
        for p, got in zip(wanted, answers):
            if got is not None and not isinstance(got, int):
                self.data[p], self.source[p] = got, node

    def _map(self, storage: Any, path: str) -> None:
        """Map ``path``'s object, with every other unmapped object of its folder when both are on this node (one
        ``ray.get``: no copy, nothing moves between nodes)."""
        ray = _ray()
        node = self.source[path]
        batch = [path]
        if node == self.local:
            folder = parent(path)
            batch += [
                p
                for p, got in self.data.items()
                if p != path and isinstance(got, list) and self.source[p] == node and parent(p) == folder
            ]
        try:
            objects = ray.get([self.data[p][0] for p in batch])
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
            for p in batch:
                self.data.pop(p, None)
            storage.forget(node)
            return
        for p, obj in zip(batch, objects):
            self.data[p] = picked(self.data[p], obj)


class ReadSessions:
    """``read_session`` of ``RayMemoryStorage`` (a mixin: it uses the storage's ``_sessions`` and ``_generation``)."""

    # -- read sessions ------------------------------------------------------------
    @contextlib.contextmanager
    def read_session(self):
        """Within it (on this thread), listings, stats and reads are answered from one view of the run taken at
        the first use: one listing of the cluster's stores and one call per store, instead of a call or a
        listing for each. A write or removal through this storage drops the view; the next use takes a new one
        (see ``actors/_memory/view.py``). Nested sessions share the outer one's view."""
        key = threading.get_ident()
        session = self._sessions.setdefault(key, [0, None])
        session[0] += 1
        try:
            yield self
        finally:
            session[0] -= 1
            if session[0] == 0:
                self._sessions.pop(key, None)

    def session_view(self) -> RunView | None:
        """This thread's read session view (taken now if there is none, or a write came since); None: no session."""
        session = self._sessions.get(threading.get_ident())
        if session is None:
            return None
        if session[1] is None or session[1].generation != self._generation:
            session[1] = RunView(self, self._generation)
        return session[1].ready(self)

    def prefetch_view(self) -> None:
        """Send this thread's read-session view calls now, without waiting for them: the session's first listing,
        stat or read then finds the answers there (a restore sends them before it asks the manager for its plan).
        The view is of the run as of now; a write through this storage before its first use drops it. Nothing
        outside a session."""
        session = self._sessions.get(threading.get_ident())
        if session is not None and (session[1] is None or session[1].generation != self._generation):
            session[1] = RunView(self, self._generation, deferred=True)

    def changed(self) -> None:
        """A write or removal went through this storage: read sessions take a new view at their next use."""
        self._generation += 1
