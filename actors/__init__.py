"""The Ray side of rl_ckpt: the detached ``CheckpointManager`` actor and its /healthz endpoint.

    handle = CheckpointManager.get_or_create(run_name="ppo", base_dir="s3://bucket/ckpt")
    engine = CheckpointEngine(cfg, manager=handle, rank=rank, world_size=world_size)

Policy versions (docs/policy_versions.md): ``PolicyVersions(run, model).publish(step)`` on the learners,
``WeightSubscriber(run).pull(module)`` on rollout workers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .manager import CheckpointManager
    from .policy_versions import PolicyVersions
    from .weight_subscriber import PullResult, WeightSubscriber

# Imported when first asked for: a Ray worker that hosts one actor imports only that actor's module (the
# manager's and a memory store's import no torch; policy versions and subscribers do).
_WHERE = {
    "CheckpointManager": ".manager",
    "PolicyVersions": ".policy_versions",
    "PullResult": ".weight_subscriber",
    "WeightSubscriber": ".weight_subscriber",
}
__all__ = ["CheckpointManager", "PolicyVersions", "PullResult", "WeightSubscriber"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value
