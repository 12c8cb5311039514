"""Decision-table tests for RecoveryCoordinator."""

from __future__ import annotations

import json
import logging

import pytest

from rl_ckpt._run.catalog import SnapshotInfo
from rl_ckpt._recovery.coordinator import (
    Action,
    CoordinatorConfig,
    Decision,
    FailureInfo,
    FailureKind,
    RecoveryCoordinator,
    make_decision,
    snapshot_failures,
)
from rl_ckpt.errors import CheckpointError, ConfigError


def snap(step: int, kind: str = "full", **metrics) -> SnapshotInfo:
    sid = f"step_{step:09d}" + (".light" if kind == "light" else "")
    return SnapshotInfo(sid, step, kind, f"2024-01-01T00:00:{step % 60:02d}", metrics, 100)


def coord(snaps, **cfg) -> RecoveryCoordinator:
    return RecoveryCoordinator(CoordinatorConfig(**cfg), lambda: list(snaps))


def fail(kind="exception", step=2500, **kw) -> FailureInfo:
    return FailureInfo(kind, step, "boom", **kw)


def test_no_snapshots_start_fresh():
    d = coord([]).decide(fail(step=42))
    assert (d.action, d.snapshot_id, d.global_step) == (Action.start_fresh, None, 0)
    assert "42" in d.reason and d.attempt == 1


def test_light_snapshots_are_not_candidates():
    d = coord([snap(100, "light", avg_reward=1.0)]).decide(fail(step=150))
    assert d.action == Action.start_fresh


@pytest.mark.parametrize("kind", ["exception", "process_killed", "oom", "heartbeat_lost"])
def test_default_restore_latest(kind):
    d = coord([snap(700, avg_reward=187.0), snap(900, avg_reward=50.0)]).decide(fail(kind))
    assert (d.action, d.snapshot_id, d.global_step) == (Action.restore_latest, "step_000000900", 900)
    assert d.failure.kind == FailureKind(kind)
    for num in ("900", "2500", "1600"):
        assert num in d.reason
    assert d.considered[0] == ("step_000000900", "chosen: restore_latest")
    assert d.considered[1] == ("step_000000700", "candidate")


def test_nan_loss_restores_before_first_nonfinite_and_skips_nan_snapshot():
    snaps = [snap(100, loss=1.0), snap(200, loss="nan"), snap(300, loss=0.9), snap(400, loss=0.8)]
    d = coord(snaps).decide(fail("nan_loss", step=450, first_nonfinite_step=300))
    assert (d.action, d.snapshot_id, d.global_step) == (Action.restore_latest, "step_000000100", 100)
    assert "100" in d.reason and "300" in d.reason and "450" in d.reason
    notes = dict(d.considered)
    assert "non-finite metrics" in notes["step_000000200"]
    assert "not before the first non-finite loss at step 300" in notes["step_000000300"]
    assert "not before" in notes["step_000000400"]


def test_nan_loss_without_first_step_uses_failure_step():
    snaps = [snap(100, loss=1.0), snap(200, loss=0.9), snap(300, loss=float("inf"))]
    d = coord(snaps).decide(fail("nan_loss", step=300))
    assert d.snapshot_id == "step_000000200"  # 300 is not < failure step 300
    d = coord(snaps).decide(fail("nan_loss", step=None))
    assert d.snapshot_id == "step_000000200"  # step unknown: only the inf-loss snapshot is skipped


def test_nan_loss_with_nothing_before_start_fresh():
    snaps = [snap(100, loss="nan"), snap(300, loss=0.5)]
    d = coord(snaps).decide(fail("nan_loss", step=350, first_nonfinite_step=250))
    assert (d.action, d.snapshot_id, d.global_step) == (Action.start_fresh, None, 0)
    assert "250" in d.reason


def test_max_acceptable_loss_steps_restores_best():
    snaps = [snap(500, avg_reward=120.0), snap(700, avg_reward=187.0), snap(900, avg_reward=50.0)]
    d = coord(snaps, max_acceptable_loss_steps=1000).decide(fail(step=2500))
    assert (d.action, d.snapshot_id, d.global_step) == (Action.restore_best, "step_000000700", 700)
    for part in (
        "step_000000900",
        "1600",
        "2500",
        "max_acceptable_loss_steps=1000",
        "avg_reward=187",
        "step_000000700",
    ):
        assert part in d.reason


def test_max_acceptable_loss_steps_within_threshold_restores_latest():
    snaps = [snap(700, avg_reward=187.0), snap(900, avg_reward=50.0)]
    d = coord(snaps, max_acceptable_loss_steps=1600).decide(fail(step=2500))
    assert d.action == Action.restore_latest and d.snapshot_id == "step_000000900"


