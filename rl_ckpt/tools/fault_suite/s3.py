"""Scenario 5: a 5xx-like error at every request of a save on S3."""

from __future__ import annotations

from rl_ckpt.errors import StorageError
from rl_ckpt.tools.fault_suite.common import build, op_phases, run_url, save_step
from rl_ckpt.tools.fault_suite.context import Suite
from rl_ckpt.tools.fault_suite.errors import expect_error
from rl_ckpt.tools.fault_suite.report import ScenarioResult
from rl_ckpt.tools.fault_suite.targets import S3Target


def s3_errors(suite: Suite) -> ScenarioResult:
    """Fail every request of a save on S3 with a 5xx-like error."""
    from rl_ckpt.tools.faults import FaultyStorage
    from rl_ckpt._storage import open_storage

    res = ScenarioResult("s3", "5xx-like errors at every request of a save on S3 (moto on 127.0.0.1)")
    s3 = suite.s3()
    buckets, jobs = [], []
    for dedup in suite.profile.s3_variants:
        variant = f"s3/{'dedup' if dedup else 'plain'}"
        kw = {"dedup": dedup}
        bucket = s3.bucket()
        buckets.append(bucket)
        probe = S3Target(s3, bucket, "record", kw)
        faulty = FaultyStorage(open_storage(run_url(probe.cfg), s3.options))
        engine, model, buf = build(probe.cfg, faulty)
        for step in (1, 2):
            save_step(engine, model, buf, step)
        faulty.ops.clear()
        save_step(engine, model, buf, 3)
        ops = list(faulty.ops)
        marks = op_phases(ops)
        indices = [k for k in range(len(ops)) if k % suite.profile.s3_stride == 0 or marks[k] != "write"]
        for k in indices:
            for when in suite.profile.s3_when:
                jobs.append(
                    lambda part, variant=variant, kw=kw, bucket=bucket, k=k, op=ops[k], when=when, mark=marks[k]: (
                        _s3_error_at(suite, part, variant, kw, bucket, k, op, when, mark)
                    )
                )
        suite.progress(f"  s3 {variant}: {len(indices)} of {len(ops)} requests x {len(suite.profile.s3_when)}")
    suite.run_jobs(res, jobs)
    for bucket in buckets:
        s3.drop_bucket(bucket)
    return res


def _s3_error_at(
    suite: Suite, part: ScenarioResult, variant: str, kw: dict, bucket: str, k: int, op: tuple, when: str, mark: str
) -> None:
    from rl_ckpt.tools.faults import FaultyStorage

    target = S3Target(suite.s3(), bucket, f"{k}-{when}", kw)
    faulty = FaultyStorage(target.storage())
    engine, model, buf = build(target.cfg, faulty)
    for step in (1, 2):
        save_step(engine, model, buf, step)
    before = target.outside()
    shown = op[1] or "."  # the run folder itself
    err = StorageError(f"injected fault: HTTP 503 SlowDown on {op[0]} {shown} (retries exhausted)", path=shown)
    faulty.fail("*", nth=k + 1, error=err, after=when == "after")
    label = f"503 {when} request {k} ({op[0]}, {mark})"
    part.tried += 1
    part.injected[f"S3 5xx ({when} the request)"] += 1
    part.note(f"faults in phase {mark}")
    acked = expect_error(suite, part, variant, label, lambda: save_step(engine, model, buf, 3), op[0])
    suite.check(
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
