"""The default run: rl_ckpt next to the floor and its peers, round-robin over the repeats; the goals."""

from __future__ import annotations

import os
import statistics
import time

from rl_ckpt.tools.bench.baselines import (
    quiet_dcp,
    dcp_async_save,
    dcp_load,
    dcp_save,
    hash_all,
    st_save,
    time_raw_floor,
    torch_save,
)
from rl_ckpt.tools.bench.common import (
    CacheDropper,
    CpuMeter,
    HASH_ALGOS,
    PAIRED,
    RATIOS,
    RESULT_KEYS,
    Samples,
    human,
    log,
    parse_size,
    quiesce,
    rmtree,
    tree_bytes,
)
from rl_ckpt.tools.bench.state import (
    build_state,
    byte_views,
    flat_tensors,
    mutate_quarter,
    nbytes,
    size_mix,
    state_dict_of,
)


def bench_engine(workdir: str, run: str, **kw):
    """A CheckpointEngine for the bench run ``run`` under ``workdir`` (config keys in ``kw``)."""
    from rl_ckpt._core.engine import CheckpointEngine

    return CheckpointEngine(base_dir=workdir, run_name=run, retention=False, **kw)


def clear_run(engine) -> None:
    """Delete every snapshot of a bench engine's run (outside the timings)."""
    root = engine.storage.root
    for name in os.listdir(root):
        rmtree(os.path.join(root, name))
    engine.catalog.refresh()


