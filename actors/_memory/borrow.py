"""What a :class:`~actors._memory.store.MemoryStore` does to take a policy version's chunks without copying them at
publish: it *borrows* the publisher's object, then owns a copy of it in the background.

- **Borrow** (:meth:`StoreBorrowing.borrow`). The publisher ``ray.put`` a chunk once and hands the store its
  ``ObjectRef`` inside a list (so Ray does not resolve it). The store on the publisher's node keeps the ref
  and nothing else: no copy. A placement target on another node ``ray.get`` s it (Ray moves the object to its
  node: the one transfer every reader on that node then reads locally) and keeps the ref and the mapped value
  (which keeps the node-local copy in place): no copy either. Readers are answered the same ``[ref]`` as for
  an owned file; budget, pins, eviction, listings and stats treat a borrowed file as an owned one.
- **Checked once per node** (*vouched for*: readers on the node map it without hashing it again). On the
  publisher's node, by the publisher's read-back (:meth:`StoreBorrowing.vouch`); on a placement target, by
  the store itself as each chunk lands (:func:`landed_whole`: hashed against its content address before it is
  held; a mismatch is not held, and the node's readers place that chunk from the publisher's node).
- **Own** (a thread of the store, :meth:`StoreBorrowing._own_loop`). Each borrowed file is copied into an
  object the store puts itself (from the value it maps, else ``ray.get`` of the ref), and swapped in under the
  lock if the entry is still the one borrowed. From then on the file outlives the publisher. The copies wait
  for the store to be quiet (no borrow nor pin for ``OWN_QUIET_SECONDS``, no pin held; ``OWN_DEFER_SECONDS``
  at most), so they do not slow the publish that borrows nor the pulls that follow it.
  :meth:`StoreBorrowing.wait_owned` waits for it.
- **The ownership window.** A publisher that dies while a file is still borrowed takes the object with it
  (``OwnerDiedError`` / ``ObjectLostError``). The thread then drops that file (``lost``, shown by ``info``):
  the store never answers a ref it knows cannot be read. A reader that meets such a ref first gets the same
  error from ``ray.get`` and treats the chunk as missing (the weight subscriber falls back, as for a checksum
  mismatch). A target that already mapped the object still owns it (from its mapped copy).

Only policy versions borrow (``VersionsStorage.write_many_atomic``); every other put copies at once, as a
memory-tier snapshot must outlive its writer the moment it commits.

A mixin of ``MemoryStore``: it uses the store's lock, files, sizes, ``_store``, ``_drop`` and ``take``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from rl_ckpt._format.manifest import MANIFEST_NAME, Manifest
from rl_ckpt._run.dedup import manifest_objects, object_path, parse_object_path

from .reads import Slice, answer_of, as_index, picked, resolved

log = logging.getLogger("rl_ckpt")

OWN_BATCH = 8  # borrowed files owned per turn of the thread (the lock is not held while copying)
OWN_QUIET_SECONDS = 0.25  # the copies start once no file was borrowed and no reader pinned for this long,
OWN_DEFER_SECONDS = 2.0  # and no pin is held (a publish and the pulls right after it go first); this long at most


def landed_whole(path: str, value, size: int, node_id: str) -> bool:
    """Check a chunk just placed on this node (``value``: its part of the object, as mapped here) against its content
    address, once for every reader of this node. True: it matches; False: ``path`` is not a content-addressed object
    (left to its readers to check). A mismatch raises :class:`~rl_ckpt.errors.CorruptSnapshotError`: the transfer
    (or the object) is damaged and the chunk is not held here (its readers then place it from the publisher's node,
    checked as any copy)."""
    from rl_ckpt._format.checksum import digest_bytes
    from rl_ckpt.errors import CorruptSnapshotError

    named = parse_object_path(path)
    if named is None:
        return False
    algo, digest = named
    data = memoryview(value).cast("B")
    if data.nbytes != size or digest_bytes(algo, data) != digest:
        raise CorruptSnapshotError(
            f"memory store {node_id[:12]}: {path} placed on this node does not match its content address "
            f"({data.nbytes} bytes of {size}): not held here; its readers place it from the publisher's node",
            path=path,
            problems=["object checksum mismatch"],
        )
    return True


class StoreBorrowing:
    def _init_borrowing(self) -> None:
        self._borrowed: dict[str, tuple] = {}  # path -> (the publisher's ref, the mapped value or None)
        self._own_queue: collections.deque = collections.deque()
        self._owning = 0
        self._last_activity = 0.0  # when a file was last borrowed or a reader pinned or let go (monotonic)
        self._own_wake = threading.Condition(self._lock)
        self._own_done = threading.Condition(self._lock)
        self._own_gate = threading.Event()  # cleared by ``hold_owning`` (tests): the thread waits
        self._own_gate.set()
        self.owned_bytes = 0  # borrowed bytes this store has copied into objects it owns
        self.lost: list[str] = []  # borrowed files dropped: their publisher died before they were owned
        self.lost_versions: list[str] = []  # manifests dropped here because a file they vouch for was lost
        self.own_errors: list[str] = []  # files left borrowed by another failure (e.g. the object store full)
        self._vouched: dict[str, object] = {}  # path -> the borrowed entry its publisher verified (``vouch``)
        self._own_thread = threading.Thread(target=self._own_loop, name="rl_ckpt-mem-own", daemon=True)
        self._own_thread.start()

    def borrow(
        self,
        path: str,
        wrapped: list,
        size: int,
        replicate_to=(),
        place: bool = False,
        replica: bool = False,
        landed=None,
    ):
        """Hold ``path`` as the object ``wrapped[0]`` (the publisher's ``ObjectRef``, ``size`` bytes), or as part
        ``wrapped[1]`` of that object when it holds a list of buffers (a publish's batch of chunks; ``item_of``),
        without a copy; it is owned in the background. ``place``: move it to this node first (``ray.get``, the
        mapped value is kept; ``landed``: the object's value mapped already). ``replica``: kept only if this store
        does not hold ``path`` already (returns False then). ``replicate_to``: peer stores to copy it to (in the
        background, as ``put``'s)."""
        ref = wrapped[0]
        held = Slice(ref, as_index(wrapped[1])) if len(wrapped) > 1 else ref  # part ``wrapped[1]`` of a batch object
        with self._lock:
            if replica and path in self._files:
                return False
        value, checked = None, False
        try:
            if place:
                self._land_gate.wait()  # (``hold_landing``, a test hook)
                # The transfer to this node; the mapped value keeps the local copy.
                value = resolved(held) if landed is None else picked(answer_of(held), landed)
                checked = landed_whole(path, value, size, self.node_id)
            with self._lock:
                if replica and path in self._files:
                    return False
                self._store(path, held, size)
                self._borrowed[path] = (held, value)
                if checked:  # hashed here, as mapped on this node: this node's readers need not hash it again
                    self._vouched[path] = held
                self._last_activity = time.monotonic()
                self._own_queue.append(path)
                self._own_wake.notify()
                peers = list(replicate_to)
                if peers:
                    self._enqueue(path, peers)
        except BaseException:
            self._not_landing([path])  # it will not land: a commit waiting for it gives up, a reader copies it
            raise
        return True

    def borrow_many(self, items: list, replicate_to=(), place: bool = False, replica: bool = False) -> int:
        """:meth:`borrow` of each ``(path, ref, size, index)`` in one call (the refs are inside a list: not resolved;
        ``index``: the file's place in the object's list, ``item_of``, or None for an object of its own); with
        ``place`` the transfers of all of them to this node run at once. Returns the bytes taken; a file that could
        not be taken (its object lost) is not landing (see :meth:`borrow`) and the first such error is raised once
        the others are taken."""
        landed: dict = {}  # batch object -> its value mapped here (``place``)
        if place and items:
            import ray

            self._land_gate.wait()  # (``hold_landing``, a test hook)
            refs = list({ref: None for _p, ref, _n, _i in items})  # (a batch object once)
            try:  # every transfer started at once; each batch object then mapped here once, for its files
                ray.wait(refs, num_returns=len(refs), fetch_local=True)
                landed = dict(zip(refs, ray.get(refs)))
            except ray.exceptions.RayError:
                pass  # (none mapped) each borrow's own ``ray.get`` says which one failed
        taken, failed = 0, None
        for path, ref, size, index in items:
            try:
                wrapped = [ref] if index is None else [ref, index]
                value = landed.get(ref)
                taken += size * bool(self.borrow(path, wrapped, size, replicate_to, place, replica, value))
            except Exception as exc:
                failed = failed or exc
        if failed is not None:
            raise failed
        return taken

    def vouch(self, items: list) -> int:
        """The publisher on this node hashed these borrowed files, as it mapped them in the object store, against
        their content address, and found them whole (its verify-after-write): ``(path, [ref, index])`` each, the
        batch object and place it hashed. Each held as exactly that object is *vouched for* until it is replaced,
        removed or owned (:meth:`get_many_vouched`): readers on this node map those same bytes (an object is
        immutable once put) and need not hash them again. Returns how many were vouched for."""
        n = 0
        with self._lock:
            for path, (ref, index) in items:  # (a publisher's chunks are parts of its batch objects: ``Slice``)
                held = self._files.get(path)
                if (
                    isinstance(held, Slice)
                    and held.ref == ref
                    and held.index == as_index(index)
                    and path in self._borrowed
                ):
                    self._vouched[path] = held
                    n += 1
        return n

    def get_many_vouched(self, paths: list[str]) -> tuple[list, list[str]]:
        """``get_many`` of ``paths``, and which of them this store vouches for (:meth:`vouch`), still held as that
        very object: a reader on this node maps the same bytes and need not hash them again."""
        with self._lock:
            answers = [self.get(p) for p in paths]
            vouched = [p for p in paths if p in self._vouched and self._vouched[p] is self._files.get(p)]
        return answers, vouched

    def _own_loop(self) -> None:
        while True:
            with self._lock:
                self._own_wake.wait_for(lambda: bool(self._own_queue))
            self._own_gate.wait()
            with self._lock:
                self._wait_quiet()
                if not self._own_gate.is_set():
                    continue  # held while this waited for quiet (files borrowed since stay borrowed): wait again
                batch = []
                while self._own_queue and len(batch) < OWN_BATCH:
                    path = self._own_queue.popleft()
                    if path in self._borrowed:
                        batch.append((path, self._borrowed[path]))
                self._owning += 1
            try:
                for path, entry in batch:
                    self._own_one(path, entry)
            finally:
                with self._lock:
                    self._owning -= 1
                    self._own_done.notify_all()

    def _wait_quiet(self) -> None:
        """Wait (holding the lock's condition) until the store is quiet: no file borrowed and no reader pinning or
        letting go for ``OWN_QUIET_SECONDS``, and no pin held; ``OWN_DEFER_SECONDS`` at most. A publish borrows
        chunk after chunk and its readers pin, pull and let go right after: the copies wait for both."""
        deadline = time.monotonic() + OWN_DEFER_SECONDS
        while True:
            now = time.monotonic()
            if now >= deadline:
                return
            quiet = self._last_activity + OWN_QUIET_SECONDS - now
            if quiet <= 0 and not self._live_pins():
                return
            self._own_wake.wait(timeout=min(max(quiet, OWN_QUIET_SECONDS / 4), deadline - now))

    def _drop_manifests_needing(self, path: str) -> None:
        """Drop the manifest of every version held here that vouches for ``path``, just lost (under the lock): a
        store never holds a manifest whose files it does not hold, so a version lost with its publisher stops being
        listed (nor ``latest``) here at once, instead of every pull falling back until retention removes it."""
        for mpath in [p for p in self._files if p.endswith("/" + MANIFEST_NAME)]:
            sid = mpath[: -len(MANIFEST_NAME) - 1]
            try:
                manifest = Manifest.from_bytes(bytes(resolved(self._files[mpath])), sid)
                needs = {f"{sid}/{e.path}" for e in manifest.files}
                needs.update(object_path(algo, digest) for digest, (algo, _n) in manifest_objects(manifest).items())
            except Exception as exc:  # unreadable: it vouches for nothing that can be checked, keep it as it is
                log.warning("memory store %s: %s not checked for a lost file: %s", self.node_id[:12], mpath, exc)
                continue
            if path in needs:
                self._drop(mpath)
                self.lost_versions.append(sid)
                del self.lost_versions[:-50]
                log.warning(
                    "memory store %s: %s dropped: its file %s was lost with its publisher", self.node_id[:12], sid, path
                )

    def pin(self, snapshot: str, holder: str, paths: list[str], seconds: float) -> bool:
        with self._lock:
            self._last_activity = time.monotonic()
        return super().pin(snapshot, holder, paths, seconds)

    def _own_one(self, path: str, entry: tuple) -> None:
        import ray

        ref, value = entry
        try:
            data = value if value is not None else resolved(ref)
            owned, size = self.take(data)
        except ray.exceptions.RayError as exc:  # the publisher died first (OwnerDiedError, ObjectLostError)
            with self._lock:
                if self._borrowed.get(path) is entry:
                    self._drop(path)
                    self.lost.append(path)
                    del self.lost[:-50]
                    self._drop_manifests_needing(path)
            log.warning(
                "memory store %s: %s lost before this store owned it (%s); dropped",
                self.node_id[:12],
                path,
                type(exc).__name__,
            )
            return
        except Exception as exc:  # e.g. the object store is full: it stays borrowed (``info`` shows it)
            log.warning("memory store %s: %s not owned yet: %s", self.node_id[:12], path, exc)
            self.own_errors.append(f"{path}: {type(exc).__name__}: {exc}"[:500])
            del self.own_errors[:-50]
            return
        with self._lock:
            if self._borrowed.get(path) is entry and self._files.get(path) is ref:
                self._files[path] = owned
                del self._borrowed[path]
                self._vouched.pop(path, None)  # the store's own copy was not hashed: readers hash it
                self.owned_bytes += size

    def unpin(self, snapshot: str, holder: str) -> None:
        super().unpin(snapshot, holder)
        with self._lock:
            self._last_activity = time.monotonic()
            self._own_wake.notify_all()  # the copies waiting for the readers

    def wait_owned(self, timeout: float | None = None) -> bool:
        """Block until the thread has taken every borrowed file: True when none is left borrowed (each owned, or
        dropped as lost); False when ``timeout`` passed first, or a file could not be owned (``own_errors``)."""
        with self._lock:
            idle = self._own_done.wait_for(lambda: not self._owning and not self._own_queue, timeout=timeout)
            return bool(idle) and not self._borrowed

    def hold_owning(self, on: bool) -> None:
        """Hold (True) or release the thread that owns borrowed files (a test hook: the ownership window kept
        open deterministically)."""
        if on:
            with self._lock:  # after this returns, the thread takes nothing more, not even what it had waited for
                self._own_gate.clear()
        else:
            self._own_gate.set()

    def borrowed_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes[p] for p in self._borrowed)
