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
import time
from typing import TYPE_CHECKING, Protocol

from rl_ckpt.errors import ConfigError
from rl_ckpt._recovery.plan import RecoveryPlan
from rl_ckpt._run.tiers import DURABLE, MEMORY

if TYPE_CHECKING:
    from rl_ckpt._recovery.coordinator import FailureInfo


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


def _restores(plan: RecoveryPlan | None) -> bool:
    return plan is not None and plan.action == "restore"


def _skipped(plan: RecoveryPlan) -> str:
    notes = [f"{c.snapshot_id}: {c.reason}" for c in plan.candidates if c.status == "skipped"]
    return ("; skipped in memory: " + "; ".join(notes[:3])) if notes else ""


def choose_tier(memory: RecoveryPlan | None, durable: RecoveryPlan | None) -> TieredPlan:
    """The plan to follow: memory's when its target is at least as new as durable's, else durable's."""
    if _restores(memory) and (not _restores(durable) or memory.continue_from_step >= durable.continue_from_step):
        reason = f"memory snapshot {memory.target} (step {memory.continue_from_step}) is the newest complete one"
        if _restores(durable):
            reason += f"; durable storage's newest usable is {durable.target} (step {durable.continue_from_step})"
        else:
            reason += "; durable storage has none usable"
        return TieredPlan(MEMORY, memory, reason + ": restoring from memory", memory, durable)
    if _restores(durable):
        if memory is None:
            why = "no memory tier"
        elif not _restores(memory):
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


def plan_across_tiers(
    memory: Planner | None, durable: Planner | None, failure: "FailureInfo | None" = None, *, deep: bool = False
) -> TieredPlan:
    """Plan each tier with its engine (``deep``: re-hash every candidate file first; either way every file
    is verified while it loads) and choose between them. Reads storage; writes nothing.

    The two tiers are planned at once (the durable one on a thread of its own: with a manager, each plan is a
    call to that tier's manager, which may re-read its storage), so a restart waits for the slower, not both."""
    seconds: dict[str, float] = {}

    def timed(tier: str, planner: Planner) -> RecoveryPlan:
        started = time.perf_counter()
        try:
            return planner.plan_recovery(failure, deep=deep)
        finally:
            seconds[tier] = time.perf_counter() - started

    if memory is not None and durable is not None:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rl_ckpt-plan-durable") as pool:
            pending = pool.submit(timed, DURABLE, durable)
            mplan = timed(MEMORY, memory)  # this thread: a read session opened here applies
            dplan = pending.result()
    else:
        mplan = timed(MEMORY, memory) if memory is not None else None
        dplan = timed(DURABLE, durable) if durable is not None else None
    if mplan is None and dplan is None:
        raise ConfigError("plan_across_tiers needs at least one engine (memory or durable)", key="engine")
    chosen = choose_tier(mplan, dplan)
    chosen.seconds = seconds
    return chosen
