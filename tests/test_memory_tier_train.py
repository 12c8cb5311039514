"""Ray Train, 2 workers, with the memory tier: a worker SIGKILLed mid-run; the group restarts from the newest
memory snapshot (steps lost bounded by the memory cadence) and ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import json
import uuid

import pytest
import torch
from safetensors.torch import load_file

import memory_workers as w

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def fit(ray, tmp_path, name: str, die_at: int | None, max_failures: int) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from actors import CheckpointManager
    from actors.memory_tier import MemoryTierService, memory_manager
    from rl_ckpt.config import CheckpointConfig

    cfg = dict(keep_best=0, memory_interval_steps=2, memory_flush_every=3, memory_replicas=1)
    base = str(tmp_path / "durable")
    config = CheckpointConfig(base_dir=base, run_name=name, **cfg)
    handles = {
        "durable": CheckpointManager.get_or_create(run_name=name, base_dir=base, config=cfg, healthz_port=None),
        "memory": memory_manager(config),
        "service": MemoryTierService.get_or_create(config, interval=3600),
    }
    out = str(tmp_path / f"{name}.safetensors")
    loop_config = {"base_dir": base, "run_name": name, "cfg": cfg, "steps": 12, "die_at": die_at, "out": out, **handles}
    trainer = TorchTrainer(
        w.train_loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 0.5}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(
            name=name,
            storage_path=str(tmp_path / "ray_results"),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    trainer.fit()
    status = ray.get(handles["service"].tick.remote())
    ranks = [json.loads((tmp_path / f"{name}.safetensors.rank{r}.json").read_text()) for r in range(2)]
    from rl_ckpt._storage import open_storage
    from rl_ckpt.integrations.memory_tier import MEMORY_BASE, memory_options

    durable_meta = tmp_path / "durable" / name / "step_000000006" / "meta.json"
    memory = open_storage(f"{MEMORY_BASE}/{name}", memory_options(config))
    same_manifest = (
        durable_meta.exists() and durable_meta.read_bytes() == bytes(memory.read("step_000000006/meta.json"))
        if "step_000000006" in status["memory_snapshots"]
        else durable_meta.exists()
    )
    memory.destroy()
    for h in handles.values():
        ray.kill(h, no_restart=True)
    return {"params": load_file(out), "ranks": ranks, "status": status, "same_manifest": same_manifest}


def test_sigkilled_worker_restarts_from_memory_bitwise(ray_cluster, tmp_path):
    ray = ray_cluster
    clean = fit(ray, tmp_path, f"clean-{uuid.uuid4().hex[:6]}", None, 0)
    crashed = fit(ray, tmp_path, f"crash-{uuid.uuid4().hex[:6]}", 7, 1)
    # Died at step 7 with memory snapshots every 2 steps: restarted from the memory snapshot of step 6.
    assert [r["restored_from"] for r in crashed["ranks"]] == [6, 6]
    assert [r["tier"] for r in crashed["ranks"]] == ["memory", "memory"]
    assert clean["params"].keys() == crashed["params"].keys()
    for k in clean["params"]:
        assert torch.equal(clean["params"][k], crashed["params"][k]), k
    assert [r["shard"] for r in clean["ranks"]] == [r["shard"] for r in crashed["ranks"]]
    # Durable copies were made from memory in the background (every 3rd memory snapshot).
    assert "step_000000006" in crashed["status"]["durable_snapshots"] and crashed["same_manifest"]
