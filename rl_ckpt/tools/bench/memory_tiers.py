"""Restore from the memory tier vs from each durable tier, at several sizes (part of ``rl_ckpt.tools.bench.memory``).

For each size: an MLP + Adam state of about that many bytes (the weights and both moments), saved once as a
memory snapshot, once to local disk and once to S3 (moto's server on 127.0.0.1, in a process of its own: the
loopback endpoint the fault suite uses). Then ``--repeat`` rounds, each timing ``engine.restore`` of the same
state (every file verified, loaded into the module and the optimizer) from:

- memory: the run's ``raymem://`` stores (one participant, one node), inside one read session of the stores as
  ``MemoryTier.restore`` reads (``RayMemoryStorage.read_session``); also without one (``memory_no_session``);
- local disk, warm: the snapshot's pages in the page cache (just read);
- local disk, cold: its pages dropped first (``--cache``);
- S3: the loopback endpoint;
- Ray's floor (``ray_floor``): no restore, only the least any memory read pays in Ray round trips: one call to
  this node's store answering the snapshot's files and the mapping of the objects it names. ``floor/disk_warm``
  is what a memory restore would be against warm disk if it paid nothing but that over the disk restore.

The medians and their ratios are printed next to issue #23's goals: memory <= 1.0x warm disk at 1 MiB; at
256 MiB and more, memory <= 0.5x cold disk and <= 1.0x warm disk. Also counted (not timed): the calls to the
memory stores that one restore makes (listings of the cluster's stores, calls to a store), with and without a
read session.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
import uuid

from rl_ckpt.tools.bench.common import CacheDropper, human, log, parse_size, rmtree

GOALS = {"small": {"warm": 1.0}, "large": {"cold": 0.5, "warm": 1.0}}
LARGE = 256 << 20  # from this size the "large" goals apply


def mlp_state(nbytes: int, seed: int = 0):
    """An MLP and its Adam (one step taken, so both moments exist) holding about ``nbytes`` in all."""
    import torch

    torch.manual_seed(seed)
    params = max(nbytes // 12, 64)  # float32 weights + Adam's two moments
    width = 1024 if params >= (8 << 20) else 256 if params >= (1 << 18) else 64
    layers = max(1, params // (width * width + width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optim.step()
    return model, optim


def calls_of(storage, restore) -> dict:
    """The Ray round trips one ``restore()`` makes to the memory stores: listings of the cluster's stores and calls
    to a store (``RayMemoryStorage.calls``)."""
    before = dict(storage.calls)
    restore()
    return {k: storage.calls[k] - before[k] for k in before}


def _engine(base_dir: str, run: str, model, optim, storage_options: dict | None = None):
    from rl_ckpt import CheckpointEngine

    engine = CheckpointEngine(
        base_dir=base_dir,
        run_name=run,
        keep_latest=2,
        keep_best=0,
        post_load_check=False,
        memory_replicas=0,
        storage_options=storage_options or {},
    )
    engine.register("model", model)
    engine.register("optim", optim)
    return engine


def compare_size(nbytes: int, base: str, s3, repeat: int, cache: CacheDropper) -> dict:
    """The figures of one size (see the module docstring)."""
    from rl_ckpt.integrations.memory_tier import MemoryTier

    model, optim = mlp_state(nbytes)
    run = f"tiers-{uuid.uuid4().hex[:6]}"
    disk = _engine(base, run, model, optim)
    tier = MemoryTier(disk)
    tier.memory.register("model", model)
    tier.memory.register("optim", optim)
    tier.save(1).wait()
    disk.save(1)
    bucket = s3.bucket()
    remote = _engine(f"s3://{bucket}", run, model, optim, s3.options)
    remote.save(1)
    state_bytes = disk.snapshots()[-1].size_bytes
    mem = tier.memory.storage

    def memory_restore():  # as MemoryTier.restore reads: inside one read session of the stores
        with mem.read_session():
            return tier.memory.restore(snapshot_id="step_000000001")

    def ray_floor():  # the least a memory read costs: one call to this node's store naming the snapshot's files
        import ray  # (a view: small files inline, refs to the rest) and the mapping of what it names; no engine

        from actors._memory.view import VIEW_INLINE_BYTES, VIEW_REFS

        answer = ray.get(mem.store_of(mem.node_id).view.remote("", VIEW_INLINE_BYTES, VIEW_REFS))
        ray.get([got[0] for got in answer["data"].values() if isinstance(got, list)])

    def memory_restore_no_session():  # every listing, stat and read asks the stores (engine.restore opens none)
        mem.read_session = contextlib.nullcontext
        try:
            return tier.memory.restore(snapshot_id="step_000000001")
        finally:
            del mem.read_session

    restores = {
        "memory": memory_restore,
        "memory_no_session": memory_restore_no_session,
        "disk_warm": lambda: disk.restore(snapshot_id="step_000000001"),
        "disk_cold": lambda: disk.restore(snapshot_id="step_000000001"),
        "s3": lambda: remote.restore(snapshot_id="step_000000001"),
        "ray_floor": ray_floor,
    }
    runs: dict[str, list[float]] = {k: [] for k in restores}
    run_dir = os.path.join(base, run)
    try:
        for i in range(repeat + 1):  # the first round warms every path up (imports, first allocations): not counted
            for name, restore in restores.items():
                if name == "disk_warm":
                    disk.restore(snapshot_id="step_000000001")  # its pages now in the page cache
                if name == "disk_cold":
                    cache.drop(run_dir)
                started = time.perf_counter()
                restore()
                if i:
                    runs[name].append(time.perf_counter() - started)
        calls = calls_of(mem, restores["memory"])
        calls_no_session = calls_of(mem, restores["memory_no_session"])
    finally:
        tier.close()
        remote.close()
        mem.destroy()
        s3.drop_bucket(bucket)
        rmtree(run_dir)
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratios = {f"memory/{k}": med["memory"] / med[k] for k in ("disk_warm", "disk_cold", "s3")}
    ratios["memory_no_session/disk_warm"] = med["memory_no_session"] / med["disk_warm"]
    # What Ray's round trips alone allow: the warm disk restore plus the floor of one store call and a mapping.
    ratios["floor/disk_warm"] = (med["disk_warm"] + med["ray_floor"]) / med["disk_warm"]
    goals = GOALS["large" if nbytes >= LARGE else "small"]
    verdict = {f"memory/disk_{k} <= {v}": ratios[f"memory/disk_{k}"] <= v for k, v in goals.items()}
    return {
        "bytes": state_bytes,
        "restore_s": med,
        "runs": runs,
        "ratios": ratios,
        "goals": verdict,
        "memory_restore_calls": calls,
        "memory_restore_calls_no_session": calls_no_session,
    }


def run_tiers(sizes: list[str], base: str, repeat: int, cache: CacheDropper) -> dict:
    """``compare_size`` for each of ``sizes``; logs a table line per size."""
    from rl_ckpt.tools.fault_suite.targets import S3Endpoint

    s3 = S3Endpoint()
    out = {}
    try:
        for text in sizes:
            got = compare_size(parse_size(text), base, s3, repeat, cache)
            out[text] = got
            t, r = got["restore_s"], got["ratios"]
            log(
                f"restore of {human(got['bytes'])} (MLP + Adam, medians of {repeat}): memory {t['memory']:.4f} s, "
                f"disk warm {t['disk_warm']:.4f} s, disk cold {t['disk_cold']:.4f} s, S3 loopback {t['s3']:.4f} s; "
                f"memory/warm {r['memory/disk_warm']:.2f}x, memory/cold {r['memory/disk_cold']:.2f}x, "
                f"memory/S3 {r['memory/s3']:.2f}x; Ray's floor (one store call + mapping, no engine) "
                f"{1000 * t['ray_floor']:.1f} ms: a restore that paid only it over warm disk would be "
                f"{r['floor/disk_warm']:.2f}x; goals: "
                + ", ".join(f"{k} {'met' if ok else 'NOT met'}" for k, ok in got["goals"].items())
                + f"; one memory restore made {got['memory_restore_calls']}; without a read session it takes "
                f"{t['memory_no_session']:.4f} s ({r['memory_no_session/disk_warm']:.2f}x warm disk) and makes "
                f"{got['memory_restore_calls_no_session']}"
            )
    finally:
        s3.close()
    return out
