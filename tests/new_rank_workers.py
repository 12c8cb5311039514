"""Rank bodies for the new-rank tests: FSDP2 on CPU/gloo, saved by 2 ranks, restored on 3.

Each function runs in one spawned rank (``torch.multiprocessing.spawn``); an assertion error in any
rank fails the test. What the test checks goes to JSON files in ``out``.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import sharded_workers as w


class RankBuffer:
    """A per-rank replay buffer stand-in: a list of ints."""

    checkpoint_kind = "buffer"

    def __init__(self) -> None:
        self.items: list[int] = []

    def state_dict(self) -> dict:
        return {"items": list(self.items)}

    def load_state_dict(self, state: dict) -> None:
        self.items = list(state["items"])


def rng_fingerprint(explore: np.random.Generator) -> str:
    """Every stream's state: Python, NumPy legacy, torch CPU and a named NumPy generator."""
    h = hashlib.sha256(repr(random.getstate()).encode())
    h.update(np.random.get_state(legacy=True)[1].tobytes())
    h.update(torch.get_rng_state().numpy().tobytes())
    h.update(json.dumps(explore.bit_generator.state, sort_keys=True).encode())
    return h.hexdigest()


def learner(run: str, rank: int, world: int, **cfg):
    """A fresh FSDP2 learner registering policy, optimizer, RNG (with a named generator) and a buffer."""
    from rl_ckpt import RNGState

    model = w.shard(w.make_model(rank + 40), (world,))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    explore = np.random.default_rng(1000 + rank)
    buffer = RankBuffer()
    engine = w.engine_for(run, rank, world, **cfg)
    engine.register("policy", model)
    engine.register("optim", optim)
    engine.register("rng", RNGState(numpy_generators={"explore": explore}))
    engine.register("replay_buffer", buffer)
    return engine, model, optim, explore, buffer


def two_then_three(rank: int, port_two: int, port_three: int, run: str, out: str) -> None:
    """Ranks 0 and 1 save as a group of two; then all three (a new process group) restore. One spawn, not two:
    starting the processes is most of the cost."""
    if rank < 2:
        save_two(rank, 2, port_two, run, out)
    restore_three(rank, 3, port_three, run, out)


def save_two(rank: int, world: int, port: int, run: str, out: str) -> None:
    """Two ranks train 2 steps with rank-seeded streams and per-rank buffers, then save step 2."""
    w.init(rank, world, port)
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    engine, model, optim, explore, buffer = learner(run, rank, world)
    w.train(model, optim, range(2), rank)
    buffer.items = [rank * 100 + i for i in range(3)]
    explore.random(5)
    engine.save(2)
    Path(out, f"saved_{rank}.json").write_text(json.dumps({"rng": rng_fingerprint(explore), "items": buffer.items}))
    engine.close()
    dist.destroy_process_group()


def gather(value) -> list:
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, value)
    return got


def restore_three(rank: int, world: int, port: int, run: str, out: str) -> None:
    """Three ranks restore the 2-rank snapshot under each ``new_rank_state``."""
    from rl_ckpt.errors import CheckpointError, StateMismatchError

    w.init(rank, world, port)
    saved = [json.loads(Path(out, f"saved_{r}.json").read_text()) for r in range(2)]
    report: dict = {}
    derived = []
    for attempt in range(2):  # the same restore twice derives the same streams
        torch.manual_seed(77)
        engine, model, optim, explore, buffer = learner(run, rank, world)
        plan = engine.plan_recovery(deep=False)
        result = engine.restore(plan)
        assert result.global_step == 2, result
        derived.append(rng_fingerprint(explore))
        report["derive_plan"] = str(plan)
        report["derive_items"] = buffer.items
        engine.close()
    assert derived[0] == derived[1], "a repeated restore derived other streams"
    everyone = gather(derived[0])
    report["derive_rng"] = everyone
    if rank < 2:  # the ranks that existed at save get exactly their own streams and buffer back
        assert derived[0] == saved[rank]["rng"] and report["derive_items"] == saved[rank]["items"]
    else:
        assert report["derive_items"] == [], report["derive_items"]
    assert len(set(everyone)) == world, "the new rank's streams repeat another rank's"

    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    engine, model, optim, explore, buffer = learner(run, rank, world, new_rank_state="empty")
    before = rng_fingerprint(explore)
    plan = engine.plan_recovery(deep=False)
    engine.restore(plan)
    report["empty_plan"] = str(plan)
    after = rng_fingerprint(explore)
    assert (after == saved[rank]["rng"]) if rank < 2 else (after == before and buffer.items == []), rank
    engine.close()

    engine, *_ = learner(run, rank, world, new_rank_state="error")
    report["error_plan"] = str(engine.plan_recovery(deep=False))
    try:
        engine.restore()
        raise AssertionError("new_rank_state='error' restored")
    except StateMismatchError as exc:  # the new ranks
        report["error"] = [type(exc).__name__, str(exc)]
    except CheckpointError as exc:  # the others: another rank could not load
        report["error"] = [type(exc).__name__, str(exc)]
    engine.close()
    Path(out, f"restored_{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def ray_train_loop(config: dict) -> None:
    """A Ray Train worker (FSDP2 over all workers, a manager): restore, then a group of 2 trains 3 steps and saves
    step 3; a larger group (the elastic run) writes what each rank restored and, rank 0, the plan."""
    import ray.train

    from rl_ckpt import CheckpointEngine, RNGState

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(500 + rank)
    model = w.shard(w.make_model(rank), (world,))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    explore = np.random.default_rng(2000 + rank)
    buffer = RankBuffer()
    engine = CheckpointEngine(
        base_dir=config["base_dir"], run_name=config["run_name"], manager=config["manager"], retention=False
    )
    for name, obj in (
        ("policy", model),
        ("optim", optim),
        ("rng", RNGState(numpy_generators={"explore": explore})),
        ("replay_buffer", buffer),
    ):
        engine.register(name, obj)
    plan = engine.plan_recovery()
    result = engine.restore(plan)
    out = Path(config["out"])
    if world == 2:
        for step in range(1, 4):
            optim.zero_grad()
            w.global_batch_loss(model, step, rank, world).backward()
            optim.step()
            buffer.items.append(rank * 100 + step)
            explore.random(3)
        engine.save(3)
        (out / f"saved_{rank}.json").write_text(json.dumps({"rng": rng_fingerprint(explore), "items": buffer.items}))
    else:
        (out / f"restored_{rank}.json").write_text(
            json.dumps(
                {
                    "world": world,
                    "snapshot": result.snapshot_id,
                    "step": result.global_step,
                    "plan": str(plan),
                    "rng": rng_fingerprint(explore),
                    "items": buffer.items,
                }
            )
        )
    engine.close()