def run_compare(args, workdir: str, cache: CacheDropper) -> dict:
    import torch

    quiet_dcp()
    size = parse_size(args.size)
    log(f"bench: building a {human(size)} model + Adam state ...")
    model, opt, shape = build_state(size, args.tensors)
    flat = flat_tensors(model, opt)
    tensors = list(flat.values())
    total = nbytes(tensors)
    views = byte_views(tensors)
    state = {
        "bytes": total,
        "tensors": len(tensors),
        "param_bytes": nbytes(model.state_dict().values()),
        "mix": size_mix(tensors),
        "shape": shape,
        "size_request": size,
    }
    log(f"bench: state {human(total)} in {len(tensors)} tensors; {args.repeat} repeat(s); cache: {cache.method}")

    sm = Samples()
    step = iter(range(1, 10**9))
    rl = bench_engine(workdir, "rl")
    rl.register("policy", model)
    rl.register("optimizer", opt)
    rl_async = bench_engine(workdir, "rl_async")
    rl_async.register("policy", model)
    rl_async.register("optimizer", opt)
    variants = {}
    if args.variants:
        for key, kw in (
            ("rl_save_sha256", {"checksum_algo": "sha256"}),
            ("rl_save_blake3", {"checksum_algo": "blake3"}),
            ("rl_save_noverify", {"verify_after_write": False}),
        ):
            e = bench_engine(workdir, key, **kw)
            e.register("policy", model)
            e.register("optimizer", opt)
            variants[key] = e
    # The first save_async allocates the staging buffers (once per engine); later ones reuse them.
    log("bench: warm-up save_async (allocates staging buffers; not counted) ...")
    h = rl_async.save_async(next(step))
    first_block = h.stage_seconds
    h.wait()
    clear_run(rl_async)
    dedup_info = {"changed_bytes": [], "first_bytes_added": [], "second_bytes_added": []}
    d = lambda *p: os.path.join(workdir, *p)  # noqa: E731

    targets = [t.clone() for t in tensors]  # the memcpy floor's destinations: allocated and touched once, reused
    breakdown: dict[str, list[float]] = {}

    def io_raw(r: int) -> None:
        time_raw_floor(sm, cache, d(f"raw-{r}.bin"), views)
        sm.timed("memcpy", lambda: [t.copy_(src) for t, src in zip(targets, tensors)])
        clones = sm.timed("clone", lambda: [t.clone() for t in tensors])
        del clones

    def io_torch(r: int) -> None:
        path = d(f"torch-{r}.pt")
        sm.timed("torch_save", lambda: torch_save(path, state_dict_of(model, opt)))
        cache.drop(path)
        # The torch.load peer the issue asks for: it reads back the file torch.save wrote a moment ago in this
        # run (weights_only: tensors and containers only). No rl_ckpt checkpoint is ever passed to torch.load.
        loaded = sm.timed("torch_load", lambda: torch.load(path, weights_only=True))
        del loaded
        cache.drop(path)

        def load_apply() -> None:  # into the existing model and optimizer (built before: not timed)
            loaded = torch.load(path, weights_only=True)
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optim"])

        sm.timed("torch_load_apply", load_apply)
        rmtree(path)

    def io_rl(r: int) -> None:
        info = sm.timed("rl_save", lambda: rl.save(next(step)))
        cache.drop(rl.storage.root)
        res = sm.timed("rl_restore", lambda: rl.restore())
        if res.snapshot_id != info.snapshot_id:
            raise RuntimeError(f"restore chose {res.snapshot_id}, expected {info.snapshot_id}")
        for phase, seconds in res.timings.items():
            breakdown.setdefault(phase, []).append(seconds)
        clear_run(rl)

    def g_io(r: int) -> None:
        """The floor, torch and rl_ckpt back to back (their order rotates per repeat): each restore is paired
        with the floor and the peer measured in the same minute."""
        steps = [io_raw, io_torch, io_rl]
        for fn in steps[r % 3 :] + steps[: r % 3]:
            fn(r)

    def g_st(r: int) -> None:
        from safetensors.torch import load_file

        path = d(f"st-{r}.safetensors")
        sm.timed("st_save", lambda: st_save(path, flat))
        cache.drop(path)
        loaded = sm.timed("st_load", lambda: load_file(path))
        del loaded
        rmtree(path)

    def g_dcp(r: int) -> None:
        path = d(f"dcp-{r}")
        sm.timed("dcp_save", lambda: dcp_save(path, state_dict_of(model, opt)))
        cache.drop(path)
        sm.timed("dcp_load", lambda: dcp_load(path, state_dict_of(model, opt)))
        rmtree(path)
        path = d(f"dcp-async-{r}")
        quiesce()
        meter = CpuMeter()
        t0 = time.perf_counter()
        fut = dcp_async_save(path, state_dict_of(model, opt))
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        other = meter.other_cores()
        sm.add("dcp_async_block", t1 - t0, other)
        sm.add("dcp_async_total", t2 - t0, other)
        rmtree(path)

    def g_rl_async(r: int) -> None:
        quiesce()
        meter = CpuMeter()
        t0 = time.perf_counter()
        handle = rl_async.save_async(next(step))
        t1 = time.perf_counter()
        opt.step()  # at once (no gradients: nothing changes): its pre-hook waits for the whole background copy
        handle.wait()
        t2 = time.perf_counter()
        other = meter.other_cores()
        sm.add("rl_async_block", t1 - t0, other)
        sm.add("rl_async_stage", handle.stage_seconds, other)
        sm.add("rl_async_total", t2 - t0, other)
        clear_run(rl_async)

    def g_dedup(r: int) -> None:
        run = f"dedup-{r}"
        e = bench_engine(workdir, run, dedup=True)
        e.register("policy", model)
        e.register("optimizer", opt)
        root = d(run)
        sm.timed("rl_dedup_first", lambda: e.save(next(step)))
        after_first = tree_bytes(root)
        changed = mutate_quarter(model, opt, seed=r)
        sm.timed("rl_dedup_second", lambda: e.save(next(step)))
        dedup_info["changed_bytes"].append(changed)
        dedup_info["first_bytes_added"].append(after_first)
        dedup_info["second_bytes_added"].append(tree_bytes(root) - after_first)
        e.close()
        rmtree(root)

    def g_hash(r: int) -> None:
        for algo in HASH_ALGOS:
            sm.timed(f"hash_{algo}", lambda algo=algo: hash_all(views, algo))

    def g_variants(r: int) -> None:
        for key, e in variants.items():
            sm.timed(key, lambda e=e: e.save(next(step)))
            clear_run(e)

    groups = [g_io, g_st, g_dcp, g_rl_async, g_dedup, g_hash]
    if variants:
        groups.insert(3, g_variants)
    started = time.perf_counter()
    for r in range(args.repeat):
        order = groups[r % len(groups) :] + groups[: r % len(groups)]
        for g in order:
            log(f"bench: repeat {r + 1}/{args.repeat}: {g.__name__[2:]} ...")
            g(r)
    for e in (rl, rl_async, *variants.values()):
        e.close()

    results = {k: sm.result(k, total) for k in (*RESULT_KEYS, *variants)}
    ratios = {}
    for name, (num, den) in RATIOS.items():
        a, b = sm.median(num), sm.median(den)
        ratios[name] = a / b if a is not None and b else None
    paired = {name: paired_ratio(sm, *pair) for name, pair in PAIRED.items()}
    dedup = {
        "changed_bytes": int(statistics.median(dedup_info["changed_bytes"])),
        "first_bytes_added": int(statistics.median(dedup_info["first_bytes_added"])),
        "second_bytes_added": int(statistics.median(dedup_info["second_bytes_added"])),
    }
    dedup["second_fraction"] = dedup["second_bytes_added"] / total if total else None
    return {
        "state": state,
        "results": results,
        "ratios": ratios,
        "paired": paired,
        "restore_breakdown": {k: statistics.median(v) for k, v in breakdown.items()},
        "dedup": dedup,
        "goals": evaluate_goals(sm, paired),
        "load": sm.load_summary(),
        "first_async_block_s": first_block,
        "elapsed_s": time.perf_counter() - started,
    }


