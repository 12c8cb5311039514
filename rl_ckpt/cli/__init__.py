"""``rl-ckpt``: look at, check and tidy checkpoint runs from the shell.

Exit codes: 0 all is well, 1 a problem was found (corrupt snapshot, failed
check), 2 bad usage (unknown snapshot or component, bad arguments).
URL is a run folder: ``<base_dir>/<run_name>`` (a path, file://, s3://, memory://).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from rl_ckpt.cli._commands import (
    EXIT_PROBLEM,
    EXIT_USAGE,
    cmd_bench,
    cmd_export,
    cmd_gc,
    cmd_inspect,
    cmd_ls,
    cmd_plan,
    cmd_scrub,
    cmd_timeline,
    cmd_verify,
)
from rl_ckpt.cli._memory import add_memory_parser
from rl_ckpt.errors import CheckpointError, ConfigError, UsageError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rl-ckpt", description=__doc__.split("\n")[0])
    p.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    sub = p.add_subparsers(dest="command", required=True)

    def cmd(name: str, func, help: str, *, needs_id: bool | None = False) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help, description=help)
        s.add_argument("url", help="run folder: <base_dir>/<run_name>")
        if needs_id is True:
            s.add_argument("snapshot_id")
        elif needs_id is None:
            s.add_argument("snapshot_id", nargs="?")
        s.add_argument("--config", help="YAML config to take storage_options from")
        s.add_argument(
            "--storage-option", action="append", metavar="KEY=VALUE", help="fsspec storage option (repeatable)"
        )
        s.set_defaults(func=func)
        return s

    s = cmd("ls", cmd_ls, "list snapshots: id, step, kind, size, metrics, valid (exit 1 if any is bad)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--deep", action="store_true", help="re-hash every file instead of checking sizes")
    s.add_argument(
        "--tiers",
        action="store_true",
        help="also list the run's memory tier (from its memory stores on the Ray cluster) and say which "
        "tiers hold each snapshot",
    )
    s.add_argument("--replicas", type=int, default=1, help="with --tiers: the run's memory_replicas")
    cmd("verify", cmd_verify, "re-hash snapshots against their manifests (exit 1 if anything is bad)", needs_id=None)
    s = cmd("inspect", cmd_inspect, "show one snapshot's manifest: components, tensors, files, metrics", needs_id=True)
    s.add_argument("--json", action="store_true")
    s.add_argument("--max-tensors", type=int, default=20)
    s = cmd("plan", cmd_plan, "print the recovery plan: which snapshot, why, what loads, what is checked")
    s.add_argument("--quick", action="store_true", help="check sizes only instead of re-hashing the candidates")
    s.add_argument(
        "--failure",
        choices=["exception", "nan_loss", "process_killed", "oom", "heartbeat_lost"],
        help="plan the recovery from this kind of failure (the coordinator decides)",
    )
    s.add_argument("--step", type=int, help="the step the failure happened at")
    s = cmd("scrub", cmd_scrub, "re-hash every snapshot at a bounded rate; quarantine corrupt ones (exit 1 if any)")
    s.add_argument("--rate-mib", type=float, default=0, help="read-rate limit in MiB/s (default: unlimited)")
    s.add_argument("--min-free-gib", type=float, default=1.0, help="warn (exit 1) below this much free space")
    s = cmd(
        "timeline",
        cmd_timeline,
        "draw the run: reward curve, snapshots (full/light, kept/deleted, best), crash and resume",
    )
    s.add_argument("-o", "--output", required=True, help="output .png")
    s.add_argument("--metric", default="avg_reward")
    s.add_argument("--log", help="a JSON-lines step log with per-step metrics to draw as the curve")
    sub.add_parser("demo", help="run the crash drill: PPO, SIGKILL mid-run, verified exact restart (rl-ckpt demo -h)")
    s = cmd("gc", cmd_gc, "remove debris of crashed saves (never a committed snapshot)")
    s.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    s.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="leave debris younger than this alone: a save may still be writing it (default 3600)",
    )
    s = cmd(
        "export",
        cmd_export,
        "write one component's tensors (plain or sharded) as a safetensors file or a Hugging Face folder",
        needs_id=True,
    )
    s.add_argument("component")
    s.add_argument(
        "-o",
        "--output",
        required=True,
        help="output .safetensors file (--format hf: a new folder): a path or a storage URL such as "
        "s3://bucket/model (written with the run's --storage-option/--config options)",
    )
    s.add_argument(
        "--format",
        choices=["safetensors", "hf"],
        default="safetensors",
        help="safetensors: one file (default); hf: model-0000x-of-0000y.safetensors + model.safetensors.index.json",
    )
    s.add_argument("--max-shard-size", default="5GB", help="--format hf: largest shard file, e.g. 5GB, 500MB, 64MiB")
    s.add_argument(
        "--strip-prefix",
        default=None,
        metavar="PREFIX",
        help="remove PREFIX from tensor names that start with it (e.g. 'module.')",
    )
    from rl_ckpt.tools.bench import add_arguments as _bench_arguments

    s = sub.add_parser(
        "bench",
        help="benchmark save/restore vs raw I/O, torch.save, DCP and safetensors (local folder)",
        description="benchmark save/restore vs raw I/O, torch.save, DCP and safetensors (local folder); "
        "`rl-ckpt bench weights --help`: policy versions to rollout actors; "
        "`rl-ckpt bench s3 --help`: S3 through real latency, next to boto3's s3transfer; "
        "`rl-ckpt bench rllib --help`: RLlib's save_to_path and restore_from_path next to rl_ckpt's",
    )
    _bench_arguments(s)
    s.set_defaults(func=cmd_bench)
    add_memory_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # the demo has its own flags
        from rl_ckpt.demo.__main__ import main as demo_main

        return demo_main(argv[1:])
    if argv[:2] == ["bench", "weights"]:  # policy versions to rollout actors, on a Ray cluster of its own
        from rl_ckpt.tools.bench.weights import main as weights_main

        return weights_main(argv[2:])
    if argv[:2] == ["bench", "s3"]:  # S3 through a latency proxy, next to s3transfer; servers of its own
        from rl_ckpt.tools.bench.s3 import main as s3_main

        return s3_main(argv[2:])
    if argv[:2] == ["bench", "rllib"]:  # RLlib's save_to_path / restore_from_path next to ours, on a Ray of its own
        from rl_ckpt.tools.bench.rllib import main as rllib_main

        return rllib_main(argv[2:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 0 for --help, 2 for bad usage
        return int(exc.code or 0)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return args.func(args)
    except (UsageError, ConfigError) as exc:
        print(f"rl-ckpt {args.command}: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except CheckpointError as exc:
        print(f"rl-ckpt {args.command}: {_one_line(exc)}", file=sys.stderr)
        return EXIT_PROBLEM


def _one_line(exc: Exception) -> str:
    """An error as one line: scripts read the first line of stderr, and a forged name may hold newlines."""
    return "; ".join(part.strip() for part in str(exc).splitlines() if part.strip())
