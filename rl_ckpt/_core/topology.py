"""Who an engine is in a save, chosen once: its topology.

Three topologies, one object each; the engine, save pipeline, registry and
restorer ask it instead of branching on flags:

- :class:`Solo`: one writer (a single process, or ranks that each save alone);
  components sit at the top of a snapshot, it commits with the storage's own
  strategy, decides by its own clock, plans its own restore, runs retention and
  retires the failed timeline after a restore (rank 0).
- :class:`TorchDistributed`: the ranks of a torch.distributed group commit each
  snapshot together (:class:`~rl_ckpt._commit.collective.DistributedCommit`,
  rank 0 commits); each rank is a participant (``learner-1``) with replicated
  state under ``shared/``; rank 0 runs maintenance and retires, restores agree
  across ranks.
- :class:`Managed`: a ``CheckpointManager`` is the commit point; the manager
  client (:class:`~rl_ckpt.integrations._managed.ManagerClient`: register,
  heartbeat, decide, plan, record a failure) answers save/skip and cadence for
  every participant, hands out one recovery plan and retires; the manager runs
  retention.

The one transition: a :class:`Solo` engine of several ranks that registers
sharded state becomes :class:`TorchDistributed`
(:meth:`Topology.with_sharded_state`): its shards must be committed together.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rl_ckpt._commit import CommitStrategy
from rl_ckpt.errors import ConfigError
from rl_ckpt._format.manifest import snapshot_id
from rl_ckpt.integrations._managed import ManagerClient, join_manager, participant_name
from rl_ckpt._recovery.plan import RecoveryPlan, layout_line
from rl_ckpt._run.layout import SHARED_SCOPE, component_key
from rl_ckpt._storage import Storage


class Topology:
    """What every topology answers; the defaults are a single writer's (:class:`Solo`).

    Args:
        rank, world_size, role: this process among the processes of its role.
        commit: the commit strategy saves go through.
    """

    name = "solo"

    def __init__(self, *, rank: int, world_size: int, role: str, commit: CommitStrategy) -> None:
        self.rank = rank
        self.world_size = world_size
        self.role = role
        self.commit = commit
        self.participant: str | None = None  # this process's name in a snapshot of several participants

    def __repr__(self) -> str:
        who = self.participant or f"rank {self.rank} of {self.world_size}"
        return f"{type(self).__name__}({who}, commit={type(self.commit).__name__})"

    # -- who ---------------------------------------------------------------------
    @property
    def participants(self) -> list[str] | None:
        """Every participant a snapshot waits for (None: one writer)."""
        return None

    @property
    def manager(self) -> Any:
        """The ``CheckpointManager`` actor handle this process commits through, or None."""
        return None

    @property
    def replicates(self) -> bool:
        """Whether learners' replicated state (modules, optimizers, ...) is written once, by rank 0."""
        return False

    @property
    def leads(self) -> bool:
        """The one process that writes a run's side records (the first participant by name, or rank 0)."""
        expected = self.participants
        return self.participant == min(expected) if expected else self.rank == 0

    # -- scopes ------------------------------------------------------------------
    def key(self, name: str, replicated: bool) -> str:
        """The manifest key (and data folder) of a plain component ``name`` saved by this process."""
        if self.participant is None:
            return component_key(name)
        return component_key(name, SHARED_SCOPE if replicated else self.participant)

    def stored_keys(self, name: str) -> list[str]:
        """Where this process looks for ``name`` in a manifest, own scope first."""
        if self.participant is None:
            return [component_key(name)]
        return [component_key(name, self.participant), component_key(name, SHARED_SCOPE), component_key(name)]

    # -- saving ------------------------------------------------------------------
    def agree(self, global_step: int, kind: str, busy: bool) -> bool:
        """Whether a due save goes ahead: alone, unless a save is still in flight."""
        return not busy

    def cadence(
        self,
        global_step: int,
        every_seconds: float | None,
        by_steps: Callable[[], str | None],
        by_clock: Callable[[], str | None],
        busy: bool,
    ) -> tuple[str | None, bool]:
        """``(kind due, go)`` for ``global_step``: due by this process's clock (``by_clock``), then agreed."""
        kind = by_clock()
        return kind, kind is not None and self.agree(global_step, kind, busy)

    @property
    def empty_part_ok(self) -> bool:
        """Whether a save holding nothing is a valid part (a participant whose state others write)."""
        return False

    def failed_before_begin(self, global_step: int, kind: str, error: BaseException) -> None:
        """A save failed before it began: tell the commit strategy (other participants fail with it)."""
        self.commit.fail(snapshot_id(global_step, kind), None, error)

    @property
    def applies_retention(self) -> bool:
        """Whether this run's retention is applied by this engine (else by the manager)."""
        return True

    @property
    def runs_maintenance(self) -> bool:
        """Whether this process runs aliases and retention after each commit."""
        return True

    def beat(self, global_step: int, newest: Callable[[], str | None]) -> None:
        """Heartbeat to the manager with the step and the newest snapshot (``newest()``); a no-op without one."""

    # -- restoring ---------------------------------------------------------------
    def recovery_plan(
        self,
        failure: Any,
        snapshot_id: str | None,
        storage: Storage,
        restart_mesh: dict | None,
        build: Callable[[], RecoveryPlan],
        light: bool = True,
    ) -> RecoveryPlan:
        """The plan this process restores by: its own (``build()``)."""
        return build()

    @property
    def records_decisions(self) -> bool:
        """Whether a restore writes its plan's coordinator decision into the run (rank 0 of its own plans)."""
        return self.rank == 0

    def agrees_on_restore(self) -> bool:
        """Whether restores agree across ranks (every rank loaded, the same probe outputs) before going on."""
        return False

    def after_restore(self, result: Any, plan: RecoveryPlan, retire: Callable[[Any, RecoveryPlan], None]) -> None:
        """What follows a restore: rank 0 retires the failed timeline (``retire(result, plan)``)."""
        if self.rank == 0:
            retire(result, plan)

    # -- transitions and lifecycle -----------------------------------------------
    def with_sharded_state(self) -> "Topology":
        """The topology once sharded state is registered: ranks of a group commit each snapshot together
        (:class:`TorchDistributed`); unchanged alone, with a manager, or when already so."""
        if self.world_size == 1:
            return self
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                f"sharded state on rank {self.rank} of {self.world_size}: initialise torch.distributed "
                "before registering it (the ranks commit each snapshot together), or pass a manager",
                key="world_size",
            )
        return TorchDistributed.joining(self)

    def close(self) -> None:
        """Leave the run (nothing to say alone)."""


