"""The CheckpointManager actor on a real local Ray cluster: sharded two-phase commit, restarts,
heartbeats, /healthz."""

from __future__ import annotations

import glob
import json
import time
import urllib.error
import urllib.request
import uuid

import pytest

from ray_workers import Participant, loads_torch

pytestmark = pytest.mark.ray
PARTS = ["learner-0", "learner-1", "rollout-0", "rollout-1"]


@pytest.fixture
def run(ray_cluster, tmp_path):
    from actors import CheckpointManager

    name = f"t-{uuid.uuid4().hex[:8]}"
    handles = []

    def make(**cfg):
        mgr = CheckpointManager.get_or_create(run_name=name, base_dir=str(tmp_path), **cfg)
        handles.append(mgr)
        return mgr

    yield name, str(tmp_path), make
    for h in handles:
        ray_cluster.kill(h)


def _group(ray, base, name, mgr, nbytes=64 * 1024, cfg=None, restarts=0):
    actor = ray.remote(num_cpus=0, max_restarts=restarts, max_task_retries=0)(Participant)
    return [
        actor.remote(base, name, mgr, 0, 2, "learner", PARTS, nbytes, cfg),
        actor.remote(base, name, mgr, 1, 2, "learner", PARTS, nbytes, cfg),
        actor.remote(base, name, mgr, 0, 2, "rollout", PARTS, nbytes, cfg),
        actor.remote(base, name, mgr, 1, 2, "rollout", PARTS, nbytes, cfg),
    ]


def test_sharded_commit_sends_only_metadata(ray_cluster, run):
    ray = ray_cluster
    name, base, make = run
    mgr = make()
    group = _group(ray, base, name, mgr, 64 * 1024)
    assert ray.get([p.save.remote(1) for p in group]) == ["step_000000001"] * 4
    ray.get([p.resize.remote(16 * 1024 * 1024) for p in group])  # 4 x 16 MiB of state from now on
    assert ray.get([p.save.remote(2) for p in group]) == ["step_000000002"] * 4
    received = ray.get(mgr.stats.remote())["bytes_received"]
    small_bytes, big_bytes = received["step_000000001"], received["step_000000002"]
    assert big_bytes < 64 * 1024 and small_bytes < 64 * 1024  # 4 x 16 MiB of state, a few KiB through the manager
    assert abs(big_bytes - small_bytes) < 1024  # independent of the state size
    snaps = ray.get(mgr.snapshots.remote())
    assert [s["snapshot_id"] for s in snaps] == ["step_000000001", "step_000000002"]
    meta = json.loads(open(f"{base}/{name}/step_000000002/meta.json").read())
    assert {f["path"].split("/")[0] for f in meta["files"]} == {"shared", *PARTS}
    assert sum(1 for f in meta["files"] if f["path"].startswith("shared/policy")) == 2  # written once, by rank 0
    assert sum(f["size"] for f in meta["files"]) > 4 * 16 * 1024 * 1024  # the state went to storage directly
    restored = ray.get([p.restore.remote() for p in group])
    assert all(r[:3] == ("step_000000002", 2, 2) for r in restored)


def test_killed_rollout_worker_means_no_commit_and_the_next_one_commits(ray_cluster, run):
    ray = ray_cluster
    name, base, make = run
    mgr = make(commit_timeout_seconds=8.0)
    group = _group(ray, base, name, mgr, cfg={"commit_timeout_seconds": 8.0}, restarts=1)
    assert ray.get([p.save.remote(1) for p in group]) == ["step_000000001"] * 4
    dead_pid = ray.get(group[3].pid.remote())
    group[3].die.remote()  # SIGKILL, before it reports step 2
    pending = [p.save.remote(2) for p in group[:3]]
    errors = []
    for ref in pending:
        try:
            ray.get(ref, timeout=60)
        except Exception as exc:  # the three that reported wait, then hear the snapshot was aborted
            errors.append(str(exc))
    assert len(errors) == 3 and all("aborted" in e for e in errors)
    assert [s["snapshot_id"] for s in ray.get(mgr.snapshots.remote())] == ["step_000000001"]
    # The worker was restarted by Ray (max_restarts=1): the next snapshot commits with everyone.
    # First wait for the restart to finish (a call that reaches it while it is still restarting waits for the
    # restart instead of failing): a restart slower than the 8 s commit timeout must not abort step 3.
    new_pid = ray.get(group[3].pid.options(max_task_retries=-1).remote(), timeout=120)
    assert new_pid != dead_pid
    assert (
        ray.get([p.save.options(max_task_retries=-1).remote(3) for p in group], timeout=120) == ["step_000000003"] * 4
    )
    restored = ray.get([p.restore.remote() for p in group])
    assert all(r[1] == 3 and r[2] == 3 for r in restored)


