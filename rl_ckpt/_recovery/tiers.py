"""Recovery across tiers: the newest complete, verifiable snapshot in memory or on durable storage.

Each tier gets its ordinary :class:`RecoveryPlan` (built on that tier's
storage, with its own checks and fallbacks); ``choose_tier`` then takes the
one whose target is newer, memory on a tie (it loads fastest), and says which
tier and why. A memory snapshot is one snapshot of every participant: when any
participant's files of it are gone (its node died and no replica survived) it
fails its checks as a whole, so no participant loads it and, unless an older
memory snapshot is complete and newer than durable storage's newest, every
participant restores the newest complete durable snapshot. Whatever is chosen
is still verified file by file while it loads (``engine.restore``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from rl_ckpt.errors import CheckpointError, ConfigError
from rl_ckpt._recovery.plan import RecoveryPlan
from rl_ckpt._run.layout import newest_folder_step
from rl_ckpt._run.tiers import DURABLE, MEMORY

if TYPE_CHECKING:
    from rl_ckpt._recovery.coordinator import FailureInfo

log = logging.getLogger("rl_ckpt")


class Planner(Protocol):
    """What a tier needs to be planned: an engine's ``plan_recovery`` (``CheckpointEngine`` has it)."""

    def plan_recovery(self, failure: "FailureInfo | None" = None, *, deep: bool = True) -> RecoveryPlan: ...


@dataclasses.dataclass
class TieredPlan:
    """The tier to restore from (None: nothing to restore), that tier's plan, and why."""

    tier: str | None
    plan: RecoveryPlan
    reason: str
    memory: RecoveryPlan | None = None
    durable: RecoveryPlan | None = None
    seconds: dict = dataclasses.field(default_factory=dict)  # each tier's plan: "memory", "durable" (wall seconds)
    durable_wait: float = 0.0  # seconds this thread waited for the durable plan once memory's was made (and used)
    meanwhile: Any = dataclasses.field(default=None, repr=False)  # what ``plan_across_tiers``' ``meanwhile`` returned

    def to_json(self) -> dict:
        return {
            "tier": self.tier,
            "reason": self.reason,
            "plan": self.plan.to_json(),
            "memory": self.memory.to_json() if self.memory else None,
            "durable": self.durable.to_json() if self.durable else None,
        }

    @classmethod
    def from_json(cls, d: dict) -> "TieredPlan":
        memory = RecoveryPlan.from_json(d["memory"]) if d.get("memory") else None
        durable = RecoveryPlan.from_json(d["durable"]) if d.get("durable") else None
        return cls(d["tier"], RecoveryPlan.from_json(d["plan"]), d["reason"], memory, durable)

    def __str__(self) -> str:
        head = f"tier:        {self.tier or 'none'} - {self.reason}"
        return head + "\n" + str(self.plan)


def plan_restores(plan: RecoveryPlan | None) -> bool:
    """Whether ``plan`` restores a snapshot (not: start fresh, give up, no plan)."""
    return plan is not None and plan.action == "restore"


def _skipped(plan: RecoveryPlan) -> str:
    notes = [f"{c.snapshot_id}: {c.reason}" for c in plan.candidates if c.status == "skipped"]
    return ("; skipped in memory: " + "; ".join(notes[:3])) if notes else ""


def choose_tier(memory: RecoveryPlan | None, durable: RecoveryPlan | None) -> TieredPlan:
    """The plan to follow: memory's when its target is at least as new as durable's, else durable's."""
    newer = plan_restores(memory) and (
        not plan_restores(durable) or memory.continue_from_step >= durable.continue_from_step
    )
    if newer:
        reason = f"memory snapshot {memory.target} (step {memory.continue_from_step}) is the newest complete one"
        if plan_restores(durable):
            reason += f"; durable storage's newest usable is {durable.target} (step {durable.continue_from_step})"
        else:
            reason += "; durable storage has none usable"
        return TieredPlan(MEMORY, memory, reason + ": restoring from memory", memory, durable)
    if plan_restores(durable):
        if memory is None:
            why = "no memory tier"
        elif not plan_restores(memory):
            why = f"the memory tier has no usable snapshot ({memory.reason}){_skipped(memory)}"
        else:
            why = (
                f"memory's newest usable snapshot {memory.target} (step {memory.continue_from_step}) is older"
                f"{_skipped(memory)}"
            )
        reason = f"durable snapshot {durable.target} (step {durable.continue_from_step}): {why}"
        return TieredPlan(DURABLE, durable, reason, memory, durable)
    chosen = durable if durable is not None else memory
    return TieredPlan(None, chosen, f"no tier has a snapshot to restore: {chosen.reason}", memory, durable)


