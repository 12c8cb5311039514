"""Policy versions: the learners publish their policy weights into the memory tier; rollout workers pull them.

    # learners (every rank of an FSDP2 group calls it; with replicated learners rank 0 writes, the rest skip)
    versions = PolicyVersions("grpo", model, dtype=torch.bfloat16)
    versions.publish(step)

    # a rollout worker, on any node
    sub = WeightSubscriber("grpo")
    result = sub.pull(policy)                      # "latest", or a version number (the learners' step)
    result.version, result.bytes_moved             # what it holds now; what moved (only changed chunks)

A version is a snapshot of one component (``policy``) in the run's version stores (``raymem://versions/
<run>``, a ``MemoryStore`` per node): the same manifest, per-chunk checksums, verify-after-write and
create-only commit as any snapshot, written by a ``CheckpointEngine`` with ``dedup`` on, so each tensor's
8 MiB chunks are content-addressed objects and versions share what did not change. Retention keeps the
newest ``keep`` versions; a version a worker is reading is pinned and stays until it lets go. A publish
places the version on the nodes where workers pull as it writes it (:class:`VersionsStorage`), so their
pulls find it on their node.

``publish`` returns once the version is committed in the publisher's node's store, not once its placement
has landed: the transfers to the other nodes overlap the workers' pulls. A store never holds a manifest
whose files it does not hold: each placement target commits the version itself once every file it vouches
for has landed there (``MemoryStore.commit_after``), and a worker pulling there meanwhile waits for the
announced files instead of copying them again (``MemoryStore.expect``). ``wait_placed`` waits for the
placements, ``wait_owned`` for the stores' own copies too. A publisher killed before its placement landed
leaves the targets without the manifest; their workers then take the version from the publisher's node
whole (checksummed) or fall back to the previous one, never a partial module.

Publishing cast (``dtype=torch.bfloat16``) writes the floating-point tensors in that dtype and records it
in the manifest's tags (``policy_dtype``); the learners' fp32 state stays theirs (and in their snapshots).
The pulling side is :class:`~actors.weight_subscriber.WeightSubscriber`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rl_ckpt.errors import CheckpointError, ConfigError, StorageError, VersionNotFoundError
from rl_ckpt._format.manifest import MANIFEST_NAME, parse_snapshot_id
from rl_ckpt._storage.base import check_relpath

from ._memory_storage import RayMemoryStorage, copy_out, hash_in_place, spread_manifest

log = logging.getLogger("rl_ckpt")

VERSIONS_BASE = "raymem://versions"
COMPONENT = "policy"
INLINE_BYTES = 256 << 10  # smaller files travel inside the call (as RayMemoryStorage.write's)


SUBSCRIBERS = "subscribers"  # subscribers/<node id>: a rollout worker pulls versions on that node


class VersionsStorage(RayMemoryStorage):
    """The version stores of a run, seen from a writer that also *places* what it writes.

    ``push_to`` (node ids, set by :meth:`PolicyVersions.publish` to the nodes where rollout workers pull):
    every file written is also copied, store to store, into those nodes' stores (``MemoryStore.borrow`` /
    ``put_replica`` / ``fetch``, started as the file is written, so the transfers run while the publish goes on
    writing and verifying), announced there first (``MemoryStore.expect``: a worker's pull there waits for them
    rather than copying them a second time).

    A manifest is committed in this node's store (and copied to its ``replicas`` peers) WITHOUT waiting for those
    transfers: the write returns then. Each placement target gets it with the files it vouches for
    (``MemoryStore.commit_after``) and stores it only once every one of them is held there, so a store never
    holds a manifest whose files it does not hold; a target where a file failed to land keeps no manifest, and
    its workers place the version when they pull. :meth:`wait_pushed` waits for the transfers and those commits.
    """

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        super().__init__(url, storage_options)
        self.push_to: list[str] = []
        self.pushing: list = []  # (paths, node, ref of that node's store's call, size or None) in flight
        self.expecting: list = []  # refs of ``expect`` calls to the placement targets (waited for before a commit)
        self.unpushed: list[str] = []
        self.batching = False
        self.written: dict[str, memoryview] = {}  # path -> what its store held right after the write (unread)
        self.listing: dict | None = None
        self.removing: list = []  # refs of object removals in flight (during a publish)
        self.pushed_bytes = 0
        self.placed: dict[str, int] = {}  # node -> bytes this writer placed in its store (``pushed_bytes`` in all)

    def write(self, path: str, chunks, *, create_only: bool = False, durable: bool = True) -> int:
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
        targets = [(node, self.store_of(node)) for node in self.push_to]
        self.expecting += [handle.expect.remote([path]) for _n, handle in targets]
        self.wait_expected()
        try:
            size = super().write(path, [data], create_only=create_only, durable=durable)
        except BaseException:
            self.expecting += [handle.expect.remote([path], 0) for _n, handle in targets]  # it is not coming
            raise
        if vouched is not None:
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
        """Many files (a publish's new chunks) at once: each put once into this node's object store and handed
        from there to this node's store and to those of ``push_to`` together (their calls run concurrently: the
        copies to other nodes start as the file lands, not after the batch), not one round trip after another."""
        import numpy as np
        import ray

        items = [(check_relpath(path), memoryview(data).cast("B")) for path, data in items]
        self.written = {}
        if any(path.endswith("/" + MANIFEST_NAME) for path, _d in items):
            return self._write_each(items)  # commits: the base's, one by one
        store = self.store_of(self.node_id)
        peers = [self.store_of(n) for n in self.peers(self.node_id)]  # ``replicas``: copied in the background
        targets = [(node, self.store_of(node)) for node in self.push_to]
        self.expecting += [handle.expect.remote([path for path, _d in items]) for _n, handle in targets]
        refs, lent = [], {}  # lent: path -> (the object put here, that the stores borrow; its size)
        for path, data in items:
            if data.nbytes <= INLINE_BYTES:  # a small file travels inside the call; each store keeps its bytes
                obj = bytes(data)
                refs.append(store.put.remote(path, obj, False, peers))
                for node, handle in targets:
                    ref = handle.put_replica.remote(path, obj, self.node_id)
                    self.pushing.append(([path], node, ref, data.nbytes))
                continue
            # One copy into this node's object store, borrowed by this node's store and the placement targets (the
            # ref inside a list: Ray does not resolve it): no store copies it now (a target moves it to its node),
            # each owns a copy of its own in the background (``MemoryStore.borrow``, ``PolicyVersions.wait_owned``).
            obj = [ray.put(np.frombuffer(data, dtype=np.uint8))]
            lent[path] = (obj[0], data.nbytes)
            for node, handle in targets:  # the transfers start now, chunk by chunk
                ref = handle.borrow.remote(path, obj, data.nbytes, (), True, True)
                self.pushing.append(([path], node, ref, data.nbytes))
        if lent:  # this node's store: no transfer, one call for the batch
            refs.append(store.borrow_many.remote([(p, ref, n) for p, (ref, n) in lent.items()], peers))
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
        small = [path for path, _d in items if path not in lent]
        answers = ray.get(store.get_many.remote(small)) if small else []
        refs = [(path, got[0]) for path, got in zip(small, answers) if isinstance(got, list)]
        refs += [(path, ref) for path, (ref, _n) in lent.items()]
        self.written = {
            path: memoryview(got).cast("B").toreadonly() for path, got in zip(small, answers) if isinstance(got, bytes)
        }
        self.written.update(
            (path, memoryview(data).cast("B").toreadonly())
            for (path, _r), data in zip(refs, ray.get([r for _p, r in refs]))
        )

    def read(self, path: str, *, on_chunk=None, max_bytes: int | None = None):
        """As the base's (a fresh writable copy, hashed as it fills), but for the read-back that verifies a file
        :meth:`write_many_atomic` just wrote (the first read of it, with ``on_chunk``): that one gets the
        mapping of what the store holds, taken right after the write, hashed in place, READ-ONLY and not copied
        (its reader, the write's verification, only hashes it)."""
        view = self.written.pop(path, None)
        if view is None or (max_bytes is not None and view.nbytes > max_bytes):
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

    def wait_pushed(self, timeout: float | None = None) -> int:
        """Wait for the copies and commits in flight (``timeout`` seconds at most: those not done stay in flight;
        0: only take those done); returns the bytes they moved (a failed copy is logged, not raised: the workers
        of that node place the file when they pull)."""
        import ray

        self.wait_expected()
        moved, pending, self.written = 0, self.pushing, {}
        if not pending:
            return 0
        refs = [ref for _p, _n, ref, _s in pending]
        done, _rest = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        done = set(done)
        self.pushing = [entry for entry in pending if entry[2] not in done]
        for paths, node, ref, size in pending:  # size: of a ``put_replica`` or ``borrow`` (True: taken), else a count
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
        """The live stores; during a publish (``hold_listing``), the listing taken when it began: a publish asks
        every store several times (stats, sweeps) and a store started meanwhile holds nothing of older versions."""
        if self.listing is None:
            return super().stores()
        return dict(self.listing)

    def hold_listing(self, on: bool) -> None:
        """Begin (True) or end a publish: the listing of stores is held meanwhile, and dedup objects removed by
        retention's sweep go in the background, all at once, waited for when the publish ends."""
        if not on:
            self.wait_removed()
        self.listing = super().stores() if on else None

    def remove(self, path: str) -> None:
        if self.listing is None or not path.startswith("objects/"):  # a snapshot's files: in order, as always
            return super().remove(path)
        path = check_relpath(path)
        self.removing += [h.remove.remote(path) for h in self.listing.values()]

    def wait_removed(self) -> None:
        import ray

        refs, self.removing = self.removing, []
        for ref in refs:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:  # that store died: nothing left there to remove
                pass

    def subscriber_nodes(self, inventory: dict | None = None) -> list[str]:
        """Nodes where a rollout worker pulled versions and whose store is alive (one call per store; none when
        given ``inventory``, what :meth:`inventory` of the stores answered)."""
        held = self.inventory(SUBSCRIBERS) if inventory is None else inventory
        return sorted(node for node, files in held.items() if f"{SUBSCRIBERS}/{node}" in files)


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


def versions_storage(
    run_name: str,
    *,
    namespace: str = "rl_ckpt",
    replicas: int = 1,
    budget_bytes: int | None = None,
    node_id: str | None = None,
) -> VersionsStorage:
    """The ``raymem://`` storage of run ``run_name``'s policy versions (its stores are created on first write)."""
    opts: dict[str, Any] = {"namespace": namespace, "replicas": replicas, "budget_bytes": budget_bytes}
    if node_id is not None:
        opts["node_id"] = node_id
    return VersionsStorage(f"{VERSIONS_BASE}/{run_name}", opts)


def published(storage: RayMemoryStorage, inventory: dict | None = None) -> dict[int, str]:
    """Committed versions in any live store: version (step) -> snapshot id, oldest first (one call per store;
    none when given ``inventory``, what ``storage.inventory("")`` answered)."""
    sids = set()
    for files in (storage.inventory("") if inventory is None else inventory).values():
        for path in files:
            sid, _, rest = path.partition("/")
            parsed = parse_snapshot_id(sid)
            if rest == MANIFEST_NAME and parsed is not None and parsed[2] == "full":
                sids.add(sid)
    by_step: dict[int, str] = {}
    for sid in sorted(sids, key=parse_snapshot_id):
        by_step[parse_snapshot_id(sid)[0]] = sid  # a later branch of the same step wins
    return dict(sorted(by_step.items()))


def not_found(run_name: str, version: Any, available: list[int]) -> VersionNotFoundError:
    newest = available[-1] if available else None
    what = (
        "no policy version is published yet"
        if not available
        else (f"newest available: {newest} (available: {', '.join(map(str, available[-8:]))})")
    )
    return VersionNotFoundError(
        f"policy version {version!r} of run {run_name!r} is unknown or retired; {what}. "
        "Ask for 'latest' or one of those",
        version=version,
        newest=newest,
        available=list(available),
    )


class CastPolicy:
    """The module's state with its floating-point tensors cast to ``dtype`` (publishing only)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        self.module = module
        self.dtype = dtype

    def state_dict(self) -> dict:
        return {
            k: (v.detach().to(self.dtype) if v.is_floating_point() else v.detach())
            for k, v in self.module.state_dict().items()
        }

    def load_state_dict(self, state: dict) -> None:
        raise CheckpointError(
            "a cast policy version is published, never restored into the learners: their "
            "full-precision state is in their own snapshots"
        )


class PolicyVersions:
    """The learners' side: ``publish(step)`` makes the policy of that step a version (module docstring).

    Args:
        run_name: the run (its version stores are ``raymem://versions/<run_name>``).
        module: the policy: a plain module (replicated learners) or an FSDP2 one (every rank publishes its shards).
        keep: versions kept (older ones are retired after each publish, unless a worker pins them).
        replicas: peer stores each file is copied to as it is written (besides placement to pulling nodes).
        budget_bytes: per-store memory budget (a publish that does not fit is refused, nothing held is lost).
        dtype: publish floating-point tensors cast to this dtype (plain modules), recorded in the manifest.
        rank, world_size: this learner's place (default: torch.distributed's, else 0 of 1). With a plain
            module only rank 0 writes (the weights are the same on every rank).
        min_object_bytes: tensors from this size are content-addressed objects (smaller ones share a file).
    """

    def __init__(
        self,
        run_name: str,
        module: torch.nn.Module,
        *,
        keep: int = 4,
        replicas: int = 1,
        budget_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        namespace: str = "rl_ckpt",
        min_object_bytes: int = 0,
    ) -> None:
        from rl_ckpt._core.engine import CheckpointEngine
        from rl_ckpt._run.retention import KeepLatest
        from rl_ckpt._sharded.component import has_dtensors

        if keep < 1:
            raise ConfigError(f"PolicyVersions: keep={keep!r}; allowed: an integer >= 1", key="keep", allowed=">= 1")
        self.run_name = run_name
        self.sharded = has_dtensors(module.parameters())
        if dtype is not None and self.sharded:
            raise ConfigError(
                "PolicyVersions: dtype= casts plain modules; an FSDP2 module is published as it is "
                "sharded (give its params the dtype wanted, or publish from a plain copy)",
                key="dtype",
            )
        if not self.sharded:
            if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
                rank = torch.distributed.get_rank()
            rank, world_size = 0 if not rank else rank, 1  # one writer: the weights are the same on every rank
        self.rank = rank or 0
        self.dtype = dtype
        self.keep = keep
        self.storage = versions_storage(run_name, namespace=namespace, replicas=replicas, budget_bytes=budget_bytes)
        self.engine = None
        if self.sharded or self.rank == 0:
            self.engine = CheckpointEngine(
                base_dir=VERSIONS_BASE,
                run_name=run_name,
                storage=self.storage,
                retention=KeepLatest(keep),
                dedup=True,
                keep_latest=keep,
                keep_best=0,
                dedup_min_tensor_bytes=min_object_bytes,
                rank=rank,
                world_size=world_size,
            )
            self.engine.register(COMPONENT, CastPolicy(module, dtype) if dtype is not None else module)

    def publish(self, step: int, metrics: dict | None = None) -> str | None:
        """Publish the policy as version ``step`` (returns its snapshot id; None on a replicated rank that does
        not write). Returns once the version is written, verified and committed in this node's store: every
        reader sees it from then on, and it is whole wherever its manifest is. Its placement on the workers'
        other nodes may still be landing (their stores commit it once its files are there; a pull there
        meanwhile waits for them): :meth:`wait_placed` waits for that, :meth:`wait_owned` for everything."""
        if self.engine is None:
            return None
        # Versions kept past retention while a worker pinned them come back into view and are retired now,
        # before the new one needs room in the budget (retention also runs after the commit, as always).
        files = self.storage.inventory("")  # one listing of the stores for the versions held and the subscribers
        held = published(self.storage, files)
        if self.rank == 0 and len(held) > self.keep:  # (with none pinned, the last publish left ``keep``)
            self.engine.catalog.refresh()
            for warning in self.engine.maintenance.after_commit():
                log.warning("policy versions of %s: %s", self.run_name, warning)
            held = published(self.storage)
        if self.sharded:  # no rank reuses an object of a version rank 0 is retiring right now
            torch.distributed.barrier()
            self.engine.catalog.refresh()
            held = published(self.storage)
        if step in held:  # published already on this timeline (a restored step): the same weights
            return held[step]
        dtype = str(self.dtype).replace("torch.", "") if self.dtype else "as trained"
        tags = {"policy_version": step, "policy_dtype": dtype}
        # Placement at publish: the nodes where workers pull get each file as it is written (see VersionsStorage).
        here = [self.storage.node_id, *self.storage.peers()]  # (the ``replicas`` peers get copies anyway)
        self.storage.push_to = [n for n in self.storage.subscriber_nodes(files) if n not in here]
        self.storage.wait_pushed(0)  # the placements of earlier publishes that are done: counted, let go
        self.storage.hold_listing(True)
        try:
            info = self.engine.save(step, metrics, tags=tags)
        except BaseException:
            self.storage.wait_pushed()  # a save that failed leaves no copy in flight
            raise
        finally:
            self.storage.push_to = []
            self.storage.hold_listing(False)
        return info.snapshot_id

    def rewind(self, step: int) -> list[str]:
        """After the learners restored ``step``: retire the versions newer than it (they belong to the timeline
        that failed; the steps are published anew). Rank 0 does it; returns the snapshot ids retired."""
        from rl_ckpt._run.delete import delete_snapshot

        if self.engine is None or self.rank != 0:
            return []
        gone = [sid for v, sid in published(self.storage).items() if v > step]
        for sid in gone:
            delete_snapshot(self.storage, sid)
        self.engine.catalog.refresh()
        if gone:
            log.info("policy versions of %s: retired %s (newer than the restored step %d)", self.run_name, gone, step)
        return gone

    def wait_placed(self, timeout: float | None = None) -> bool:
        """Block until the placements of what was published have landed (or failed: logged, the workers of that
        node place the version when they pull) and each target committed or refused it; True when none is left
        in flight, False when ``timeout`` passed first."""
        self.storage.wait_pushed(timeout)
        return not self.storage.pushing

    def wait_owned(self, timeout: float | None = None) -> bool:
        """Block until the placements landed (:meth:`wait_placed`) and every store owns its copy of what was
        published (True: from then on the versions outlive this publisher), or ``timeout`` passed (False).
        ``publish`` returns before both: see ``VersionsStorage``."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.wait_placed(timeout):
            return False
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        return all(self.storage.each("wait_owned", left).values())

    def versions(self) -> list[int]:
        """The versions published and not retired, oldest first."""
        return list(published(self.storage))

    def status(self) -> dict:
        """Versions held, bytes per node, pins and the faults rollout workers reported (for /healthz)."""
        return versions_status(self.storage)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def versions_status(storage: RayMemoryStorage) -> dict:
    """What the run's version stores hold: versions, bytes per node, copies pulled in, pins, reported faults.
    (``fetched_bytes``: copies the workers' pulls placed; a publisher counts its own, ``VersionsStorage.placed``.)"""
    import json

    info = storage.store_info()
    faults = []
    paths = sorted({p for files in storage.inventory(FAULTS).values() for p in files})
    for path in paths[-20:]:
        try:
            faults.append(json.loads(bytes(storage.read(path))))
        except (CheckpointError, ValueError):
            continue
    pins = storage.each("pins") if info else {}
    return {
        "versions": list(published(storage)),
        "bytes_per_node": {n: i["bytes_held"] for n, i in info.items()},
        "fetched_bytes": {n: i.get("fetched_bytes", 0) for n, i in info.items()},
        "borrowed_bytes": {n: i.get("borrowed_bytes", 0) for n, i in info.items()},
        "lost": {n: i["lost"] for n, i in info.items() if i.get("lost")},
        "pinned": {n: p for n, p in pins.items() if p},
        "faults": sorted(faults, key=lambda f: f.get("time", 0))[-20:],
        "status": "degraded" if faults or any(i.get("lost") for i in info.values()) else "ok",
    }


FAULTS = "faults"
