"""Unit tests for rl_ckpt._run.retention: policies, hard rules, light snapshots."""

from __future__ import annotations

import pytest

from rl_ckpt._run.catalog import SnapshotInfo
from rl_ckpt.config import CheckpointConfig
from rl_ckpt.errors import ConfigError
from rl_ckpt._run.retention import (
    AnyOf,
    KeepAll,
    KeepBest,
    KeepEveryNSteps,
    KeepLatest,
    RetentionDecision,
    RetentionPolicy,
    best_per_metric,
    plan_retention,
    policy_from_config,
    rank_best,
)


def full(step: int, **metrics) -> SnapshotInfo:
    return SnapshotInfo(f"step_{step:09d}", step, "full", f"2024-01-01T00:00:{step % 60:02d}", metrics, 100)


def light(step: int, base: SnapshotInfo) -> SnapshotInfo:
    return SnapshotInfo(
        f"step_{step:09d}.light", step, "light", "2024-01-01T00:00:00", {}, 10, base_snapshot_id=base.snapshot_id
    )


def steps(ids) -> list[int]:
    return [int(i.split(".")[0][5:]) for i in ids]


def simulate(policy, rewards: list[float]) -> list[int]:
    """Commit one snapshot per step and apply retention after each, like the engine does."""
    live: list[SnapshotInfo] = []
    for step, reward in enumerate(rewards, 1):
        live.append(full(step, avg_reward=reward))
        deleted = set(plan_retention(live, policy).delete)
        live = [s for s in live if s.snapshot_id not in deleted]
    return [s.global_step for s in live]


def test_spec_example_latest_two_best_one():
    cfg = CheckpointConfig(keep_latest=2, keep_best=1, best_metric="avg_reward", best_mode="max")
    assert simulate(policy_from_config(cfg), [5, 9, 1, 2, 3, 4]) == [2, 5, 6]


def test_decision_shape_and_reasons():
    snaps = [full(s, avg_reward=r) for s, r in zip(range(1, 5), [5, 9, 1, 2])]
    d = plan_retention(snaps, AnyOf(KeepLatest(2), KeepBest(1, "avg_reward", "max")))
    assert isinstance(d, RetentionDecision)
    assert steps(d.keep) == [2, 3, 4] and steps(d.delete) == [1]
    assert d.reasons[snaps[1].snapshot_id] == ["best avg_reward=9 (#1)"]
    assert d.reasons[snaps[3].snapshot_id] == ["latest 2", "newest snapshot"]
    assert set(d.reasons) == set(d.keep)


def test_min_mode():
    snaps = [full(s, loss=v) for s, v in zip(range(1, 6), [0.5, 0.1, 0.3, 0.1, 0.9])]
    # 0.1 ties at steps 2 and 4: the newer one wins
    assert [s.global_step for s in rank_best(snaps, "loss", "min")] == [4, 2, 3, 1, 5]
    d = plan_retention(snaps, KeepBest(1, "loss", "min"))
    assert steps(d.keep) == [4, 5]  # best + newest


def test_multi_objective_lexicographic_with_ties():
    snaps = [
        full(1, success_rate=0.9, safety_violations=3),
        full(2, success_rate=0.9, safety_violations=1),
        full(3, success_rate=0.8, safety_violations=0),
        full(4, success_rate=0.9, safety_violations=1),  # exact tie with step 2: newer wins
        full(5, success_rate=0.9),  # missing tie-breaker ranks last among the 0.9s
    ]
    ranked = rank_best(snaps, ["success_rate", "safety_violations"], ["max", "min"])
    assert [s.global_step for s in ranked] == [4, 2, 1, 5, 3]
    policy = KeepBest(2, ["success_rate", "safety_violations"], ["max", "min"])
    assert sorted(steps(policy.keep(snaps))) == [2, 4]
    reasons = policy.reasons(snaps)
    assert reasons["step_000000004"] == ["best success_rate=0.9, safety_violations=1 (#1)"]


def test_single_mode_applies_to_every_metric():
    snaps = [full(1, a=1, b=5), full(2, a=1, b=7)]
    assert rank_best(snaps, ["a", "b"], "max")[0].global_step == 2