def test_manager_killed_mid_run_restarts_and_loses_nothing(ray_cluster, run):
    ray = ray_cluster
    name, base, make = run
    mgr = make()
    group = _group(ray, base, name, mgr)
    for step in (1, 2):
        ray.get([p.save.remote(step) for p in group])
    # Kill it in the middle of a commit: two of four participants have reported.
    first = [p.save.remote(3) for p in group[:2]]
    deadline = time.monotonic() + 120
    while len(glob.glob(f"{base}/{name}/.staging/step_000000003.*/learner-*.report.json")) < 2:
        assert time.monotonic() < deadline, "the two learners never wrote their reports"
        time.sleep(0.05)
    ray.kill(mgr, no_restart=False)
    rest = [p.save.remote(3) for p in group[2:]]
    assert ray.get(first + rest, timeout=120) == ["step_000000003"] * 4
    assert [s["snapshot_id"] for s in ray.get(mgr.snapshots.remote())] == [f"step_00000000{i}" for i in (1, 2, 3)]
    ray.kill(mgr, no_restart=False)  # again, between saves: the catalog is rebuilt from storage
    assert ray.get([p.save.remote(4) for p in group], timeout=120) == ["step_000000004"] * 4
    assert [s["global_step"] for s in ray.get(mgr.snapshots.remote())] == [1, 2, 3, 4]


def test_hung_worker_is_detected_and_stopped(ray_cluster, run):
    ray = ray_cluster
    name, base, make = run
    mgr = make(heartbeat_interval_seconds=0.5, kill_hung=True)
    cfg = {"heartbeat_interval_seconds": 0.5}
    actor = ray.remote(num_cpus=0, max_restarts=1, max_concurrency=2)(Participant)
    worker = actor.remote(base, name, mgr, 0, 1, "learner", ["learner-0"], 4096, cfg)
    ray.get(worker.beat.remote(1))
    old_pid = ray.get(worker.pid.remote())
    worker.hang.remote()  # the worker sleeps forever: no more heartbeats
    deadline = time.monotonic() + 60
    failures = []
    while time.monotonic() < deadline and not failures:
        failures = [f for f in ray.get(mgr.failures.remote()) if f["kind"] == "heartbeat_lost"]
        time.sleep(0.2)
    assert failures and failures[0]["participant"] == "learner-0" and "no heartbeat" in failures[0]["message"]
    new_pid = None
    while time.monotonic() < deadline:
        try:
            new_pid = ray.get(worker.pid.remote(), timeout=10)
            if new_pid != old_pid:
                break
        except Exception:  # the actor is being restarted
            time.sleep(0.2)
    assert new_pid is not None and new_pid != old_pid  # stopped and restarted by Ray


def test_healthz(ray_cluster, run):
    ray = ray_cluster
    name, base, make = run
    mgr = make(heartbeat_interval_seconds=0.5)
    group = _group(ray, base, name, mgr, cfg={"heartbeat_interval_seconds": 0.5})
    ray.get([p.save.remote(5) for p in group])
    ray.get([p.beat.remote(6) for p in group])
    url = ray.get(mgr.healthz_url.remote())
    assert url.startswith("http://127.0.0.1:")
    body = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert body["run"] == name and body["last_committed_snapshot"] == "step_000000005"
    assert set(body["participants"]) == set(PARTS)
    assert all("heartbeat_age_s" in p for p in body["participants"].values())
    assert body["storage_free_bytes"] > 0 and "patrol" in body and body["last_step"] >= 5
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(url.replace("/healthz", "/other"), timeout=10)


def test_attaching_to_a_manager_of_the_same_run_name_in_another_folder_is_refused(ray_cluster, run, tmp_path_factory):
    """A second run reusing a run name while its first manager still runs: attaching would commit into, and plan
    restores from, the first run's folder. get_or_create names both folders; the first run keeps its manager and
    its snapshots; the same folder still attaches (also a spelled-differently relative path)."""
    import torch

    from actors import CheckpointManager
    from rl_ckpt import CheckpointEngine, CheckpointError
    from rl_ckpt.errors import ConfigError

    ray = ray_cluster
    name, base, make = run
    mgr = make()
    engine = CheckpointEngine(base_dir=base, run_name=name, manager=mgr, participants=["learner-0"])  # the driver
    engine.register("policy", torch.nn.Linear(4, 4))
    assert engine.save(1).snapshot_id == "step_000000001"
    # A commit, a plan, health: none of it imports torch in the manager's process (seconds at every (re)start).
    # (A participant that is an actor sends its handle, and Ray loads the actor's class, and its imports, with it.)
    ray.get(mgr.plan.remote())
    urllib.request.urlopen(ray.get(mgr.healthz_url.remote()), timeout=10).read()
    assert not loads_torch(ray.get(mgr.stats.remote())["pid"])
    other = tmp_path_factory.mktemp("other-run")
    with pytest.raises(ConfigError) as err:
        CheckpointManager.get_or_create(run_name=name, base_dir=str(other))
    assert isinstance(err.value, CheckpointError) and err.value.key == "base_dir"
    assert base in str(err.value) and str(other) in str(err.value) and repr(name) in str(err.value)
    assert [s["snapshot_id"] for s in ray.get(mgr.snapshots.remote())] == ["step_000000001"]  # nothing lost
    assert not list(other.iterdir())  # nothing written into the other folder
    same = CheckpointManager.get_or_create(run_name=name, base_dir=base + "/.")
    assert ray.get(same.run_url.remote()) == ray.get(mgr.run_url.remote())
    assert ray.get(same.stats.remote())["pid"] == ray.get(mgr.stats.remote())["pid"]  # attached, not a new one
    engine.close()
