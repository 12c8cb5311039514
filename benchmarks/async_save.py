#!/usr/bin/env python
"""Benchmark of rl_ckpt's two-phase save: what a synchronous save costs, what
``save_async`` blocks, and how much a background save slows training.

    python benchmarks/async_save.py [--dir PATH] [--size-gib 1.0] [--repeat 3]
                                    [--algo xxh3_128|sha256|blake3] [--json] [--phases]
                                    [--wait-quiet S] [--no-probe] [--no-prepare]

State: a synthetic model plus ``torch.optim.Adam`` state (exp_avg/exp_avg_sq
populated by one optimizer step) of about ``--size-gib`` in total, fp32, with
a realistic tensor mix: a few large matrices, many medium ones, many small
vectors (plus Adam's scalar ``step`` tensors). The optimizer is ~2/3 of the
bytes.

``engine.prepare()`` after registering (allocates and faults in the staging
buffers on a thread; ``--no-prepare``: the first ``save_async`` does it), then
one warm-up round (its figures are reported separately), then ``--repeat`` rounds, each
running every measurement once, interleaved:

1. ``sync_save_s``    ``engine.save(step)`` wall time (checksums + verify-after-write on).
2. ``async_call_s``   wall time of the ``engine.save_async(step)`` call itself; then the next
                      training step: one step of the training MLP below (the forward/backward
                      before the optimizer's step) and the checkpointed optimizer's ``step()``
                      (no gradients: it changes nothing, but its pre-hook waits for the background
                      copy if it is still running); ``hook_wait_s`` is that wait
                      (``handle.hook_wait_seconds``), ``async_block_s = async_call_s + hook_wait_s``
                      (``handle.stage_seconds``): what the trainer was blocked. ``copy_s``: how long the
                      background copy took (what an optimizer step right after the call would wait).
                      Then ``handle.wait()``; ``async_total_s`` is call start to committed.
3. ``clone_s``        ``[t.clone() for t in tensors]`` of the same tensors (memory-copy floor);
   ``copy_into_s``    ``dst.copy_(src)`` into preallocated tensors.
4. training step time of a separate MLP (forward/backward/Adam, calibrated to
   ``--step-ms``) followed by the checkpointed optimizer's (no-op) ``step()``, (a) with no save
   running, (b) from the ``save_async`` call until it committed (hook waits included);
   ``step_slowdown = b / a`` (medians).
5. staging reuse: ``engine.pipeline.staging.allocations`` after the first save_async vs after
   every later save.

Medians over the rounds are compared with the goals (issue #23):
``async_block_s <= 5 ms`` (steady, at 1 GiB and at ``--size-gib 4``), first call (warm-up round;
buffers prepared ahead unless ``--no-prepare``) ``<= 2 x`` steady, ``step_slowdown <= 1.15``. The former ratios
(``async_block_s`` vs ``sync_save_s`` and vs ``clone_s``) are printed too.

``--phases`` also times the parts of a save on their own (stage/encode, hashing
in memory, write+fsync without hashing, verify re-read+hash) and the training
step while a background thread does only one of them, to attribute a miss.

The run writes into a fresh temporary folder (inside ``--dir`` if given, else a
temp folder on the repo's disk, never /dev/shm) and deletes it at the end.
GB/s figures are decimal (1e9 bytes/s).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parent.parent
try:
    import rl_ckpt  # noqa: F401  (installed editable)
except ImportError:  # pragma: no cover - running from a checkout without install
    sys.path.insert(0, str(REPO_ROOT))
from rl_ckpt import CheckpointEngine  # noqa: E402
from rl_ckpt.tools.bench import LARGE, SMALL, CpuMeter, build_state, flat_tensors, fs_info, nbytes, size_mix  # noqa: E402
from rl_ckpt.config import CHECKSUM_ALGOS  # noqa: E402

GIB = 1 << 30
GOAL_BLOCK_S = 0.005  # steady blocked time (call + hook wait), at any size
GOAL_FIRST_VS_STEADY = 2.0
GOAL_STEP_SLOWDOWN = 1.15
QUIET_LIMIT = 0.25  # cores used by other processes above which a round is flagged (and, with --wait-quiet, redone)
MAX_DISCARDED = 6  # at most this many redone rounds per run


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- state
# The synthetic model + Adam state is rl-ckpt bench's (same tensor mix, same sizes); the engine
# saves exactly these tensors: the model's state_dict and the optimizer's state.
def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return list(flat_tensors(model, opt).values())


# --------------------------------------------------------------------------- training
class Trainer:
    """A CPU-realistic training step on its own MLP (never touches the checkpointed tensors)."""

    def __init__(self, width: int = 1024, hidden: int = 2048, batch: int = 256, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.width, self.hidden = width, hidden
        torch.manual_seed(seed)
        self.net = nn.Sequential(
            nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, width)
        )
        self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-4)
        self._g = g
        self.set_batch(batch)

    def set_batch(self, batch: int) -> None:
        self.batch = batch
        self.x = torch.randn(batch, self.width, generator=self._g)
        self.y = torch.randn(batch, self.width, generator=self._g)

    def step(self, then=None) -> float:
        """One step; ``then``: called after it (the checkpointed optimizer's step, whose pre-hook may wait)."""
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.net(self.x), self.y)
        loss.backward()
        self.opt.step()
        if then is not None:
            then()
        return time.perf_counter() - t0

    def median_step(self, n: int) -> float:
        return statistics.median(self.step() for _ in range(n))

    def calibrate(self, target_s: float) -> None:
        for _ in range(3):
            self.step()
        t = self.median_step(5)
        for _ in range(2):
            batch = int(min(16384, max(16, round(self.batch * target_s / t / 16) * 16)))
            self.set_batch(batch)
            for _ in range(2):
                self.step()
            t = self.median_step(5)
            if abs(t / target_s - 1) < 0.15:
                break


