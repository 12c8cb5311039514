"""The manager's save decisions: one answer per snapshot (and per step) for every participant, kept on storage.

Two questions reach the manager from the participants' schedulers:

* ``decide(snapshot id, busy)``: a save is due (by step count) and may be
  skipped because the asker's previous save still runs. The first asker decides
  for everyone.
* ``step(global step, ...)``, asked for every step while a time cadence
  (``save_interval_seconds``) is configured: is this step a save step? Each
  rank's own clock would answer differently on a loaded machine and split a
  snapshot, so the first asker for a step gets an answer from the manager's
  clock and every later asker gets the same one.

Every save/skip decision is a create-only JSON record in ``save_decisions/``
written before it is answered: the first decision wins, also when a restarted
manager is asked the second time. "Not due" answers are not written one by one;
instead a *horizon* record says "no time-based save at any step up to H
unless recorded", written ahead of the steps answered (about 1/16 of the
interval in steps), so a restarted manager never turns a step some rank was
told was not due into a save step. Records of steps older than the newest
commit are removed; a recovery plan removes all of them (those steps are
trained again).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable

from rl_ckpt.errors import CheckpointError, CommitConflictError
from rl_ckpt._format.manifest import parse_snapshot_id, snapshot_id
from rl_ckpt._run.layout import SAVE_DECISIONS as FOLDER
from rl_ckpt._run.records import RecordStore
from rl_ckpt._storage import Storage

log = logging.getLogger("rl_ckpt")
HORIZON = "horizon-"
HORIZON_FRACTION = 16  # a horizon covers ~interval/16 of steps: what a restart may delay a time-based save by
MAX_HORIZON_STEPS = 100_000
NOT_DUE = {"kind": None, "save": False}


class DecisionRecords:
    """Storage access for the decision records: the run's record store, create-only, the first record wins."""

    def __init__(self, storage: Storage, folder: str = FOLDER) -> None:
        self.store = RecordStore(storage, folder, what="save decision record")
        self.folder = folder

    def create(self, name: str, body: dict) -> dict | None:
        """Write ``body`` as ``name`` unless it exists; returns the record already there (None: ours won).

        A record already there that cannot be read is reported and ours is used.
        """
        self.store.storage.makedirs(self.folder)
        try:
            self.store.storage.write_atomic(self.store.path(name), json.dumps(body).encode(), create_only=True)
            return None
        except CommitConflictError:
            return self.read(name)

    def read(self, name: str) -> dict | None:
        try:
            body = self.store.read(name)
        except CheckpointError as exc:
            log.warning("ignoring unreadable save decision record %s: %s", self.store.path(name), exc)
            return None
        return body if isinstance(body, dict) else None

    def names(self) -> list[str]:
        return self.store.names()

    def remove(self, name: str) -> None:
        try:
            self.store.storage.remove(self.store.path(name))
        except CheckpointError as exc:  # a leftover record is harmless: it names a step already passed
            log.warning("could not remove save decision record %s: %s", self.store.path(name), exc)


def _decision(body: dict | None) -> tuple[str, str] | None:
    """(``"save"``/``"skip"``, who decided) from a record, or None if it is not a valid one."""
    if body is None or body.get("decision") not in ("save", "skip") or not isinstance(body.get("by"), str):
        return None
    return body["decision"], body["by"]


