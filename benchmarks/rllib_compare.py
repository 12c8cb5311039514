#!/usr/bin/env python
"""RLlib's own checkpoints (``save_to_path``) vs rl_ckpt's ``CheckpointCallback``, side by side in one run.

    python benchmarks/rllib_compare.py [--sizes default,large] [--every 2] [--saves 3] [--more 2] [--dir PATH]

Same PPO config and seed (CartPole-v1, 2 EnvRunners, CPU, 256 env steps per iteration), at two sizes:
RLlib's default CartPole module (2x256 hidden) and ``large`` (3x2048 hidden, where checkpoint cost matters).
Per size, in one local Ray (2 CPUs):

1. an Algorithm with the rl_ckpt callback trains ``saves*every`` iterations; rl_ckpt saves every ``every``
   (the time ``train()`` is held: staging only, the write runs in the background) and, after waiting for
   that write to land, RLlib's ``save_to_path`` runs at the same iterations (its time is all blocking). The
   learner state at ``saves*every`` is recorded, then ``more`` more iterations (the uninterrupted run). The
   blocked time is the median over the saves; the first save of each is shown apart (rl_ckpt allocates its
   staging buffers then, RLlib's first pickling and files are as cold).
2. a fresh Algorithm from the same config restores rl_ckpt's newest snapshot (plan + load, timed), its learner
   state is compared with the recorded one bitwise, and it trains ``more`` iterations (the first one timed:
   both restores send the weights to the EnvRunners without waiting, so they take them before that
   iteration samples; "restore + first train()" compares like with like); its learner state then is compared
   with the uninterrupted run's (rl_ckpt restores the EnvRunners' environments, episodes and random streams
   and PPO's KL coefficient: the same run, bitwise).
3. a fresh Algorithm restores RLlib's checkpoint of the same iteration (timed), the same checks (RLlib's
   checkpoint holds none of those: its resumed run differs).
4. a byte is flipped in the largest file of each: rl_ckpt's plan refuses the snapshot and falls back; RLlib's
   ``restore_from_path`` raises or loads other numbers than it saved.

Timings are wall-clock on whatever machine runs it; the ratios in the last column compare two figures of the
same run (one restore each: ``rl-ckpt bench rllib`` measures save and restore in paired rounds).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

SIZES = {"default": None, "large": (2048, 2048, 2048)}


def folder_bytes(folder: str) -> tuple[int, int]:
    total = files = 0
    for d, _, names in os.walk(folder):
        for n in names:
            total += os.path.getsize(os.path.join(d, n))
            files += n.endswith(".pkl")
    return total, files


def measure(size: str, base: str, every: int, saves: int, more: int) -> dict:
    """One size: the figures of steps 1-4 in the module docstring."""
    from rl_ckpt.demo.rllib_drill import digest, flip_byte, largest_file, learner_state, ppo_config
    from rl_ckpt.integrations.rllib import checkpointing

    cfg = dict(base_dir=base, run_name=f"ppo_{size}", every=every, hidden=SIZES[size], keep_latest=10)
    rllib_dir = os.path.join(base, f"rllib_{size}")
    at = saves * every
    algo = ppo_config(cfg).build_algo()
    cp = checkpointing(algo)
    rllib_blocked = []
    while algo.training_iteration < at:
        algo.train()
        if algo.training_iteration % every == 0:
            cp.engine.wait()  # rl_ckpt's background write is done: RLlib's save is timed alone
            t = time.perf_counter()
            algo.save_to_path(os.path.join(rllib_dir, str(algo.training_iteration)))
            rllib_blocked.append(time.perf_counter() - t)
    ours_blocked = list(cp.blocked)
    cp.close()  # no snapshot after ``at``: the resumed runs start from it
    snapshot = cp.engine.snapshots()[-1]
    snap_bytes = snapshot.size_bytes
    saved = digest(learner_state(algo))
    for _ in range(more):
        algo.train()
    uninterrupted = digest(learner_state(algo))
    algo.stop()

    ours = ppo_config(cfg).build_algo()  # resumes on build (the plan is printed)
    cp = checkpointing(ours)
    ours_restore = cp.restore_seconds
    ours_note = "; ".join(cp.restored.warnings) or "(the restore reported an exact resume)"
    ours_exact = digest(learner_state(ours)) == saved
    t = time.perf_counter()
    ours.train()  # the first iteration after the restore: the EnvRunners take the sent weights before sampling
    ours_first = time.perf_counter() - t
    for _ in range(more - 1):
        ours.train()
    ours_resume = digest(learner_state(ours)) == uninterrupted
    cp.engine.wait()
    newest = cp.engine.snapshots()[-1]
    flip_byte(largest_file(os.path.join(base, cfg["run_name"], newest.snapshot_id)))
    plan = cp.engine.plan_recovery(deep=True)
    cp.close()
    ours.stop()

    theirs = ppo_config(dict(cfg, run_name=None)).build_algo()
    t = time.perf_counter()
    theirs.restore_from_path(os.path.join(rllib_dir, str(at)))
    theirs_restore = time.perf_counter() - t
    theirs_exact = digest(learner_state(theirs)) == saved
    t = time.perf_counter()
    theirs.train()
    theirs_first = time.perf_counter() - t
    for _ in range(more - 1):
        theirs.train()
    theirs_resume = digest(learner_state(theirs)) == uninterrupted
    rl_bytes, pickles = folder_bytes(os.path.join(rllib_dir, str(at)))
    target = largest_file_any(os.path.join(rllib_dir, str(at)))
    flip_byte(target)
    try:
        theirs.restore_from_path(os.path.join(rllib_dir, str(at)))
        same = digest(learner_state(theirs)) == saved
        corrupt = "loaded, " + ("same numbers" if same else "other numbers than saved")
    except Exception as exc:  # what RLlib does with a damaged file is the figure
        corrupt = f"raised {type(exc).__name__}"
    theirs.stop()
    skipped = next((c for c in plan.candidates if c.snapshot_id == newest.snapshot_id), None)
    return {
        "size": size,
        "at": at,
        "more": more,
        "ours_blocked": statistics.median(ours_blocked),
        "theirs_blocked": statistics.median(rllib_blocked),
        "ours_first_save": ours_blocked[0],
        "theirs_first_save": rllib_blocked[0],
        "saves": len(ours_blocked),
        "ours_bytes": snap_bytes,
        "theirs_bytes": rl_bytes,
        "pickles": pickles,
        "ours_restore": ours_restore,
        "theirs_restore": theirs_restore,
        "ours_first": ours_first,
        "theirs_first": theirs_first,
        "ours_exact": ours_exact,
        "theirs_exact": theirs_exact,
        "ours_resume": ours_resume,
        "ours_note": ours_note,
        "theirs_resume": theirs_resume,
        "ours_corrupt": f"{newest.snapshot_id} refused ({skipped.reason if skipped else '?'}); restores {plan.target}",
        "theirs_corrupt": f"{corrupt} ({os.path.basename(target)})",
    }


def largest_file_any(folder: str) -> str:
    files = [os.path.join(d, n) for d, _, names in os.walk(folder) for n in names]
    return max(files, key=os.path.getsize)


def table(r: dict) -> str:
    def row(name: str, a: str, b: str, ratio: str = "") -> str:
        return f"  {name:<36} {a:<30} {b:<30} {ratio}"

    def mb(n: int) -> str:
        return f"{n / 2**20:.1f} MiB"

    yes = {True: "YES", False: "NO"}
    return "\n".join(
        [
            f"size {r['size']}: checkpoint every {r['at'] // r['saves']} iterations ({r['saves']} saves); resume after "
            f"iteration {r['at']}, "
            f"{r['more']} more",
            row("", "rl_ckpt", "RLlib save_to_path", "rl_ckpt / RLlib"),
            row(
                f"train() blocked (median of {r['saves']} saves)",
                f"{r['ours_blocked'] * 1000:.1f} ms",
                f"{r['theirs_blocked'] * 1000:.1f} ms",
                f"{r['ours_blocked'] / r['theirs_blocked']:.2f}x",
            ),
            row(
                "  the first save (buffers allocated)",
                f"{r['ours_first_save'] * 1000:.1f} ms",
                f"{r['theirs_first_save'] * 1000:.1f} ms",
                f"{r['ours_first_save'] / r['theirs_first_save']:.2f}x",
            ),
            row(
                "checkpoint bytes",
                mb(r["ours_bytes"]),
                f"{mb(r['theirs_bytes'])} ({r['pickles']} .pkl)",
                f"{r['ours_bytes'] / r['theirs_bytes']:.2f}x",
            ),
            row(
                "restore time (fresh Algorithm)",
                f"{r['ours_restore']:.3f} s",
                f"{r['theirs_restore']:.3f} s",
                f"{r['ours_restore'] / r['theirs_restore']:.2f}x",
            ),
            row(
                "restore + first train()",
                f"{r['ours_restore'] + r['ours_first']:.3f} s",
                f"{r['theirs_restore'] + r['theirs_first']:.3f} s",
                f"{(r['ours_restore'] + r['ours_first']) / (r['theirs_restore'] + r['theirs_first']):.2f}x",
            ),
            row("learner state after restore = saved", yes[r["ours_exact"]], yes[r["theirs_exact"]]),
            row(f"= uninterrupted after {r['more']} more", yes[r["ours_resume"]], yes[r["theirs_resume"]]),
            row("a flipped byte in the largest file", "refused (checksum), falls back", r["theirs_corrupt"]),
            f"  rl_ckpt's plan: {r['ours_corrupt']}",
        ]
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="default,large")
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--saves", type=int, default=3, help="checkpoints before the resume point")
    p.add_argument("--more", type=int, default=2, help="iterations after the restore (at least 1)")
    p.add_argument("--dir", default=None, help="parent of the temporary run folder")
    args = p.parse_args(argv)
    if min(args.more, args.every, args.saves) < 1:
        p.error("--every, --saves and --more must be at least 1")
    import ray

    base = tempfile.mkdtemp(prefix="rllib-compare-", dir=args.dir)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        results = [measure(size, base, args.every, args.saves, args.more) for size in args.sizes.split(",")]
    finally:
        ray.shutdown()
        shutil.rmtree(base, ignore_errors=True)
    print()
    for r in results:
        print(table(r))
        print()
    for r in results:
        if not r["ours_resume"]:
            print(f"size {r['size']}: rl_ckpt's resumed run differs from the uninterrupted one: {r['ours_note']}")
        if not r["theirs_resume"]:
            print(
                f"size {r['size']}: RLlib's resumed run differs from the uninterrupted one: its checkpoint holds no "
                "EnvRunner state (environments, episodes, random streams) nor PPO's KL coefficient."
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