# --------------------------------------------------------------------------- helpers
def repo_commit() -> str | None:
    """The checked-out commit, read from .git directly (no git process, nothing written)."""
    git = REPO_ROOT / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if (git / ref).exists():
            return (git / ref).read_text().strip()
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return None


def make_workdir(base: str | None) -> str:
    """A fresh folder to write into: inside ``base``, or a temp folder on the repo's disk."""
    if base is not None:
        os.makedirs(base, exist_ok=True)
        return tempfile.mkdtemp(prefix="rl_ckpt_bench-", dir=base)
    tmp = tempfile.gettempdir()
    try:
        same_disk = os.stat(tmp).st_dev == os.stat(REPO_ROOT).st_dev and fs_info(tmp)["fstype"] != "tmpfs"
    except OSError:
        same_disk = False
    return tempfile.mkdtemp(prefix="rl_ckpt_bench-", dir=tmp if same_disk else str(REPO_ROOT.parent))


def wait_quiet(limit_s: float, threshold: float = 0.15, window_s: float = 2.0) -> float | None:
    """Wait (up to ``limit_s``) until other processes use < ``threshold`` cores over ``window_s``.

    Returns the last measured load (cores), or None where /proc/stat is unavailable.
    """
    deadline = time.perf_counter() + limit_s
    load = None
    while True:
        meter = CpuMeter()
        time.sleep(window_s)
        load = meter.other_cores()
        if load is None or load < threshold or time.perf_counter() >= deadline:
            return load
        log(f"  machine busy ({load:.2f} other cores); waiting to start the round ...")


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def gbps(n: int, s: float | None) -> float | None:
    return n / s / 1e9 if s else None


