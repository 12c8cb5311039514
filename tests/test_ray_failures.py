"""Failure attribution and /healthz on a real local Ray cluster: the failure record names the participant
whose process died and the step it had reached (not a survivor's), /healthz answers 503 with that failure
while a participant is lost and 200 again once the group is whole; and the Ray Train report pointer is
remembered per engine."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid

import pytest

from ray_workers import Participant
from helpers import wait_until

PARTS = ["learner-0", "learner-1", "rollout-0", "rollout-1"]


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _dead_actor_error(ray, actor):
    """SIGKILL ``actor``; returns the real error Ray raises for the call that was queued behind the kill."""
    from ray.exceptions import RayActorError

    actor.die.remote()
    with pytest.raises(RayActorError) as info:
        ray.get(actor.pid.remote(), timeout=60)
    return info.value


@pytest.fixture
def manager(ray_cluster, tmp_path):
    from actors import CheckpointManager

    handles = []

    def make(**cfg):
        name = f"f-{uuid.uuid4().hex[:8]}"
        mgr = CheckpointManager.get_or_create(run_name=name, base_dir=str(tmp_path), **cfg)
        handles.append(mgr)
        return name, mgr

    yield make
    for h in handles:
        ray_cluster.kill(h)


def _registered(ray, mgr, names) -> bool:
    parts = ray.get(mgr.health.remote())["participants"]
    return all(parts.get(n, {}).get("pid") for n in names)


@pytest.mark.ray
def test_killed_participant_is_named_with_its_own_step_and_healthz_degrades(ray_cluster, manager, tmp_path):
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback, WorkerHealthCheckFailedError

    from rl_ckpt.integrations.ray_train import dead_processes, failure_from_exceptions

    ray = ray_cluster
    name, mgr = manager(heartbeat_interval_seconds=60)  # no heartbeat loss in this test: only the kills
    actor = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(Participant)
    group = {p: actor.remote(str(tmp_path), name, mgr, int(p[-1]), 2, p.split("-")[0], PARTS, 4096) for p in PARTS}
    wait_until(lambda: _registered(ray, mgr, PARTS), "every participant registered")
    url = ray.get(mgr.healthz_url.remote())
    assert _get(url)[0] == 200

    # A rollout worker dies at step 9 while the learners ran on to step 12; learner-0 saw the death
    # (its call failed), learner-1 only a broken collective.
    for p, step in zip(PARTS, (12, 12, 9, 12)):
        ray.get(mgr.heartbeat.remote(p, step, None))
    died = _dead_actor_error(ray, group["rollout-0"])
    seen = {
        0: UserExceptionWithTraceback(died, "Traceback ...\nActorDiedError"),
        1: RuntimeError("[gloo] Connection closed by peer"),
    }
    failure = failure_from_exceptions(seen)
    assert failure.kind.value == "process_killed"
    stored = ray.get(mgr.record_failure.remote(failure.to_json(), dead_processes(seen)))
    assert stored["participant"] == "rollout-0" and stored["step"] == 9

    status, body = _get(url)
    assert status == 503 and body["status"] == "degraded" and body["lost"] == ["rollout-0"]
    assert body["failure"]["participant"] == "rollout-0" and body["failure"]["kind"] == "process_killed"

    # Ray restarts it (here: a new actor in its place); once it registers the group is whole again.
    group["rollout-0"] = actor.remote(str(tmp_path), name, mgr, 0, 2, "rollout", PARTS, 4096)
    wait_until(lambda: _get(url)[0] == 200, "/healthz back to 200 after the restart")

    # A learner rank killed: Ray Train reports its health check failed with the actor's death; the other
    # rank raised a gloo error. The record names the killed rank and its step, not the rank that raised.
    for p, step in zip(PARTS, (31, 30, 31, 31)):
        ray.get(mgr.heartbeat.remote(p, step, None))
    died = _dead_actor_error(ray, group["learner-1"])
    seen = {
        0: RuntimeError("[gloo] Connection closed by peer; a remote worker crashed"),
        1: WorkerHealthCheckFailedError("A worker health check failed.", failure=died),
    }
    failure = failure_from_exceptions(seen)
    assert failure.participant == "learner-1" and failure.kind.value == "process_killed"
    stored = ray.get(mgr.record_failure.remote(failure.to_json(), dead_processes(seen)))
    assert stored["participant"] == "learner-1" and stored["step"] == 30
    assert _get(url)[0] == 503
    assert [f["participant"] for f in ray.get(mgr.failures.remote())] == ["rollout-0", "learner-1"]
    group["learner-1"] = actor.remote(str(tmp_path), name, mgr, 1, 2, "learner", PARTS, 4096)
    wait_until(lambda: _get(url)[0] == 200, "/healthz back to 200 after the learner restart")

    # Restarted before the failure is recorded: the new process has no step yet, so the record says
    # "unknown" rather than borrowing a survivor's later step.
    from ray.exceptions import RayActorError

    restartable = ray.remote(num_cpus=0, max_restarts=1, max_task_retries=0)(Participant)
    group["rollout-1"] = restartable.remote(str(tmp_path), name, mgr, 1, 2, "rollout", PARTS, 4096)
    old_pid = ray.get(group["rollout-1"].pid.remote(), timeout=60)
    wait_until(lambda: ray.get(mgr.health.remote())["participants"]["rollout-1"]["pid"] == old_pid, "registration")
    ray.get(mgr.heartbeat.remote("rollout-1", 40, None))
    with pytest.raises(RayActorError) as info:
        ray.get(group["rollout-1"].die.remote(), timeout=60)  # Ray restarts it: same actor, new process
    died = info.value
    wait_until(lambda: ray.get(mgr.health.remote())["participants"]["rollout-1"]["pid"] != old_pid, "re-registration")
    seen = {1: UserExceptionWithTraceback(died, "Traceback ...")}
    stored = ray.get(mgr.record_failure.remote(failure_from_exceptions(seen).to_json(), dead_processes(seen)))
    assert stored["participant"] == "rollout-1" and stored["step"] is None
    # Whether the registration is already the restarted process is known only when Ray's error names the
    # dead pid; either way the participant is back once the restarted process reports a step.
    ray.get(group["rollout-1"].beat.options(max_task_retries=-1).remote(41))  # (waits out the restart's end)
    wait_until(lambda: _get(url)[0] == 200, "/healthz 200 once the restarted process beats")


@pytest.mark.ray
def test_healthz_degraded_while_a_heartbeat_is_lost(ray_cluster, manager, tmp_path):
    ray = ray_cluster
    name, mgr = manager(heartbeat_interval_seconds=0.5)
    actor = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(Participant)
    cfg = {"heartbeat_interval_seconds": 0.5}
    victim = actor.remote(str(tmp_path), name, mgr, 0, 1, "learner", ["learner-0"], 4096, cfg)
    wait_until(lambda: _registered(ray, mgr, ["learner-0"]), "registered")
    url = ray.get(mgr.healthz_url.remote())
    ray.get(mgr.heartbeat.remote("learner-0", 5, None))
    _dead_actor_error(ray, victim)  # SIGKILLed: it falls silent at step 5
    status, body = wait_until(lambda: (lambda r: r if r[0] == 503 else None)(_get(url)), "/healthz 503 on the silence")
    assert body["lost"] == ["learner-0"]
    assert body["failure"]["kind"] == "heartbeat_lost" and body["failure"]["participant"] == "learner-0"
    assert body["failure"]["step"] == 5
    # kept: a dropped handle ends the actor
    back = actor.remote(str(tmp_path), name, mgr, 0, 1, "learner", ["learner-0"], 4096, cfg)
    assert ray.get(back.pid.remote(), timeout=60)
    wait_until(lambda: _get(url)[0] == 200, "/healthz back to 200 once the participant is back")


def test_report_pointer_is_per_engine(tmp_path, monkeypatch):
    """Two engines in one process each attach a pointer to their own newest snapshot."""
    import ray.train
    import torch

    from rl_ckpt import CheckpointEngine
    from rl_ckpt.integrations import ray_train

    sent = []
    monkeypatch.setattr(
        ray.train,
        "report",
        lambda metrics, checkpoint=None: sent.append(
            json.load(open(f"{checkpoint.path}/rl_ckpt_pointer.json"))["snapshot_id"] if checkpoint else None
        ),
    )
    engines = []
    for run in ("a", "b"):
        e = CheckpointEngine(base_dir=str(tmp_path), run_name=run)
        e.register("policy", torch.nn.Linear(2, 2))
        e.save(10)
        engines.append(e)
    a, b = engines
    ray_train.report({"step": 10}, a)
    ray_train.report({"step": 10}, b)  # the same snapshot id in another run: still new for b
    ray_train.report({"step": 10}, a)  # nothing new for a
    assert sent == ["step_000000010", "step_000000010", None]
    a.save(20)
    ray_train.report({"step": 20}, a)
    ray_train.report({"step": 20}, b)
    assert sent[3:] == ["step_000000020", None]
    for e in engines:
        e.close()


def test_a_rank_can_name_the_failed_participant_and_its_step():
    """A rank whose rollout worker died raises ParticipantFailedError: after Ray Train's wrapping and
    pickling, the failure names that worker and its step, not the rank and not another rank's gloo error."""
    import pickle

    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    from rl_ckpt.errors import CheckpointError
    from rl_ckpt.integrations.ray_train import ParticipantFailedError, dead_processes, failure_from_exceptions

    told = ParticipantFailedError(
        "rollout-3 died after step 24: ActorDiedError",
        participant="rollout-3",
        step=24,
        kind="process_killed",
        actor_id="ab12",
        pid=4242,
    )
    assert isinstance(told, CheckpointError)
    seen = pickle.loads(
        pickle.dumps(
            {0: RuntimeError("[gloo] Connection closed by peer"), 1: UserExceptionWithTraceback(told, "Traceback ...")}
        )
    )
    failure = failure_from_exceptions(seen)
    assert (failure.kind.value, failure.participant, failure.step) == ("process_killed", "rollout-3", 24)
    assert dead_processes(seen) == [{"actor_id": "ab12", "pid": 4242}]