def test_missing_and_non_finite_never_best():
    snaps = [
        full(1, avg_reward=1.0),
        full(2, avg_reward="nan"),
        full(3, avg_reward="inf"),
        full(4, avg_reward=float("inf")),
        full(5, avg_reward=float("nan")),
        full(6),
        full(7, avg_reward="-inf"),
        full(8, avg_reward=True),
    ]
    assert [s.global_step for s in rank_best(snaps, "avg_reward", "max")] == [1]
    assert [s.global_step for s in rank_best(snaps, "avg_reward", "min")] == [1]
    d = plan_retention(snaps, KeepBest(3, "avg_reward", "max"))
    assert steps(d.keep) == [1, 8]  # the only ranked one + the newest


def test_archive_points_survive_forever():
    live: list[SnapshotInfo] = []
    policy = AnyOf(KeepLatest(1), KeepEveryNSteps(1000))
    for step in range(500, 5001, 500):
        live.append(full(step))
        d = plan_retention(live, policy)
        live = [s for s in live if s.snapshot_id in d.keep]
    assert [s.global_step for s in live] == [1000, 2000, 3000, 4000, 5000]
    assert "archive every 1000 steps" in d.reasons["step_000003000"]


def test_union_of_policies_and_keep_all():
    snaps = [full(s, r=s % 3) for s in range(1, 8)]
    union = AnyOf(KeepLatest(1), KeepEveryNSteps(3), KeepBest(1, "r", "max"))
    # best r=2 at steps 2 and 5 -> newer (5); multiples of 3: 3, 6; latest: 7
    assert sorted(steps(union.keep(snaps))) == [3, 5, 6, 7]
    assert steps(plan_retention(snaps, KeepAll()).keep) == list(range(1, 8))
    assert plan_retention(snaps, KeepAll()).delete == []


def test_custom_user_policy():
    class KeepEvenSteps:
        def keep(self, snapshots):
            return {s.snapshot_id for s in snapshots if s.global_step % 2 == 0} | {"no_such_snapshot"}

    policy = KeepEvenSteps()
    assert isinstance(policy, RetentionPolicy)
    snaps = [full(s) for s in range(1, 6)]
    d = plan_retention(snaps, AnyOf(policy, KeepLatest(1)))
    assert steps(d.keep) == [2, 4, 5]
    assert d.reasons["step_000000002"] == ["policy KeepEvenSteps"]
    assert "no_such_snapshot" not in d.keep  # invented ids are ignored
    assert steps(plan_retention(snaps, policy).keep) == [2, 4, 5]


def test_newest_never_deleted_even_if_policy_keeps_nothing():
    class KeepNothing:
        def keep(self, snapshots):
            return set()

    snaps = [full(s) for s in range(1, 4)]
    for policy in (KeepNothing(), KeepLatest(0), KeepBest(0), KeepBest(5, "absent", "max")):
        d = plan_retention(snaps, policy)
        assert steps(d.keep) == [3] and steps(d.delete) == [1, 2]
        assert d.reasons["step_000000003"] == ["newest snapshot"]
    assert plan_retention([], KeepLatest(1)) == RetentionDecision([], [], {})


def test_light_rule_newest_light_per_kept_full():
    f1, f2, f3 = full(100), full(200), full(300)
    l1a, l1b = light(110, f1), light(120, f1)
    l2 = light(210, f2)
    l3a, l3b = light(310, f3), light(320, f3)
    snaps = [f1, l1a, l1b, f2, l2, f3, l3a, l3b]
    d = plan_retention(snaps, KeepLatest(2))
    assert d.keep == [f2.snapshot_id, l2.snapshot_id, f3.snapshot_id, l3b.snapshot_id]
    assert d.delete == [f1.snapshot_id, l1a.snapshot_id, l1b.snapshot_id, l3a.snapshot_id]
    assert d.reasons[l3b.snapshot_id] == [f"newest light on {f3.snapshot_id}"]
    assert f"base of {l3b.snapshot_id}" in d.reasons[f3.snapshot_id]
    # policies only ever see full snapshots, even when handed lights directly
    assert KeepLatest(10).keep(snaps) == {f1.snapshot_id, f2.snapshot_id, f3.snapshot_id}


