"""One save decision per step and per snapshot for every participant of a managed run, by the manager's
clock, kept on storage so a restarted manager answers the same (actors/_manager/decisions.py).

The first tests drive the decision logic with a fake clock on a real local folder; the Ray tests run two
ranks through a real manager, one of them with a clock that runs slow, and kill the manager between two
ranks' questions."""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest

from helpers import wait_until

from actors._manager.decisions import FOLDER, SaveDecisions
from rl_ckpt._format.manifest import MANIFEST_NAME
from rl_ckpt._storage.local import LocalStorage


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _decisions(root, clock, wall=None):
    return SaveDecisions(LocalStorage(str(root)), clock=clock, wall=wall or (lambda: 1_000_000.0 + clock.now))


def _never_started(sid: str) -> bool:
    return False


def test_first_asker_decides_each_step_for_everyone_by_the_managers_clock(tmp_path):
    clock = Clock()
    d = _decisions(tmp_path, clock)
    ask = lambda step, who, busy=False, kind=None: d.step(step, who, kind, busy, 10.0, _never_started)  # noqa: E731
    assert ask(1, "learner-0") == {"kind": None, "save": False}  # the interval starts at the first question
    clock.now += 9.0
    assert ask(2, "learner-0") == {"kind": None, "save": False}
    clock.now += 2.0  # the interval has elapsed by the time the slow rank asks about step 2: still not due
    assert ask(2, "learner-1") == {"kind": None, "save": False}
    assert ask(3, "learner-1") == {"kind": "full", "save": True}
    assert ask(3, "learner-0") == {"kind": "full", "save": True}
    # The interval counts from the save decided; a step-count kind is taken as given.
    assert ask(4, "learner-0", kind="light") == {"kind": "light", "save": True}
    clock.now += 10.0
    assert ask(5, "learner-0", busy=True, kind="light") == {"kind": "full", "save": False}  # due, busy: skipped
    assert ask(5, "learner-1") == {"kind": "full", "save": False}
    assert ask(6, "learner-1") == {"kind": "full", "save": True}  # still due at the next step
    assert d.get("step_000000005") == ("skip", "learner-0") and d.get("step_000000006") == ("save", "learner-1")


def test_a_restarted_manager_answers_what_was_answered_before(tmp_path):
    clock = Clock()
    d = _decisions(tmp_path, clock)
    for step in range(1, 6):  # one step a second: the horizon runs ahead of the answered steps
        assert d.step(step, "learner-0", None, False, 32.0, _never_started)["save"] is False
        clock.now += 1.0
    assert d.decide("step_000000004.light", "skip", "learner-0") == ("skip", "learner-0")

    clock.now += 100.0  # restarted long after: every interval has elapsed
    again = _decisions(tmp_path, clock)
    # Steps some rank was told were not due stay not due; the recorded skip stays a skip.
    for step in range(1, 6):
        answer = again.step(step, "learner-1", "light" if step == 4 else None, False, 32.0, _never_started)
        assert answer == ({"kind": "light", "save": False} if step == 4 else {"kind": None, "save": False})
    assert again.decide("step_000000004.light", "save", "learner-1") == ("skip", "learner-0")
    # A later step is decided by the new process's clock.
    later = [again.step(s, "learner-1", None, False, 32.0, _never_started) for s in range(6, 10)]
    assert {"kind": "full", "save": True} in later


def test_the_interval_goes_on_from_the_last_full_save_across_a_restart(tmp_path):
    clock = Clock()
    d = _decisions(tmp_path, clock)
    assert d.step(1, "learner-0", "full", False, 10.0, _never_started) == {"kind": "full", "save": True}
    clock.now += 6.0
    again = _decisions(tmp_path, clock)
    assert again.step(2, "learner-0", None, False, 10.0, _never_started)["save"] is False
    clock.now += 5.0  # 11 s after the save, though only 5 s after the restart
    assert again.step(3, "learner-0", None, False, 10.0, _never_started) == {"kind": "full", "save": True}


def test_first_decision_wins_on_storage_and_planted_records_are_ignored(tmp_path):
    clock = Clock()
    storage = LocalStorage(str(tmp_path))
    storage.makedirs(FOLDER)
    for name, body in (
        ("step_000000003.json", b"[" * 5000),
        ("step_000000002.json", b'{"decision": 5}'),
        ("horizon-x.json", b"{}"),
        ("notes.txt", b"hello"),
    ):
        with open(os.path.join(tmp_path, FOLDER, name), "wb") as f:
            f.write(body)
    d = _decisions(tmp_path, clock)  # never raises because of what the folder holds
    assert d.get("step_000000003") is None
    assert d.decide("step_000000003", "save", "learner-0") == ("save", "learner-0")
    # Two manager processes racing (the old one still finishing a call): create-only, the first wins.
    other = _decisions(tmp_path, clock)
    assert other.decide("step_000000007", "skip", "learner-1") == ("skip", "learner-1")
    assert d.decide("step_000000007", "save", "learner-0") == ("skip", "learner-1")
    body = json.loads((tmp_path / FOLDER / "step_000000007.json").read_bytes())
    assert body["decision"] == "skip" and body["by"] == "learner-1" and body["step"] == 7


