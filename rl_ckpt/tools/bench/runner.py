"""The ``rl-ckpt bench`` command: arguments, the chosen run, its output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile

from rl_ckpt.tools.bench.common import (
    BenchUsageError,
    CacheDropper,
    DEFAULT_COUNTS,
    DEFAULT_SIZES,
    free_page_reporting,
    fs_info,
    loadavg,
    local_path,
    log,
    rmtree,
)
from rl_ckpt.tools.bench.compare import run_compare
from rl_ckpt.tools.bench.model import MODELS, format_model, run_model
from rl_ckpt.tools.bench.report import format_compare, format_scaling, plot
from rl_ckpt.tools.bench.scaling import run_scaling

DESCRIPTION = "``rl-ckpt bench``: how fast rl_ckpt saves and restores, next to the floor and its peers, in one run."


def run(args) -> dict:
    import torch

    base = local_path(args.url)
    os.makedirs(base, exist_ok=True)
    if args.repeat < 1:
        raise BenchUsageError("--repeat must be >= 1")
    if args.tensors is not None and args.tensors < 4:
        raise BenchUsageError("--tensors must be >= 4")
    if args.threads < 0:
        raise BenchUsageError("--threads must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    workdir = tempfile.mkdtemp(prefix="rl-ckpt-bench-", dir=base)
    cache = CacheDropper(args.cache)
    out: dict = {
        "mode": "scaling" if args.scaling else "compare",
        "url": args.url,
        "workdir": workdir,
        "repeat": args.repeat,
        "host": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "fs": fs_info(workdir),
            "page_reporting": free_page_reporting(),
        },
        "cache": {"method": cache.method, "note": cache.note},
    }
    la0 = loadavg()
    try:
        if args.scaling:
            out["scaling"] = run_scaling(args, workdir, cache)
            out["load"] = {"other_cores_mean": None, "other_cores_max": None}
        elif args.model:
            out["mode"] = "model"
            out.update(run_model(args, workdir, cache))
            out["goals_met"] = sum(1 for g in out["goals"] if g["met"])
            out["goals_total"] = len(out["goals"])
        else:
            out.update(run_compare(args, workdir, cache))
            if args.fresh:
                from rl_ckpt.tools.bench.fresh import run_fresh  # (needs Ray)

                try:
                    out["fresh"] = run_fresh(args, workdir, cache)
                except Exception as exc:  # noqa: BLE001 - e.g. Ray did not start: the figures above still count
                    log(f"bench --fresh failed: {type(exc).__name__}: {exc}")
                    out["fresh"] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            out["goals_met"] = sum(1 for g in out["goals"] if g["met"])
            out["goals_total"] = sum(1 for g in out["goals"] if g["met"] is not None)
            out["ratios"] = out.pop("ratios")
    finally:
        if not args.keep:
            rmtree(workdir)
    out["load"].update({"loadavg_start": la0, "loadavg_end": loadavg()})
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="local folder to write into (a path or file://)")
    p.add_argument("--size", default="1GiB", help="state size (model + Adam), e.g. 64MiB, 1GiB (default 1GiB)")
    p.add_argument(
        "--tensors",
        type=int,
        default=None,
        metavar="N",
        help="about N tensors in the saved state (default: from the size)",
    )
    p.add_argument("--repeat", type=int, default=3, help="repeats per measurement; medians are reported (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.add_argument("--plot", metavar="FILE.png", help="draw grouped bars (matplotlib, Agg)")
    p.add_argument(
        "--variants", action="store_true", help="also time engine.save with xxh3_128 and/or verify_after_write=False"
    )
    p.add_argument(
        "--cache",
        choices=["drop", "fadvise", "none"],
        default="drop",
        help="how reads are made cold: drop_caches (falls back to fadvise), fadvise, none",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch intra-op threads while measuring (default 1: on a shared machine OpenMP spin-waits make "
        "multi-threaded copies erratic; 0 keeps torch's default)",
    )
    p.add_argument(
        "--scaling",
        action="store_true",
        help="instead: how cost grows with state size (--sizes) and snapshot count (--counts)",
    )
    p.add_argument("--sizes", default=None, help=f"with --scaling: state sizes (default {DEFAULT_SIZES})")
    p.add_argument("--counts", default=None, help=f"with --scaling: snapshot counts (default {DEFAULT_COUNTS})")
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default=None,
        help="instead: a real transformers GPT-2 shaped model + AdamW (random init, no download) vs "
        "torch.save+fsync and torch.load+load_state_dict; gpt2-small = GPT2Config() defaults (124M)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="also: the first restore in a new process (a Ray actor, as a restarted rank), from the memory tier and "
        "from local disk, next to one memcpy of the state in that process (starts a local Ray cluster if needed)",
    )
    p.add_argument("--keep", action="store_true", help="keep the files written")
    p.add_argument("--fail-on-miss", action="store_true", help="exit 1 when a goal is missed")
    p.add_argument(
        "--sharded",
        action="store_true",
        help="instead: FSDP2 save and resharding restore on --ranks gloo processes, next to DCP's save/load",
    )
    p.add_argument("--ranks", default="2,4", help="with --sharded: world sizes to save and restore on (default 2,4)")


def main_args(args) -> int:
    """Run the bench for parsed ``args``; prints the table (or JSON); returns the exit code."""
    if args.sharded:
        # spawns gloo processes: imported only when asked
        from rl_ckpt.tools.bench.sharded import main_args as sharded_main

        return sharded_main(args)
    try:
        out = run(args)
    except BenchUsageError as exc:
        print(f"rl-ckpt bench: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        plot(out, args.plot)
        log(f"bench: wrote {args.plot}")
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        print({"scaling": format_scaling, "model": format_model}.get(out["mode"], format_compare)(out))
    if args.fail_on_miss and out["mode"] in ("compare", "model") and out["goals_met"] < out["goals_total"]:
        return 1
    return 1 if (out.get("fresh") or {}).get("error") else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rl-ckpt bench", description=DESCRIPTION)
    add_arguments(p)
    return main_args(p.parse_args(argv))
