"""``RolloutPool``: the learners' handle on their rollout workers, where losing one costs only its missing work.

    pool = RolloutPool(workers, names=["rollout-0", "rollout-1"], managers=[manager])
    batches = pool.call("collect", [(weights, 128, step)] * len(pool), step=step)  # one result per worker
    pool.cast("save", [(step, "full")] * len(pool), step=step, save=True)          # fire and forget, journaled

A worker that dies during a call (SIGKILL, an actor death, its node removed) is recovered by the pool alone: the
learners and the other workers go on, nothing rolls back, Ray Train does not restart. The learners wait for the
missing batch only:

1. **A replacement.** Ray's restart of the actor (``max_restarts=-1``), or, when the pool holds warm standbys
   (``standbys=``), one of them takes the lost worker's identity at once (``standby.assume(index)``); the dead actor
   is killed for good first, so one process at most answers to a participant name.
2. **Its own state back** (``worker.rejoin()``): the newest committed snapshot holding that participant, memory tier
   first, verified (``CheckpointEngine.rejoin``); it answers that snapshot's step (``None``: nothing committed holds
   it yet, it goes on from its constructor's state).
3. **Caught up** (``worker.replay(calls)``): the calls the pool made to it after that step, journaled in order with
   their arguments (e.g. each step's policy weights, or the policy version to pull), run again and their outputs
   thrown away. A journaled save (``cast(..., save=True)``) is taken again only when a manager still waits for that
   snapshot's part from this participant (``CheckpointManager.awaiting``), so the snapshot commits as if nothing
   happened; a save already committed is not taken twice.
4. **The failed call, issued again**; its result joins the others'.

The journal keeps the calls after the newest step a worker could be asked to rejoin from: ``truncate(step)`` once a
snapshot of ``step`` holding every worker is committed (durably, if a memory snapshot may be lost with its node),
``journal_steps`` at most. When a recovery cannot be exact (the state came back from before the journal's start, no
replacement comes up, the worker keeps dying), the pool raises ``ParticipantFailedError``: the failure goes up the
ladder to a group restart, as without a pool.

What it asks of a worker (``ScopedWorker`` gives ``replay`` and ``ping``): its results and state after a call are a
function of its state before and the call's arguments (seeded RNG streams in its snapshot, no wall clock, an env that
is deterministic given its seed); ``rejoin()`` restores its registered state and returns the step (a stateless worker,
whose calls carry all they need, returns ``{"snapshot_id": None, "step": None}`` and its calls go unjournaled,
``record=False``: the lost call is simply issued again); a standby also has ``assume(index)``, ``index`` being the
number ending the lost worker's name (``rollout-3``: 3). What it redid is in ``pool.recoveries`` (``Recovery``) and the
log.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Sequence

from rl_ckpt._format.manifest import parse_snapshot_id
from rl_ckpt.errors import ParticipantFailedError

log = logging.getLogger("rl_ckpt")


@dataclasses.dataclass
class Recovery:
    """One scoped recovery: who was lost, how it came back, what it redid and what it cost."""

    participant: str
    step: int  # the learners' step whose call failed
    method: str
    cause: str
    replacement: str  # "restart" (Ray's restart of the actor) or "standby"
    restored: str | None  # the snapshot it took its state back from (None: none held it yet)
    restored_step: int | None
    tier: str | None  # "memory" / "durable" when the worker says
    skipped: dict  # snapshots its rejoin passed over (damaged, lost), with why
    replayed_steps: list[int]
    saves_completed: list[int]  # steps of pending snapshots its replay reported
    seconds: float  # failure seen -> the call's result in hand
    replace_seconds: float  # of which: until the replacement answered
    rejoin_seconds: float
    replay_seconds: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def line(self) -> str:
        source = f"{self.restored} ({self.tier})" if self.restored else "its initial state (no snapshot held it)"
        steps = f"steps {self.replayed_steps[0]}-{self.replayed_steps[-1]}" if self.replayed_steps else "nothing"
        saves = f"; completed the pending save of step {self.saves_completed}" if self.saves_completed else ""
        if self.skipped:
            saves += f"; passed over {', '.join(self.skipped)} (damaged or lost)"
        redo = f"state from {source}, replayed {steps}{saves}"
        if not (self.restored or self.replayed_steps or self.saves_completed):
            redo = "nothing to restore or replay"  # e.g. a stateless worker: its calls carry all it needs
        return (
            f"{self.participant} lost at step {self.step} ({self.cause[:120]}): {self.replacement} in "
            f"{self.replace_seconds:.2f} s, {redo}; the {self.method} of step "
            f"{self.step} issued again: {self.seconds:.2f} s in all, no learner step undone"
        )


def _index(name: str, position: int) -> int:
    """What a standby's ``assume`` is given for the worker named ``name``: the number its name ends with
    (``rollout-3``: 3, whichever position it has in its pool), else its ``position``."""
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else position


class ScopedWorker:
    """What a :class:`RolloutPool` calls on a worker besides its own methods (mix into the actor class):
    ``replay`` runs journaled calls again, discarding their outputs; ``ping`` answers once the actor is up.
    The worker itself provides ``rejoin()`` (and ``assume(index)`` to serve as a standby)."""

    def replay(self, calls: list[dict]) -> int:
        for call in calls:
            getattr(self, call["method"])(*call["args"], **call["kwargs"])
        return len(calls)

    def ping(self) -> str:
        return "ok"


@dataclasses.dataclass
class _Entry:
    step: int
    method: str
    args: tuple
    kwargs: dict
    save: bool

    def call(self) -> dict:
        return {"method": self.method, "args": self.args, "kwargs": self.kwargs}


class RolloutPool:
    """Rollout worker actors with failure-scoped, exact recovery (see the module docstring).

    Args:
        workers: the worker actor handles (a class mixing in :class:`ScopedWorker`, ``max_restarts=-1`` unless
            standbys replace them).
        names: their participant names (default ``rollout-<i>``), as their engines register them.
        managers: the ``CheckpointManager`` handles their snapshots commit through (durable, memory tier): asked
            which pending snapshots still wait for a replaced worker's part.
        standbys: warm workers of the same class, ready to ``assume`` a lost worker's identity.
        standby_factory: makes a new standby (called in the background after one is used).
        journal_steps: the journal keeps calls of this many steps at most.
        timeout: seconds a replacement may take to come up, rejoin and replay before the failure goes up.
        attempts: recoveries of one call before the failure goes up (a worker that dies again and again).
        on_recovery: called with each :class:`Recovery` (e.g. the learner's log).
    """

    def __init__(
        self,
        workers: Sequence[Any],
        names: Sequence[str] | None = None,
        *,
        managers: Sequence[Any] = (),
        standbys: Sequence[Any] = (),
        standby_factory: Callable[[], Any] | None = None,
        journal_steps: int = 64,
        timeout: float = 300.0,
        attempts: int = 3,
        on_recovery: Callable[[Recovery], None] | None = None,
    ) -> None:
        self.workers = list(workers)
        self.names = list(names) if names is not None else [f"rollout-{i}" for i in range(len(self.workers))]
        if len(self.names) != len(self.workers):
            raise ValueError(f"RolloutPool: {len(self.workers)} workers but {len(self.names)} names")
        self.managers = [m for m in managers if m is not None]
        self.standbys = list(standbys)
        self.standby_factory = standby_factory
        self.journal_steps = journal_steps
        self.timeout = timeout
        self.attempts = attempts
        self.on_recovery = on_recovery
        self.journal: list[list[_Entry]] = [[] for _ in self.workers]
        self.floor: list[int | None] = [None] * len(self.workers)  # entries at or before it were dropped
        self.recoveries: list[Recovery] = []

    def __len__(self) -> int:
        return len(self.workers)

    # -- calls ------------------------------------------------------------------------------------------------
    def call(self, method: str, args: Sequence[tuple] | None = None, *, step: int, record: bool = True) -> list:
        """``method`` on every worker (``args[i]`` for worker ``i``); their results in order. A worker lost during
        the call is recovered (see the module docstring) and its call issued again; ``record``: journal the calls
        (False for calls that leave no state behind)."""
        import ray

        args = list(args) if args is not None else [()] * len(self.workers)
        refs = {i: getattr(w, method).remote(*args[i]) for i, w in enumerate(self.workers)}
        out: list = [None] * len(self.workers)
        while refs:
            ready, _ = ray.wait(list(refs.values()), num_returns=1)
            i = next(i for i, r in refs.items() if r == ready[0])
            del refs[i]
            out[i] = self._result(i, ready[0], method, tuple(args[i]), step)
        if record:
            for i in range(len(self.workers)):
                self._record(i, _Entry(step, method, tuple(args[i]), {}, False))
        return out

    def call_one(self, index: int, method: str, *args: Any, step: int, record: bool = True) -> Any:
        """``method`` on worker ``index`` alone (recovered the same way)."""
        result = self._result(index, getattr(self.workers[index], method).remote(*args), method, args, step)
        if record:
            self._record(index, _Entry(step, method, args, {}, False))
        return result

    def cast(self, method: str, args: Sequence[tuple] | None = None, *, step: int, save: bool = False) -> None:
        """``method`` on every worker without waiting (its failure shows at the worker's next call), journaled;
        ``save``: it is a save, replayed only while a manager still waits for its part (see the docstring)."""
        args = list(args) if args is not None else [()] * len(self.workers)
        for i, w in enumerate(self.workers):
            getattr(w, method).remote(*args[i])
            self._record(i, _Entry(step, method, tuple(args[i]), {}, save))

    def truncate(self, step: int) -> None:
        """Forget journaled calls of ``step`` and before: a snapshot of ``step`` holding every worker committed."""
        for i, entries in enumerate(self.journal):
            kept = [e for e in entries if e.step > step]
            if len(kept) != len(entries):
                self.floor[i] = max(self.floor[i] or step, step)
            self.journal[i] = kept

    def _record(self, i: int, entry: _Entry) -> None:
        entries = self.journal[i]
        entries.append(entry)
        oldest = entry.step - self.journal_steps
        if entries[0].step <= oldest:
            self.journal[i] = [e for e in entries if e.step > oldest]
            self.floor[i] = max(self.floor[i] or oldest, oldest)

    # -- recovery ---------------------------------------------------------------------------------------------
    def _result(self, i: int, ref: Any, method: str, args: tuple, step: int) -> Any:
        """The call's result; a worker lost meanwhile is recovered and the call issued again (``attempts`` times)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        pending: Recovery | None = None
        seen = 0.0
        lost: BaseException | None = None  # the loss still to recover from
        for attempt in range(self.attempts + 1):
            if lost is None:
                try:
                    result = ray.get(ref)
                except RayActorError as exc:
                    lost = exc
                else:
                    if pending is not None:
                        pending.seconds = time.monotonic() - seen
                        self.recoveries.append(pending)
                        log.warning("rollout pool: %s", pending.line())
                        if self.on_recovery is not None:
                            self.on_recovery(pending)
                    return result
            if attempt == self.attempts:
                raise self._give_up(i, step, f"lost {attempt + 1} times during one call: {lost}", lost) from lost
            seen = seen or time.monotonic()
            try:
                ref, pending = self._recover(i, method, args, step, lost, seen)
                lost = None
            except RayActorError as again:  # the replacement died too: the next attempt starts over
                log.warning("rollout pool: the replacement of %s was lost too: %s", self.names[i], again)
                lost = again
            except GetTimeoutError as slow:
                raise self._give_up(i, step, f"no replacement within {self.timeout} s ({slow})", lost) from lost
        raise self._give_up(i, step, f"lost {self.attempts + 1} times during one call", lost)

    def _recover(
        self, i: int, method: str, args: tuple, step: int, exc: BaseException, seen: float
    ) -> tuple[Any, Recovery]:
        """Bring worker ``i`` back to where the failed call found it and issue the call again: its ref, and the
        recovery to record once the call's result is in."""
        import ray

        name = self.names[i]
        cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log.warning("rollout pool: %s lost during %s of step %d (%s); recovering it alone", name, method, step, cause)
        replacement = self._replace(i)
        self._wait_up(i)
        up = time.monotonic()
        back = ray.get(self.workers[i].rejoin.remote(), timeout=self.timeout) or {}
        rejoined = time.monotonic()
        restored_step = back.get("step")
        floor = self.floor[i]
        if floor is not None and (restored_step is None or restored_step < floor):
            raise self._give_up(
                i,
                step,
                f"its state came back from step {restored_step}, before the journal's start (step {floor + 1}): "
                "the calls since cannot be replayed (truncate later, or keep more journal_steps)",
                exc,
            )
        awaited = self._awaited(name)
        calls = [
            e
            for e in self.journal[i]
            if (restored_step is None or e.step > restored_step) and (not e.save or e.step in awaited)
        ]
        if calls:  # nothing journaled since (e.g. calls with record=False): no round trip
            ray.get(self.workers[i].replay.remote([e.call() for e in calls]), timeout=self.timeout)
        replayed = time.monotonic()
        event = Recovery(
            participant=name,
            step=step,
            method=method,
            cause=cause,
            replacement=replacement,
            restored=back.get("snapshot_id"),
            restored_step=restored_step,
            tier=back.get("tier"),
            skipped=dict(back.get("skipped") or {}),
            replayed_steps=sorted({e.step for e in calls if not e.save}),
            saves_completed=sorted({e.step for e in calls if e.save}),
            seconds=0.0,
            replace_seconds=up - seen,
            rejoin_seconds=rejoined - up,
            replay_seconds=replayed - rejoined,
        )
        return getattr(self.workers[i], method).remote(*args), event

    def _wait_up(self, i: int) -> None:
        """Until worker ``i`` answers: Ray refuses calls to an actor it is restarting (``ActorUnavailableError``)
        rather than queueing them, and has no event for the restart done, so it is asked again, backing off
        (10 ms doubling to 200 ms), ``timeout`` at most. A death meanwhile (``ActorDiedError``) is a new loss."""
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError

        deadline = time.monotonic() + self.timeout
        pause = 0.01
        while True:
            try:
                ray.get(self.workers[i].ping.remote(), timeout=max(0.0, deadline - time.monotonic()))
                return
            except ActorUnavailableError:
                if time.monotonic() + pause > deadline:
                    raise GetTimeoutError(f"{self.names[i]} did not come back within {self.timeout} s") from None
                time.sleep(pause)
                pause = min(pause * 2, 0.2)

    def _replace(self, i: int) -> str:
        """Worker ``i``'s replacement: a standby taking its identity, else Ray's restart of the actor."""
        import ray

        if not self.standbys:
            return "restart"
        dead = self.workers[i]
        try:
            ray.kill(dead, no_restart=True)  # one process per participant name: Ray must not bring it back too
        except Exception:  # already gone for good
            pass
        standby = self.standbys.pop(0)
        ray.get(standby.assume.remote(_index(self.names[i], i)), timeout=self.timeout)
        self.workers[i] = standby
        if self.standby_factory is not None:
            self.standbys.append(self.standby_factory())  # warmed in the background for the next loss
        return "standby"

    def _awaited(self, participant: str) -> set[int]:
        """Steps of the snapshots a manager still waits for ``participant``'s part of."""
        import ray

        steps: set[int] = set()
        for manager in self.managers:
            for sid in ray.get(manager.awaiting.remote(participant), timeout=60):
                parsed = parse_snapshot_id(sid)
                if parsed is not None:
                    steps.add(parsed[0])
        return steps

    def _give_up(self, i: int, step: int, why: str, exc: BaseException) -> ParticipantFailedError:
        from rl_ckpt.integrations.ray_train import dead_pid  # (lazy: ray.train, not for a rollout worker's import)

        name = self.names[i]
        log.error("rollout pool: %s cannot be recovered alone (%s); the failure goes up to a group restart", name, why)
        return ParticipantFailedError(
            f"{name} died after step {step} and could not be recovered alone: {why}",
            participant=name,
            step=step,
            kind="process_killed",
            actor_id=getattr(exc, "actor_id", None),
            pid=dead_pid(exc),
        )
