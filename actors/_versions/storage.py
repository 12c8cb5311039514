"""The storage a policy-version publisher writes through: :class:`VersionsStorage`, the run's version stores
(``raymem://versions/<run>``) seen from a writer that also *places* each file on the nodes where rollout
workers pull, and commits there only once the files landed (see ``actors/policy_versions.py``)."""

from __future__ import annotations

import logging

from rl_ckpt.errors import CheckpointError, StorageError
from rl_ckpt._format.manifest import MANIFEST_NAME
from rl_ckpt._storage.base import check_relpath

from .._memory.reads import item_of
from .._memory.storage import RayMemoryStorage, copy_out, hash_in_place, local_views, spread_manifest

log = logging.getLogger("rl_ckpt")

INLINE_BYTES = 256 << 10  # smaller files travel inside the call (as RayMemoryStorage.write's)


SUBSCRIBERS = "subscribers"  # subscribers/<node id>: a rollout worker pulls versions on that node


class VersionsStorage(RayMemoryStorage):
    """The version stores of a run, seen from a writer that also *places* what it writes.

    ``push_to`` (node ids, set by :meth:`PolicyVersions.publish` to the nodes where rollout workers pull):
    every file written is also copied, store to store, into those nodes' stores (``MemoryStore.borrow_many`` /
    ``put_replica`` / ``fetch``, started as each batch of files is written, so the transfers run while the publish
    goes on writing and verifying), announced there first (``MemoryStore.expect``: a worker's pull there waits for them
    rather than copying them a second time).

    A manifest is committed in this node's store (and copied to its ``replicas`` peers) WITHOUT waiting for those
    transfers: the write returns then. Each placement target gets it with the files it vouches for
    (``MemoryStore.commit_after``) and stores it only once every one of them is held there, so a store never
    holds a manifest whose files it does not hold (else its workers place the version when they pull).
    :meth:`wait_pushed` waits for the transfers and those commits."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        super().__init__(url, storage_options)
        self.push_to: list[str] = []
        self.pushing: list = []  # (paths, node, ref of that node's store's call, size or None) in flight
        self.expecting: list = []  # refs of ``expect`` calls to the placement targets (waited for before a commit)
        self.unpushed: list[str] = []
        self.batching = False
        self.written: dict[str, memoryview] = {}  # path -> what its store held right after the write (unread)
        self.listing: dict | None = None
        self.removing: list[str] = []  # objects the retention's sweep removed (sent at once: ``wait_removed``)
        self.acking: list = []  # (ref, batch, peers): this node's store borrowing a batch (waited for before a commit)
        self.lent: dict[str, list] = {}  # path -> [ref, place]: its batch object (this write); read back whole:
        self.vouching: list = []  # (path, [ref, place]) since the last commit (``read_back_verified``)
        self.pushed_bytes = 0
        self.placed: dict[str, int] = {}  # node -> bytes this writer placed in its store (``pushed_bytes`` in all)

    def write(self, path: str, chunks, *, create_only: bool = False, durable: bool = True) -> int:
        if path.endswith("/" + MANIFEST_NAME):
            self.wait_acked()  # a manifest vouches only for files this node's store took
            send_vouching(self)
        if not (self.push_to and path.endswith("/" + MANIFEST_NAME)):
            size = super().write(path, chunks, create_only=create_only, durable=durable)
            if self.push_to:
                self.unpushed.append(path)
                if not self.batching:
                    self.push()
            return size
        # A commit: the targets know what is on its way to them (and that this manifest follows) before any reader
        # can see the version here; then this node's store commits it, and each target once its files landed.
        data = b"".join(memoryview(c).cast("B") for c in chunks)
        self.written = {}
        self.push()
        vouched = vouched_paths(path, data)
        targets = [(node, self.store_of(node)) for node in self.push_to] if vouched is not None else []
        self.expecting += [handle.expect.remote([path]) for _n, handle in targets]
        self.wait_expected()
        try:
            size = super().write(path, [data], create_only=create_only, durable=durable)
        except BaseException:
            self.expecting += [handle.expect.remote([path], 0) for _n, handle in targets]  # it is not coming
            raise
        for node, handle in targets:
            self.pushing.append(([path], node, handle.commit_after.remote(path, data, vouched), None))
        return size

    def spread_manifest(self, path: str, payload, written_on: str) -> None:
        """As the base's, but not to the placement targets: they commit it themselves once its files landed."""
        spread_manifest(self, path, payload, written_on, skip=set(self.push_to))

    def wait_expected(self) -> None:
        """Wait for the announcements to the placement targets (a target that died is left out)."""
        import ray

        refs, self.expecting = self.expecting, []
        for ref in refs:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as exc:  # that store is gone: its workers place the version
                log.warning("policy versions: a placement target did not take the announcement: %s", str(exc)[:300])

    def write_many_atomic(self, items) -> None:
        """Many files (a publish's new chunks) at once: put once into this node's object store, the larger ones as one
        object for the batch, and handed from there to this node's store and to those of ``push_to`` together, one
        call per store for the batch (the targets start moving it to their node at once), not one round trip
        after another."""
        import ray

        items = [(check_relpath(path), memoryview(data).cast("B")) for path, data in items]
        self.written, self.lent = {}, {}
        if any(path.endswith("/" + MANIFEST_NAME) for path, _d in items):
            return self._write_each(items)  # commits: the base's, one by one
        store = self.store_of(self.node_id)
        peers = [self.store_of(n) for n in self.peers(self.node_id)]  # ``replicas``: copied in the background
        targets = [(node, self.store_of(node)) for node in self.push_to]
        self.expecting += [handle.expect.remote([path for path, _d in items]) for _n, handle in targets]
        refs, big = [], []
        for path, data in items:
            if data.nbytes <= INLINE_BYTES:  # a small file travels inside the call; each store keeps its bytes
                obj = bytes(data)
                refs.append(store.put.remote(path, obj, False, peers))
                for node, handle in targets:
                    ref = handle.put_replica.remote(path, obj, self.node_id)
                    self.pushing.append(([path], node, ref, data.nbytes))
            else:
                big.append((path, data))
        # The batch's larger files (a publish's chunks) as ONE object put here, a list of buffers (each file a span)
        # (Ray's cost is per object: one put, one transfer and one ref per batch, not per chunk). This node's store
        # and the placement targets borrow it (the ref inside a list: Ray does not resolve it): no store copies it
        # now (a target moves it to its node); each owns a copy of each file in the background
        # (``MemoryStore.borrow``, ``PolicyVersions.wait_owned``). lent: path -> (size, place).
        lent: dict[str, tuple] = {}
        if big:  # a tensor's neighbouring chunks as one buffer (Ray's put starts its copy threads per buffer)
            spans, where = contiguous_spans([data for _p, data in big])
            obj, lent = ray.put(spans), {path: (data.nbytes, at) for (path, data), at in zip(big, where)}
            batch = [(p, obj, n, i) for p, (n, i) in lent.items()]
            for node, handle in targets:  # one call per store: the targets move the batch to their node at once
                self.pushing.append((list(lent), node, handle.borrow_many.remote(batch, (), True, True), None))
            # This node's store: no transfer, and its answer is not waited for here: the read-back that verifies
            # these files maps the object put above, not the store's; the commit waits for it (``wait_acked``).
            self.acking.append((store.borrow_many.remote(batch, peers), batch, peers))
        try:
            ray.get(refs)
        except ray.exceptions.RayActorError:  # the store died: the base write starts a new one and retries
            return self._write_each(items)
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            raise (
                cause
                if isinstance(cause, StorageError)
                else StorageError(f"cannot write {len(items)} files to {self.url}: {exc}", path=items[0][0])
            ) from None
        # What the store now holds, mapped: the read-back that verifies each file costs no call per file. A borrowed
        # file is the very object put here (mapped without asking the store); the small ones' bytes, in one call.
        self.written = local_views(self, [path for path, _d in items if path not in lent])
        if lent:
            files = ray.get(obj)
            views = {path: memoryview(item_of(files, at)).cast("B").toreadonly() for path, (_n, at) in lent.items()}
            self.written.update(views)
            self.lent = {path: [obj, i] for path, (_n, i) in lent.items()}
        self.wait_expected()  # announced before this write returns (another rank's manifest may follow at once)

    def read_back_verified(self, path: str) -> None:
        """The read-back of a borrowed ``path`` (the very object put here) matched: told with the commit."""
        wrapped = self.lent.pop(path, None)
        if wrapped is not None:
            self.vouching.append((path, wrapped))

    def wait_acked(self) -> None:
        """Wait for this node's store to have taken the batches borrowed since the last wait (``acked``)."""
        acked(self)

    def views_many(self, paths) -> dict:
        self.wait_acked()
        return super().views_many(paths)

    def stat_many(self, paths) -> list:
        self.wait_acked()
        return super().stat_many(paths)

    def read(self, path: str, *, on_chunk=None, max_bytes: int | None = None):
        """As the base's, but the read-back of a file :meth:`write_many_atomic` just wrote (its first read, with
        ``on_chunk``) gets the mapping of what the store holds, hashed in place, READ-ONLY and not copied."""
        view = self.written.pop(path, None)
        if view is None or (max_bytes is not None and view.nbytes > max_bytes):
            self.wait_acked()
            return super().read(path, on_chunk=on_chunk, max_bytes=max_bytes)
        return hash_in_place(view, on_chunk) if on_chunk is not None else copy_out(view, None)

    def _write_each(self, items) -> None:
        self.batching = True
        try:
            super().write_many_atomic(items)
        finally:
            self.batching = False
            self.push()

    def push(self) -> None:
        """Start copying the files written since the last push into the stores of ``push_to`` (one call each,
        announced first)."""
        paths, self.unpushed = self.unpushed, []
        if paths:
            here = self.store_of(self.node_id)
            for node in self.push_to:
                handle = self.store_of(node)
                self.expecting.append(handle.expect.remote(paths))
                self.pushing.append((paths, node, handle.fetch.remote(paths, [here], True), None))
            self.wait_expected()

    def wait_pushed(self, timeout: float | None = None) -> int:
        """Wait for the copies and commits in flight (``timeout`` seconds at most, 0: only those done); returns the
        bytes they moved (a failed copy is logged, not raised: the workers of that node place the file)."""
        import ray

        self.wait_acked()
        self.wait_expected()
        send_vouching(self)  # (a rank that writes no manifest: what it read back, and the refs let go)
        moved, pending, self.written, self.lent = 0, self.pushing, {}, {}
        if not pending:
            return 0
        refs = [ref for _p, _n, ref, _s in pending]
        done, _rest = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        done = set(done)
        self.pushing = [entry for entry in pending if entry[2] not in done]
        for paths, node, ref, size in pending:  # size: of a ``put_replica`` (True: taken), else bytes moved
            if ref not in done:
                continue
            try:
                got = ray.get(ref)
                got = got if size is None else size * bool(got)
                moved += got
                self.placed[node] = self.placed.get(node, 0) + got
            except Exception as exc:  # that store is full or gone: its workers place (or read remotely)
                log.warning(
                    "policy versions: %d files (%s...) not placed on node %s at publish (%s); its workers "
                    "will place them",
                    len(paths),
                    paths[0],
                    node[:12],
                    str(exc)[:300],
                )
        self.pushed_bytes += moved
        return moved

    def stores(self) -> dict:
        """The live stores; during a publish or a pull (``hold_listing``), the listing taken when it began: either
        asks every store several times (stats, sweeps; pins, placement) and a store started meanwhile holds nothing
        of older versions."""
        listing = self.listing  # (read once: another thread may end its hold meanwhile)
        return super().stores() if listing is None else dict(listing)

    def hold_listing(self, on: bool) -> None:
        """Begin (True) or end a publish, the retention after it, or a worker's pull: the listing of stores is held
        meanwhile, and dedup objects removed by retention's sweep are collected and go at the end, all at once
        (one call per store: ``wait_removed``)."""
        if not on:
            self.wait_removed()
        self.listing = super().stores() if on else None

    def remove(self, path: str) -> None:
        if self.listing is None or not path.startswith("objects/"):  # a snapshot's files: in order, as always
            return super().remove(path)
        self.removing.append(check_relpath(path))

    def wait_removed(self) -> None:
        """Remove the objects the sweep collected from every store of the held listing, one call each, and wait."""
        paths, self.removing = self.removing, []
        if paths and self.listing:
            self.changed()
            self.each("remove_many", paths, stores=self.listing)

    def subscriber_nodes(self, inventory: dict | None = None) -> list[str]:
        """Nodes where a rollout worker pulled versions and whose store is alive (one call per store; none when
        given ``inventory``, what :meth:`inventory` of the stores answered)."""
        held = self.inventory(SUBSCRIBERS) if inventory is None else inventory
        return sorted(node for node, files in held.items() if f"{SUBSCRIBERS}/{node}" in files)


