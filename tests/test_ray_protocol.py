"""The participant/manager protocol under faults, on a real local Ray cluster: a participant that fails
aborts its snapshot for everyone at once, a manager killed between the last report and the commit comes
back and serves on, one skip decision per snapshot, heartbeats while a rank waits, a dead manager as a
CheckpointError, and begin/report/abort bound to registered participants."""

from __future__ import annotations

import glob
import os
import uuid

import pytest

from ray_workers import Rank
from helpers import wait_until

pytestmark = pytest.mark.ray


@pytest.fixture
def cluster(ray_cluster, tmp_path):
    """(ray, base_dir, make_manager, make_ranks); everything made is killed afterwards."""
    from actors import CheckpointManager

    made = []
    name = f"p-{uuid.uuid4().hex[:8]}"

    def manager(**kw):
        mgr = CheckpointManager.get_or_create(run_name=name, base_dir=str(tmp_path), **kw)
        made.append(mgr)
        return mgr

    def ranks(mgr, cfg=None, rng=(True, True), concurrency=1):
        cls = ray_cluster.remote(num_cpus=0, max_restarts=0, max_concurrency=concurrency)(Rank)
        out = [cls.remote(str(tmp_path), name, mgr, r, 2, cfg, rng[r]) for r in range(2)]
        made.extend(out)
        return out

    yield ray_cluster, str(tmp_path / name), manager, ranks
    for handle in made:
        ray_cluster.kill(handle)


def _committed(ray, mgr) -> list[str]:
    return [s["snapshot_id"] for s in ray.get(mgr.snapshots.remote())]


def test_one_rank_fails_to_encode_the_other_fails_within_2s_nothing_committed_next_commits(cluster):
    ray, run_dir, manager, ranks = cluster
    mgr = manager(commit_timeout_seconds=120.0)
    r0, r1 = ranks(mgr, cfg={"commit_timeout_seconds": 120.0}, concurrency=2)
    assert [x[0] for x in ray.get([r0.save.remote(1), r1.save.remote(1)])] == ["step_000000001"] * 2

    # Rank 1 has written its part and waits in report when rank 0 fails to encode its optimizer state.
    ray.get(r0.poison.remote())
    ray.get(r1.save_async.remote(2))
    wait_until(lambda: glob.glob(f"{run_dir}/.staging/step_000000002.*/learner-1.report.json"), "rank 1's report")
    sid0, err0, failed0 = ray.get(r0.save.remote(2))
    sid1, err1, failed1 = ray.get(r1.wait.remote())
    assert sid0 is None and "Unsaveable" in err0
    assert sid1 is None and err1.startswith("SnapshotAbortedError") and "learner-0" in err1 and "Unsaveable" in err1
    assert failed1 - failed0 < 2.0  # CLOCK_MONOTONIC is one clock for every process of this machine

    # Rank 0 fails first, before rank 1 began: rank 1 is refused at begin.
    sid0, err0, failed0 = ray.get(r0.save.remote(3))
    sid1, err1, failed1 = ray.get(r1.save.remote(3))
    assert sid0 is None and sid1 is None
    assert "learner-0" in err1 and "Unsaveable" in err1 and failed1 - failed0 < 2.0

    # Rank 1 began, then its disk stalled while rank 0 failed: its late report hears why at once.
    ray.get(r1.close_gate.remote())
    ray.get(r1.save_async.remote(4))
    assert ray.get(r1.wait_held.remote())
    sid0, err0, _ = ray.get(r0.save.remote(4))
    ray.get(r1.open_gate.remote())
    sid1, err1, _ = ray.get(r1.wait.remote())
    assert sid0 is None and sid1 is None and "learner-0" in err1 and "Unsaveable" in err1

    assert _committed(ray, mgr) == ["step_000000001"]
    assert ray.get(mgr.stats.remote())["pending"] == []
    ray.get(r0.poison.remote(False))
    assert [x[0] for x in ray.get([r0.save.remote(5), r1.save.remote(5)])] == ["step_000000005"] * 2
    assert _committed(ray, mgr) == ["step_000000001", "step_000000005"]


def test_a_rank_with_only_replicated_state_reports_an_empty_part(cluster):
    ray, run_dir, manager, ranks = cluster
    mgr = manager()
    r0, r1 = ranks(mgr, rng=(True, False))  # rank 1: policy and optimizer only, both written by rank 0
    assert [x[0] for x in ray.get([r0.save.remote(1), r1.save.remote(1)])] == ["step_000000001"] * 2
    assert not os.path.exists(f"{run_dir}/step_000000001/learner-1")


