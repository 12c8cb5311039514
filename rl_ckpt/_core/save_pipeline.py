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
from rl_ckpt._core.async_save import BackgroundWriter, SaveHandle
from rl_ckpt._run.snapshot_files import read_manifest
from rl_ckpt._core.capture import StateCapture
from rl_ckpt._core.registry import ComponentRegistry
from rl_ckpt._core.stage_guard import StageGuard, after_staging, stage_background
from rl_ckpt._core.staging import StagingArea
from rl_ckpt._core.topology import Topology
from rl_ckpt._core.writer import write_component
from rl_ckpt.errors import CheckpointError, ConfigError
from rl_ckpt._format.manifest import Manifest, now_iso, snapshot_id
from rl_ckpt._format.metrics import clean_metrics
from rl_ckpt._format.state_codec import EncodedState
from rl_ckpt._run.catalog import Catalog, SnapshotInfo
from rl_ckpt._commit import Attempt, CommitStrategy
from rl_ckpt.errors import post_commit_text
from rl_ckpt._run.dedup import ObjectWriter
from rl_ckpt._run.maintenance import RunMaintenance, referenced_objects
from rl_ckpt._storage import Storage
from rl_ckpt._storage.base import per_file

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
        self.capture, self.guard = StateCapture(config, registry), StageGuard()
        self._writer: BackgroundWriter | None = None

    @property
    def topology(self) -> Topology:
        """Who this process is in a save (the registry's: it changes once, when sharded state registers)."""
        return self.registry.topology

    @property
    def commit(self) -> CommitStrategy:
        """The commit strategy saves go through (the topology's)."""
        return self.registry.topology.commit

    # -- stage (core/capture.py) ----------------------------------------------------
    @property
    def staging(self) -> StagingArea:
        """The reused staging buffers of background saves."""
        return self.capture.staging

    @staging.setter
    def staging(self, area: StagingArea) -> None:
        self.capture.staging = area

    def probes(self, kind: str) -> dict:
        """Reference outputs of the post-load probe, taken from the state being saved."""
        return self.capture.probes(kind)

    def stage(self, kind: str = "full", *, copy: bool = False, capture: Any = None) -> dict[str, EncodedState]:
        """Every saved component's state, split into tensors/tables/JSON (``StateCapture.stage``)."""
        return self.capture.stage(kind, copy=copy, capture=capture)

    def prepare(self, kind: str = "full") -> int:
        """Allocate and fault in the staging buffers of background saves ahead of the first one, on a thread;
        returns the bytes prepared (``StateCapture.prepare``)."""
        return self.capture.prepare(kind)

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
            objects = self._object_writer() if self.config.dedup else None
            files, sections = write_staged(self.storage, self.registry, self.config, attempt, staged, objects)
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


def write_staged(
    storage: Storage,
    registry: ComponentRegistry,
    cfg: CheckpointConfig,
    attempt: Attempt,
    staged: Mapping[str, EncodedState],
    objects: ObjectWriter | None,
) -> tuple[list, dict]:
    """Every staged component's files inside ``attempt``: (manifest file entries, component sections);
    ``objects``: the dedup object writer, if any."""

    def write_one(name: str, enc: EncodedState) -> tuple[list, str, dict]:
        key = registry.key(name)
        if "/" in key:
            storage.makedirs(attempt.data_path(key.rsplit("/", 1)[0]))
        reg = registry.get(name)
        if reg is not None and reg.sharded is not None:
            from rl_ckpt._sharded import write_shards  # (lazy: see registry.SHARDED_IMPORT)

            entries, section = write_shards(
                storage,
                attempt,
                key,
                enc,
                registry.rank,
                algo=cfg.checksum_algo,
                verify=cfg.verify_after_write,
                block_bytes=reg.sharded.block_bytes,
                min_block_bytes=reg.sharded.min_block_bytes,
                objects=objects,
            )
        else:
            entries, section = write_component(
                storage,
                attempt,
                key,
                enc,
                algo=cfg.checksum_algo,
                verify=cfg.verify_after_write,
                objects=objects,
            )
        section["kind"] = reg.kind if reg is not None else "other"
        return entries, key, section

    # (one at a time with the dedup object writer: one writer, shared)
    written = per_file(storage, list(staged.items()), lambda item: write_one(*item), at_once=objects is None)
    files, sections = [], {}
    for entries, key, section in written:
        files += entries
        sections[key] = section
    return files, sections


def manifest_landed(storage: Storage, attempt: Attempt) -> bool:
    """True when the snapshot's committed manifest names ``attempt``: its data belongs to a committed snapshot."""
    try:
        return read_manifest(storage, attempt.snapshot_id).writer.get("attempt") == attempt.attempt_id
    except CheckpointError:
        return False


__all__ = ["SavePipeline", "check_step", "write_staged"]
