"""Two-phase saves and the scheduler: snapshot = state at the call, skip-not-queue, errors surface."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from helpers import PPOState
from rl_ckpt import CheckpointEngine, StorageError
from rl_ckpt.tools.faults import FaultyStorage
from rl_ckpt._storage import open_storage


def _engine(tmp_path, **cfg):
    storage = FaultyStorage(open_storage(str(tmp_path / "run")))
    return CheckpointEngine(base_dir=str(tmp_path), storage=storage, **cfg), storage


def test_snapshot_is_the_state_at_the_call(tmp_path):
    s = PPOState(seed=2)
    engine, storage = _engine(tmp_path)
    s.register(engine)
    s.train(3)
    at_call = {n: copy.deepcopy(c.state_dict()) for n, c in s.components().items() if n != "replay_buffer"}
    at_call_obs = s.replay_buffer.obs.copy()
    gate = threading.Event()
    storage.before("write", gate.wait, nth=1)  # hold the background writer until training moved on
    handle = engine.save_async(3, metrics={"avg_reward": 1.0})
    assert not handle.done() and engine.saving
    # Change everything right after the call: the modules and the optimizer through optimizer steps (their
    # tensors may still be copying: the step waits for the copy), in place after the copy; the replay buffer
    # (not guarded: copied at the call) in place at once.
    s.train(2)
    handle.wait_staged()
    with torch.no_grad():
        for p in list(s.policy.parameters()) + list(s.value.parameters()):
            p.fill_(123.0)
        for st in s.optimizer.state.values():
            st["exp_avg"].fill_(-1.0)
    s.replay_buffer.obs[:] = 9.0
    s.replay_buffer.advantages.fill_(7.0)
    gate.set()
    info = handle.wait(timeout=60)
    assert info.global_step == 3 and handle.done()
    fresh = PPOState(seed=99)
    fresh.register(CheckpointEngine(base_dir=str(tmp_path))).restore()
    for name in ("policy", "value"):
        got = getattr(fresh, name).state_dict()
        assert all(torch.equal(got[k], v) for k, v in at_call[name].items()), name
    for pid, st in at_call["optimizer"]["state"].items():
        assert torch.equal(fresh.optimizer.state_dict()["state"][pid]["exp_avg"], st["exp_avg"])
    assert (fresh.replay_buffer.obs == at_call_obs).all()


def test_staging_buffers_are_reused(tmp_path):
    s = PPOState()
    engine, _ = _engine(tmp_path, keep_latest=10)
    s.register(engine)
    s.train(1)  # the optimizer has its exp_avg/exp_avg_sq from here on
    engine.save_async(1).wait()
    first = engine.pipeline.staging.allocations
    assert first > 0
    for step in range(2, 6):
        s.train(1)
        engine.save_async(step).wait()
    assert engine.pipeline.staging.allocations == first


def test_background_error_reaches_wait_and_on_error(tmp_path):
    s = PPOState()
    engine, storage = _engine(tmp_path)
    s.register(engine)
    storage.fail("write", nth=2, error=28)  # ENOSPC on the 2nd file
    errors = []
    sched = engine.scheduler(on_error=lambda exc, step: errors.append((type(exc), step)))
    engine.config.values["save_interval_steps"] = 1
    sched = engine.scheduler(on_error=lambda exc, step: errors.append((type(exc), step)))
    sched.step(0)
    handle = sched.step(1)
    with pytest.raises(StorageError, match="No space left"):
        handle.wait(timeout=60)
    sched.step(2)  # the scheduler collects the failure and reports it; training goes on
    sched.close()
    assert errors and errors[0] == (StorageError, 1)
    assert [i.global_step for i in CheckpointEngine(base_dir=str(tmp_path)).snapshots()] == [2]


def test_scheduler_skips_rather_than_queues(tmp_path):
    s = PPOState()
    engine, storage = _engine(tmp_path, save_interval_steps=1, save_interval_seconds=None, keep_latest=50)
    s.register(engine)
    gate = threading.Event()
    storage.before("write", gate.wait, nth=1)
    sched = engine.scheduler()
    sched.step(0)
    first = sched.step(1)
    assert first is not None
    for step in range(2, 8):  # every step is due, but the first save is stuck: skipped, not queued
        assert sched.step(step) is None
    assert sched.skipped == 6 and engine.saving
    gate.set()
    first.wait(timeout=60)
    assert sched.step(8) is not None
    sched.close()
    assert [i.global_step for i in engine.snapshots()] == [1, 8]


def test_scheduler_steps_or_seconds_and_light(tmp_path):
    now = [0.0]
    s = PPOState()
    engine = s.register(
        CheckpointEngine(
            base_dir=str(tmp_path),
            save_interval_steps=10,
            save_interval_seconds=60,
            light_interval_steps=3,
            keep_latest=50,
        )
    )
    sched = engine.scheduler(clock=lambda: now[0])
    kinds = {}
    for step in range(0, 25):
        if step == 14:
            now[0] = 61.0  # a minute passed: time triggers before the step interval does
        h = sched.step(step, metrics={"avg_reward": float(step)})
        if h is not None:
            h.wait(timeout=60)
            kinds[step] = h.kind
    sched.close()
    # No light snapshot before the first full one: a light snapshot needs a base.
    assert kinds == {10: "full", 13: "light", 14: "full", 17: "light", 20: "light", 23: "light", 24: "full"}
    lights = [i for i in engine.snapshots() if i.kind == "light"]
    assert all(i.base_snapshot_id for i in lights)
    assert {i.global_step: i.base_snapshot_id for i in lights}[13] == "step_000000010"


def test_close_waits_for_the_save_in_flight(tmp_path):
    s = PPOState()
    engine, storage = _engine(tmp_path)
    s.register(engine)
    gate = threading.Event()
    storage.before("write", gate.wait, nth=1)
    handle = engine.save_async(5)
    threading.Timer(0.05, gate.set).start()
    engine.close()
    assert handle.done() and handle.wait().global_step == 5


@pytest.mark.parametrize("nice", [0, 7])
def test_background_writer_runs_at_the_configured_lower_priority(tmp_path, nice):
    """writer_nice: the writer thread (not the trainer) is reniced, so training threads win a contended core."""
    import os

    s = PPOState(seed=4)
    engine, storage = _engine(tmp_path, writer_nice=nice)
    s.register(engine)
    seen = {}

    def look() -> None:  # runs on the writer thread, at its first write
        tid = threading.get_native_id()
        seen["writer"] = os.getpriority(os.PRIO_PROCESS, tid)
        seen["name"] = threading.current_thread().name

    storage.before("write", look, nth=1)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    engine.save_async(1).wait()
    assert seen["name"].startswith("rl_ckpt-writer")
    assert seen["writer"] == min(19, base + nice)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the caller is untouched
    engine.close()


def test_an_error_raised_by_on_commit_reaches_on_error(tmp_path):
    s = PPOState()
    engine, _ = _engine(tmp_path, save_interval_steps=1, save_interval_seconds=None, keep_latest=10)
    s.register(engine)
    errors = []

    def on_commit(info):
        raise ValueError(f"dashboard down for {info.snapshot_id}")

    sched = engine.scheduler(on_error=lambda exc, step: errors.append((exc, step)), on_commit=on_commit)
    sched.step(0)
    sched.step(1).wait(timeout=60)
    sched.close()  # collects the finished save and the callback's error, without another step
    ((exc, step),) = errors
    assert isinstance(exc, ValueError) and "step_000000001" in str(exc) and step == 1
    assert sched.failures == 0 and sched.warnings == 1
    assert [i.global_step for i in engine.snapshots()] == [1]


def test_staging_frees_the_buffers_of_keys_that_are_gone(tmp_path):
    engine, _ = _engine(tmp_path, keep_latest=10)
    policy = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    head = torch.nn.Linear(8, 3)
    engine.register("policy", policy)
    engine.register("head", head)
    engine.save_async(1).wait()
    keys = set(engine.pipeline.staging.buffers)
    assert {k for k in keys if k[0] == "head"} == {("head", "weight"), ("head", "bias")}
    del policy[1]  # a key vanishes from the policy's state dict
    engine.registry.remove("head")  # and a component is no longer saved
    engine.save_async(2).wait()
    assert set(engine.pipeline.staging.buffers) == {("policy", "0.weight"), ("policy", "0.bias")}
