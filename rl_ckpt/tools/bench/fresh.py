"""``rl-ckpt bench --fresh``: the first restore in a new process (what a restarted rank does), from the memory tier
and from local disk (cold cache), each next to one memcpy of the state in that same process.

The bench's state (model + Adam, ``--size``) is saved once as a memory snapshot (the run's ``raymem://`` store on
this node, one participant) and once to local disk. Then, ``--repeat`` times and for each tier (their order
alternating), a new Ray actor: it builds the model and an optimizer that has taken no step yet (a new process
has no optimizer state until it restores one; not timed); a third run per repeat, ``memory_allocated``, restores
from the memory tier into an optimizer whose state exists already (allocated and zeroed before the restore, as
frameworks that load through torch DCP do: the restore then copies every byte into memory that exists, the case
"one memcpy" is the floor of). Each run builds the engines (``CheckpointEngine`` and, for the
memory tier, ``MemoryTier``: timed apart, ``engine_s``), restores (``restore_s``, with its breakdown: plan, read,
hash, decode, copy; after a ``gc.collect()``, as every measurement of the bench), and then, in the same process,
measures the floors: ``memcpy_s``, the state's bytes copied into tensors that exist already, and ``clone_s``,
copied into fresh memory (what any restore pays for state that does not exist yet, as a new process's optimizer
state). Ratios are paired: each restore against the floors of its own process, medians over the repeats. Needs
Ray (a local cluster is started when none is connected).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import uuid

from rl_ckpt.tools.bench.common import log, parse_size, rmtree

RUNS = ("memory", "durable", "memory_allocated")  # (tier, whether the optimizer's state exists before the restore)


class FreshProcess:
    """A Ray actor: one first restore in a new process, then the floors in that process (see the module doc)."""

    def restore(
        self, base: str, run: str, size: int, tensors: int | None, tier: str, threads: int, allocated: bool = False
    ) -> dict:
        import torch

        from rl_ckpt import CheckpointEngine
        from rl_ckpt.tools.bench.state import build_state, flat_tensors

        if threads:
            torch.set_num_threads(threads)
        model, opt, _shape = build_state(size, tensors, seed=1)
        if allocated:  # the state exists, zeroed (as a zero-gradient step leaves Adam's, in new memory)
            for state in opt.state.values():
                for value in state.values():
                    if torch.is_tensor(value):
                        value.zero_()
        else:
            opt.state.clear()  # a new process's optimizer has taken no step: no state until it restores one
        # As before every measurement of the bench: no garbage. Here it is more: a new process's first full
        # collection (~340,000 objects after importing Ray and torch) took 0.5-0.9 s on a loaded VM, wherever it
        # fell; a restarted rank can take it before its restore too (``gc.collect()`` or ``gc.freeze()``).
        gc.collect()
        started = time.perf_counter()
        engine = CheckpointEngine(
            base_dir=base, run_name=run, keep_latest=2, keep_best=0, post_load_check=False, memory_replicas=0
        )
        front = engine
        if tier == "memory":
            from rl_ckpt.integrations.memory_tier import MemoryTier

            front = MemoryTier(engine)
        front.register("policy", model)
        front.register("optimizer", opt)
        built = time.perf_counter()
        result = front.restore()
        restored = time.perf_counter()
        got = tier if tier == "durable" else getattr(front, "tier_restored", None)
        tensors_now = list(flat_tensors(model, opt).values())
        nbytes = sum(t.numel() * t.element_size() for t in tensors_now)
        targets = [t.clone() for t in tensors_now]  # exist (allocated and touched) before the floor is timed
        t0 = time.perf_counter()
        for dst, src in zip(targets, tensors_now):
            dst.copy_(src)
        memcpy = time.perf_counter() - t0
        t0 = time.perf_counter()
        clones = [t.clone() for t in tensors_now]
        clone = time.perf_counter() - t0
        del clones, targets
        front.close()
        return {
            "tier": got,
            "snapshot": result.snapshot_id,
            "bytes": nbytes,
            "engine_s": built - started,
            "restore_s": restored - built,
            "breakdown": dict(result.timings),
            "memcpy_s": memcpy,
            "clone_s": clone,
        }


def run_fresh(args, workdir: str, cache) -> dict:
    """``--fresh``: the figures of the module docstring, as a dict (``fresh`` in the JSON)."""
    import ray

    from rl_ckpt import CheckpointEngine
    from rl_ckpt.integrations.memory_tier import MEMORY_BASE, MemoryTier
    from rl_ckpt._storage import open_storage
    from rl_ckpt.tools.bench.state import build_state

    size = parse_size(args.size)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            logging_level="ERROR",
            namespace="rl_ckpt_bench",
            object_store_memory=max(3 * size, 1 << 30),  # the snapshot, one in flight: nothing spilled to disk
        )
    run = f"fresh-{uuid.uuid4().hex[:6]}"
    model, opt, _shape = build_state(size, args.tensors)
    engine = CheckpointEngine(
        base_dir=workdir, run_name=run, keep_latest=2, keep_best=0, post_load_check=False, memory_replicas=0
    )
    tier = MemoryTier(engine)
    tier.register("policy", model)
    tier.register("optimizer", opt)
    log(f"bench --fresh: saving {run} to memory and to disk ...")
    tier.save(1).wait()
    engine.save(1)
    tier.close()
    del model, opt, tier, engine
    actor_cls = ray.remote(num_cpus=0)(FreshProcess)
    runs: dict[str, list[dict]] = {t: [] for t in RUNS}
    try:
        for r in range(args.repeat):
            for name in RUNS if r % 2 == 0 else RUNS[::-1]:
                log(f"bench --fresh: repeat {r + 1}/{args.repeat}: {name} restore in a new process ...")
                tier, allocated = name.split("_")[0], name.endswith("_allocated")
                if tier == "durable":
                    cache.drop(os.path.join(workdir, run))
                actor = actor_cls.remote()
                try:
                    call = actor.restore.remote(workdir, run, size, args.tensors, tier, args.threads, allocated)
                    got = ray.get(call)
                finally:
                    ray.kill(actor)
                if got["tier"] != tier:
                    raise RuntimeError(f"the {name} run restored from {got['tier']} ({got['snapshot']})")
                runs[name].append(got)
    finally:
        open_storage(f"{MEMORY_BASE}/{run}", {"replicas": 0}).destroy()
        rmtree(os.path.join(workdir, run))
        if started_ray:
            ray.shutdown()
    return summarize(runs)


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Medians per tier and the paired ratios (each restore against the floors measured in its own process)."""

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    out: dict = {"bytes": runs["memory"][0]["bytes"], "runs": runs}
    for name, rs in runs.items():
        phases = sorted({k for r in rs for k in r["breakdown"]})
        out[name] = {
            "restore_s": med([r["restore_s"] for r in rs]),
            "engine_s": med([r["engine_s"] for r in rs]),
            "memcpy_s": med([r["memcpy_s"] for r in rs]),
            "clone_s": med([r["clone_s"] for r in rs]),
            "vs_memcpy": med([r["restore_s"] / r["memcpy_s"] for r in rs]),
            "vs_clone": med([r["restore_s"] / r["clone_s"] for r in rs]),
            "breakdown": {k: med([r["breakdown"].get(k, 0.0) for r in rs]) for k in phases},
        }
    out["memory_vs_durable"] = med(
        [m["restore_s"] / d["restore_s"] for m, d in zip(runs["memory"], runs["durable"], strict=True)]
    )
    return out


