"""``--scaling``: how save/restore scale with the state size and the catalog with the snapshot count."""

from __future__ import annotations

import gc
import os
import random
import time

from rl_ckpt.tools.bench.baselines import time_raw_floor
from rl_ckpt.tools.bench.common import (
    BenchUsageError,
    CacheDropper,
    DEFAULT_COUNTS,
    DEFAULT_SIZES,
    Samples,
    human,
    log,
    parse_size,
    quiesce,
    rmtree,
)
from rl_ckpt.tools.bench.compare import clear_run, bench_engine
from rl_ckpt.tools.bench.state import build_state, byte_views, flat_tensors, nbytes


def run_scaling(args, workdir: str, cache: CacheDropper) -> dict:
    sizes = [s for s in (args.sizes or DEFAULT_SIZES).split(",") if s.strip()]
    counts = sorted({int(c) for c in (args.counts or DEFAULT_COUNTS).split(",") if c.strip()})
    if not counts or counts[0] < 1:
        raise BenchUsageError("--counts: positive integers, e.g. 1,10,100")
    size_rows = [scale_size(args, workdir, cache, s) for s in sizes]
    catalog_rows = scale_catalog(args, workdir, cache, counts)
    return {"sizes": size_rows, "catalog": catalog_rows}


def scale_size(args, workdir: str, cache: CacheDropper, size_text: str) -> dict:
    size = parse_size(size_text)
    log(f"scaling: {human(size)} state ...")
    model, opt, shape = build_state(size, args.tensors)
    tensors = list(flat_tensors(model, opt).values())
    total = nbytes(tensors)
    views = byte_views(tensors)
    sm = Samples()
    step = iter(range(1, 10**9))
    run = f"scale-{size}"
    rl = bench_engine(workdir, run)
    rl.register("policy", model)
    rl.register("optimizer", opt)
    h = rl.save_async(next(step))  # warm-up: allocates the staging buffers
    h.wait()
    clear_run(rl)
    path = os.path.join(workdir, f"raw-{size}.bin")

    def floor() -> None:
        time_raw_floor(sm, cache, path, views)
        clones = sm.timed("clone", lambda: [t.clone() for t in tensors])
        del clones

    def ours() -> None:
        sm.timed("rl_save", lambda: rl.save(next(step)))
        cache.drop(rl.storage.root)
        sm.timed("rl_restore", lambda: rl.restore())
        clear_run(rl)
        quiesce()
        t0 = time.perf_counter()
        handle = rl.save_async(next(step))
        sm.add("rl_async_block", time.perf_counter() - t0, None)
        handle.wait()
        clear_run(rl)

    for r in range(args.repeat):
        for g in (floor, ours) if r % 2 == 0 else (ours, floor):
            g()
    rl.close()
    rmtree(os.path.join(workdir, run))
    res = {
        k: sm.result(k, total) for k in ("raw_write", "raw_read", "clone", "rl_save", "rl_restore", "rl_async_block")
    }
    m = sm.median
    row = {
        "size_request": size,
        "state_bytes": total,
        "tensors": len(tensors),
        "shape": shape,
        "results": res,
        "save_vs_raw": m("rl_save") / m("raw_write"),
        "restore_vs_raw": m("rl_restore") / m("raw_read"),
        "block_vs_clone": m("rl_async_block") / m("clone"),
    }
    model = opt = tensors = views = rl = None  # drops the state (floor/ours capture part of it) before gc.collect()
    gc.collect()
    return row


def scale_catalog(args, workdir: str, cache: CacheDropper, counts: list[int]) -> list[dict]:
    import torch

    from rl_ckpt._run.retention import plan_retention

    e = bench_engine(workdir, "catalog", verify_after_write=False)
    e.register("policy", torch.nn.Linear(4, 4))
    rng = random.Random(0)
    made = 0
    rows = []
    for count in counts:
        log(f"scaling: creating snapshots {made + 1}..{count} (tiny state, verify_after_write=False) ...")
        t0 = time.perf_counter()
        first = made
        while made < count:
            made += 1
            e.save(made, metrics={"avg_reward": rng.random()})
        create_s = time.perf_counter() - t0
        sm = Samples()
        policy = e.retention or _default_policy(e)
        for _ in range(args.repeat):
            sm.timed("snapshots", e.snapshots)
            sm.timed("refresh", e.catalog.refresh)
            plan = sm.timed("plan_recovery", lambda: e.plan_recovery(deep=False))
            snaps = e.snapshots()
            sm.timed("retention", lambda: plan_retention(snaps, policy))
        if plan.target is None or len(e.snapshots()) != count:
            raise RuntimeError(f"catalog scaling: expected {count} snapshots, plan target {plan.target}")
        for _ in range(args.repeat):  # a restarted process: its first listing parses every manifest
            fresh = bench_engine(workdir, "catalog", verify_after_write=False)
            sm.timed("open", fresh.snapshots)
            fresh.close()
        cache.drop(e.storage.root)
        fresh = bench_engine(workdir, "catalog", verify_after_write=False)
        sm.timed("plan_recovery_cold", lambda: fresh.plan_recovery(deep=False))
        fresh.close()
        m = sm.median
        rows.append(
            {
                "count": count,
                "create_s": create_s,
                "created": count - first,
                "create_per_s": (count - first) / create_s if create_s else None,
                "snapshots_s": m("snapshots"),
                "refresh_s": m("refresh"),
                "plan_recovery_s": m("plan_recovery"),
                "plan_recovery_cold_s": m("plan_recovery_cold"),
                "retention_s": m("retention"),
                "open_s": m("open"),
                "per_snapshot_us": {
                    k: m(k) / count * 1e6 for k in ("snapshots", "refresh", "plan_recovery", "retention", "open")
                },
            }
        )
    e.close()
    rmtree(os.path.join(workdir, "catalog"))
    return rows


def _default_policy(engine):
    from rl_ckpt._run.retention import policy_from_config

    return policy_from_config(engine.config)
