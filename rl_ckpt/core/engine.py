"""``CheckpointEngine``: register the training state, save it, verify it, restore it.

A save has two phases: *stage* takes each component's state into
memory the trainer no longer touches (for a synchronous save the trainer
waits anyway, so nothing is copied), then *persist* writes every file,
verifies it, and commits the manifest through the commit strategy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from typing import Any, Mapping

import torch

from rl_ckpt.core.async_save import BackgroundWriter, SaveHandle
from rl_ckpt.run.catalog import Catalog, SnapshotInfo, decode_metrics
from rl_ckpt.run.commit import retire_snapshot, strategy_for
from rl_ckpt.run.dedup import ObjectWriter, manifest_objects, object_path
from rl_ckpt.components import check_component_name, classify
from rl_ckpt.config import CheckpointConfig, changed_keys, config_digest
from rl_ckpt.recovery.coordinator import Decision, FailureInfo
from rl_ckpt.errors import (
    CheckpointError,
    ConfigError,
    CorruptSnapshotError,
    NoValidSnapshotError,
    RestoreError,
    SerializationError,
    StateMismatchError,
)
from rl_ckpt.integrations.managed import REPLICATED_KINDS
from rl_ckpt.format.manifest import Manifest, now_iso, snapshot_id
from rl_ckpt.recovery.probe import compare, run_probe
from rl_ckpt.run.quarantine import quarantine
from rl_ckpt.core.reader import FileProblem, VerifyReport, load_component, read_manifest, verify_snapshot
from rl_ckpt.recovery.plan import RecoveryPlan, build_plan, without_light
from rl_ckpt.sharded.layout import plan_layout
from rl_ckpt.run.retention import RetentionDecision, RetentionPolicy, best_per_metric, plan_retention, policy_from_config
from rl_ckpt.core.staging import StagingArea
from rl_ckpt.format.state_codec import EncodedState, encode_state
from rl_ckpt.storage import Storage, open_storage
from rl_ckpt.format.untrusted import read_json
from rl_ckpt.core.writer import write_component

log = logging.getLogger("rl_ckpt")

DECISIONS = "decisions"
RETIRED = "history/retired"
# Config keys that change what training does or what a snapshot holds: a
# difference between the snapshot and the running job is worth a warning.
DIGEST_KEYS = ("save_optimizer", "save_rng_state", "save_replay_buffer", "schema_version", "light_components", "dedup")


@dataclasses.dataclass
class Registered:
    name: str
    obj: Any
    kind: str
    probe: Any = None  # a user probe function obj -> output, for the post-load check
    replicated: bool = False  # sharded saves: the same on every learner rank, written once by rank 0
    sharded: Any = None  # a rl_ckpt.sharded.ShardedState: every rank writes its own shards of it


@dataclasses.dataclass
class RestoreResult:
    """What ``restore`` did. ``snapshot_id`` is None when nothing was found and training starts fresh."""

    snapshot_id: str | None
    global_step: int
    light_snapshot_id: str | None = None
    components: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # snapshot id -> why it was not used
    warnings: list[str] = dataclasses.field(default_factory=list)
    metrics: dict = dataclasses.field(default_factory=dict)
    plan: Any = dataclasses.field(default=None, repr=False)

    @property
    def fresh(self) -> bool:
        return self.snapshot_id is None


def recorded_config(cfg: CheckpointConfig, train_config: Mapping[str, Any] | None) -> dict:
    rec = {k: cfg.public_dict()[k] for k in DIGEST_KEYS}
    for key, value in (train_config or {}).items():
        rec[f"train.{key}"] = value
    # As the manifest will hold it (tuples become lists), so a comparison sees only real changes.
    return json.loads(json.dumps(rec, default=str))


class CheckpointEngine:
    """Saves and restores the whole training state of one run.

    Args:
        config: a :class:`CheckpointConfig`, a dict of config keys, or a YAML path.
        train_config: your hyperparameters (lr, batch size, ...); recorded in every
            manifest and compared on restore (changed keys are warned about).
        storage: use this storage instead of opening ``config.run_url``.
        retention: a :class:`RetentionPolicy` (default: built from keep_latest,
            keep_best and keep_interval_steps); ``False`` keeps everything.
        manager: a ``CheckpointManager`` actor handle: this engine is then one
            participant of a sharded save (the manager commits, keeps the
            catalog and applies retention).
        rank, world_size: this participant's rank and how many of its ``role``
            there are (default: from ``torch.distributed`` when initialised).
        role: ``"learner"`` (replicated state is written once, by rank 0) or
            e.g. ``"rollout"`` (everything is per participant).
        participants: every participant a snapshot waits for (default: the
            ``world_size`` participants of this role).
    """

    def __init__(
        self,
        config: CheckpointConfig | Mapping[str, Any] | str | None = None,
        *,
        train_config: Mapping[str, Any] | None = None,
        storage: Storage | None = None,
        retention: RetentionPolicy | bool | None = None,
        manager: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        role: str = "learner",
        participants: list[str] | None = None,
        **overrides: Any,
    ) -> None:
        if config is None:
            config = CheckpointConfig(**overrides)
        elif isinstance(config, str):
            config = CheckpointConfig.from_yaml(config)
        elif isinstance(config, Mapping):
            config = CheckpointConfig.from_dict(config)
        if overrides and isinstance(config, CheckpointConfig) and config is not None:
            config = config.replace(**overrides)
        self.config: CheckpointConfig = config
        self.train_config = dict(train_config or {})
        self.storage = storage or open_storage(config.run_url, config.storage_options)
        self.commit = strategy_for(self.storage, config.atomic_write)
        self.catalog = Catalog(self.storage)
        self._components: dict[str, Registered] = {}
        if retention is None or retention is True:
            retention = policy_from_config(config)
        self.retention: RetentionPolicy | None = retention or None
        self.manager = manager
        self.participant: str | None = None
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.heartbeat = None
        self.role = role
        if manager is not None:
            from rl_ckpt.integrations.managed import Heartbeat, ManagedCommit, participant_name

            self.participant = participant_name(role, self.rank)
            expected = participants or [participant_name(role, r) for r in range(self.world_size)]
            label = f"CheckpointManager 'rl_ckpt:{config.run_name}'"
            self.heartbeat = Heartbeat(manager, self.participant, config.heartbeat_interval_seconds, _current_actor(),
                                       name=label)
            self.commit = ManagedCommit(self.storage, manager, self.participant, expected,
                                        commit_timeout=config.commit_timeout_seconds, heartbeat=self.heartbeat,
                                        name=label)
            self.retention = None  # the manager applies retention once per committed snapshot
        self.last_save_time = time.monotonic()
        self.last_retention: RetentionDecision | None = None
        self.sweep_in_gc_only = False  # set by the manager: participants may be reusing chunks right now
        self._best_cache: tuple[int, dict | None] = (-1, None)  # (catalog version, best ids and ids seen then)
        self._staging = StagingArea()
        self._writer: BackgroundWriter | None = None
        self._patrol = None
        self._probe_outputs: dict = {}
        self._closed = False
        self._distributed = False  # manager-less multi-rank saves (set when sharded state is registered)

    # -- registration --------------------------------------------------------
    def register(self, name: str, obj: Any, *, kind: str | None = None, probe: Any = None,
                 replicated: bool | None = None) -> Any:
        """Register a component (module, optimizer, scheduler, RNGState, buffer, any Checkpointable).

        ``probe``: a function ``obj -> tensor(s)`` run at save and after load
        (post-load check); modules get an inferred probe when it is omitted.
        ``replicated`` (with a manager): identical on every learner rank, so
        written once by rank 0 (default: modules, optimizers, schedulers and
        progress of learners).
        """
        check_component_name(name)
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigError(
                f"component {name!r}: {type(obj).__name__} has no state_dict()/load_state_dict(); "
                "implement the Checkpointable protocol",
                key=name,
            )
        if name in self._components and self._components[name].obj is not obj:
            raise ConfigError(f"component {name!r} is already registered with another object", key=name)
        reg = Registered(name, obj, kind or classify(name, obj), probe)
        from rl_ckpt.sharded import as_sharded

        reg.sharded = as_sharded(name, obj, [r.sharded or r.obj for r in self._components.values()])
        if reg.sharded is not None:
            reg.kind = kind or reg.sharded.checkpoint_kind
            self._enable_distributed()
        if replicated is None:
            replicated = (self.manager is not None or self._distributed) and self.role == "learner" \
                and reg.kind in REPLICATED_KINDS
        reg.replicated = bool(replicated) and reg.sharded is None
        self._components[name] = reg
        return obj

    def _enable_distributed(self) -> None:
        """Sharded state without a manager: ranks commit together over torch.distributed (rank 0 commits)."""
        if self.manager is not None or self._distributed or self.world_size == 1:
            return
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(f"sharded state on rank {self.rank} of {self.world_size}: initialise torch.distributed "
                              "before registering it (the ranks commit each snapshot together), or pass a manager",
                              key="world_size")
        from rl_ckpt.integrations.managed import participant_name
        from rl_ckpt.sharded.dist_commit import DistributedCommit

        names = [participant_name(self.role, r) for r in range(self.world_size)]
        self.commit = DistributedCommit(self.commit, self.rank, self.world_size, names)
        self.participant = names[self.rank]
        self._distributed = True

    def _key(self, name: str) -> str:
        """Where a component lives in a manifest: its name, or ``<scope>/<name>`` in a sharded save."""
        if self.participant is None or self._components[name].sharded is not None:
            return name
        return f"shared/{name}" if self._components[name].replicated else f"{self.participant}/{name}"

    @property
    def components(self) -> dict[str, Any]:
        return {n: r.obj for n, r in self._components.items()}

    def _saved_components(self, kind: str) -> list[Registered]:
        cfg = self.config
        out = []
        for reg in self._components.values():
            if reg.kind == "optimizer" and not cfg.save_optimizer:
                continue
            if reg.kind == "rng" and not cfg.save_rng_state:
                continue
            if reg.kind == "buffer" and not cfg.save_replay_buffer:
                continue
            if kind == "light" and reg.name not in cfg.light_components:
                continue
            if reg.replicated and self.rank != 0:
                continue  # rank 0 writes replicated state once for everyone
            out.append(reg)
        return out

    # -- saving --------------------------------------------------------------
    def _probes(self, kind: str) -> dict:
        """Reference outputs of the post-load probe, taken from the state being saved."""
        if not self.config.post_load_check or kind != "full":
            return {}
        out = {}
        for reg in self._saved_components(kind):
            if reg.sharded is not None:
                continue  # a probe forward of a sharded module is a collective; its chunks carry checksums
            shape = self.config.probe_shapes.get(reg.name)
            result = run_probe(reg.obj, fn=reg.probe, shape=shape)
            if result is not None:
                out[self._key(reg.name)] = result
        return out

    def stage(self, kind: str = "full") -> dict[str, EncodedState]:
        """Phase 1: every saved component's state, split into tensors/tables/JSON."""
        staged = {}
        for reg in self._saved_components(kind):
            if reg.sharded is not None:
                from rl_ckpt.sharded import stage_sharded

                staged[reg.name] = stage_sharded(reg.sharded, self.rank, copy=False)
                continue
            staged[reg.name] = encode_state(reg.name, _state_of(reg))
        if not staged and not (self.manager is not None and self._components):
            # A participant whose state is all replicated (written by rank 0) contributes an empty part.
            raise CheckpointError(
                f"nothing to save in a {kind} snapshot: register components first"
                + (" (or list them in light_components)" if kind == "light" else ""),
                kind=kind,
            )
        return staged

    def save(self, global_step: int, metrics: Mapping[str, Any] | None = None, *,
             tags: Mapping[str, Any] | None = None, kind: str = "full") -> SnapshotInfo:
        """Save synchronously; returns only after the snapshot is committed (and verified)."""
        self._check_open()
        _check_step(global_step)
        self.wait()  # one save at a time, in order
        try:
            base = self._base_for(kind)
            probes = self._probes(kind)
            staged = self.stage(kind)
        except BaseException as exc:
            self._failed_before_begin(global_step, kind, exc)
            raise
        return self.persist(staged, global_step, metrics=metrics, tags=tags, kind=kind, base=base, probes=probes)

    def save_async(self, global_step: int, metrics: Mapping[str, Any] | None = None, *,
                   tags: Mapping[str, Any] | None = None, kind: str = "full") -> SaveHandle:
        """Stage the state now (the only blocking part), then write, verify and commit it in the background.

        The snapshot holds the state as of this call, whatever training does
        next. If a save is still in flight this first waits for it: at most one
        save is in flight and one staged copy is in memory. Errors come back on
        ``handle.wait()`` and are logged.
        """
        self._check_open()
        _check_step(global_step)
        self.wait()
        started = time.perf_counter()
        try:
            base = self._base_for(kind)
            probes = self._probes(kind)
            staged = {}
            for reg in self._saved_components(kind):
                if reg.sharded is not None:
                    from rl_ckpt.sharded import stage_sharded

                    staged[reg.name] = stage_sharded(reg.sharded, self.rank, copy=True)
                    continue
                enc = encode_state(reg.name, _state_of(reg), host=False)
                staged[reg.name] = self._staging.stage(reg.name, enc)
            self._staging.release_unused({(name, key) for name, enc in staged.items()
                                          if isinstance(enc, EncodedState) for key in enc.arrays})
            if not staged:
                self.stage(kind)  # raises the "nothing to save" error (a participant may save an empty part)
            metrics = clean_metrics(metrics)
        except BaseException as exc:
            self._failed_before_begin(global_step, kind, exc)
            raise
        blocked = time.perf_counter() - started
        if self._writer is None:
            self._writer = BackgroundWriter(nice=self.config.writer_nice)
        return self._writer.submit(
            lambda: self.persist(staged, global_step, metrics=metrics, tags=tags, kind=kind, base=base, probes=probes),
            global_step, kind, blocked,
        )

    def scheduler(self, **kwargs: Any) -> "CheckpointScheduler":
        """A :class:`CheckpointScheduler` over this engine (``on_error``, ``on_commit``, ``start_step``)."""
        from rl_ckpt.core.scheduler import CheckpointScheduler

        return CheckpointScheduler(self, **kwargs)

    def _failed_before_begin(self, global_step: int, kind: str, error: BaseException) -> None:
        """A multi-participant save failed before it began: the others must fail with it, at once.

        With a manager, it aborts that snapshot for every participant; without one (ranks of a
        torch.distributed group), the ranks about to begin this save are told through the group.
        """
        if self.manager is not None and kind in ("full", "light"):
            self.commit.fail(snapshot_id(global_step, kind), None, error)
        elif self._distributed and isinstance(error, Exception):
            self.commit.fail_begin(error)

    def agree_to_save(self, global_step: int, kind: str = "full") -> bool:
        """Whether a due save of ``global_step`` goes ahead (the scheduler asks).

        Alone: unless a save is still in flight. With a manager, one decision
        for every participant of the snapshot: the first participant to ask
        decides (skip if its previous save is still running, else save), so
        ranks never split into half-snapshots; a participant told to save
        while busy waits for its previous save first.
        """
        busy = self.saving
        if self.manager is None:
            return not busy
        return self.commit.decide(snapshot_id(global_step, kind), busy)

    @property
    def saving(self) -> bool:
        """True while a background save is in flight."""
        return self._writer is not None and self._writer.busy

    def wait(self) -> None:
        """Wait for the background save in flight, if any (its error stays on its handle)."""
        if self._writer is not None:
            self._writer.wait_idle()

    def _base_for(self, kind: str) -> str | None:
        if kind == "full":
            return None
        if kind != "light":
            raise ConfigError(f"kind must be 'full' or 'light', got {kind!r}", key="kind")
        fulls = self.catalog.snapshots("full")
        if not fulls:
            raise CheckpointError("a light snapshot needs a full snapshot to build on; save a full snapshot first")
        return fulls[-1].snapshot_id

    def persist(self, staged: Mapping[str, EncodedState], global_step: int, *, metrics=None, tags=None,
                kind: str = "full", base: str | None = None, probes: dict | None = None) -> SnapshotInfo:
        """Phase 2: write, verify and commit ``staged``. Safe to run on a background thread."""
        cfg = self.config
        sid = snapshot_id(global_step, kind)
        attempt = self.commit.begin(sid)
        try:
            objects = self._object_writer() if cfg.dedup else None
            files, sections = [], {}
            for name, enc in staged.items():
                key = self._key(name)
                if "/" in key:
                    self.storage.makedirs(attempt.data_path(key.rsplit("/", 1)[0]))
                reg = self._components.get(name)
                if reg is not None and reg.sharded is not None:
                    from rl_ckpt.sharded import write_shards

                    entries, section = write_shards(self.storage, attempt, key, enc, self.rank, algo=cfg.checksum_algo,
                                                    verify=cfg.verify_after_write, block_bytes=reg.sharded.block_bytes,
                                                    min_block_bytes=reg.sharded.min_block_bytes)
                else:
                    entries, section = write_component(self.storage, attempt, key, enc, algo=cfg.checksum_algo,
                                                       verify=cfg.verify_after_write, objects=objects)
                section["kind"] = self._components[name].kind if name in self._components else "other"
                files += entries
                sections[key] = section
            recorded = recorded_config(cfg, self.train_config)
            manifest = Manifest(
                snapshot_id=sid, global_step=global_step, kind=kind, created_at=now_iso(), base_snapshot_id=base,
                config_digest=config_digest(recorded), config=recorded, state_schema_version=cfg.schema_version,
                metrics=clean_metrics(metrics), tags=dict(tags or {}), files=files, components=sections,
                writer={"attempt": attempt.attempt_id, **({"participant": self.participant} if self.participant else {})},
                extra={"probes": probes} if probes else {},
            )
            merged = self.commit.commit(attempt, manifest.to_bytes())
            if merged is not None:  # a sharded save: the manager committed the merged manifest
                manifest = merged
        except BaseException as exc:
            if self._landed(attempt):
                # The manifest is there and names this attempt (the error came after it landed, e.g. a
                # lost response or a failed folder fsync): the save is not acknowledged, but its data
                # now belongs to a committed snapshot and must not be deleted.
                log.error("save of %s failed after its manifest landed; keeping its data", sid)
                if isinstance(exc, CheckpointError):
                    exc.message = f"{post_commit_text(exc)} (after {sid}'s manifest landed: it may be committed)"
                    exc.args = (exc.message,)
                raise
            try:
                if self.manager is not None:  # with the reason: the manager aborts it for every participant
                    self.commit.fail(sid, attempt, exc)
                else:
                    self.commit.abort(attempt)
            except CheckpointError as cleanup_error:  # the original error matters more; gc cleans up
                log.warning("could not clean up failed save of %s: %s", sid, cleanup_error)
            raise
        info = SnapshotInfo.from_manifest(manifest)
        self.catalog.add(info)
        self.last_save_time = time.monotonic()
        log.info("committed %s (%d files, %d bytes)", sid, len(files), info.size_bytes)
        if self.manager is None and (not self._distributed or self.rank == 0):
            info.warnings = self._after_commit()
        return info

    def beat(self, global_step: int) -> None:
        """Heartbeat to the manager (rate-limited); a no-op without one."""
        if self.heartbeat is not None:
            newest = self.catalog.snapshots()
            self.heartbeat.beat(global_step, newest[-1].snapshot_id if newest else None)

    def _landed(self, attempt) -> bool:
        try:
            return read_manifest(self.storage, attempt.snapshot_id).writer.get("attempt") == attempt.attempt_id
        except CheckpointError:
            return False

    def _object_writer(self) -> ObjectWriter:
        if self.manager is not None:
            # The manager applies retention: see its deletions before reusing any chunk.
            self.catalog.refresh()
        committed: set[str] = set()
        for info in self.catalog.snapshots():
            if info.manifest is not None:
                committed.update(manifest_objects(info.manifest))
        return ObjectWriter(self.storage, self.config.checksum_algo, committed,
                            min_bytes=self.config.dedup_min_tensor_bytes)

    def _after_commit(self) -> list[str]:
        """Best aliases first, deletions last: a crash in between only leaves extra snapshots.

        Runs after the commit point, so nothing here may fail the save: each step's error is
        logged and returned as a warning, and the pass goes on. A snapshot found gone (deleted
        by hand, or by another engine on the run) just leaves the catalog.
        """
        problems: list[str] = []

        def guarded(what: str, fn, *args) -> Any:
            try:
                return fn(*args)
            except Exception as exc:  # the snapshot is committed whatever happens here
                msg = f"{what}: {post_commit_text(exc)}"
                log.warning("after committing: %s", msg)
                problems.append(msg)
                return None

        cfg = self.config
        if cfg.keep_best > 0:
            guarded("best-snapshot alias not updated", self._write_best_aliases, self.catalog.snapshots())
        if self.retention is None:
            return problems
        # Quarantined snapshots are neither kept-counted nor deleted: a person decides.
        decision = plan_retention([i for i in self.catalog.snapshots() if not i.quarantined], self.retention)
        self.last_retention = decision
        freed: dict[str, tuple[str, int]] = {}
        for sid in decision.delete:
            info = self.catalog.get(sid)
            if guarded(f"retention could not check {sid}", self._vanished, sid):
                continue
            guarded(f"retention: no tombstone for {sid}", self._tombstone, info, decision)
            retired = guarded(f"retention could not delete {sid}", retire_snapshot, self.storage, sid)
            if retired is None:
                continue  # still there: the next pass tries again
            if info is not None and info.manifest is not None:
                freed.update(manifest_objects(info.manifest))
            self.catalog.discard([sid])
            log.info("retention: deleted %s" if retired else "retention: %s was already gone", sid)
        if freed and not self.sweep_in_gc_only:
            guarded("retention could not sweep unused objects", self._sweep_objects, freed)
        return problems

    def _vanished(self, sid: str) -> bool:
        """True (and the catalog forgets it) when a listed snapshot's manifest is gone from storage."""
        if self.storage.exists(f"{sid}/meta.json"):
            return False
        log.warning("snapshot %s is no longer in %s (deleted outside this engine); forgetting it",
                    sid, self.storage.url)
        self.catalog.discard([sid])
        return True

    def _tombstone(self, info: SnapshotInfo | None, decision: RetentionDecision) -> None:
        """A note of what retention deleted (for the timeline and for people), written before deleting."""
        if info is None:
            return
        body = {"snapshot_id": info.snapshot_id, "global_step": info.global_step, "kind": info.kind,
                "metrics": clean_metrics(info.metrics), "size_bytes": info.size_bytes, "deleted_at": now_iso()}
        self.storage.makedirs(RETIRED)
        self.storage.write_atomic(f"{RETIRED}/{info.snapshot_id}.json", json.dumps(body).encode())

    def _sweep_objects(self, candidates: dict[str, tuple[str, int]]) -> None:
        """Delete dedup objects of deleted snapshots that no remaining manifest references.

        Only this engine writes to the run while it runs, and it is between
        saves here, so no in-flight save can be reusing them. (``gc`` sweeps
        everything else, with a grace period.)
        """
        live: set[str] = set()
        for info in self.catalog.snapshots():
            if info.manifest is not None:
                live.update(manifest_objects(info.manifest))
        if self.catalog.unreadable():
            return  # an unreadable manifest may reference these: leave them to gc
        for digest, (algo, _size) in candidates.items():
            if digest not in live:
                self.storage.remove(object_path(algo, digest))

    def _write_best_aliases(self, snapshots: list[SnapshotInfo]) -> None:
        cfg = self.config
        metrics = cfg.best_metric if isinstance(cfg.best_metric, list) else [cfg.best_metric]
        modes = cfg.best_mode if isinstance(cfg.best_mode, list) else [cfg.best_mode] * len(metrics)
        version, cached = self._best_cache
        if version == self.catalog.version and cached is not None:
            # Only adds since the last look: the best is the old best or one of the new snapshots.
            known = cached["_seen"]
            best_ids = {v for k, v in cached.items() if k != "_seen"}
            pool = [i for i in snapshots if i.snapshot_id in best_ids or i.snapshot_id not in known]
        else:
            pool = snapshots
        best = best_per_metric(pool, metrics, modes)
        gone = [sid for sid in set(best.values()) if self._vanished(sid)]
        if gone:  # a best snapshot deleted outside this engine: rank again without it
            return self._write_best_aliases(self.catalog.snapshots())
        self._best_cache = (self.catalog.version, {**best, "_seen": {i.snapshot_id for i in snapshots}})
        for metric, sid in best.items():
            info = self.catalog.get(sid)
            mode = modes[metrics.index(metric)]
            body = {"snapshot_id": sid, "global_step": info.global_step if info else None, "metric": metric,
                    "mode": mode, "value": info.metrics.get(metric) if info else None, "updated_at": now_iso()}
            if self._best_alias(metric) != body["snapshot_id"]:
                self.storage.makedirs("best")
                self.storage.write_atomic(f"best/{_safe_metric(metric)}.json", json.dumps(body).encode())

    def _best_alias(self, metric: str) -> str | None:
        path = f"best/{_safe_metric(metric)}.json"
        try:
            record = read_json(self.storage, path) if self.storage.exists(path) else None
        except CheckpointError:  # unreadable or planted: the alias is rewritten from the catalog
            return None
        sid = record.get("snapshot_id") if isinstance(record, dict) else None
        return sid if isinstance(sid, str) else None

    def best(self, metric: str | None = None) -> SnapshotInfo | None:
        """The best committed snapshot by ``metric`` (default: the first of best_metric)."""
        cfg = self.config
        metrics = cfg.best_metric if isinstance(cfg.best_metric, list) else [cfg.best_metric]
        modes = cfg.best_mode if isinstance(cfg.best_mode, list) else [cfg.best_mode] * len(metrics)
        metric = metric or metrics[0]
        mode = modes[metrics.index(metric)] if metric in metrics else "max"
        sid = best_per_metric(self.catalog.snapshots(), [metric], [mode]).get(metric)
        return self.catalog.get(sid) if sid else None

    # -- listing and verification -------------------------------------------
    def snapshots(self) -> list[SnapshotInfo]:
        """Committed snapshots, oldest first."""
        return self.catalog.snapshots()

    def verify(self, snapshot_id: str | None = None) -> VerifyReport:
        """Re-hash every file of one snapshot (or all of them) against its manifest."""
        report = VerifyReport()
        if snapshot_id is not None:
            return verify_snapshot(self.storage, snapshot_id, report)
        self.catalog.refresh()
        for info in self.catalog.snapshots():
            verify_snapshot(self.storage, info.snapshot_id, report)
            if info.quarantined and info.snapshot_id not in report.bad_snapshots:
                report.problems.append(FileProblem(info.snapshot_id, "quarantine", info.quarantined))
        for bad in self.catalog.unreadable():
            report.checked.append(bad.snapshot_id)
            report.problems.append(FileProblem(bad.snapshot_id, "meta.json", bad.reason))
        return report

    # -- recovery --------------------------------------------------------------
    def plan_recovery(self, failure: "FailureInfo | None" = None, *, deep: bool = True, snapshot_id: str | None = None,
                      light: bool = True) -> RecoveryPlan:
        """What a restore would do, and why; no side effects.

        Args:
            failure: the failure being recovered from; the RecoveryCoordinator
                (rebuilt from the run's recorded decisions) chooses the target.
            deep: re-hash the candidates' files (else check presence and sizes;
                ``restore`` verifies checksums while loading either way).
            snapshot_id: plan for this snapshot only.
            light: apply the newest valid light snapshot built on the target.
        """
        self._check_open()
        if self.manager is not None and snapshot_id is None:
            from rl_ckpt.integrations.managed import _ray_get

            if failure is not None:
                _ray_get(self.manager.record_failure.remote(failure.to_json()), timeout=60, name=self.commit.name)
            # One plan for every participant: the manager computes it (and records the decision) once.
            plan = RecoveryPlan.from_json(_ray_get(self.manager.plan.remote(), timeout=self.config.commit_timeout_seconds,
                                                   name=self.commit.name))
            plan.layout = plan_layout(self, plan.target)  # the manager cannot know this process's mesh
            return plan
        return build_plan(self, failure, deep=deep, snapshot_id=snapshot_id, light=light, history=self.decisions())

    def decisions(self) -> list[Decision]:
        """The coordinator decisions recorded in this run, oldest first."""
        out = []
        for entry in sorted(self.storage.list(DECISIONS), key=lambda e: e.name):
            if not entry.name.endswith(".json"):
                continue
            try:
                decision = Decision.from_json(read_json(self.storage, f"{DECISIONS}/{entry.name}"))
                ids = (decision.snapshot_id, decision.charged_to, *(s for s, _n in decision.considered))
                steps = (decision.global_step, decision.failure.step, decision.attempt)
                if not (all(i is None or isinstance(i, str) for i in ids)
                        and all(n is None or type(n) is int for n in steps)):
                    raise TypeError("fields of the wrong type")  # e.g. a list as snapshot id: unhashable later
                out.append(decision)
            except (CheckpointError, ValueError, KeyError, TypeError, AttributeError) as exc:  # a planted record
                log.warning("ignoring unreadable decision record %s: %s", entry.name, exc)
        return out

    def record_decision(self, decision: Decision) -> None:
        """Write a coordinator decision into the run folder (one file each: atomic on every backend)."""
        self.storage.makedirs(DECISIONS)
        name = f"{DECISIONS}/{decision.time.replace(':', '').replace('+', 'p')}-{decision.action}.json"
        self.storage.write_atomic(name, json.dumps(decision.to_json(), allow_nan=False).encode())

    def restore(self, plan: RecoveryPlan | None = None, *, snapshot_id: str | None = None, strict: bool = True,
                light: bool = True) -> RestoreResult:
        """Execute a recovery plan (default: newest valid snapshot) into the registered objects.

        A snapshot that fails while loading (checksum, decoding, post-load
        probe) is skipped with a logged reason and the plan's next fallback is
        tried. With no snapshot at all, returns ``fresh == True``. If snapshots
        exist but none is valid, raises :class:`NoValidSnapshotError`.
        """
        self._check_open()
        self.wait()
        if plan is None:
            plan = self.plan_recovery(deep=False, snapshot_id=snapshot_id, light=light)
        if not light and plan.light is not None:  # e.g. the manager's plan: report what this restore does
            plan = without_light(self, plan)
        if plan.decision is not None and self.manager is None and self.rank == 0:  # the manager records its own
            self.record_decision(plan.decision)
        skipped = {c.snapshot_id: c.reason for c in plan.candidates if c.status == "skipped"}
        if plan.action == "start_fresh":
            log.info("recovery: %s", plan.reason)
            return RestoreResult(None, 0, skipped=skipped, warnings=[plan.reason], plan=plan)
        if plan.action == "give_up":
            lines = "\n".join(f"  {sid}: {why}" for sid, why in skipped.items())
            raise NoValidSnapshotError(f"recovery of {self.storage.url} gave up: {plan.reason}" + (f"; skipped:\n{lines}" if lines else ""),
                                       reasons=skipped)
        for sid in [plan.target, *plan.fallbacks]:
            result, fatal, error = None, None, None
            self._probe_outputs = {}
            try:
                result = self._restore_one(sid, skipped, strict, light=light and (plan.light is not None or sid != plan.target))
            except (StateMismatchError, RestoreError) as exc:
                fatal = exc
            except CheckpointError as exc:
                error = str(exc)
            if self._collective():
                # Every rank loaded its own shards; continue only if all did, and all compute the same
                # probe outputs. Otherwise all roll back together to the next snapshot.
                error, fatal_elsewhere = agree_across_ranks(result is not None, error or (str(fatal) if fatal else None),
                                                            fatal is not None, self._probe_outputs, self.config)
                if fatal is None and fatal_elsewhere:
                    fatal = RestoreError(f"{sid}: another rank could not load its state: {fatal_elsewhere}", snapshot_id=sid)
            if fatal is not None:
                raise fatal
            if error is not None:
                skipped[sid] = error
                log.warning("recovery: %s failed (%s); falling back to the next snapshot", sid, error)
                continue
            result.plan = plan
            if sid != plan.target:
                result.warnings.append(f"fell back from {plan.target} to {sid}: {skipped[plan.target]}")
            return result
        lines = "\n".join(f"  {sid}: {why}" for sid, why in skipped.items())
        raise NoValidSnapshotError(f"no valid snapshot in {self.storage.url}; skipped:\n{lines}", reasons=skipped)

    def _manifest(self, sid: str) -> Manifest:
        """``sid``'s manifest as the catalog parsed it when the plan was made (read only if the catalog lacks it)."""
        info = self.catalog.get(sid)
        return info.manifest if info is not None and info.manifest is not None else read_manifest(self.storage, sid)

    def _restore_one(self, sid: str, skipped: dict, strict: bool, light: bool) -> RestoreResult:
        manifest = self._manifest(sid)
        self._check_schema(manifest)
        warnings = self._config_warnings(manifest)
        states: dict[str, Any] = {}
        missing = []
        sharded: dict[str, str] = {}
        for reg in self._components.values():
            key = self._stored_key(manifest, reg.name)
            if key is None:
                missing.append(reg.name)
                continue
            if reg.sharded is not None or "layout" in (manifest.components.get(key) or {}):
                sharded[reg.name] = key  # loaded in place below, after every other check
                continue
            states[reg.name] = load_component(self.storage, manifest, key)
        if missing:
            msg = f"{sid}: registered component(s) {missing} are not in the snapshot"
            if strict and not all(self._excluded(self._components[m]) for m in missing):
                raise StateMismatchError(msg + "; register them under the names used when saving, or restore(strict=False)",
                                         component=missing[0], mismatches=missing, snapshot_id=sid)
            warnings.append(msg + "; they keep their current state")
        top = self._apply_light(manifest, states, skipped) if light else None
        for name, state in states.items():
            check_fits(name, self._components[name].obj, state, sid)
        self._load_sharded(manifest, sharded)
        for name, state in states.items():
            try:
                self._components[name].obj.load_state_dict(state)
            except Exception as exc:  # a user object's own error: name the component and snapshot
                raise RestoreError(f"{sid}: loading component {name!r} failed: {type(exc).__name__}: {exc}",
                                   snapshot_id=sid, component=name) from exc
        self._post_load_check(manifest)
        for w in warnings:
            log.warning(w)
        last = top or manifest
        log.info("restored %s (step %d)%s", sid, last.global_step, f" + light {top.snapshot_id}" if top else "")
        return RestoreResult(sid, last.global_step, top.snapshot_id if top else None, [*states, *sharded], dict(skipped),
                             warnings, decode_metrics(last.metrics))

    def _load_sharded(self, manifest: Manifest, keys: dict[str, str]) -> None:
        """Each sharded component: this rank reads and verifies only the byte ranges of its own shards."""
        from rl_ckpt.sharded import is_sharded_section, load_sharded, sharded_view

        objects = [r.sharded or r.obj for r in self._components.values()]
        for name, key in keys.items():
            reg = self._components[name]
            if not is_sharded_section(manifest.components[key]):
                raise StateMismatchError(f"{manifest.snapshot_id}: component {name!r} holds sharded state here but was "
                                         "saved unsharded; register it as it was saved", component=name,
                                         mismatches=[name], snapshot_id=manifest.snapshot_id)
            load_sharded(self.storage, manifest, key, reg.sharded or sharded_view(name, reg.obj, objects), name)

    def load_full_weights(self, name: str, module: torch.nn.Module, snapshot_id: str | None = None) -> str:
        """Load sharded component ``name`` whole into an ordinary ``module`` (rollout workers: no process group).

        Streams chunk by chunk and verifies every block; uses the newest
        committed snapshot holding ``name`` unless ``snapshot_id`` is given.
        Returns the snapshot id loaded.
        """
        from rl_ckpt.sharded import load_full_weights

        self._check_open()
        self.catalog.refresh()
        candidates = [snapshot_id] if snapshot_id else [i.snapshot_id for i in reversed(self.catalog.snapshots("full"))
                                                        if not i.quarantined]
        for sid in candidates:
            manifest = read_manifest(self.storage, sid)
            if name in manifest.components:
                load_full_weights(self.storage, manifest, name, module)
                return sid
        raise NoValidSnapshotError(f"no committed snapshot in {self.storage.url} holds component {name!r}"
                                   + (f" (looked in {snapshot_id})" if snapshot_id else ""), reasons={})

    def _post_load_check(self, manifest: Manifest) -> None:
        """Re-run the probes recorded at save; a mismatch quarantines the snapshot (then recovery falls back)."""
        if not self.config.post_load_check:
            return
        probes = (manifest.extra or {}).get("probes") or {}
        for reg in self._components.values():
            name = reg.name
            reference = probes.get(self._stored_key(manifest, name) or name)
            if reference is None:
                continue
            got = run_probe(reg.obj, fn=reg.probe, shape=self.config.probe_shapes.get(name))
            self._probe_outputs[name] = got
            problem = compare(reference, got, rtol=self.config.probe_rtol, atol=self.config.probe_atol)
            if problem:
                reason = f"post-load check failed for component {name!r}: {problem}"
                quarantine(self.storage, manifest.snapshot_id, reason, source="post-load check")
                self.catalog.mark_quarantined(manifest.snapshot_id, reason)
                raise CorruptSnapshotError(f"{manifest.snapshot_id}: {reason}; snapshot quarantined",
                                           snapshot_id=manifest.snapshot_id, problems=[reason])

    def _apply_light(self, full: Manifest, states: dict, skipped: dict) -> Manifest | None:
        """Overlay the newest valid light snapshot built on ``full``; a broken one is skipped."""
        for info in reversed(self.catalog.snapshots("light")):
            if info.base_snapshot_id != full.snapshot_id or info.global_step < full.global_step:
                continue
            try:
                manifest = info.manifest if info.manifest is not None else read_manifest(self.storage, info.snapshot_id)
                self._check_schema(manifest)
                light_states = {}
                for name in self._components:
                    key = self._stored_key(manifest, name)
                    if key is not None:
                        light_states[name] = load_component(self.storage, manifest, key)
            except CheckpointError as exc:
                skipped[info.snapshot_id] = str(exc)
                log.warning("skipping light snapshot %s: %s", info.snapshot_id, exc)
                continue
            states.update(light_states)
            return manifest
        return None

    def _collective(self) -> bool:
        """Restores agree across learner ranks when they form a torch.distributed group."""
        dist = torch.distributed
        return ((self.manager is not None or self._distributed) and self.role == "learner" and self.world_size > 1
                and dist.is_available() and dist.is_initialized())

    def _stored_key(self, manifest: Manifest, name: str) -> str | None:
        """The manifest key holding component ``name`` for this participant (own scope first)."""
        keys = [name] if self.participant is None else [f"{self.participant}/{name}", f"shared/{name}", name]
        return next((k for k in keys if k in manifest.components), None)

    def _excluded(self, reg: Registered) -> bool:
        return reg not in self._saved_components("full")

    def _check_schema(self, manifest: Manifest) -> None:
        from rl_ckpt.errors import SchemaVersionError

        if manifest.state_schema_version != self.config.schema_version:
            raise SchemaVersionError(
                f"{manifest.snapshot_id}: saved with schema_version {manifest.state_schema_version}, this job declares "
                f"{self.config.schema_version}. The state layout changed; refusing to load it. Restore with the "
                "matching schema_version, or start a new run.",
                snapshot_id=manifest.snapshot_id, found=manifest.state_schema_version, supported=self.config.schema_version,
            )

    def _config_warnings(self, manifest: Manifest) -> list[str]:
        now = recorded_config(self.config, self.train_config)
        if manifest.config_digest == config_digest(now):
            return []
        keys = changed_keys(manifest.config, now)
        if not self.train_config:  # this process declared no hyperparameters (e.g. a rollout worker)
            keys = [k for k in keys if not k.startswith("train.")]
            if not keys:
                return []
        return [f"{manifest.snapshot_id}: config changed since this snapshot was saved: {', '.join(keys) or '(unknown keys)'}"]

    # -- health patrol -------------------------------------------------------
    def start_patrol(self, interval_seconds: float = 3600.0, **kwargs: Any) -> "HealthPatrol":
        """Re-hash old snapshots in the background (rate-limited); corrupt ones are quarantined."""
        from rl_ckpt.run.patrol import HealthPatrol

        if self._patrol is None:
            self._patrol = HealthPatrol(self.storage, interval_seconds=interval_seconds,
                                        bytes_per_second=kwargs.get("bytes_per_second", self.config.scrub_bytes_per_second),
                                        min_free_bytes=kwargs.get("min_free_bytes", self.config.min_free_bytes),
                                        on_report=lambda r: self.catalog.refresh()).start()
        return self._patrol

    # -- lifecycle -----------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this CheckpointEngine is closed")

    def close(self) -> None:
        """Wait for the save in flight, then release the storage."""
        if not self._closed:
            if self._patrol is not None:
                self._patrol.stop()
            if self._writer is not None:
                self._writer.close()
            if self.heartbeat is not None:
                self.heartbeat.close()
            if self.manager is not None and self.participant is not None:
                self.manager.unregister.remote(self.participant)  # a clean exit is not a lost heartbeat
            self._closed = True
            self.storage.close()

    def __enter__(self) -> "CheckpointEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def agree_across_ranks(ok: bool, error: str | None, fatal: bool, probe_outputs: dict, cfg) -> tuple[str | None, str | None]:
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


