"""The main job end to end on a real local Ray cluster: PPO with TorchTrainer learner ranks (gloo) and
rollout-worker actors, the CheckpointCallback, FailureConfig(max_failures=2), layered saves with dedup and
keep-best. A learner rank is SIGKILLed mid-run on the first attempt: Ray Train restarts, every participant
restores the snapshot the coordinator chose, and the final parameters and every logged loss equal the
uninterrupted run's. The chaos drill: rollout workers SIGKILLed mid-rollout or inside their part of a snapshot
(recovered alone: the learners never go back a step for them), a damaged memory chunk, a learner rank, the
manager and the memory store, in one run that ends bitwise equal with every batch trained on exactly once.
A rollout worker's node removed: tests/test_scoped_nodes.py."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]
STEPS = 36
# dedup_min_tensor_bytes: the demo's 64x64 layers (16 KiB) become objects, its biases stay in the snapshot files
ENGINE = {
    "save_interval_steps": 10,
    "light_interval_steps": 5,
    "keep_latest": 2,
    "keep_best": 1,
    "dedup": True,
    "dedup_min_tensor_bytes": 4096,
}


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory):
    from rl_ckpt.demo.ray_ppo import run

    base = tmp_path_factory.mktemp("demo")
    return base, run(base_dir=str(base), run_name="reference", steps=STEPS, engine_cfg=ENGINE)


def _last_losses(result) -> dict:
    out = {}
    for m in result.log:
        if m["event"] == "step":
            out[m["step"]] = m["loss"]
    return out


_CRASHED: dict = {}


def _why(run_dir, result) -> str:
    """What a failed expectation needs to be understood: the attempts, the failure and decision records."""
    records = [
        f"{kind}/{p.name}: {p.read_text()[:1500]}"
        for kind in ("failures", "decisions")
        if (run_dir / kind).is_dir()
        for p in sorted((run_dir / kind).iterdir())
    ]
    events = [m for m in result.log if m["event"] != "step"]
    return "\n".join([f"attempts and events: {events}", *records])


def _crashed(base, target: str, crash_at: int, memory_tier: bool = False):
    """The crash run of ``target`` at ``crash_at`` in this module's folder (run once, shared by the tests)."""
    from rl_ckpt.demo.ray_ppo import run

    key = (target, crash_at, memory_tier)
    if key not in _CRASHED:
        _CRASHED[key] = run(
            base_dir=str(base),
            run_name=f"crash-{target}" + ("-memory" if memory_tier else ""),
            steps=STEPS,
            engine_cfg=ENGINE,
            crash_at=crash_at,
            crash_target=target,
            memory_tier=memory_tier,
        )
    return _CRASHED[key]


@pytest.mark.parametrize("target,crash_at", [("learner", 23)])
def test_crash_then_exact_restart(ray_cluster, reference, target, crash_at):
    base, ref = reference
    result = _crashed(base, target, crash_at)
    attempts = result.attempts
    assert len(attempts) == 2 and attempts[0]["restored"] is None, _why(base / f"crash-{target}", result)
    restored = attempts[1]
    assert restored["restored"] in ("step_000000010", "step_000000020"), restored["restored"]
    assert all(w[0] == restored["restored"] for w in restored["workers"])  # rollout workers restored the same one
    assert result.done["step"] == ref.done["step"] == STEPS
    assert result.done["digest"] == ref.done["digest"]  # bitwise-equal final parameters
    assert result.done["avg_reward"] > 80  # PPO learns: random play averages ~22
    assert _last_losses(result) == _last_losses(ref)
    run_dir = base / f"crash-{target}"
    failures = [json.loads(p.read_text()) for p in (run_dir / "failures").iterdir()]
    kinds = [f["kind"] for f in failures]
    # The kill; if Ray Train is slow to notice on a loaded machine, the silence may be recorded too (once).
    assert kinds.count("process_killed") == 1 and set(kinds) <= {"process_killed", "heartbeat_lost"}
    assert kinds.count("heartbeat_lost") <= 2
    killed = next(f for f in failures if f["kind"] == "process_killed")
    # Recorded exactly where it happened, naming the participant that was killed (not a rank that saw gloo fail).
    assert killed["step"] == crash_at
    assert killed["participant"] == ("learner-1" if target == "learner" else "rollout-0")
    decisions = [json.loads(p.read_text()) for p in (run_dir / "decisions").iterdir()]
    assert decisions[0]["snapshot_id"] == restored["restored"]
    assert decisions[0]["failure"]["step"] == crash_at
    _check_summary(ref, result, base, target, crash_at)
    kinds = {p.name.endswith(".light") for p in run_dir.iterdir() if p.name.startswith("step_")}
    assert kinds == {True, False}  # full and light layers both committed
    assert (run_dir / "objects").exists() and (run_dir / "best" / "avg_reward.json").exists()
    # The save the crash cut off is aborted; on a loaded machine the last save of the run may be too
    # (its commit can miss the timeout as the job winds down). Never more than a few.
    assert ray_cluster.get(result.manager.stats.remote())["aborted"] <= 3


