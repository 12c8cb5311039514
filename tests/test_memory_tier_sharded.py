"""FSDP2 sharded state through the memory tier, on real Ray Train (gloo) with a rank SIGKILLed mid-run.

2 learners, a memory snapshot every 2 steps (each rank puts its own shards into the node's store, committed by the
memory manager's two-phase commit), a durable copy of every 3rd made from memory by ``MemoryTierService``. Rank 1
dies at the start of step 7. Then: a fit on 1 learner restores the step-6 memory snapshot resharded; a fit on 2
learners restores it again and finishes bitwise equal to an uninterrupted run; the durable copy of step 6 alone
restores into a plain module.
"""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

import sharded_workers as w

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS, DIE_AT = 10, 7
CFG = {"keep_best": 0, "memory_interval_steps": 2, "memory_flush_every": 3, "memory_replicas": 0}


def fit(config: dict, workers: int, tag: str, max_failures: int = 0) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = f"{config['base_dir']}/{tag}.safetensors"
    trainer = TorchTrainer(
        w.ray_train_loop,
        train_loop_config={**config, "out": out},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 0.5}),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(
            name=f"{config['run_name']}-{tag}",
            storage_path=config["base_dir"] + "/ray_results",
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    trainer.fit()
    return {"state": load_file(out), "info": json.loads(open(out + ".json").read()), "out": out}


def start(ray, base: str, name: str) -> dict:
    from actors import CheckpointManager
    from actors.memory_tier import MemoryTierService, memory_manager
    from rl_ckpt.config import CheckpointConfig

    config = CheckpointConfig(base_dir=base, run_name=name, **CFG)
    mgr = CheckpointManager.get_or_create(run_name=name, base_dir=base, config=CFG, healthz_port=None)
    memory = {"manager": memory_manager(config), "service": MemoryTierService.get_or_create(config, interval=3600)}
    return {
        "base_dir": base,
        "run_name": name,
        "manager": mgr,
        "memory": memory,
        "cfg": CFG,
        "seed": 0,
        "steps": STEPS,
        "save_at": [],
        "config": config,
    }


def stop(ray, run: dict) -> None:
    from rl_ckpt.integrations.memory_tier import MEMORY_BASE, memory_options
    from rl_ckpt._storage import open_storage

    open_storage(f"{MEMORY_BASE}/{run['run_name']}", memory_options(run["config"])).destroy()
    for h in (run["manager"], run["memory"]["manager"], run["memory"]["service"]):
        ray.kill(h, no_restart=True)


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    """The uninterrupted run, the crashed run, its restore on 1 learner and its resume on 2 (shared by the tests)."""
    from ray.train import TrainingFailedError

    ray = ray_cluster
    crash = start(ray, str(tmp_path_factory.mktemp("crash")), f"shmem-crash-{uuid.uuid4().hex[:6]}")
    try:
        # The uninterrupted run: the same loop and math, no snapshots at all. It needs nothing from the crashed
        # run, so it runs next to it (at most 2 + 2 workers of half a CPU: the 2-CPU cluster holds both).
        ref = {
            **crash,
            "base_dir": str(tmp_path_factory.mktemp("ref")),
            "manager": None,
            "memory": None,
            "gather_at": 6,
        }
        with ThreadPoolExecutor(1) as pool:
            ref_fit = pool.submit(fit, ref, 2, "ref")
            with pytest.raises(TrainingFailedError):
                fit({**crash, "die_at": DIE_AT}, 2, "killed")  # rank 1 SIGKILLed at the start of step 7
            # The service flushes what is due (every 3rd memory snapshot: step 6) when it looks; look now.
            out = {"status": ray.get(crash["memory"]["service"].tick.remote())}
            out["one"] = fit({**crash, "steps": 6}, 1, "one")  # restore only: on 1 learner, resharded
            out["resumed"] = fit(crash, 2, "resumed")
            out["ref"] = ref_fit.result()
        out["ref"]["gathered"] = load_file(out["ref"]["out"] + ".gathered")
        out["durable_dir"] = f"{crash['base_dir']}/{crash['run_name']}"
        yield out
    finally:
        stop(ray, crash)


def test_restart_on_two_learners_restores_memory_bitwise(runs):
    info = runs["resumed"]["info"]
    assert (info["world"], info["restored_from"], info["tier"]) == (2, 6, "memory"), info
    assert info["snapshot"] == "step_000000006"
    assert "saved by 2 ranks as FSDP(2) -> restored on 2 ranks as FSDP(2) (same layout)" in info["layout"], info
    ref, got = runs["ref"]["state"], runs["resumed"]["state"]
    assert ref.keys() == got.keys() and any(k.startswith("optim.") for k in got)
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


def test_restart_on_one_learner_restores_the_memory_snapshot_resharded(runs):
    info = runs["one"]["info"]
    assert (info["world"], info["restored_from"], info["tier"], info["snapshot"]) == (
        1,
        6,
        "memory",
        "step_000000006",
    ), info
    assert "optim, policy saved by 2 ranks as FSDP(2) -> restored on 1 rank as FSDP(1) (resharded)" in info["layout"]
    assert "restoring from memory" in info["reason"]
    # Resharded: the one rank reads parts of both ranks' files, each stored file with one request to its store.
    shard_files = {p.rsplit("/", 1)[-1] for p in info["ranged_reads"]}
    assert {"policy.rank0.safetensors", "policy.rank1.safetensors"} <= shard_files, info["ranged_reads"]
    assert set(info["ranged_reads"].values()) == {1}, info["ranged_reads"]
    gathered, got = runs["ref"]["gathered"], runs["one"]["state"]
    assert gathered.keys() == got.keys()
    for k in gathered:
        assert torch.equal(gathered[k], got[k]), k


def test_durable_copy_of_a_sharded_memory_snapshot_restores_alone(runs, tmp_path):
    from rl_ckpt import CheckpointEngine

    assert "step_000000006" in runs["status"]["flushed"], runs["status"]
    durable = runs["durable_dir"]
    meta = json.loads(open(f"{durable}/step_000000006/meta.json").read())
    assert meta["components"]["policy"]["layout"]["saved_by"]["world_size"] == 2
    # Durable storage alone (no Ray, no memory tier): the gathered step-6 state in a plain module + optimizer.
    model = w.make_model(1)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = CheckpointEngine(base_dir=durable.rsplit("/", 1)[0], run_name=durable.rsplit("/", 1)[1], retention=False)
    engine.register("policy", model)
    engine.register("optim", optim)
    result = engine.restore(snapshot_id="step_000000006")
    engine.close()
    assert (result.snapshot_id, result.global_step) == ("step_000000006", 6)
    gathered, got = runs["ref"]["gathered"], w.full_state(model, optim)
    assert gathered.keys() == got.keys()
    for k in gathered:
        assert torch.equal(gathered[k], got[k]), k