def _state_of(reg: Registered) -> Any:
    """``reg.obj.state_dict()``; an exception it raises becomes a SerializationError naming the component."""
    try:
        return reg.obj.state_dict()
    except CheckpointError:
        raise
    except Exception as exc:  # the user's own code: name the component, keep the cause chained
        raise SerializationError(f"component {reg.name!r}: state_dict() raised {type(exc).__name__}: {exc}; "
                                 "nothing was saved", component=reg.name, key="") from exc


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    return (rank or 0), (world_size or 1)


def _current_actor() -> Any:
    """This process's Ray actor handle, when it is one (so the manager can stop a hung worker)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().current_actor
    except (ImportError, RuntimeError):  # not inside a Ray actor: nothing to hand over
        return None
    return None


def post_commit_text(exc: BaseException) -> str:
    """An error's text as seen after the commit point: a storage hint that nothing was committed is untrue here."""
    return str(exc).replace("; nothing was committed by this save", "")


def _safe_metric(metric: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in metric).lstrip(".") or "metric"


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"global_step must be a non-negative int, got {step!r}", key="global_step")


def clean_metrics(metrics: Mapping[str, Any] | None) -> dict:
    """Metrics as JSON: numbers (numpy/0-d tensors too) become floats; non-finite ones become strings."""
    out = {}
    for key, value in (metrics or {}).items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if hasattr(value, "item") and not isinstance(value, (int, float)):
            value = value.item()
        if isinstance(value, bool) or value is None or isinstance(value, str):
            out[str(key)] = value
        elif isinstance(value, (int, float)):
            out[str(key)] = value if math.isfinite(value) else repr(float(value))
        else:
            raise ConfigError(f"metric {key!r}: {type(value).__name__} is not a number", key=str(key))
    return out


