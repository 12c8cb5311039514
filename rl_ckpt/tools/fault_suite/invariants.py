"""The common invariant check every fault-suite case ends with (``Suite.check``): after the fault, every
acknowledged snapshot is listed (unless retention retired it for newer ones) and only allowed ones are, every
listed snapshot verifies, restore loads exactly one complete snapshot, no older than the newest acknowledged one
(and the expected writer's, when one is named), ``gc --grace 0`` changes no listing and leaves no debris, a later
save succeeds, and nothing outside the run folder changed."""

from __future__ import annotations

from rl_ckpt.errors import CheckpointError
from rl_ckpt.tools.fault_suite.common import Mixed, build, observed, save_step
from rl_ckpt.tools.fault_suite.report import ScenarioResult


def check_invariants(
    res: ScenarioResult,
    variant: str,
    label: str,
    target,
    *,
    must_list: set[int],
    allowed: set[int],
    acked_max: int | None,
    in_flight: int | None,
    save_after: int | None = None,
    gc: bool = True,
    writer: int | None = None,
    outside_before: dict | None = None,
    damaged: frozenset = frozenset(),
    retention_keeps: int | None = None,
) -> tuple[bool, int | None]:
    """Every invariant after a fault; violations go into ``res``. Returns (all held, restored step).

    ``damaged``: snapshot ids the case broke on purpose (they may fail verify and be skipped).
    ``retention_keeps``: an acknowledged step may be gone only if at least this many newer snapshots
    are listed (retention retired it in their favour: keep_latest).
    """
    from rl_ckpt._run.gc import find_debris, find_unreferenced_objects

    n_before = len(res.violations)
    restored = None
    seen: set[str] = set()

    def bad(kind: str, msg: str, count: int = 1) -> None:
        # one record per kind and case; a later echo of a snapshot already found broken is not a new finding
        if kind in seen or (kind in ("gc", "broken_listed") and "broken_listed" in seen and "verif" in msg):
            return
        seen.add(kind)
        res.violate(variant, label, kind, msg, count)

    try:
        engine, model, buf = build(target.cfg, target.storage())
        listed = sorted(i.global_step for i in engine.snapshots())
        missing = must_list - set(listed)
        if retention_keeps:
            retired = {s for s in missing if sum(1 for x in listed if x > s) >= retention_keeps}
            if retired:
                res.note("acknowledged snapshots retired by retention in favour of newer ones", len(retired))
            missing -= retired
        if missing:
            bad("acked_lost", f"acknowledged step(s) {sorted(missing)} not listed (listed: {listed})", len(missing))
        if set(listed) - allowed:
            bad("unexpected", f"snapshots {sorted(set(listed) - allowed)} listed; only {sorted(allowed)} may be")
        report = engine.verify()
        broken = set(report.bad_snapshots) - damaged
        if broken:
            bad("broken_listed", f"verify: {report}", len(broken))
        try:
            result = engine.restore()
        except CheckpointError as exc:
            intact = [
                i.snapshot_id
                for i in engine.snapshots()
                if i.snapshot_id not in damaged and i.snapshot_id not in report.bad_snapshots
            ]
            if intact:
                bad("restore_failed", f"restore raised {type(exc).__name__} with {intact} intact: {exc}")
        else:
            if result.fresh:
                if listed or must_list:
                    bad(
                        "acked_lost" if must_list else "restore_failed",
                        f"restore started fresh with {listed} listed",
                    )
            else:
                try:
                    step, who = observed(model, buf)
                except Mixed as exc:
                    bad("corrupt_load", str(exc))
                else:
                    restored = step
                    if result.global_step != step:
                        bad("corrupt_load", f"restore says step {result.global_step}, the state is step {step}")
                    elif writer is not None and who != writer:
                        bad("corrupt_load", f"restored writer {who}'s state, but writer {writer} committed")
                    if acked_max is not None and step < acked_max and not missing:
                        bad("acked_lost", f"restored step {step} < acknowledged step {acked_max}")
                    if in_flight is not None:
                        res.max_rolled_back = max(res.max_rolled_back, in_flight - step)
                if set(result.skipped) - damaged:
                    bad("broken_listed", f"restore skipped {result.skipped}")
        engine.close()
        if gc:
            removed = target.gc()
            engine, model, buf = build(target.cfg, target.storage())
            after = sorted(i.global_step for i in engine.snapshots())
            if after != listed:
                bad("gc", f"gc changed the listing: {listed} -> {after}")
            if removed:  # (nothing removed: nothing to verify again)
                report = engine.verify()
                if set(report.bad_snapshots) - damaged:
                    bad("gc", f"verify after gc removed {removed} entries: {report}")
            storage = target.storage()
            left = [d.path for d in find_debris(storage, grace_seconds=0)]
            left += [d.path for d in find_unreferenced_objects(storage, grace_seconds=0)[0]]
            if left:
                bad("gc", f"gc left debris: {left[:5]}")
            engine.close()
        if save_after is not None:
            engine, model, buf = build(target.cfg, target.storage())
            try:
                save_step(engine, model, buf, save_after)
            except CheckpointError as exc:
                bad("later_save", f"a later save of step {save_after} failed: {type(exc).__name__}: {exc}")
            else:
                report = engine.verify()
                if set(report.bad_snapshots) - damaged:
                    bad(
                        "broken_listed",
                        f"a later save (step {save_after}) returned, but verify then says: {report}",
                        len(set(report.bad_snapshots) - damaged),
                    )
            engine.close()
    except Exception as exc:  # anything that is not a CheckpointError where one was due, or a suite bug
        bad("crash", f"{type(exc).__name__}: {exc}")
    if outside_before is not None and target.outside() != outside_before:
        bad("escape", "something outside the run folder changed")
    return len(res.violations) == n_before, restored
