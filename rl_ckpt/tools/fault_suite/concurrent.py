"""Scenario 6: 2, 4 and 8 processes released together save the same step."""

from __future__ import annotations

import os

from rl_ckpt.tools.fault_suite.common import child_race
from rl_ckpt.tools.fault_suite.context import Suite
from rl_ckpt.tools.fault_suite.report import ScenarioResult
from rl_ckpt.tools.fault_suite.targets import S3Target


def concurrent(suite: Suite) -> ScenarioResult:
    """Release 2, 4 and 8 processes together to save the same step (local rename, manifest-last, S3)."""
    res = ScenarioResult("concurrent", "2, 4, 8 writers of the same step released together")
    for backend in ("local/rename", "local/manifest-last", "s3"):
        for n in suite.profile.race_writers:
            for rnd in range(suite.profile.race_rounds):
                _race(suite, res, backend, n, rnd)
        suite.progress(f"  concurrent {backend}: {len(suite.profile.race_writers) * suite.profile.race_rounds} races")
    return res


def _race(suite: Suite, res: ScenarioResult, backend: str, n: int, rnd: int) -> None:
    label = f"{n} writers, round {rnd}"
    env: dict = {}
    bucket = None
    if backend == "s3":
        s3 = suite.s3()
        bucket = s3.bucket()
        target = S3Target(s3, bucket, "race")
        env = dict(s3.env)
    else:
        target = suite.case(f"race-{backend}-{n}-{rnd}", {"atomic_write": backend == "local/rename"})
        os.makedirs(target.run, exist_ok=True)
    before = target.outside()
    step = 7
    barrier = suite.ctx.Barrier(n)
    procs, pipes = [], []
    for writer in range(1, n + 1):
        recv, send = suite.ctx.Pipe(duplex=False)
        proc = suite.ctx.Process(target=child_race, args=(target.cfg, env, writer, step, barrier, send), daemon=True)
        proc.start()
        send.close()
        procs.append(proc)
        pipes.append(recv)
    outcomes = {}
    for writer, (proc, recv) in enumerate(zip(procs, pipes), start=1):
        try:
            outcomes[writer] = recv.recv() if recv.poll(180) else ("error", "no answer")
        except EOFError:
            outcomes[writer] = ("error", f"died (exit {proc.exitcode})")
        proc.join(30)
        recv.close()
    res.tried += 1
    res.injected[f"race of {n} writers"] += 1
    committed = [w for w, (what, _) in outcomes.items() if what == "committed"]
    errors = {w: msg for w, (what, msg) in outcomes.items() if what == "error"}
    res.note(f"{backend}: races")
    if errors:
        res.violate(backend, label, "race_error", f"writers failed with other errors: {errors}")
    if len(committed) != 1:
        res.violate(backend, label, "race", f"{len(committed)} writers committed: {committed}")
    else:
        res.note(f"{backend}: exactly one committed")
    res.note(
        f"{backend}: losers got CommitConflictError", sum(1 for what, _ in outcomes.values() if what == "conflict")
    )
    ok, _ = suite.check(
        res,
        backend,
        label,
        target,
        must_list={step},
        allowed={step},
        acked_max=step,
        in_flight=None,
        writer=committed[0] if len(committed) == 1 else None,
        outside_before=before,
        save_after=step + 1,
    )
    if bucket is not None:
        suite.s3().drop_bucket(bucket)
    else:
        suite.done(target, ok)
