"""The run folder's layout: every name rl_ckpt gives to a file or folder in a run, in one place.

::

    <run>/
      step_000000500/            a committed snapshot: its manifest ``meta.json`` and data files
      step_000000500/shared/<component>...         several participants: state replicated on every learner
                                 rank, written once by rank 0 (``SHARED_SCOPE``)
      step_000000500/<participant>/<component>...  several participants: one participant's own state
                                 (``learner-1/rng``); a single writer's components sit at the top
      step_000000500/<attempt>/  manifest-last saves: this attempt's data (debris until meta.json lands)
      step_000000600.light/      a light snapshot (``.bN`` marks a later branch: step_000000500.b1)
      .staging/<id>.<attempt>/   staged-rename saves before their rename (debris if never renamed)
      .trash/<id>.<suffix>/      a retired snapshot between its rename and its deletion
      objects/<algo>/<hh>/<digest>   dedup chunks
      best/<metric>.json         best-snapshot aliases
      quarantine/<id>.json       snapshots fenced off after commit
      decisions/<time>-<action>.json  recovery coordinator decisions
      failures/<time>-<kind>.json     failures recorded by the manager
      history/retired/<id>.json  notes of what retention deleted
      memory_tier/snapshot-<id>.json, <time>-restore-<tier>.json   memory snapshots committed and restores
                                 across tiers, recorded by the memory tier
      history/retired/<id>.<tag>/      a snapshot of an abandoned timeline, moved here whole after a restore
      history/retired/<id>.<tag>.json  why it was retired (the restore that abandoned it)
      save_decisions/<id>.json   the manager's save/skip decision per snapshot (horizon-<step>.json: steps
                                 answered "not due" under a time cadence), removed once a newer step commits

An attempt folder of a sharded save also holds the manager's ``attempt.json``
and each participant's ``<participant>.report.json`` until the commit.
Snapshot names are only the canonical ones :func:`snapshot_id` writes, so a
folder a person made that merely looks like one is never listed, restored or
deleted.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator

from rl_ckpt.errors import CheckpointError
from rl_ckpt._format.manifest import MANIFEST_NAME, parse_snapshot_id, snapshot_id
from rl_ckpt._storage import Storage, join
from rl_ckpt._storage.base import Entry

_ISO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,6})?([+-]\d\d:\d\d|Z)?")
_RECORD_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

__all__ = [
    "MANIFEST_NAME",
    "STAGING",
    "TRASH",
    "OBJECTS",
    "BEST",
    "QUARANTINE",
    "DECISIONS",
    "FAILURES",
    "RETIRED",
    "ATTEMPT_FILE",
    "RESERVED",
    "Attempt",
    "snapshot_id",
    "parse_snapshot_id",
    "is_snapshot_name",
    "manifest_path",
    "snapshot_folders",
    "staged_attempt",
    "in_place_attempt",
    "parse_staged_name",
    "uncommitted_attempts",
    "committed_data_prefix",
    "report_name",
    "best_alias_path",
    "safe_name",
    "quarantine_path",
    "retired_path",
    "timed_record_stem",
    "SAVE_DECISIONS",
    "MEMORY_TIER_EVENTS",
    "retired_snapshot_dir",
    "retired_record_path",
    "SHARED_SCOPE",
    "component_key",
]

STAGING = ".staging"
TRASH = ".trash"
OBJECTS = "objects"
BEST = "best"
QUARANTINE = "quarantine"
DECISIONS = "decisions"
FAILURES = "failures"
RETIRED = "history/retired"
SAVE_DECISIONS = "save_decisions"
MEMORY_TIER_EVENTS = "memory_tier"  # the memory tier's record of its snapshots and restores (run/tier_events.py)
ATTEMPT_FILE = "attempt.json"  # the manager's record of a sharded attempt: who is expected to report
RESERVED = (STAGING, TRASH)  # top-level folders that are never snapshots, whatever they hold
SHARED_SCOPE = "shared"  # in a snapshot of several participants: the scope of state written once for all


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One try at writing one snapshot."""

    snapshot_id: str
    attempt_id: str
    data_prefix: str  # where files are written, relative to the storage root
    file_prefix: str  # prepended to file names in the manifest (relative to the snapshot folder)

    def data_path(self, name: str) -> str:
        """Where the file ``name`` of this attempt is written."""
        return join(self.data_prefix, name)

    def manifest_path(self, name: str) -> str:
        """The file ``name`` as the manifest lists it (relative to the snapshot folder)."""
        return self.file_prefix + name


def is_snapshot_name(name: str) -> bool:
    """True for a canonical snapshot folder name (``step_000000500``, ``step_000000500.light``...)."""
    return parse_snapshot_id(name) is not None


def manifest_path(snapshot: str) -> str:
    """``<id>/meta.json``: the file whose presence makes a snapshot committed."""
    return join(snapshot, MANIFEST_NAME)


def snapshot_folders(storage: Storage, links: list[str] | None = None) -> Iterator[Entry]:
    """Top-level folders with canonical snapshot names, committed or not (one listing).

    ``links``: gets the snapshot names that are symbolic links instead of folders (storage that has links:
    local disk). A link is never a snapshot of this run (its files would live elsewhere), so it is not
    yielded; the catalog reports it.
    """
    is_link = getattr(storage, "is_link", None)
    for entry in storage.list(""):
        if entry.name in RESERVED or not is_snapshot_name(entry.name):
            continue
        if entry.is_dir:
            yield entry
        elif links is not None and is_link is not None and is_link(entry.name):
            links.append(entry.name)


