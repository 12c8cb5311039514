"""Verify a run: re-hash snapshots against their manifests (``engine.verify`` and ``rl-ckpt verify``)."""

from __future__ import annotations

from typing import Callable, Sequence

from rl_ckpt.errors import CheckpointError
from rl_ckpt._run.snapshot_files import FileProblem, VerifyReport, read_manifest, read_verified, verify_snapshot
from rl_ckpt._format.manifest import MANIFEST_NAME
from rl_ckpt._format.npy_payload import unsafe_strings
from rl_ckpt._format.untrusted import parse_json
from rl_ckpt._run.catalog import Catalog
from rl_ckpt._run.quarantine import quarantine_records
from rl_ckpt._run.retire import retired_records


def verify_run(
    catalog: Catalog, snapshot_ids: Sequence[str] | None = None, *, progress: Callable[[int], None] | None = None
) -> VerifyReport:
    """Re-hash every file of ``snapshot_ids`` (default: every committed snapshot) against its manifest.

    A quarantined snapshot is reported as bad even when its files hash right (a
    person decides about it); with no ids given, so is every snapshot whose
    manifest cannot be read. ``progress`` is called with the bytes checked.
    The catalog is read as it is: refresh it first.
    """
    storage = catalog.storage
    report = VerifyReport()
    ids = list(snapshot_ids) if snapshot_ids is not None else [i.snapshot_id for i in catalog.snapshots()]
    for sid in ids:
        verify_snapshot(storage, sid, report, progress=progress)
        if sid not in report.bad_snapshots:
            report.problems += hidden_payloads(catalog, sid)
        info = catalog.get(sid)
        if info is not None and info.quarantined and sid not in report.bad_snapshots:
            report.problems.append(FileProblem(sid, "quarantine", info.quarantined))
    if snapshot_ids is None:
        for bad in catalog.unreadable():
            report.checked.append(bad.snapshot_id)
            report.problems.append(FileProblem(bad.snapshot_id, MANIFEST_NAME, bad.reason))
    return report


def hidden_payloads(catalog: Catalog, snapshot_id: str) -> list[FileProblem]:
    """Values of the snapshot's JSON state that hide what NumPy's loader would unpickle (an object-dtype
    ``.npy``, a pickle stream) behind base64 and zlib, as RLlib stores arrays: the checksums cannot tell a
    forged one from a real one, so verify reads the state itself (``_format/npy_payload.py``)."""
    info = catalog.get(snapshot_id)
    problems = []
    try:
        manifest = info.manifest if info is not None and info.manifest is not None else None
        manifest = manifest or read_manifest(catalog.storage, snapshot_id)
        for entry in manifest.files:
            if entry.role != "json":
                continue
            tree = parse_json(read_verified(catalog.storage, snapshot_id, entry), entry.path)
            for key, why in unsafe_strings(tree):
                problems.append(
                    FileProblem(
                        snapshot_id,
                        entry.path,
                        f"component {entry.component!r}, key {key!r}: {why}; refusing it (nothing decodes it)",
                    )
                )
    except CheckpointError as exc:  # verify_snapshot has just read these files: a change since is a problem too
        problems.append(FileProblem(snapshot_id, MANIFEST_NAME, str(exc)))
    return problems


def fenced_off(catalog: Catalog) -> list[str]:
    """What a person should know was taken out of the run, with when and why (not failures of the run):
    snapshots retired into ``history/retired/`` (the failed timeline of a restore, with the reason the restore
    skipped one, e.g. a checksum mismatch) and quarantine marks of snapshots no longer in the run. A quarantined
    snapshot still in the run is reported by :func:`verify_run` itself."""
    storage = catalog.storage
    present = {i.snapshot_id for i in catalog.snapshots()}
    notes = []
    for sid, record in quarantine_records(storage).items():
        if sid not in present:
            notes.append(
                f"{sid}: quarantined {record.get('at') or '(time unknown)'} by "
                f"{record.get('source') or '?'}: {record.get('reason') or '(no reason recorded)'}"
            )
    for r in retired_records(storage):
        why = r.get("skipped_by_restore")
        notes.append(
            f"{r['snapshot_id']} (step {r.get('global_step')}): retired {r.get('retired_at')} by "
            f"{r.get('retired_by')}: {r.get('reason')}"
            + (f"; the restore skipped it: {why}" if why else "")
            + (f"; kept in {r['moved_to']}" if r.get("moved_to") else "")
        )
    return [n[:2000] for n in notes]
