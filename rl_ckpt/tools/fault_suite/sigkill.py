"""Scenario 1: SIGKILL before/after every storage operation of a save, and at random moments."""

from __future__ import annotations

import os
import random
import signal
import time

from rl_ckpt.tools.fault_suite.common import VARIANTS, child_kill_at, child_save_loop, op_phases, variant_name
from rl_ckpt.tools.fault_suite.context import Suite
from rl_ckpt.tools.fault_suite.report import ScenarioResult


def sigkill(suite: Suite) -> ScenarioResult:
    """Kill a saving child at every operation of a save (before/after), then at random moments of a save loop."""
    res = ScenarioResult("sigkill", "SIGKILL before/after every storage operation of a save, and at random moments")
    jobs = []
    for dedup, aw in VARIANTS:
        variant = variant_name(dedup, aw)
        kw = {"dedup": dedup, "atomic_write": aw}
        tpl = suite.template(variant, kw)
        ops = suite.record_ops(tpl, kw, 3)
        marks = op_phases(ops)
        for k, (op, _path) in enumerate(ops):
            for when in suite.profile.kill_when:
                if when == "after" and marks[k] not in suite.profile.kill_after_phases:
                    continue
                jobs.append(
                    lambda part, variant=variant, kw=kw, tpl=tpl, k=k, op=op, when=when, mark=marks[k]: _kill_point(
                        suite, part, variant, kw, tpl, k, op, when, mark
                    )
                )
        suite.progress(f"  sigkill {variant}: {len(ops)} operations x {len(suite.profile.kill_when)}")
    suite.run_jobs(res, jobs)
    suite.run_jobs(res, [lambda part, v=v: _random_kills(suite, part, *v) for v in VARIANTS])
    suite.progress(f"  sigkill: {suite.profile.random_kills} random-moment kills")
    return res


def _kill_point(
    suite: Suite, part: ScenarioResult, variant: str, kw: dict, tpl: str, k: int, op: str, when: str, mark: str
) -> None:
    target = suite.case(f"kill-{variant}-{k}-{when}", kw, tpl)
    before = target.outside()
    code, acks = suite.run_child(child_kill_at, (target.cfg, 3, k + 1, op, when))
    if code not in (-signal.SIGKILL, 0, 3):  # 255: the forkserver lost the child (host trouble), not our kill
        part.note(f"harness: child lost (exit {code}), case run again")
        suite.done(target, True)
        target = suite.case(f"kill-{variant}-{k}-{when}-again", kw, tpl)
        before = target.outside()
        code, acks = suite.run_child(child_kill_at, (target.cfg, 3, k + 1, op, when))
    part.tried += 1
    part.injected[f"SIGKILL {when} op"] += 1
    part.note(f"kill points in phase {mark}")
    label = f"kill {when} op {k} ({op}, {mark})"
    if code != -signal.SIGKILL:
        why = {0: "the save finished without reaching it", 3: "the save took another path"}.get(code, f"exit {code}")
        part.violate(variant, label, "harness", f"kill point not reached: {why}")
    acked = 3 in acks
    ok, _ = suite.check(
        part,
        variant,
        label,
        target,
        must_list={2} | ({3} if acked else set()),
        allowed={1, 2, 3},
        acked_max=3 if acked else 2,
        in_flight=3,
        outside_before=before,
    )
    suite.done(target, ok)


def _random_kills(suite: Suite, res: ScenarioResult, dedup: bool, aw: bool) -> None:
    """One run folder; a child saves steps in a loop and is SIGKILLed at a random moment, over and over.
    Like a trainer, each new child resumes from the step that was restored."""
    variant = variant_name(dedup, aw)
    rnd = random.Random(20240611 + 2 * dedup + aw)
    target = suite.case(f"random-kills-{variant}", {"dedup": dedup, "atomic_write": aw})
    outside = target.outside()
    last_ack, start, all_ok = -1, 0, True
    for i in range(suite.profile.random_kills // len(VARIANTS)):
        recv, send = suite.ctx.Pipe(duplex=False)
        proc = suite.ctx.Process(target=child_save_loop, args=(target.cfg, start, send), daemon=True)
        proc.start()
        send.close()
        acks: list[int] = []
        if recv.poll(60) and recv.recv_bytes() == b"ready":
            # every 4th kill comes after an acknowledged save, however slow the machine
            if i % 4 == 3 and recv.poll(60):
                acks.append(int(recv.recv_bytes()))
            time.sleep(rnd.uniform(0.0, suite.profile.random_kill_max_delay))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        while recv.poll(0):
            try:
                acks.append(int(recv.recv_bytes()))
            except (EOFError, ValueError):
                break
        recv.close()
        res.tried += 1
        res.injected["SIGKILL at a random moment"] += 1
        if acks:
            last_ack = max(last_ack, acks[-1])
            res.note("random kills: saves acknowledged", len(acks))
            res.note("random kills after at least one acknowledged save")
        in_flight = (acks[-1] + 1) if acks else start  # the save that was running when the kill came
        ok, restored = suite.check(
            res,
            variant,
            f"random kill {i}",
            target,
            must_list={last_ack} if last_ack >= 0 else set(),
            allowed=set(range(in_flight + 1)),
            acked_max=last_ack if last_ack >= 0 else None,
            in_flight=in_flight,
            outside_before=outside,
            retention_keeps=target.cfg["keep_latest"],
        )
        all_ok &= ok
        start = 0 if restored is None else restored + 1
    suite.done(target, all_ok)
