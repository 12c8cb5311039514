"""The save pipeline: stage -> persist -> commit (or fail), for one engine.

*Stage* takes each saved component's state into memory the trainer no longer
touches (for a synchronous save the trainer waits anyway, so nothing is
copied; a background save copies into reused staging buffers). *Persist*
writes every file through the writer (safetensors/Arrow/JSON, dedup objects),
verifies it, builds the manifest and hands it to the commit strategy, which is
the only place that knows how a snapshot becomes visible (staged rename,
manifest-last, a manager, or rank 0 of a torch.distributed group: the engine's
topology holds it). After the commit point, run maintenance (aliases,
retention) runs where the topology says (a single writer, rank 0 of a group).
This is the shape of DCP's ``save()``: a planner (what to write: the
component registry) joined to a storage writer (the commit strategy).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any, Mapping

from rl_ckpt.config import CheckpointConfig, config_digest, recorded_config
from rl_ckpt.core.async_save import BackgroundWriter, SaveHandle
from rl_ckpt.run.snapshot_files import read_manifest
from rl_ckpt.core.registry import ComponentRegistry, Registered
from rl_ckpt.core.stage_guard import StageGuard, after_staging, stage_background
from rl_ckpt.core.staging import StagingArea
from rl_ckpt.core.topology import Topology
from rl_ckpt.core.writer import write_component
from rl_ckpt.errors import CheckpointError, ConfigError, SerializationError
from rl_ckpt.format.manifest import Manifest, now_iso, snapshot_id
from rl_ckpt.format.metrics import clean_metrics
from rl_ckpt.format.state_codec import EncodedState, encode_state
from rl_ckpt.recovery.probe import run_probe
from rl_ckpt.run.catalog import Catalog, SnapshotInfo
from rl_ckpt.commit import Attempt, CommitStrategy
from rl_ckpt.errors import post_commit_text
from rl_ckpt.run.dedup import ObjectWriter
from rl_ckpt.run.maintenance import RunMaintenance, referenced_objects
from rl_ckpt.storage import Storage

log = logging.getLogger("rl_ckpt")


def check_step(step: Any) -> None:
    """ConfigError unless ``step`` is a non-negative int."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"global_step must be a non-negative int, got {step!r}", key="global_step")


