"""Ray Train: a 4-worker FSDP2 run that loses a worker resumes as a new fit on 2 workers and finishes."""

from __future__ import annotations

import json
import uuid

import pytest
import torch
from safetensors.torch import load_file

import sharded_workers as w

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def fit(ray, config: dict, workers: int, max_failures: int = 0):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        w.ray_train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 0.5}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(
            name=f"{config['run_name']}-{workers}",
            storage_path=config["base_dir"] + "/ray_results",
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    return trainer.fit()


def test_four_workers_lose_one_and_resume_on_two(ray_cluster, tmp_path):
    ray = ray_cluster
    from actors import CheckpointManager

    name = f"elastic-{uuid.uuid4().hex[:6]}"
    mgr = CheckpointManager.get_or_create(run_name=name, base_dir=str(tmp_path))
    config = {
        "base_dir": str(tmp_path),
        "run_name": name,
        "manager": mgr,
        "seed": 0,
        "steps": 6,
        "save_at": [3],
        "die_at": 5,
        "out": str(tmp_path / "final.safetensors"),
    }
    with pytest.raises(Exception):
        fit(ray, config, 4)  # rank 3 dies at step 5, after the step-3 snapshot of 4 shards
    meta = json.loads((tmp_path / name / "step_000000003" / "meta.json").read_text())
    assert meta["components"]["policy"]["layout"]["saved_by"]["world_size"] == 4

    fit(ray, {**config, "seed": 1, "die_at": None, "save_at": []}, 2)  # a new fit, half the workers
    info = json.loads((tmp_path / "final.safetensors.json").read_text())
    assert (info["world"], info["restored_from"], info["snapshot"], info["tier"]) == (2, 3, "step_000000003", None)
    assert info["layout"] == "optim, policy saved by 4 ranks as FSDP(4) -> restored on 2 ranks as FSDP(2) (resharded)"
    got = load_file(str(tmp_path / "final.safetensors"))

    # The same 6 steps in one process on the whole global batch: FSDP averages the ranks' gradients of equal
    # slices, so the math is layout-independent; only the order of float additions differs (4 vs 2 vs 1 ranks).
    model = w.make_model(0)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(1, 7):
        optim.zero_grad()
        w.global_batch_loss(model, step, 0, 1).backward()
        optim.step()
    for fqn, t in model.state_dict().items():
        torch.testing.assert_close(got[f"model.{fqn}"], t, rtol=1e-5, atol=1e-6)
