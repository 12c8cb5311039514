"""RecoveryPlan, coordinator decisions through the engine, post-load probe, scrub and quarantine."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from helpers import PPOState, assert_same_state
from rl_ckpt import CheckpointEngine, NoValidSnapshotError
from rl_ckpt._format.checksum import digest_bytes
from rl_ckpt.cli import main as cli
from rl_ckpt._recovery.coordinator import FailureInfo
from rl_ckpt._format.manifest import manifest_checksum


def _tree(path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def _run(tmp_path, rewards, **cfg):
    cfg = {"base_dir": str(tmp_path), "retention": False, **cfg}
    s = PPOState(seed=5)
    e = s.register(CheckpointEngine(**cfg))
    for step, reward in rewards:
        s.train(1)
        e.save(step, metrics={"avg_reward": reward, "loss": 0.5 if reward == reward else float("nan")})
    return cfg, s


def test_plan_is_readable_and_has_no_side_effects(tmp_path):
    cfg, _ = _run(tmp_path, [(10, 1.0), (20, 2.0), (30, 3.0)])
    snap = tmp_path / "run" / "step_000000030" / "optimizer.safetensors"
    snap.write_bytes(snap.read_bytes()[:-3])
    before = _tree(tmp_path)
    e = PPOState().register(CheckpointEngine(**cfg))
    plan = e.plan_recovery()
    assert _tree(tmp_path) == before  # planning wrote nothing
    text = str(plan)
    assert plan.target == "step_000000020" and plan.continue_from_step == 20
    assert "step_000000030" in text and "skipped" in text and "optimizer.safetensors" in text
    assert [a.component for a in plan.actions][:3] == ["policy", "value", "optimizer"]
    assert plan.actions[-1].component == "progress"
    assert any("probe policy" in c for c in plan.checks) and plan.fallbacks == ["step_000000010"]
    result = e.restore(plan)
    assert result.snapshot_id == "step_000000020" and result.plan is plan


def test_a_quick_plan_says_checksums_come_next_and_the_restore_says_why_it_fell_back(tmp_path):
    """A plan that checked sizes only chooses a snapshot whose byte was flipped: it says checksums come as it
    loads; the plan the restore returns lists that snapshot as skipped, with the mismatch, and what was loaded."""
    cfg, _ = _run(tmp_path, [(10, 1.0), (20, 2.0)])
    snap = tmp_path / "run" / "step_000000020" / "policy.safetensors"
    data = bytearray(snap.read_bytes())
    data[-1] ^= 1  # same size: only a checksum finds it
    snap.write_bytes(bytes(data))
    e = PPOState().register(CheckpointEngine(**cfg))
    plan = e.plan_recovery(deep=False)
    text = str(plan)
    assert plan.target == "step_000000020" and "checked as it loads" in text and "sizes checked" in text, text
    result = e.restore(plan)
    assert result.snapshot_id == "step_000000010"
    after = str(result.plan)
    row = next(line for line in after.splitlines() if "step_000000020" in line and "step 20" in line)
    assert "skipped" in row and "checksum" in row and "policy.safetensors" in row, after
    assert "loaded:    step_000000010" in after and "resumes after step 10" in after, after
    assert "checked as it loads" not in after


def test_restore_falls_back_when_the_post_load_probe_disagrees(tmp_path):
    cfg, _ = _run(tmp_path, [(10, 1.0), (20, 2.0)])
    reference = PPOState(seed=1)
    reference.register(CheckpointEngine(**cfg)).restore(snapshot_id="step_000000010")
    # Tamper with one weight of the newest snapshot and "fix" its checksum: only the probe can tell.
    shard = tmp_path / "run" / "step_000000020" / "policy.safetensors"
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    begin = header["0.weight"]["data_offsets"][0] + 8 + n
    data[begin : begin + 4] = struct.pack("<f", 1000.0)
    shard.write_bytes(bytes(data))
    meta_path = shard.parent / "meta.json"
    meta = json.loads(meta_path.read_text())
    for f in meta["files"]:
        if f["path"] == "policy.safetensors":
            f["checksum"] = digest_bytes(f["algo"], bytes(data))
    meta.pop("manifest_checksum", None)
    meta["manifest_checksum"] = manifest_checksum(meta)  # the tamperer recomputes the manifest's own checksum too
    meta_path.write_text(json.dumps(meta))
    assert CheckpointEngine(**cfg).verify().ok  # checksums alone see nothing wrong

    fresh = PPOState(seed=3)
    e = fresh.register(CheckpointEngine(**cfg))
    result = e.restore()
    assert result.snapshot_id == "step_000000010"
    assert "post-load check failed" in result.skipped["step_000000020"]
    assert any("fell back" in w for w in result.warnings)
    assert_same_state(fresh, reference)
    # The bad snapshot is quarantined: reported, excluded from recovery, not deleted.
    assert (tmp_path / "run" / "quarantine" / "step_000000020.json").exists()
    assert (tmp_path / "run" / "step_000000020").exists()
    assert cli(["ls", str(tmp_path / "run")]) == 1 and cli(["verify", str(tmp_path / "run")]) == 1
    assert PPOState().register(CheckpointEngine(**cfg)).plan_recovery().target == "step_000000010"


def test_nan_failure_restores_from_before_the_first_nonfinite_loss(tmp_path):
    cfg, _ = _run(tmp_path, [(10, 1.0), (20, 2.0), (30, float("nan")), (40, 4.0)])
    e = PPOState().register(CheckpointEngine(**cfg))
    plan = e.plan_recovery(FailureInfo(kind="nan_loss", step=45, first_nonfinite_step=25))
    assert plan.target == "step_000000020" and plan.decision.action == "restore_latest"
    assert "25" in plan.decision.reason
    result = e.restore(plan)
    assert result.global_step == 20
    decisions = e.decisions()
    assert len(decisions) == 1 and decisions[0].snapshot_id == "step_000000020"  # recorded in the run folder
    assert list((tmp_path / "run" / "decisions").iterdir())


def test_divergence_guard_and_budget_through_the_engine(tmp_path):
    cfg, _ = _run(tmp_path, [(10, 50.0), (20, 90.0), (30, 20.0)], divergence_threshold=0.5, max_failures=2)
    e = PPOState().register(CheckpointEngine(**cfg))
    plan = e.plan_recovery(FailureInfo(kind="exception", step=31, message="boom"))
    assert plan.decision.action == "restore_best" and plan.target == "step_000000020"
    e.restore(plan)
    e.restore(e.plan_recovery(FailureInfo(kind="exception", step=25)))
    plan = e.plan_recovery(FailureInfo(kind="exception", step=25))
    assert plan.action == "give_up"
    with pytest.raises(NoValidSnapshotError, match="gave up"):
        e.restore(plan)


def test_empty_run_plans_a_fresh_start(tmp_path):
    e = PPOState().register(CheckpointEngine(base_dir=str(tmp_path / "nothing-here")))
    plan = e.plan_recovery()
    assert plan.fresh and "starting fresh" in str(plan)
    assert e.restore(plan).fresh


def test_scrub_quarantines_a_corrupted_old_snapshot(tmp_path):
    cfg, _ = _run(tmp_path, [(10, 1.0), (20, 2.0), (30, 3.0)])
    old = tmp_path / "run" / "step_000000010" / "rng.safetensors"
    data = bytearray(old.read_bytes())
    data[100] ^= 0xFF
    old.write_bytes(bytes(data))
    url = str(tmp_path / "run")
    assert cli(["scrub", url, "--min-free-gib", "0"]) == 1
    assert (tmp_path / "run" / "quarantine" / "step_000000010.json").exists()
    assert old.exists()  # never deleted
    e = PPOState().register(CheckpointEngine(**cfg))
    assert [i.snapshot_id for i in e.snapshots() if i.quarantined] == ["step_000000010"]
    assert cli(["scrub", url, "--min-free-gib", "0"]) == 0  # already quarantined: nothing new
    assert cli(["scrub", url, "--min-free-gib", "1000000"]) == 1  # low space is reported


def test_background_patrol_quarantines_and_reports_space(tmp_path):
    cfg, _ = _run(tmp_path, [(10, 1.0), (20, 2.0)])
    victim = tmp_path / "run" / "step_000000010" / "progress.json"
    victim.write_text('{"tampered": true}')
    e = PPOState().register(CheckpointEngine(**cfg))
    patrol = e.start_patrol(interval_seconds=3600, bytes_per_second=50 * 2**20, min_free_bytes=0)
    while patrol.passes == 0:
        patrol._stop.wait(0.01)
    status = patrol.status()
    e.close()
    assert status["quarantined"] == ["step_000000010"] and status["free_bytes"] > 0
    assert e.catalog.get("step_000000010").quarantined


def test_cli_plan(tmp_path):
    _run(tmp_path, [(10, 1.0), (20, 2.0)])
    url = str(tmp_path / "run")
    assert cli(["plan", url]) == 0
    assert cli(["plan", url, "--failure", "nan_loss", "--step", "15"]) == 0
    os.remove(tmp_path / "run" / "step_000000010" / "meta.json")
    os.remove(tmp_path / "run" / "step_000000020" / "meta.json")
    assert cli(["plan", url]) == 1  # snapshots exist but none is valid: gives up rather than starting fresh


# -- the post-load probe: deterministic, small, sensitive ------------------------------------------------------
def _rng_states():
    import random

    import numpy as np

    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def test_probe_of_a_sampling_sb3_policy_passes_after_the_global_rng_moved(tmp_path):
    """SB3's ActorCriticPolicy samples its actions in forward(): the probe must seed what it draws from."""
    import random

    import numpy as np
    from stable_baselines3 import PPO

    from rl_ckpt._recovery.probe import run_probe

    cfg = {"base_dir": str(tmp_path), "retention": False}
    torch.manual_seed(0)
    saved = PPO("MlpPolicy", "CartPole-v1", device="cpu", seed=0).policy
    e = CheckpointEngine(**cfg)
    e.register("policy", saved)
    e.register("optimizer", saved.optimizer)
    e.save(1)
    before = _rng_states()
    run_probe(saved)
    after = _rng_states()
    assert torch.equal(before[0], after[0]) and (before[1] == after[1]).all() and before[2] == after[2]

    torch.manual_seed(12345)  # a real restart starts from other RNG states
    np.random.seed(6789)
    random.seed(4321)
    fresh = PPO("MlpPolicy", "CartPole-v1", device="cpu", seed=7).policy
    e2 = CheckpointEngine(**cfg)
    e2.register("policy", fresh)
    e2.register("optimizer", fresh.optimizer)
    result = e2.restore()
    assert result.snapshot_id == "step_000000001" and not result.skipped
    assert not (tmp_path / "run" / "quarantine").exists()
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), fresh.state_dict().values()))


