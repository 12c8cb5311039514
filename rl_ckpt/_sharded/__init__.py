"""Sharded training state (FSDP2 / DTensor): every rank saves its own shards, any layout restores.

See ``component`` (what is saved), ``layout`` (the manifest's global layout),
``dcp_writer`` and ``dcp_reader`` (torch.distributed.checkpoint plugins, saving and loading) and
``full_weights`` (rollout workers); the manager-less multi-rank commit is ``rl_ckpt._commit.collective``.
"""

from __future__ import annotations

import importlib
import sys

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


def possible() -> bool:
    """Whether this process can hold sharded state at all: a DTensor exists only once ``torch.distributed.tensor``
    is imported, a ``ShardedState`` once its module is. False: no object needs looking at (nor DCP importing)."""
    return "torch.distributed.tensor" in sys.modules or f"{__name__}.component" in sys.modules


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
