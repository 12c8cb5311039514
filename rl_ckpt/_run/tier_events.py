"""The memory tier's trace in the durable run folder: ``memory_tier/`` records.

Memory snapshots live in the cluster's memory and vanish with it (evicted,
retired, or the cluster gone), so the memory tier writes one small create-only
JSON record per memory snapshot it commits (``snapshot-<id>.json``: step,
kind, time, metrics, size) and one per restore across tiers
(``<time>-restore-<tier>.json``: the tier and snapshot restored, and the
failure and decision it answered). Pictures and reports of a run
(``rl-ckpt timeline``, the demo) read them back as untrusted records.

Records are written by one participant of a snapshot; bodies are built only
from what every participant shares (the committed manifest, the plan), so a
second writer of the same record finds it already there (``RecordStore.add``).
"""

from __future__ import annotations

from typing import Any

from rl_ckpt._run.layout import MEMORY_TIER_EVENTS, timed_record_stem
from rl_ckpt._run.records import RecordStore
from rl_ckpt._storage import Storage

SNAPSHOT = "memory_snapshot"
RESTORE = "tier_restore"


def tier_event_records(storage: Storage) -> RecordStore:
    """The run's ``memory_tier/`` record folder."""
    return RecordStore(storage, MEMORY_TIER_EVENTS, "memory tier record")


def record_memory_snapshot(storage: Storage, info: Any) -> str:
    """Record the committed memory snapshot ``info`` (a ``SnapshotInfo``) in the durable run folder."""
    body = {
        "event": SNAPSHOT,
        "snapshot_id": info.snapshot_id,
        "global_step": info.global_step,
        "kind": info.kind,
        "created_at": info.created_at,
        "size_bytes": info.size_bytes,
        "metrics": _plain(info.metrics),
    }
    return tier_event_records(storage).add(f"snapshot-{info.snapshot_id}", body)


def record_tier_restore(
    storage: Storage, tier: str, snapshot_id: str, global_step: int, plan: Any, decision: Any = None
) -> str:
    """Record a restore across tiers: ``tier`` and the snapshot restored, with the failure and recovery decision
    it answered (``decision``: the durable manager's ``Decision``, or None) and the plan's time."""
    failure = decision.failure if decision is not None else getattr(plan, "failure", None)
    body = {
        "event": RESTORE,
        "tier": tier,
        "snapshot_id": snapshot_id,
        "global_step": global_step,
        "planned_at": plan.created_at,
        "decision_time": decision.time if decision is not None else None,
        "failure_step": failure.step if failure is not None else None,
        "failure_kind": str(failure.kind) if failure is not None else None,
    }
    return tier_event_records(storage).add(timed_record_stem(plan.created_at, f"restore-{tier}"), body)


def _plain(metrics: dict) -> dict:
    """Metrics a JSON record can hold (finite numbers, strings, bools); anything else is left out."""
    out = {}
    for k, v in metrics.items():
        finite = isinstance(v, (int, float)) and v == v and v not in (float("inf"), float("-inf"))
        if isinstance(v, (bool, str)) or finite:
            out[str(k)] = v
    return out


def load_tier_events(storage: Storage) -> tuple[list[dict], list[dict]]:
    """``(memory snapshots, restores)`` recorded in the run, each oldest first; records of the wrong shape are
    skipped (a planted or damaged file is data, never a crash)."""
    snaps: dict[str, dict] = {}
    restores = []
    for r in tier_event_records(storage).load():
        step = r.get("global_step")
        if type(step) is not int or not isinstance(r.get("snapshot_id"), str):
            continue
        if r.get("event") == SNAPSHOT and r.get("kind") in ("full", "light"):
            metrics = r.get("metrics") if isinstance(r.get("metrics"), dict) else {}
            snaps.setdefault(
                r["snapshot_id"], {"id": r["snapshot_id"], "step": step, "kind": r["kind"], "metrics": metrics}
            )
        elif r.get("event") == RESTORE and isinstance(r.get("tier"), str):
            fstep = r.get("failure_step")
            restores.append(
                {
                    "tier": r["tier"],
                    "snapshot": r["snapshot_id"],
                    "to": step,
                    "failure_step": fstep if type(fstep) is int else None,
                    "decision_time": (r.get("decision_time") if isinstance(r.get("decision_time"), str) else None),
                }
            )
    return sorted(snaps.values(), key=lambda s: s["step"]), restores
