"""Sharded training state (FSDP2 / DTensor): every rank saves its own shards, any layout restores.

See ``component`` (what is saved), ``layout`` (the manifest's global layout),
``dcp_writer`` and ``dcp_reader`` (torch.distributed.checkpoint plugins, saving and loading) and
``full_weights`` (rollout workers); the manager-less multi-rank commit is ``rl_ckpt._commit.collective``.
"""

from rl_ckpt._sharded.component import (
    ShardedState,
    as_sharded,
    is_sharded_section,
    load_sharded,
    sharded_view,
    stage_sharded,
)
from rl_ckpt._sharded.dcp_writer import StagedShards, write_shards
from rl_ckpt._sharded.full_weights import load_full_weights
from rl_ckpt._sharded.layout import Layout, merge_components

__all__ = [
    "ShardedState",
    "Layout",
    "StagedShards",
    "as_sharded",
    "is_sharded_section",
    "load_full_weights",
    "load_sharded",
    "merge_components",
    "sharded_view",
    "stage_sharded",
    "write_shards",
]
