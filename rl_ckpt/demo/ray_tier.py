"""What both Ray demos (PPO and sharded GRPO) share around their participants: the memory tier's handles, and the
crash drill's last heartbeat."""

from __future__ import annotations

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