def test_restore_without_light_reports_the_plan_it_follows(tmp_path):
    """A plan made with a light layer (as the manager makes it for everyone), followed by restore(light=False):
    the plan returned says what was done: no light, resume after the full snapshot, every load from it."""
    import torch

    from rl_ckpt import CheckpointEngine, TrainingProgress

    engine = CheckpointEngine(base_dir=str(tmp_path), run_name="r", light_components=["progress"])
    progress = TrainingProgress()
    engine.register("policy", torch.nn.Linear(2, 2))
    engine.register("progress", progress)
    engine.save(20)
    progress.global_step = 25
    engine.save(25, kind="light")
    plan = engine.plan_recovery()
    assert plan.light == "step_000000025.light" and plan.continue_from_step == 25
    result = engine.restore(plan, light=False)
    assert result.global_step == 20 and result.plan.light is None and result.plan.continue_from_step == 20
    assert {a.snapshot_id for a in result.plan.actions} == {"step_000000020"}
    assert "training resumes after step 20" in str(result.plan)
    engine.close()


@pytest.mark.ray
def test_a_failure_request_names_no_file_and_hostile_fields_are_refused(ray_cluster, manager, tmp_path):
    """Any driver on the cluster can call the manager (here: from the tests' namespace, the manager lives in
    ``rl_ckpt``). Fields that could steer a path or smuggle data are refused, naming the field; nothing is
    written for them; a plain failure still lands under ``failures/`` with a name of the manager's."""
    import os

    from rl_ckpt.errors import ConfigError

    ray = ray_cluster
    name, mgr = manager(heartbeat_interval_seconds=60)
    run = tmp_path / name
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    hostile = [
        ({"kind": "exception", "time": "../../escape"}, "time"),
        ({"kind": "exception", "time": "/abs/escape"}, "time"),
        ({"kind": "exception", "participant": "../../learner-0"}, "participant"),
        ({"kind": "exception", "participant": "a/b"}, "participant"),
        ({"kind": "../../x"}, "kind"),
        ({"kind": "exception", "step": "../3"}, "step"),
        ({"kind": "exception", "path": "../../x"}, "path"),
        ({"kind": "exception", "name": "x.json"}, "name"),
        (["exception"], "failure"),
    ]
    for body, key in hostile:
        with pytest.raises(ConfigError) as info:
            ray.get(mgr.record_failure.remote(body))
        assert info.value.key == key and key in str(info.value), (body, info.value)
    after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert after == before and not (run / "failures").exists(), after
    stored = ray.get(mgr.record_failure.remote({"kind": "exception", "step": 3, "participant": "learner-0"}))
    records = os.listdir(run / "failures")
    assert stored["participant"] == "learner-0" and len(records) == 1 and records[0].endswith("-exception.json")


