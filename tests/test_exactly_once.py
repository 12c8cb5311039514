"""Exactly once, on the session Ray cluster: a prompt dataset (12 prompts, 3 epochs) trained on by a learner
fed by two rollout workers whose partial rollouts are saved in the same two-phase commit as the learner's
weights, sampler and auditor. Three failures, each SIGKILL: the learner; a rollout worker; and a node's
processes, the learner and a rollout worker at once (the node loss is modelled by killing every actor that
node held, together, on one machine: storage survives, as a shared file system or S3 would). After each, every
participant restores the manager's snapshot and the loop goes on from it. The auditor, as of the final state,
and its append-only log replayed, both count 0 skipped and 0 duplicated across the epoch boundaries, and the
rollouts half-generated at a snapshot were resumed from their saved tokens, not generated again."""

from __future__ import annotations

import uuid

import pytest

from data_workers import GEN, DataLearner, DataRollout, expected_tokens
from rl_ckpt.data import replay_log

SIZE, EPOCHS, PER_STEP, SAVE_EVERY = 12, 3, 2, 3
PARTS = ["learner-0", "rollout-0", "rollout-1"]


class Loop:
    """The driver: step = tick every worker, train on what finished, hand out new prompts, save every 3 steps."""

    def __init__(self, ray, base: str, run: str, manager, log: str) -> None:
        self.ray, self.args, self.log = ray, (base, run, manager, PARTS), log
        self.learner_cls = ray.remote(num_cpus=0, max_restarts=0)(DataLearner)
        self.rollout_cls = ray.remote(num_cpus=0, max_restarts=0)(DataRollout)
        self.learner = self.new_learner()
        self.workers = [self.new_worker(i) for i in range(2)]
        self.step, self.trained, self.restores = 0, [], []

    def new_learner(self):
        return self.learner_cls.remote(*self.args, SIZE, self.log)

    def new_worker(self, i: int):
        return self.rollout_cls.remote(*self.args, i, 2)

    def run_step(self) -> None:
        ray, self.step = self.ray, self.step + 1
        done = sum(ray.get([w.tick.remote() for w in self.workers]), [])
        ray.get(self.learner.train.remote(self.step, done))
        self.trained.append((self.step, done))
        pairs = ray.get(self.learner.hand_out.remote(PER_STEP, EPOCHS))
        ray.get([w.assign.remote(pairs[i::2]) for i, w in enumerate(self.workers)])
        if self.step % SAVE_EVERY == 0:
            sids = ray.get([p.save.remote(self.step) for p in [self.learner, *self.workers]])
            assert len(set(sids)) == 1  # one snapshot: the learner's and both workers' parts in one commit

    def kill(self, learner: bool, workers: list[int]) -> None:
        """SIGKILL these participants together, start new processes for them, restore everyone."""
        ray = self.ray
        victims = ([self.learner] if learner else []) + [self.workers[i] for i in workers]
        for v in victims:
            v.die.remote()
        for v in victims:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(v.stats.remote() if v is not self.learner else v.position.remote(), timeout=60)
        if learner:
            self.learner = self.new_learner()
        for i in workers:
            self.workers[i] = self.new_worker(i)
        got = ray.get([self.learner.restore.remote(), *[w.restore.remote() for w in self.workers]])
        assert len({g[0] for g in got}) == 1 and len({g[1] for g in got}) == 1, got  # the same cut everywhere
        lost = self.step - got[0][1]
        self.restores.append({"to": got[0][1], "lost_steps": lost, "in_flight": sum(g[2] for g in got[1:])})
        self.trained = [(s, d) for s, d in self.trained if s <= got[0][1]]  # the updates the restored weights hold
        self.step = got[0][1]


@pytest.mark.ray
def test_every_prompt_trained_exactly_once_through_three_kills_and_two_epoch_boundaries(ray_cluster, tmp_path):
    from actors import CheckpointManager

    ray = ray_cluster
    run = f"once-{uuid.uuid4().hex[:6]}"
    manager = CheckpointManager.get_or_create(run_name=run, base_dir=str(tmp_path), healthz_port=None,
                                              config={"heartbeat_interval_seconds": 60.0, "keep_best": 0})
    loop = Loop(ray, str(tmp_path), run, manager, str(tmp_path / "audit.jsonl"))
    try:
        for kill_after, learner, workers in ((5, True, []), (10, False, [1]), (16, True, [0])):
            while loop.step < kill_after:
                loop.run_step()
            loop.kill(learner, workers)
        for _ in range(200):  # the rest: until 3 epochs are handed out and every rollout is trained on
            loop.run_step()
            stats = ray.get([w.stats.remote() for w in loop.workers])
            if ray.get(loop.learner.position.remote())[0] >= EPOCHS and not any(s["in_flight"] for s in stats):
                break
        report = ray.get(loop.learner.report.remote())
        replayed = replay_log(str(tmp_path / "audit.jsonl"), SIZE).report(complete_below=EPOCHS).to_json()
    finally:
        for p in [loop.learner, *loop.workers]:
            ray.kill(p)
        ray.kill(manager)

    assert all(r["lost_steps"] > 0 for r in loop.restores), loop.restores  # each kill undid updates
    assert all(r["in_flight"] > 0 for r in loop.restores), loop.restores  # and caught rollouts half-generated
    assert (report["skipped"], report["duplicated"], report["epochs"]) == (0, 0, EPOCHS), report
    assert report["consumed"] == SIZE * EPOCHS
    assert replayed == report  # the append-only log, with the rolled-back updates dropped, agrees
    rollouts = [r for _, done in loop.trained for r in done]
    assert sorted((r["epoch"], r["prompt"]) for r in rollouts) == [(e, p) for e in range(EPOCHS) for p in range(SIZE)]
    for r in rollouts:  # a resumed rollout went on from its saved tokens and generator: the uninterrupted answer
        assert r["tokens"] == expected_tokens(r["epoch"], r["prompt"])
    resumed = [r for r in rollouts if r["resumed"]]
    assert report["resumed_in_flight"] == len(resumed) > 0
    # Resumed, not regenerated: their first tokens came from the snapshot (only the rest was generated after the
    # restore, and the whole answer is the uninterrupted one, checked above).
    assert sum(r["restored_tokens"] for r in resumed) > 0
    assert all(r["restored_tokens"] < GEN for r in resumed)
