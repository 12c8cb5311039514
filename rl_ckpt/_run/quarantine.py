"""Quarantine: snapshots found bad after commit are fenced off, never silently deleted.

A quarantined snapshot is excluded from recovery and retention (so it is
neither restored nor deleted) and shown by ``ls``/``verify`` with the reason.
The registry is one small JSON file per snapshot under ``quarantine/`` (an
atomic write on every backend); ``release`` removes the mark after a person
has looked.
"""

from __future__ import annotations

import json

from rl_ckpt.errors import CheckpointError
from rl_ckpt._format.manifest import now_iso, parse_snapshot_id
from rl_ckpt._run.layout import QUARANTINE, quarantine_path
from rl_ckpt._run.records import RecordStore
from rl_ckpt._storage import Storage


def quarantine(storage: Storage, snapshot_id: str, reason: str, source: str) -> None:
    if parse_snapshot_id(snapshot_id) is None:
        raise CheckpointError(f"not a snapshot id: {snapshot_id!r}", snapshot_id=snapshot_id)
    storage.makedirs(QUARANTINE)
    body = {"snapshot_id": snapshot_id, "reason": reason, "source": source, "at": now_iso()}
    storage.write_atomic(quarantine_path(snapshot_id), json.dumps(body).encode())


def quarantined(storage: Storage) -> dict[str, str]:
    """snapshot id -> reason."""
    return {sid: r["reason"] for sid, r in quarantine_records(storage).items()}


def quarantine_records(storage: Storage) -> dict[str, dict]:
    """snapshot id -> its quarantine record (``reason``, ``source``, ``at``: strings, or None where unknown)."""
    out = {}
    records = RecordStore(storage, QUARANTINE, "quarantine record")
    for name in records.names():
        sid = name[:-5]
        if parse_snapshot_id(sid) is None:
            continue
        try:
            record = records.read(name)
        except CheckpointError:  # still fenced off: a mark that cannot be read is not a release
            record = None
        record = record if isinstance(record, dict) else {}
        fields = {
            k: record.get(k)[:1000] if isinstance(record.get(k), str) else None for k in ("reason", "source", "at")
        }
        fields["reason"] = fields["reason"] or "quarantined (record unreadable)"
        out[sid] = fields
    return out


def release(storage: Storage, snapshot_id: str) -> None:
    storage.remove(quarantine_path(snapshot_id))
