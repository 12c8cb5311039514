"""Exact resume: PPO on CartPole in a real process, scheduled async saves, SIGKILL at a random
step, restore through a recovery plan in a new process, continue to step N: bitwise-equal
parameters and equal losses compared with a run that never crashed."""

from __future__ import annotations

import random

import pytest

from rl_ckpt.demo.drill import context, crash_drill

STEPS = 40


@pytest.fixture(scope="module")
def ctx():
    return context()


@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_mid_run_then_exact_resume(ctx, tmp_path, seed):
    rnd = random.Random(seed + 99)
    crash_at = rnd.randint(12, STEPS - 6)
    cfg = {"base_dir": str(tmp_path), "run_name": "ppo", "save_interval_steps": 5, "save_interval_seconds": None,
           "keep_latest": 3, "keep_best": 1}
    result = crash_drill(cfg, STEPS, crash_at, seed=seed, ctx=ctx)
    assert result.crashed.killed_at >= crash_at and result.crashed.done is None
    assert result.resumed.restored["snapshot"] is not None, "nothing was restored"
    restored = result.restored_step
    assert 0 < restored <= result.crashed.killed_at and restored % 5 == 0
    assert "checksums verified" in result.resumed.restored["plan"]
    assert min(result.resumed.losses) == restored + 1  # it continued right after the snapshot
    assert result.losses_equal, "losses differ from the uninterrupted run"
    assert result.params_equal, "final parameters differ from the uninterrupted run"
    assert result.resumed.done["step"] == result.reference.done["step"] == STEPS