@pytest.mark.ray
def test_the_plan_answers_a_reported_death_not_the_silence_noticed_after_it(ray_cluster, manager, tmp_path):
    """A process killed at step 23, then the watch's heartbeat loss of the same incident with an earlier step: the
    manager's plan answers the death, and the decision it records says step 23 (a hang alone is still answered)."""
    import json

    from ray_workers import Participant

    ray = ray_cluster
    name, mgr = manager(heartbeat_interval_seconds=60, healthz_port=None)
    learner = ray.remote(num_cpus=0)(Participant).remote(str(tmp_path), name, mgr, 0, 1, "learner", ["learner-0"])
    ray.get(learner.save.remote(20))  # a snapshot to restore: the plan decides (and records why)
    ray.kill(learner)
    ray.get(mgr.record_failure.remote({"kind": "process_killed", "step": 23, "participant": "learner-1"}))
    ray.get(mgr.record_failure.remote({"kind": "heartbeat_lost", "step": 21, "participant": "rollout-0"}))
    ray.get(mgr.plan.remote())
    decisions = [json.loads(p.read_text()) for p in sorted((tmp_path / name / "decisions").iterdir())]
    assert [(d["failure"]["kind"], d["failure"]["step"]) for d in decisions] == [("process_killed", 23)], decisions
    # a later incident of silence alone: answered by the next plan
    ray.get(mgr.record_failure.remote({"kind": "heartbeat_lost", "step": 30, "participant": "learner-0"}))
    ray.get(mgr.plan.remote())
    decisions = [json.loads(p.read_text()) for p in sorted((tmp_path / name / "decisions").iterdir())]
    assert [(d["failure"]["kind"], d["failure"]["step"]) for d in decisions][1:] == [("heartbeat_lost", 30)]
