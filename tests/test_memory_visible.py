"""The memory tier made visible: the durable manager's /healthz and /metrics show it (on a real Ray cluster),
the timeline marks memory snapshots and restores from memory apart from durable ones, and the health section's
look-up never holds a request past its bound."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
import uuid

import pytest

from helpers import PPOState, wait_until
from rl_ckpt import CheckpointEngine


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


# -- /healthz and /metrics on a real cluster ---------------------------------------------------------------------
@pytest.mark.ray
def test_healthz_and_metrics_show_the_memory_tier(ray_cluster, tmp_path):
    from actors import CheckpointManager
    from actors.memory_tier import MemoryTierService
    from rl_ckpt.integrations.memory_tier import MemoryTier

    ray = ray_cluster
    run = f"vis-{uuid.uuid4().hex[:8]}"
    base = str(tmp_path / "durable")
    # One node and memory_replicas=1: no peer can hold a copy, so the newest memory snapshot is never replicated.
    cfg = dict(keep_best=0, memory_interval_steps=2, memory_flush_every=None, memory_replicas=1)
    mgr = CheckpointManager.get_or_create(run_name=run, base_dir=base, config=cfg, healthz_port=0)
    url = ray.get(mgr.healthz_url.remote())
    status, body = _get(url)
    assert status == 200 and json.loads(body)["memory_tier"] is None  # no memory tier service for this run yet
    assert b"rl_ckpt_memory" not in _get(url.replace("/healthz", "/metrics"))[1]

    engine = CheckpointEngine(base_dir=base, run_name=run, **cfg)
    service = MemoryTierService.get_or_create(engine.config, interval=3600)
    tier = MemoryTier(engine, service=None)
    state = PPOState(seed=1)
    for name, obj in state.components().items():
        tier.register(name, obj)
    try:
        for step in range(1, 5):
            state.train_step()
            tier.maybe_save(step)
            tier.wait()
        ray.get(service.flush_now.remote("step_000000002"))
        ray.get(service.tick.remote())
        # A health request waits for the service's answer a bounded time (the manager's first look-up also loads
        # the service's class): poll until the section shows what the service holds.
        got: dict = {}

        def shown() -> bool:
            got["status"], body = _get(url)
            got["section"] = json.loads(body)["memory_tier"]
            return bool(got["section"] and got["section"].get("reachable") and got["section"]["snapshots"] == 2)

        wait_until(shown, "the memory tier section of /healthz shows the service's 2 snapshots")
        status, section = got["status"], got["section"]
        assert status == 200  # the memory tier's state has its own status; the run's health stands
        assert section["newest_snapshot"] == "step_000000004" and section["newest_step"] == 4
        held = sum(tier.memory.storage.store_info()[n]["bytes_held"] for n in section["bytes_per_node"])
        assert len(section["bytes_per_node"]) == 1 and section["bytes_total"] == held > 0
        assert section["replicas"] == 1 and not section["newest_replicated"]
        assert (
            section["status"] == "degraded"
            and "step_000000004 is not yet held on 2 nodes" in section["degraded_reason"]
        )
        assert section["replication_lag_s"] >= 0 and section["flush_lag_s"] > 0
        assert section["newest_durable"] == "step_000000002" and section["not_flushed"] == ["step_000000004"]

        status, text = _get(url.replace("/healthz", "/metrics"))
        lines = text.decode().splitlines()
        assert status == 200 and "# TYPE rl_ckpt_memory_snapshots gauge" in lines
        assert f'rl_ckpt_memory_snapshots{{run="{run}"}} 2' in lines
        assert f'rl_ckpt_memory_newest_step{{run="{run}"}} 4' in lines
        assert f'rl_ckpt_memory_tier_degraded{{run="{run}"}} 1' in lines
        node = next(iter(section["bytes_per_node"]))
        assert f'rl_ckpt_memory_bytes{{run="{run}",node="{node}"}} {held}' in lines
        assert any(ln.startswith("rl_ckpt_memory_flush_lag_seconds{") for ln in lines)

        # The service gone: the section says so (null: no service any more), /healthz still answers.
        ray.get(service.stop.remote())
        ray.kill(service, no_restart=True)

        def gone():
            status, body = _get(url)
            return status == 200 and json.loads(body)["memory_tier"] is None

        wait_until(gone, "the memory section to go with its service")
    finally:
        tier.close()
        tier.memory.storage.destroy()
        ray.kill(mgr, no_restart=True)


def test_health_section_never_waits_past_its_bound(monkeypatch):
    """A service that does not answer: the request gets 'unreachable' after the bound, not a hang or an error."""
    import actors._memory.health as mh

    release, calls = threading.Event(), []

    def stuck(run, namespace, timeout=mh.ANSWER_SECONDS):
        calls.append(run)
        release.wait()
        return {"reachable": True, "status": "ok", "snapshots": 3}

    monkeypatch.setattr(mh, "fetch", stuck)
    monkeypatch.setattr(mh, "ANSWER_SECONDS", 0.05)
    watch = mh.MemoryTierWatch("r", "ns", wait=0.05)
    first = watch.section()
    assert first["reachable"] is False and first["status"] == "unreachable" and "no answer" in first["error"]
    assert watch.section()["status"] == "unreachable" and calls == ["r"]  # one look-up in flight, not a pile
    release.set()
    watch._running.join() if watch._running else None
    assert watch.section()["snapshots"] == 3

    def broken(run, namespace, timeout=None):
        raise RuntimeError("GCS gone")

    monkeypatch.setattr(mh, "fetch", broken)
    monkeypatch.setattr(mh, "FRESH_SECONDS", 0.0)
    section = mh.MemoryTierWatch("r2", "ns").section()
    assert section["reachable"] is False and "GCS gone" in section["error"]


def test_summary_and_prometheus_text():
    from actors._memory.health import summarize
    from actors._manager.metrics import prometheus_text

    tiers = [
        {
            "snapshot_id": "step_000000002",
            "global_step": 2,
            "tiers": ["memory", "durable"],
            "replicated": True,
            "memory_nodes": ["a", "b"],
        },
        {
            "snapshot_id": "step_000000004",
            "global_step": 4,
            "tiers": ["memory"],
            "replicated": True,
            "memory_nodes": ["a", "b"],
        },
    ]
    ok = summarize(
        {
            "tiers": tiers,
            "bytes_per_node": {"a": 10, "b": 12},
            "replicas": 1,
            "replication_lag_s": 0.0,
            "flush_lag_s": 3.5,
            "not_flushed": ["step_000000004"],
            "updated_at": 100.0,
        },
        now=101.0,
    )
    assert ok["status"] == "ok" and ok["degraded_reason"] is None and ok["figures_age_s"] == 1.0
    assert (ok["snapshots"], ok["newest_step"], ok["bytes_total"], ok["newest_durable"]) == (2, 4, 22, "step_000000002")
    health = {
        "status": "ok",
        "run": 'r"1',
        "last_step": 4,
        "lost": [],
        "pending_commits": [],
        "committed": 0,
        "aborted": 0,
        "storage_free_bytes": 123456789012,
        "memory_tier": ok,
    }
    text = prometheus_text(health).splitlines()
    assert 'rl_ckpt_storage_free_bytes{run="r\\"1"} 123456789012' in text
    assert (
        'rl_ckpt_memory_bytes{run="r\\"1",node="b"} 12' in text
        and 'rl_ckpt_memory_tier_degraded{run="r\\"1"} 0' in text
    )
    assert 'rl_ckpt_memory_flush_lag_seconds{run="r\\"1"} 3.5' in text
    assert not any("memory" in ln for ln in prometheus_text({**health, "memory_tier": None}).splitlines())


# -- the timeline -------------------------------------------------------------------------------------------------
def test_timeline_marks_memory_snapshots_and_restores_from_memory(tmp_path):
    """Durable snapshots from manifests, memory snapshots and the restore from memory from ``memory_tier/``."""
    from rl_ckpt._recovery.coordinator import FailureInfo
    from rl_ckpt._recovery.history import load_decisions, record_decision
    from rl_ckpt._run.catalog import SnapshotInfo
    from rl_ckpt._run.tier_events import record_memory_snapshot, record_tier_restore
    from rl_ckpt._timeline import load, plot

    state = PPOState(seed=0)
    with state.register(CheckpointEngine(base_dir=str(tmp_path), run_name="r", keep_best=0)) as engine:
        engine.save(4, metrics={"avg_reward": 20.0})
        storage = engine.storage
        for step in (2, 4, 6):  # as MemoryTier records its memory snapshots (step 4 was also flushed)
            info = SnapshotInfo(
                f"step_{step:09d}",
                step,
                "full",
                "2026-12-01T10:00:00+00:00",
                {"avg_reward": 10.0 + step, "loss": float("nan")},
                1000,
            )
            record_memory_snapshot(storage, info)
            record_memory_snapshot(storage, info)  # a second participant's copy of the same record: one record
        plan = engine.plan_recovery(FailureInfo(kind="process_killed", step=7, participant="learner-1"))
        if not load_decisions(storage):
            record_decision(storage, plan.decision)
        decision = load_decisions(storage)[0]
        memory_plan = dataclasses_replace(plan, target="step_000000006", continue_from_step=6)
        record_tier_restore(storage, "memory", "step_000000006", 6, memory_plan, decision)
    (tmp_path / "r" / "memory_tier" / "planted.json").write_text("[1, 2]")  # damaged: skipped, never a crash
    data = load(storage)
    assert [(m["id"], m["value"]) for m in data["memory_snapshots"]] == [
        ("step_000000002", 12.0),
        ("step_000000004", 14.0),
        ("step_000000006", 16.0),
    ]
    assert [s["id"] for s in data["snapshots"]] == ["step_000000004"]  # the durable one, as before
    assert [(d["step"], d["to"], d["resumed_to"], d["tier"]) for d in data["decisions"]] == [(7, 4, 6, "memory")]
    drawn = plot(data, str(tmp_path / "t.png"))
    assert "memory-tier snapshot (Ray memory)" in drawn["legend"] and "full snapshot (kept)" in drawn["legend"]
    assert "resume from memory step 6" in drawn["notes"] and (tmp_path / "t.png").stat().st_size > 0


def dataclasses_replace(plan, **changes):
    import dataclasses

    return dataclasses.replace(plan, **changes)


def test_demo_memory_tier_only_with_the_ray_drills(capsys):
    from rl_ckpt.demo.__main__ import main

    with pytest.raises(SystemExit) as exc:  # asked for explicitly where there is no Ray: a usage error, nothing run
        main(["--memory-tier", "--local"])
    assert exc.value.code == 2 and "--memory-tier needs Ray" in capsys.readouterr().err