class DurablePlanning:
    """The durable tier's plan, made on a thread of its own while this thread plans the memory tier.

    The thread first lists durable storage's snapshot folders once (``newest_step``: a bound on the step any
    durable plan can target, known long before the plan itself when a manager makes it), then makes the plan
    (with a manager, one call to it: it may re-read and re-hash its storage). ``plan()`` waits for it."""

    def __init__(self, durable: Planner, failure: "FailureInfo | None" = None, *, deep: bool = False) -> None:
        self.seconds: float | None = None  # the thread's listing and plan, once done
        self._listed: concurrent.futures.Future = concurrent.futures.Future()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rl_ckpt-plan-durable")
        self._plan = self._pool.submit(self._run, durable, failure, deep)

    def _run(self, durable: Planner, failure: "FailureInfo | None", deep: bool) -> RecoveryPlan:
        started = time.perf_counter()
        try:
            storage = getattr(durable, "storage", None)
            try:
                self._listed.set_result(newest_folder_step(storage) if storage is not None else None)
            except CheckpointError as exc:  # not known: whoever asks waits for the plan
                log.info("durable storage could not be listed ahead of its plan: %s", exc)
                self._listed.set_result(None)
            except BaseException:
                self._listed.set_result(None)
                raise
            return durable.plan_recovery(failure, deep=deep)
        finally:
            self.seconds = time.perf_counter() - started

    def newest_step(self) -> int | None:
        """The newest durable snapshot folder's step (-1: none); None when the listing failed."""
        return self._listed.result()

    def plan(self) -> RecoveryPlan:
        """The durable plan (waits for it; raises what planning raised)."""
        return self._plan.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def memory_is_newest(memory: RecoveryPlan | None, newest_durable_step: int | None) -> bool:
    """Whether the memory plan restores a step no durable plan can beat: durable storage holds no snapshot folder
    newer (so ``choose_tier`` takes memory whatever the durable plan says, unless a snapshot is committed there
    meanwhile). A restore may then load memory while the durable plan is still being made."""
    if not plan_restores(memory) or newest_durable_step is None:
        return False
    return memory.continue_from_step >= newest_durable_step


def plan_across_tiers(
    memory: Planner | None,
    durable: Planner | None,
    failure: "FailureInfo | None" = None,
    *,
    deep: bool = False,
    meanwhile: Callable[[RecoveryPlan], Any] | None = None,
) -> TieredPlan:
    """Plan each tier with its engine (``deep``: re-hash every candidate file first; either way every file
    is verified while it loads) and choose between them. Reads storage; writes nothing itself.

    The two tiers are planned at once (the durable one on a thread of its own, ``DurablePlanning``), so a
    restart waits for the slower, not both. ``meanwhile(memory_plan)`` is called on this thread once memory's
    plan is made, if durable storage holds no snapshot newer than its target (``memory_is_newest``: memory
    wins whatever the durable plan says), while the durable plan is still being made; what it returns is the
    chosen plan's ``meanwhile`` (a restore loads memory there)."""
    if memory is None and durable is None:
        raise ConfigError("plan_across_tiers needs at least one engine (memory or durable)", key="engine")
    seconds: dict[str, float] = {}
    planning = DurablePlanning(durable, failure, deep=deep) if durable is not None else None
    early, waited = None, 0.0
    try:
        mplan = None
        if memory is not None:  # this thread: a read session opened here applies
            started = time.perf_counter()
            mplan = memory.plan_recovery(failure, deep=deep)
            seconds[MEMORY] = time.perf_counter() - started
            if meanwhile is not None and planning is not None and memory_is_newest(mplan, planning.newest_step()):
                early = meanwhile(mplan)
        waited = time.perf_counter()
        dplan = planning.plan() if planning is not None else None
        waited = time.perf_counter() - waited
    finally:
        if planning is not None:
            planning.close()
            seconds[DURABLE] = planning.seconds
    chosen = choose_tier(mplan, dplan)
    chosen.seconds, chosen.durable_wait, chosen.meanwhile = seconds, waited, early
    return chosen
