"""The fault-injection suite: crash, cut, corrupt, fill, break and race real storage; print the figures.

    python -m rl_ckpt.tools.fault_suite [--quick | --long] [--json] [--base-dir DIR] [--only NAME ...]

Scenarios (each against real storage: the local disk under ``--base-dir``, and
an S3 endpoint served by moto on 127.0.0.1, started here):

1. ``sigkill``      a child process saves and SIGKILLs itself right before /
                    right after every storage operation of one save (dedup
                    on/off x staged-rename/manifest-last), plus kills at random
                    moments of a save loop;
2. ``power``        a power cut (``rl_ckpt.tools.faults.PowerLossStorage``: what was not
                    fsynced is undone) before every operation of a save and
                    after it returned;
3. ``corruption``   bit flips, truncation and deletion of every kind of file of
                    a snapshot, plus a bit-flip sweep over the manifest;
4. ``errors``       ENOSPC, EIO and a timeout at every operation of a save
                    (write, commit, retention) and of ``gc``;
5. ``s3``           a 5xx-like error at every request of a save on S3;
6. ``concurrent``   2, 4 and 8 processes released together save the same step
                    (local rename, local manifest-last, S3);
7. ``malicious``    path traversal, absolute paths, symlinks, pickles, bad
                    safetensors headers, corrupt Arrow, unknown schema versions;
8. ``sharded``      a 2-rank FSDP2 save (gloo) with one rank SIGKILLed before
                    each of its storage calls, and flipped/truncated chunks of
                    a committed sharded snapshot (both ranks must fall back
                    together).

After every case: the restored state is exactly one complete snapshot, no
acknowledged snapshot is lost, every listed snapshot verifies, ``rl-ckpt gc
--grace 0`` leaves everything verifiable, a later save succeeds, and nothing
outside the run folder changed. Exit status 1 if any invariant is violated.

Python API: ``report = run_suite("quick")``; ``report.ok``, ``report.table()``,
``report.to_json()``.

One module per scenario (``sigkill``, ``power``, ``corruption``, ``errors``, ``s3``, ``concurrent``,
``malicious``, ``sharded``), each a function of the shared context (``context.Suite``); ``runner`` runs them.
"""

from __future__ import annotations

from rl_ckpt.tools.fault_suite.common import (
    PROFILES,
    SCENARIOS,
    VALUE_BASE,
    VARIANTS,
    Mixed,
    Profile,
    SuiteBuffer,
    SuiteModel,
    build,
    engine_cfg,
    observed,
    op_phases,
    run_url,
    save_step,
    stamp,
    variant_name,
)
from rl_ckpt.tools.fault_suite.context import Suite
from rl_ckpt.tools.fault_suite.hostile import HOSTILE_TYPES, HostileCase, check_hostile, hostile_cases, json_paths
from rl_ckpt.tools.fault_suite.malicious import MALICIOUS
from rl_ckpt.tools.fault_suite.report import ScenarioResult, SuiteReport, Violation
from rl_ckpt.tools.fault_suite.runner import RUNS, machine_info, main, run_suite
from rl_ckpt.tools.fault_suite.tamper import forge_json, reseal
from rl_ckpt.tools.fault_suite.targets import LocalTarget, S3Endpoint, S3Target

__all__ = [
    "HOSTILE_TYPES",
    "MALICIOUS",
    "PROFILES",
    "RUNS",
    "SCENARIOS",
    "VALUE_BASE",
    "VARIANTS",
    "HostileCase",
    "LocalTarget",
    "Mixed",
    "Profile",
    "S3Endpoint",
    "S3Target",
    "ScenarioResult",
    "Suite",
    "SuiteBuffer",
    "SuiteModel",
    "SuiteReport",
    "Violation",
    "build",
    "check_hostile",
    "engine_cfg",
    "forge_json",
    "hostile_cases",
    "json_paths",
    "machine_info",
    "main",
    "observed",
    "op_phases",
    "reseal",
    "run_suite",
    "run_url",
    "save_step",
    "stamp",
    "variant_name",
]
