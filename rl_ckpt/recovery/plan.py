"""``RecoveryPlan``: what a restore will do and why, computed without side effects.

enumerate snapshots -> verify checksums -> read manifests -> check schema and
config -> choose a target (newest valid, or what the coordinator decided for a
failure) -> ordered load actions -> post-load checks -> the step to continue
from. Every choice carries its reason; ``str(plan)`` is the report a person
reads (``rl-ckpt plan URL``). ``engine.restore(plan)`` executes it and falls
back along ``plan.fallbacks`` when a step fails.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rl_ckpt.run.catalog import SnapshotInfo
from rl_ckpt.recovery.coordinator import Action, CoordinatorConfig, Decision, FailureInfo, RecoveryCoordinator
from rl_ckpt.errors import CheckpointError, SchemaVersionError
from rl_ckpt.format.manifest import Manifest, now_iso
from rl_ckpt.core.reader import read_manifest, verify_snapshot
from rl_ckpt.sharded.layout import layout_change, restart_layout

if TYPE_CHECKING:
    from rl_ckpt.core.engine import CheckpointEngine

# Load order: weights, optimizer, scheduler, RNG, buffer, env/other, progress last.
LOAD_ORDER = ("module", "optimizer", "scheduler", "rng", "buffer", "other", "progress")


@dataclasses.dataclass
class CandidateNote:
    snapshot_id: str
    global_step: int
    kind: str
    status: str  # chosen | light | skipped | fallback | quarantined | not needed
    reason: str


@dataclasses.dataclass
class LoadAction:
    component: str
    kind: str
    snapshot_id: str
    files: int
    bytes: int


@dataclasses.dataclass
class RecoveryPlan:
    run_url: str
    action: str  # restore | start_fresh | give_up
    reason: str
    target: str | None = None
    light: str | None = None
    continue_from_step: int = 0
    candidates: list[CandidateNote] = dataclasses.field(default_factory=list)
    actions: list[LoadAction] = dataclasses.field(default_factory=list)
    checks: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    fallbacks: list[str] = dataclasses.field(default_factory=list)
    failure: FailureInfo | None = None
    decision: Decision | None = None
    deep: bool = True
    layout: str = ""  # sharded components: the layout saved and the one restored onto (rl_ckpt.sharded.layout)
    created_at: str = dataclasses.field(default_factory=now_iso)

    @property
    def fresh(self) -> bool:
        return self.action == "start_fresh"

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["failure"] = self.failure.to_json() if self.failure else None
        d["decision"] = self.decision.to_json() if self.decision else None
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RecoveryPlan":
        d = dict(d)
        d["candidates"] = [CandidateNote(**c) for c in d.get("candidates", [])]
        d["actions"] = [LoadAction(**a) for a in d.get("actions", [])]
        d["failure"] = FailureInfo.from_json(d["failure"]) if d.get("failure") else None
        d["decision"] = Decision.from_json(d["decision"]) if d.get("decision") else None
        return cls(**d)

    def __str__(self) -> str:
        lines = [f"Recovery plan for {self.run_url}  ({'checksums verified' if self.deep else 'sizes checked'}; {self.created_at})"]
        if self.failure is not None:
            f = self.failure
            first = f.message.strip().splitlines()[0] if f.message.strip() else ""
            lines.append(f"  failure:   {f.kind} at step {f.step}: {first[:240]}".rstrip(": "))
        if self.decision is not None:
            lines.append(f"  decision:  {self.decision.action} - {self.decision.reason}")
        if self.action == "restore":
            lines.append(f"  target:    {self.target}" + (f" + light {self.light}" if self.light else ""))
            lines.append(f"  why:       {self.reason}")
            lines.append(f"  continue:  training resumes after step {self.continue_from_step}")
            if self.layout:
                lines.append(f"  layout:    {self.layout}")
        else:
            lines.append(f"  action:    {self.action.upper()} - {self.reason}")
        if self.candidates:
            lines.append("  snapshots (newest first):")
            for c in self.candidates:
                lines.append(f"    {c.snapshot_id:<28} step {c.global_step:<9} {c.kind:<5} {c.status:<11} {c.reason}")
        if self.actions:
            lines.append("  load, in order:")
            for i, a in enumerate(self.actions, 1):
                lines.append(f"    {i}. {a.component:<16} ({a.kind}) from {a.snapshot_id}: {a.files} file(s), {a.bytes} bytes")
        if self.checks:
            lines.append("  after loading:")
            lines += [f"    - {c}" for c in self.checks]
        if self.fallbacks:
            lines.append(f"  if a step fails: fall back to {', '.join(self.fallbacks)}")
        for w in self.warnings:
            lines.append(f"  WARNING: {w}")
        return "\n".join(lines)


def coordinator_config(cfg) -> CoordinatorConfig:
    metric = cfg.best_metric[0] if isinstance(cfg.best_metric, list) else cfg.best_metric
    mode = cfg.best_mode[0] if isinstance(cfg.best_mode, list) else cfg.best_mode
    return CoordinatorConfig(max_failures=cfg.max_failures, max_same_snapshot_failures=cfg.max_same_snapshot_failures,
                             max_acceptable_loss_steps=cfg.max_acceptable_loss_steps,
                             divergence_threshold=cfg.divergence_threshold, best_metric=metric, best_mode=mode)


def _check(engine: "CheckpointEngine", info: SnapshotInfo, deep: bool) -> Manifest:
    """The snapshot's manifest if it is usable, else CheckpointError saying why.

    The manifest is the one the catalog parsed (or re-validated by its stat version) in the
    refresh that starts every plan, so a restore parses each manifest once."""
    sid = info.snapshot_id
    manifest = info.manifest if info.manifest is not None else read_manifest(engine.storage, sid)
    engine._check_schema(manifest)
    if deep:
        report = verify_snapshot(engine.storage, sid)
        if not report.ok:
            raise CheckpointError("; ".join(f"{p.path}: {p.problem}" for p in report.problems[:3]), snapshot_id=sid)
    else:
        for f in manifest.files:
            path = f"{sid}/{f.path}"
            if not engine.storage.exists(path) or engine.storage.size(path) != f.size:
                raise CheckpointError(f"{f.path}: missing or wrong size", snapshot_id=sid)
    return manifest


def build_plan(engine: "CheckpointEngine", failure: FailureInfo | None = None, *, deep: bool = True,
               snapshot_id: str | None = None, light: bool = True, history: list[Decision] | None = None) -> RecoveryPlan:
    """Compute a RecoveryPlan for ``engine``'s run. Reads storage; writes nothing."""
    engine.catalog.refresh()
    cat = engine.catalog
    plan = RecoveryPlan(engine.storage.url, "start_fresh", "", failure=failure, deep=deep)
    fulls = list(reversed(cat.snapshots("full")))
    for info in fulls:
        if info.quarantined:
            plan.candidates.append(CandidateNote(info.snapshot_id, info.global_step, "full", "quarantined", info.quarantined))
    for bad in cat.unreadable():
        plan.candidates.append(CandidateNote(bad.snapshot_id, -1, "?", "skipped", bad.reason))
    usable = [i for i in fulls if not i.quarantined]
    if snapshot_id is not None:
        usable = [i for i in usable if i.snapshot_id == snapshot_id]
        if not usable:
            plan.action, plan.reason = "give_up", f"no usable full snapshot {snapshot_id!r}"
            return plan
    if not usable and not plan.candidates:
        plan.reason = f"no snapshot in {engine.storage.url}: nothing to restore, starting fresh"
        return plan

    invalid: dict[str, str] = {}
    manifests: dict[str, Manifest] = {}

    def valid_fulls() -> list[SnapshotInfo]:
        return [i for i in reversed(usable) if i.snapshot_id not in invalid]  # oldest first, as the coordinator wants

    def is_valid(info: SnapshotInfo) -> bool:
        if info.snapshot_id in invalid:
            return False
        if info.snapshot_id not in manifests:
            try:
                manifests[info.snapshot_id] = _check(engine, info, deep)
            except CheckpointError as exc:
                invalid[info.snapshot_id] = str(exc)
                return False
        return True

    target: SnapshotInfo | None = None
    while True:
        if failure is not None and snapshot_id is None:
            coordinator = RecoveryCoordinator.from_history(coordinator_config(engine.config), valid_fulls, history or [])
            decision = coordinator.decide(failure)
            plan.decision = decision
            if decision.action == Action.give_up:
                plan.action, plan.reason = "give_up", decision.reason
                break
            if decision.action == Action.start_fresh:
                plan.reason = decision.reason
                break
            chosen = next(i for i in usable if i.snapshot_id == decision.snapshot_id)
            reason = decision.reason
        else:
            chosen = next((i for i in usable if i.snapshot_id not in invalid), None)
            if chosen is None:
                break
            reason = "newest valid full snapshot" if snapshot_id is None else "requested snapshot"
        if is_valid(chosen):
            target = chosen
            plan.action, plan.reason = "restore", reason
            break
    for info in usable:
        if info.snapshot_id in invalid:
            plan.candidates.append(CandidateNote(info.snapshot_id, info.global_step, "full", "skipped", invalid[info.snapshot_id]))
    if target is None:
        if plan.action == "start_fresh" and not plan.reason:
            plan.action = "give_up"
            plan.reason = "snapshots exist but none is valid (see skipped); refusing to start fresh over them"
        plan.candidates.sort(key=lambda c: -c.global_step)
        return plan

    manifest = manifests[target.snapshot_id]
    plan.target, plan.continue_from_step = target.snapshot_id, target.global_step
    plan.layout = layout_change(manifest.components, restart_layout(engine))
    plan.candidates.append(CandidateNote(target.snapshot_id, target.global_step, "full", "chosen", plan.reason))
    light_manifest = _choose_light(engine, plan, target, deep) if light else None
    if light_manifest is not None:
        plan.light, plan.continue_from_step = light_manifest.snapshot_id, light_manifest.global_step
    older = [i for i in usable if i.global_step < target.global_step and i.snapshot_id not in invalid]
    plan.fallbacks = [i.snapshot_id for i in older]
    for info in older:
        plan.candidates.append(CandidateNote(info.snapshot_id, info.global_step, "full", "fallback", "used if the target fails"))
    for info in usable:
        if info.global_step > target.global_step and info.snapshot_id not in invalid:
            plan.candidates.append(CandidateNote(info.snapshot_id, info.global_step, "full", "not chosen",
                                                 "newer, but the decision above chose an older snapshot"))
    plan.candidates.sort(key=lambda c: (-c.global_step, c.kind))
    _actions(engine, plan, manifest, light_manifest)
    if engine._components:  # a running job: compare its config with the snapshot's (the CLI has none to compare)
        plan.warnings += engine._config_warnings(manifest)
    return plan


