"""What a process of the engine pays to start: the imports of each kind of process, in fresh interpreters, next to
``import torch`` and a bare interpreter measured in the same run, and (with ``--ray``) the time from creating a
``CheckpointManager`` actor to its first answer, next to a trivial actor's.

    python benchmarks/process_start.py [--rounds 5] [--ray]

Every figure is the median of ``--rounds`` fresh processes, taken in turns (one of each kind per round), so the
machine's load falls on all of them alike. A manager, a memory store and the CLI import neither torch nor Ray
Train: their ratio to ``import torch`` is what each start (and each restart of a manager) saves."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

KINDS = {
    "bare interpreter": "pass",
    "import torch (baseline)": "import torch",
    "import rl_ckpt": "import rl_ckpt",
    "CheckpointManager actor module": "import actors.manager",
    "memory store actor module": "import actors._memory.store",
    "rollout worker module (demo)": "import rl_ckpt.demo.ppo_rollout",
    "the engine (CheckpointEngine)": "from rl_ckpt import CheckpointEngine",
}
CLI = {"rl-ckpt --help": [sys.executable, "-m", "rl_ckpt.cli", "--help"]}


def timed(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def imports(rounds: int) -> dict[str, float]:
    runs: dict[str, list[float]] = {k: [] for k in [*KINDS, *CLI]}
    for _ in range(rounds):
        for kind, code in KINDS.items():
            runs[kind].append(timed([sys.executable, "-c", code]))
        for kind, argv in CLI.items():
            runs[kind].append(timed(argv))
    return {k: statistics.median(v) for k, v in runs.items()}


def actor_starts(rounds: int) -> dict[str, float]:
    import tempfile

    import ray

    from actors import CheckpointManager

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")

    @ray.remote(num_cpus=0)
    class Trivial:
        def ping(self) -> int:
            return 0

    runs: dict[str, list[float]] = {"trivial actor": [], "CheckpointManager actor": []}
    with tempfile.TemporaryDirectory() as base:
        ray.get(Trivial.remote().ping.remote())  # Ray's own first-actor costs, untimed
        for i in range(rounds):
            started = time.perf_counter()
            trivial = Trivial.remote()
            ray.get(trivial.ping.remote())
            runs["trivial actor"].append(time.perf_counter() - started)
            started = time.perf_counter()
            manager = CheckpointManager.get_or_create(run_name=f"start-{i}", base_dir=base)
            ray.get(manager.snapshots.remote())
            runs["CheckpointManager actor"].append(time.perf_counter() - started)
            ray.kill(trivial)
            ray.kill(manager)
    ray.shutdown()
    return {k: statistics.median(v) for k, v in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ray", action="store_true", help="also time a CheckpointManager actor's start")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    figures = {"imports": imports(args.rounds)}
    torch_s = figures["imports"]["import torch (baseline)"]
    print(f"fresh processes, medians of {args.rounds}:")
    for kind, seconds in figures["imports"].items():
        print(f"  {kind:34s} {seconds:7.3f} s   {seconds / torch_s:5.2f} x import torch")
    if args.ray:
        figures["actors"] = actor_starts(args.rounds)
        trivial = figures["actors"]["trivial actor"]
        print("actor created -> first answer, medians:")
        for kind, seconds in figures["actors"].items():
            print(f"  {kind:34s} {seconds:7.3f} s   {seconds / trivial:5.2f} x a trivial actor")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