def check_fits(name: str, obj: Any, state: Any, sid: str) -> None:
    """For modules: every tensor's name, shape and dtype must match, or StateMismatchError lists them."""
    if not isinstance(obj, torch.nn.Module):
        return
    current = obj.state_dict()
    problems = []
    for key, tensor in current.items():
        if key not in state:
            problems.append(f"{key}: missing from snapshot")
            continue
        saved = state[key]
        if not isinstance(saved, torch.Tensor):
            problems.append(f"{key}: snapshot holds {type(saved).__name__}, not a tensor")
        elif tuple(saved.shape) != tuple(tensor.shape):
            problems.append(f"{key}: snapshot shape {list(saved.shape)} != model shape {list(tensor.shape)}")
        elif saved.dtype != tensor.dtype:
            problems.append(f"{key}: snapshot dtype {saved.dtype} != model dtype {tensor.dtype}")
    problems += [f"{key}: in snapshot, not in model" for key in state if key not in current]
    if problems:
        shown = "\n  ".join(problems[:50]) + (f"\n  ... {len(problems) - 50} more" if len(problems) > 50 else "")
        raise StateMismatchError(
            f"{sid}: component {name!r} does not fit the registered model ({len(problems)} tensor(s) differ):\n  {shown}\n"
            "Is this snapshot from a different model? Restore into the model it was saved from, or start a new run.",
            component=name, mismatches=problems, snapshot_id=sid,
        )


__all__ = ["CheckpointEngine", "RestoreResult", "SnapshotInfo"]
