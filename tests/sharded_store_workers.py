"""Rank bodies for the sharded staging and dedup tests (spawned with torch.multiprocessing, like sharded_workers).

Results the test checks go to JSON or safetensors files in ``out`` (never pickles).
"""

from __future__ import annotations

import json
import os
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
        assert got[k].cpu().reshape(-1).view(torch.uint8).equal(v.reshape(-1).view(torch.uint8)), f"rank {rank}: {k}"
    engine2.close()
    dist.destroy_process_group()


def write_json(out: str, name: str, data) -> None:
    Path(out, name).write_text(json.dumps(data))


# -- dedup ------------------------------------------------------------------------------------------------
FEATURES = 64


def frozen_model(seed: int) -> torch.nn.Module:
    """A small policy whose first layer (a 64 x 48 float32 weight, 12 KiB) is frozen, as a frozen embedding."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 48), torch.nn.Tanh(), torch.nn.Linear(48, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3)
    )
    model[0].requires_grad_(False)
    return model


def frozen_setup(world: int, seed: int):
    model = w.shard(frozen_model(seed), (world,))
    optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return model, optim


def frozen_train(model, optim, steps: range, rank: int) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        optim.zero_grad()
        model(torch.randn(8, FEATURES, generator=g)).pow(2).mean().backward()
        optim.step()


def counting_writes(engine) -> dict:
    """Count the tensor bytes this engine writes: dedup objects and shard files (not manifests or JSON)."""
    st = engine.storage
    counts = {"bytes": 0}
    write, write_many = st.write, st.write_many_atomic

    def counted_write(path, chunks, **kw):
        if path.endswith(".safetensors"):
            chunks = list(chunks)
            counts["bytes"] += sum(memoryview(c).nbytes for c in chunks)
        return write(path, chunks, **kw)

    def counted_many(items):
        counts["bytes"] += sum(memoryview(data).nbytes for path, data in items if path.startswith("objects/"))
        return write_many(items)

    st.write, st.write_many_atomic = counted_write, counted_many
    return counts


def dedup_save_job(rank: int, world: int, port: int, run: str, out: str) -> None:
    """Three dedup saves (keep_latest=2: the third deletes the first); tensor bytes written per save to JSON."""
    from safetensors.torch import save_file

    from rl_ckpt import CheckpointEngine

    w.init(rank, world, port)
    model, optim = frozen_setup(world, 0)
    engine = CheckpointEngine(
        base_dir=str(Path(run).parent),
        run_name=Path(run).name,
        rank=rank,
        world_size=world,
        dedup=True,
        dedup_min_tensor_bytes=256,
        keep_latest=2,
    )
    engine.register("policy", model)
    engine.register("optim", optim)
    counts = counting_writes(engine)
    written = []
    for step in (1, 2, 3):
        frozen_train(model, optim, range(2 * step, 2 * step + 2), rank)
        before = counts["bytes"]
        engine.save(step)
        written.append(counts["bytes"] - before)
        full = w.full_state(model, optim)
        if rank == 0:
            save_file(full, str(Path(out) / f"full_{step}.safetensors"))
            if step == 1:  # kept for the test: retention deletes step 1 after step 3
                Path(out, "meta_1.json").write_bytes((Path(run) / "step_000000001" / "meta.json").read_bytes())
    local_frozen = model[0].weight.to_local()
    write_json(
        out,
        f"written_{rank}.json",
        {"written": written, "frozen_bytes": local_frozen.numel() * local_frozen.element_size()},
    )
    engine.close()
    dist.destroy_process_group()


def dedup_restore_job(rank: int, world: int, port: int, run: str, out: str, step: int, skipped: str) -> None:
    """Restore onto ``world`` ranks; the state must equal ``full_<step>`` bitwise (``skipped``: why newer was not)."""
    from safetensors.torch import load_file

    w.init(rank, world, port)
    model, optim = frozen_setup(world, 77)  # another init: everything must come from the snapshot
    engine = w.engine_for(run, rank, world, dedup=True, dedup_min_tensor_bytes=256)
    engine.register("policy", model)
    engine.register("optim", optim)
    result = engine.restore()
    assert result.global_step == step, (result.snapshot_id, result.skipped)
    if skipped:
        why = " ".join(result.skipped.values())
        assert all(s in why for s in skipped.split("|")), why
    expected = load_file(str(Path(out) / f"full_{step}.safetensors"))
    got = w.full_state(model, optim)
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))
    for k, v in expected.items():
        assert got[k].reshape(-1).view(torch.uint8).equal(v.reshape(-1).view(torch.uint8)), f"rank {rank}/{world}: {k}"
    engine.close()
    dist.destroy_process_group()


def dedup_kill_job(rank: int, world: int, port: int, run: str, out: str, nth: int, partial: bool) -> None:
    """Commit step 1 (dedup); in step 2, rank 1 is SIGKILLed at its ``nth`` object publish (``partial``: half
    of that batch published), while rank 0 waits for its part."""
    import signal

    from safetensors.torch import save_file

    w.init(rank, world, port)
    model, optim = frozen_setup(world, 0)
    engine = w.engine_for(run, rank, world, dedup=True, dedup_min_tensor_bytes=256)
    engine.register("policy", model)
    engine.register("optim", optim)
    frozen_train(model, optim, range(0, 2), rank)
    engine.save(1)
    full = w.full_state(model, optim)
    if rank == 0:
        save_file(full, str(Path(out) / "full_1.safetensors"))
    frozen_train(model, optim, range(2, 4), rank)
    dist.barrier()
    if rank == 1:
        write_many = engine.storage.write_many_atomic
        calls = {"n": 0}

        def dying(items):
            calls["n"] += 1
            if calls["n"] == nth:
                write_many(items[: max(1, len(items) // 2)] if partial else items)
                Path(out, "killed").write_text(str(len(items)))
                os.kill(os.getpid(), signal.SIGKILL)
            return write_many(items)

        engine.storage.write_many_atomic = dying
    engine.save(2)
    raise AssertionError("step 2 must not commit: rank 1 was killed")
