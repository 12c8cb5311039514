"""Releasing a finished run's memory on a real Ray cluster: ``memory_runs`` / ``rl-ckpt memory ls`` list the runs
holding memory, ``release_run`` / ``rl-ckpt memory drop`` free a run's memory-snapshot and policy-version stores,
its service and memory manager; never while it trains, never losing a memory snapshot durable storage lacks
without ``--force``; the newest memory snapshot is copied to durable storage first."""

from __future__ import annotations

import uuid

import pytest
import torch

from helpers import wait_until
from rl_ckpt import CheckpointEngine
from rl_ckpt.cli import main as cli

pytestmark = pytest.mark.ray


def _named(ray, run: str) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if run in a["name"])


def _tier(tmp_path, run: str, steps, *, service: bool):
    """A run whose trainer saved memory snapshots at ``steps`` (and, with ``service``, runs its MemoryTierService,
    which flushes nothing on its own here: memory_flush_every is large)."""
    from actors.memory_tier import MemoryTierService
    from rl_ckpt.integrations.memory_tier import MemoryTier

    cfg = {"base_dir": str(tmp_path), "run_name": run, "memory_replicas": 0, "memory_flush_every": 1000}
    engine = CheckpointEngine(**cfg)
    handle = MemoryTierService.get_or_create(engine.config, interval=3600.0) if service else None
    tier = MemoryTier(engine, service=None)
    tier.register("policy", torch.nn.Linear(64, 64))
    for step in steps:
        tier.save(step).wait()
    tier.close()
    engine.close()
    return handle


def test_a_finished_run_is_listed_then_released_with_its_newest_snapshot_copied(ray_cluster, tmp_path, capsys):
    from actors import CheckpointManager, PolicyVersions
    from actors.memory_tier import memory_runs, release_run
    from rl_ckpt.errors import CheckpointError

    ray = ray_cluster
    run = f"rel-{uuid.uuid4().hex[:8]}"
    _tier(tmp_path, run, [1, 2], service=True)
    versions = PolicyVersions(run, torch.nn.Linear(64, 64), replicas=0)
    versions.publish(1)
    versions.close()
    listed = {r["run"]: r for r in memory_runs()}[run]
    assert set(listed["holds"]) == {"mem", "versions"} and listed["service"] and listed["bytes"] > 0
    assert listed["holds"]["mem"]["snapshots"] == ["step_000000001", "step_000000002"]
    assert cli(["memory", "ls"]) == 0 and run in capsys.readouterr().out

    # While a participant trains (registered with the run's manager, beating with a step), nothing is released.
    manager = CheckpointManager.get_or_create(run_name=run, base_dir=str(tmp_path), healthz_port=None)
    ray.get(manager.register.remote("learner-0", {"pid": 12345}))
    ray.get(manager.heartbeat.remote("learner-0", 7, None))
    with pytest.raises(CheckpointError, match="learner-0"):
        release_run(run)
    assert cli(["memory", "drop", run]) == 1 and "still training" in capsys.readouterr().err
    assert run in {r["run"] for r in memory_runs()}  # nothing was released
    ray.get(manager.unregister.remote("learner-0"))  # the run ended cleanly

    assert cli(["memory", "drop", run]) == 0
    out = capsys.readouterr().out
    assert "copied step_000000002 to durable storage first" in out and f"released run {run}" in out, out
    # Only the durable manager is left (it holds no bytes); Ray forgets a killed actor's name a moment later.
    wait_until(lambda: _named(ray, run) == [f"rl_ckpt:{run}"], "the run's stores and service gone")
    assert run not in {r["run"] for r in memory_runs()}
    with CheckpointEngine(base_dir=str(tmp_path), run_name=run) as engine:  # the copy is a durable snapshot
        assert [s.snapshot_id for s in engine.snapshots()] == ["step_000000002"]
        assert engine.verify().ok
    ray.kill(manager)


def test_memory_durable_storage_lacks_is_not_released_without_force(ray_cluster, tmp_path, capsys):
    from actors.memory_tier import memory_runs

    ray = ray_cluster
    run = f"rel-{uuid.uuid4().hex[:8]}"
    _tier(tmp_path, run, [3], service=False)  # no service: nobody can copy step 3
    assert cli(["memory", "drop", run]) == 1
    err = capsys.readouterr().err
    assert "step_000000003" in err and "no MemoryTierService" in err and "--force" in err, err
    assert run in {r["run"] for r in memory_runs()}
    assert cli(["memory", "drop", run, "--force"]) == 0
    assert "without a durable copy (--force): step_000000003" in capsys.readouterr().out
    wait_until(lambda: _named(ray, run) == [], "the run's stores gone")
    assert run not in {r["run"] for r in memory_runs()}


def test_a_store_that_does_not_say_what_it_holds_stops_the_release(monkeypatch):
    """With no service to copy what memory holds, a store whose inventory call fails may hold the only copy of a
    snapshot: the release is refused naming its node (nothing killed), and ``force`` releases it as lost."""
    import types

    from actors._memory import release
    from rl_ckpt.errors import CheckpointError

    class Call:
        def __init__(self, fn):
            self.remote = fn

    killed = []
    silent = types.SimpleNamespace(inventory=Call(lambda _p: "inventory"), info=Call(lambda: "info"))
    answers = {"inventory": RuntimeError("store unreachable"), "info": {"bytes_held": 7}}

    def get(what, timeout=None):
        if isinstance(answers[what], Exception):
            raise answers[what]
        return answers[what]

    def get_actor(name, namespace=None):
        raise ValueError(name)  # no service, no memory manager

    fake = types.SimpleNamespace(get=get, get_actor=get_actor, kill=lambda h, no_restart: killed.append(h))
    monkeypatch.setattr(release, "need_ray", lambda: fake)
    monkeypatch.setattr(release, "_training", lambda *a: [])
    monkeypatch.setattr(release, "_stores", lambda ns: {("mem", "r"): {"node-a": silent}})
    with pytest.raises(CheckpointError, match="node-a") as info:
        release.release_run("r")
    assert "force" in str(info.value) and killed == []
    report = release.release_run("r", force=True)
    assert killed == [silent] and report["stores"]["mem"] == {"node-a": 7}
    assert any("node-a" in lost for lost in report["lost"])
