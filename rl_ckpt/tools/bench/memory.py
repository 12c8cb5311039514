"""The memory tier's figures, in one run on a local Ray cluster (``python -m rl_ckpt.tools.bench.memory``).

For a state of ``--size`` bytes (default 1 GiB, one participant):

- restore: from the memory tier vs from local disk with a cold page cache (the same engine code, the same
  verified reads; only the storage differs). Memory is measured two ways: ``engine.restore`` (the restorer
  asks for writable tensors, so each file is copied once out of the object store, hashed as it is copied)
  and the zero-copy load (``load_component(readonly_ok=True)``: the store's shared memory is hashed in place
  and decoded read-only, then ``load_state_dict`` copies it into the state: one copy in all);
- cold page cache: the files' pages are dropped before every disk read, and the bench checks with
  ``mincore`` that none of the snapshot's pages stayed resident (the figure says how many did);
- blocking: how long the trainer is blocked by a memory snapshot vs by a durable ``save_async`` (median of
  ``--repeat``, after one save of each that allocates its staging buffers; the two alternate who goes first);
- death to first step: a trainer actor force-killed (``ray.kill``) and restarted by Ray (``max_restarts=1``): the
  time from the kill until the restarted process finished its first training step after restoring, with the memory
  tier and without it (durable storage, cold page cache), split into its phases: Ray restarting the process, the
  engines opening the run, the restore, the first step.

- memory vs each durable tier (``--tiers``, default 1 MiB and 256 MiB; ``--only-tiers`` runs just these): an MLP +
  Adam state restored from memory, from local disk warm and cold, and from S3 on a loopback endpoint, with the
  ratios against issue #23's goals (``rl_ckpt.tools.bench.memory_tiers``).

Prints the figures and writes them as JSON (``--json``). Needs a machine with room for a few copies of the
state in memory (the trainer's, the store's, the object store's while in flight).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid

from rl_ckpt.tools.bench.common import CacheDropper, human, log, parse_size, print_json, rmtree


def weights(nbytes: int, seed: int = 0):
    """The whole training state: a module holding one big float32 tensor (``w``, a buffer)."""
    import torch

    class Weights(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("w", torch.arange(nbytes // 4, dtype=torch.float32).mul_(1e-3).add_(seed))

        def step(self) -> None:
            self.w[:1024].add_(1.0)

    return Weights()


def _engines(durable_dir: str, run: str, nbytes: int, tier: bool, state=None):
    from rl_ckpt import CheckpointEngine

    cfg = dict(keep_latest=2, keep_best=0, post_load_check=False, memory_replicas=0)
    engine = CheckpointEngine(base_dir=durable_dir, run_name=run, **cfg)
    state = weights(nbytes) if state is None else state
    if not tier:
        engine.register("weights", state)
        return engine, None, state
    from rl_ckpt.integrations.memory_tier import MemoryTier

    t = MemoryTier(engine)
    t.register("weights", state)
    return engine, t, state


def resident_fraction(root: str) -> float:
    """The fraction of the pages of the files under ``root`` that are in the page cache (``mincore``)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    files = [root] if os.path.isfile(root) else [os.path.join(r, n) for r, _d, fs in os.walk(root) for n in fs]
    page = os.sysconf("SC_PAGE_SIZE")
    total = resident = 0
    for name in files:
        size = os.path.getsize(name)
        if not size:
            continue
        fd = os.open(name, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED: maps, reads nothing
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap failed on {name}")
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore failed on {name}")
                total += pages
                resident += sum(v & 1 for v in vec)
            finally:
                libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


class Trainer:
    """A trainer actor for the death-to-first-step figure: restores in its constructor, then trains a step."""

    def __init__(self, durable_dir: str, run: str, nbytes: int, tier: bool, out: str) -> None:
        started = time.time()
        state = weights(nbytes)
        built = time.time()
        self.engine, self.tier, self.state = _engines(durable_dir, run, nbytes, tier, state)
        opened = time.time()
        result = self.tier.restore() if self.tier is not None else self.engine.restore()
        restored = time.time()
        self.state.step()
        with open(out, "a") as f:
            f.write(
                json.dumps(
                    {
                        "pid": os.getpid(),
                        "started_at": started,
                        "built_at": built,
                        "opened_at": opened,
                        "restored_at": restored,
                        "first_step_at": time.time(),
                        "restored": result.snapshot_id,
                        "tier": getattr(self.tier, "tier_restored", None),
                    }
                )
                + "\n"
            )

    def save(self, step: int) -> float:
        handle = self.tier.save(step) if self.tier is not None else self.engine.save_async(step)
        handle.wait()
        return handle.stage_seconds

    def pid(self) -> int:
        return os.getpid()


def run(args) -> dict:
    import ray

    nbytes = parse_size(args.size)
    base = tempfile.mkdtemp(prefix="rl-ckpt-membench-", dir=args.dir)
    cache = CacheDropper(args.cache)
    out: dict = {"bytes": nbytes, "cache": cache.note, "repeat": args.repeat}
    tier_sizes = [t for t in args.tiers.split(",") if t.strip()] if args.tiers else []
    if not ray.is_initialized():
        # The stores keep two snapshots in the object store, plus one in flight: room for five, so that
        # nothing is spilled to disk (a spilled object would make a memory read a disk read).
        largest = max([0 if args.only_tiers else nbytes] + [parse_size(t) for t in tier_sizes])
        store_bytes = max(5 * largest, 1 << 30)
        out["object_store_bytes"] = store_bytes
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            logging_level="ERROR",
            namespace="rl_ckpt_bench",
            object_store_memory=store_bytes,
        )
    run_name = f"bench-{uuid.uuid4().hex[:6]}"
    if tier_sizes:
        from rl_ckpt.tools.bench.memory_tiers import run_tiers

        out["tiers"] = run_tiers(tier_sizes, base, args.repeat, cache)
    if args.only_tiers:
        rmtree(base)
        return out
    try:
        # -- blocking time and restore, in this process ------------------------------------------------------
        engine, tier, state = _engines(base, run_name, nbytes, True)
        mem_block, disk_block = [], []
        saves = {"memory": (tier.save, mem_block), "durable": (engine.save_async, disk_block)}
        step = 0
        for i in range(args.repeat + 1):  # the first save of each allocates its staging buffers: not counted
            for kind in ("memory", "durable") if i % 2 else ("durable", "memory"):  # alternate who goes first
                step += 1
                save, times = saves[kind]
                h = save(step)
                h.wait()
                if i:
                    times.append(h.stage_seconds)
        # Both stage into buffers allocated by their first save and reused since: the same code blocks.
        out["blocking_s"] = {
            "memory_snapshot": statistics.median(mem_block),
            "durable_save_async": statistics.median(disk_block),
            "memory_snapshot_runs": mem_block,
            "durable_save_async_runs": disk_block,
        }
        log(
            f"blocking: memory snapshot {out['blocking_s']['memory_snapshot']:.3f} s, durable save_async "
            f"{out['blocking_s']['durable_save_async']:.3f} s"
        )
        from rl_ckpt._core.reader import load_component

        mem_restore, mem_zero_copy, disk_restore, resident = [], [], [], []
        newest_disk = engine.snapshots()[-1].snapshot_id
        newest_mem = tier.memory.snapshots()[-1].snapshot_id
        mem_manifest = tier.memory.catalog.get(newest_mem).manifest
        disk_run = os.path.join(base, run_name)
        for _ in range(args.repeat):
            started = time.perf_counter()
            tier.memory.restore(snapshot_id=newest_mem)
            mem_restore.append(time.perf_counter() - started)
            started = time.perf_counter()
            loaded = load_component(tier.memory.storage, mem_manifest, "weights", readonly_ok=True)
            state.load_state_dict(loaded)  # the one copy: the store's shared memory into the state
            mem_zero_copy.append(time.perf_counter() - started)
            del loaded
            cache.drop(disk_run)
            resident.append(resident_fraction(disk_run))
            started = time.perf_counter()
            engine.restore(snapshot_id=newest_disk)
            disk_restore.append(time.perf_counter() - started)
        out["cache_check"] = (
            f"after each drop, {max(resident):.2%} of the durable run's file pages were still resident (mincore)"
        )
        out["restore_s"] = {
            "memory_engine_restore": statistics.median(mem_restore),
            "memory_zero_copy_load": statistics.median(mem_zero_copy),
            "disk_cold": statistics.median(disk_restore),
            "runs": {
                "memory_engine_restore": mem_restore,
                "memory_zero_copy_load": mem_zero_copy,
                "disk_cold": disk_restore,
            },
        }
        disk = out["restore_s"]["disk_cold"]
        out["restore_ratio"] = {
            "engine_restore": out["restore_s"]["memory_engine_restore"] / disk,
            "zero_copy_load": out["restore_s"]["memory_zero_copy_load"] / disk,
        }
        for key, label in (
            ("memory_engine_restore", "memory (engine.restore)"),
            ("memory_zero_copy_load", "memory (zero-copy load)"),
        ):
            took = out["restore_s"][key]
            log(f"restore: {label} {took:.3f} s ({human(nbytes / took)}/s), ratio to disk cold {took / disk:.2f}")
        log(f"restore: disk cold {disk:.3f} s ({human(nbytes / disk)}/s); {out['cache_check']}")
        memory_storage = tier.memory.storage
        tier.close()
        memory_storage.destroy()  # frees its snapshots before the trainer actors need the memory
        del state, engine, tier, memory_storage

        # -- death to first step, with and without the memory tier -----------------------------------------
        out["death_to_first_step_s"] = {}
        for with_tier in (True, False):
            name = f"{run_name}-{'mem' if with_tier else 'disk'}"
            marks = os.path.join(base, f"{name}.jsonl")
            actor = ray.remote(num_cpus=0, max_restarts=1, max_task_retries=-1)(Trainer).remote(
                base, name, nbytes, with_tier, marks
            )
            ray.get(actor.save.remote(1))
            first_pid = ray.get(actor.pid.remote())
            if not with_tier:
                cache.drop(os.path.join(base, name))
            killed_at = time.time()
            ray.kill(actor, no_restart=False)  # the process is killed at once; Ray restarts it (max_restarts=1)
            # The restarted process answers only once its constructor (restore + first step) has finished.
            while ray.get(actor.pid.remote()) == first_pid:
                time.sleep(0.05)
            with open(marks) as f:
                last = json.loads(f.read().splitlines()[-1])
            key = "memory_tier" if with_tier else "durable_only"
            out["death_to_first_step_s"][key] = last["first_step_at"] - killed_at
            out["death_to_first_step_s"][key + "_restored"] = f"{last['restored']} ({last['tier'] or 'durable'})"
            out["death_to_first_step_s"][key + "_phases"] = phases = {
                "ray_restart_to_constructor": last["started_at"] - killed_at,
                "build_state": last["built_at"] - last["started_at"],
                "open_engines": last["opened_at"] - last["built_at"],
                "restore": last["restored_at"] - last["opened_at"],
                "first_step": last["first_step_at"] - last["restored_at"],
            }
            log(
                f"death to first step ({key}): {out['death_to_first_step_s'][key]:.2f} s, restored {last['restored']}; "
                + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
            )
            ray.kill(actor, no_restart=True)
        from rl_ckpt._storage import open_storage

        open_storage(f"raymem://mem/{run_name}-mem", {"replicas": 0}).destroy()
    finally:
        rmtree(base)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_ckpt.tools.bench.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB", help="bytes of state per participant (default 1GiB)")
    parser.add_argument("--dir", default=None, help="local folder for the durable snapshots (default: the temp dir)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure (the median is reported)")
    parser.add_argument(
        "--cache",
        choices=("drop", "fadvise", "none"),
        default="drop",
        help="how disk reads are made cold (drop_caches where allowed, else fadvise)",
    )
    parser.add_argument(
        "--tiers",
        default="1MiB,256MiB",
        help="sizes (comma-separated) at which memory is compared with warm and cold local disk and S3 "
        "on a loopback endpoint (default 1MiB,256MiB; '' to skip)",
    )
    parser.add_argument("--only-tiers", action="store_true", help="run only the --tiers comparison")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    print_json(run(args), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
