"""The exactly-once scenario on a Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``).

Run by test_exactly_once.py in a process of its own (a process joins one Ray cluster only):
``python exactly_once_nodes.py <base_dir>`` prints one JSON line. A learner and rollout worker 0 run on the
worker node, rollout worker 1 and the run's manager on the head node; the loop trains on a 12-prompt dataset
for 3 epochs, a snapshot (learner + both workers, one two-phase commit) every 3 steps. Failures: the learner
SIGKILLed; rollout worker 1 SIGKILLed; the worker node removed (its learner and rollout worker lost together).
After each, new processes replace the lost ones (on the head node once the worker node is gone) and every
participant restores the manager's snapshot.
"""

from __future__ import annotations

import os
import sys
import time
import uuid

SIZE, EPOCHS, PER_STEP, SAVE_EVERY = 12, 3, 2, 3
PARTS = ["learner-0", "rollout-0", "rollout-1"]


class Loop:
    """The driver: a step ticks every worker, trains on what finished, hands out prompts, saves every 3 steps."""

    def __init__(self, ray, base: str, run: str, manager, log: str) -> None:
        from data_workers import DataLearner, DataRollout

        self.ray, self.args, self.log = ray, (base, run, manager, PARTS), log
        self.learner_cls = ray.remote(num_cpus=0, max_restarts=0)(DataLearner)
        self.rollout_cls = ray.remote(num_cpus=0, max_restarts=0)(DataRollout)
        self.learner = self.learner_cls.options(resources={"worker": 1}).remote(*self.args, SIZE, log)
        self.workers = [self.new_worker(0, "worker"), self.new_worker(1, "head")]
        self.step, self.trained, self.restores, self.saves = 0, [], [], []

    def new_worker(self, i: int, node: str):
        return self.rollout_cls.options(resources={node: 1}).remote(*self.args, i, 2)

    def nodes(self) -> list[str]:
        return self.ray.get([p.node.remote() for p in [self.learner, *self.workers]])

    def run_step(self) -> None:
        ray, self.step = self.ray, self.step + 1
        done = sum(ray.get([w.tick.remote() for w in self.workers]), [])
        ray.get(self.learner.train.remote(self.step, done))
        self.trained.append((self.step, done))
        pairs = ray.get(self.learner.hand_out.remote(PER_STEP, EPOCHS))
        ray.get([w.assign.remote(pairs[i::2]) for i, w in enumerate(self.workers)])
        if self.step % SAVE_EVERY == 0:
            self.saves.append(ray.get([p.save.remote(self.step) for p in [self.learner, *self.workers]]))

    def lost(self, learner: bool, workers: list[int], node: str) -> None:
        """The given participants are gone (killed or their node removed): replace them, restore everyone."""
        ray = self.ray
        victims = ([self.learner] if learner else []) + [self.workers[i] for i in workers]
        for v in victims:
            try:
                ray.get(v.node.remote(), timeout=120)
                raise AssertionError("a lost participant still answers")
            except ray.exceptions.RayActorError:
                pass
        if learner:
            self.learner = self.learner_cls.options(resources={node: 1}).remote(*self.args, SIZE, self.log)
        for i in workers:
            self.workers[i] = self.new_worker(i, node)
        got = ray.get([self.learner.restore.remote(), *[w.restore.remote() for w in self.workers]])
        self.restores.append(
            {
                "snapshots": [g[0] for g in got],
                "steps": [g[1] for g in got],
                "from_step": self.step,
                "in_flight": sum(g[2] for g in got[1:]),
                "nodes": self.nodes(),
            }
        )
        self.trained = [(s, d) for s, d in self.trained if s <= got[0][1]]  # the updates the restored weights hold
        self.step = got[0][1]


def scenario(ray, cluster, base_dir: str) -> dict:
    from actors import CheckpointManager
    from rl_ckpt.data import replay_log

    t0 = time.monotonic()
    marks = {}
    run = f"once-{uuid.uuid4().hex[:6]}"
    manager = CheckpointManager.get_or_create(
        run_name=run, base_dir=base_dir, healthz_port=None, config={"heartbeat_interval_seconds": 60.0, "keep_best": 0}
    )
    ray.get(manager.ping.remote())  # on the head node: the only node so far
    worker = cluster.add_node(num_cpus=1, resources={"worker": 4})
    cluster.wait_for_nodes()
    log = os.path.join(base_dir, "audit.jsonl")
    loop = Loop(ray, base_dir, run, manager, log)
    nodes = loop.nodes()
    marks["started"] = time.monotonic() - t0
    for kill_after, failure in ((5, "learner"), (10, "rollout"), (16, "node")):
        while loop.step < kill_after:
            loop.run_step()
        if failure == "learner":
            loop.learner.die.remote()
            loop.lost(True, [], "worker")
        elif failure == "rollout":
            loop.workers[1].die.remote()
            loop.lost(False, [1], "head")
        else:
            cluster.remove_node(worker)  # the learner and rollout worker 0 go with it
            loop.lost(True, [0], "head")
        marks[failure] = time.monotonic() - t0
    for _ in range(200):  # the rest: until 3 epochs are handed out and every rollout is trained on
        loop.run_step()
        stats = ray.get([w.stats.remote() for w in loop.workers])
        if ray.get(loop.learner.position.remote())[0] >= EPOCHS and not any(s["in_flight"] for s in stats):
            break
    out = {
        "nodes": nodes,
        "restores": loop.restores,
        "saves": loop.saves,
        "report": ray.get(loop.learner.report.remote()),
        "replayed": replay_log(log, SIZE).report(complete_below=EPOCHS).to_json(),
        "trained": [r for _, done in loop.trained for r in done],
        "epochs": EPOCHS,
        "size": SIZE,
        "seconds": {**marks, "done": time.monotonic() - t0},
    }  # where the time goes (not asserted)
    for p in [loop.learner, *loop.workers, manager]:
        ray.kill(p, no_restart=True)
    return out


def main() -> None:
    from node_cluster import emit, node_cluster

    with node_cluster("exactly-once", head_resources=4) as (ray, cluster):
        emit(scenario(ray, cluster, sys.argv[1]))


if __name__ == "__main__":
    main()