class Solo(Topology):
    """One writer: see :class:`Topology`."""


class _Participants(Topology):
    """Several participants in one snapshot: state in ``shared/`` and ``<participant>/`` scopes."""

    @property
    def replicates(self) -> bool:
        return True

    def agrees_on_restore(self) -> bool:
        dist = torch.distributed
        return self.role == "learner" and self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def with_sharded_state(self) -> Topology:
        return self


class TorchDistributed(_Participants):
    """The ranks of a torch.distributed group commit each snapshot together; rank 0 commits, runs maintenance
    and retires."""

    name = "torch.distributed"

    def __init__(self, *, rank: int, world_size: int, role: str, commit: CommitStrategy) -> None:
        super().__init__(rank=rank, world_size=world_size, role=role, commit=commit)
        self.names = [participant_name(role, r) for r in range(world_size)]
        self.participant = self.names[rank]

    @classmethod
    def joining(cls, solo: Topology) -> "TorchDistributed":
        """``solo``'s process as a rank of its group: its commit strategy wrapped in the collective one."""
        from rl_ckpt._commit.collective import DistributedCommit  # (lazy: see registry.SHARDED_IMPORT)

        names = [participant_name(solo.role, r) for r in range(solo.world_size)]
        commit = DistributedCommit(solo.commit, solo.rank, solo.world_size, names)
        return cls(rank=solo.rank, world_size=solo.world_size, role=solo.role, commit=commit)

    @property
    def participants(self) -> list[str]:
        return list(self.names)

    @property
    def runs_maintenance(self) -> bool:
        return self.rank == 0

    def after_restore(self, result: Any, plan: RecoveryPlan, retire: Callable[[Any, RecoveryPlan], None]) -> None:
        super().after_restore(result, plan, retire)
        if self.agrees_on_restore():
            torch.distributed.barrier()  # no rank saves a step of the failed timeline before it is retired


