"""Runs the chosen scenarios and prints the report: ``run_suite`` and the command line."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import os
import platform
import sys
import time
from typing import Callable

import torch

from rl_ckpt.tools.fault_suite.common import SCENARIOS
from rl_ckpt.tools.fault_suite.concurrent import concurrent
from rl_ckpt.tools.fault_suite.context import Suite
from rl_ckpt.tools.fault_suite.corruption import corruption
from rl_ckpt.tools.fault_suite.errors import errors
from rl_ckpt.tools.fault_suite.malicious import malicious
from rl_ckpt.tools.fault_suite.power import power
from rl_ckpt.tools.fault_suite.report import ScenarioResult, SuiteReport
from rl_ckpt.tools.fault_suite.s3 import s3_errors
from rl_ckpt.tools.fault_suite.sharded import sharded
from rl_ckpt.tools.fault_suite.sigkill import sigkill

DESCRIPTION = "The fault-injection suite: crash, cut, corrupt, fill, break and race real storage; print the figures."
# scenario name -> the function that runs it in the shared context
RUNS: dict[str, Callable[[Suite], ScenarioResult]] = {
    "sigkill": sigkill,
    "power": power,
    "corruption": corruption,
    "errors": errors,
    "s3": s3_errors,
    "concurrent": concurrent,
    "malicious": malicious,
    "sharded": sharded,
}


def machine_info() -> dict:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def run_suite(
    mode: str = "quick",
    base_dir: str | None = None,
    *,
    scenarios: tuple[str, ...] | list[str] | None = None,
    s3_storage_options: dict | None = None,
    progress: Callable[[str], None] | None = None,
) -> SuiteReport:
    """Run the suite; returns a :class:`SuiteReport` (``.ok``, ``.table()``, ``.to_json()``)."""
    chosen = list(scenarios or SCENARIOS)
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        raise ValueError(f"unknown scenario(s) {sorted(unknown)}; choose from {SCENARIOS}")
    logger = logging.getLogger("rl_ckpt")
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.CRITICAL)
    logger.propagate = False
    started = time.perf_counter()
    report = SuiteReport(mode, _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), machine_info(), [])
    suite = Suite(mode, base_dir, s3_storage_options=s3_storage_options, progress=progress)
    try:
        for key in chosen:
            t0 = time.perf_counter()
            suite.progress(f"{key} ...")
            result = RUNS[key](suite)
            result.seconds = time.perf_counter() - t0
            report.scenarios.append(result)
            suite.progress(f"{key}: {result.tried} cases, {len(result.violations)} violations, {result.seconds:.1f}s")
    finally:
        suite.close()
        logger.setLevel(level)
        logger.propagate = propagate
    report.seconds = time.perf_counter() - started
    if suite.kept:
        report.machine["kept_failed_cases"] = suite.kept
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl_ckpt.tools.fault_suite", description=DESCRIPTION)
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--quick", dest="mode", action="store_const", const="quick", help="the quick suite (default, ~3.5 min)"
    )
    g.add_argument("--long", dest="mode", action="store_const", const="long", help="the long suite (10-20 minutes)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    p.add_argument(
        "--base-dir",
        default=None,
        help="where the suite's working folder goes (default: the temp dir); removed after the run "
        "unless a case failed (failed cases are kept there and listed in the report)",
    )
    p.add_argument("--only", nargs="+", choices=SCENARIOS, help="run only these scenarios")
    p.add_argument("-q", "--no-progress", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    progress = None if args.no_progress else (lambda msg: print(msg, file=sys.stderr, flush=True))
    report = run_suite(args.mode or "quick", args.base_dir, scenarios=args.only, progress=progress)
    if args.json:
        print(json.dumps(report.to_json(), indent=1, default=str))
    else:
        print(report.table())
    return 0 if report.ok else 1
