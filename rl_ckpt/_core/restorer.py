"""The restore path: follow a ``RecoveryPlan`` into the registered objects.

For the plan's target, then each fallback in order: load it (``core/snapshot_loader.py``: schema,
components, light overlay, sharded loads, post-load probes) and (learner ranks of a torch.distributed
group) agree across ranks before going on. A snapshot that fails while loading is skipped with its
reason; one whose probe disagrees is quarantined first. A component that does not fit its object (or a
user object's own load error) stops the restore: falling back would not help.

After a restore, committed snapshots of a later step than the one training
continues after belong to the timeline that failed: they are retired into
``history/retired/`` (``rl_ckpt._run.retire``), once per run, as the engine's
topology says (``Topology.after_restore``): by rank 0 of an engine without a
manager, by the manager when it hands out a managed run's plan
(``RestoreResult.retired`` then repeats what it retired).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterator, Mapping

import torch

from rl_ckpt.config import CheckpointConfig, recorded_config
from rl_ckpt._core.registry import ComponentRegistry
from rl_ckpt._core.snapshot_loader import RestoreResult, SnapshotLoader
from rl_ckpt.errors import CheckpointError, NoValidSnapshotError, RestoreError, StateMismatchError
from rl_ckpt._recovery.coordinator import FailureInfo
from rl_ckpt._recovery.history import load_decisions, record_decision
from rl_ckpt._recovery.plan import (
    RecoveryPlan,
    build_plan,
    coordinator_config,
    new_rank_lines,
    probe_check,
    without_light,
)
from rl_ckpt._recovery.probe import compare
from rl_ckpt._run.catalog import Catalog
from rl_ckpt._run.retire import retire_newer
from rl_ckpt._run.snapshot_files import read_manifest
from rl_ckpt._format.manifest import parse_snapshot_id
from rl_ckpt._storage import Storage

log = logging.getLogger("rl_ckpt")


class Restorer:
    """Plans and follows the recovery of one run into the components of a registry: the target, then the fallbacks
    (each loaded by its :class:`SnapshotLoader`), agreed across ranks, then the failed timeline retired."""

    def __init__(
        self,
        config: CheckpointConfig,
        train_config: Mapping[str, Any],
        storage: Storage,
        catalog: Catalog,
        registry: ComponentRegistry,
    ) -> None:
        self.config = config
        self.train_config = train_config
        self.storage = storage
        self.catalog = catalog
        self.registry = registry
        self.loader = SnapshotLoader(config, train_config, storage, catalog, registry)

    def plan_and_restore(
        self, plan: RecoveryPlan | None, *, snapshot_id: str | None, strict: bool, light: bool, record: bool
    ) -> RestoreResult:
        """``CheckpointEngine.restore``: plan (unless given ``plan``), then follow it, inside one read session of the
        storage (the memory tier: one view of the run for planning and loading); the result's ``timings`` get the
        plan's seconds and the total."""
        started = time.perf_counter()
        with self.storage.read_session():
            if plan is None:
                plan = self.plan(deep=False, snapshot_id=snapshot_id, light=light)
            if not light and plan.light is not None:  # e.g. the manager's plan: report what this restore does
                plan = without_light(self.storage, plan)
            planned = time.perf_counter()
            result = self.restore(plan, strict=strict, light=light, record=record)
        result.timings["plan"] = planned - started
        result.timings["total"] = time.perf_counter() - started
        return result

    def restore(
        self, plan: RecoveryPlan, *, strict: bool = True, light: bool = True, record: bool = True, retire: bool = True
    ) -> RestoreResult:
        """Follow ``plan``: its target, then its fallbacks; NoValidSnapshotError if none loads.

        ``record``: write the coordinator decision the plan carries into the run's decision records.
        ``retire``: retire the snapshots newer than what was loaded (see the module docstring); False
        for a look at an old snapshot that training will not continue from. A plan for a snapshot the
        caller named (``restore(snapshot_id=...)``) retires nothing either.
        """
        recording = time.perf_counter()
        if plan.decision is not None and record:
            record_decision(self.storage, plan.decision)
        recording = time.perf_counter() - recording
        skipped = {c.snapshot_id: c.reason for c in plan.candidates if c.status == "skipped"}
        if plan.action == "start_fresh":
            log.info("recovery: %s", plan.reason)
            return RestoreResult(None, 0, skipped=skipped, warnings=[plan.reason], plan=plan)
        if plan.action == "give_up":
            lines = "\n".join(f"  {sid}: {why}" for sid, why in skipped.items())
            raise NoValidSnapshotError(
                f"recovery of {self.storage.url} gave up: {plan.reason}" + (f"; skipped:\n{lines}" if lines else ""),
                reasons=skipped,
            )
        touched: list[str] = []  # components whose objects got a refused file's bytes (read in place)
        agreeing = 0.0  # seconds in the ranks' agreement: mostly waiting for the slowest rank to get there
        for sid in [plan.target, *plan.fallbacks]:
            result, fatal, error = None, None, None
            try:
                result = self.loader.load(
                    sid, skipped, strict, light=light and (plan.light is not None or sid != plan.target), plan=plan
                )
            except (StateMismatchError, RestoreError) as exc:
                fatal = exc
            except CheckpointError as exc:
                error = str(exc)
            if self.registry.topology.agrees_on_restore():
                # Every rank loaded its own shards; continue only if all did, and all compute the same
                # probe outputs. Otherwise all roll back together to the next snapshot.
                mine = error or (str(fatal) if fatal else None)
                waited = time.perf_counter()
                error, fatal_elsewhere = agree_across_ranks(
                    result is not None, mine, fatal is not None, self.loader.probe_outputs, self.config
                )
                agreeing += time.perf_counter() - waited
                if fatal is None and fatal_elsewhere:
                    fatal = RestoreError(
                        f"{sid}: another rank could not load its state: {fatal_elsewhere}", snapshot_id=sid
                    )
            if fatal is not None:
                raise fatal
            if error is not None:
                skipped[sid] = error
                touched += [k for k in self.loader.report.placed if k not in touched]
                log.warning("recovery: %s failed (%s); falling back to the next snapshot", sid, error)
                continue
            result.plan = plan
            if agreeing:
                result.timings["agree"] = agreeing
            plan.followed(sid, skipped)
            if sid != plan.target:
                result.warnings.append(f"fell back from {plan.target} to {sid}: {skipped[plan.target]}")
            stale = [k for k in touched if k.rsplit("/", 1)[-1] not in result.components]
            if stale:
                result.warnings.append(
                    f"{', '.join(stale)}: read in place from a snapshot refused since, and not in {sid}: their "
                    "objects hold part of the refused snapshot's bytes"
                )
            result.timings["record"] = recording
            retiring = time.perf_counter()
            if retire and not plan.requested:  # a snapshot named by the caller: a look, not a rollback
                self.registry.topology.after_restore(result, plan, self._retire_newer)
            result.timings["retire"] = time.perf_counter() - retiring
            return result
        lines = "\n".join(f"  {sid}: {why}" for sid, why in skipped.items())
        held = (
            f"\nthe objects of {', '.join(touched)} hold part of the bytes of a refused snapshot (read straight into "
            "their tensors before its checksum was compared): rebuild or reload them before training on"
            if touched
            else ""
        )
        raise NoValidSnapshotError(f"no valid snapshot in {self.storage.url}; skipped:\n{lines}{held}", reasons=skipped)

    def _retire_newer(self, result: RestoreResult, plan: RecoveryPlan) -> None:
        """Retire what is newer than ``result`` (on the process the topology names: rank 0 without a manager)."""
        light = f" + light {result.light_snapshot_id}" if result.light_snapshot_id else ""
        loaded = f"{result.snapshot_id}{light}"
        try:
            outcome = retire_newer(
                self.storage,
                self.catalog,
                continue_step=result.global_step,
                loaded=[result.snapshot_id, result.light_snapshot_id],
                restored=loaded,
                by=f"engine rank 0 (pid {os.getpid()})",
                skipped=result.skipped,
            )
        except CheckpointError as exc:  # the state is loaded; the next restore retries
            outcome = None
            result.warnings.append(f"could not retire the snapshots newer than step {result.global_step}: {exc}")
        if outcome is not None:
            result.retired, plan.retired = outcome.retired, outcome.retired
            result.warnings += outcome.warnings

    def plan(
        self,
        failure: FailureInfo | None = None,
        *,
        deep: bool = True,
        snapshot_id: str | None = None,
        light: bool = True,
    ) -> RecoveryPlan:
        """This process's recovery plan (``CheckpointEngine.plan_recovery``): the topology's, with the lines for
        restoring its target onto this process's group of ranks."""

        def build() -> RecoveryPlan:
            return build_plan(
                self.catalog,
                self.storage,
                schema_version=self.config.schema_version,
                components=self.registry.kinds(),
                coordinator=coordinator_config(self.config),
                history=load_decisions(self.storage),
                failure=failure,
                deep=deep,
                snapshot_id=snapshot_id,
                probes=probe_check(self.config),
                restart_mesh=self.registry.restart_mesh(),
                light=light,
                job_config=recorded_config(self.config, self.train_config),
            )

        # The topology's plan: this process's own, or with a manager one plan for all, made (and recorded) by it.
        topology = self.registry.topology
        plan = topology.recovery_plan(
            failure, snapshot_id, self.storage, self.registry.restart_mesh(), build, light=light
        )
        # The restoring group is this process's to know.
        plan.new_ranks = new_rank_lines(
            self.storage, plan.target, self.registry.group(), self.registry.per_rank(), self.config.new_rank_state
        )
        return plan

    def holding_this_participant(self) -> Iterator[str]:
        """Committed full snapshots holding every registered component of this process, newest first (the ones a
        replaced participant can take its own state back from: ``CheckpointEngine.rejoin``); quarantined and
        unreadable ones are passed over."""
        self.catalog.refresh()
        for info in reversed(self.catalog.snapshots("full")):
            if info.quarantined:
                continue
            try:
                manifest = read_manifest(self.storage, info.snapshot_id)
            except CheckpointError as exc:
                log.warning("rejoin: %s passed over: %s", info.snapshot_id, exc)
                continue
            if all(self.registry.stored_key(manifest, reg.name) is not None for reg in self.registry):
                yield info.snapshot_id

    def rejoin(self, newer_than: int | None = None) -> RestoreResult:
        """``CheckpointEngine.rejoin``: the newest snapshot holding this participant (of a step after
        ``newer_than``), loaded by a plan of its own (nothing recorded, nothing retired); older ones when it fails."""
        skipped: dict[str, str] = {}
        for sid in self.holding_this_participant():
            if newer_than is not None and parse_snapshot_id(sid)[0] <= newer_than:
                break
            try:
                plan = self.plan(snapshot_id=sid, deep=False, light=False)
                result = self.restore(plan, light=False, record=False, retire=False)
            except (StateMismatchError, RestoreError):
                raise  # the state does not fit this process: an older snapshot would not either
            except CheckpointError as exc:  # checksum, lost file...: the next older one
                skipped[sid] = str(exc)
                continue
            result.skipped.update(skipped)
            return result
        return RestoreResult(None, 0, skipped=skipped, warnings=["no committed snapshot holds this participant"])

    def load_full_weights(self, name: str, module: torch.nn.Module, snapshot_id: str | None = None) -> str:
        """Load sharded component ``name`` whole into ``module``; returns the snapshot id loaded."""
        from rl_ckpt._sharded import load_full_weights  # (lazy: registry.SHARDED_IMPORT)

        self.catalog.refresh()
        candidates = (
            [snapshot_id]
            if snapshot_id
            else [i.snapshot_id for i in reversed(self.catalog.snapshots("full")) if not i.quarantined]
        )
        for sid in candidates:
            manifest = read_manifest(self.storage, sid)
            if name in manifest.components:
                load_full_weights(self.storage, manifest, name, module)
                return sid
        raise NoValidSnapshotError(
            f"no committed snapshot in {self.storage.url} holds component {name!r}"
            + (f" (looked in {snapshot_id})" if snapshot_id else ""),
            reasons={},
        )