class Managed(_Participants):
    """A ``CheckpointManager`` commits, decides, plans, retires and applies retention; this process is one
    participant, linked to it by its manager client (with heartbeat)."""

    name = "managed"

    def __init__(
        self,
        manager: Any,
        client: ManagerClient,
        *,
        rank: int,
        world_size: int,
        role: str,
        commit: CommitStrategy,
        participants: list[str],
    ) -> None:
        super().__init__(rank=rank, world_size=world_size, role=role, commit=commit)
        self.handle = manager
        self.client = client
        self.participant = client.participant
        self.expected = list(participants)

    @property
    def participants(self) -> list[str]:
        return list(self.expected)

    @property
    def manager(self) -> Any:
        return self.handle

    def agree(self, global_step: int, kind: str, busy: bool) -> bool:
        """One decision for every participant: the first to ask decides (skip if its previous save is still
        running), so ranks never split into half-snapshots."""
        return self.client.decide(snapshot_id(global_step, kind), busy)

    def cadence(
        self,
        global_step: int,
        every_seconds: float | None,
        by_steps: Callable[[], str | None],
        by_clock: Callable[[], str | None],
        busy: bool,
    ) -> tuple[str | None, bool]:
        """Under a time cadence the manager's clock decides for everyone (each rank's would differ)."""
        if every_seconds:
            return self.client.decide_step(global_step, by_steps(), busy, every_seconds)
        return super().cadence(global_step, every_seconds, by_steps, by_clock, busy)

    @property
    def empty_part_ok(self) -> bool:
        return True

    def failed_before_begin(self, global_step: int, kind: str, error: BaseException) -> None:
        if kind in ("full", "light"):  # (another kind names no snapshot: nobody waits for it)
            super().failed_before_begin(global_step, kind, error)

    @property
    def applies_retention(self) -> bool:
        return False

    @property
    def runs_maintenance(self) -> bool:
        return False

    def beat(self, global_step: int, newest: Callable[[], str | None]) -> None:
        self.client.heartbeat.beat(global_step, newest())

    def recovery_plan(
        self,
        failure: Any,
        snapshot_id: str | None,
        storage: Storage,
        restart_mesh: dict | None,
        build: Callable[[], RecoveryPlan],
        light: bool = True,
    ) -> RecoveryPlan:
        """One plan for all, made (and recorded) by the manager; a named snapshot is this process's own plan.
        ``light``: whether the participants apply light layers (the manager retires what the plan will not load)."""
        if snapshot_id is not None:
            return build()
        plan = RecoveryPlan.from_json(self.client.recovery_plan(failure.to_json() if failure else None, light))
        plan.layout = layout_line(storage, plan.target, restart_mesh)  # not the manager's to know
        return plan

    @property
    def records_decisions(self) -> bool:
        return False  # the manager records the decisions of its own plans

    def after_restore(self, result: Any, plan: RecoveryPlan, retire: Callable[[Any, RecoveryPlan], None]) -> None:
        """The manager retired the failed timeline when it handed out the plan: report what it retired."""
        result.retired = list(plan.retired or [])

    def close(self) -> None:
        """Stop the heartbeat, then unregister: a clean exit is not a lost heartbeat."""
        self.client.heartbeat.close()
        self.client.unregister()


def choose_topology(
    storage: Storage,
    config: Any,
    *,
    commit: CommitStrategy,
    manager: Any,
    rank: int,
    world_size: int,
    role: str,
    participants: list[str] | None,
    actor_handle: Any,
) -> Topology:
    """The topology an engine starts with: :class:`Managed` with a manager (this process registers with it),
    else :class:`Solo` (a :class:`TorchDistributed` rank once it registers sharded state)."""
    if manager is None:
        return Solo(rank=rank, world_size=world_size, role=role, commit=commit)
    _name, client, participant_commit = join_manager(
        manager, storage, config, role, rank, world_size, participants, actor_handle
    )
    return Managed(
        manager,
        client,
        rank=rank,
        world_size=world_size,
        role=role,
        commit=participant_commit,
        participants=participant_commit.expected,
    )


__all__ = ["Managed", "Solo", "Topology", "TorchDistributed", "choose_topology"]