def contiguous_spans(views: list[memoryview]) -> tuple[list, list[tuple[int, int, int]]]:
    """The buffers to put for ``views`` (byte views, in order), and where each view is in them: ``(buffer, start,
    size)`` (``actors/_memory/reads.py`` ``item_of``). Views of one exporter (a tensor's chunks) that lie next to
    each other in its memory make one buffer, a slice of that exporter (nothing copied): ``ray.put`` copies a list
    of 8 arrays of 8 MiB with more work than one of 64 MiB (its parallel copy starts its threads for each array;
    ``benchmarks/ray_put_shape.py``). Any other view is a buffer of its own."""
    import numpy as np

    def located(view: memoryview):  # (the exporter as bytes, the view's offset in it), or None
        try:
            whole = np.frombuffer(memoryview(view.obj).cast("B"), dtype=np.uint8)
        except (TypeError, ValueError):  # not a contiguous exporter
            return None
        start = np.frombuffer(view, dtype=np.uint8).ctypes.data - whole.ctypes.data
        return (whole, start) if 0 <= start and start + view.nbytes <= whole.nbytes else None

    runs: list[list] = []  # [the exporter, its bytes (None: the view alone), start, end, the first view]
    where: list[tuple[int, int, int]] = []
    for view in views:
        found = located(view) if view.nbytes else None
        last = runs[-1] if runs else None
        if found is not None and last is not None and last[1] is not None and last[0] is view.obj:
            if last[3] == found[1]:  # right after the run's last view, in the same exporter
                where.append((len(runs) - 1, found[1] - last[2], view.nbytes))
                last[3] = found[1] + view.nbytes
                continue
        whole, start = found if found is not None else (None, 0)
        runs.append([view.obj, whole, start, start + view.nbytes, view])
        where.append((len(runs) - 1, 0, view.nbytes))
    spans = [
        whole[start:end] if whole is not None else np.frombuffer(view, dtype=np.uint8)
        for _obj, whole, start, end, view in runs
    ]
    return spans, where


