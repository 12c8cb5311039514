"""Sharded training state (FSDP2 / DTensor): every rank saves its own shards, any layout restores.

See ``component`` (what is saved), ``layout`` (the manifest's global layout),
``dcp_writer`` and ``dcp_reader`` (torch.distributed.checkpoint plugins, saving and loading) and
``full_weights`` (rollout workers); the manager-less multi-rank commit is ``rl_ckpt._commit.collective``.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

# Every name is imported on first use: ``component``, ``dcp_writer`` and ``dcp_reader`` pull in
# torch.distributed.checkpoint and DTensor (seconds per process), which a process that only reads a manifest's
# layout (``layout``: a recovery plan, the CLI, every Ray actor's import of the engine) must not pay.
_WHERE = {
    "ShardedState": "component",
    "as_sharded": "component",
    "is_sharded_section": "layout",
    "load_sharded": "component",
    "sharded_view": "component",
    "stage_sharded": "component",
    "StagedShards": "dcp_writer",
    "write_shards": "dcp_writer",
    "load_full_weights": "full_weights",
    "Layout": "layout",
    "merge_components": "layout",
}
__all__ = sorted(_WHERE)


def holds_shards(obj: Any) -> bool:
    """Whether ``obj`` is sharded state (a ``ShardedState``, or a module or optimizer holding DTensors; what
    ``as_sharded`` takes), found without importing DCP: a DTensor exists only once ``torch.distributed.tensor``
    is imported, a ``ShardedState`` once its module is."""
    component = sys.modules.get(f"{__name__}.component")
    if component is not None and isinstance(obj, component.ShardedState):
        return True
    tensor, torch = sys.modules.get("torch.distributed.tensor"), sys.modules.get("torch")
    if tensor is None or torch is None:
        return False
    if isinstance(obj, torch.nn.Module):
        params: Any = obj.parameters()
    elif isinstance(obj, torch.optim.Optimizer):
        params = (p for g in obj.param_groups for p in g["params"])
    else:
        return False
    return any(isinstance(p, tensor.DTensor) for p in params)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
