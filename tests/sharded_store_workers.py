"""Rank bodies for the sharded staging and dedup tests (spawned with torch.multiprocessing, like sharded_workers).

Results the test checks go to JSON or safetensors files in ``out`` (never pickles).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

import sharded_workers as w


def staging_job(rank: int, world: int, port: int, run: str, out: str) -> None:
    """Background saves of FSDP2 shards reuse one set of host buffers; what is saved is what was staged."""
    w.init(rank, world, port)
    model = w.shard(w.make_model(0), (world,))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = w.engine_for(run, rank, world)
    engine.register("policy", model)
    engine.register("optim", optim)
    w.train(model, optim, range(0, 2), rank)
    staging = engine.pipeline.staging
    engine.save_async(2).wait()
    first = staging.allocations
    keys = set(staging.buffers)
    ptrs = {k: b.data_ptr() for k, b in staging.buffers.items()}
    assert first == len(keys) > 0 and {c for c, _k in keys} == {"policy", "optim"}, keys
    w.train(model, optim, range(2, 4), rank)
    handle = engine.save_async(4)
    at_save = w.full_state(model, optim)
    w.train(model, optim, range(4, 6), rank)  # the live shards change while step 4 is written
    handle.wait()
    assert staging.allocations == first and set(staging.buffers) == keys
    assert {k: b.data_ptr() for k, b in staging.buffers.items()} == ptrs
    engine.close()

    model2 = w.shard(w.make_model(5), (world,))
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    engine2 = w.engine_for(run, rank, world)
    engine2.register("policy", model2)
    engine2.register("optim", optim2)
    assert engine2.restore().global_step == 4
    got = w.full_state(model2, optim2)
    for k, v in at_save.items():
        assert torch.equal(got[k], v), f"rank {rank}: {k} differs from the state at save_async(4)"
    engine2.close()
    dist.destroy_process_group()


def cuda_staging_job(rank: int, world: int, port: int, run: str, out: str) -> None:
    """FSDP2 on CUDA (NCCL): local shards staged into pinned buffers; mutated right after; restored bitwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cuda", (world,))
    model = w.make_model(0).cuda()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = w.engine_for(run, rank, world)
    engine.register("policy", model)
    engine.register("optim", optim)
    for step in range(2):
        optim.zero_grad()
        model(w.batch(step, rank).cuda()).pow(2).mean().backward()
        optim.step()
    expected = {k: v.cpu() for k, v in w.full_state(model, optim).items()}
    handle = engine.save_async(2)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().mul_(-1).add_(3)  # right after the blocking phase
    handle.wait()
    bufs = [b for b in engine.pipeline.staging.buffers.values() if isinstance(b, torch.Tensor)]
    assert bufs and all(b.is_pinned() for b in bufs)
    assert engine.pipeline.staging.copies.async_copies > 0
    engine.close()
    model2 = w.make_model(3).cuda()  # another init: everything must come from the snapshot
    for layer in model2:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model2, mesh=mesh)
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    engine2 = w.engine_for(run, rank, world)
    engine2.register("policy", model2)
    engine2.register("optim", optim2)
    assert engine2.restore().global_step == 2
    got = w.full_state(model2, optim2)
    for k, v in expected.items():
        assert got[k].cpu().view(torch.uint8).equal(v.view(torch.uint8)), f"rank {rank}: {k} differs"
    engine2.close()
    dist.destroy_process_group()


def write_json(out: str, name: str, data) -> None:
    Path(out, name).write_text(json.dumps(data))

