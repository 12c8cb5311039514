"""The Ray demos' figures from a run's event log (``rl_ckpt.demo.figures``): what a lost rollout worker cost, counted
from the kill, for a scoped recovery and for a group restart, and rl_ckpt's share of a group restart without the
restore's wait for the other learner rank."""

from __future__ import annotations

import math
import types

import pytest

from rl_ckpt.demo.figures import rollout_comparison, scoped_figures


def _run(log):
    return types.SimpleNamespace(log=log, attempts=[m for m in log if m["event"] == "attempt"])


def test_a_scoped_recovery_is_counted_from_the_kill():
    log = [
        {"event": "step", "step": 26, "t": 99.0},
        {"event": "kill", "target": "rollout-0", "step": 27, "t": 100.0},
        # seen at 101.5 (t - seconds), replacement up 4.0 s after that, logged as the batch came back at 106.0
        {
            "event": "scoped_recovery",
            "participant": "rollout-0",
            "t": 106.0,
            "seconds": 4.5,
            "replace_seconds": 4.0,
            "rejoin_seconds": 0.05,
            "replay_seconds": 0.25,
            "replacement": "restart",
            "restored": "step_000000024",
            "tier": "memory",
            "replayed_steps": [25, 26],
        },
        {"event": "step", "step": 27, "t": 106.4},
    ]
    f = scoped_figures(_run(log))
    assert f["how"] == "alone: Ray actor restart" and f["undone"] == 0
    assert f["seen"] == pytest.approx(1.5) and f["replace"] == pytest.approx(5.5)  # both from the kill
    assert f["ours"] == pytest.approx(0.3) and f["waited"] == pytest.approx(6.0) and f["to_step"] == pytest.approx(6.4)
    assert f["redone"] == "2 collects replayed + 1"
    table = rollout_comparison([("scoped", f, True)])
    assert "kill: replacement up" in table and "5.50 s" in table


def test_a_group_restart_leaves_the_wait_for_the_other_rank_out_of_rl_ckpts_share():
    phases = {"began": 110.0, "pool": 110.1, "learner": 111.5, "engine_ready": 111.6, "restored": 112.4}
    phases["workers_restored"] = 112.5
    log = [
        {"event": "attempt", "restored": None, "step": 0, "t": 1.0, "phases": {}},
        {"event": "kill", "target": "rollout-0", "step": 27, "t": 100.0},
        {
            "event": "attempt",
            "restored": "step_000000024",
            "step": 24,
            "tier": "memory",
            "t": 112.5,
            "phases": phases,
            "restore_seconds": 0.8,
            "restore_timings": {"agree": 0.6, "total": 0.8},
        },
        {"event": "step", "step": 25, "t": 113.0},
    ]
    f = scoped_figures(_run(log))
    assert f["how"] == "group restart (Ray Train)" and f["undone"] == 3
    assert f["replace"] == pytest.approx(10.0) and f["to_step"] == pytest.approx(13.0)
    assert f["ours"] == pytest.approx(0.1 + 1.0 - 0.6)  # pool, then engines to workers told, less the wait
    assert math.isnan(f["seen"])