def _check_summary(ref, result, base, target: str, crash_at: int) -> None:
    """The demo's printed numbers agree with each other, with the run's log and with the timeline's facts."""
    from rl_ckpt.demo.__main__ import ray_summary
    from rl_ckpt._storage import open_storage
    from rl_ckpt._timeline import load

    text, ok = ray_summary(ref, result, str(base), STEPS, crash_at, None)
    assert ok, text
    failure = re.search(r"failure\s+process_killed of (\S+) at step (\d+)", text)
    decision = re.search(r"decision\s+\w+ -> (\S+) \(step (\d+)\)", text)
    restored = re.search(r"restored\s+(\S+) \(step (\d+)\)", text)
    redone = re.search(r"time lost\s+(\d+) steps redone", text)
    resumes = re.search(r"continue:\s+training resumes after step (\d+)", text)
    dedup = re.search(
        r"tensor chunks ([\d.]+ \w+) referenced, ([\d.]+ \w+) stored "
        r"\(dedup saved ([\d.]+) (\w+)\)",
        text,
    )
    assert failure and decision and restored and redone and resumes and dedup, text
    crash_step, resume_step = int(failure.group(2)), int(restored.group(2))
    assert failure.group(1) == ("learner-1" if target == "learner" else "rollout-0")
    assert crash_step == crash_at
    assert restored.group(1) == decision.group(1) and resume_step == int(decision.group(2)) == int(resumes.group(1))
    assert int(redone.group(1)) == crash_step - resume_step > 0
    first_after = min(m["step"] for m in result.log if m["event"] == "step" and m["t"] > result.attempts[-1]["t"])
    assert first_after == resume_step + 1  # training really resumed right after the restored step
    objects = list((base / result.run_name / "objects").rglob("*"))
    assert any(p.is_file() for p in objects) and float(dedup.group(3)) > 0  # dedup wrote objects and saved some
    # The timeline draws the same facts: the failure line at the crash step, the arrow back to the restored step.
    data = load(open_storage(str(base / result.run_name)))
    assert [f["step"] for f in data["failures"] if f["kind"] == "process_killed"] == [crash_step]
    assert [(d["step"], d["to"]) for d in data["decisions"]] == [(crash_step, resume_step)]


def test_memory_tier_crash_restarts_from_memory(ray_cluster, reference):
    """The same learner crash with the memory tier: every participant restores the step-22 memory snapshot (the
    durable-only run loses back to step 20), the run ends bitwise equal to the uninterrupted one, the demo's
    side-by-side figures agree with each other and with the run, and the timeline draws the memory tier."""
    from rl_ckpt.demo.__main__ import memory_summary
    from rl_ckpt._storage import open_storage
    from rl_ckpt._timeline import load, plot

    base, ref = reference
    durable = _crashed(base, "learner", 23)
    result = _crashed(base, "learner", 23, memory_tier=True)
    resumed = result.attempts[-1]
    why = _why(base / "crash-learner-memory", result)
    # The killed rank waited for its step-22 memory snapshot to end before the kill: it committed.
    kill = next(m for m in result.log if m["event"] == "kill")
    assert kill["last_save"] == {"step": 22, "error": None}, why
    assert (resumed["tier"], resumed["restored"], resumed["step"]) == ("memory", "step_000000022", 22), why
    assert [w[:2] for w in resumed["workers"]] == [["step_000000022", 22]]  # rank 0's rollout worker: the same one
    assert result.done["digest"] == ref.done["digest"] and _last_losses(result) == _last_losses(ref)
    # Durable copies were made from memory by the service (one in 5 memory snapshots), none by the trainer.
    flushed = result.memory_status["flushed"]
    assert flushed and all(int(s.split("_")[1]) % 2 == 0 for s in flushed), flushed
    assert set(result.memory_status["durable_snapshots"]) <= set(flushed)  # every durable snapshot came from memory

    text, ok = memory_summary(ref, durable, result, str(base), 23)
    assert ok, text

    def row(name):
        m = re.search(rf"^  {name}\s+(.+?)\s{{2,}}(.+)$", text, re.M)
        assert m, (name, text)
        return m.group(1).strip(), m.group(2).strip()

    tiers = row("restored from")
    assert tiers == (f"durable {durable.attempts[-1]['restored']}", "memory step_000000022")
    restored = [int(x) for x in row("restored step")]
    failed = [int(x) for x in row("failure step")]
    lost = [int(x) for x in row("steps lost")]
    assert failed == [23, 23] and restored[1] == 22 and restored[0] == int(tiers[0].split("_")[-1])
    assert lost == [failed[0] - restored[0], failed[1] - restored[1]] and lost[1] < lost[0]
    restore_s = [float(x.split()[0]) for x in row("restore time")]
    kill_s = [float(x.split()[0]) for x in row("kill to first step")]
    assert all(0 < r < k for r, k in zip(restore_s, kill_s))  # the restore is part of the time from kill to step
    # Kill to first step split at the restarted train function's first line: Ray's part, then the run's own
    # (which holds the restore); the two add up to the whole (each printed rounded to 0.01 s).
    ray_s = [float(x.split()[0]) for x in row("  of which Ray")]
    resume_s = [float(x.split()[0]) for x in row("  of which resume")]
    assert all(a > 0 and b > r and abs(a + b - k) <= 0.011 for a, b, r, k in zip(ray_s, resume_s, restore_s, kill_s))
    assert row("exact restart") == ("YES", "YES")
    first_after = min(m["step"] for m in result.log if m["event"] == "step" and m["t"] > resumed["t"])
    assert first_after == restored[1] + 1

    # The timeline: memory snapshots from memory_tier/ records, the restart drawn back to the memory snapshot.
    data = load(open_storage(str(base / result.run_name)))
    steps = [m["step"] for m in data["memory_snapshots"]]
    assert steps[:11] == list(range(2, 23, 2)) and all(s % 2 == 0 for s in steps)
    assert [(d["step"], d["resumed_to"], d["tier"]) for d in data["decisions"]] == [(23, 22, "memory")]
    drawn = plot(data, str(base / "memory.png"))
    assert "memory-tier snapshot (Ray memory)" in drawn["legend"] and "resume from memory step 22" in drawn["notes"]