# --------------------------------------------------------------------------- phases (--phases)
def measure_phases(
    staged_tensors: list[torch.Tensor], algo: str, workdir: str, trainer: Trainer, quiet=lambda: None
) -> dict:
    """Time each part of a save on its own, and the training step next to each one."""
    from rl_ckpt._format import safetensors_io
    from rl_ckpt._format.checksum import new_hasher
    from rl_ckpt._format.state_codec import encode_state
    from rl_ckpt._storage import LocalStorage
    from rl_ckpt._format.hashed_io import hash_file

    arrays = {f"t{i}": t for i, t in enumerate(staged_tensors)}
    storage = LocalStorage(os.path.join(workdir, "phases"))
    storage.makedirs("x")
    n = nbytes(staged_tensors)
    counter = iter(range(1_000_000))

    def hash_only() -> None:
        h = new_hasher(algo)
        for chunk in safetensors_io.encode(arrays)[0]:
            h.update(memoryview(chunk).cast("B"))
        h.hexdigest()

    def write_only() -> None:
        storage.write(f"x/w{next(counter)}.safetensors", safetensors_io.encode(arrays)[0], durable=True)

    def write_hashed() -> None:  # what the engine does per file: hash each chunk, then write it
        h = new_hasher(algo)

        def gen():
            for chunk in safetensors_io.encode(arrays)[0]:
                v = memoryview(chunk).cast("B")
                h.update(v)
                yield v

        storage.write(f"x/h{next(counter)}.safetensors", gen(), durable=True)
        h.hexdigest()

    write_only()
    verify_path = f"x/w{next(counter) - 1}.safetensors"

    def verify_only() -> None:  # re-read (page cache) + hash, like verify_after_write
        hash_file(storage, verify_path, algo)

    def copy_only(dst=[t.clone() for t in staged_tensors]) -> None:  # noqa: B006 - preallocated once
        for d, s in zip(dst, staged_tensors):
            d.copy_(s)

    def timed(fn, reps: int = 2) -> float:
        return statistics.median(_t(fn) for _ in range(reps))

    def _t(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    out: dict = {"bytes": n, "other_cores": {}}
    t0 = time.perf_counter()
    encode_state("x", {"a": arrays})
    out["encode_state_s"] = time.perf_counter() - t0
    for name, fn in (
        ("hash_s", hash_only),
        ("write_fsync_s", write_only),
        ("write_hashed_s", write_hashed),
        ("verify_reread_hash_s", verify_only),
        ("copy_into_s", copy_only),
    ):
        quiet()
        meter = CpuMeter()
        out[name] = timed(fn)
        out["other_cores"][name] = meter.other_cores()
        log(f"  phase {name}: {out[name]:.3f} s (other load {out['other_cores'][name] or 0:.2f} cores)")
    # Training next to one background activity at a time (looped until 12 steps ran), each
    # against an idle baseline measured just before it.
    contention = {}
    for name, fn in (
        ("hash", hash_only),
        ("write_fsync", write_only),
        ("verify", verify_only),
        ("copy_into", copy_only),
    ):
        quiet()
        meter = CpuMeter()
        idle = trainer.median_step(12)
        stop = threading.Event()

        def loop(fn=fn) -> None:
            while not stop.is_set():
                fn()

        th = threading.Thread(target=loop, daemon=True)
        th.start()
        time.sleep(0.05)
        busy = statistics.median(trainer.step() for _ in range(12))
        stop.set()
        th.join()
        contention[name] = {
            "idle_ms": 1e3 * idle,
            "step_ms": 1e3 * busy,
            "slowdown": busy / idle,
            "other_cores": meter.other_cores(),
        }
        log(f"  step next to {name}: {1e3 * busy:.1f} ms vs idle {1e3 * idle:.1f} ms ({busy / idle:.2f}x)")
        storage.remove_tree("x")
        storage.makedirs("x")
        write_only()
        verify_path = f"x/w{next(counter) - 1}.safetensors"
    out["step_next_to"] = contention
    shutil.rmtree(os.path.join(workdir, "phases"), ignore_errors=True)
    return out


# --------------------------------------------------------------------------- benchmark
def run(args: argparse.Namespace) -> dict:
    workdir = make_workdir(args.dir)
    from rl_ckpt.config import FIELDS

    nice = FIELDS["writer_nice"][0] if args.writer_nice is None else args.writer_nice
    res: dict = {
        "config": {
            "size_gib": args.size_gib,
            "repeat": args.repeat,
            "algo": args.algo,
            "writer_nice": nice,
            "post_load_check": not args.no_probe,
            "prepare": not args.no_prepare,
            "verify_after_write": True,
            "dir": workdir,
            "fs": fs_info(workdir),
        },
        "env": {
            "torch": torch.__version__,
            "torch_num_threads": torch.get_num_threads(),
            "torch_num_interop_threads": torch.get_num_interop_threads(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "repo_commit": repo_commit(),
        },
    }
    if res["config"]["fs"]["fstype"] == "tmpfs":
        log(f"warning: {workdir} is on tmpfs: write/fsync figures will not reflect a disk")
    engine = None
    try:
        log(f"building ~{args.size_gib} GiB of model + Adam state ...")
        model, opt, shape = build_state(int(args.size_gib * GIB))
        tensors = state_tensors(model, opt)
        total = nbytes(tensors)
        model_bytes = nbytes(list(model.state_dict().values()))
        res["state"] = {
            "bytes": total,
            "gib": total / GIB,
            "tensors": len(tensors),
            "model_bytes": model_bytes,
            "optimizer_bytes": total - model_bytes,
            "optimizer_fraction": (total - model_bytes) / total,
            "mix": size_mix(tensors),
            "shape": shape,
        }
        saves = 3 * (args.repeat + 1 + (MAX_DISCARDED if args.wait_quiet > 0 else 0))
        free = shutil.disk_usage(workdir).free
        if free < saves * total * 1.1 + 2 * total:
            raise SystemExit(
                f"not enough free space in {workdir}: {free / GIB:.1f} GiB free, "
                f"~{(saves * total * 1.1 + 2 * total) / GIB:.1f} GiB needed ({saves} snapshots)"
            )

        trainer = Trainer()
        for _ in range(5):  # calibrate on a quiet machine if possible: other load makes steps look slow
            if args.wait_quiet > 0:
                wait_quiet(args.wait_quiet)
            meter = CpuMeter()
            trainer.calibrate(args.step_ms / 1e3)
            calib_load = meter.other_cores()
            if args.wait_quiet <= 0 or (calib_load or 0.0) <= QUIET_LIMIT:
                break
            log(f"  calibration disturbed ({calib_load:.2f} other cores); redoing it")
        res["train"] = {
            "model": f"MLP {trainer.width}-{trainer.hidden}-{trainer.hidden}-{trainer.width} + Adam",
            "batch": trainer.batch,
            "target_ms": args.step_ms,
            "calibration_other_cores": calib_load,
        }

        extra = {} if args.writer_nice is None else {"writer_nice": args.writer_nice}
        engine = CheckpointEngine(
            base_dir=workdir,
            run_name="bench",
            checksum_algo=args.algo,
            verify_after_write=True,
            retention=False,
            post_load_check=not args.no_probe,
            **extra,
        )
        engine.register("policy", model)
        engine.register("optimizer", opt)
        if not args.no_prepare:  # allocate + fault in the staging buffers ahead of the first save_async
            prepare = engine.prepare
            t0 = time.perf_counter()
            res["prepare"] = {"bytes": prepare()}
            res["prepare"]["call_s"] = time.perf_counter() - t0
            engine.pipeline.staging.warmed.wait()
            res["prepare"]["ready_s"] = time.perf_counter() - t0
            log(
                f"prepare: {res['prepare']['bytes'] / GIB:.2f} GiB of staging buffers; call "
                f"{res['prepare']['call_s']:.3f}s, ready after {res['prepare']['ready_s']:.3f}s"
            )
        dst = [torch.empty_like(t) for t in tensors]
        for d in dst:
            d.zero_()  # fault the pages in once: copy_into measures the steady state, like reused staging

        step = 0
        rounds: list[dict] = []
        alloc_first = None
        alloc_after: list[int] = []
        discarded: list[dict] = []
        rnd = 0
        while rnd <= args.repeat:
            warm = rnd == 0
            r: dict = {"round": rnd, "warmup": warm}
            if args.wait_quiet > 0:
                wait_quiet(args.wait_quiet)
            log(f"round {rnd}{' (warm-up)' if warm else ''} ...")
            meter = CpuMeter()

            # 1. synchronous save
            step += 1
            t0 = time.perf_counter()
            engine.save(step)
            r["sync_save_s"] = time.perf_counter() - t0

            # 2. async save: the call, the next step (its optimizer step may wait in the hook), until committed
            step += 1
            t0 = time.perf_counter()
            handle = engine.save_async(step)
            t1 = time.perf_counter()
            trainer.step(then=opt.step)
            handle.wait()
            t2 = time.perf_counter()
            r.update(
                async_call_s=t1 - t0,
                hook_wait_s=handle.hook_wait_seconds,
                async_block_s=t1 - t0 + handle.hook_wait_seconds,
                copy_s=handle.copy_seconds,
                async_total_s=t2 - t0,
            )
            t0 = time.perf_counter()
            engine.pipeline.probes("full")  # the post-load probe's reference forward, part of every save's call
            r["probe_s"] = time.perf_counter() - t0
            if alloc_first is None:
                alloc_first = engine.pipeline.staging.allocations
            else:
                alloc_after.append(engine.pipeline.staging.allocations)

            # 3. memory-copy floor
            t0 = time.perf_counter()
            clones = [t.clone() for t in tensors]
            r["clone_s"] = time.perf_counter() - t0
            del clones
            t0 = time.perf_counter()
            for d, s in zip(dst, tensors):
                d.copy_(s)
            r["copy_into_s"] = time.perf_counter() - t0

            # 4a. training, no save running
            engine.wait()  # (removes the finished save's hooks, as any engine call does)
            r["step_idle_s"] = [trainer.step(then=opt.step) for _ in range(args.train_steps)]

            # 4b. training while a save_async persists
            step += 1
            done_at: list[float] = []
            t0 = time.perf_counter()
            handle = engine.save_async(step)
            t1 = time.perf_counter()
            handle.add_done_callback(lambda _h: done_at.append(time.perf_counter()))
            spans = []
            while not handle.done():
                s = time.perf_counter()
                trainer.step(then=opt.step)
                spans.append((s, time.perf_counter()))
            handle.wait()
            r["busy_hook_wait_s"] = handle.hook_wait_seconds
            end = done_at[0] if done_at else time.perf_counter()
            inside = [e - s for s, e in spans if e <= end] or [e - s for s, e in spans]
            r["step_slowdown"] = med(inside) / med(r["step_idle_s"]) if inside else None
            r.update(
                step_during_save_s=inside, steps_during_save=len(spans), busy_block_s=t1 - t0, busy_total_s=end - t0
            )
            alloc_after.append(engine.pipeline.staging.allocations)
            r["other_cores"] = meter.other_cores()
            log(
                "  sync %.3fs  async block %.4fs (call %.4fs + hook %.4fs; copy %.3fs) total %.3fs  clone %.3fs  "
                "copy_into %.3fs  step idle %.1fms  during save %.1fms (%d steps, save %.2fs)  other load %.2f"
                % (
                    r["sync_save_s"],
                    r["async_block_s"],
                    r["async_call_s"],
                    r["hook_wait_s"],
                    r["copy_s"],
                    r["async_total_s"],
                    r["clone_s"],
                    r["copy_into_s"],
                    1e3 * med(r["step_idle_s"]),
                    1e3 * (med(inside) or 0),
                    len(spans),
                    r["busy_total_s"],
                    r["other_cores"] or 0.0,
                )
            )
            if (
                args.wait_quiet > 0
                and not warm
                and (r["other_cores"] or 0.0) > QUIET_LIMIT
                and len(discarded) < MAX_DISCARDED
            ):
                log(f"  round {rnd} discarded: other processes used {r['other_cores']:.2f} cores; redoing it")
                discarded.append(r)
                continue
            rounds.append(r)
            rnd += 1

        measured = [r for r in rounds if not r["warmup"]]
        m = {
            k: med([r[k] for r in measured])
            for k in (
                "sync_save_s",
                "async_block_s",
                "async_call_s",
                "probe_s",
                "hook_wait_s",
                "copy_s",
                "async_total_s",
                "clone_s",
                "copy_into_s",
                "busy_block_s",
                "busy_hook_wait_s",
                "busy_total_s",
            )
        }
        m["step_idle_s"] = med([x for r in measured for x in r["step_idle_s"]])
        m["step_during_save_s"] = med([x for r in measured for x in r["step_during_save_s"]])
        m["step_slowdown"] = m["step_during_save_s"] / m["step_idle_s"]
        res["rounds"] = rounds
        res["discarded_rounds"] = discarded
        loads = [r["other_cores"] for r in measured if r["other_cores"] is not None]
        res["other_load_cores"] = max(loads) if loads else None
        res["median"] = m
        res["gbps"] = {
            k: gbps(total, m[k]) for k in ("sync_save_s", "copy_s", "async_total_s", "clone_s", "copy_into_s")
        }
        res["first_save"] = {
            k: rounds[0][k]
            for k in ("sync_save_s", "async_block_s", "async_call_s", "hook_wait_s", "copy_s", "async_total_s")
        }
        res["staging"] = {
            "allocations_after_first_save": alloc_first,
            "allocations_after_later_saves": alloc_after,
            "reused": all(a == alloc_first for a in alloc_after),
            "bytes_copied": engine.pipeline.staging.bytes_copied,
        }
        steady = max(m["async_block_s"], 1e-9)
        res["ratios"] = {
            "async_block_vs_sync": m["async_block_s"] / m["sync_save_s"],
            "async_block_vs_clone": m["async_block_s"] / m["clone_s"],
        }
        res["goals"] = {
            "steady_block": {
                "value": 1e3 * m["async_block_s"],
                "limit": 1e3 * GOAL_BLOCK_S,
                "text": f"async_block_s <= {1e3 * GOAL_BLOCK_S:.0f} ms (value in ms)",
            },
            "first_vs_steady": {
                "value": res["first_save"]["async_block_s"] / steady,
                "limit": GOAL_FIRST_VS_STEADY,
                "text": f"first async_block_s <= {GOAL_FIRST_VS_STEADY:.0f} x steady",
            },
            "step_slowdown": {
                "value": m["step_slowdown"],
                "limit": GOAL_STEP_SLOWDOWN,
                "text": f"step_slowdown <= {GOAL_STEP_SLOWDOWN}",
            },
        }
        for g in res["goals"].values():
            g["met"] = g["value"] <= g["limit"]
        res["all_goals_met"] = all(g["met"] for g in res["goals"].values())

        if args.phases:
            log("phases ...")
            staged = [buf for buf in engine.pipeline.staging.buffers.values() if isinstance(buf, torch.Tensor)]
            quiet = (lambda: wait_quiet(args.wait_quiet)) if args.wait_quiet > 0 else (lambda: None)
            res["phases"] = measure_phases(staged or tensors, args.algo, workdir, trainer, quiet)
        return res
    finally:
        if engine is not None:
            engine.close()
        shutil.rmtree(workdir, ignore_errors=True)
        res["config"]["cleaned_up"] = not os.path.exists(workdir)


# --------------------------------------------------------------------------- output
def print_report(res: dict) -> None:
    c, e, st, m, gb = res["config"], res["env"], res["state"], res["median"], res["gbps"]
    mix = st["mix"]
    print("rl_ckpt two-phase save benchmark")
    print(
        f"  state      {st['gib']:.3f} GiB ({st['bytes']:,} B) in {st['tensors']} fp32 tensors; "
        f"optimizer {st['optimizer_fraction']:.1%} of bytes"
    )
    print(
        "  mix        "
        + ", ".join(f"{mix[k]['count']} {k} ({mix[k]['bytes'] / GIB:.3f} GiB)" for k in ("large", "medium", "small"))
        + f"  [large >= {LARGE >> 20} MiB, small < {SMALL >> 10} KiB]"
    )
    print(
        f"  storage    {c['dir']} ({c['fs']['fstype']} on {c['fs']['source']}); checksum {c['algo']}, "
        f"verify_after_write on, retention off, writer_nice {c.get('writer_nice')}, "
        f"post_load_check {'on' if c.get('post_load_check', True) else 'off'}"
    )
    print(
        f"  machine    torch {e['torch']}, torch.get_num_threads()={e['torch_num_threads']}, "
        f"interop={e['torch_num_interop_threads']}, os.cpu_count()={e['cpu_count']}; "
        f"repo at {(e.get('repo_commit') or '?')[:10]}"
    )
    print(
        f"  training   {res['train']['model']}, batch {res['train']['batch']} "
        f"(calibrated to ~{res['train']['target_ms']:.0f} ms/step)"
    )
    print(f"  rounds     1 warm-up + {c['repeat']} measured (medians below); GB/s = 1e9 B/s")
    load = res.get("other_load_cores")
    if load is not None:
        per = ", ".join(f"{r['other_cores']:.2f}" for r in res["rounds"] if not r["warmup"])
        print(
            f"  other load {per} cores busy outside this process per round"
            + ("   WARNING: the machine was not quiet; figures are skewed" if load > QUIET_LIMIT else " (quiet)")
        )
    if res.get("discarded_rounds"):
        print(f"  redone     {len(res['discarded_rounds'])} round(s) discarded because other processes were busy")
    print()
    rows = [
        ("sync_save_s", "engine.save(step)", m["sync_save_s"], gb["sync_save_s"]),
        ("async_block_s", "caller blocked: call + hook wait (handle.stage_seconds)", m["async_block_s"], None),
        ("  async_call_s", "the save_async() call", m["async_call_s"], None),
        ("    probe_s", "of which the post-load probe's forward (post_load_check)", m["probe_s"], None),
        ("  hook_wait_s", "optimizer step pre-hook after one step (hook_wait_seconds)", m["hook_wait_s"], None),
        ("  copy_s", "background copy (the wait of a step right after the call)", m["copy_s"], gb["copy_s"]),
        ("async_total_s", "save_async() -> committed", m["async_total_s"], gb["async_total_s"]),
        ("clone_s", "[t.clone() for t in tensors]", m["clone_s"], gb["clone_s"]),
        ("copy_into_s", "dst.copy_(src), preallocated", m["copy_into_s"], gb["copy_into_s"]),
        ("busy_block_s", "save_async() call, training run", m["busy_block_s"], None),
        ("busy_hook_wait_s", "hook waits, training run", m["busy_hook_wait_s"], None),
        ("busy_total_s", "save commit time while training", m["busy_total_s"], None),
    ]
    print(f"  {'metric':<18} {'median':>9} {'GB/s':>7}   {'per round':<28} what")
    for key, what, val, rate in rows:
        k = key.strip()
        per = " ".join(f"{r[k]:.4f}" for r in res["rounds"] if not r["warmup"])
        rate_s = "" if rate is None else f"{rate:6.2f}"
        print(f"  {key:<18} {val:>8.4f}s {rate_s:>7}   {per:<28} {what}")
    measured = [r for r in res["rounds"] if not r["warmup"]]
    per = " ".join(f"{1e3 * med(r['step_idle_s']):.1f}" for r in measured)
    print(f"  {'step_idle':<18} {1e3 * m['step_idle_s']:>7.1f}ms {'':>7}   {per:<28} training step, no save (ms)")
    n_during = sum(len(r["step_during_save_s"]) for r in measured)
    per = " ".join(f"{1e3 * med(r['step_during_save_s']):.1f}" for r in measured)
    print(
        f"  {'step_during_save':<18} {1e3 * m['step_during_save_s']:>7.1f}ms {'':>7}   "
        f"{per:<28} training step while save_async persists ({n_during} steps, ms)"
    )
    per = " ".join(f"{r['step_slowdown']:.3f}" for r in res["rounds"] if not r["warmup"] and r["step_slowdown"])
    print(f"  {'step_slowdown':<18} {m['step_slowdown']:>8.3f}x {'':>7}   {per:<28} median during / median idle")
    f = res["first_save"]
    prep = res.get("prepare")
    where = (
        f"engine.prepare() allocated the staging buffers ahead ({prep['bytes'] / GIB:.2f} GiB; call "
        f"{prep['call_s']:.3f}s, ready after {prep['ready_s']:.3f}s)"
        if prep
        else "the background copy allocates the staging buffers (--no-prepare)"
    )
    print(
        f"  first (warm-up) round: sync {f['sync_save_s']:.3f}s, async block {f['async_block_s']:.4f}s "
        f"(call {f['async_call_s']:.4f}s + hook {f['hook_wait_s']:.4f}s; copy {f['copy_s']:.3f}s), "
        f"async total {f['async_total_s']:.3f}s; {where}"
    )
    print(
        f"  former ratios: async_block_s / sync_save_s {res['ratios']['async_block_vs_sync']:.4f}, "
        f"async_block_s / clone_s {res['ratios']['async_block_vs_clone']:.4f}"
    )
    print()
    print("  goals")
    for g in res["goals"].values():
        print(
            f"    {g['text']:<44} value {g['value']:7.3f} (limit {g['limit']:.2f})   {'MET' if g['met'] else 'MISSED'}"
        )
    s = res["staging"]
    print()
    print(
        f"  staging allocations: {s['allocations_after_first_save']} after the first save_async, "
        f"{s['allocations_after_later_saves']} after each later one -> "
        f"{'REUSED' if s['reused'] else 'NOT REUSED (buffers re-allocated)'}"
    )
    if "phases" in res:
        p = res["phases"]
        n = p["bytes"]
        print()
        loads = p["other_cores"]
        print("  phases (each alone, same bytes, median of 2; other = cores busy outside this process)")
        for key in (
            "encode_state_s",
            "hash_s",
            "write_fsync_s",
            "write_hashed_s",
            "verify_reread_hash_s",
            "copy_into_s",
        ):
            load = loads.get(key)
            note = "" if load is None else f"   other {load:.2f}" + ("  NOT QUIET" if load > QUIET_LIMIT else "")
            print(f"    {key:<22} {p[key]:8.3f}s  {n / p[key] / 1e9:6.2f} GB/s{note}")
        print("    training step next to one background activity (12 steps each, vs idle just before):")
        for name, v in p["step_next_to"].items():
            load = v["other_cores"]
            note = "" if load is None else f"   other {load:.2f}" + ("  NOT QUIET" if load > QUIET_LIMIT else "")
            print(f"      {name:<14} {v['step_ms']:7.1f} ms vs {v['idle_ms']:6.1f} ms   {v['slowdown']:.2f}x{note}")
    print(f"  cleaned up: {c['cleaned_up']}")


def _terminate(signum, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through run()'s cleanup


def main(argv: list[str] | None = None) -> int:
    import signal

    signal.signal(signal.SIGTERM, _terminate)
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dir", default=None, help="write into a fresh folder inside PATH (default: temp on repo disk)")
    ap.add_argument("--size-gib", type=float, default=1.0, help="total model + optimizer state (default 1.0)")
    ap.add_argument("--repeat", type=int, default=3, help="measured rounds; medians reported (default 3)")
    ap.add_argument(
        "--writer-nice",
        type=int,
        default=None,
        help="writer_nice for the engine (default: the engine default); 0 = writer at normal priority",
    )
    ap.add_argument(
        "--algo",
        default="xxh3_128",
        choices=CHECKSUM_ALGOS,
        help="checksum_algo (default xxh3_128, the engine default)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument(
        "--no-probe",
        action="store_true",
        help="post_load_check off: no reference forward of the model in the save_async call",
    )
    ap.add_argument(
        "--no-prepare",
        action="store_true",
        help="no engine.prepare(): the first save_async allocates the staging buffers (in its background copy)",
    )
    ap.add_argument("--phases", action="store_true", help="also time hash / write / verify / copy on their own")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each round, wait up to S seconds for other processes to go idle (default 0)",
    )
    ap.add_argument("--train-steps", type=int, default=15, help="idle training steps per round (default 15)")
    ap.add_argument("--step-ms", type=float, default=75.0, help="target training step time (default 75)")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.size_gib <= 0:
        ap.error("--repeat must be >= 1 and --size-gib > 0")
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=None, default=str))
    else:
        print_report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
