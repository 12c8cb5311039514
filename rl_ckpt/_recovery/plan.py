"""Deciding a ``RecoveryPlan``: what a restore will do and why, computed without side effects.

enumerate snapshots -> verify checksums -> read manifests -> check schema and
config -> choose a target (newest valid, or what the coordinator decided for a
failure) -> ordered load actions -> post-load checks -> the step to continue
from. Every choice carries its reason; ``str(plan)`` is the report a person
reads (``rl-ckpt plan URL``; the plan's record, its JSON and that report are
:mod:`rl_ckpt._recovery.plan_record`). ``engine.restore(plan)`` executes it and
falls back along ``plan.fallbacks`` when a step fails.

Everything a plan depends on is an argument of :func:`build_plan` (catalog,
storage, schema version, the job's components, coordinator settings and the
recorded decisions), so the engine, the manager and the CLI (which has no
components) plan the same way, and nothing here knows about the engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from rl_ckpt.config import changed_keys, config_digest
from rl_ckpt._format.hashed_io import hash_files
from rl_ckpt._run.dedup import check_object, manifest_objects, object_path
from rl_ckpt._run.snapshot_files import read_manifest
from rl_ckpt.errors import CheckpointError, SchemaVersionError
from rl_ckpt._format.manifest import Manifest, layout_object_bytes
from rl_ckpt._recovery.new_ranks import plan_lines
from rl_ckpt._recovery.coordinator import Action, CoordinatorConfig, Decision, FailureInfo, log_decision, make_decision
from rl_ckpt._recovery.plan_record import CandidateNote, LoadAction, RecoveryPlan, Verdict
from rl_ckpt._run.catalog import Catalog, SnapshotInfo
from rl_ckpt._run.retention import normalize_best
from rl_ckpt._sharded.layout import layout_change
from rl_ckpt._storage import Storage, join

# Load order: weights, optimizer, scheduler, RNG, buffer, env/other, progress last.
LOAD_ORDER = ("module", "optimizer", "scheduler", "rng", "buffer", "other", "progress")


@dataclasses.dataclass(frozen=True)
class ProbeCheck:
    """The post-load probe comparison a restore will run (for the plan's "after loading" lines)."""

    rtol: float
    atol: float


def coordinator_config(cfg: Any) -> CoordinatorConfig:
    """The coordinator settings of a :class:`CheckpointConfig`."""
    metrics, modes = normalize_best(cfg.best_metric, cfg.best_mode)
    metric, mode = metrics[0], modes[0]  # the coordinator ranks by the first metric
    return CoordinatorConfig(
        max_failures=cfg.max_failures,
        max_same_snapshot_failures=cfg.max_same_snapshot_failures,
        max_acceptable_loss_steps=cfg.max_acceptable_loss_steps,
        divergence_threshold=cfg.divergence_threshold,
        best_metric=metric,
        best_mode=mode,
    )


def probe_check(cfg: Any) -> ProbeCheck | None:
    """The probe comparison of a :class:`CheckpointConfig` (None with ``post_load_check`` off)."""
    return ProbeCheck(cfg.probe_rtol, cfg.probe_atol) if cfg.post_load_check else None


def check_schema(manifest: Manifest, schema_version: int) -> None:
    """SchemaVersionError unless ``manifest`` was saved with the job's state ``schema_version``."""
    if manifest.state_schema_version != schema_version:
        raise SchemaVersionError(
            f"{manifest.snapshot_id}: saved with schema_version {manifest.state_schema_version}, this job declares "
            f"{schema_version}. The state layout changed; refusing to load it. Restore with the "
            "matching schema_version, or start a new run.",
            snapshot_id=manifest.snapshot_id,
            found=manifest.state_schema_version,
            supported=schema_version,
        )


def config_warnings(manifest: Manifest, job_config: Mapping[str, Any]) -> list[str]:
    """A warning when the job's recorded config (``recorded_config``) differs from the snapshot's.

    A job that declared no hyperparameters (no ``train.*`` keys, e.g. a rollout
    worker) is not warned about the learner's.
    """
    if manifest.config_digest == config_digest(job_config):
        return []
    keys = changed_keys(manifest.config, job_config)
    if not any(k.startswith("train.") for k in job_config):
        keys = [k for k in keys if not k.startswith("train.")]
        if not keys:
            return []
    changed = ", ".join(keys) or "(unknown keys)"
    return [f"{manifest.snapshot_id}: config changed since this snapshot was saved: {changed}"]


def verdict_of(
    plan: RecoveryPlan, manifest: Manifest, schema_version: int, job_config: Mapping[str, Any] | None = None
) -> list[str]:
    """The schema check (SchemaVersionError) and config warnings of ``manifest`` for a restore following ``plan``.

    The plan's verdict where it made one for this manifest and schema; made now otherwise (a fallback the
    plan did not check, a plan made by the manager). ``job_config`` None: no config comparison.
    """
    v = plan.verdicts.get(manifest.snapshot_id)
    if v is not None and v.config_digest != manifest.config_digest:
        v = None  # not the manifest the plan checked
    if v is None or v.schema_version != schema_version:
        check_schema(manifest, schema_version)
    if job_config is None:
        return []
    if v is not None and v.config_warnings is not None:
        return list(v.config_warnings)
    return config_warnings(manifest, job_config)


def deep_check(storage: Storage, sid: str, manifest: Manifest, verified: Mapping[str, str] | None = None) -> list[str]:
    """What ``verify_snapshot`` finds wrong with snapshot ``sid`` (``path: problem`` each), for the manifest the plan
    holds already: each file re-hashed as the backend hands it over (``hash_files``: the memory tier maps a store's
    files with one call and hashes them where they lie; a disk streams each), then the dedup objects it uses.

    ``verified``: path -> the version the file had when it was verified after write, on storage whose versions name
    immutable contents (``Storage.versions_name_content``: the memory tier, where replacing a file makes a new
    object). A file that still has that version and its manifest's size holds the bytes verified then: it is
    not re-hashed (one stat for all of them: the read session's view)."""
    problems: list[str] = []
    same = unchanged_files(storage, sid, manifest, verified) if verified else set()
    for algo in sorted({f.algo for f in manifest.files}):
        entries = [f for f in manifest.files if f.algo == algo and f.path not in same]
        paths, sizes = [join(sid, f.path) for f in entries], [f.size for f in entries]
        for entry, got in zip(entries, hash_files(storage, paths, algo, sizes)):
            if got is None:
                try:
                    gone = not storage.exists(join(sid, entry.path))
                except CheckpointError:
                    gone = False
                problems.append(f"{entry.path}: {'missing' if gone else 'unreadable'}")
            elif got[0] != entry.size:
                problems.append(f"{entry.path}: size {got[0]} != {entry.size} in manifest (truncated or overwritten)")
            elif got[1] != entry.checksum:
                problems.append(f"{entry.path}: {algo} checksum mismatch (content changed)")
    for digest, (algo, size) in manifest_objects(manifest).items():
        try:
            check_object(storage, algo, digest, size)
        except CheckpointError as exc:
            problems.append(f"../{object_path(algo, digest)}: {exc}")
    return problems


def unchanged_files(storage: Storage, sid: str, manifest: Manifest, verified: Mapping[str, str]) -> set[str]:
    """The manifest paths of ``sid`` whose files still have the version ``verified`` gives them (and their size)."""
    if not getattr(storage, "versions_name_content", False):
        return set()
    paths = [join(sid, f.path) for f in manifest.files]
    try:
        stats = storage.stat_many(paths)
    except CheckpointError:
        return set()  # each is re-hashed, and what is wrong named there
    return {
        f.path
        for f, path, st in zip(manifest.files, paths, stats)
        if st is not None and st.version is not None and st.version == verified.get(path) and st.size == f.size
    }


@dataclasses.dataclass(frozen=True)
class _Inputs:
    storage: Storage
    schema_version: int
    deep: bool
    verified: Mapping[str, Mapping[str, str]] | None = None


def _check(inp: _Inputs, info: SnapshotInfo, plan: RecoveryPlan) -> Manifest:
    """The snapshot's manifest if it is usable (its verdict noted in ``plan``), else CheckpointError saying why.

    The manifest is the one the catalog parsed (or re-validated by its stat version) in the
    refresh that starts every plan, so a restore parses each manifest once."""
    sid = info.snapshot_id
    manifest = info.manifest if info.manifest is not None else read_manifest(inp.storage, sid)
    check_schema(manifest, inp.schema_version)
    if inp.deep:
        problems = deep_check(inp.storage, sid, manifest, (inp.verified or {}).get(sid))
        if problems:
            raise CheckpointError("; ".join(problems[:3]), snapshot_id=sid)
    else:
        stats = inp.storage.stat_many([f"{sid}/{f.path}" for f in manifest.files])  # one request where possible
        for f, st in zip(manifest.files, stats):
            if st is None or st.is_dir or st.size != f.size:
                raise CheckpointError(f"{f.path}: missing or wrong size", snapshot_id=sid)
    plan.verdicts[sid] = Verdict(inp.schema_version, manifest.config_digest)
    return manifest


def layout_line(storage: Storage, snapshot_id: str | None, restart_mesh: Mapping[str, Any] | None) -> str:
    """The ``layout`` line of a plan restoring ``snapshot_id`` onto ``restart_mesh`` ('' if it holds no sharded state).

    For a plan computed elsewhere (the manager cannot know a participant's mesh).
    """
    if snapshot_id is None:
        return ""
    try:
        components = read_manifest(storage, snapshot_id).components
    except CheckpointError:
        return ""  # an unreadable target: the restore says why and falls back; the plan must not fail for a line
    return layout_change(components, restart_mesh)


def new_rank_lines(
    storage: Storage, snapshot_id: str | None, participants: Sequence[str], per_rank: Mapping[str, bool], rule: str
) -> list[str]:
    """The ``new ranks`` lines of a plan restoring ``snapshot_id`` onto ``participants`` (see
    :mod:`rl_ckpt._recovery.new_ranks`); for a plan computed elsewhere, like :func:`layout_line`."""
    if snapshot_id is None or not per_rank:
        return []
    try:
        components = read_manifest(storage, snapshot_id).components
    except CheckpointError:
        return []  # an unreadable target: the restore says why and falls back
    return plan_lines(components, participants, per_rank, rule)


def build_plan(
    catalog: Catalog,
    storage: Storage,
    *,
    schema_version: int,
    components: Mapping[str, str] | None,
    coordinator: CoordinatorConfig,
    history: Sequence[Decision] = (),
    failure: FailureInfo | None = None,
    deep: bool = True,
    snapshot_id: str | None = None,
    light: bool = True,
    probes: ProbeCheck | None = None,
    job_config: Mapping[str, Any] | None = None,
    restart_mesh: Mapping[str, Any] | None = None,
    verified: Mapping[str, Mapping[str, str]] | None = None,
) -> RecoveryPlan:
    """Compute a RecoveryPlan for the run in ``storage``. Refreshes ``catalog``, reads storage, writes nothing.

    Args:
        catalog, storage: the run.
        schema_version: the job's state schema; snapshots saved with another are skipped.
        components: the job's registered components (name -> kind), loaded in that order;
            None (the CLI) plans for what the target snapshot holds.
        coordinator, history: with a ``failure``, the coordinator decides the target from
            these settings and the run's recorded decisions (oldest first).
        deep: re-hash the candidates' files (else check presence and sizes).
        snapshot_id: plan for this snapshot only.
        light: apply the newest valid light snapshot built on the target.
        probes: the post-load probe comparison a restore runs (None: none).
        job_config: the running job's recorded config, compared with the target's (None: no comparison).
        restart_mesh: the layout this process restores sharded state onto (world size, mesh,
            placements: ``ComponentRegistry.restart_mesh``); None (the CLI, the manager)
            names only the saved layout.
        verified: snapshot -> path -> the version each file had when verified after write (see ``deep_check``);
            a deep plan does not re-hash what still has it.
    """
    catalog.refresh()
    cat = catalog
    inp = _Inputs(storage, schema_version, deep, verified)
    plan = RecoveryPlan(storage.url, "start_fresh", "", failure=failure, deep=deep)
    fulls = list(reversed(cat.snapshots("full")))
    for info in fulls:
        if info.quarantined:
            plan.candidates.append(
                CandidateNote(info.snapshot_id, info.global_step, "full", "quarantined", info.quarantined)
            )
    for bad in cat.unreadable():
        plan.candidates.append(CandidateNote(bad.snapshot_id, -1, "?", "skipped", bad.reason))
    usable = [i for i in fulls if not i.quarantined]
    if snapshot_id is not None:
        usable = [i for i in usable if i.snapshot_id == snapshot_id]
        if not usable:
            plan.action, plan.reason = "give_up", f"no usable full snapshot {snapshot_id!r}"
            return plan
    if not usable and not plan.candidates:
        plan.reason = f"no snapshot in {storage.url}: nothing to restore, starting fresh"
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
                manifests[info.snapshot_id] = _check(inp, info, plan)
            except CheckpointError as exc:
                invalid[info.snapshot_id] = str(exc)
                return False
        return True

    target: SnapshotInfo | None = None
    while True:
        if failure is not None and snapshot_id is None:
            decision = make_decision(coordinator, failure, valid_fulls(), history)
            log_decision(decision)
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
            plan.candidates.append(
                CandidateNote(info.snapshot_id, info.global_step, "full", "skipped", invalid[info.snapshot_id])
            )
    if target is None:
        if plan.action == "start_fresh" and not plan.reason:
            plan.action = "give_up"
            plan.reason = "snapshots exist but none is valid (see skipped); refusing to start fresh over them"
        plan.candidates.sort(key=lambda c: -c.global_step)
        return plan

    manifest = manifests[target.snapshot_id]
    plan.target, plan.continue_from_step = target.snapshot_id, target.global_step
    plan.layout = layout_change(manifest.components, restart_mesh)
    plan.candidates.append(CandidateNote(target.snapshot_id, target.global_step, "full", "chosen", plan.reason))
    light_manifest = _choose_light(catalog, inp, plan, target) if light else None
    if light_manifest is not None:
        plan.light, plan.continue_from_step = light_manifest.snapshot_id, light_manifest.global_step
    older = [i for i in usable if i.global_step < target.global_step and i.snapshot_id not in invalid]
    plan.fallbacks = [i.snapshot_id for i in older]
    for info in older:
        plan.candidates.append(
            CandidateNote(info.snapshot_id, info.global_step, "full", "fallback", "used if the target fails")
        )
    for info in usable:
        if info.global_step > target.global_step and info.snapshot_id not in invalid:
            plan.candidates.append(
                CandidateNote(
                    info.snapshot_id,
                    info.global_step,
                    "full",
                    "not chosen",
                    "newer, but the decision above chose an older snapshot",
                )
            )
    plan.candidates.sort(key=lambda c: (-c.global_step, c.kind))
    _actions(plan, components, probes, manifest, light_manifest)
    if components and job_config is not None:  # a running job: compare its config with the snapshot's
        warnings = config_warnings(manifest, job_config)
        plan.verdicts[target.snapshot_id].config_warnings = warnings
        plan.warnings += warnings
    return plan


def _choose_light(catalog: Catalog, inp: _Inputs, plan: RecoveryPlan, target: SnapshotInfo) -> Manifest | None:
    for info in reversed(catalog.snapshots("light", usable=True)):
        if info.base_snapshot_id != target.snapshot_id or info.global_step < target.global_step:
            continue
        try:
            m = _check(inp, info, plan)
        except (CheckpointError, SchemaVersionError) as exc:
            plan.candidates.append(CandidateNote(info.snapshot_id, info.global_step, "light", "skipped", str(exc)))
            continue
        plan.candidates.append(
            CandidateNote(
                info.snapshot_id,
                info.global_step,
                "light",
                "light",
                f"newest valid light snapshot on {target.snapshot_id}",
            )
        )
        return m
    return None


def _actions(
    plan: RecoveryPlan,
    components: Mapping[str, str] | None,
    probe: ProbeCheck | None,
    full: Manifest,
    light: Manifest | None,
) -> None:
    # What is registered, or (planning from the CLI, nothing registered) what the snapshot holds.
    names = dict(components or {}) or {n: sec.get("kind", "other") for n, sec in full.components.items()}
    probes = (full.extra or {}).get("probes", {})
    for name, kind in sorted(names.items(), key=lambda nk: LOAD_ORDER.index(nk[1]) if nk[1] in LOAD_ORDER else 5):
        source = light if light is not None and name in light.components else full
        if name not in source.components:
            plan.warnings.append(
                f"component {name!r} is not in {full.snapshot_id}: it keeps its current state "
                "(restore(strict=True) refuses this)"
            )
            continue
        plan.actions.append(_load_action(source, name, kind))
        if name in probes and probe is not None:
            plan.checks.append(
                f"probe {name}: re-run the forward pass recorded at save, its fingerprint within "
                f"allclose(rtol={probe.rtol}, "
                f"atol={probe.atol})"
            )
    if not plan.checks:
        plan.checks.append("no probe recorded (no module, or post_load_check off): checksums only")


def _load_action(source: Manifest, name: str, kind: str) -> LoadAction:
    """Loading component ``name`` from ``source``: its files, and its bytes in files and dedup objects
    (plain tensors' objects and a sharded layout's)."""
    files = source.files_of(name)
    section = source.components[name]
    chunks = (section.get("objects") or {}).values()
    return LoadAction(
        name,
        kind,
        source.snapshot_id,
        len(files),
        sum(f.size for f in files)
        + sum(size for c in chunks for _d, size in c)
        + layout_object_bytes(section.get("layout")),
    )


def without_light(storage: Storage, plan: RecoveryPlan) -> RecoveryPlan:
    """``plan`` as followed by a caller that applies no light layer (``restore(light=False)``).

    The plan may come from the run's manager, made for every participant with
    the light layer: what this caller reports (continue step, what it loads
    from where) must be what it does, so training resumes after the full
    snapshot's step and every component loads from it.
    """
    full = read_manifest(storage, plan.target)
    actions = []
    for a in plan.actions:
        if a.snapshot_id == plan.light and a.component in full.components:
            a = _load_action(full, a.component, a.kind)
        actions.append(a)
    return dataclasses.replace(
        plan,
        light=None,
        continue_from_step=full.global_step,
        actions=actions,
        candidates=[c for c in plan.candidates if c.status != "light"],
    )
