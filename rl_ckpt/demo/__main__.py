"""``rl-ckpt demo``: the crash drill, end to end, with a summary a person can read.

PPO on CartPole-v1 saves on a schedule (async, full + light layers, keep-best
on average reward); the training process is SIGKILLed mid-run; a new process
plans the recovery (the coordinator decides from the failure), restores,
verifies the probe, and finishes the run. The result is compared with a run
that never crashed, bit for bit. Exit 0 only if recovery was exact.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from ..catalog import Catalog
from ..storage import open_storage
from .drill import crash_drill


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def summarize(result, cfg: dict, steps: int) -> str:
    storage = open_storage(f"{cfg['base_dir'].rstrip('/')}/{cfg['run_name']}")
    cat = Catalog(storage)
    cat.refresh()
    snaps = cat.snapshots()
    full = [i for i in snaps if i.kind == "full"]
    light = [i for i in snaps if i.kind == "light"]
    crashed_at = result.crashed.killed_at
    restored = result.restored_step
    lost_steps = crashed_at - restored
    per_step = result.reference.seconds / max(steps, 1)
    plan = result.resumed.restored.get("plan", "") if result.resumed.restored else ""
    decision = next((ln.split("decision:", 1)[1].strip() for ln in plan.splitlines() if "decision:" in ln), "-")
    lines = [
        "rl_ckpt demo: PPO on CartPole-v1, SIGKILL mid-run, verified exact restart",
        f"  storage            {storage.url}",
        f"  snapshots kept     {len(full)} full, {len(light)} light, {_human(sum(i.size_bytes for i in snaps))}",
        f"  failure            SIGKILL of the training process at step {crashed_at}",
        f"  decision           {decision}",
        f"  restored           {result.resumed.restored.get('snapshot')} (step {restored})",
        f"  time lost          {lost_steps} steps (~{lost_steps * per_step:.1f} s of training) redone",
        f"  final avg reward   {result.resumed.rewards.get(steps, float('nan')):.1f} at step {steps}",
        f"  matches uninterrupted run: parameters {'YES' if result.params_equal else 'NO'}, "
        f"losses {'YES' if result.losses_equal else 'NO'}",
        "",
        "Recovery plan used by the restarted process:",
        plan,
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="rl-ckpt demo", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--crash-at", type=int, default=37, help="SIGKILL the training process at this step")
    p.add_argument("--base-dir", help="where to write snapshots (default: a fresh temp folder)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0 < args.crash_at < args.steps:
        p.error("--crash-at must be between 0 and --steps")
    base = args.base_dir or tempfile.mkdtemp(prefix="rl-ckpt-demo-")
    cfg = {"base_dir": base, "run_name": "ppo_cartpole", "save_interval_steps": 10, "save_interval_seconds": None,
           "light_interval_steps": 0, "keep_latest": 3, "keep_best": 1}
    print(f"running: reference run, crashed run (SIGKILL at step {args.crash_at}), resumed run ...", file=sys.stderr)
    result = crash_drill(cfg, args.steps, args.crash_at, seed=args.seed)
    print(summarize(result, cfg, args.steps))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
