"""Ray Train: a 2-worker FSDP2 run saves; an elastic run (``num_workers=(2, 4)``) comes back on 4 workers and
restores it. The new ranks' RNG is derived (the plan says so), their buffers start empty, the old ranks get
theirs back bitwise."""

from __future__ import annotations

import json
import uuid

import pytest

import new_rank_workers as nw

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def fit(config: dict, workers):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(
        nw.ray_train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 0.5}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(
            name=f"{config['run_name']}-{uuid.uuid4().hex[:4]}", storage_path=config["base_dir"] + "/ray_results"
        ),
    ).fit()


def test_two_workers_save_and_an_elastic_run_restores_on_four(ray_cluster, tmp_path):
    from actors import CheckpointManager

    name = f"newranks-{uuid.uuid4().hex[:6]}"
    mgr = CheckpointManager.get_or_create(run_name=name, base_dir=str(tmp_path))
    config = {"base_dir": str(tmp_path), "run_name": name, "manager": mgr, "out": str(tmp_path)}
    fit(config, 2)
    saved = [json.loads((tmp_path / f"saved_{r}.json").read_text()) for r in range(2)]
    fit(config, (2, 4))  # elastic: the cluster has room for 4 (0.5 CPU each on 2 CPUs)
    got = [json.loads((tmp_path / f"restored_{r}.json").read_text()) for r in range(4)]
    assert all(g["world"] == 4 and g["snapshot"] == "step_000000003" for g in got), got
    plan = got[0]["plan"]
    assert (
        "  new ranks: learner-2, learner-3: no saved rng; derived from the saved streams of learner-0, learner-1 "
        "and the rank's name (new_rank_state='derive')"
    ) in plan.splitlines(), plan
    assert "learner-2, learner-3: no saved replay_buffer; starts as constructed" in plan
    assert "saved by 2 ranks as FSDP(2) -> restored on 4 ranks as FSDP(4)" in plan
    for rank in (0, 1):
        assert got[rank]["rng"] == saved[rank]["rng"] and got[rank]["items"] == saved[rank]["items"]
    assert got[2]["items"] == got[3]["items"] == []
    assert len({g["rng"] for g in got}) == 4