def test_max_acceptable_loss_steps_best_is_newest_restores_latest():
    snaps = [snap(700, avg_reward=50.0), snap(900, avg_reward=187.0)]
    d = coord(snaps, max_acceptable_loss_steps=1000).decide(fail(step=2500))
    assert d.action == Action.restore_latest and d.snapshot_id == "step_000000900"
    assert "also the best" in d.reason and "1600" in d.reason and "2500" in d.reason


def test_max_acceptable_loss_steps_without_metric_restores_latest():
    d = coord([snap(700), snap(900)], max_acceptable_loss_steps=1000).decide(fail(step=2500))
    assert d.action == Action.restore_latest and "no candidate records avg_reward" in d.reason


def test_divergence_guard_max_metric():
    snaps = [snap(700, avg_reward=200.0), snap(900, avg_reward=100.0)]
    d = coord(snaps, divergence_threshold=0.2).decide(fail(step=950))
    assert (d.action, d.snapshot_id) == (Action.restore_best, "step_000000700")
    for part in ("avg_reward=100", "avg_reward=200", "900", "700", "950", "divergence_threshold=0.2"):
        assert part in d.reason
    # 100 below 200 is within 60% of |200| = 120
    assert coord(snaps, divergence_threshold=0.6).decide(fail(step=950)).action == Action.restore_latest


def test_divergence_guard_negative_rewards():
    snaps = [snap(700, avg_reward=-100.0), snap(900, avg_reward=-130.0)]
    assert coord(snaps, divergence_threshold=0.2).decide(fail()).action == Action.restore_best
    assert coord(snaps, divergence_threshold=0.5).decide(fail()).action == Action.restore_latest


def test_divergence_guard_min_metric():
    snaps = [snap(700, loss=1.0), snap(900, loss=1.5)]
    d = coord(snaps, divergence_threshold=0.2, best_metric="loss", best_mode="min").decide(fail(step=950))
    assert (d.action, d.snapshot_id) == (Action.restore_best, "step_000000700")
    assert "loss=1.5" in d.reason and "loss=1" in d.reason and "950" in d.reason
    snaps = [snap(700, loss=1.0), snap(900, loss=1.1)]
    d = coord(snaps, divergence_threshold=0.2, best_metric="loss", best_mode="min").decide(fail(step=950))
    assert d.action == Action.restore_latest
    # lower loss is better: a newer, lower loss is the best itself
    snaps = [snap(700, loss=1.5), snap(900, loss=1.0)]
    d = coord(snaps, divergence_threshold=0.0, best_metric="loss", best_mode="min").decide(fail(step=950))
    assert d.action == Action.restore_latest


def test_budget_exhausted_gives_up():
    c = coord([snap(900)], max_failures=2)
    assert c.decide(fail()).action == Action.restore_latest
    assert c.decide(fail()).action == Action.restore_latest
    d = c.decide(fail(step=2600))
    assert (d.action, d.snapshot_id, d.global_step, d.attempt) == (Action.give_up, None, None, 3)
    assert "max_failures=2" in d.reason and "2600" in d.reason and "3" in d.reason


def test_same_snapshot_failures_fall_back_then_give_up():
    c = coord([snap(500), snap(900)])
    chosen = [c.decide(fail(step=950)).snapshot_id for _ in range(3)]
    assert chosen == ["step_000000900"] * 3
    d = c.decide(fail(step=950))  # 900 was restored and failed 3 times
    assert d.snapshot_id == "step_000000500" and d.charged_to == "step_000000900"
    assert "step_000000900" in d.reason and "3x" in d.reason
    assert "failed 3 times" in dict(d.considered)["step_000000900"]
    assert c.decide(fail(step=950)).snapshot_id == "step_000000500"
    assert c.decide(fail(step=950)).snapshot_id == "step_000000500"
    d = c.decide(fail(step=950))
    assert d.action == Action.give_up and "500" in d.reason and "900" in d.reason
    assert c.snapshot_failures == {"step_000000900": 3, "step_000000500": 3}
    assert c.failures == 7


def test_failure_after_progress_does_not_count_against_restored_snapshot():
    snaps = [snap(500), snap(900)]
    c = coord(snaps)
    assert c.decide(fail(step=950)).snapshot_id == "step_000000900"
    snaps.append(snap(1100))  # training resumed from 900 and saved again
    d = c.decide(fail(step=1150))
    assert d.snapshot_id == "step_000001100" and d.charged_to is None
    assert c.snapshot_failures == {}
    d = c.decide(fail(step=1150))
    assert d.charged_to == "step_000001100"