class SavePipeline:
    """Stages, persists and commits the registered state of one engine; at most one save in flight.

    Args:
        registry: what to save, under which manifest keys, and the topology (commit strategy, agreement).
        maintenance: run after each commit when the topology says this process runs it.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        train_config: Mapping[str, Any],
        storage: Storage,
        catalog: Catalog,
        registry: ComponentRegistry,
        *,
        maintenance: RunMaintenance | None,
    ) -> None:
        self.config = config
        self.train_config = train_config
        self.storage = storage
        self.catalog = catalog
        self.registry = registry
        self.maintenance = maintenance
        self.staging, self.guard = StagingArea(), StageGuard()
        self._writer: BackgroundWriter | None = None

    @property
    def topology(self) -> Topology:
        """Who this process is in a save (the registry's: it changes once, when sharded state registers)."""
        return self.registry.topology

    @property
    def commit(self) -> CommitStrategy:
        """The commit strategy saves go through (the topology's)."""
        return self.registry.topology.commit

    # -- stage -------------------------------------------------------------------
    def probes(self, kind: str) -> dict:
        """Reference outputs of the post-load probe, taken from the state being saved."""
        if not self.config.post_load_check or kind != "full":
            return {}
        out = {}
        for reg in self.registry.saved(kind):
            if reg.sharded is not None:
                continue  # a probe forward of a sharded module is a collective; its chunks carry checksums
            result = run_probe(reg.obj, fn=reg.probe, shape=self.config.probe_shapes.get(reg.name))
            if result is not None:
                out[self.registry.key(reg.name)] = result
        return out

    def stage(self, kind: str = "full", *, copy: bool = False, capture: Any = None) -> dict[str, EncodedState]:
        """Every saved component's state, split into tensors/tables/JSON.

        ``copy``: into this pipeline's staging buffers (a background save), which then hold only what this round
        staged; ``capture``: a ``core/stage_guard.Capture`` that defers the guarded tensors to a stager."""
        from rl_ckpt.sharded import stage_sharded  # (lazy: see registry.SHARDED_IMPORT)

        staged, area = {}, capture or self.staging
        try:
            for reg in self.registry.saved(kind):
                if reg.sharded is not None:
                    staged[reg.name] = stage_sharded(
                        reg.sharded,
                        self.registry.rank,
                        copy=copy,
                        name=reg.name,
                        staging=self.staging if copy else None,
                    )
                elif copy:
                    staged[reg.name] = area.stage(reg.name, encode_state(reg.name, _state_of(reg), host=False))
                else:
                    staged[reg.name] = encode_state(reg.name, _state_of(reg))
        finally:
            if copy and capture is None:  # device-to-host copies land; buffers of keys not staged this round are freed
                self.staging.finish()
        if not staged and not (self.topology.empty_part_ok and len(self.registry)):
            # A participant whose state is all replicated (written by rank 0) contributes an empty part.
            raise CheckpointError(
                f"nothing to save in a {kind} snapshot: register components first"
                + (" (or list them in light_components)" if kind == "light" else ""),
                kind=kind,
            )
        return staged

    # -- save --------------------------------------------------------------------
    def save(
        self, global_step: int, metrics: Mapping[str, Any] | None, tags: Mapping[str, Any] | None, kind: str
    ) -> SnapshotInfo:
        """Stage and persist now; returns once committed."""
        check_step(global_step)
        self.wait()  # one save at a time, in order
        try:
            base = self.base_for(kind)
            probes = self.probes(kind)
            staged = self.stage(kind)
        except BaseException as exc:
            self.failed_before_begin(global_step, kind, exc)
            raise
        return self.persist(staged, global_step, metrics=metrics, tags=tags, kind=kind, base=base, probes=probes)

    def save_async(
        self, global_step: int, metrics: Mapping[str, Any] | None, tags: Mapping[str, Any] | None, kind: str
    ) -> SaveHandle:
        """Capture the state now, copy it in the background (``core/stage_guard.py``), persist on the writer."""
        check_step(global_step)
        self.wait()
        started = time.perf_counter()
        try:
            base = self.base_for(kind)
            probes = self.probes(kind)
            rnd = stage_background(self, kind)
            metrics = clean_metrics(metrics)
        except BaseException as exc:
            self.failed_before_begin(global_step, kind, exc)
            raise
        blocked = time.perf_counter() - started
        if self._writer is None:
            self._writer = BackgroundWriter(nice=self.config.writer_nice)
        job = after_staging(
            rnd,
            partial(
                self.persist, global_step=global_step, metrics=metrics, tags=tags, kind=kind, base=base, probes=probes
            ),
            partial(self.failed_before_begin, global_step, kind),
        )
        return self._writer.submit(job, global_step, kind, blocked, stage=rnd)

    def failed_before_begin(self, global_step: int, kind: str, error: BaseException) -> None:
        """A save failed before it began: the other participants, if any, must fail with it at once."""
        self.topology.failed_before_begin(global_step, kind, error)

    def agree_to_save(self, global_step: int, kind: str) -> bool:
        """Whether a due save of ``global_step`` goes ahead.

        Alone: unless a save is still in flight. With a manager, one decision
        for every participant of the snapshot: the first participant to ask
        decides (skip if its previous save is still running, else save), so
        ranks never split into half-snapshots; a participant told to save
        while busy waits for its previous save first.
        """
        return self.topology.agree(global_step, kind, self.saving)

    @property
    def saving(self) -> bool:
        """True while a background save is in flight."""
        return self._writer is not None and self._writer.busy

    def wait(self) -> None:
        """Wait for the background save in flight, if any (its error stays on its handle)."""
        if self._writer is not None:
            self._writer.wait_idle()
        self.guard.disarm()

    def base_for(self, kind: str) -> str | None:
        """The full snapshot a light one builds on (None for a full snapshot)."""
        if kind == "full":
            return None
        if kind != "light":
            raise ConfigError(f"kind must be 'full' or 'light', got {kind!r}", key="kind")
        fulls = self.catalog.snapshots("full")
        if not fulls:
            raise CheckpointError("a light snapshot needs a full snapshot to build on; save a full snapshot first")
        return fulls[-1].snapshot_id

    # -- persist -------------------------------------------------------------------
    def persist(
        self,
        staged: Mapping[str, EncodedState],
        global_step: int,
        *,
        metrics=None,
        tags=None,
        kind: str = "full",
        base: str | None = None,
        probes: dict | None = None,
    ) -> SnapshotInfo:
        """Write, verify and commit ``staged``. Safe to run on a background thread."""
        sid = snapshot_id(global_step, kind)
        attempt = self.commit.begin(sid)
        try:
            files, sections = self._write(staged, attempt)
            recorded = recorded_config(self.config, self.train_config)
            participant = self.registry.participant
            manifest = Manifest(
                snapshot_id=sid,
                global_step=global_step,
                kind=kind,
                created_at=now_iso(),
                base_snapshot_id=base,
                config_digest=config_digest(recorded),
                config=recorded,
                state_schema_version=self.config.schema_version,
                metrics=clean_metrics(metrics),
                tags=dict(tags or {}),
                files=files,
                components=sections,
                writer={"attempt": attempt.attempt_id, **({"participant": participant} if participant else {})},
                extra={"probes": probes} if probes else {},
            )
            merged = self.commit.commit(attempt, manifest.to_bytes())
            if merged is not None:  # several participants: the committed manifest merges every part
                manifest = merged
        except BaseException as exc:
            if manifest_landed(self.storage, attempt):
                # The manifest is there and names this attempt (the error came after it landed, e.g. a
                # lost response or a failed folder fsync): the save is not acknowledged, but its data
                # now belongs to a committed snapshot and must not be deleted.
                log.error("save of %s failed after its manifest landed; keeping its data", sid)
                if isinstance(exc, CheckpointError):
                    exc.message = f"{post_commit_text(exc)} (after {sid}'s manifest landed: it may be committed)"
                    exc.args = (exc.message,)
                raise
            try:
                self.commit.fail(sid, attempt, exc)
            except CheckpointError as cleanup_error:  # the original error matters more; gc cleans up
                log.warning("could not clean up failed save of %s: %s", sid, cleanup_error)
            raise
        info = SnapshotInfo.from_manifest(manifest)
        self.catalog.add(info)
        log.info("committed %s (%d files, %d bytes)", sid, len(files), info.size_bytes)
        if self.maintenance is not None and self.topology.runs_maintenance:
            info.warnings = self.maintenance.after_commit()
        return info

    def _write(self, staged: Mapping[str, EncodedState], attempt: Attempt) -> tuple[list, dict]:
        """Every staged component's files inside ``attempt``: (manifest file entries, component sections)."""
        from rl_ckpt.sharded import write_shards  # (lazy: see registry.SHARDED_IMPORT)

        cfg = self.config
        objects = self._object_writer() if cfg.dedup else None
        files, sections = [], {}
        for name, enc in staged.items():
            key = self.registry.key(name)
            if "/" in key:
                self.storage.makedirs(attempt.data_path(key.rsplit("/", 1)[0]))
            reg = self.registry.get(name)
            if reg is not None and reg.sharded is not None:
                entries, section = write_shards(
                    self.storage,
                    attempt,
                    key,
                    enc,
                    self.registry.rank,
                    algo=cfg.checksum_algo,
                    verify=cfg.verify_after_write,
                    block_bytes=reg.sharded.block_bytes,
                    min_block_bytes=reg.sharded.min_block_bytes,
                    objects=objects,
                )
            else:
                entries, section = write_component(
                    self.storage,
                    attempt,
                    key,
                    enc,
                    algo=cfg.checksum_algo,
                    verify=cfg.verify_after_write,
                    objects=objects,
                )
            section["kind"] = reg.kind if reg is not None else "other"
            files += entries
            sections[key] = section
        return files, sections

    def _object_writer(self) -> ObjectWriter:
        if not self.topology.applies_retention:
            # The manager applies retention: see its deletions before reusing any chunk.
            self.catalog.refresh()
        committed = referenced_objects(self.catalog.snapshots())
        return ObjectWriter(
            self.storage, self.config.checksum_algo, committed, min_bytes=self.config.dedup_min_tensor_bytes
        )

    def beat(self, global_step: int) -> None:
        """Heartbeat to the manager (rate-limited); a no-op without one."""

        def newest() -> str | None:
            snapshots = self.catalog.snapshots()
            return snapshots[-1].snapshot_id if snapshots else None

        self.topology.beat(global_step, newest)

    def close(self) -> None:
        """Wait for the save in flight and stop the background writer."""
        if self._writer is not None:
            self._writer.close()


def manifest_landed(storage: Storage, attempt: Attempt) -> bool:
    """True when the snapshot's committed manifest names ``attempt``: its data belongs to a committed snapshot."""
    try:
        return read_manifest(storage, attempt.snapshot_id).writer.get("attempt") == attempt.attempt_id
    except CheckpointError:
        return False


def _state_of(reg: Registered) -> Any:
    """``reg.obj.state_dict()``; an exception it raises becomes a SerializationError naming the component."""
    try:
        return reg.obj.state_dict()
    except CheckpointError:
        raise
    except Exception as exc:  # the user's own code: name the component, keep the cause chained
        raise SerializationError(
            f"component {reg.name!r}: state_dict() raised {type(exc).__name__}: {exc}; nothing was saved",
            component=reg.name,
            key="",
        ) from exc


__all__ = ["SavePipeline", "check_step"]
