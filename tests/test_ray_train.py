"""Ray Train v2: TorchTrainer with 2 gloo workers, the CheckpointCallback and FailureConfig(max_failures=2).
One worker is SIGKILLed mid-run on the first attempt; Ray Train restarts the group, every rank restores
the snapshot the coordinator chose, and the final parameters equal an uninterrupted run bit for bit."""

from __future__ import annotations

import uuid

import pytest

from ray_workers import ddp_train

pytestmark = pytest.mark.ray
STEPS = 30


def _fit(ray, tmp_path, run_name, **extra):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from actors import CheckpointManager
    from rl_ckpt.integrations.ray_train import CheckpointCallback

    manager = CheckpointManager.get_or_create(run_name=run_name, base_dir=str(tmp_path / "ckpt"),
                                              commit_timeout_seconds=15.0)
    out = tmp_path / f"{run_name}.digest"
    config = {"base_dir": str(tmp_path / "ckpt"), "run_name": run_name, "manager": manager, "every": 5,
              "steps": STEPS, "out": str(out), "log": str(tmp_path / f"{run_name}.log"), **extra}
    callback = CheckpointCallback(run_name=run_name)
    trainer = TorchTrainer(
        ddp_train, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0.5}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(name=run_name, storage_path=str(tmp_path / "ray_results"),
                             failure_config=FailureConfig(max_failures=2), callbacks=[callback]),
    )
    trainer.fit()
    return manager, out.read_text(), (tmp_path / f"{run_name}.log").read_text()


def test_worker_sigkill_then_exact_restart(ray_cluster, tmp_path):
    ray = ray_cluster
    tag = uuid.uuid4().hex[:6]
    ref_mgr, reference, _ = _fit(ray, tmp_path, f"ref-{tag}")
    mgr, crashed, log = _fit(ray, tmp_path, f"crash-{tag}", crash_at=17, crash_marker=str(tmp_path / "crashed"))
    assert (tmp_path / "crashed").exists(), "the first attempt never crashed"
    attempts = log.strip().splitlines()
    assert len(attempts) == 2 and "restored=None" in attempts[0]
    assert "restored=step_000000015" in attempts[1] or "restored=step_000000010" in attempts[1], attempts
    failures = ray.get(mgr.failures.remote())
    assert failures and failures[0]["kind"] == "process_killed"
    decisions_dir = tmp_path / "ckpt" / f"crash-{tag}" / "decisions"
    assert any(decisions_dir.iterdir())  # the coordinator's decision is in the run folder
    assert crashed == reference  # bitwise-equal final parameters
    ray.kill(mgr)
    ray.kill(ref_mgr)
