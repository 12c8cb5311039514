"""Retiring an abandoned timeline: after a restore, the snapshots newer than what was loaded.

A restore loads snapshot S (and maybe a light layer L on top) and training
goes on after L's step (else S's). Committed snapshots of a later step were
written by the run that failed: restoring one later would jump back onto that
timeline, retention and ``latest`` would keep choosing them, and saving their
step again would collide with them (a commit never overwrites). They are moved
out of the snapshot namespace, whole, into ``history/retired/<id>.<tag>/``
next to a record ``history/retired/<id>.<tag>.json`` saying why; nothing is
deleted, so a person can still look at them.

Per snapshot, in this order (each step is safe to repeat):

1. the record, create-only (a repeat finds it there; the first restore's
   reason stands). The snapshot is still committed in place.
2. the move. With rename (local disks, NFS): one no-replace rename of the
   whole folder, then both parent folders are fsynced: the catalog sees the
   snapshot committed in place or not at all. Without rename (object stores):
   every file is copied into the retired folder, its manifest last; then the
   manifest ``<id>/meta.json`` is removed (the commit point, undone), then the
   rest. A kill before the manifest goes leaves the snapshot committed (the
   next restore retires it; a half copy is copied again); after it, what is
   left is an attempt folder without a manifest, which is debris for ``gc`` as
   after a crashed save (a manifest-last save keeps its files in an attempt
   subfolder, so nothing makes the folder look like a committed snapshot that
   lost its manifest; if something does, the next retire pass removes it once
   its copy is complete).
Quarantined snapshots stay where they are, in quarantine, for a person to
look at (as retention leaves them): they are never restored, but a save of
their step conflicts until someone releases and deletes them, so each one
newer than the restored step is named in a warning. So are snapshots whose
manifest cannot be read: ``verify`` and ``ls`` keep reporting them, gc keeps
them, and a person decides.

The memory tier's ``raymem://`` stores keep no retired copies (they would hold
RAM for good): there the snapshot is deleted as retention deletes, after its
record. Dedup chunks a retired snapshot references stay in ``objects/`` until
``rl-ckpt gc``, which counts only committed snapshots' references.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from typing import Iterable, Iterator, Mapping

from rl_ckpt.errors import CheckpointError, CommitConflictError
from rl_ckpt._format.manifest import now_iso, parse_snapshot_id
from rl_ckpt._format.metrics import clean_metrics
from rl_ckpt._run.catalog import Catalog, SnapshotInfo, lost_manifest
from rl_ckpt._run.layout import (
    MANIFEST_NAME,
    RETIRED,
    manifest_path,
    retired_record_path,
    retired_snapshot_dir,
    snapshot_folders,
)
from rl_ckpt._run.delete import delete_snapshot
from rl_ckpt._run.records import RecordStore
from rl_ckpt._storage import Storage, join
from rl_ckpt._storage.registry import protocol_of

log = logging.getLogger("rl_ckpt")
COPY_CHUNK = 8 << 20
NO_COPIES = ("raymem",)  # storage protocols where a retired snapshot is deleted, not kept
REASON = "newer than the snapshot a restore loaded: written by the timeline that failed"

__all__ = ["RetireOutcome", "retire_newer", "retire_for_plan", "retire_one", "retired_records", "snapshot_tag"]


@dataclasses.dataclass
class RetireOutcome:
    """What one pass retired (snapshot ids, oldest first) and what it could not (warnings)."""

    retired: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)


def snapshot_tag(info: SnapshotInfo) -> str:
    """A short name part derived from the snapshot's manifest: the same for a retried retire of one snapshot,
    different for a later snapshot of the same step."""
    body = json.dumps(
        info.manifest.to_json() if info.manifest is not None else [info.snapshot_id, info.created_at],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(body.encode()).hexdigest()[:12]


def retire_newer(
    storage: Storage,
    catalog: Catalog,
    *,
    continue_step: int,
    loaded: Iterable[str | None],
    restored: str | None,
    by: str,
    skipped: Mapping[str, str] | None = None,
) -> RetireOutcome:
    """Retire every committed snapshot (full or light; not quarantined ones) of a step after ``continue_step``.

    Args:
        continue_step: the step training continues after (the restored light layer's, else the full's).
        loaded: the snapshots the restore loaded (never retired, whatever their step).
        restored: the snapshot restored (with its light layer, as text), for the records.
        by: who retires (``"engine rank 0"``, ``"manager"``), for the records.
        skipped: snapshot id -> why the restore did not use it (a checksum mismatch...), for the records.

    One snapshot that cannot be retired becomes a warning and the pass goes on; the
    catalog is refreshed at the start and the end.
    """
    catalog.refresh()
    keep = {sid for sid in loaded if sid}
    outcome = RetireOutcome()
    context = {"reason": REASON, "restored": restored, "restored_step": continue_step, "retired_by": by}
    for info in catalog.snapshots():
        if info.global_step <= continue_step or info.snapshot_id in keep:
            continue
        if info.quarantined is not None:
            outcome.warnings.append(
                f"{info.snapshot_id} is newer than step {continue_step} but quarantined: left in "
                "quarantine for a person (a save of its step conflicts until it is deleted)"
            )
            continue
        try:
            why = (skipped or {}).get(info.snapshot_id)
            if retire_one(storage, info, {**context, "skipped_by_restore": why} if why else context):
                outcome.retired.append(info.snapshot_id)
        except CheckpointError as exc:
            outcome.warnings.append(f"could not retire {info.snapshot_id} (newer than step {continue_step}): {exc}")
    for bad in catalog.unreadable():
        parsed = parse_snapshot_id(bad.snapshot_id)
        if parsed is not None and parsed[0] > continue_step:
            outcome.warnings.append(
                f"{bad.snapshot_id} is newer than step {continue_step} but unreadable "
                f"({bad.reason}); left in place for a person (a save of its step will conflict)"
            )
    _finish_interrupted(storage, continue_step, keep)
    catalog.refresh()
    for w in outcome.warnings:
        log.warning("retiring the failed timeline: %s", w)
    if outcome.retired:
        log.info(
            "retired %s (newer than step %d, restored %s) into %s/",
            ", ".join(outcome.retired),
            continue_step,
            restored,
            RETIRED,
        )
    return outcome


def retire_for_plan(storage: Storage, catalog: Catalog, plan, *, by: str) -> list[str]:
    """Retire what is newer than a ``RecoveryPlan``'s continue step before anyone follows it (the manager).

    Every participant restores the plan's target (with its light layer) or an older fallback, never a
    newer snapshot, so nothing retired here is anything a participant loads; and it happens before any
    participant of the new timeline can save a step a retired snapshot held. Problems become plan warnings.
    """
    restored = f"{plan.target}" + (f" + light {plan.light}" if plan.light else "")
    try:
        outcome = retire_newer(
            storage,
            catalog,
            continue_step=plan.continue_from_step,
            loaded=[plan.target, plan.light, *plan.fallbacks],
            restored=restored,
            by=by,
            skipped={c.snapshot_id: c.reason for c in plan.candidates if c.status == "skipped"},
        )
    except CheckpointError as exc:  # the plan stands; the next plan retries
        plan.warnings.append(f"could not retire the snapshots newer than step {plan.continue_from_step}: {exc}")
        return []
    plan.warnings += outcome.warnings
    return outcome.retired


def retired_records(storage: Storage) -> list[dict]:
    """The records of the snapshots retired from this run (``history/retired/*.json``), oldest first."""
    return [
        r
        for r in RecordStore(storage, RETIRED, "retired-snapshot record").load()
        if isinstance(r.get("snapshot_id"), str)
    ]


def retire_one(storage: Storage, info: SnapshotInfo, context: dict) -> bool:
    """Record why, then move ``info``'s snapshot into ``history/retired/``.

    ``moved_to`` in the record is None where no copy is kept (``NO_COPIES``).

    Returns False when it was already gone from the snapshot namespace.
    """
    sid, tag = info.snapshot_id, snapshot_tag(info)
    dest = retired_snapshot_dir(sid, tag) if protocol_of(storage.url) not in NO_COPIES else None
    body = {
        "snapshot_id": sid,
        "global_step": info.global_step,
        "kind": info.kind,
        "metrics": clean_metrics(info.metrics),
        "size_bytes": info.size_bytes,
        "created_at": info.created_at,
        **context,
        "moved_to": dest,
        "retired_at": now_iso(),
    }
    storage.makedirs(RETIRED)
    try:
        storage.write_atomic(
            retired_record_path(sid, tag), json.dumps(body, allow_nan=False).encode(), create_only=True
        )
    except CommitConflictError:
        pass  # a retire of this snapshot was interrupted after its record: the record stands
    return _move(storage, sid, dest) if dest is not None else delete_snapshot(storage, sid)


def _move(storage: Storage, sid: str, dest: str) -> bool:
    if not storage.exists(manifest_path(sid)):
        return False
    if storage.supports_rename:
        storage.rename_dir(sid, dest)  # CommitConflictError if dest exists: never overwrite what was retired
        storage.sync_dir("")
        storage.sync_dir(RETIRED)
        return True
    if not storage.exists(join(dest, MANIFEST_NAME)):
        _copy_tree(storage, sid, dest)
    storage.remove(manifest_path(sid))
    storage.remove_tree(sid)
    return True


def _files(storage: Storage, folder: str, prefix: str = "") -> Iterator[str]:
    for entry in storage.list(join(folder, prefix) if prefix else folder):
        rel = f"{prefix}/{entry.name}" if prefix else entry.name
        if entry.is_dir:
            yield from _files(storage, folder, rel)
        elif not entry.name.startswith(".tmp-"):
            yield rel


def _copy_tree(storage: Storage, src: str, dest: str) -> None:
    """Copy every file of ``src`` into ``dest``, streamed, the manifest last (its presence marks a whole copy)."""
    files = sorted(_files(storage, src), key=lambda rel: rel == MANIFEST_NAME)
    made = set()
    for rel in files:
        parent = join(dest, rel).rsplit("/", 1)[0]
        if parent not in made:
            storage.makedirs(parent)
            made.add(parent)
        with storage.open_read(join(src, rel)) as f:
            storage.write(join(dest, rel), iter(lambda: f.read(COPY_CHUNK), b""), durable=True)


def _finish_interrupted(storage: Storage, continue_step: int, keep: set[str]) -> None:
    """Remove what a kill left of a move without rename once the retired copy is whole (see the module docstring)."""
    copies = {
        e.name.rsplit(".", 1)[0]
        for e in storage.list(RETIRED)
        if e.is_dir and storage.exists(join(RETIRED, e.name, MANIFEST_NAME))
    }
    for entry in snapshot_folders(storage):
        parsed = parse_snapshot_id(entry.name)
        if (
            parsed[0] > continue_step
            and entry.name not in keep
            and entry.name in copies
            and not storage.exists(manifest_path(entry.name))
            and lost_manifest(storage, entry.name)
        ):
            storage.remove_tree(entry.name)