def test_manager_killed_between_last_report_and_commit_restarts_finishes_and_serves_on(cluster, tmp_path):
    ray, run_dir, manager, ranks = cluster
    pause = tmp_path / "pause"
    pause.mkdir()
    mgr = manager(runtime_env={"env_vars": {"RL_CKPT_TEST_PAUSE_DIR": str(pause)}})
    r0, r1 = ranks(mgr)
    assert [x[0] for x in ray.get([r0.save.remote(1), r1.save.remote(1)])] == ["step_000000001"] * 2
    before = ray.get(mgr.stats.remote())
    (pause / "pause-before-commit-step_000000002").touch()
    saves = [r0.save.remote(2), r1.save.remote(2)]
    wait_until(
        lambda: (pause / "paused-before-commit-step_000000002").exists(), "the manager to pause before the commit"
    )
    ray.kill(mgr, no_restart=False)  # both reports are on storage; the commit has not happened
    (pause / "pause-before-commit-step_000000002").unlink()
    results = ray.get(saves, timeout=180)
    # The restarted manager finished the commit from storage; the retried reports got its manifest.
    assert [r[0] for r in results] == ["step_000000002"] * 2, results
    stats = ray.get(mgr.stats.remote())
    assert stats["pid"] != before["pid"] and stats["pending"] == []
    assert _committed(ray, mgr) == ["step_000000001", "step_000000002"]
    assert [x[0] for x in ray.get([r0.save.remote(3), r1.save.remote(3)])] == ["step_000000003"] * 2


def test_skip_is_one_decision_for_every_participant(cluster):
    ray, run_dir, manager, ranks = cluster
    cfg = {"save_interval_steps": 2, "save_interval_seconds": None}
    mgr = manager(**cfg)
    r0, r1 = ranks(mgr, cfg=cfg, concurrency=2)
    ray.get(r0.close_gate.remote())  # rank 0's disk stalls
    assert ray.get([r0.sched_step.remote(2), r1.sched_step.remote(2)]) == [True, True]
    assert ray.get(r0.wait_held.remote())
    # Step 4 is due. Rank 0 is still saving step 2 and decides to skip it...
    assert ray.get(r0.sched_step.remote(4)) is False
    ray.get(r0.open_gate.remote())
    ray.get([r0.sched_wait.remote(), r1.sched_wait.remote()])
    assert _committed(ray, mgr) == ["step_000000002"]
    # ...so rank 1, idle by now, skips it too instead of saving half a snapshot alone.
    assert ray.get(r1.sched_step.remote(4)) is False
    assert ray.get([r0.sched_step.remote(5), r1.sched_step.remote(5)]) == [True, True]
    outcomes = ray.get([r0.sched_wait.remote(), r1.sched_wait.remote()])
    assert outcomes == [{"skipped": 1, "failures": 0, "error": None}] * 2
    assert _committed(ray, mgr) == ["step_000000002", "step_000000005"]
    assert ray.get(mgr.stats.remote())["aborted"] == 0


def test_heartbeats_go_on_while_a_rank_waits_and_a_clean_close_unregisters(cluster):
    ray, run_dir, manager, ranks = cluster
    cfg = {"heartbeat_interval_seconds": 1.0}
    mgr = manager(**cfg)
    r0, r1 = ranks(mgr, cfg=cfg, concurrency=2)
    ray.get([r0.beat.remote(1), r1.beat.remote(1)])  # both are training: silence from now on would be a loss
    ray.get(r0.close_gate.remote())
    refs = [r0.save_async.remote(2), r1.save_async.remote(2)]
    ray.get(refs)
    assert ray.get(r0.wait_held.remote())
    # Both ranks now wait (rank 0 on its disk, rank 1 on the commit) and their loops send nothing. Let
    # the manager see eight liveness beats, 4 s at an interval of 1 s: twice its loss threshold.
    start = ray.get(mgr.stats.remote())["beats"]
    wait_until(
        lambda: all(ray.get(mgr.stats.remote())["beats"][p] >= start[p] + 8 for p in ("learner-0", "learner-1")),
        "eight liveness beats from each rank",
    )
    assert [f for f in ray.get(mgr.failures.remote()) if f["kind"] == "heartbeat_lost"] == []
    ray.get(r0.open_gate.remote())
    assert [x[0] for x in ray.get([r0.wait.remote(), r1.wait.remote()])] == ["step_000000002"] * 2
    ray.get([r0.close.remote(), r1.close.remote()])
    wait_until(lambda: ray.get(mgr.health.remote())["participants"] == {}, "both ranks to unregister")
    assert [f for f in ray.get(mgr.failures.remote()) if f["kind"] == "heartbeat_lost"] == []