def test_from_history_rebuilds_counts():
    records: list[str] = []
    snaps = [snap(500), snap(900)]
    c = coord(snaps)
    for _ in range(4):
        records.append(json.dumps(c.decide(fail(step=950)).to_json(), allow_nan=False))
    assert len(records) == 4
    rebuilt = RecoveryCoordinator.from_history(
        CoordinatorConfig(), lambda: list(snaps), [json.loads(line) for line in records]
    )
    assert rebuilt.failures == c.failures == 4
    assert rebuilt.snapshot_failures == c.snapshot_failures == {"step_000000900": 3}
    assert rebuilt.history == c.history
    nxt_a, nxt_b = c.decide(fail(step=950)), rebuilt.decide(fail(step=950))
    assert (nxt_b.snapshot_id, nxt_b.charged_to, nxt_b.attempt) == (nxt_a.snapshot_id, nxt_a.charged_to, 5)
    # budget survives a restart too
    rebuilt = RecoveryCoordinator.from_history(
        CoordinatorConfig(max_failures=4), lambda: list(snaps), [Decision.from_json(json.loads(r)) for r in records]
    )
    assert rebuilt.decide(fail()).action == Action.give_up


def test_failure_info_round_trip():
    f = FailureInfo(
        FailureKind.nan_loss,
        300,
        "loss is nan",
        {"loss": float("nan"), "lr": 1e-3, "x": "inf"},
        first_nonfinite_step=290,
        participant="rank3",
    )
    d = json.loads(json.dumps(f.to_json(), allow_nan=False))
    assert d["version"] == 1 and d["kind"] == "nan_loss" and d["metrics"]["loss"] == "nan"
    back = FailureInfo.from_json(d)
    assert back.kind is FailureKind.nan_loss and back.metrics == {"loss": "nan", "lr": 1e-3, "x": "inf"}
    assert (back.step, back.first_nonfinite_step, back.participant, back.time) == (300, 290, "rank3", f.time)
    assert FailureInfo.from_json(back.to_json()) == back


def test_decision_round_trip():
    snaps = [snap(700, avg_reward=187.0), snap(900, avg_reward=50.0)]
    c = coord(snaps, max_acceptable_loss_steps=1000)
    for d in (c.decide(fail(step=2500)), coord([]).decide(fail()), coord([snap(1)], max_failures=0).decide(fail())):
        line = json.dumps(d.to_json(), allow_nan=False)
        back = Decision.from_json(json.loads(line))
        assert back == d and isinstance(back.action, Action)
        assert all(isinstance(pair, tuple) for pair in back.considered)


def test_newer_record_version_refused():
    d = coord([]).decide(fail()).to_json()
    d["version"] = 99
    with pytest.raises(CheckpointError, match="version 99"):
        Decision.from_json(d)


def test_history_and_logging(caplog):
    c = coord([snap(900)])
    with caplog.at_level(logging.INFO, logger="rl_ckpt"):
        d = c.decide(fail())
    assert c.history == [d]
    assert any("restore_latest" in r.getMessage() and "step_000000900" in r.getMessage() for r in caplog.records)


def test_bad_config_and_kind():
    with pytest.raises(ConfigError):
        CoordinatorConfig(best_mode="median")
    with pytest.raises(ConfigError):
        CoordinatorConfig(max_same_snapshot_failures=0)
    with pytest.raises(ConfigError):
        CoordinatorConfig(divergence_threshold=-0.1)
    with pytest.raises(ConfigError):
        FailureInfo("segfault")


def test_step_unknown_and_snapshot_ahead_of_failure():
    d = coord([snap(900)], max_acceptable_loss_steps=10).decide(fail(step=None))
    assert d.action == Action.restore_latest and "step unknown" in d.reason and "900" in d.reason
    d = coord([snap(900)]).decide(fail(step=800))
    assert d.snapshot_id == "step_000000900" and "100 steps ahead of the failure" in d.reason


def test_make_decision_is_a_pure_function_of_its_inputs():
    snaps = [snap(500), snap(900)]
    history = [coord(snaps).decide(fail(step=950)) for _ in range(1)]
    frozen = [Decision.from_json(d.to_json()) for d in history]
    cfg = CoordinatorConfig(max_same_snapshot_failures=2)
    first = make_decision(cfg, fail(step=950), snaps, history)
    again = make_decision(cfg, fail(step=950), snaps, history)
    assert history == frozen and len(snaps) == 2  # nothing it was given changed
    assert (
        (first.action, first.snapshot_id, first.charged_to, first.attempt)
        == (again.action, again.snapshot_id, again.charged_to, again.attempt)
        == (Action.restore_latest, "step_000000900", "step_000000900", 2)
    )
    # the same inputs with a longer history: 900 has now failed twice after restore
    third = make_decision(cfg, fail(step=950), snaps, history + [first])
    assert (third.snapshot_id, third.attempt) == ("step_000000500", 3)
    assert snapshot_failures(history + [first, third]) == {"step_000000900": 2}
