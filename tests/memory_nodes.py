"""Node loss with the memory tier, on a Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``).

Run by test_memory_tier_nodes.py in a process of its own (a process joins one Ray cluster only):
``python memory_nodes.py <base_dir>`` prints one JSON line per scenario. Per scenario (memory_replicas
1, then 0): a participant on the head node and one on a worker node train to step 6 with memory snapshots
every 2 steps; step 2 is flushed to durable storage; the worker node is removed; two new participants on the
head node restore across tiers.
"""

from __future__ import annotations

import sys
import uuid


def scenario(ray, cluster, base_dir: str, replicas: int) -> dict:
    from actors import CheckpointManager
    from actors.memory_tier import MemoryTierService, memory_manager
    from memory_workers import MemParticipant
    from rl_ckpt.config import CheckpointConfig
    from rl_ckpt.integrations.memory_tier import MEMORY_BASE, memory_options
    from rl_ckpt._storage import open_storage

    worker = cluster.add_node(num_cpus=1, resources={"worker": 4})
    cluster.wait_for_nodes()
    run = f"nodes-{replicas}-{uuid.uuid4().hex[:6]}"
    cfg = dict(
        keep_best=0,
        memory_interval_steps=2,
        memory_replicas=replicas,
        memory_flush_every=None,
        heartbeat_interval_seconds=30.0,
    )
    config = CheckpointConfig(base_dir=base_dir, run_name=run, **cfg)
    durable_mgr = CheckpointManager.get_or_create(run_name=run, base_dir=base_dir, config=cfg, healthz_port=None)
    memory_mgr = memory_manager(config)
    service = MemoryTierService.get_or_create(config, interval=3600)
    parts = ["rollout-0", "rollout-1"]
    actor = ray.remote(num_cpus=0, max_restarts=0)(MemParticipant)
    on_head = actor.options(resources={"head": 1})
    group = [
        on_head.remote(base_dir, run, durable_mgr, memory_mgr, 0, parts, cfg),
        actor.options(resources={"worker": 1}).remote(base_dir, run, durable_mgr, memory_mgr, 1, parts, cfg),
    ]
    nodes = ray.get([p.node.remote() for p in group])
    ray.get([p.train_to.remote(2) for p in group])
    digests_2 = ray.get([p.digest.remote() for p in group])
    flushed = ray.get(service.flush_now.remote())
    saved = ray.get([p.train_to.remote(6) for p in group])
    digests = ray.get([p.digest.remote() for p in group])
    memory = open_storage(f"{MEMORY_BASE}/{run}", memory_options(config))
    memory.wait_replicated()
    before = ray.get(service.tick.remote())
    cluster.remove_node(worker)
    after = ray.get(service.tick.remote())
    for p in group[:1]:
        ray.kill(p, no_restart=True)
    fresh = [on_head.remote(base_dir, run, durable_mgr, memory_mgr, r, parts, cfg) for r in range(2)]
    restored = ray.get([p.restore.remote() for p in fresh])
    for p in fresh:
        ray.get(p.close.remote())
    out = {
        "replicas": replicas,
        "nodes": nodes,
        "flushed": flushed,
        "saved": saved,
        "digests_at_2": digests_2,
        "digests_at_6": digests,
        "memory_before": before["memory_snapshots"],
        "replicated_before": before["replicated"],
        "memory_after": after["memory_snapshots"],
        "dropped": after["dropped"],
        "restored": restored,
    }
    memory.destroy()
    for handle in (durable_mgr, memory_mgr, service):
        ray.kill(handle, no_restart=True)
    return out


def main() -> None:
    from node_cluster import emit, node_cluster

    with node_cluster("memtier-nodes", head_resources=4) as (ray, cluster):
        for replicas in (1, 0):
            emit(scenario(ray, cluster, sys.argv[1], replicas))


if __name__ == "__main__":
    main()