def test_kept_light_keeps_its_base():
    f1, f2 = full(100), full(200)
    l1 = light(150, f1)
    snaps = [f1, l1, f2]
    d = plan_retention(snaps, KeepLatest(1), protect=[l1.snapshot_id])
    assert d.keep == [f1.snapshot_id, l1.snapshot_id, f2.snapshot_id]
    assert d.reasons[f1.snapshot_id] == [f"base of {l1.snapshot_id}"]
    assert d.reasons[l1.snapshot_id][0] == "protected"

    class KeepTheLight:  # a user policy naming a light snapshot directly
        def keep(self, snapshots):
            return {l1.snapshot_id}

    assert f1.snapshot_id in plan_retention(snaps, KeepTheLight()).keep
    # every kept light has a kept base, whatever kept it
    for policy in (KeepLatest(1), KeepAll(), KeepTheLight()):
        d = plan_retention(snaps, policy)
        for sid in d.keep:
            base = next(s for s in snaps if s.snapshot_id == sid).base_snapshot_id
            assert base is None or base in d.keep


def test_orphan_light_deleted():
    gone = full(50)
    f1 = full(100)
    d = plan_retention([light(60, gone), f1], KeepLatest(5))
    assert d.keep == [f1.snapshot_id] and d.delete == ["step_000000060.light"]


def test_protect():
    snaps = [full(s) for s in range(1, 6)]
    d = plan_retention(snaps, KeepLatest(1), protect=("step_000000002", "unknown_id"))
    assert steps(d.keep) == [2, 5]
    assert d.reasons["step_000000002"] == ["protected"]
    assert "unknown_id" not in d.keep and "unknown_id" not in d.delete


def test_input_order_does_not_matter():
    snaps = [full(s, avg_reward=r) for s, r in zip(range(1, 7), [5, 9, 1, 2, 3, 4])]
    a = plan_retention(snaps, AnyOf(KeepLatest(2), KeepBest(1)))
    b = plan_retention(list(reversed(snaps)), AnyOf(KeepLatest(2), KeepBest(1)))
    assert a == b and steps(a.keep) == [2, 5, 6] and steps(a.delete) == [1, 3, 4]


def test_policy_from_config():
    cfg = CheckpointConfig(keep_latest=3, keep_best=0, keep_interval_steps=None)
    p = policy_from_config(cfg)
    assert isinstance(p, AnyOf) and p.policies == (KeepLatest(3),)
    cfg = CheckpointConfig(
        keep_latest=1, keep_best=2, best_metric=["a", "b"], best_mode=["max", "min"], keep_interval_steps=1000
    )
    p = policy_from_config(cfg)
    assert p.policies == (KeepLatest(1), KeepBest(2, ("a", "b"), ("max", "min")), KeepEveryNSteps(1000))
    hash(p.policies[1])  # list config values become tuples: policies stay hashable


def test_bad_modes_rejected():
    with pytest.raises(ConfigError):
        KeepBest(1, "r", "biggest")
    with pytest.raises(ConfigError):
        KeepBest(1, ["a", "b"], ["max"])
    with pytest.raises(ConfigError):
        best_per_metric([], ["a"], ["max", "min"])


def test_best_per_metric():
    f1 = full(1, avg_reward=5.0, loss=0.2)
    f2 = full(2, avg_reward=9.0, loss=0.4)
    f3 = full(3, avg_reward=9.0, loss="nan")
    l3 = light(4, f3)
    l3.metrics = {"avg_reward": 100.0}  # light snapshots are never "best": no weights to point at
    snaps = [f1, f2, f3, l3]
    assert best_per_metric(snaps, ["avg_reward", "loss", "absent"], ["max", "min", "max"]) == {
        "avg_reward": f3.snapshot_id,  # tie at 9.0: newer wins
        "loss": f1.snapshot_id,
    }
    assert best_per_metric(snaps, "loss", "max") == {"loss": f2.snapshot_id}
    assert best_per_metric([], "loss", "min") == {}
