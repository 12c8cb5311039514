"""``rl-ckpt memory ls`` / ``rl-ckpt memory drop RUN``: the runs holding memory on a Ray cluster, and releasing
one when it is over (its memory-snapshot and policy-version stores on every node, its service and memory manager).
"""

from __future__ import annotations

import json
import os

from rl_ckpt.errors import CheckpointError

EXIT_OK, EXIT_PROBLEM = 0, 1


def _connect(args) -> None:
    """Join the Ray cluster (``--address``, else the one running on this machine) unless already connected."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # an explicit address needs the cluster's token mode
    try:
        ray.init(address=args.address or "auto", logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        raise CheckpointError(
            f"no Ray cluster reachable at {args.address or 'auto'} ({exc}); pass --address of the cluster that "
            "ran the run (e.g. ray://head:10001 or 127.0.0.1:6379)"
        ) from exc


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_memory_ls(args) -> int:
    from actors.memory_tier import memory_runs

    _connect(args)
    runs = memory_runs(namespace=args.namespace)
    if args.json:
        print(json.dumps(runs, indent=2))
        return EXIT_OK
    if not runs:
        print("no run holds memory on this cluster")
        return EXIT_OK
    print(f"{'run':<28} {'holds':<34} {'nodes':>5} {'bytes':>11}  service")
    for r in runs:
        holds = ", ".join(f"{k}: {len(h['snapshots'])} snapshot(s)" for k, h in r["holds"].items())
        nodes = len({n for h in r["holds"].values() for n in h["nodes"]})
        print(f"{r['run']:<28} {holds:<34} {nodes:>5} {_size(r['bytes']):>11}  {'yes' if r['service'] else 'no'}")
    return EXIT_OK


def cmd_memory_drop(args) -> int:
    from actors.memory_tier import release_run

    _connect(args)
    report = release_run(args.run, namespace=args.namespace, flush=not args.no_flush, force=args.force)
    if args.json:
        print(json.dumps(report, indent=2))
        return EXIT_OK
    freed = sum(sum(nodes.values()) for nodes in report["stores"].values())
    stores = sum(len(nodes) for nodes in report["stores"].values())
    if report["flushed"]:
        print(f"copied {report['flushed']} to durable storage first")
    print(f"released run {args.run}: {stores} store(s), {_size(freed)}; stopped {', '.join(report['actors']) or '-'}")
    if report["lost"]:
        print(f"WARNING: released without a durable copy (--force): {', '.join(report['lost'])}")
    return EXIT_OK


def add_memory_parser(sub) -> None:
    s = sub.add_parser(
        "memory",
        help="runs holding memory on the Ray cluster (memory tier, policy versions); release one when it is over",
        description="runs holding memory on the Ray cluster: `memory ls`; `memory drop RUN` frees a finished run's "
        "stores on every node, its service and memory manager (the newest memory snapshot is copied to durable "
        "storage first; durable storage is never touched)",
    )
    verbs = s.add_subparsers(dest="verb", required=True)
    for verb, func, help in (
        ("ls", cmd_memory_ls, "list the runs holding memory: what, on how many nodes, how many bytes"),
        ("drop", cmd_memory_drop, "release a finished run's memory (refused while it trains or would lose data)"),
    ):
        v = verbs.add_parser(verb, help=help, description=help)
        if verb == "drop":
            v.add_argument("run", help="the run's name (run_name)")
            v.add_argument("--force", action="store_true", help="release even while it trains or loses snapshots")
            v.add_argument("--no-flush", action="store_true", help="do not copy the newest memory snapshot first")
        v.add_argument("--address", help="the Ray cluster (default: the one running on this machine)")
        v.add_argument("--namespace", default="rl_ckpt", help="the Ray namespace of the run's stores")
        v.add_argument("--json", action="store_true")
        v.set_defaults(func=func)