def newest_folder_step(storage: Storage) -> int:
    """The step of the newest snapshot folder in ``storage`` (full or light, committed or not; -1: none), from one
    listing and no manifest: a bound on what a recovery plan of this storage can target."""
    steps = [parse_snapshot_id(entry.name)[0] for entry in snapshot_folders(storage)]
    return max(steps, default=-1)


def staged_attempt(snapshot: str, attempt_id: str) -> Attempt:
    """The staged-rename attempt: files in ``.staging/<id>.<attempt>/``, renamed to ``<id>/`` at commit."""
    return Attempt(snapshot, attempt_id, join(STAGING, f"{snapshot}.{attempt_id}"), "")


def in_place_attempt(snapshot: str, attempt_id: str) -> Attempt:
    """The manifest-last attempt: files in ``<id>/<attempt>/``, listed as ``<attempt>/<file>``."""
    return Attempt(snapshot, attempt_id, join(snapshot, attempt_id), attempt_id + "/")


def parse_staged_name(name: str) -> tuple[str, str] | None:
    """``(snapshot id, attempt id)`` of a ``.staging/`` entry named ``<id>.<attempt>``, or None.

    Snapshot ids hold dots themselves (``.light``, ``.bN``), so the longest canonical id prefix wins.
    """
    best = None
    for i, c in enumerate(name):
        if c == "." and is_snapshot_name(name[:i]) and i + 1 < len(name):
            best = (name[:i], name[i + 1 :])
    return best


def uncommitted_attempts(storage: Storage) -> list[Attempt]:
    """Attempt folders of saves not committed yet, as the commit strategies lay them out.

    Staged ones under ``.staging/`` and manifest-last ones inside a snapshot
    folder that has no manifest. Whether one is still being written or is
    debris of a crash is for the caller to tell (gc: age; the manager: its
    ``attempt.json``).
    """
    found = []
    for entry in storage.list(STAGING):
        parsed = parse_staged_name(entry.name) if entry.is_dir else None
        if parsed is not None:
            found.append(staged_attempt(*parsed))
    for entry in snapshot_folders(storage):
        if not storage.exists(manifest_path(entry.name)):
            found += [in_place_attempt(entry.name, inner.name) for inner in storage.list(entry.name) if inner.is_dir]
    return found


def committed_data_prefix(attempt: Attempt) -> str:
    """Where an attempt's files are once it committed: a staged folder was renamed to the snapshot's."""
    if attempt.data_prefix.startswith(STAGING + "/"):
        return attempt.snapshot_id
    return attempt.data_prefix


def component_key(name: str, scope: str | None = None) -> str:
    """Where component ``name`` lives in a snapshot (manifest key and data folder): ``name`` for a single
    writer, ``<scope>/<name>`` in a snapshot of several participants (``SHARED_SCOPE`` or the participant)."""
    return name if scope is None else f"{scope}/{name}"


def report_name(participant: str) -> str:
    """A participant's part of a sharded manifest, in the attempt folder until the commit."""
    return f"{participant}.report.json"


def safe_name(text: str) -> str:
    """``text`` as one file name: anything but letters, digits and ``-_.`` becomes ``_``, no leading dot."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text).lstrip(".") or "metric"


def best_alias_path(metric: str) -> str:
    """``best/<metric>.json``: which snapshot is best by ``metric``."""
    return f"{BEST}/{safe_name(metric)}.json"


def quarantine_path(snapshot: str) -> str:
    """``quarantine/<id>.json``: why the snapshot was fenced off."""
    return f"{QUARANTINE}/{snapshot}.json"


def retired_path(snapshot: str) -> str:
    """``history/retired/<id>.json``: what retention deleted, written before deleting it."""
    return f"{RETIRED}/{snapshot}.json"


def retired_snapshot_dir(snapshot: str, tag: str) -> str:
    """``history/retired/<id>.<tag>/``: where a snapshot of an abandoned timeline is kept, whole.

    ``tag`` tells apart snapshots of one step retired after different restores (it is derived from the
    retired snapshot's manifest, so a retried retire of the same snapshot lands in the same place).
    """
    return f"{RETIRED}/{snapshot}.{tag}"


def retired_record_path(snapshot: str, tag: str) -> str:
    """``history/retired/<id>.<tag>.json``: why the snapshot in ``retired_snapshot_dir`` was retired."""
    return f"{RETIRED}/{snapshot}.{tag}.json"


def is_record_time(value: object) -> bool:
    """``value`` is an ISO time as records carry it (what a record's name may be made of)."""
    return isinstance(value, str) and _ISO_TIME.fullmatch(value) is not None


def timed_record_stem(time: str, what: str) -> str:
    """The file stem of a dated record (decisions, failures): the ISO time without ``:``/``+``, then ``what``.

    Names sort by time, so a listing is the records in the order they were written. Both parts become a file
    name: anything but an ISO time and a plain word is refused (names never come from a caller's fields).
    """
    stem = f"{time.replace(':', '').replace('+', 'p')}-{what}"
    if not _ISO_TIME.fullmatch(time) or not _RECORD_WORD.fullmatch(what):
        raise CheckpointError(f"not a record name: time {time[:80]!r}, kind {what[:80]!r} (an ISO time and a word)")
    return stem
