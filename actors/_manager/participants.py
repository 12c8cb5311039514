"""The manager's participant registry: who takes part in the run's saves, their heartbeats, who is lost.

A participant (one engine process: ``learner-0``, ``rollout-3``...) registers
on construction, and again after a manager restart; it beats every
``heartbeat_interval_seconds`` with the step it is at. One that is training
(has reported a step) and has been silent for two intervals is *lost*, as is
the one a failure record names. The caller (the manager) holds its lock
around every call: the registry itself is plain data.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from rl_ckpt.errors import CheckpointError
from rl_ckpt.errors import UnknownParticipantError
from rl_ckpt._recovery.coordinator import FailureInfo

from .metrics import ManagerMetrics

log = logging.getLogger("rl_ckpt")


@dataclasses.dataclass
class Participant:
    meta: dict
    handle: Any = None
    last_beat: float = 0.0
    step: int | None = None
    last_snapshot: str | None = None
    lost: bool = False
    beats: int = 0


class ParticipantRegistry:
    """Registered participants by name, and those that finished cleanly."""

    def __init__(self, run_name: str, heartbeat_interval: float) -> None:
        self.run_name = run_name
        self.interval = heartbeat_interval
        self.participants: dict[str, Participant] = {}
        self.unregistered: set[str] = set()  # finished cleanly: their liveness thread stops, not re-registers

    def check(self, participant: str) -> None:
        """UnknownParticipantError unless ``participant`` is registered."""
        if participant not in self.participants:
            raise UnknownParticipantError(
                f"participant {participant!r} is not registered with the manager of run {self.run_name!r}: "
                "only registered participants (a CheckpointEngine built with manager=...) may begin, report or "
                f"abort snapshots. Registered: {sorted(self.participants)}.",
                participant=participant,
            )

    def register(self, participant: str, meta: dict, handle: Any, now: float) -> None:
        """A participant process announces itself; a registration from the same process merges."""
        known = self.participants.get(participant)
        if known is not None and known.meta.get("pid") in (None, meta.get("pid")):
            known.meta, known.handle = {**known.meta, **meta}, handle or known.handle
            return
        self.participants[participant] = Participant(meta, handle, now)
        self.unregistered.discard(participant)

    def unregister(self, participant: str) -> None:
        """A participant finished cleanly: no longer expected to beat (nor lost when silent)."""
        self.participants.pop(participant, None)
        self.unregistered.add(participant)

    def heartbeat(self, participant: str, step: int | None, last_snapshot: str | None, now: float) -> bool | None:
        """True: noted; False: not registered (it registers again); None: it unregistered (it stops beating)."""
        p = self.participants.get(participant)
        if p is None:
            return None if participant in self.unregistered else False
        p.last_beat, p.lost = now, False
        p.beats += 1
        if step is not None:
            p.step, p.last_snapshot = step, last_snapshot
        return True

    def lost_count(self) -> int:
        return sum(p.lost for p in self.participants.values())

    def newly_lost(self, now: float) -> list[tuple[str, Participant]]:
        """Participants silent for more than two intervals since the last look; they are marked lost.

        Only participants that are training (have reported a step) can be lost: a
        worker idle before training starts, or one already known to have failed,
        is not a new incident.
        """
        lost = [
            (n, p)
            for n, p in self.participants.items()
            if p.step is not None and not p.lost and now - p.last_beat > 2 * self.interval
        ]
        for _, p in lost:
            p.lost = True
        return lost

    def silence_message(self, lost: list[tuple[str, Participant]], now: float) -> str:
        names = ", ".join(name for name, _ in lost)
        ages = ", ".join(f"{now - p.last_beat:.1f}" for _, p in lost)
        return f"{names} sent no heartbeat for {ages} s (> 2 x {self.interval} s)"

    def participant_of(self, dead: list[dict]) -> str | None:
        """The registered participant that ran in one of the ``dead`` processes (actor id first, then pid)."""
        for d in dead:
            for name, p in self.participants.items():
                actor_id = getattr(getattr(p.handle, "_actor_id", None), "hex", lambda: None)()
                if d.get("actor_id") and actor_id == d["actor_id"]:
                    return name
        for d in dead:
            for name, p in self.participants.items():
                if d.get("pid") is not None and p.meta.get("pid") == d["pid"]:
                    return name
        return None

    def blame(self, info: FailureInfo, dead: list[dict]) -> None:
        """Name the failed participant in ``info`` and fill in its step; mark it lost.

        The participant that ran in a ``dead`` process is the one that failed; a
        failure without a step takes that participant's last reported step (a
        survivor may have run on until its collective failed). It is not marked
        lost when its registration is already the restarted process.
        """
        failed = self.participant_of(dead) or info.participant
        info.participant = failed
        p = self.participants.get(failed) if failed else None
        if info.step is None and p is not None:
            # None if it was restarted already (the new process has reported no step): unknown is honest,
            # a survivor's step would be wrong.
            info.step = p.step
        elif info.step is None:  # nobody identified: the furthest any participant got
            info.step = max((q.step for q in self.participants.values() if q.step is not None), default=None)
        dead_pids = {d.get("pid") for d in dead} - {None}
        if p is not None and (not dead_pids or p.meta.get("pid") in dead_pids | {None}):
            p.lost = True
        ManagerMetrics.lost(self.lost_count())
        if info.kind != "heartbeat_lost":
            for q in self.participants.values():  # the group is restarting: silence is expected now
                q.step = None

    def status(self, now: float) -> dict[str, dict]:
        """Each participant's heartbeat age, step, lost flag and registration metadata."""
        return {
            n: {
                "heartbeat_age_s": round(now - p.last_beat, 3),
                "step": p.step,
                "lost": p.lost,
                "last_snapshot": p.last_snapshot,
                **p.meta,
            }
            for n, p in self.participants.items()
        }

    def furthest_step(self) -> int | None:
        steps = [p.step for p in self.participants.values() if p.step is not None]
        return max(steps) if steps else None


