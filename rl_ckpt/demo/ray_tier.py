"""What both Ray demos (PPO and sharded GRPO) share around their participants: the memory tier's handles, the
crash drill's last heartbeat, and warm standby rollout workers."""

from __future__ import annotations

import uuid
from typing import Any

from rl_ckpt import CheckpointEngine


def memory_tier(engine: CheckpointEngine, memory: dict | None, service: bool = True):
    """``engine``'s ``MemoryTier`` when the run has one (``memory``: the memory manager and service handles)."""
    if memory is None:
        return None
    from rl_ckpt.integrations.memory_tier import MemoryTier

    return MemoryTier(engine, manager=memory["manager"], service=memory["service"] if service else None)


def last_beat(engine: CheckpointEngine, step: int) -> None:
    """Tell the manager, and wait until it knows, that this participant reached ``step``.

    A crash drill calls this right before its SIGKILL: the failure the manager then
    records carries this participant's last step, which is exactly the crash step
    (an ordinary heartbeat is rate-limited and fire-and-forget, so it may lag).
    """
    import ray

    newest = engine.catalog.snapshots()
    ray.get(
        engine.manager.heartbeat.remote(engine.participant, step, newest[-1].snapshot_id if newest else None),
        timeout=60,
    )


# The demo's memory tier: a memory snapshot every 2 steps, a durable copy of every 5th (every 10 steps, as the
# durable-only run saves), one node so no replicas.
MEMORY_DEFAULTS = {"memory_interval_steps": 2, "memory_flush_every": 5, "memory_replicas": 0}


def start_memory_tier(engine_cfg: dict) -> dict:
    """The run's memory manager and ``MemoryTierService`` handles."""
    from actors.memory_tier import MemoryTierService, memory_manager
    from rl_ckpt.config import CheckpointConfig

    cfg = CheckpointConfig(**engine_cfg)
    return {"manager": memory_manager(cfg), "service": MemoryTierService.get_or_create(cfg)}


def stop_memory_tier(memory: dict, engine_cfg: dict) -> dict:
    """The service's last figures; then the run's memory is released (``release_run``: the memory manager, the
    service, the run's memory and version stores; the durable copies stay). The run is over: nothing trains, and
    what memory holds beyond durable storage is the demo's to drop."""
    import ray

    from actors.memory_tier import release_run
    from rl_ckpt.config import CheckpointConfig

    cfg = CheckpointConfig(**engine_cfg)
    status = ray.get(memory["service"].tick.remote(), timeout=120)
    release_run(cfg.run_name, flush=False, force=True)
    return status


STANDBY_PREFIX = "rl_ckpt-standby:"


def start_standby(cls: type, run_name: str, *args: Any) -> Any:
    """A warm standby rollout worker of run ``run_name`` (``cls(*args)``, built with no identity): detached (the
    learner that asks for one may die, the worker it becomes must not) and named, so the run finds the standbys
    that took over (``standbys_of``)."""
    import ray

    remote = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(cls)
    return remote.options(name=f"{STANDBY_PREFIX}{run_name}:{uuid.uuid4().hex[:8]}", lifetime="detached").remote(*args)


def standbys_of(run_name: str) -> list:
    """Run ``run_name``'s standby workers alive now (used or not)."""
    import ray

    prefix = f"{STANDBY_PREFIX}{run_name}:"
    out = []
    for item in ray.util.list_named_actors(all_namespaces=True):
        if item["name"].startswith(prefix):
            try:
                out.append(ray.get_actor(item["name"], namespace=item["namespace"]))
            except ValueError:  # gone meanwhile
                continue
    return out


def spare(standbys: list) -> list:
    """Those of ``standbys`` not used yet (``identity()`` None): a standby an earlier attempt used serves a worker
    now, and one lost since is gone."""
    import ray
    from ray.exceptions import RayActorError

    out = []
    for standby in standbys:
        try:
            if ray.get(standby.identity.remote(), timeout=60) is None:
                out.append(standby)
        except RayActorError:
            continue
    return out
