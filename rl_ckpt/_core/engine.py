"""``CheckpointEngine``: register the training state, save it, verify it, restore it.

The engine is the public front of one run in one process. It holds the
pieces that do the work and delegates to them:

- :class:`~rl_ckpt._core.topology.Topology`: who this process is in a save
  (:class:`~rl_ckpt._core.topology.Solo`, ``TorchDistributed`` or ``Managed``),
  chosen once here; the pieces below ask it instead of branching;
- :class:`~rl_ckpt._core.registry.ComponentRegistry`: what is registered, and
  under which manifest key each component lives for this participant;
- :class:`~rl_ckpt._core.save_pipeline.SavePipeline`: stage -> persist ->
  commit (through the commit strategy of ``rl_ckpt._commit``, a manager's,
  or rank 0's of a torch.distributed group);
- :class:`~rl_ckpt._core.run_handle.RunHandle` (what the engine is, beneath): the
  run's storage, catalog and :class:`~rl_ckpt._run.maintenance.RunMaintenance`
  (best aliases and retention after each commit, where the topology says: not
  with a manager, which runs it); listing, verification, recorded decisions, patrol;
- :class:`~rl_ckpt._core.restorer.Restorer`: makes this process's recovery plan
  and follows it into the registered objects, falling back along the plan.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

import torch

from rl_ckpt._commit import CommitStrategy, strategy_for
from rl_ckpt.config import CheckpointConfig
from rl_ckpt._core.async_save import SaveHandle
from rl_ckpt._core.registry import ComponentRegistry
from rl_ckpt._core.restorer import Restorer, RestoreResult
from rl_ckpt._core.run_handle import RunHandle
from rl_ckpt._core.save_pipeline import SavePipeline
from rl_ckpt._core.scheduler import CheckpointScheduler
from rl_ckpt._core.stage_guard import check_background
from rl_ckpt._core.topology import Topology, choose_topology
from rl_ckpt._format.state_codec import EncodedState
from rl_ckpt._recovery.coordinator import FailureInfo
from rl_ckpt._recovery.plan import RecoveryPlan
from rl_ckpt._run.catalog import SnapshotInfo
from rl_ckpt._run.retention import RetentionPolicy
from rl_ckpt._storage import Storage, open_storage


class CheckpointEngine(RunHandle):
    """Saves and restores the whole training state of one run.

    Args:
        config: a :class:`CheckpointConfig`, a dict of config keys, or a YAML path.
        train_config: your hyperparameters (lr, batch size, ...); recorded in every
            manifest and compared on restore (changed keys are warned about).
        storage: use this storage instead of opening ``config.run_url``.
        retention: a :class:`RetentionPolicy` (default: built from keep_latest,
            keep_best and keep_interval_steps); ``False`` keeps everything.
        manager: a ``CheckpointManager`` actor handle: this engine is then one participant of a
            sharded save (the manager commits, keeps the catalog and applies retention).
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
        config = _as_config(config, overrides)
        self.train_config = dict(train_config or {})
        storage = storage or open_storage(config.run_url, config.storage_options)
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.role = role
        topology = choose_topology(
            storage,
            config,
            commit=strategy_for(storage, config.atomic_write),
            manager=manager,
            rank=self.rank,
            world_size=self.world_size,
            role=role,
            participants=participants,
            actor_handle=_current_actor(),
        )
        # The run: storage, catalog, maintenance (with a manager, the manager applies retention).
        super().__init__(config, storage, retention=retention if topology.applies_retention else False)
        self.registry = ComponentRegistry(config, topology)
        self.pipeline = SavePipeline(
            config, self.train_config, self.storage, self.catalog, self.registry, maintenance=self.maintenance
        )
        self.restorer = Restorer(config, self.train_config, self.storage, self.catalog, self.registry)
        self.storage.warm_up()  # first contact (the memory tier's stores) on a thread: not on a restore's path

    # -- registration --------------------------------------------------------
    def register(
        self,
        name: str,
        obj: Any,
        *,
        kind: str | None = None,
        probe: Any = None,
        replicated: bool | None = None,
        background: bool | None = None,
    ) -> Any:
        """Register a component (module, optimizer, scheduler, RNGState, buffer, any Checkpointable).

        ``probe``: a function ``obj -> tensor(s)`` run at save and after load
        (post-load check); modules get an inferred probe when it is omitted.
        ``replicated`` (with a manager): identical on every learner rank, so
        written once by rank 0 (default: modules, optimizers, schedulers and
        progress of learners). ``background``: may ``save_async`` copy it after the call returns (stage_guard.py).
        """
        reg = self.registry.prepare(name, obj, kind=kind, probe=probe)
        if reg.sharded is not None:  # the one topology transition: ranks now commit each snapshot together
            self.registry.topology = self.topology.with_sharded_state()
        self.registry.add(reg, replicated, check_background(name, background))
        return obj

    @property
    def components(self) -> dict[str, Any]:
        """Registered component name -> object."""
        return self.registry.objects()

    @property
    def topology(self) -> Topology:
        """Who this process is in a save: ``Solo``, ``TorchDistributed`` or ``Managed`` (``core/topology.py``)."""
        return self.registry.topology

    @property
    def manager(self) -> Any:
        """The ``CheckpointManager`` actor handle this engine commits through, or None."""
        return self.topology.manager

    @property
    def participant(self) -> str | None:
        """This process's name in a multi-participant save (``learner-0``...), else None."""
        return self.registry.participant

    @property
    def commit(self) -> CommitStrategy:
        """The commit strategy saves go through."""
        return self.pipeline.commit

    # -- saving --------------------------------------------------------------
    def stage(self, kind: str = "full") -> dict[str, EncodedState]:
        """Phase 1: every saved component's state, split into tensors/tables/JSON."""
        return self.pipeline.stage(kind)

    def save(
        self,
        global_step: int,
        metrics: Mapping[str, Any] | None = None,
        *,
        tags: Mapping[str, Any] | None = None,
        kind: str = "full",
    ) -> SnapshotInfo:
        """Save synchronously; returns only after the snapshot is committed (and verified)."""
        self._check_open()
        return self.pipeline.save(global_step, metrics, tags, kind)

    def save_async(
        self,
        global_step: int,
        metrics: Mapping[str, Any] | None = None,
        *,
        tags: Mapping[str, Any] | None = None,
        kind: str = "full",
    ) -> SaveHandle:
        """Capture the state now; copy, write, verify and commit it in the background. The snapshot holds the
        state as of this call (guarded tensors are copied after it; the next optimizer step/forward waits for the
        copy if needed: ``core/stage_guard.py``); one save in flight at most. Errors come back on ``handle.wait()``."""
        self._check_open()
        return self.pipeline.save_async(global_step, metrics, tags, kind)

    def prepare(self, kind: str = "full") -> int:
        """Allocate ``save_async``'s staging buffers on a thread now (the first save finds them ready; held from here
        on: one copy of the saved tensors); returns the bytes prepared."""
        self._check_open()
        return self.pipeline.prepare(kind)

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
        """Phase 2: write, verify and commit ``staged``. Safe to run on a background thread."""
        return self.pipeline.persist(
            staged, global_step, metrics=metrics, tags=tags, kind=kind, base=base, probes=probes
        )

    def scheduler(self, **kwargs: Any) -> CheckpointScheduler:
        """A :class:`CheckpointScheduler` over this engine (``on_error``, ``on_commit``, ``start_step``)."""
        return CheckpointScheduler(self, **kwargs)

    def agree_to_save(self, global_step: int, kind: str = "full") -> bool:
        """Whether a due save of ``global_step`` goes ahead (the scheduler asks; see ``SavePipeline.agree_to_save``)."""
        return self.pipeline.agree_to_save(global_step, kind)

    @property
    def saving(self) -> bool:
        """True while a background save is in flight."""
        return self.pipeline.saving

    def wait(self) -> None:
        """Wait for the background save in flight, if any (its error stays on its handle)."""
        self.pipeline.wait()

    def beat(self, global_step: int) -> None:
        """Heartbeat to the manager (rate-limited); a no-op without one."""
        self.pipeline.beat(global_step)

    # -- recovery --------------------------------------------------------------
    def plan_recovery(
        self,
        failure: FailureInfo | None = None,
        *,
        deep: bool = True,
        snapshot_id: str | None = None,
        light: bool = True,
    ) -> RecoveryPlan:
        """What a restore would do, and why; no side effects.

        Args:
            failure: the failure recovered from; the coordinator chooses the target given the run's decisions.
            deep: re-hash the candidates' files (else check sizes; ``restore`` verifies checksums anyway).
            snapshot_id: plan for this snapshot only.
            light: apply the newest valid light snapshot built on the target.
        """
        self._check_open()
        return self.restorer.plan(failure, deep=deep, snapshot_id=snapshot_id, light=light)

    def restore(
        self,
        plan: RecoveryPlan | None = None,
        *,
        snapshot_id: str | None = None,
        strict: bool = True,
        light: bool = True,
    ) -> RestoreResult:
        """Execute a recovery plan (default: newest valid snapshot) into the registered objects. A snapshot that
        fails while loading (checksum, decoding, post-load probe) is skipped with a logged reason for the plan's
        next fallback. No snapshot at all: ``fresh == True``; none valid: :class:`NoValidSnapshotError`."""
        self._check_open()
        self.wait()
        return self.restorer.plan_and_restore(
            plan, snapshot_id=snapshot_id, strict=strict, light=light, record=self.topology.records_decisions
        )

    def rejoin(self, *, newer_than: int | None = None) -> RestoreResult:
        """A replaced participant takes back its own state while the others go on (scoped recovery): the newest
        committed full snapshot holding every component it registered (after step ``newer_than``), verified, older
        ones if it fails. No run-wide plan: no decision recorded, no pending save aborted, nothing retired."""
        self._check_open()
        self.wait()
        with self.storage.read_session():
            return self.restorer.rejoin(newer_than)

    def load_full_weights(self, name: str, module: torch.nn.Module, snapshot_id: str | None = None) -> str:
        """Load sharded component ``name`` whole into an ordinary ``module`` (rollout workers: no process group).

        Streams chunk by chunk and verifies every block; uses the newest
        committed snapshot holding ``name`` unless ``snapshot_id`` is given.
        Returns the snapshot id loaded.
        """
        self._check_open()
        return self.restorer.load_full_weights(name, module, snapshot_id)

    # -- lifecycle -----------------------------------------------------------
    def close(self) -> None:
        """Wait for the save in flight, then release the storage."""
        if not self._closed:
            self._stop_patrol()
            self.pipeline.close()
            self.topology.close()  # with a manager: a clean exit, not a lost heartbeat
            super().close()


def _as_config(config: CheckpointConfig | Mapping[str, Any] | str | None, overrides: dict) -> CheckpointConfig:
    """A CheckpointConfig from any accepted form, with keyword ``overrides`` applied."""
    if config is None:
        return CheckpointConfig(**overrides)
    if isinstance(config, str):
        config = CheckpointConfig.from_yaml(config)
    elif isinstance(config, Mapping):
        config = CheckpointConfig.from_dict(config)
    return config.replace(**overrides) if overrides else config


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    return (rank or 0), (world_size or 1)


def _current_actor() -> Any:
    """This process's Ray actor handle, when it is one (so the manager can stop a hung worker)."""
    ray = sys.modules.get("ray")  # a Ray worker has imported Ray; any other process is no actor (no import: ~1 s)
    if ray is None:
        return None
    try:
        if ray.is_initialized():
            return ray.get_runtime_context().current_actor
    except (ImportError, RuntimeError):  # not inside a Ray actor: nothing to hand over
        return None
    return None


__all__ = ["CheckpointEngine", "RestoreResult", "SnapshotInfo"]