def paired_ratio(sm: Samples, num: str, den: str) -> float | None:
    """The median over repeats of ``num``'s seconds / ``den``'s in the same repeat (a noisy minute moves both)."""
    pairs = [a / b for a, b in zip(sm.times.get(num, []), sm.times.get(den, [])) if b]
    return statistics.median(pairs) if pairs else None


def evaluate_goals(sm: Samples, paired: dict | None = None) -> list[dict]:
    m = sm.median
    paired = paired or {}
    goals = []

    def goal(name: str, value: float | None, limit: float | None, text: str, lower_is_better: bool = True) -> None:
        met = None if value is None or limit is None else (value <= limit if lower_is_better else value >= limit)
        goals.append({"name": name, "met": met, "value": value, "limit": limit, "text": text})

    def ratio(a: str, b: str) -> float | None:
        return m(a) / m(b) if m(a) is not None and m(b) else None

    # throughput ratio = raw_write time / rl_save time
    thr = (m("raw_write") / m("rl_save")) if m("raw_write") and m("rl_save") else None
    goal("save_vs_raw_write", thr, 0.8, "rl save throughput >= 0.8 x raw write throughput", lower_is_better=False)
    goal("save_faster_than_torch_save", ratio("rl_save", "torch_save"), 1.0, "rl save time < torch.save+fsync time")
    goal(
        "save_faster_than_st_save", ratio("rl_save", "st_save"), 1.0, "rl save time < safetensors.save_file+fsync time"
    )
    goal("block_vs_save", ratio("rl_async_block", "rl_save"), 0.10, "save_async blocking <= 0.10 x sync save")
    goal("block_vs_clone", ratio("rl_async_block", "clone"), 1.5, "save_async blocking <= 1.5 x memory copy (clone)")
    goal(
        "restore_vs_raw_read",
        paired.get("restore_vs_raw_read", ratio("rl_restore", "raw_read")),
        1.05,
        "restore <= 1.05 x raw read time (paired by repeat)",
    )
    goal(
        "restore_vs_torch_load",
        paired.get("restore_vs_torch_load", ratio("rl_restore", "torch_load")),
        0.8,
        "restore <= 0.8 x torch.load time (paired by repeat)",
    )
    for g in goals:  # strict "faster than": equal is not faster
        if g["name"].startswith("save_faster") and g["value"] is not None:
            g["met"] = g["value"] < 1.0
    return goals
