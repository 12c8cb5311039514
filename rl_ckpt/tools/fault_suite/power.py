"""Scenario 2: a power cut (unsynced effects undone) before every operation of a save and after it."""

from __future__ import annotations

import random
from functools import partial

from rl_ckpt.errors import CheckpointError
from rl_ckpt.tools.fault_suite.common import VARIANTS, build, op_phases, save_step, variant_name
from rl_ckpt.tools.fault_suite.context import Suite
from rl_ckpt.tools.fault_suite.report import ScenarioResult


def power(suite: Suite) -> ScenarioResult:
    """Cut power before every operation of a first and a third save, and after each returned."""
    res = ScenarioResult("power", "power cut (unsynced effects undone) before every operation of a save and after it")
    jobs = []
    for dedup, aw in VARIANTS:
        for stage in ("first", "third"):
            variant = f"{variant_name(dedup, aw)}/{stage} save"
            kw = {"dedup": dedup, "atomic_write": aw}
            step = 1 if stage == "first" else 3
            tpl = suite.template(variant_name(dedup, aw), kw, steps=() if stage == "first" else (1, 2))
            ops = suite.record_ops(tpl, kw, step)
            marks = op_phases(ops) + ["after the save returned"]
            for k in range(len(ops) + 1):
                for mix in range(1 + suite.profile.power_mixes):
                    op = ops[k][0] if k < len(ops) else ""
                    jobs.append(
                        partial(
                            _power_cut,
                            suite,
                            variant=variant,
                            kw=kw,
                            tpl=tpl,
                            step=step,
                            k=k,
                            n=len(ops),
                            op=op,
                            mark=marks[k],
                            mix=mix,
                        )
                    )
            suite.progress(f"  power {variant}: {len(ops) + 1} cut points x {1 + suite.profile.power_mixes}")
    suite.run_jobs(res, jobs)
    return res


def _power_cut(
    suite: Suite,
    part: ScenarioResult,
    variant: str,
    kw: dict,
    tpl: str,
    step: int,
    k: int,
    n: int,
    op: str,
    mark: str,
    mix: int,
) -> None:
    from rl_ckpt.tools.faults import FaultyStorage, PowerCut, PowerLossStorage

    rng = random.Random(k * 1000 + mix) if mix else None
    target = suite.case(f"power-{variant}-{k}-{mix}", kw, tpl)
    before = target.outside()
    storage = PowerLossStorage(target.run, journal_dir=suite.journal_dir)
    faulty = FaultyStorage(storage)
    engine, model, buf = build(target.cfg, faulty)
    engine.catalog.refresh()

    def cut() -> None:
        storage.power_cut(rng)
        raise PowerCut("power cut")

    if k < n:
        faulty.before("*", cut, nth=k + 1)
        label = f"cut before op {k} ({op}, {mark})"
    else:
        label = "cut after the save returned"
    label += " (random mix)" if mix else ""
    acked = False
    try:
        save_step(engine, model, buf, step)
        acked = True
    except PowerCut:
        pass
    except CheckpointError as exc:
        part.violate(variant, label, "harness", f"save failed without a fault: {exc}")
    if acked and k < n:
        part.violate(variant, label, "harness", "cut point not reached")
    if acked:
        storage.power_cut(rng)
    storage.close()
    part.tried += 1
    part.injected[
        "power cut, random mix of unsynced effects undone"
        if mix
        else ("power cut after the save returned" if k == n else "power cut before op")
    ] += 1
    must = ({2} if step == 3 else set()) | ({step} if acked else set())
    ok, _ = suite.check(
        part,
        variant,
        label,
        target,
        must_list=must,
        allowed={1, 2, 3},
        acked_max=max(must) if must else None,
        in_flight=step,
        save_after=step + 1 if suite.profile.power_save_after else None,
        outside_before=before,
    )
    suite.done(target, ok)