def test_records_older_than_the_newest_commit_are_removed_and_a_plan_removes_all(tmp_path):
    clock = Clock()
    d = _decisions(tmp_path, clock)
    for step in range(1, 40):
        d.step(step, "learner-0", "full" if step % 10 == 0 else None, False, 1000.0, _never_started)
        clock.now += 1.0
    d.forget_before(30)
    left = sorted(os.listdir(tmp_path / FOLDER))
    assert "step_000000030.json" in left and not any(n.startswith("step_00000001") for n in left)
    assert len([n for n in left if n.startswith("horizon-")]) == 1
    assert d.step(35, "learner-1", None, False, 1000.0, _never_started) == {"kind": None, "save": False}
    d.clear()  # training goes on from an older snapshot: its steps are decided anew
    assert os.listdir(tmp_path / FOLDER) == []
    assert d.step(20, "learner-0", "full", False, 1000.0, _never_started) == {"kind": "full", "save": True}


# -- on a real Ray cluster ---------------------------------------------------------------------------------

from ray_workers import Rank  # noqa: E402  (the Ray tests' actors)


class ClockedRank(Rank):
    """A learner rank whose scheduler's own clock runs at ``rate`` x real time: a rank slowed down (a loaded
    node, a paused process), whose clock alone would call a save due at other steps than its peer's."""

    def __init__(self, *args, rate: float = 1.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        start = time.monotonic()
        self.scheduler = self.engine.scheduler(start_step=0, clock=lambda: start + (time.monotonic() - start) * rate)

    def cadence_step(self, step: int) -> tuple[bool, int]:
        """(a save started, saves skipped so far)."""
        return self.sched_step(step), self.scheduler.skipped


@pytest.fixture
def cluster(ray_cluster, tmp_path):
    """(ray, run folder, manager, make_ranks(mgr, cfg, rates)); everything made is killed afterwards."""
    from actors import CheckpointManager

    made = []
    name = f"c-{uuid.uuid4().hex[:8]}"

    def manager(**kw):
        mgr = CheckpointManager.get_or_create(run_name=name, base_dir=str(tmp_path), **kw)
        made.append(mgr)
        return mgr

    def ranks(mgr, cfg, rates=(1.0, 1.0)):
        cls = ray_cluster.remote(num_cpus=0, max_restarts=0, max_concurrency=2)(ClockedRank)
        out = [cls.remote(str(tmp_path), name, mgr, r, 2, cfg, rate=rates[r]) for r in range(2)]
        made.extend(out)
        return out

    yield ray_cluster, str(tmp_path / name), manager, ranks
    for handle in made:
        ray_cluster.kill(handle)


def _both_parts(run_dir: str, sid: str) -> bool:
    with open(os.path.join(run_dir, sid, MANIFEST_NAME), "rb") as f:
        writer = json.load(f)["writer"]
    return writer["participants"] == ["learner-0", "learner-1"] and os.path.isdir(
        os.path.join(run_dir, sid, "learner-1")
    )


@pytest.mark.ray
def test_time_cadence_is_one_decision_by_the_managers_clock_with_a_slowed_rank(cluster):
    ray, run_dir, manager, ranks = cluster
    interval = 1.0
    cfg = {"save_interval_steps": None, "save_interval_seconds": interval, "commit_timeout_seconds": 60.0}
    mgr = manager(**cfg)
    # Rank 1's clock runs at a quarter speed and it always asks after rank 0: by its own clock it would
    # call a save due about three intervals after rank 0 did, and each would save half a snapshot.
    r0, r1 = ranks(mgr, cfg, rates=(1.0, 0.25))
    ray.get([r0.beat.remote(0), r1.beat.remote(0)])
    steps = []  # (step, before rank 0 asked, after rank 0 answered, started, skipped)
    deadline = time.monotonic() + 240
    while sum(s[3] for s in steps) < 3:
        assert time.monotonic() < deadline, "three saves within the generous bound"
        step = len(steps) + 1
        before = time.monotonic()
        started0, skipped0 = ray.get(r0.cadence_step.remote(step))
        after = time.monotonic()
        started1, skipped1 = ray.get(r1.cadence_step.remote(step))
        assert (started1, skipped1) == (started0, skipped0), f"step {step}: the ranks disagree"
        steps.append((step, before, after, started0, skipped0))
    outcomes = ray.get([r0.sched_wait.remote(), r1.sched_wait.remote()])
    assert [o["failures"] for o in outcomes] == [0, 0] and outcomes[0]["error"] is None, outcomes
    assert ray.get(mgr.stats.remote())["aborted"] == 0

    saved = [s for s in steps if s[3]]
    committed = [x["snapshot_id"] for x in ray.get(mgr.snapshots.remote())]
    assert committed == [f"step_{s[0]:09d}" for s in saved]
    assert all(_both_parts(run_dir, sid) for sid in committed)
    # The cadence by the manager's clock (CLOCK_MONOTONIC is one clock for every process of this machine):
    # it decides step s while rank 0 asks, so within [before, after] of that call. A save is due once the
    # interval since the last save (or the first question) has elapsed, and not before.
    anchor = steps[0]
    skipped = 0
    for step in steps[1:]:
        due = step[3] or step[4] > skipped
        skipped = step[4]
        if due:
            assert step[2] - anchor[1] >= interval, f"step {step[0]} saved before the interval elapsed"
        else:
            assert step[1] - anchor[2] < interval, f"step {step[0]} not saved though the interval had elapsed"
        if step[3]:
            anchor = step


@pytest.mark.ray
def test_a_restarted_manager_gives_the_second_rank_the_first_ranks_answer(cluster):
    ray, run_dir, manager, ranks = cluster
    # A skip: rank 0 is still saving step 2 when step 4 is due and skips it; the manager is killed
    # before rank 1, idle, asks. It must skip step 4 too instead of saving half a snapshot alone.
    cfg = {"save_interval_steps": 2, "save_interval_seconds": None, "commit_timeout_seconds": 60.0}
    mgr = manager(**cfg)
    r0, r1 = ranks(mgr, cfg)
    ray.get(r0.close_gate.remote())  # rank 0's disk stalls
    assert ray.get([r0.sched_step.remote(2), r1.sched_step.remote(2)]) == [True, True]
    assert ray.get(r0.wait_held.remote())
    assert ray.get(r0.sched_step.remote(4)) is False
    pid = ray.get(mgr.stats.remote())["pid"]
    ray.kill(mgr, no_restart=False)
    wait_until(lambda: ray.get(mgr.stats.remote(), timeout=60)["pid"] != pid, "the manager to restart")
    ray.get(r0.open_gate.remote())
    ray.get([r0.sched_wait.remote(), r1.sched_wait.remote()])
    assert ray.get(r1.sched_step.remote(4)) is False
    assert ray.get([r0.sched_step.remote(5), r1.sched_step.remote(5)]) == [True, True]
    outcomes = ray.get([r0.sched_wait.remote(), r1.sched_wait.remote()])
    assert outcomes == [{"skipped": 1, "failures": 0, "error": None}] * 2
    assert [x["snapshot_id"] for x in ray.get(mgr.snapshots.remote())] == ["step_000000002", "step_000000005"]
    assert ray.get(mgr.stats.remote())["aborted"] == 0
    # Records of steps older than the newest commit are gone.
    assert sorted(n for n in os.listdir(os.path.join(run_dir, FOLDER)) if n.startswith("step_")) == [
        "step_000000005.json"
    ]


@pytest.mark.ray
def test_a_restarted_manager_keeps_the_time_cadence_answers_given_before(cluster):
    ray, run_dir, manager, ranks = cluster
    # Rank 0 runs ahead until the manager's clock makes a step a save step; the manager is killed; then
    # rank 1 asks about the same steps, long after the interval: the same answers, step by step.
    interval = 1.0
    cfg = {"save_interval_steps": None, "save_interval_seconds": interval, "commit_timeout_seconds": 60.0}
    mgr = manager(**cfg)
    r0, r1 = ranks(mgr, cfg)
    answers = []
    while not any(answers):
        assert len(answers) < 100_000
        answers.append(ray.get(r0.sched_step.remote(len(answers) + 1)))
    pid = ray.get(mgr.stats.remote())["pid"]
    ray.kill(mgr, no_restart=False)
    wait_until(lambda: ray.get(mgr.stats.remote(), timeout=60)["pid"] != pid, "the manager to restart")
    assert [ray.get(r1.sched_step.remote(s)) for s in range(1, len(answers) + 1)] == answers
    ray.get([r0.sched_wait.remote(), r1.sched_wait.remote()])
    assert [x["snapshot_id"] for x in ray.get(mgr.snapshots.remote())] == [f"step_{len(answers):09d}"]
    assert _both_parts(run_dir, f"step_{len(answers):09d}")
    assert ray.get(mgr.stats.remote())["aborted"] == 0
