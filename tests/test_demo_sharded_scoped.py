"""The sharded GRPO demo on the session's Ray cluster: rollout actors SIGKILLed mid-rollout cost the FSDP2 learners
nothing. Each lost actor is replaced (Ray's restart of it, or a warm standby) and its task (step, prompts, the
policy snapshot it started with) is issued again whole; the learners wait for that part only, never go back a step,
never restart, and end with every step's rollouts and the final weights bitwise equal to an uninterrupted run's,
every prompt trained on once."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]
STEPS = 6


def test_lost_rollout_actors_cost_the_grpo_learners_nothing(ray_cluster, tmp_path):
    from rl_ckpt.demo.sharded_drill import scoped_drill

    faults = [
        # mid-generation (before answer token 1 of 3) of step 3, rank 1's actor: Ray restarts it
        {"id": 0, "target": "rollout-1", "step": 3, "moment": 1},
        # before it gets step 5's weights, rank 0's actor: rank 0 holds a warm standby, which takes its place
        {"id": 1, "target": "rollout-0", "step": 5, "moment": "pull"},
    ]
    report = scoped_drill(str(tmp_path), steps=STEPS, faults=faults, standbys={0: 1}, save_every=2)
    f = report.figures
    assert report.ok, report.text
    assert f["attempts"] == 1 and f["steps_logged"] == list(range(1, STEPS + 1)) and f["steps_undone"] == 0
    assert f["kills"] == [("rollout-1", 3, 1), ("rollout-0", 5, "pull")]
    got = [(r["participant"], r["step"], r["replacement"], r["restored"]) for r in f["recoveries"]]
    assert got == [("rollout-1", 3, "restart", None), ("rollout-0", 5, "standby", None)], report.text
    # The task issued again is the lost one: its step, its rank's half of the step's prompts, the same snapshot.
    tasks = [r["task"] for r in f["recoveries"]]
    assert [(t["step"], t["snapshot"], len(t["prompts"])) for t in tasks] == [
        (3, "step_000000002", 8),
        (5, "step_000000004", 8),
    ]
    assert f["rollouts_equal"] and f["weights_equal"], report.text
    assert f["audit"] == {"consumed": 96, "skipped": 0, "duplicated": 0, "resumed_in_flight": 0, "epochs": 2}
    # The replacements pulled the policy versions they were asked for, from scratch: the restarted rollout-1 a full
    # pull of version 2 and a delta to version 4; the standby now rollout-0 a full pull of version 4.
    one, zero = f["rollout_stats"][1], f["rollout_stats"][0]
    assert one["moved"]["pulls"] == 2 and one["moved"]["full"] > 0 and one["moved"]["delta"] > 0, one
    assert zero["moved"] == {"full": one["moved"]["full"], "delta": 0, "pulls": 1}, zero
    assert zero["loaded"].endswith("/step_000000004") and one["loaded"].endswith("/step_000000004")
    assert "bitwise equal to the uninterrupted run's: YES" in report.text and "consistent         YES" in report.text


def test_pool_issues_a_lost_stateless_call_again_to_a_restart_or_a_standby(ray_cluster, tmp_path):
    """The pool's path for stateless workers (calls not journaled, ``rejoin`` with nothing to take back): the lost
    call is issued again and nothing is replayed; a standby takes the lost worker's own index (the number ending its
    name), not its position in the pool."""
    import ray

    from actors.rollout_pool import RolloutPool, ScopedWorker
    from rl_ckpt.demo.faults import fires, kill_self

    class Stateless(ScopedWorker):
        def __init__(self, index):
            self.index, self.replays = index, 0

        def work(self, x, faults):
            if fires(faults, f"w-{self.index}", x):
                kill_self()
            return 2 * x

        def rejoin(self):
            return {"snapshot_id": None, "step": None}

        def assume(self, index):
            self.index = index
            return index

        def replay(self, calls):
            self.replays += 1
            return super().replay(calls)

        def seen(self):
            return self.index, self.replays

    cls = ray.remote(num_cpus=0, max_task_retries=0)(Stateless)
    faults = [{"id": i, "target": "w-3", "step": i, "marker": str(tmp_path / f"fault-{i}")} for i in (1, 2)]
    worker = cls.options(max_restarts=-1).remote(3)
    pool = RolloutPool([worker], ["w-3"])
    assert pool.call("work", [(1, faults)], step=1, record=False) == [2]  # killed mid-call, Ray restarts it
    (event,) = pool.recoveries
    assert (event.participant, event.replacement, event.restored, event.replayed_steps) == ("w-3", "restart", None, [])
    assert "nothing to restore or replay" in event.line()
    assert ray.get(worker.seen.remote()) == (3, 0)  # the restarted worker: nothing replayed

    standby = cls.options(max_restarts=0).remote(None)
    pool = RolloutPool([worker], ["w-3"], standbys=[standby])
    assert pool.call_one(0, "work", 2, faults, step=2, record=False) == 4
    assert pool.workers[0] is standby and pool.recoveries[0].replacement == "standby"
    assert ray.get(standby.seen.remote()) == (3, 0)  # w-3's index, though it sits at position 0 of the pool
    ray.kill(standby)