def format_fresh(fresh: dict) -> list[str]:
    """The ``--fresh`` lines of the report."""
    from rl_ckpt.tools.bench.common import human

    lines = [
        "",
        f"first restore in a new process ({human(fresh['bytes'])}: model + Adam; the optimizer has no state yet but in "
        "the last line), "
        "each next to the floors measured in that same process (paired medians):",
    ]
    labels = (
        ("memory", "memory tier"),
        ("durable", "local disk, cold"),
        ("memory_allocated", "memory tier, into an optimizer state allocated first"),
    )
    for name, label in labels:
        f = fresh[name]
        parts = ", ".join(
            f"{k} {f['breakdown'][k]:.3f}"
            for k in ("plan", "read", "hash", "decode", "copy", "probe")
            if k in f["breakdown"]
        )
        lines.append(
            f"  {label:<17} restore {f['restore_s']:.3f} s = {f['vs_memcpy']:.2f}x one memcpy into existing "
            f"tensors ({f['memcpy_s']:.3f} s), {f['vs_clone']:.2f}x a copy into fresh memory ({f['clone_s']:.3f} s); "
            f"engines built in {f['engine_s']:.3f} s before it; breakdown (s): {parts}"
        )
    lines.append(f"  memory tier / local disk cold: {fresh['memory_vs_durable']:.2f}x")
    return lines