def test_chaos_drill_every_fault_recovered_exactly(ray_cluster, reference):
    """The chaos drill on the demo with the memory tier: seeded faults of every kind in one run (rollout workers
    mid-collect or in their save, a damaged memory chunk then its worker, a learner rank, the manager, the memory
    store), each recovered by the smallest rung that stays exact; bitwise equal to the uninterrupted run."""
    from rl_ckpt.demo.chaos import chaos_report, chaos_table, plan_faults
    from rl_ckpt.demo.ray_ppo import run

    base, ref = reference
    faults = plan_faults(seed=3, steps=STEPS, count=6, learners=2, workers=2, env_steps=16)
    assert {f["kind"] for f in faults} == {"rollout", "chunk", "learner", "manager", "memory_store"}
    assert len(faults) >= 7  # the chunk fault brings its worker's kill
    result = run(base_dir=str(base), run_name="chaos", steps=STEPS, engine_cfg=ENGINE, memory_tier=True, faults=faults)
    text, ok = chaos_report(ref.done["digest"], result.log, faults)
    assert ok, text + "\n" + _why(base / "chaos", result)
    rows = {r["id"]: r for r in chaos_table(result.log, faults)}
    for f in faults:
        r = rows[f["id"]]
        if f["kind"] == "rollout":
            assert r["recovery"].startswith("scoped") and r["undone"] == 0, (r, text)
            if f.get("after_chunk"):
                assert "fallback" in r["recovery"], (r, text)  # its newest memory snapshot was the damaged one
        elif f["kind"] == "learner":
            assert r["recovery"].startswith("group restart"), (r, text)
        else:
            assert r["recovery"] != "did not strike", (r, text)
    assert "verdict: EXACT" in text
    steps = [m["step"] for m in result.log if m["event"] == "step"]
    restarts = [m for m in result.log if m["event"] == "attempt"][1:]
    assert len(restarts) == 1  # the learner kill alone restarted the group
    assert steps[-1] == STEPS and all(b == a + 1 for a, b in zip(steps, steps[1:]) if b > a), steps
    learner_at = next(f["step"] for f in faults if f["kind"] == "learner")
    before = steps[: steps.index(learner_at) + 1]
    assert before == list(range(1, learner_at + 1)), steps  # the learners never went back for a rollout worker
    recovered = [m for m in result.log if m["event"] == "scoped_recovery"]
    for f in faults:
        if f["kind"] == "rollout":  # each recovered by its own replay, up to the step it was lost at
            r = next(m for m in recovered if m["participant"] == f["target"] and m["step"] >= f["step"])
            assert r["replayed_steps"] == list(range((r["restored_step"] or 0) + 1, r["step"])), r
            if f.get("moment") == "save":  # killed inside its part of a snapshot: the replay completed that save
                assert f["step"] in r["saves_completed"], r
    assert any(f.get("moment") == "save" for f in faults)
    audits = [m for m in result.log if m["event"] == "audit"]
    assert audits and all(a["skipped"] == a["duplicated"] == 0 for a in audits), audits
