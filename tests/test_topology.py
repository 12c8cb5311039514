"""The topology seam (core/topology.py): what Solo, TorchDistributed and Managed answer, the one transition
(sharded state registered), and the restorer reusing the plan's verdicts (recovery/plan.py ``verdict_of``)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from helpers import PPOState
from rl_ckpt import CheckpointEngine, ConfigError, NoValidSnapshotError
from rl_ckpt._commit import StagedRenameCommit
from rl_ckpt._commit.collective import DistributedCommit
from rl_ckpt._core.topology import Managed, Solo, TorchDistributed
from rl_ckpt._recovery import plan as plan_module
from rl_ckpt._recovery.plan import RecoveryPlan
from rl_ckpt._storage import open_storage


class FakeCommit:
    """A commit strategy that records the failures it is told about."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def fail(self, snapshot_id, attempt, error) -> None:
        self.failed.append(snapshot_id)


class FakeHeartbeat:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def beat(self, step, newest) -> None:
        self.calls.append(("beat", step, newest))

    def close(self) -> None:
        self.calls.append(("close",))


class FakeClient:
    """The manager client's calls, answered and recorded without Ray."""

    def __init__(self, participant: str) -> None:
        self.participant = participant
        self.calls: list = []
        self.heartbeat = FakeHeartbeat(self.calls)

    def decide(self, snapshot_id, busy):
        self.calls.append(("decide", snapshot_id, busy))
        return not busy

    def decide_step(self, global_step, kind, busy, interval):
        self.calls.append(("decide_step", global_step, kind, busy, interval))
        return "full", True

    def recovery_plan(self, failure, light=True):
        self.calls.append(("plan", failure) if light else ("plan", failure, "no light"))
        return RecoveryPlan("mem://run", "start_fresh", "the manager's plan", retired=["step_000000009"]).to_json()

    def unregister(self) -> None:
        self.calls.append(("unregister",))


def managed(rank: int = 1, world_size: int = 2) -> tuple[Managed, FakeClient, FakeCommit]:
    client, commit = FakeClient(f"learner-{rank}"), FakeCommit()
    topo = Managed(
        object(),
        client,
        rank=rank,
        world_size=world_size,
        role="learner",
        commit=commit,
        participants=["learner-0", "learner-1", "rollout-0"],
    )
    return topo, client, commit


def test_single_writer_engine_is_solo_and_keeps_components_at_the_top(tmp_path):
    s = PPOState()
    engine = s.register(CheckpointEngine(base_dir=str(tmp_path)))
    topo = engine.topology
    assert isinstance(topo, Solo) and engine.manager is None and engine.participant is None
    assert topo.participants is None and topo.leads and not topo.replicates
    assert topo.runs_maintenance and topo.applies_retention and topo.records_decisions
    assert not topo.agrees_on_restore()
    assert topo.agree(5, "full", busy=False) and not topo.agree(5, "full", busy=True)
    info = engine.save(1)
    assert set(info.manifest.components) == set(s.components())  # no scope folder for one writer
    assert engine.registry.key("policy") == "policy"
    assert engine.registry.stored_key(info.manifest, "policy") == "policy"
    engine.close()


def test_solo_cadence_is_by_this_process_clock_then_agreed():
    topo = Solo(rank=0, world_size=1, role="learner", commit=FakeCommit())

    def not_asked():
        raise AssertionError("a single writer never asks what is due by steps alone")

    assert topo.cadence(10, 30.0, not_asked, lambda: "full", busy=False) == ("full", True)
    assert topo.cadence(10, 30.0, not_asked, lambda: "full", busy=True) == ("full", False)
    assert topo.cadence(10, None, not_asked, lambda: None, busy=False) == (None, False)


def test_managed_asks_its_manager_client_for_every_decision():
    topo, client, commit = managed()
    assert topo.key("policy", replicated=True) == "shared/policy"
    assert topo.key("rng", replicated=False) == "learner-1/rng"
    assert topo.stored_keys("rng") == ["learner-1/rng", "shared/rng", "rng"]
    assert topo.replicates and not topo.leads  # learner-0 is first by name
    assert managed(rank=0)[0].leads
    assert not (topo.runs_maintenance or topo.applies_retention or topo.records_decisions)
    assert topo.empty_part_ok  # a participant whose state is all replicated contributes an empty part

    assert topo.agree(20, "full", busy=True) is False
    assert client.calls[-1] == ("decide", "step_000000020", True)
    # Under a time cadence the manager's clock decides; by steps alone, the local answer is agreed with it.
    assert topo.cadence(21, 30.0, lambda: "light", lambda: pytest.fail("not by this clock"), False) == ("full", True)
    assert client.calls[-1] == ("decide_step", 21, "light", False, 30.0)
    assert topo.cadence(22, None, lambda: None, lambda: "full", busy=False) == ("full", True)
    assert client.calls[-1] == ("decide", "step_000000022", False)

    topo.failed_before_begin(23, "full", RuntimeError("staging failed"))
    topo.failed_before_begin(23, "bogus", RuntimeError("bad kind"))  # names no snapshot: nobody waits for it
    assert commit.failed == ["step_000000023"]

    topo.beat(24, lambda: "step_000000020")
    assert client.calls[-1] == ("beat", 24, "step_000000020")


