#!/usr/bin/env python
"""Two versions of rl_ckpt restoring the same snapshot, alternating, next to a raw read of the same bytes.

    python benchmarks/restore_ab.py --base PATH --new PATH [--size 1GiB] [--rounds 4] [--dir DIR]

``--base`` and ``--new`` are checkouts of the repository (``git worktree add`` or ``git archive`` of two
commits). The bench's synthetic state (model + Adam after one step, ``--size``) is saved once by ``--new``
(the file format is the same for both); then, each round: a raw read of the same tensor bytes (cold cache,
64 MiB reads into one buffer), and each version (their order alternating) restoring the snapshot in a new
process into a model and optimizer built there (not timed), after ``posix_fadvise(DONTNEED)`` of its files.
Prints each round, the new version's breakdown (``RestoreResult.timings`` where it has them) and the medians
of the per-round ratios: new / base, new / raw read, base / raw read. A shared machine moves single figures;
the rounds pair them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import gc, json, sys, time
import torch
torch.set_num_threads(1)
from rl_ckpt import CheckpointEngine
from rl_ckpt.tools.bench.common import parse_size
from rl_ckpt.tools.bench.state import build_state
model, opt, _ = build_state(parse_size(sys.argv[2]), None, seed=1)
engine = CheckpointEngine(base_dir=sys.argv[1], run_name="ab", retention=False, post_load_check=False)
engine.register("policy", model)
engine.register("optimizer", opt)
gc.collect()
started = time.perf_counter()
result = engine.restore()
took = time.perf_counter() - started
timings = getattr(result, "timings", {})
print(json.dumps({"restore": took, "timings": timings, "module": __import__("rl_ckpt").__file__}))
"""


def evict(path: str) -> None:
    files = [path] if os.path.isfile(path) else [os.path.join(r, n) for r, _d, fs in os.walk(path) for n in fs]
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def restore_in(root: str, workdir: str, size: str) -> dict:
    env = dict(os.environ, PYTHONPATH=root)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, workdir, size], env=env, capture_output=True, text=True, cwd=workdir
    )
    if done.returncode:
        raise RuntimeError(f"the restore in {root} failed:\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    if not os.path.realpath(got["module"]).startswith(os.path.realpath(root)):
        raise RuntimeError(f"{root}: rl_ckpt was imported from {got['module']}")
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="a checkout of the version to compare against")
    parser.add_argument("--new", required=True, help="a checkout of the version measured")
    parser.add_argument("--size", default="1GiB", help="state size (model + Adam), default 1GiB")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dir", default=None, help="folder to write into (default: the temp dir)")
    args = parser.parse_args(argv)
    sys.path.insert(0, args.new)
    from rl_ckpt import CheckpointEngine
    from rl_ckpt.tools.bench.baselines import raw_read, raw_write
    from rl_ckpt.tools.bench.common import parse_size
    from rl_ckpt.tools.bench.state import build_state, byte_views, flat_tensors

    workdir = tempfile.mkdtemp(prefix="restore-ab-", dir=args.dir)
    try:
        model, opt, _ = build_state(parse_size(args.size), None)
        engine = CheckpointEngine(base_dir=workdir, run_name="ab", retention=False, post_load_check=False)
        engine.register("policy", model)
        engine.register("optimizer", opt)
        engine.save(1)
        raw = os.path.join(workdir, "raw.bin")
        raw_write(raw, byte_views(list(flat_tensors(model, opt).values())))
        del model, opt, engine
        rounds = []
        for r in range(args.rounds):
            row: dict = {}
            evict(raw)
            started = time.perf_counter()
            buf = raw_read(raw)
            row["raw"] = time.perf_counter() - started
            del buf
            order = [("base", args.base), ("new", args.new)]
            for name, root in order if r % 2 == 0 else order[::-1]:
                evict(os.path.join(workdir, "ab"))
                got = restore_in(root, workdir, args.size)
                row[name], row[f"{name}_timings"] = got["restore"], got["timings"]
            row["loadavg"] = os.getloadavg()[0]
            rounds.append(row)
            shown = {k: round(v, 3) for k, v in row.items() if isinstance(v, float)}
            print(json.dumps(shown), "new:", {k: round(v, 3) for k, v in row["new_timings"].items()}, flush=True)

        def med(a: str, b: str) -> float:
            return statistics.median(x[a] / x[b] for x in rounds)

        print(
            f"medians of the per-round ratios: new / base {med('new', 'base'):.2f}, new / raw read "
            f"{med('new', 'raw'):.2f}, base / raw read {med('base', 'raw'):.2f}"
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
