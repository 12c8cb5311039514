"""Ray Train elastic mode (``ScalingConfig(num_workers=(1, 2))``): a node is lost mid-run, the worker group
restarts smaller, and the learners resume from the sharded snapshot the two workers wrote.

The node loss needs a cluster of several nodes (``ray.cluster_utils.Cluster``), and a driver connects to
one cluster only, while the suite shares one session cluster (conftest.py). So the run happens in a child
process (this file run as a script) with its own cluster: a head node that holds the driver, the
checkpoint manager and the rollout actors, and two one-CPU nodes, one learner each. The child writes the
run's event log and exits; the test checks the log and the snapshots.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]
STEPS = 40
SAVE_EVERY = 2
LOSE_AFTER = 6  # remove a node once a snapshot of this step or later is committed by both learners


def _events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def child(base_dir: str) -> None:
    """The elastic run: own cluster, a fit on (1, 2) workers, one node removed after a commit."""
    import threading

    import ray
    from ray.cluster_utils import Cluster

    from rl_ckpt.demo.sharded_grpo import Run

    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    # Ray's autoscaling coordinator refreshes its view of the nodes every 20 s, so the first restart after the
    # loss may still ask for 2 workers and wait out the group start timeout (60 s by default) before it asks
    # for 1. The nodes inherit this process's environment: a shorter wait keeps the test short.
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "20"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "resources": {"rl_head": 4}})
    try:
        ray.init(address=cluster.address, namespace="rl_ckpt", logging_level="ERROR")
        # Created while the head is the only node: the manager (and the actors, pinned) never run where a node is lost.
        run = Run.start(base_dir, "elastic", actor_options={"resources": {"rl_head": 0.01}})
        nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
        cluster.wait_for_nodes()
        log = Path(run.log)
        lost: dict = {}

        def lose_a_node() -> None:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:  # wait for the event: a commit by both learners
                saved = [
                    e
                    for e in _events(log)
                    if e["event"] == "step" and e["world"] == 2 and e.get("saved") and e["step"] >= LOSE_AFTER
                ]
                if saved:
                    lost.update(step=saved[0]["step"])
                    cluster.remove_node(nodes[1])
                    Path(base_dir, "node_lost.json").write_text(json.dumps({**lost, "t": time.time()}))
                    return
                time.sleep(0.2)

        watcher = threading.Thread(target=lose_a_node, daemon=True)
        watcher.start()
        run.fit((1, 2), STEPS, save_every=SAVE_EVERY, max_failures=3, resources_per_worker={"CPU": 1})
        watcher.join(timeout=60)
        run.close()
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_elastic_group_restarts_smaller_from_the_sharded_snapshot(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-4000:]
    lost = json.loads((tmp_path / "node_lost.json").read_text())
    events = _events(tmp_path / "elastic.log.jsonl")
    attempts = [e for e in events if e["event"] == "attempt"]
    assert attempts[0]["world"] == 2 and attempts[0]["restored"] is None
    resumed = attempts[-1]
    assert resumed["world"] == 1, [a["world"] for a in attempts]
    # It restored what both learners committed last before the node loss, onto the smaller group.
    assert resumed["step"] >= lost["step"] and resumed["saved_by"]["world_size"] == 2
    assert "saved by 2 ranks as FSDP(2) -> restored on 1 rank as FSDP(1) (resharded)" in resumed["layout"]
    assert f"target:    {resumed['restored']}" in resumed["plan"]
    after = [e for e in events if e["event"] == "step" and e["t"] > resumed["t"]]
    assert after[0]["step"] == resumed["step"] + 1 and all(e["world"] == 1 for e in after)
    done = [e for e in events if e["event"] == "done"]
    assert done and done[-1]["step"] == STEPS and done[-1]["world"] == 1
    rewards = {e["step"]: e["reward"] for e in events if e["event"] == "step"}
    assert rewards[STEPS] > rewards[1] + 0.2, (rewards[1], rewards[STEPS])


if __name__ == "__main__":
    child(sys.argv[1])
