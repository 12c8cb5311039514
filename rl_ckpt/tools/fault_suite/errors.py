"""Scenario 4: ENOSPC, EIO and a timeout at every operation of a save and of gc."""

from __future__ import annotations

import os
import shutil
from typing import Callable

from rl_ckpt.errors import CheckpointError
from rl_ckpt.tools.fault_suite.common import ERRORS, VARIANTS, build, op_phases, save_step, variant_name
from rl_ckpt.tools.fault_suite.context import Suite
from rl_ckpt.tools.fault_suite.report import ScenarioResult
from rl_ckpt.tools.fault_suite.targets import run_gc


def errors(suite: Suite) -> ScenarioResult:
    """Fail every operation of a save (write, commit, retention) and of gc with ENOSPC, EIO and a timeout."""
    res = ScenarioResult("errors", "ENOSPC, EIO and timeouts at every operation of a save, a retention pass and gc")
    jobs = []
    kinds = suite.profile.error_kinds
    for dedup, aw in VARIANTS:
        variant = variant_name(dedup, aw)
        kw = {"dedup": dedup, "atomic_write": aw}
        tpl = suite.template(variant, kw)
        ops = suite.record_ops(tpl, kw, 3)
        marks = op_phases(ops)
        for k, (op, _path) in enumerate(ops):
            names = kinds if suite.profile.every_error_kind else (kinds[(k + len(jobs)) % len(kinds)],)
            for name in names:
                for when in suite.profile.error_when:
                    jobs.append(
                        lambda part, variant=variant, kw=kw, tpl=tpl, k=k, op=op, name=name, when=when, mark=marks[k]: (
                            _error_at(suite, part, variant, kw, tpl, k, op, name, when, mark)
                        )
                    )
        suite.progress(f"  errors {variant}: {len(ops)} operations")
    jobs += _gc_error_jobs(suite)
    suite.run_jobs(res, jobs)
    return res


def _error_at(
    suite: Suite,
    part: ScenarioResult,
    variant: str,
    kw: dict,
    tpl: str,
    k: int,
    op: str,
    name: str,
    when: str,
    mark: str,
) -> None:
    from rl_ckpt.tools.faults import FaultyStorage
    from rl_ckpt._storage import LocalStorage

    target = suite.case(f"error-{variant}-{k}-{name}-{when}", kw, tpl)
    before = target.outside()
    faulty = FaultyStorage(LocalStorage(target.run))
    engine, model, buf = build(target.cfg, faulty)
    engine.catalog.refresh()
    faulty.fail("*", nth=k + 1, error=ERRORS[name], after=when == "after")
    label = f"{name} {when} op {k} ({op}, {mark})"
    part.tried += 1
    part.injected[f"{name} ({when} the call)"] += 1
    part.note(f"faults in phase {mark}")
    acked = expect_error(suite, part, variant, label, lambda: save_step(engine, model, buf, 3), op)
    ok, _ = suite.check(
        part,
        variant,
        label,
        target,
        must_list={2} | ({3} if acked else set()),
        allowed={1, 2, 3},
        acked_max=3 if acked else 2,
        in_flight=3,
        save_after=4,
        outside_before=before,
    )
    suite.done(target, ok)


def expect_error(suite: Suite, res: ScenarioResult, variant: str, label: str, fn: Callable, op: str) -> bool:
    """Run ``fn`` with a fault armed: a CheckpointError naming a path, or a fault absorbed. True if fn returned."""
    try:
        fn()
    except CheckpointError as exc:
        path = getattr(exc, "path", None)
        if not path and "/" not in str(exc):
            res.violate(variant, label, "error_without_path", f"{type(exc).__name__} names no path: {exc}")
        return False
    except Exception as exc:
        res.violate(variant, label, "not_a_checkpoint_error", f"{type(exc).__name__}: {exc}")
        return False
    res.note(f"faults absorbed (optional {op})")
    return True


def _gc_error_jobs(suite: Suite) -> list:
    from rl_ckpt.tools.faults import FaultyStorage
    from rl_ckpt._storage import LocalStorage

    kw = {"dedup": True, "atomic_write": True}
    tpl_clean = suite.template(variant_name(True, True), kw)
    tpl = os.path.join(suite.root, "_templates", "gc-debris", "run")
    if not os.path.exists(tpl):
        shutil.copytree(tpl_clean, tpl, symlinks=True)
        plant_debris(tpl)
    probe = suite.case("gc-record", kw, tpl)
    faulty = FaultyStorage(LocalStorage(probe.run))
    removed = run_gc(faulty)
    ops = list(faulty.ops)
    suite.done(probe, True)
    suite.progress(f"  errors gc: {len(ops)} operations ({removed} debris entries)")
    jobs = []
    kinds = suite.profile.error_kinds
    for k, (op, _path) in enumerate(ops):
        names = kinds if suite.profile.every_error_kind else (kinds[k % len(kinds)],)
        for name in names:
            for when in suite.profile.error_when:
                jobs.append(
                    lambda part, k=k, op=op, name=name, when=when: _gc_error_at(suite, part, kw, tpl, k, op, name, when)
                )
    return jobs


def _gc_error_at(suite: Suite, part: ScenarioResult, kw: dict, tpl: str, k: int, op: str, name: str, when: str) -> None:
    from rl_ckpt.tools.faults import FaultyStorage
    from rl_ckpt._storage import LocalStorage

    variant = "gc/" + variant_name(True, True)
    target = suite.case(f"gc-error-{k}-{name}-{when}", kw, tpl)
    before = target.outside()
    faulty = FaultyStorage(LocalStorage(target.run))
    faulty.fail("*", nth=k + 1, error=ERRORS[name], after=when == "after")
    label = f"gc: {name} {when} op {k} ({op})"
    part.tried += 1
    part.injected[f"{name} ({when} the call)"] += 1
    part.note("faults in gc")
    expect_error(suite, part, variant, label, lambda: run_gc(faulty), op)
    ok, _ = suite.check(
        part,
        variant,
        label,
        target,
        must_list={1, 2},
        allowed={1, 2},
        acked_max=2,
        in_flight=None,
        save_after=3,
        outside_before=before,
    )
    suite.done(target, ok)


def plant_debris(run: str) -> None:
    """Everything gc must remove, beside committed snapshots 1 and 2 (dedup)."""

    def put(rel: str, data: bytes = b"debris") -> None:
        full = os.path.join(run, *rel.split("/"))
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)

    shutil.copytree(
        os.path.join(run, "step_000000002"), os.path.join(run, ".staging", "step_000000005.host-1-2-dead0001")
    )
    put("step_000000006/host-1-2-dead0002/model.json")  # manifest-last attempt that never committed
    put(".trash/step_000000000.host-1-2-dead0003/model.json")  # an interrupted retirement
    put(".tmp-host-1-2-dead0004-meta.json")  # an interrupted write_atomic
    put("step_000000002/host-1-2-dead0005/model.json")  # a losing writer's attempt inside a committed snapshot
    algo = sorted(os.listdir(os.path.join(run, "objects")))[0]  # the checksum algorithm the objects are named by
    put(f"objects/{algo}/ff/ff" + "0" * 30)  # an object no manifest references
    put(f"objects/{algo}/ff/.tmp-host-1-2-dead0006-ff00")  # an interrupted object write