class SaveDecisions:
    """One run's save decisions (see the module docstring). Not thread-safe: the manager holds its lock.

    Args:
        storage: the run folder.
        clock: the manager's monotonic clock (seconds).
        wall: wall-clock seconds, recorded so a restarted manager can go on timing the interval.
    """

    def __init__(
        self, storage: Storage, *, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time
    ) -> None:
        self.records = DecisionRecords(storage)
        self.clock, self.wall = clock, wall
        self._by_id: dict[str, tuple[str, str]] = {}
        self._answers: dict[int, dict] = {}  # step -> the time-cadence answer given for it
        self._frontier: int | None = None  # the newest step this process answered
        self._horizon = -1  # persisted: no time-based save at a step <= this unless recorded
        self._answered_before = -1  # the horizon a previous manager process left: its answers up to there
        self._anchor: float | None = None  # manager clock at the newest full save decided (the interval's start)
        self._rate_start: tuple[int, float] | None = None  # (step, time) to estimate steps per second
        self._load()

    def _load(self) -> None:
        """Records of a previous manager process (after a restart)."""
        since = None  # wall time the running interval counts from
        try:
            names = self.records.names()
        except CheckpointError as exc:
            log.error("cannot list %s/ (save decisions start empty): %s", self.records.folder, exc)
            return
        for name in names:
            stem = name[: -len(".json")]
            body = self.records.read(name)
            if stem.startswith(HORIZON):
                if body is not None and type(body.get("step")) is int:
                    self._horizon = self._answered_before = max(self._horizon, body["step"])
                    if isinstance(body.get("since"), (int, float)):
                        since = max(since or body["since"], body["since"])
                continue
            parsed = parse_snapshot_id(stem)
            decision = _decision(body)
            if parsed is None or decision is None:
                continue
            self._by_id[stem] = decision
            wall = body.get("time")
            if decision[0] == "save" and parsed[2] == "full" and isinstance(wall, (int, float)):
                since = max(since or wall, wall)
        if since is not None:  # the interval counts on from the last full save, not from the restart
            self._anchor = self.clock() - max(0.0, self.wall() - since)

    # -- one decision per snapshot ----------------------------------------------
    def get(self, sid: str) -> tuple[str, str] | None:
        """The decision taken for snapshot ``sid``: (``"save"``/``"skip"``, who decided), or None."""
        return self._by_id.get(sid)

    def save_or_skip(self, sid: str, participant: str, busy: bool, started: Callable[[str], bool]) -> str:
        """``"save"``/``"skip"`` for ``sid``: the first asker skips if busy (unless ``started(sid)``), for all."""
        decision = self._by_id.get(sid)
        if decision is None:  # recorded on storage before it is answered: a restarted manager answers the same
            decision = self.decide(sid, "skip" if busy and not started(sid) else "save", participant)
        return decision[0]

    def decide(self, sid: str, proposal: str, by: str) -> tuple[str, str]:
        """Record ``proposal`` for ``sid`` unless a decision exists (also on storage): returns the one that holds."""
        known = self._by_id.get(sid)
        if known is not None:
            return known
        parsed = parse_snapshot_id(sid)
        body = {
            "snapshot_id": sid,
            "step": parsed[0] if parsed else None,
            "decision": proposal,
            "by": by,
            "time": self.wall(),
        }
        decision = _decision(self.records.create(f"{sid}.json", body)) or (proposal, by)
        self._by_id[sid] = decision
        if decision[0] == "save" and parsed and parsed[2] == "full":
            self._anchor = self.clock()
        if decision[0] == "skip":
            log.info("%s: skipped by every participant (%s's previous save is still running)", sid, decision[1])
        return decision

    # -- one answer per step under a time cadence --------------------------------
    def step(
        self,
        global_step: int,
        participant: str,
        kind: str | None,
        busy: bool,
        interval: float,
        started: Callable[[str], bool],
    ) -> dict:
        """Whether ``global_step`` is a save step: ``{"kind": "full" | "light" | None, "save": bool}``.

        ``kind``: what is due by step count alone (the same on every rank);
        ``busy``: the asker's previous save still runs (a due save is then
        skipped unless ``started(sid)``); ``interval``: ``save_interval_seconds``.
        The first asker's answer is every asker's answer.
        """
        answer = self._answers.get(global_step)
        if answer is None:
            answer = self._recorded(global_step)
        if answer is None:
            answer = self._fresh(global_step, participant, kind, busy, interval, started)
        self._answers[global_step] = answer
        self._frontier = max(global_step, self._frontier if self._frontier is not None else global_step)
        return answer

    def _recorded(self, global_step: int) -> dict | None:
        for k in ("full", "light"):
            decision = self._by_id.get(snapshot_id(global_step, k))
            if decision is not None:
                return {"kind": k, "save": decision[0] == "save"}
        # A step up to the newest one answered (by this process, or by one before a restart as far as
        # the horizon says) has had its answer: nothing recorded means it was "not due".
        if global_step <= self._answered_before or (self._frontier is not None and global_step <= self._frontier):
            return dict(NOT_DUE)
        return None

    def _fresh(
        self,
        global_step: int,
        participant: str,
        kind: str | None,
        busy: bool,
        interval: float,
        started: Callable[[str], bool],
    ) -> dict:
        now = self.clock()
        if self._anchor is None:
            self._anchor = now  # the first interval counts from the first question
        if self._rate_start is None:
            self._rate_start = (global_step, now)
        if interval and now - self._anchor >= interval:
            kind = "full"
        if kind is None:
            self._extend_horizon(global_step, now, interval)
            return dict(NOT_DUE)
        decision = self.save_or_skip(snapshot_id(global_step, kind), participant, busy, started)
        return {"kind": kind, "save": decision == "save"}

    def _extend_horizon(self, global_step: int, now: float, interval: float) -> None:
        """Make sure a restarted manager answers "not due" for ``global_step`` too: persist a horizon past it."""
        if global_step <= self._horizon:
            return
        first_step, first_time = self._rate_start
        rate = (global_step - first_step) / (now - first_time) if now > first_time else 0.0
        ahead = int(min(MAX_HORIZON_STEPS, max(0.0, rate * (interval or 0.0) / HORIZON_FRACTION)))
        horizon = global_step + ahead
        wall = self.wall()
        since = wall - (now - self._anchor)
        self.records.create(f"{HORIZON}{horizon:012d}.json", {"step": horizon, "time": wall, "since": since})
        self._horizon = horizon

    # -- keeping it small ---------------------------------------------------------
    def forget_before(self, step: int) -> None:
        """A snapshot at ``step`` committed: every participant is past the older steps."""
        for sid in [s for s in self._by_id if (parse_snapshot_id(s) or (step,))[0] < step]:
            del self._by_id[sid]
        for s in [s for s in self._answers if s < step]:
            del self._answers[s]
        self._remove_records(
            lambda stem, parsed, horizon: (
                (parsed is not None and parsed[0] < step)
                or (horizon is not None and horizon < min(step, self._horizon))
            )
        )

    def clear(self) -> None:
        """A recovery plan was made: training goes on from an older step and its steps are decided anew."""
        self._by_id.clear()
        self._answers.clear()
        self._frontier, self._horizon, self._answered_before, self._anchor, self._rate_start = None, -1, -1, None, None
        self._remove_records(lambda stem, parsed, horizon: parsed is not None or horizon is not None)

    def _remove_records(self, drop: Callable) -> None:
        try:
            names = self.records.names()
        except CheckpointError as exc:
            log.warning("cannot list %s/ to tidy it: %s", self.records.folder, exc)
            return
        for name in names:
            stem = name[: -len(".json")]
            horizon = stem[len(HORIZON) :] if stem.startswith(HORIZON) else None
            ok = horizon is not None and horizon.isascii() and horizon.isdigit() and len(horizon) <= 18
            horizon = int(horizon) if ok else None
            if drop(stem, parse_snapshot_id(stem), horizon):
                self.records.remove(name)

    def __len__(self) -> int:
        return len(self._by_id)
