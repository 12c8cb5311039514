"""The Ray side of rl_ckpt: the detached ``CheckpointManager`` actor and its /healthz endpoint.

    handle = CheckpointManager.get_or_create(run_name="ppo", base_dir="s3://bucket/ckpt")
    engine = CheckpointEngine(cfg, manager=handle, rank=rank, world_size=world_size)

Policy versions (docs/policy_versions.md): ``PolicyVersions(run, model).publish(step)`` on the learners,
``WeightSubscriber(run).pull(module)`` on rollout workers.
"""

from .manager import CheckpointManager
from .policy_versions import PolicyVersions
from .weight_subscriber import PullResult, WeightSubscriber

__all__ = ["CheckpointManager", "PolicyVersions", "PullResult", "WeightSubscriber"]