def _choose_light(engine: "CheckpointEngine", plan: RecoveryPlan, target: SnapshotInfo, deep: bool) -> Manifest | None:
    for info in reversed(engine.catalog.snapshots("light", usable=True)):
        if info.base_snapshot_id != target.snapshot_id or info.global_step < target.global_step:
            continue
        try:
            m = _check(engine, info, deep)
        except (CheckpointError, SchemaVersionError) as exc:
            plan.candidates.append(CandidateNote(info.snapshot_id, info.global_step, "light", "skipped", str(exc)))
            continue
        plan.candidates.append(CandidateNote(info.snapshot_id, info.global_step, "light", "light",
                                             f"newest valid light snapshot on {target.snapshot_id}"))
        return m
    return None


def _actions(engine: "CheckpointEngine", plan: RecoveryPlan, full: Manifest, light: Manifest | None) -> None:
    # What is registered, or (planning from the CLI, nothing registered) what the snapshot holds.
    names = {r.name: r.kind for r in engine._components.values()} or {n: sec.get("kind", "other")
                                                                      for n, sec in full.components.items()}
    probes = (full.extra or {}).get("probes", {})
    for name, kind in sorted(names.items(), key=lambda nk: LOAD_ORDER.index(nk[1]) if nk[1] in LOAD_ORDER else 5):
        source = light if light is not None and name in light.components else full
        if name not in source.components:
            plan.warnings.append(f"component {name!r} is not in {full.snapshot_id}: it keeps its current state "
                                 "(restore(strict=True) refuses this)")
            continue
        files = source.files_of(name)
        section = source.components[name]
        obj_bytes = sum(size for chunks in (section.get("objects") or {}).values() for _d, size in chunks)
        plan.actions.append(LoadAction(name, kind, source.snapshot_id, len(files), sum(f.size for f in files) + obj_bytes))
        if name in probes and engine.config.post_load_check:
            cfg = engine.config
            plan.checks.append(f"probe {name}: re-run the forward pass recorded at save, its fingerprint within "
                               f"allclose(rtol={cfg.probe_rtol}, "
                               f"atol={cfg.probe_atol})")
    if not plan.checks:
        plan.checks.append("no probe recorded (no module, or post_load_check off): checksums only")



def without_light(engine: "CheckpointEngine", plan: RecoveryPlan) -> RecoveryPlan:
    """``plan`` as followed by a caller that applies no light layer (``restore(light=False)``).

    The plan may come from the run's manager, made for every participant with
    the light layer: what this caller reports (continue step, what it loads
    from where) must be what it does, so training resumes after the full
    snapshot's step and every component loads from it.
    """
    full = read_manifest(engine.storage, plan.target)
    actions = []
    for a in plan.actions:
        if a.snapshot_id == plan.light and a.component in full.components:
            files = full.files_of(a.component)
            chunks = (full.components[a.component].get("objects") or {}).values()
            a = LoadAction(a.component, a.kind, full.snapshot_id, len(files),
                           sum(f.size for f in files) + sum(size for c in chunks for _d, size in c))
        actions.append(a)
    return dataclasses.replace(plan, light=None, continue_from_step=full.global_step, actions=actions,
                               candidates=[c for c in plan.candidates if c.status != "light"])