def test_probe_record_is_bounded_for_a_large_output(tmp_path):
    """A GPT-2 shaped model (full 50257-token vocabulary) keeps meta.json small: a fingerprint, not the logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16))
    e = CheckpointEngine(base_dir=str(tmp_path), retention=False)
    e.register("model", model)
    e.save(1)
    meta = tmp_path / "run" / "step_000000001" / "meta.json"
    probe = json.loads(meta.read_text())["extra"]["probes"]["model"]
    assert probe["shapes"][0] == [2, 4, 50257]  # 402k logits recorded as ...
    assert len(json.dumps(probe)) < 16 * 1024  # ... a few KiB
    assert meta.stat().st_size < 64 * 1024
    fresh = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16))
    e2 = CheckpointEngine(base_dir=str(tmp_path), retention=False)
    e2.register("model", fresh)
    assert e2.restore().snapshot_id == "step_000000001"


@pytest.mark.parametrize("delta", [1e-2, 1e-4])
def test_fingerprint_catches_one_perturbed_weight_and_passes_a_correct_restore(delta):
    from rl_ckpt._recovery.probe import compare, run_probe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1000))
    reference = run_probe(model)
    copy = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1000))
    copy.load_state_dict(model.state_dict())
    assert compare(reference, run_probe(copy), rtol=1e-5, atol=1e-6) is None
    with torch.no_grad():
        copy[0].weight[17, 5] += delta  # one weight of 16k in the first layer
    problem = compare(reference, run_probe(copy), rtol=1e-5, atol=1e-6)
    assert problem is not None and "differ" in problem


def test_probe_recorded_in_full_by_an_older_version_still_compares():
    from rl_ckpt._recovery.probe import compare, run_probe

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    x = torch.randn(2, 8)
    old = {"outputs": [model(x).detach().double().reshape(-1).tolist()], "shapes": [[2, 3]]}
    assert compare(old, run_probe(model, fn=lambda m: m(x)), rtol=1e-5, atol=1e-6) is None
    with torch.no_grad():
        model.weight[0, 0] += 0.1
    assert compare(old, run_probe(model, fn=lambda m: m(x)), rtol=1e-5, atol=1e-6) is not None


def test_a_restore_parses_each_manifest_once(tmp_path):
    from rl_ckpt.tools.faults import FaultyStorage
    from rl_ckpt._storage import open_storage

    cfg, _ = _run(tmp_path, [(10, 1.0), (20, 2.0)])
    storage = FaultyStorage(open_storage(str(tmp_path / "run")))
    e = PPOState().register(CheckpointEngine(**cfg, storage=storage))
    assert e.restore().snapshot_id == "step_000000020"
    reads = [p for op, p in storage.ops if op in ("read", "open_read") and p.endswith("meta.json")]
    assert sorted(reads) == ["step_000000010/meta.json", "step_000000020/meta.json"]  # the listing's reads only
