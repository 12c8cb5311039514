"""What a run's policy-version stores hold, without torch (``/healthz`` asks for it from the manager's process):
their storage (``versions_storage``), the versions published (``published``) and their status for health
(``versions_status``). The publisher is ``actors.policy_versions``, the pulling side ``actors.weight_subscriber``."""

from __future__ import annotations

import json
from typing import Any

from rl_ckpt.errors import CheckpointError, VersionNotFoundError
from rl_ckpt._format.manifest import MANIFEST_NAME, parse_snapshot_id

from .._memory.storage import RayMemoryStorage
from .storage import VersionsStorage

VERSIONS_BASE = "raymem://versions"
COMPONENT = "policy"
FAULTS = "faults"  # faults/<...>: what rollout workers reported (a chunk failing its checksum, a fallback)


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


def versions_status(storage: RayMemoryStorage) -> dict:
    """What the run's version stores hold: versions, bytes per node, copies pulled in, pins, reported faults.
    (``fetched_bytes``: copies the workers' pulls placed; a publisher counts its own, ``VersionsStorage.placed``.)"""
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
        "lost_versions": {n: i["lost_versions"] for n, i in info.items() if i.get("lost_versions")},
        "pinned": {n: p for n, p in pins.items() if p},
        "faults": sorted(faults, key=lambda f: f.get("time", 0))[-20:],
        "status": "degraded" if faults or any(i.get("lost") for i in info.values()) else "ok",
    }
