"""``WeightSubscriber``: a rollout worker's side of policy versions (see ``actors/policy_versions.py``).

``pull(module, version="latest")``:

1. finds the version among the committed ones in the run's version stores (no call to the learners: a
   worker that joins or restarts asks the stores); an unknown or retired version is a
   :class:`VersionNotFoundError` naming it and the newest available;
2. reads its manifest (self-checksummed) and works out the pieces of the policy (content-addressed chunks);
3. pins the files it will read in every store (retention and budget leave them alone until it is done, or
   until its lease ends if the worker dies);
4. places the version on this node: the node's store copies the files it lacks from a peer store, once for
   however many workers on the node ask at the same time (usually nothing: a worker's first pull announces
   its node, ``subscribers/<node>``, and publishers place every later version there as they write it);
5. hashes every piece that changed since the version it holds, in this node's shared memory, and only when
   every one verified copies them into the module (:class:`~rl_ckpt._sharded.weight_pull.WeightPuller`).

A piece that fails its checksum is never loaded: the module keeps what it held, the fault is logged and
recorded in the stores (``versions_status`` and the manager's ``/healthz`` show it), and the worker falls
back to the newest older version that verifies, then to the run's durable snapshots when given
(``durable=``); the result says which it holds and why.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import uuid
from typing import Any

import torch

from rl_ckpt.errors import CheckpointError, CorruptSnapshotError, NoValidSnapshotError, StorageError
from rl_ckpt._format.manifest import parse_snapshot_id
from rl_ckpt._run.snapshot_files import read_manifest
from rl_ckpt._sharded.weight_pull import WeightPuller, component_pieces

from ._memory.storage import local_views
from ._versions.storage import SUBSCRIBERS
from ._versions.held import COMPONENT, FAULTS, not_found, published, versions_storage

log = logging.getLogger("rl_ckpt")


class _Gone(Exception):
    """The version was retired between the listing and the pin (retention, not a fault)."""


@dataclasses.dataclass
class PullResult:
    """What a pull left in the module and what it cost."""

    version: int  # the version the module holds now (the learners' step)
    snapshot_id: str
    source: str  # "memory" (the version stores) or "durable" (the fallback)
    bytes_moved: int  # bytes of the pieces that changed and were copied into the module
    bytes_total: int  # bytes of the whole policy
    node_bytes_copied: int  # bytes this call had copied to this node's store (0 when already there)
    seconds: float
    place_seconds: float = 0.0  # of ``seconds``: copying the version to this node's store
    fell_back_from: int | None = None  # the version asked for, when a fault made the worker take another
    reason: str = ""
    bytes_vouched: int = 0  # of ``bytes_moved``: chunks this node's store had checked already (not hashed again)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class WeightSubscriber:
    """Pulls policy versions of run ``run_name`` into modules (see the module docstring).

    Args:
        run_name: the run whose versions to pull.
        durable: where to fall back when no version in memory verifies: ``{"base_dir", "run_name",
            "storage_options"}`` of the run's durable snapshots (their ``key`` component), or None.
        lease_seconds: how long a pin outlives a worker that died while reading.
        placement: copy versions to this node's store before reading (False: read from wherever they are).
        budget_bytes: the memory budget of this node's version store when this worker is the one creating it
            (as ``PolicyVersions``'; a placement that does not fit is skipped and the version read from its peers).
    """

    def __init__(
        self,
        run_name: str,
        *,
        key: str = COMPONENT,
        namespace: str = "rl_ckpt",
        durable: dict | None = None,
        lease_seconds: float = 300.0,
        placement: bool = True,
        budget_bytes: int | None = None,
    ) -> None:
        self.run_name = run_name
        self.key = key
        self.storage = versions_storage(run_name, namespace=namespace, replicas=0, budget_bytes=budget_bytes)
        self.durable = durable
        self.lease_seconds = lease_seconds
        self.placement = placement
        self.holder = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._pullers: dict[int, WeightPuller] = {}
        self.version: int | None = None
        self.faults: list[dict] = []
        self._announced = False

    def versions(self) -> list[int]:
        """Versions published and not retired, oldest first."""
        return list(published(self.storage))

    def latest(self) -> int:
        """The newest version (VersionNotFoundError when none is published)."""
        available = self.versions()
        if not available:
            raise not_found(self.run_name, "latest", [])
        return available[-1]

    def puller(self, module: torch.nn.Module) -> WeightPuller:
        puller = self._pullers.get(id(module))
        if puller is None or puller.module is not module:
            puller = self._pullers[id(module)] = WeightPuller(module, self.key)
        return puller

    def pull(self, module: torch.nn.Module, version: int | str = "latest", *, _tries: int = 3) -> PullResult:
        """Make ``module`` hold ``version`` ("latest" or a version number); returns what it holds and the cost."""
        # One listing of the stores for the whole pull (the versions published, then the read: manifest, pins,
        # placement, unpin), not one per step; taken again if this node's store started meanwhile.
        self.storage.hold_listing(True)
        try:
            return self._pull(module, version, _tries)
        finally:
            self.storage.hold_listing(False)

    def _pull(self, module: torch.nn.Module, version: int | str, _tries: int) -> PullResult:
        started = time.monotonic()
        available = published(self.storage)
        if version == "latest":
            if not available:
                raise not_found(self.run_name, version, [])
            target = max(available)
        elif isinstance(version, int) and not isinstance(version, bool) and version in available:
            target = version
        else:
            raise not_found(self.run_name, version, list(available))
        puller = self.puller(module)
        if self.placement and not self._announced:
            self._announce()
        reasons: dict[str, str] = {}
        for step in [s for s in sorted(available, reverse=True) if s <= target]:
            sid = available[step]
            try:
                stats, copied, placed = self._pull_version(puller, sid)
            except _Gone:
                if version == "latest" and _tries > 1:  # a newer one was published meanwhile: take that
                    return self.pull(module, version, _tries=_tries - 1)
                if step == target:
                    raise not_found(self.run_name, version, list(published(self.storage))) from None
                continue
            except (CorruptSnapshotError, StorageError) as exc:
                reasons[sid] = str(exc)
                self._fault(sid, exc, target)
                continue
            return self._done(
                PullResult(
                    step,
                    sid,
                    "memory",
                    stats.bytes_moved,
                    stats.bytes_total,
                    copied,
                    time.monotonic() - started,
                    placed,
                    None if step == target else target,
                    "" if step == target else _why(reasons),
                    stats.bytes_vouched,
                )
            )
        if self.durable is not None:
            sid, stats = self._pull_durable(puller, reasons)
            step = parse_snapshot_id(sid)[0]
            return self._done(
                PullResult(
                    step,
                    sid,
                    "durable",
                    stats.bytes_moved,
                    stats.bytes_total,
                    0,
                    time.monotonic() - started,
                    0.0,
                    target,
                    _why(reasons),
                )
            )
        raise NoValidSnapshotError(
            f"no policy version of run {self.run_name!r} up to {target} could be loaded and "
            f"no durable fallback is configured; {_why(reasons)}. The module keeps what it "
            "held",
            reasons=reasons,
        )

    def _announce(self) -> None:
        """Tell the publishers this node pulls versions (``subscribers/<node>`` in this node's store): they place
        every new version here as they write it, so a pull finds it on its node."""
        node = self.storage.node_id
        try:
            self.storage.write(f"{SUBSCRIBERS}/{node}", [json.dumps({"node": node, "since": time.time()}).encode()])
            self._announced = True
        except CheckpointError as exc:  # no room: the versions are placed by the pulls instead
            log.warning(
                "policy versions of %s: node %s not announced to the publishers (%s)", self.run_name, node[:12], exc
            )

    def _done(self, result: PullResult) -> PullResult:
        self.version = result.version
        if result.fell_back_from is not None:
            log.warning(
                "policy version %s of run %s could not be loaded; holding %s from %s instead: %s",
                result.fell_back_from,
                self.run_name,
                result.version,
                result.source,
                result.reason,
            )
        return result

    def _pull_version(self, puller: WeightPuller, sid: str):
        if self.storage.node_id not in (self.storage.listing or {}):  # this node's store is pinned with the others
            self.storage.hold_listing(True)
        try:
            manifest = read_manifest(self.storage, sid)
        except CorruptSnapshotError:  # also what an unreadable (e.g. just removed) manifest gives
            if sid not in published(self.storage).values():
                raise _Gone(sid) from None
            raise
        pieces = component_pieces(manifest, self.key)
        paths = pieces.paths()
        if not any(self.storage.each("pin", sid, self.holder, paths, self.lease_seconds).values()):
            self.storage.each("unpin", sid, self.holder)
            raise _Gone(sid)
        try:
            copied, placing = 0, time.monotonic()
            if self.placement:
                try:
                    copied = fetch_here(self.storage, paths)
                except CheckpointError as exc:  # e.g. no room on this node: read from the peers instead
                    log.warning("policy version %s not placed on this node (%s); reading it from its stores", sid, exc)
            placed = time.monotonic() - placing
            todo = {path for piece in puller.needed(pieces) for path in piece.paths(pieces.algo)}
            vouched: set[str] = set()  # chunks the publisher read back whole, as the object mapped here: not hashed
            views = local_views(self.storage, sorted(todo), vouched)
            return puller.pull(self.storage, manifest, pieces, views=views, vouched=vouched), copied, placed
        finally:
            try:
                self.storage.each("unpin", sid, self.holder)
            except Exception as exc:  # the lease runs out by itself
                log.warning("could not unpin %s: %s", sid, exc)

    def _pull_durable(self, puller: WeightPuller, reasons: dict[str, str]):
        from rl_ckpt._run.catalog import Catalog
        from rl_ckpt._storage import open_storage

        d = self.durable
        storage = open_storage(f"{d['base_dir'].rstrip('/')}/{d['run_name']}", d.get("storage_options") or {})
        catalog = Catalog(storage)
        catalog.refresh()
        for info in reversed(catalog.snapshots("full", usable=True)):
            if info.manifest is None or self.key not in info.manifest.components:
                continue
            try:
                return info.snapshot_id, puller.pull(storage, info.manifest)
            except (CorruptSnapshotError, StorageError) as exc:
                reasons[f"durable:{info.snapshot_id}"] = str(exc)
        raise NoValidSnapshotError(
            f"no policy version of run {self.run_name!r} and no durable snapshot could be "
            f"loaded: {_why(reasons)}. The module keeps what it held",
            reasons=reasons,
        )

    def _fault(self, sid: str, exc: Exception, asked: int) -> None:
        record = {
            "time": time.time(),
            "run": self.run_name,
            "snapshot_id": sid,
            "asked": asked,
            "holder": self.holder,
            "node": self.storage.node_id,
            "error": str(exc)[:500],
            "path": getattr(exc, "path", None),
        }
        self.faults.append(record)
        del self.faults[:-50]
        log.warning("policy version %s of run %s not loaded: %s", sid, self.run_name, exc)
        try:
            self.storage.write(f"{FAULTS}/{time.time_ns():020d}-{self.holder}.json", [json.dumps(record).encode()])
        except CheckpointError as e:
            log.warning("could not record the fault of %s in the version stores: %s", sid, e)

    def status(self) -> dict:
        """This worker's view: the version it holds and the faults it met (newest last)."""
        return {
            "version": self.version,
            "holder": self.holder,
            "faults": list(self.faults[-10:]),
            "status": "degraded" if self.faults else "ok",
        }


def fetch_here(storage, paths: list[str]) -> int:
    """Copy ``paths`` this node's store lacks into it from the run's other live stores; returns bytes copied."""
    import ray

    others = [h for n, h in sorted(storage.stores().items()) if n != storage.node_id]
    return ray.get(storage.store_of(storage.node_id).fetch.remote(list(paths), others))


def _why(reasons: dict[str, Any]) -> str:
    return "; ".join(v if v.startswith(k) else f"{k}: {v}" for k, v in reasons.items())[:2000] or "no reason recorded"
