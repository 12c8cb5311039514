"""One view of a run's snapshots across the memory tier and durable storage.

A snapshot is in the memory tier when its manifest is committed there and
every file it names is held, at the right size, by at least one live memory
store; it is *replicated* when every file is held on at least ``1 + replicas``
nodes (never with ``replicas == 0``). Stores report what they hold (``inventory``: node id -> {path: size}),
so a store killed or a node lost removes exactly the copies it held: a
snapshot whose last copy of some file went with it leaves the memory tier
(``drop_incomplete`` then retires its manifest there, so no reader lists it).
"""

from __future__ import annotations

import dataclasses
import logging

from rl_ckpt.errors import CheckpointError
from rl_ckpt._format.manifest import MANIFEST_NAME, Manifest, parse_snapshot_id
from rl_ckpt._run.catalog import Catalog
from rl_ckpt._run.delete import delete_snapshot
from rl_ckpt._storage import Storage, join

log = logging.getLogger("rl_ckpt")

MEMORY = "memory"
DURABLE = "durable"
MEMORY_BASE = "raymem://mem"  # a run's memory tier is raymem://mem/<run_name>


def memory_options(config, namespace: str = "rl_ckpt") -> dict:
    """The ``raymem://`` storage options a run's config implies (replicas, per-node budget, stores' namespace)."""
    return {"replicas": config.memory_replicas, "budget_bytes": config.memory_budget_bytes, "namespace": namespace}


def memory_config(config):
    """The config of a run's memory tier: the same run, stored in ``raymem://mem/<run_name>``, no dedup (the
    tier keeps whole snapshots), and at least ``memory_flush_every`` memory snapshots kept (the flush of every
    K-th one comes due when K of them are newer than durable storage's newest)."""
    keep = max(config.keep_latest, config.memory_flush_every or 0)
    return config.replace(base_dir=MEMORY_BASE, dedup=False, storage_options={}, keep_latest=keep)


@dataclasses.dataclass
class TierStatus:
    """Where one snapshot lives."""

    snapshot_id: str
    global_step: int
    kind: str
    tiers: list[str]  # "memory" and/or "durable"
    memory_nodes: list[str] = dataclasses.field(default_factory=list)  # nodes holding any of its files in memory
    copies: int = 0  # fewest live memory copies of any of its files (0: incomplete in memory)
    missing: list[str] = dataclasses.field(default_factory=list)  # files of its memory manifest no store holds
    replicated: bool = False

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def memory_status(manifest: Manifest, inventory: dict[str, dict[str, int]], replicas: int) -> TierStatus:
    """How completely the live stores (``inventory``) hold the memory snapshot ``manifest`` describes."""
    sid = manifest.snapshot_id
    nodes, missing, fewest = set(), [], None
    for path in [*(join(sid, f.path) for f in manifest.files), join(sid, MANIFEST_NAME)]:
        want = next((f.size for f in manifest.files if join(sid, f.path) == path), None)
        holders = [n for n, files in inventory.items() if path in files and (want is None or files[path] == want)]
        nodes.update(holders)
        if not holders:
            missing.append(path[len(sid) + 1 :])
        fewest = len(holders) if fewest is None else min(fewest, len(holders))
    copies = fewest or 0
    tiers = [MEMORY] if not missing else []
    return TierStatus(
        sid,
        manifest.global_step,
        manifest.kind,
        tiers,
        sorted(nodes),
        copies,
        missing,
        not missing and replicas > 0 and copies >= 1 + replicas,
    )


def tier_view(
    memory: Catalog | None,
    inventory: dict[str, dict[str, int]] | None,
    durable: Catalog | None,
    replicas: int = 1,
    *,
    refresh: bool = True,
) -> list[TierStatus]:
    """Every snapshot of the run in either tier, oldest first, with the tiers that hold it."""
    out: dict[str, TierStatus] = {}
    if memory is not None and inventory is not None:
        if refresh:
            memory.refresh()
        for info in memory.snapshots():
            if info.manifest is not None:
                out[info.snapshot_id] = memory_status(info.manifest, inventory, replicas)
    if durable is not None:
        if refresh:
            durable.refresh()
        for info in durable.snapshots():
            status = out.get(info.snapshot_id)
            if status is None:
                out[info.snapshot_id] = TierStatus(info.snapshot_id, info.global_step, info.kind, [DURABLE])
            else:
                status.tiers.append(DURABLE)
    return sorted(out.values(), key=lambda s: parse_snapshot_id(s.snapshot_id) or (s.global_step, 0, s.kind))


def drop_incomplete(memory: Storage, view: list[TierStatus]) -> list[str]:
    """Retire the memory manifests of snapshots that lost the last copy of a file; returns their ids."""
    dropped = []
    for status in view:
        if status.missing:
            try:
                delete_snapshot(memory, status.snapshot_id)
                dropped.append(status.snapshot_id)
                log.warning(
                    "memory tier: %s lost %s with its store (no replica survived): dropped from memory",
                    status.snapshot_id,
                    ", ".join(status.missing[:3]),
                )
            except CheckpointError as exc:
                log.warning("memory tier: could not drop incomplete %s: %s", status.snapshot_id, exc)
    return dropped