def agree_across_ranks(
    ok: bool, error: str | None, fatal: bool, probe_outputs: dict, cfg
) -> tuple[str | None, str | None]:
    """All-gather every rank's restore outcome and probe outputs (gloo works on CPU).

    Returns ``(error, fatal_error)`` as seen by all ranks: an error if any rank
    failed or the ranks' probe outputs are not allclose.
    """
    dist = torch.distributed
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (ok, error, fatal, probe_outputs))
    fatal_msgs = [f"rank {r}: {e}" for r, (_o, e, f, _p) in enumerate(gathered) if f]
    if fatal_msgs:
        return "; ".join(fatal_msgs), "; ".join(fatal_msgs)
    failed = [f"rank {r}: {e}" for r, (o, e, _f, _p) in enumerate(gathered) if not o]
    if failed:
        return "; ".join(failed), None
    reference = gathered[0][3]
    for r, (_o, _e, _f, outputs) in enumerate(gathered[1:], start=1):
        for name, ref in reference.items():
            if name in outputs and compare(ref, outputs[name], rtol=cfg.probe_rtol, atol=cfg.probe_atol):
                return f"rank {r} computes a different {name!r} than rank 0 after loading", None
    return None, None


__all__ = ["Restorer", "RestoreResult", "agree_across_ranks"]
