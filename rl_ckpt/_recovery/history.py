"""A run's recovery history: the failures and coordinator decisions recorded in its folder.

One file per record (``failures/<time>-<kind>.json``,
``decisions/<time>-<action>.json``; the time is the recorder's clock), written create-only through the run's
record store, so every backend writes it atomically and no writer replaces
another's. The decisions read back are the history the next decision is made
from (:func:`rl_ckpt._recovery.coordinator.make_decision`); a planted or
damaged record is skipped with a warning.
"""

from __future__ import annotations

from rl_ckpt._format.manifest import now_iso
from rl_ckpt._recovery.coordinator import Action, Decision, FailureInfo, FailureKind
from rl_ckpt._run.layout import DECISIONS, FAILURES, timed_record_stem
from rl_ckpt._run.records import RecordStore
from rl_ckpt._storage import Storage


def decision_records(storage: Storage) -> RecordStore:
    """The run's ``decisions/`` folder."""
    return RecordStore(storage, DECISIONS, "decision record")


def failure_records(storage: Storage) -> RecordStore:
    """The run's ``failures/`` folder."""
    return RecordStore(storage, FAILURES, "failure record")


def _decision(record: dict) -> Decision:
    decision = Decision.from_json(record)
    ids = (decision.snapshot_id, decision.charged_to, *(s for s, _n in decision.considered))
    steps = (decision.global_step, decision.failure.step, decision.attempt)
    if not (all(i is None or isinstance(i, str) for i in ids) and all(n is None or type(n) is int for n in steps)):
        raise TypeError("fields of the wrong type")  # e.g. a list as snapshot id: unhashable later
    return decision


def load_decisions(storage: Storage) -> list[Decision]:
    """The coordinator decisions recorded in the run, oldest first."""
    return decision_records(storage).load(_decision)


def record_decision(storage: Storage, decision: Decision) -> str:
    """Write ``decision`` into the run folder; returns its path (see :func:`record_failure` for the name)."""
    what = Action(decision.action).value
    return decision_records(storage).add_once(timed_record_stem(now_iso(), what), decision.to_json(), ending=f"-{what}")


def load_failures(storage: Storage) -> list[dict]:
    """The failures recorded in the run (``FailureInfo`` JSON), oldest first."""
    return failure_records(storage).load()


def record_failure(storage: Storage, failure: FailureInfo) -> str:
    """Write ``failure`` into the run folder; returns its path.

    The record's name is the recorder's: its own clock and the failure's validated kind, never a field of the
    request (a caller's ``time`` of ``"/abs/escape"`` once named a file outside ``failures/``). A retried call
    (the same failure again) finds its record and writes nothing.
    """
    what = FailureKind(failure.kind).value
    return failure_records(storage).add_once(timed_record_stem(now_iso(), what), failure.to_json(), ending=f"-{what}")
