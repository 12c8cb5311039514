"""``rl-ckpt bench rllib``: rl_ckpt's RLlib restore and save next to RLlib's own, in paired rounds of one run.

    rl-ckpt bench rllib [--size default|large] [--rounds 9] [--no-env-runners] [--json FILE]

One PPO Algorithm (CartPole-v1, 2 EnvRunners with a ``MeanStdFilter``, CPU, 256 env steps per iteration; the
crash drill's config, ``rl_ckpt/demo/rllib_drill.py``) with rl_ckpt's ``CheckpointCallback`` saving after every
iteration, on a local Ray of its own (2 CPUs). ``--size``: RLlib's default CartPole module (2x256 hidden) or
``large`` (3x2048, a 96 MiB checkpoint with Adam). Two warm-up iterations, then ``--rounds`` rounds of each,
every round a pair measured back to back:

- ``save``: one ``train()``; ``blocked``: the time the callback held it for rl_ckpt's save (the staging; the
  write runs in the background; arming the EnvRunners the iteration before counts too), then, once that write
  landed, RLlib's ``save_to_path`` of the same state (all of it blocking);
- ``restore``: the newest snapshot restored into the live Algorithm by ``restore_algorithm`` (plan, verified
  read, every part set through RLlib, the weights and each EnvRunner's sampling state sent, not awaited), and
  RLlib's ``restore_from_path`` of its checkpoint of the same iteration (unpickling, the same ``set_state``
  calls, its weight sync, not awaited). Before each timed restore the EnvRunners have answered a no-op call:
  what the previous one sent them is done, on both sides. Also the CPU time of this process for each (less
  sensitive to the machine's load than the wall-clock time).

``--no-env-runners``: without the EnvRunners' sampling state (``checkpoint_callback(env_runners=False)``: the
resumed run is then not exact), to see what taking it costs.

The figures are the medians of the rounds' ratios (and their range); wall-clock time on this machine as it is
(``loadavg`` says how loaded it was).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from rl_ckpt.tools.bench.common import log, print_json, rmtree

SIZES = {"default": None, "large": (2048, 2048, 2048)}


def _idle(algo) -> None:
    """Every EnvRunner has run what it was sent (one call each, awaited)."""
    algo.env_runner_group.foreach_env_runner(lambda runner: None, local_env_runner=False)


def measure(size: str, rounds: int, base: str, env_runners: bool = True) -> dict:
    from rl_ckpt.demo.rllib_drill import ppo_config
    from rl_ckpt.integrations.rllib import checkpointing, restore_algorithm

    cfg = dict(base_dir=base, run_name=f"ppo_{size}", every=1, hidden=SIZES[size], keep_latest=3, resume=False)
    cfg["env_runners"] = env_runners
    rllib_dir = os.path.join(base, f"rllib_{size}")
    algo = ppo_config(cfg).build_algo()
    try:
        cp = checkpointing(algo)
        for _ in range(2):
            algo.train()
        saves = []
        for _ in range(rounds):
            algo.train()
            blocked = cp.blocked[-1]
            cp.engine.wait()  # rl_ckpt's background write is done: RLlib's save is timed alone
            started = time.perf_counter()
            algo.save_to_path(os.path.join(rllib_dir, "latest"))
            saves.append((blocked, time.perf_counter() - started))
        cp.engine.wait()
        restores, cpu = [], []
        for _ in range(rounds):
            _idle(algo)
            started, cpu0 = time.perf_counter(), time.process_time()
            restore_algorithm(algo, cp.engine, out=None)
            ours, ours_cpu = time.perf_counter() - started, time.process_time() - cpu0
            _idle(algo)
            started, cpu0 = time.perf_counter(), time.process_time()
            algo.restore_from_path(os.path.join(rllib_dir, "latest"))
            restores.append((ours, time.perf_counter() - started))
            cpu.append((ours_cpu, time.process_time() - cpu0))
        cp.close()
    finally:
        algo.stop()
    return {
        "size": size,
        "env_runners": env_runners,
        "rounds": rounds,
        "save": _figures(saves),
        "restore": _figures(restores),
        "restore_cpu": _figures(cpu),
    }


def _figures(pairs: list[tuple[float, float]]) -> dict:
    ratios = [a / b for a, b in pairs]
    return {
        "ours_s": statistics.median(a for a, _ in pairs),
        "rllib_s": statistics.median(b for _, b in pairs),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "pairs": pairs,
    }


def table(r: dict) -> str:
    def row(name: str, f: dict, theirs: str) -> str:
        return (
            f"  {name:<34} {f['ours_s'] * 1000:8.1f} ms   {theirs:<22} {f['rllib_s'] * 1000:8.1f} ms   "
            f"{f['ratio']:.2f}x (rounds {f['ratio_min']:.2f}-{f['ratio_max']:.2f}x)"
        )

    return "\n".join(
        [
            f"RLlib PPO, size {r['size']}, {r['rounds']} paired rounds (medians; load average {r['loadavg']})"
            + ("" if r["env_runners"] else "; without the EnvRunners' sampling state"),
            f"  {'':<34} {'rl_ckpt':>11}   {'RLlib':<22} {'':>11}   rl_ckpt / RLlib",
            row("train() blocked by a save", r["save"], "save_to_path"),
            row("restore alone (live Algorithm)", r["restore"], "restore_from_path"),
            row("  its CPU time (this process)", r["restore_cpu"], "restore_from_path"),
        ]
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="rl-ckpt bench rllib", description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="default")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--dir", default=None, help="parent of the temporary run folder")
    p.add_argument(
        "--no-env-runners", action="store_true", help="save without the EnvRunners' sampling state (not exact)"
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    import ray

    base = tempfile.mkdtemp(prefix="rl-ckpt-bench-rllib-", dir=args.dir)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        log(f"RLlib PPO ({args.size}): {args.rounds} rounds of save and of restore ...")
        result = measure(args.size, args.rounds, base, env_runners=not args.no_env_runners)
    finally:
        ray.shutdown()
        rmtree(base)
    result["loadavg"] = " ".join(open("/proc/loadavg").read().split()[:3])
    print(table(result))
    if args.json:
        print_json(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
