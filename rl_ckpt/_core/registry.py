"""The registered components of one engine, and where each lives in a manifest.

Saving and restoring both ask the same questions of it: which components a
snapshot of a kind holds (config switches, light components, replicated state
written once by rank 0), and under which manifest key a component is stored
for this participant (its name alone, ``shared/<name>`` or ``<participant>/<name>``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from rl_ckpt.components import check_component_name, classify
from rl_ckpt.config import CheckpointConfig
from rl_ckpt.errors import ConfigError
from rl_ckpt._format.manifest import Manifest
from rl_ckpt._core.topology import Topology
from rl_ckpt._sharded import holds_shards
from rl_ckpt.integrations._managed import participant_name

# SHARDED_IMPORT: the names of rl_ckpt._sharded are taken where they are used, and only for sharded state: they
# pull in torch.distributed.checkpoint and DTensor (seconds), which a process that saves no shards never pays.

# Identical on every learner rank: written once, by rank 0, under ``shared/``.
REPLICATED_KINDS = ("module", "optimizer", "scheduler", "progress")


@dataclasses.dataclass
class Registered:
    """One registered component."""

    name: str
    obj: Any
    kind: str
    probe: Any = None  # a user probe function obj -> output, for the post-load check
    replicated: bool = False  # sharded saves: the same on every learner rank, written once by rank 0
    sharded: Any = None  # a rl_ckpt._sharded.ShardedState: every rank writes its own shards of it
    background: bool | None = None  # save_async copies it in the background (None: core/stage_guard.py decides)


class ComponentRegistry:
    """Registered components plus who this process is in a save: its topology (``core/topology.py``).

    ``participant`` is None for a single writer; it is set when the engine
    joins a multi-participant save: through a manager, or as a rank of a
    torch.distributed group committing together. The engine sets ``topology``
    (once, and again on the one transition: sharded state registered).
    """

    def __init__(self, config: CheckpointConfig, topology: Topology) -> None:
        self.config = config
        self.topology = topology
        self._components: dict[str, Registered] = {}

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def role(self) -> str:
        return self.topology.role

    @property
    def participant(self) -> str | None:
        return self.topology.participant

    def prepare(self, name: str, obj: Any, *, kind: str | None = None, probe: Any = None) -> Registered:
        """Check ``obj`` can be registered as ``name`` and describe it (not registered yet: see :meth:`add`)."""
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
        if holds_shards(obj):  # (found without importing DCP, which unsharded state never needs: SHARDED_IMPORT)
            from rl_ckpt._sharded import as_sharded

            reg.sharded = as_sharded(name, obj, [r.sharded or r.obj for r in self._components.values()])
        if reg.sharded is not None:
            reg.kind = kind or reg.sharded.checkpoint_kind
        return reg

    def add(self, reg: Registered, replicated: bool | None = None, background: bool | None = None) -> None:
        """Register ``reg``; ``replicated`` None: learners' modules, optimizers, schedulers and progress
        are replicated in a multi-participant save. ``background``: see ``core/stage_guard.py``."""
        reg.background = background
        if replicated is None:
            replicated = self.topology.replicates and self.role == "learner" and reg.kind in REPLICATED_KINDS
        reg.replicated = bool(replicated) and reg.sharded is None
        self._components[reg.name] = reg

    def remove(self, name: str) -> None:
        """Forget component ``name``: later snapshots no longer hold it."""
        self._components.pop(name, None)

    def __iter__(self) -> Iterator[Registered]:
        return iter(list(self._components.values()))

    def __len__(self) -> int:
        return len(self._components)

    def __contains__(self, name: str) -> bool:
        return name in self._components

    def get(self, name: str) -> Registered | None:
        """The registration of ``name``, or None."""
        return self._components.get(name)

    def objects(self) -> dict[str, Any]:
        """Component name -> registered object."""
        return {n: r.obj for n, r in self._components.items()}

    def restart_mesh(self) -> dict | None:
        """The layout this process restores sharded state onto (None when nothing is registered).

        The mesh of the first registered sharded component; a process with only
        plain components restores sharded state unsharded.
        """
        if not self._components:
            return None
        sharded = next((r.sharded for r in self._components.values() if r.sharded is not None), None)
        return sharded.saved_by() if sharded is not None else {"world_size": self.world_size, "mesh": []}

    def kinds(self) -> dict[str, str]:
        """Component name -> kind (module, optimizer, ...)."""
        return {n: r.kind for n, r in self._components.items()}

    def saved(self, kind: str) -> list[Registered]:
        """The components a snapshot of ``kind`` written by this process holds."""
        cfg = self.config
        out = []
        for reg in self._components.values():
            if reg.kind == "optimizer" and not cfg.save_optimizer:
                continue
            if reg.kind == "rng" and not cfg.save_rng_state:
                continue
            if reg.kind == "buffer" and not cfg.save_replay_buffer:
                continue
            if kind == "light" and (reg.name not in cfg.light_components or getattr(reg.obj, "data_position", False)):
                # A light snapshot is laid over an older full one's weights: a data position (rl_ckpt.data) in it
                # would be ahead of what those weights trained on, so the data stays with the weights.
                continue
            if reg.replicated and self.rank != 0:
                continue  # rank 0 writes replicated state once for everyone
            out.append(reg)
        return out

    def excluded(self, reg: Registered) -> bool:
        """True when a full snapshot of this process leaves ``reg`` out (config switch, or another rank writes it)."""
        return reg not in self.saved("full")

    def key(self, name: str) -> str:
        """Where a component lives in a manifest: its name, or ``<scope>/<name>`` in a sharded save."""
        reg = self._components[name]
        return name if reg.sharded is not None else self.topology.key(name, reg.replicated)

    def per_rank(self) -> dict[str, bool]:
        """Components this participant stores under its own name (``learner-1/rng``), none for a single
        process: name -> whether it can derive its state (``derive_state``) as a rank that did not exist at save."""
        if self.participant is None:
            return {}
        return {
            r.name: callable(getattr(r.obj, "derive_state", None))
            for r in self._components.values()
            if r.sharded is None and not r.replicated and not self.excluded(r)
        }

    def group(self) -> list[str]:
        """The participants of this process's role in the group restoring (``learner-0`` ... ``learner-<world-1>``)."""
        names = [participant_name(self.role, r) for r in range(self.world_size)]
        return names + [self.participant] if self.participant and self.participant not in names else names

    def stored_key(self, manifest: Manifest, name: str) -> str | None:
        """The manifest key holding component ``name`` for this participant (own scope first)."""
        return next((k for k in self.topology.stored_keys(name) if k in manifest.components), None)
