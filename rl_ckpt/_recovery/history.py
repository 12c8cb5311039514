"""A run's recovery history: the failures and coordinator decisions recorded in its folder.

One file per record (``failures/<time>-<kind>.json``,
``decisions/<time>-<action>.json``; the time is the recorder's clock), written create-only through the run's
record store, so every backend writes it atomically and no writer replaces
another's. The decisions read back are the history the next decision is made
from (:func:`rl_ckpt._recovery.coordinator.make_decision`); a planted or
damaged record is skipped with a warning.
"""

from __future__ import annotations

import re

from rl_ckpt.errors import ConfigError
from rl_ckpt._format.manifest import now_iso
from rl_ckpt._recovery.coordinator import Action, Decision, FailureInfo, FailureKind
from rl_ckpt._run.layout import DECISIONS, FAILURES, is_record_time, timed_record_stem
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


def failure_to_answer(failures: list[dict], answered: set) -> dict | None:
    """The failure a recovery plan answers: of ``failures`` (oldest first), those recorded since the newest one a
    decision answered (``answered``: their ``time``s) are one incident; the newest of them that a participant or
    Ray reported (an exception, a killed process, a NaN loss, OOM) is answered, else the newest of them.

    A ``heartbeat_lost`` record is the manager's inference from silence, with the step the silent participant last
    reported. When a process dies, the watch may notice the silence before or after the death is reported (on a
    loaded machine a late heartbeat can even bring back an earlier step first): the report says what happened and
    where, so it is the one answered. With nothing recorded since the last answered failure, the newest one no
    decision answered (None: none)."""
    last = max((i for i, f in enumerate(failures) if f.get("time") in answered), default=-1)
    incident = failures[last + 1 :] or [f for f in failures if f.get("time") not in answered]
    if not incident:
        return None
    reported = [f for f in incident if f.get("kind") != FailureKind.heartbeat_lost.value]
    return (reported or incident)[-1]


def record_failure(storage: Storage, failure: FailureInfo) -> str:
    """Write ``failure`` into the run folder; returns its path.

    The record's name is the recorder's: its own clock and the failure's validated kind, never a field of the
    request (a caller's ``time`` of ``"/abs/escape"`` once named a file outside ``failures/``). A retried call
    (the same failure again) finds its record and writes nothing.
    """
    what = FailureKind(failure.kind).value
    return failure_records(storage).add_once(timed_record_stem(now_iso(), what), failure.to_json(), ending=f"-{what}")


FAILURE_FIELDS = ("version", "kind", "step", "message", "metrics", "first_nonfinite_step", "participant", "time")
PARTICIPANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}")
MAX_MESSAGE = 8192


def failure_request(body: object) -> FailureInfo:
    """A failure as a caller (a participant, a callback, any driver on the cluster) reports it, checked field by
    field before anything is written: a ConfigError names the first field that is not what a failure holds.

    Nothing of a request names a file (the record's name is the recorder's clock and the kind); this also keeps
    a record's fields plain: a participant name is a word, the time an ISO time, the steps whole numbers."""
    if not isinstance(body, dict):
        raise ConfigError(f"a failure is a JSON object (FailureInfo JSON), not {type(body).__name__}", key="failure")
    unknown = sorted(str(k)[:80] for k in body if k not in FAILURE_FIELDS)
    if unknown:
        raise ConfigError(f"failure: unknown field(s) {unknown}; a failure has {list(FAILURE_FIELDS)}", key=unknown[0])
    for key in ("step", "first_nonfinite_step"):
        value = body.get(key)
        if value is not None and (type(value) is not int or value < 0):
            raise ConfigError(f"failure: {key} must be a step (an int >= 0) or null, not {value!r:.80}", key=key)
    participant = body.get("participant")
    if participant is not None and not (isinstance(participant, str) and PARTICIPANT_NAME.fullmatch(participant)):
        raise ConfigError(
            f"failure: participant {participant!r:.80} is not a participant name (a word such as 'learner-0' or "
            "'rollout-3': letters, digits and _ . : @ -)",
            key="participant",
        )
    if "time" in body and body["time"] is not None and not is_record_time(body["time"]):
        raise ConfigError(f"failure: time {body['time']!r:.80} is not an ISO time (e.g. {now_iso()!r})", key="time")
    message = body.get("message", "")
    if not isinstance(message, str):
        raise ConfigError(f"failure: message must be text, not {type(message).__name__}", key="message")
    if not isinstance(body.get("metrics") or {}, dict):
        raise ConfigError("failure: metrics must be an object of name -> number", key="metrics")
    if "kind" not in body:
        raise ConfigError("failure: no kind; a failure names what happened (e.g. 'process_killed')", key="kind")
    info = FailureInfo.from_json(body)
    info.message = message[:MAX_MESSAGE]
    return info
