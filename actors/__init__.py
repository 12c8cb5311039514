"""The Ray side of rl_ckpt: the detached ``CheckpointManager`` actor and its /healthz endpoint.

    handle = CheckpointManager.get_or_create(run_name="ppo", base_dir="s3://bucket/ckpt")
    engine = CheckpointEngine(cfg, manager=handle, rank=rank, world_size=world_size)
"""

from .manager import CheckpointManager

__all__ = ["CheckpointManager"]
