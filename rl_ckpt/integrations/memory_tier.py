"""The trainer's side of the memory tier: memory snapshots next to a durable engine (needs Ray).

    engine = CheckpointEngine(cfg)                  # durable: base_dir/run_name, as always
    tier = MemoryTier(engine)                       # memory: raymem://mem/<run_name>
    tier.register("policy", policy); tier.register("optim", optim)
    result = tier.restore()                         # newest complete snapshot across both tiers
    for step in range(result.global_step + 1, ...):
        ...
        tier.maybe_save(step, {"reward": r})        # memory snapshot per memory_interval_steps/seconds

A memory snapshot is written by a second ``CheckpointEngine`` whose storage
is the run's ``raymem://`` stores, so it has the manifest, checksums,
verify-after-write and commit (through the memory manager's two-phase commit
with ``manager=``) of a durable one. The trainer blocks only while the state
is staged, as in ``save_async``; replication is store-to-store and durable
copies are made from memory by the ``MemoryTierService`` actor. The trainer
never writes durable snapshots itself while the tier is on; one participant
records each memory snapshot and each restore across tiers as a small JSON
record in the durable run folder (``memory_tier/``, ``rl_ckpt/_run/tier_events.py``),
which the timeline draws.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

from rl_ckpt._core.engine import CheckpointEngine, RestoreResult
from rl_ckpt.errors import CheckpointError, ConfigError, NoValidSnapshotError
from rl_ckpt._format.manifest import parse_snapshot_id
from rl_ckpt._recovery.tiers import TieredPlan, plan_across_tiers, plan_restores
from rl_ckpt._run.delete import delete_committed_after
from rl_ckpt._run.retention import KeepLatest
from rl_ckpt._run.tier_events import record_memory_snapshot, record_tier_restore
from rl_ckpt._run.tiers import DURABLE, MEMORY, MEMORY_BASE, memory_config, memory_options  # noqa: F401
from rl_ckpt._storage import open_storage

log = logging.getLogger("rl_ckpt")


def view_seconds(storage: Any) -> float | None:
    """Seconds ``storage`` (the memory tier's) has spent taking read sessions' views so far; None if it takes none."""
    return getattr(storage, "view_seconds", None)


class MemoryTier:
    """Memory snapshots of ``engine``'s run (see the module docstring).

    Args:
        engine: the run's durable engine (its config holds the ``memory_*`` keys).
        manager: the memory tier's ``CheckpointManager`` (``actors.memory_tier.memory_manager``) when the
            snapshot has several participants: their memory snapshots then commit through its two-phase commit.
        service: the run's ``MemoryTierService`` handle (told when a memory snapshot committed, so it flushes
            without waiting for its interval); None: no notice (it still looks every interval).
        namespace: the Ray namespace of the run's memory stores.
    """

    def __init__(
        self, engine: CheckpointEngine, *, manager: Any = None, service: Any = None, namespace: str = "rl_ckpt"
    ) -> None:
        cfg = engine.config
        if engine.topology.manager is not None and manager is None:
            raise ConfigError(
                "MemoryTier: this engine commits through a CheckpointManager (several participants), so "
                "memory snapshots need one too: pass manager=actors.memory_tier.memory_manager(config)",
                key="manager",
            )
        self.durable = engine
        self.service = service
        storage = open_storage(f"{MEMORY_BASE}/{cfg.run_name}", memory_options(cfg, namespace))
        participants = engine.topology.participants if manager is not None else None
        self.memory = CheckpointEngine(
            memory_config(cfg),
            train_config=engine.train_config,
            storage=storage,
            retention=KeepLatest(memory_config(cfg).keep_latest),
            manager=manager,
            rank=engine.rank,
            world_size=engine.world_size,
            role=engine.role,
            participants=participants,
        )
        self.last_memory_save = time.monotonic()
        self.last_handle = None

    def register(self, name: str, obj: Any, **kwargs: Any) -> Any:
        """Register a component with both tiers (``CheckpointEngine.register`` arguments)."""
        self.durable.register(name, obj, **kwargs)
        return self.memory.register(name, obj, **kwargs)

    # -- saving ------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether ``step`` is due for a memory snapshot (``memory_interval_steps`` / ``_seconds``)."""
        cfg = self.memory.config
        by_steps = bool(cfg.memory_interval_steps) and step % cfg.memory_interval_steps == 0
        by_time = (
            bool(cfg.memory_interval_seconds)
            and time.monotonic() - self.last_memory_save >= cfg.memory_interval_seconds
        )
        return by_steps or by_time

    def maybe_save(self, step: int, metrics: Mapping[str, Any] | None = None):
        """Take a memory snapshot if ``step`` is due (one decision for every participant); returns its
        ``SaveHandle`` or None."""
        if not self.due(step) or not self.memory.agree_to_save(step):
            return None
        return self.save(step, metrics)

    def save(self, step: int, metrics: Mapping[str, Any] | None = None):
        """Take a memory snapshot now: stage (the only blocking part), then write, verify and commit it in the
        background; returns the ``SaveHandle``."""
        handle = self.memory.save_async(step, metrics)
        self.last_memory_save = time.monotonic()
        self.last_handle = handle
        if self.service is not None:
            service = self.service
            handle.add_done_callback(lambda h: h.exception() is None and service.notify.remote())
        if self.records_events:
            handle.add_done_callback(self._record_snapshot)
        return handle

    @property
    def records_events(self) -> bool:
        """Whether this participant writes the tier's records into the durable run folder (``memory_tier/``):
        the first of a snapshot's participants by name, or the only one."""
        return self.memory.topology.leads

    def _record_snapshot(self, handle) -> None:
        if handle.exception() is not None:
            return
        try:
            record_memory_snapshot(self.durable.storage, handle.wait())
        except CheckpointError as exc:  # a missing record never fails a snapshot
            log.warning(
                "memory snapshot %s: could not record it in %s: %s", handle.global_step, self.durable.storage.url, exc
            )

    def wait(self) -> None:
        """Wait for the memory snapshot in flight."""
        self.memory.wait()

    # -- recovery ----------------------------------------------------------------
    def plan(self, failure=None) -> TieredPlan:
        """The tier and plan a restore follows now (no side effects)."""
        with self.memory.storage.read_session():
            return plan_across_tiers(self.memory, self.durable, failure)

    def restore(self, failure=None, *, strict: bool = True) -> RestoreResult:
        """Restore the newest complete snapshot across tiers (memory preferred on a tie).

        When a memory snapshot fails while loading (every file is verified as it loads) and no older one in
        memory loads, the durable plan is followed. Memory snapshots newer than what was restored belong to
        the timeline that failed: they are retired so the steps are saved anew.
        """
        # One view of the memory stores answers the plan's listings and stats and carries the files it loads
        # (one round trip per store instead of one per listing and file); every file is still verified.
        started = time.perf_counter()
        with self.memory.storage.read_session():
            result = self._restore(failure, strict, started)
        result.timings["total"] = time.perf_counter() - started
        return result

    def _restore(self, failure, strict: bool, started: float) -> RestoreResult:
        # A memory snapshot still copying the objects in the background finishes first: a restore reads straight
        # into the objects' tensors, whichever tier it reads from.
        self.memory.wait()
        views = view_seconds(self.memory.storage)
        prefetch = getattr(self.memory.storage, "prefetch_view", None)
        if prefetch is not None:  # the stores answer while the manager plans (the session's first use waits)
            prefetch()
        # The durable plan is made on a thread of its own (with a manager: its call, which re-hashes the target)
        # while this thread plans memory. When durable storage holds no snapshot newer than memory's target, memory
        # wins whatever the durable plan says, so its snapshot loads while the durable plan is still being made;
        # the tier is chosen from both plans either way, as ``plan()`` chooses it.
        planned = []

        def load_memory(mplan):
            planned.append(time.perf_counter() - started)
            return self._from_memory(mplan, strict)

        tiered = plan_across_tiers(self.memory, self.durable, failure, meanwhile=load_memory)
        loaded = tiered.meanwhile
        if not planned:
            planned.append(time.perf_counter() - started)
            if tiered.tier == MEMORY:
                loaded = self._from_memory(tiered.plan, strict)
        log.info("recovery across tiers: %s", tiered.reason)
        result, why = self._memory_result(tiered, loaded)
        tier, reason = (tiered.tier, tiered.reason) if why is None else (DURABLE, f"{why} ({tiered.reason})")
        if result is None:
            result = self.durable.restore(tiered.durable or tiered.plan, strict=strict)
        result.warnings.insert(0, f"tier: {tier or 'none'} - {reason}")
        result.timings["plan"] = result.timings.get("plan", 0.0) + planned[0]
        # Where the plan went: each tier's plan (at once, on two threads), the wait for the durable plan once
        # memory was loaded or chosen, and the views of the memory stores this restore's read session took (the
        # store listing and one call to each store).
        result.timings.update({f"plan_{tier}": s for tier, s in tiered.seconds.items()})
        result.timings["durable_wait"] = tiered.durable_wait
        if views is not None:
            result.timings["memory_views"] = view_seconds(self.memory.storage) - views
        self.tier_restored = tier if result.snapshot_id is not None else None
        if self.tier_restored is not None and self.records_events:
            self._record_restore(tiered, result)
        self._retire_newer(result.global_step if result.snapshot_id is not None else -1)
        return result

    @staticmethod
    def _memory_result(tiered: TieredPlan, loaded) -> tuple[RestoreResult | None, str | None]:
        """What memory restored, if it is what the restore returns; else (None, why durable storage is restored
        instead: None when durable was the tier chosen)."""
        if tiered.tier != MEMORY or loaded is None:
            return None, None
        result, failed = loaded
        if result is None:
            if tiered.durable is None:
                raise failed
            return None, f"every memory snapshot of the plan failed while loading: {failed}"
        durable = tiered.durable
        if plan_restores(durable) and result.global_step < durable.continue_from_step:
            return None, (
                f"memory fell back to {result.snapshot_id} (step {result.global_step}), older than durable "
                f"storage's {durable.target}: {'; '.join(f'{k}: {v}' for k, v in result.skipped.items())[:500]}"
            )
        return result, None

    def _from_memory(self, plan, strict: bool) -> tuple[RestoreResult | None, NoValidSnapshotError | None]:
        """Follow the memory plan: (its result, None), or (None, why) when none of its snapshots loaded."""
        try:
            return self.memory.restore(plan, strict=strict), None
        except NoValidSnapshotError as exc:
            log.warning("memory snapshots failed while loading (%s); restoring from durable storage", exc)
            return None, exc

    tier_restored: str | None = None

    def rejoin(self) -> RestoreResult:
        """A replaced participant takes back its own state (``CheckpointEngine.rejoin``) from the newest committed
        snapshot holding it across both tiers, memory first on a tie (it loads fastest); a memory snapshot that
        fails (its store lost, a checksum) falls back to older ones, then to durable storage. Nothing run-wide
        happens: no plan, no decision, nothing retired; the other participants go on."""
        with self.memory.storage.read_session():
            newest_durable = next(self.durable.restorer.holding_this_participant(), None)
            floor = parse_snapshot_id(newest_durable)[0] - 1 if newest_durable else None
            result = self.memory.rejoin(newer_than=floor)  # a memory snapshot as new as durable's newest, or newer
            self.tier_restored = MEMORY if result.snapshot_id is not None else None
            if result.snapshot_id is None:
                skipped = result.skipped
                result = self.durable.rejoin()
                result.skipped.update(skipped)
                self.tier_restored = DURABLE if result.snapshot_id is not None else None
        return result

    def _record_restore(self, tiered: TieredPlan, result: RestoreResult) -> None:
        decision = tiered.durable.decision if tiered.durable is not None else None
        restored = tiered.memory if self.tier_restored == MEMORY else tiered.durable
        plan = restored if restored is not None else tiered.plan
        try:
            record_tier_restore(
                self.durable.storage, self.tier_restored, result.snapshot_id, result.global_step, plan, decision
            )
        except CheckpointError as exc:
            log.warning(
                "could not record the restore of %s in %s: %s", result.snapshot_id, self.durable.storage.url, exc
            )

    def _retire_newer(self, step: int) -> None:
        """Memory snapshots of a step after ``step`` belong to the timeline that failed: the participant that
        leads deletes the committed ones (``delete_committed_after``: only what their manifests name, since
        another participant may already be saving the new timeline's next step beside them)."""
        if not self.memory.topology.leads:
            return
        retired = delete_committed_after(self.memory.storage, step)
        if retired:
            log.info("memory tier: deleted %s of the failed timeline (newer than step %d)", ", ".join(retired), step)

    def close(self) -> None:
        """Wait for the memory snapshot in flight and close both engines."""
        self.memory.close()
        self.durable.close()
