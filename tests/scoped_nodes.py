"""A rollout worker's node removed mid-run, on a Ray cluster of two nodes on this machine
(``ray.cluster_utils.Cluster``): the Ray PPO demo with the memory tier, its learners on the head node, its rollout
workers on the worker node. Once the learners pass step ``remove_at`` the worker node is removed: both rollout
workers die with it, and so does their node's memory store (their memory snapshots); a new worker node joins (as
an autoscaler would bring one). Each worker is recovered alone, restarted by Ray on the new node, from its newest
durable snapshot (none if its copy from memory was not made yet), replaying the collects since.

The same run uninterrupted goes first, on the same cluster, as the reference the test compares with.

Run by test_scoped_nodes.py in a process of its own (a process joins one Ray cluster only):
``python scoped_nodes.py <base_dir> <steps> <remove_at> <engine config JSON>`` prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import threading


def main() -> None:
    from node_cluster import emit, node_cluster

    from rl_ckpt.demo.faults import log_event
    from rl_ckpt.demo.ray_ppo import run

    base, steps, remove_at, engine = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    with node_cluster("scoped-nodes", head_resources=4) as (ray, cluster):
        import ray_train_cleaner

        ray_train_cleaner.install()  # as the session's cluster: a loaded GCS is no dead controller
        worker = cluster.add_node(num_cpus=0, resources={"worker": 4})
        cluster.wait_for_nodes()
        node_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "worker" in n["Resources"])
        reference = run(
            base_dir=base,
            run_name="reference",
            steps=steps,
            engine_cfg=engine,
            memory_tier=True,
            worker_options={"resources": {"worker": 1}},
        )
        log = os.path.join(base, "nodes.log.jsonl")
        out: dict = {}

        def train() -> None:
            try:
                out["result"] = run(
                    base_dir=base,
                    run_name="nodes",
                    steps=steps,
                    engine_cfg=engine,
                    memory_tier=True,
                    worker_options={"resources": {"worker": 1}},
                )
            except BaseException as exc:  # the main thread reports it
                out["error"] = f"{type(exc).__name__}: {exc}"

        thread = threading.Thread(target=train)
        thread.start()
        removed_at = None
        stop = threading.Event()
        while thread.is_alive() and removed_at is None:  # the log is the event: the learners passed the step
            if os.path.exists(log):
                with open(log) as f:
                    done = [json.loads(line) for line in f if '"event": "step"' in line]
                if done and done[-1]["step"] >= remove_at:
                    removed_at = done[-1]["step"]
                    from ray.util.state import list_actors

                    out["placed"] = {
                        a.name: a.node_id for a in list_actors(filters=[("state", "=", "ALIVE")]) if a.name
                    }
                    log_event(log, {"event": "fault", "step": removed_at, "target": "node", "fault": {"id": -1}})
                    cluster.remove_node(worker)
                    cluster.add_node(num_cpus=0, resources={"worker": 4})  # a new node joins, as an autoscaler's
                    break
            stop.wait(0.05)
        thread.join()
        result = out.get("result")
        emit(
            {
                "error": out.get("error"),
                "node": node_id,
                "removed_at": removed_at,
                "placed": out.get("placed"),
                "log": result.log if result else [],
                "reference": reference.done,
            }
        )


if __name__ == "__main__":
    main()