class LivenessWatch:
    """The manager's watch thread: every half heartbeat interval (at most 1 s) it expires overdue
    commits and records participants that fell silent.

    ``tick(now)`` runs first on each pass (under ``lock``); silent participants
    make one ``heartbeat_lost`` failure record per incident through ``record``
    (FailureInfo JSON), and with ``kill_hung`` their actors are killed so Ray
    restarts them.
    """

    def __init__(
        self,
        registry: ParticipantRegistry,
        lock: threading.RLock,
        tick: Callable[[float], None],
        record: Callable[[dict], Any],
        kill_hung: bool = False,
    ) -> None:
        self.registry = registry
        self.lock = lock
        self.tick = tick
        self.record = record
        self.kill_hung = kill_hung
        self._last_loss_record = float("-inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rl_ckpt-manager-monitor", daemon=True)

    def start(self) -> "LivenessWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        interval = self.registry.interval
        while not self._stop.wait(min(1.0, interval / 2)):
            now = time.monotonic()
            with self.lock:
                self.tick(now)
                lost = self.registry.newly_lost(now)
            if lost:
                self._heartbeat_lost(lost, now)

    def _heartbeat_lost(self, lost: list[tuple[str, Participant]], now: float) -> None:
        """One failure record per incident: participants that fell silent together are listed together.

        The record names the first of them and the step it last reported (where it stopped).
        """
        with self.lock:
            ManagerMetrics.lost(self.registry.lost_count())
            msg = self.registry.silence_message(lost, now)
        if now - self._last_loss_record < 2 * self.registry.interval:
            return  # the same incident, noticed a watch cycle later for other participants
        self._last_loss_record = now
        names = ", ".join(name for name, _ in lost)
        try:
            self.record(
                FailureInfo(kind="heartbeat_lost", step=lost[0][1].step, message=msg, participant=lost[0][0]).to_json()
            )
        except CheckpointError as exc:
            log.error("could not record heartbeat loss of %s: %s", names, exc)
        if self.kill_hung:
            import ray

            for name, p in lost:
                if p.handle is not None:
                    log.warning("stopping hung participant %s so Ray restarts it", name)
                    ray.kill(p.handle, no_restart=False)