def test_dead_manager_is_a_checkpoint_error_naming_it(cluster):
    ray, run_dir, manager, ranks = cluster
    cfg = {"save_interval_steps": 1, "save_interval_seconds": None}
    mgr = manager(**cfg)
    r0, r1 = ranks(mgr, cfg=cfg)
    assert [x[0] for x in ray.get([r0.save.remote(1), r1.save.remote(1)])] == ["step_000000001"] * 2
    ray.kill(mgr, no_restart=True)
    sid, err, _ = ray.get(r0.save.remote(2))
    assert sid is None and err.startswith("ManagerUnavailableError")
    assert "rl_ckpt:" in err and "get_or_create" in err
    # The scheduler reports it like any failed save, and training goes on.
    assert ray.get(r1.sched_step.remote(3)) is False
    outcome = ray.get(r1.sched_wait.remote())
    assert outcome["failures"] == 1 and "dead or unreachable" in outcome["error"]


def test_begin_report_abort_are_bound_to_registered_participants(cluster):
    ray, run_dir, manager, ranks = cluster
    from rl_ckpt.errors import UnknownParticipantError

    mgr = manager()
    r0, r1 = ranks(mgr)
    for call in (
        mgr.begin.remote("step_000000009", ["learner-0", "intruder"], "intruder"),
        mgr.report.remote("step_000000009", "x", "intruder", b"{}"),
        mgr.abort.remote("step_000000009", None, "intruder", "planted"),
        mgr.decide.remote("step_000000009", "intruder", True),
    ):
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(call)
        assert isinstance(info.value.as_instanceof_cause(), UnknownParticipantError)
        assert "intruder" in str(info.value)
    assert ray.get(mgr.stats.remote())["pending"] == []
    assert [x[0] for x in ray.get([r0.save.remote(9), r1.save.remote(9)])] == ["step_000000009"] * 2


@pytest.mark.slow
def test_clean_ray_train_run_with_short_heartbeats_records_no_lost_heartbeat(ray_cluster, tmp_path):
    """The PPO demo (TorchTrainer learners blocking in ray.train.report and scheduler.close(), idle rollout
    workers) run cleanly with heartbeat_interval_seconds=3: no heartbeat_lost, and nobody left registered.
    (Those blocking calls last the whole run; 3 s, not 1 s: a loaded 2-core machine stalls a process for
    over 2 s now and then, which is a lost heartbeat at 1 s and says nothing about the blocking calls.)"""
    import ray

    from rl_ckpt.demo.ray_ppo import run

    result = run(
        base_dir=str(tmp_path),
        run_name=f"hb-{uuid.uuid4().hex[:6]}",
        steps=12,  # ~10 heartbeat intervals of blocking calls on a quiet machine, more under load
        engine_cfg={"heartbeat_interval_seconds": 3.0, "save_interval_steps": 5, "keep_latest": 2},
    )
    try:
        assert result.done is not None and len(result.attempts) == 1
        assert [f for f in ray.get(result.manager.failures.remote()) if f["kind"] == "heartbeat_lost"] == []
        wait_until(
            lambda: ray.get(result.manager.health.remote())["participants"] == {}, "every participant to unregister"
        )
        steps = [s["global_step"] for s in ray.get(result.manager.snapshots.remote())]
        # Every 5 steps, unless a save was still running when one was due (then the next step saves): how many
        # are skipped depends on the machine's load, so only the spacing is checked.
        assert steps and all(b - a >= 5 for a, b in zip(steps, steps[1:])), steps
        assert ray.get(result.manager.stats.remote())["aborted"] == 0
    finally:
        ray.kill(result.manager)


def test_manager_starts_whatever_the_staging_folder_holds(cluster):
    """Unreadable or unfinishable pending commits are logged and left to gc; the constructor never raises."""
    import json

    ray, run_dir, manager, ranks = cluster
    staging = os.path.join(run_dir, ".staging")
    for name, attempt, report in (
        ("step_000000007.a", b"{not json", None),
        ("step_000000008.b", json.dumps({"expected": ["learner-0"]}).encode(), b'{"schema_version": 1, "files": 5}'),
        ("step_000000009.c", json.dumps({"expected": 7}).encode(), None),
    ):
        os.makedirs(os.path.join(staging, name))
        with open(os.path.join(staging, name, "attempt.json"), "wb") as f:
            f.write(attempt)
        if report is not None:
            with open(os.path.join(staging, name, "learner-0.report.json"), "wb") as f:
                f.write(report)
    mgr = manager()
    assert ray.get(mgr.ping.remote(), timeout=120) == "ok"
    assert ray.get(mgr.stats.remote())["pending"] == []
    r0, r1 = ranks(mgr)
    assert [x[0] for x in ray.get([r0.save.remote(8), r1.save.remote(8)])] == ["step_000000008"] * 2