def test_managed_restores_by_the_managers_plan_and_reports_what_it_retired(tmp_path):
    topo, client, _ = managed()
    storage = open_storage(str(tmp_path / "run"))
    plan = topo.recovery_plan(None, None, storage, None, lambda: pytest.fail("the manager plans for everyone"))
    assert plan.reason == "the manager's plan" and client.calls[-1] == ("plan", None)
    own = RecoveryPlan("x", "start_fresh", "this process's own")
    assert topo.recovery_plan(None, "step_000000005", storage, None, lambda: own) is own  # a named snapshot

    class Result:
        retired: list = []

    result = Result()
    topo.after_restore(result, plan, lambda r, p: pytest.fail("the manager retired the failed timeline"))
    assert result.retired == ["step_000000009"]
    topo.close()
    assert client.calls[-2:] == [("close",), ("unregister",)]  # no beat after the unregistration


def test_solo_retires_on_rank_0_only():
    retired = []
    for rank in (0, 1):
        Solo(rank=rank, world_size=2, role="learner", commit=FakeCommit()).after_restore(
            "result", "plan", lambda r, p, rank=rank: retired.append(rank)
        )
    assert retired == [0]


def test_sharded_state_without_a_process_group_is_refused_with_what_to_do(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    solo = Solo(rank=1, world_size=2, role="learner", commit=FakeCommit())
    with pytest.raises(ConfigError, match="initialise torch.distributed before registering it") as info:
        solo.with_sharded_state()
    assert info.value.key == "world_size"
    alone = Solo(rank=0, world_size=1, role="learner", commit=FakeCommit())
    assert alone.with_sharded_state() is alone  # one rank commits alone
    topo = managed()[0]
    assert topo.with_sharded_state() is topo  # the manager already commits for everyone


@pytest.fixture
def gloo_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_sharded_state_turns_solo_ranks_into_torch_distributed(tmp_path, gloo_group):
    inner = StagedRenameCommit(open_storage(str(tmp_path / "run")))
    solo = Solo(rank=0, world_size=2, role="learner", commit=inner)
    topo = solo.with_sharded_state()
    assert isinstance(topo, TorchDistributed) and topo is not solo
    assert isinstance(topo.commit, DistributedCommit) and topo.commit.inner is inner
    assert topo.participant == "learner-0" and topo.participants == ["learner-0", "learner-1"]
    assert topo.key("policy", replicated=True) == "shared/policy" and topo.key("rng", False) == "learner-0/rng"
    assert topo.runs_maintenance and topo.applies_retention and topo.records_decisions and topo.leads
    assert topo.with_sharded_state() is topo  # the transition happens once
    assert not TorchDistributed(rank=1, world_size=2, role="learner", commit=inner).runs_maintenance


# -- the restorer reuses the plan's verdicts --------------------------------------------------------------
def _count_schema_checks(monkeypatch) -> list:
    checked = []
    real = plan_module.check_schema

    def counting(manifest, version):
        checked.append(manifest.snapshot_id)
        return real(manifest, version)

    monkeypatch.setattr(plan_module, "check_schema", counting)
    return checked


def test_restore_reuses_the_plans_schema_check_and_config_warnings(tmp_path, monkeypatch):
    s = PPOState()
    with s.register(CheckpointEngine(base_dir=str(tmp_path), train_config={"lr": 1e-3})) as engine:
        engine.save(1)
    s2 = PPOState()
    engine = s2.register(CheckpointEngine(base_dir=str(tmp_path), train_config={"lr": 3e-4}))
    checked = _count_schema_checks(monkeypatch)
    plan = engine.plan_recovery(deep=False)
    verdict = plan.verdicts[plan.target]
    assert checked == [plan.target] and verdict.schema_version == engine.config.schema_version
    assert verdict.config_warnings and "train.lr" in verdict.config_warnings[0]
    assert RecoveryPlan.from_json(plan.to_json()).verdicts == plan.verdicts  # the manager sends plans as JSON
    verdict.config_warnings = ["the plan's verdict"]
    result = engine.restore(plan)
    assert checked == [plan.target]  # not checked again
    assert result.warnings == ["the plan's verdict"]
    engine.close()


def test_restore_checks_what_the_plan_did_not(tmp_path, monkeypatch):
    s = PPOState()
    with s.register(CheckpointEngine(base_dir=str(tmp_path), train_config={"lr": 1e-3})) as engine:
        engine.save(1)
        engine.save(2)
    engine = PPOState().register(CheckpointEngine(base_dir=str(tmp_path), train_config={"lr": 3e-4}))
    plan = engine.plan_recovery(deep=False)
    assert plan.target == "step_000000002" and plan.fallbacks == ["step_000000001"]
    checked = _count_schema_checks(monkeypatch)
    plan.verdicts[plan.target].config_digest = "another manifest"  # not the manifest the plan checked
    engine.restore(plan)
    assert checked == [plan.target]
    # A fallback the plan never checked is checked when the restore falls back to it, with its config warning.
    plan = engine.plan_recovery(deep=False)
    data = tmp_path / "run" / plan.target / "policy.safetensors"
    flipped = bytearray(data.read_bytes())
    flipped[-1] ^= 0xFF
    data.write_bytes(bytes(flipped))
    checked.clear()
    result = engine.restore(plan)
    assert result.snapshot_id == "step_000000001" and checked == ["step_000000001"]
    assert any("config changed" in w and "train.lr" in w for w in result.warnings)
    engine.close()


def test_a_plan_for_another_schema_is_checked_against_this_jobs(tmp_path):
    with PPOState().register(CheckpointEngine(base_dir=str(tmp_path))) as engine:
        engine.save(1)
        plan = engine.plan_recovery(deep=False)
    other = PPOState().register(CheckpointEngine(base_dir=str(tmp_path), schema_version=2))
    with pytest.raises(NoValidSnapshotError, match="schema_version"):
        other.restore(plan)
    other.close()
