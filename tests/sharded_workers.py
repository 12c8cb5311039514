"""Rank bodies for the sharded-state tests: real FSDP2 on CPU/gloo processes started by torch.multiprocessing.

Each function runs in one spawned rank; an assertion error in any rank fails
the test (mp.spawn re-raises it). Results that the test checks go to JSON or
safetensors files in ``out`` (never pickles).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

ROWS = (24, 10)  # uneven on 3 and 4 ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, ROWS[0]),
        torch.nn.Tanh(),
        torch.nn.Linear(ROWS[0], ROWS[1]),
        torch.nn.Tanh(),
        torch.nn.Linear(ROWS[1], 3),
    )


def init(rank: int, world: int, port: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def shard(model: torch.nn.Module, mesh_shape: tuple[int, ...]) -> torch.nn.Module:
    """FSDP2 over a 1-D mesh (FSDP) or a 2-D one (HSDP: replicate over dim 0, shard over dim 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = ("dp",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g)


def train(model, optim, steps: range, rank: int) -> None:
    for step in steps:
        optim.zero_grad()
        model(batch(step, rank)).pow(2).mean().backward()
        optim.step()


def full_state(model, optim) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor, gathered whole (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    msd, osd = get_state_dict(model, optim)
    out = {f"model.{k}": v for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim.{fqn}.{k}"] = v
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone().contiguous() for k, v in out.items()}


def local_bytes(model, optim) -> int:
    """This rank's share: the bytes of its local shards of everything restored."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    msd, osd = get_state_dict(model, optim)
    ts = list(msd.values()) + [v for st in osd["state"].values() for v in st.values()]
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in ts)


def engine_for(run: str, rank: int, world: int, **kw):
    from rl_ckpt import CheckpointEngine

    return CheckpointEngine(
        base_dir=str(Path(run).parent), run_name=Path(run).name, rank=rank, world_size=world, retention=False, **kw
    )


def counting(engine) -> dict:
    """Count every byte this engine reads from storage (whole files and ranges)."""
    st = engine.storage
    counts = {"read": 0, "range": 0}
    read, read_range = st.read, st.read_range

    def counted_read(path, **kw):
        data = read(path, **kw)
        counts["read"] += len(data)
        return data

    def counted_range(path, start, length):
        data = read_range(path, start, length)
        counts["range"] += len(data)
        return data

    st.read, st.read_range = counted_read, counted_range
    return counts


def count_ranged_reads(storage) -> dict:
    """path -> ranged read requests made through ``storage`` from now on (``read_ranges`` of many ranges: one)."""
    counts: dict = {}
    read_range, read_ranges = storage.read_range, storage.read_ranges

    def one(path, start, length):
        counts[path] = counts.get(path, 0) + 1
        return read_range(path, start, length)

    def many(path, ranges):
        counts[path] = counts.get(path, 0) + 1
        return read_ranges(path, ranges)

    storage.read_range, storage.read_ranges = one, many
    return counts


def save_job(rank: int, world: int, port: int, run: str, out: str, mesh_shape: tuple, steps: int, step: int) -> None:
    """Train ``steps`` steps on ``mesh_shape``, save as ``step``, write the gathered full state (rank 0)."""
    from safetensors.torch import save_file

    init(rank, world, port)
    model = shard(make_model(0), mesh_shape)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, optim, range(steps), rank)
    from rl_ckpt._sharded import ShardedState

    engine = engine_for(run, rank, world)
    # This test's tensors are a few KiB: blocks that small (the default floor is 64 KiB) let the restore
    # tests check the read bound at row granularity. The optimizer takes the model's block sizes.
    engine.register("policy", ShardedState(model, min_block_bytes=0))
    engine.register("optim", optim)
    info = engine.save(step)
    ids = [None] * world
    dist.all_gather_object(ids, (info.snapshot_id, info.size_bytes))
    assert len(set(ids)) == 1, f"ranks saw different commits: {ids}"
    full = full_state(model, optim)
    if rank == 0:
        save_file(full, str(Path(out) / f"full_{step}.safetensors"))
    engine.close()
    dist.destroy_process_group()


def restore_job(rank: int, world: int, port: int, run: str, out: str, mesh_shape: tuple, step: int) -> None:
    """Restore onto ``mesh_shape`` from whatever layout the snapshot has; compare gathered state bitwise."""
    from safetensors.torch import load_file

    init(rank, world, port)
    model = shard(make_model(123), mesh_shape)  # different init: everything must come from the snapshot
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = engine_for(run, rank, world)
    engine.register("policy", model)
    engine.register("optim", optim)
    counts = counting(engine)
    result = engine.restore()
    assert result.snapshot_id == f"step_{step:09d}", result
    expected = load_file(str(Path(out) / f"full_{step}.safetensors"))
    share = local_bytes(model, optim)
    got = full_state(model, optim)
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"rank {rank}: {k} differs after restore"
    manifest = (Path(run) / result.snapshot_id / "meta.json").stat().st_size
    report = {
        "rank": rank,
        "share": share,
        "range_bytes": counts["range"],
        "whole_file_bytes": counts["read"],
        "manifest": manifest,
    }
    (Path(out) / f"read_{world}_{rank}.json").write_text(json.dumps(report))
    # The tensor bytes a rank reads stay within 1.25x its share (whole-file reads are the manifest and catalog).
    assert counts["range"] <= 1.25 * share, report
    engine.close()
    dist.destroy_process_group()


def resume_job(rank: int, world: int, port: int, run: str, out: str) -> None:
    """Same-layout restore + continued training equals an uninterrupted run, bitwise."""
    init(rank, world, port)
    model = shard(make_model(0), (world,))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = engine_for(run, rank, world)
    engine.register("policy", model)
    engine.register("optim", optim)
    train(model, optim, range(0, 3), rank)
    handle = engine.save_async(3)  # stages copies of the local shards; training goes on while they are written
    train(model, optim, range(3, 6), rank)
    assert handle.wait().snapshot_id == "step_000000003"
    uninterrupted = full_state(model, optim)
    engine.close()

    model2 = shard(make_model(7), (world,))
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    engine2 = engine_for(run, rank, world)
    engine2.register("policy", model2)
    engine2.register("optim", optim2)
    assert engine2.restore().global_step == 3
    train(model2, optim2, range(3, 6), rank)
    resumed = full_state(model2, optim2)
    for k, v in uninterrupted.items():
        assert torch.equal(resumed[k], v), f"rank {rank}: {k} differs from the uninterrupted run"
    engine2.close()
    dist.destroy_process_group()


def corrupt_job(rank: int, world: int, port: int, run: str, out: str) -> None:
    """A damaged chunk is caught by the rank reading it; every rank falls back to the previous snapshot."""
    from rl_ckpt.errors import CheckpointError, StorageError

    init(rank, world, port)
    model = shard(make_model(0), (world,))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = engine_for(run, rank, world)
    engine.register("policy", model)
    engine.register("optim", optim)
    train(model, optim, range(0, 2), rank)
    engine.save(1)
    at_step_1 = full_state(model, optim)
    train(model, optim, range(2, 4), rank)
    engine.save(2)

    # A save that fails on one rank fails on all, with the same error, and commits nothing.
    if rank == 1:
        write = engine.storage.write

        def failing(path, chunks, **kw):
            if path.endswith(".safetensors"):
                raise StorageError(f"injected write failure for {path}", path=path)
            return write(path, chunks, **kw)

        engine.storage.write = failing
    try:
        engine.save(3)
        raise AssertionError("save(3) should have failed on every rank")
    except CheckpointError as exc:
        msgs = [None] * world
        dist.all_gather_object(msgs, str(exc))
        assert "injected write failure" in msgs[0] and len(set(msgs[1:])) == 1, msgs
    assert not (Path(run) / "step_000000003").exists()
    if rank == 1:
        engine.storage.write = write

    # A rank whose state cannot even be staged: the others do not wait for it forever; all fail alike.
    class Unsaveable:
        def state_dict(self):
            return {"ids": {1, 2}}  # a set has no encoding

        def load_state_dict(self, state):
            pass

    if rank == 1:
        engine.register("extra", Unsaveable())
    try:
        engine.save(3)
        raise AssertionError("save(3) should have failed on every rank")
    except CheckpointError as exc:
        msgs = [None] * world
        dist.all_gather_object(msgs, str(exc))
        assert len(set(msgs)) == 1 and "rank 1: SerializationError" in msgs[0], msgs
    engine.close()

    dist.barrier()
    if rank == 0:  # damage one block of rank 1's part of the policy in step 2
        meta = json.loads((Path(run) / "step_000000002" / "meta.json").read_text())
        chunk = next(
            c for c in meta["components"]["policy"]["layout"]["tensors"]["0.weight"]["chunks"] if c["offsets"][0] > 0
        )
        f = Path(run) / "step_000000002" / chunk["file"]
        data = bytearray(f.read_bytes())
        data[chunk["start"] + 5] ^= 0x40
        f.write_bytes(bytes(data))
    dist.barrier()

    model2 = shard(make_model(9), (world,))
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    engine2 = engine_for(run, rank, world)
    engine2.register("policy", model2)
    engine2.register("optim", optim2)
    result = engine2.restore()
    assert result.snapshot_id == "step_000000001", result
    why = result.skipped["step_000000002"]
    assert "rank 1" in why and "checksum mismatch" in why and "0.weight" in why, why
    got = full_state(model2, optim2)
    for k, v in at_step_1.items():
        assert torch.equal(got[k], v), f"rank {rank}: {k} differs from step 1"
    engine2.close()
    dist.destroy_process_group()


class ManagedFSDPLearner:
    """A Ray actor: one FSDP2 rank in a gloo group, checkpointing through the CheckpointManager."""

    def __init__(
        self, base_dir: str, run_name: str, manager, rank: int, world: int, init_method: str, seed: int
    ) -> None:
        from rl_ckpt import CheckpointEngine

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        self.rank = rank
        self.model = shard(make_model(seed), (world,))
        self.optim = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.engine = CheckpointEngine(
            base_dir=base_dir, run_name=run_name, manager=manager, rank=rank, world_size=world, retention=False
        )
        self.engine.register("policy", self.model)
        self.engine.register("optim", self.optim)

    def train_and_save(self, steps: int, step: int) -> str:
        train(self.model, self.optim, range(steps), self.rank)
        return self.engine.save(step).snapshot_id

    def restore(self) -> str:
        return self.engine.restore().snapshot_id

    def full_state(self) -> dict:
        return {k: v.numpy() for k, v in full_state(self.model, self.optim).items()}


def global_batch_loss(model, step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of one global batch: the averaged gradient does not depend on the number of ranks."""
    rows = batch(step, 0)
    per = rows.shape[0] // world
    return model(rows[rank * per : (rank + 1) * per]).pow(2).mean()


def ray_train_loop(config: dict) -> None:
    """A Ray Train worker: FSDP2 over all workers, restore from the run (any earlier world size), train, save.

    With ``config["memory"]`` (the memory manager and service handles) the state goes through a ``MemoryTier``:
    each rank puts its own shards into memory every ``memory_interval_steps`` (each snapshot finished before
    training goes on), and the restore is across tiers. ``gather_at``: rank 0 also writes the gathered full state
    of that step to ``out + ".gathered"``. Rank 0 writes the final full state to ``out`` and where it restored
    from (world, step, tier, the plan's layout line) to ``out + ".json"``.
    """
    import ray.train
    from safetensors.torch import save_file

    from rl_ckpt import CheckpointEngine

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = shard(make_model(config["seed"]), (world,))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = CheckpointEngine(
        base_dir=config["base_dir"],
        run_name=config["run_name"],
        manager=config["manager"],
        retention=False,
        **config.get("cfg", {}),
    )
    tier = None
    if config.get("memory"):
        from rl_ckpt.integrations.memory_tier import MemoryTier

        tier = MemoryTier(engine, manager=config["memory"]["manager"], service=config["memory"]["service"])
    saver = tier or engine
    saver.register("policy", model)
    saver.register("optim", optim)
    reads = count_ranged_reads(tier.memory.storage) if tier is not None else {}
    result = saver.restore()
    start = result.global_step
    for step in range(start + 1, config["steps"] + 1):
        if step == config.get("die_at") and rank == world - 1:
            os.kill(os.getpid(), 9)  # a lost node: this worker vanishes mid-run
        optim.zero_grad()
        global_batch_loss(model, step, rank, world).backward()
        optim.step()
        if tier is not None:
            handle = tier.maybe_save(step)
            if handle is not None:
                handle.wait()  # which steps are in memory does not depend on machine load
        elif step in config["save_at"]:
            engine.save(step)
        if step == config.get("gather_at"):
            gathered = full_state(model, optim)
            if rank == 0:
                save_file(gathered, config["out"] + ".gathered")
    full = full_state(model, optim)
    if rank == 0:
        save_file(full, config["out"])
        Path(config["out"] + ".json").write_text(
            json.dumps(
                {
                    "world": world,
                    "restored_from": start,
                    "snapshot": result.snapshot_id,
                    "tier": tier.tier_restored if tier is not None else None,
                    "layout": result.plan.layout if result.plan is not None else "",
                    "reason": result.warnings[0] if tier is not None and result.warnings else "",
                    "ranged_reads": reads,
                }
            )
        )
    saver.close()