def send_vouching(storage: VersionsStorage) -> None:
    """Tell this node's store which borrowed chunks the read-back found whole (``MemoryStore.vouch``; after
    ``wait_acked``: it took them): its readers then take them without hashing them again. Awaited (one small call
    per commit; the store's calls run on threads): a pull after the commit finds them vouched for. A store that
    died meanwhile holds none of them: nothing to tell."""
    import ray

    vouching, storage.vouching = storage.vouching, []
    if vouching:
        try:
            ray.get(storage.store_of(storage.node_id).vouch.remote(vouching))
        except ray.exceptions.RayActorError:
            storage.forget(storage.node_id)


def acked(storage: VersionsStorage) -> None:
    """Wait for ``storage``'s node store to have taken the batches borrowed since the last wait; a store that died
    meanwhile is replaced and asked again, a store's refusal (e.g. its budget) is raised (before any commit)."""
    import ray

    pending, storage.acking = storage.acking, []
    for ref, batch, peers in pending:
        try:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:  # the store of this node died: a new one takes the batch
                storage.forget(storage.node_id)
                ray.get(storage.store_of(storage.node_id).borrow_many.remote(batch, peers))
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            raise (
                cause
                if isinstance(cause, StorageError)
                else StorageError(f"cannot write {len(batch)} files to {storage.url}: {exc}", path=batch[0][0])
            ) from None


def vouched_paths(path: str, data: bytes) -> list[str] | None:
    """The files the manifest at ``path`` (``data``) vouches for: its snapshot's files and the objects it references
    (None if it cannot be parsed: then no target is told to commit it, its workers place it when they pull)."""
    from rl_ckpt._format.manifest import Manifest
    from rl_ckpt._run.dedup import manifest_objects, object_path

    sid = path.split("/", 1)[0]
    try:
        manifest = Manifest.from_bytes(data, sid)
        objects = manifest_objects(manifest)
    except CheckpointError as exc:
        log.warning("policy versions: %s not placed (%s)", path, exc)
        return None
    files = [f"{sid}/{f.path}" for f in manifest.files]
    out = dict.fromkeys(files + [object_path(algo, d) for d, (algo, _n) in objects.items()])
    out.pop(path, None)
    return list(out)
