"""Sharded components: FSDP2 / DTensor modules and their optimizers, saved where their shards live.

State comes from ``torch.distributed.checkpoint.state_dict`` (FQN-keyed,
sharded optimizer state) and goes back through ``set_*_state_dict``. A
module or optimizer whose parameters are DTensors is recognised at
``register``; the same code restores a sharded snapshot into a plain module
(one process, no process group): the planner then reads whole tensors.
"""

from __future__ import annotations

import time

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from rl_ckpt.errors import ConfigError, CorruptSnapshotError, StateMismatchError
from rl_ckpt._format.manifest import Manifest
from rl_ckpt._storage import Storage
from rl_ckpt._sharded.dcp_reader import ChunkReader, load_shards
from rl_ckpt._sharded.dcp_writer import (
    DEFAULT_BLOCK_BYTES,
    MIN_BLOCK_BYTES,
    StagedShards,
    TensorStager,
    stage_shards,
)
from rl_ckpt._sharded import holds_shards
from rl_ckpt._sharded.layout import Layout, is_sharded_section


class ShardedState:
    """A model (or its optimizer, with ``optimizer=``) saved and restored shard by shard.

    Register it directly to choose the checksum blocks (``block_bytes`` at
    most, ``min_block_bytes`` at least, else >= 32 blocks per chunk: a
    resharding rank reads at most one block too many at each end of what it
    needs); registering an FSDP2 module or its optimizer wraps it automatically.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        min_block_bytes: int = MIN_BLOCK_BYTES,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.block_bytes = int(block_bytes)
        self.min_block_bytes = int(min_block_bytes)
        self.checkpoint_kind = "optimizer" if optimizer is not None else "module"

    @property
    def target(self) -> Any:
        return self.optimizer if self.optimizer is not None else self.model

    def state_dict(self) -> dict:
        """FQN-keyed state with DTensor values (a fresh optimizer's state is created first, as DCP does)."""
        if self.optimizer is not None:
            return get_optimizer_state_dict(self.model, self.optimizer)
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        if self.optimizer is not None:
            set_optimizer_state_dict(self.model, self.optimizer, state)
        else:
            set_model_state_dict(self.model, state)

    def saved_by(self) -> dict:
        mesh = next((p.device_mesh for p in self.model.parameters() if isinstance(p, DTensor)), None)
        if mesh is None:
            return {"world_size": 1, "mesh": []}
        return {
            "world_size": torch.distributed.get_world_size(),
            "mesh": list(mesh.shape),
            "placements": [
                str(p) for p in next(x for x in self.model.parameters() if isinstance(x, DTensor)).placements
            ],
        }


def _owner_module(optimizer: torch.optim.Optimizer, objects: list[Any]) -> torch.nn.Module | None:
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return next((o for o in objects if isinstance(o, torch.nn.Module) and ids <= {id(p) for p in o.parameters()}), None)


def sharded_view(name: str, obj: Any, objects: list[Any]) -> ShardedState:
    """``obj`` (module, optimizer or ShardedState) as a ShardedState; an optimizer needs its model among ``objects``
    (and takes that model's checksum block sizes when it was registered as a ShardedState)."""
    if isinstance(obj, ShardedState):
        return obj
    if isinstance(obj, torch.nn.Module):
        return ShardedState(obj)
    if isinstance(obj, torch.optim.Optimizer):
        model = _owner_module(obj, [o.model if isinstance(o, ShardedState) else o for o in objects])
        if model is None:
            raise ConfigError(
                f"component {name!r}: a sharded optimizer is saved by parameter name, "
                "so its model must be registered first (register the model, then the optimizer), "
                "or register ShardedState(model, optimizer)",
                key=name,
            )
        like = next((o for o in objects if isinstance(o, ShardedState) and o.model is model), None)
        sizes = {"block_bytes": like.block_bytes, "min_block_bytes": like.min_block_bytes} if like else {}
        return ShardedState(model, obj, **sizes)
    raise ConfigError(
        f"component {name!r}: {type(obj).__name__} is neither a module nor an optimizer; sharded state "
        "is saved for those (or a ShardedState)",
        key=name,
    )


def as_sharded(name: str, obj: Any, objects: list[Any]) -> ShardedState | None:
    """A ShardedState for ``obj`` when it holds DTensors (or already is one), else None."""
    if isinstance(obj, ShardedState):
        return obj
    return sharded_view(name, obj, objects) if holds_shards(obj) else None


def stage_sharded(
    comp: ShardedState, rank: int, *, copy: bool, name: str = "", staging: TensorStager | None = None
) -> StagedShards:
    """This rank's local shards of ``comp``, planned by DCP (``copy``: taken out of the trainer's hands, into
    ``staging``'s reused host buffers under component ``name`` when given; complete after ``staging.finish()``)."""
    return stage_shards(comp.state_dict(), rank, copy=copy, saved_by=comp.saved_by(), name=name, staging=staging)


def chunk_reader(storage: Storage, manifest: Manifest, key: str) -> ChunkReader:
    """A verified-range reader over one sharded component of a committed snapshot."""
    sid = manifest.snapshot_id
    section = manifest.components.get(key)
    if not is_sharded_section(section):
        raise CorruptSnapshotError(
            f"{sid}: component {key!r} is not a sharded component", snapshot_id=sid, problems=[f"no layout for {key}"]
        )
    layout = Layout.from_json(section["layout"], f"{sid}/{key}")
    layout.check_complete(f"{sid}/{key}")
    return ChunkReader(storage, sid, layout, {f.path: f for f in manifest.files_of(key)})


def load_sharded(
    storage: Storage, manifest: Manifest, key: str, comp: ShardedState, name: str, timing: dict | None = None
) -> int:
    """Restore ``comp`` on this rank from any saved layout; returns the bytes this rank read. ``timing`` gets the
    seconds of each phase added: ``prepare`` (the state DCP loads into: the live one, a fresh optimizer's made
    first), ``read`` (this rank's byte ranges read, verified and placed, DCP's plan included), ``copy`` (the state
    set into the objects)."""

    def add(phase: str, since: float) -> float:
        now = time.perf_counter()
        if timing is not None:
            timing[phase] = timing.get(phase, 0.0) + now - since
        return now

    started = time.perf_counter()
    reader = chunk_reader(storage, manifest, key)
    state = comp.state_dict()
    started = add("prepare", started)
    try:
        load_shards(state, reader)
    except (RuntimeError, ValueError) as exc:  # DCP's planner: a key or shape that does not fit
        raise StateMismatchError(
            f"{manifest.snapshot_id}: component {name!r} does not fit the registered "
            f"{type(comp.target).__name__}: {exc}. Restore into the model it was saved from.",
            component=name,
            mismatches=[str(exc)],
            snapshot_id=manifest.snapshot_id,
        ) from exc
    started = add("read", started)
    comp.load_state_dict(state)
    add("copy", started)
    return reader.bytes_read
