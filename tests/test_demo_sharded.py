"""`rl-ckpt demo --sharded`: GRPO on a tiny GPT-2 with FSDP2 learners on Ray Train, a learner SIGKILLed after a
commit, the run restarted on fewer learners; the plan names both layouts and the printed figures agree.

The drills run in a subprocess on a Ray cluster of their own (as `rl-ckpt demo --sharded` does), so this file
runs next to the tests that share the session's cluster. The layout line and the GRPO math are also checked
alone (no Ray)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
import uuid

import pytest
import torch

from rl_ckpt.demo.grpo import GRPOConfig, advantages, make_policy, sample
from rl_ckpt._recovery.plan import RecoveryPlan
from rl_ckpt._sharded.layout import layout_change, mesh_name


def _sharded(world: int, mesh: list, placements: list) -> dict:
    return {"kind": "module", "layout": {"saved_by": {"world_size": world, "mesh": mesh, "placements": placements}}}


def test_layout_line_names_saved_and_restored_layouts():
    comps = {
        "policy": _sharded(2, [2], ["S(0)"]),
        "optim": _sharded(2, [2], ["S(0)"]),
        "learner-0/rng": {"kind": "rng"},
    }
    assert (
        layout_change(comps, {"world_size": 1, "mesh": [1], "placements": ["S(0)"]})
        == "optim, policy saved by 2 ranks as FSDP(2) -> restored on 1 rank as FSDP(1) (resharded)"
    )
    same = layout_change(comps, {"world_size": 2, "mesh": [2], "placements": ["Shard(dim=0)"]})
    assert same.endswith("(same layout)")
    hsdp = {"policy": _sharded(4, [2, 2], ["R", "S(0)"])}
    assert (
        layout_change(hsdp, {"world_size": 1, "mesh": []})
        == "policy saved by 4 ranks as HSDP(2x2) -> restored on 1 rank as unsharded (resharded)"
    )
    assert layout_change(hsdp, None) == "policy saved by 4 ranks as HSDP(2x2)"  # planning from the CLI
    assert layout_change({"policy": {"kind": "module"}}, None) == ""  # nothing sharded: no line
    # The manifest is untrusted: odd values give a readable line, not an exception.
    assert mesh_name({"mesh": ["x", True], "placements": None}) == "unsharded"
    assert "saved by 1 rank as" in layout_change({"p": {"layout": {"saved_by": {"world_size": "two"}}}}, None)


def test_plan_prints_and_keeps_the_layout():
    plan = RecoveryPlan(
        "/r",
        "restore",
        "newest",
        target="step_000000008",
        continue_from_step=8,
        layout="policy saved by 2 ranks as FSDP(2) -> restored on 1 rank as FSDP(1) (resharded)",
    )
    assert "  layout:    policy saved by 2 ranks as FSDP(2) -> restored on 1 rank as FSDP(1)" in str(plan)
    assert RecoveryPlan.from_json(plan.to_json()).layout == plan.layout
    assert "layout:" not in str(RecoveryPlan("/r", "restore", "newest", target="s"))


def test_rollout_data_do_not_depend_on_how_the_prompts_are_split():
    cfg = GRPOConfig(prompts_per_step=4, group_size=4)
    model = make_policy(cfg)
    whole = sample(model, cfg, 3, [0, 1, 2, 3])
    parts = [sample(model, cfg, 3, idx) for idx in ([0], [1, 2], [3])]
    for k in ("seqs", "rewards"):
        assert torch.equal(whole[k], torch.cat([p[k] for p in parts]))
    torch.testing.assert_close(whole["logps"], torch.cat([p["logps"] for p in parts]))
    assert not torch.equal(whole["seqs"], sample(model, cfg, 4, [0, 1, 2, 3])["seqs"])  # another step, other answers
    adv = advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5]), 4)
    assert adv[0] > 0 > adv[1] and torch.allclose(adv.view(2, 4).sum(1), torch.zeros(2), atol=1e-5)
    assert torch.equal(adv[4:], torch.zeros(4))  # a group that all scored the same teaches nothing


DRILLS = """
import json, os, sys
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
import ray
from rl_ckpt.demo.sharded_drill import side_by_side
ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="rl_ckpt", logging_level="ERROR",
         log_to_driver=False)
try:
    r = side_by_side(sys.argv[1], steps=12, crash_at=10, learners=2, restart_learners=1, save_every=6,
                     run_name=sys.argv[2])
    print("REPORT " + json.dumps({"text": r.text, "figures": r.figures, "problems": r.problems}))
finally:
    ray.shutdown()
"""


def _drills(base: str):
    """Both drills (durable-only, then with the memory tier) on a Ray cluster of their own, in a subprocess."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", DRILLS, base, f"grpo-{uuid.uuid4().hex[:6]}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=570,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(line[len("REPORT ") :])
    return types.SimpleNamespace(**report, ok=not report["problems"])


@pytest.mark.ray
@pytest.mark.slow
def test_sharded_demo_crash_and_restart_on_fewer_learners(tmp_path):
    pytest.importorskip("ray")
    report = _drills(str(tmp_path))
    assert report.ok, report.problems
    durable_text, rest = report.text.split("\n\nrl_ckpt demo --sharded", 1)
    memory_text, table = rest.split("\n\nMemory tier:", 1)
    f, text = report.figures["durable"], durable_text
    assert "consistent         YES" in text
    # Killed at the start of step 10 (after step 9); the newest durable commit was step 6, saved by both learners.
    assert (f["kill_step"], f["restored_step"], f["steps_redone"], f["first_step_after"]) == (9, 6, 3, 7)
    assert (f["saved_world"], f["restart_world"], f["final_step"], f["tier"]) == (2, 1, 12, "durable")
    assert f["downtime_s"] > 0 and f["weight_loads"] >= 12 // 6
    # The rollout actors pulled policy versions: a first full pull each, then only changed chunks.
    assert f["version_pulls"] == f["weight_loads"] and f["version_bytes_full"] > 0 and f["version_bytes_delta"] > 0
    assert re.search(r"policy versions pulled, [\d.]+ MiB full \(first pulls\) \+ [\d.]+ MiB delta", text)
    # What is printed says the same as the figures, line by line.
    assert "saved by 2 ranks as FSDP(2) -> restored on 1 rank as FSDP(1) (resharded)" in text
    assert re.search(r"SIGKILL of learner rank 1 of 2 after step 9\b", text)
    assert re.search(r"restored\s+step_000000006 \(step 6\) on 1 learner\(s\), from durable in \d+\.\d\d s", text)
    assert re.search(r"time lost\s+3 steps redone \(steps 7\.\.9\); \d+\.\d s from the kill", text)
    plan = text.split("Recovery plan followed by the restarted learner(s):\n", 1)[1]
    assert "target:    step_000000006" in plan and "continue:  training resumes after step 6" in plan
    assert "layout:    optim, policy saved by 2 ranks as FSDP(2) -> restored on 1 rank as FSDP(1)" in plan
    assert "failure:   process_killed at step 9" in plan
    # The policy learned: the seeded task starts near chance (1/12) and climbs.
    first, final = (float(x) for x in re.search(r"reward\s+([\d.]+) at step 1 -> ([\d.]+) at step 12", text).groups())
    assert (first, final) == (pytest.approx(f["first_reward"], abs=1e-3), pytest.approx(f["final_reward"], abs=1e-3))
    assert first < 0.15 and final > first, (first, final)

    # The memory tier: memory snapshots every 2 steps, so the restart on 1 learner restores step 8 from memory,
    # resharded, and redoes 1 step where durable-only redid 3.
    m, text = report.figures["memory"], memory_text
    assert "consistent         YES" in text
    # The prompts: 12 steps x 16 from a dataset of 40, in a PromptSampler's order, through the kill and the
    # restart on fewer learners: 4 complete epochs, each prompt trained on once per epoch as of the final snapshot.
    for figs, txt in ((f, durable_text), (m, memory_text)):
        assert figs["audit"] == {"consumed": 192, "skipped": 0, "duplicated": 0, "resumed_in_flight": 0, "epochs": 4}
        assert re.search(
            r"data\s+40 prompts .*192 trained on over 4 complete epoch\(s\): skipped 0, duplicated 0, "
            r"resumed in flight 0",
            txt,
        )
    assert (m["kill_step"], m["restored_step"], m["steps_redone"], m["first_step_after"]) == (9, 8, 1, 9)
    assert (m["saved_world"], m["restart_world"], m["final_step"], m["tier"]) == (2, 1, 12, "memory")
    assert re.search(r"restored\s+step_000000008 \(step 8\) on 1 learner\(s\), from memory in \d+\.\d\d s", text)
    assert re.search(r"time lost\s+1 step redone \(steps 9\.\.9\)", text)
    assert "optim, policy saved by 2 ranks as FSDP(2) -> restored on 1 rank as FSDP(1) (resharded)" in text
    # Durable copies made from memory by the service, the final one included.
    assert "step_000000012" in m["flushed"] and re.search(r"durable copies\s+.*step_000000012", text)

    # The side-by-side table: its figures are the two drills' figures, and they agree.
    rows = {ln[2:22].strip(): ln[23:].split() for ln in table.splitlines()[2:] if ln.startswith("  ")}
    assert rows["restored from"] == ["durable", "step_000000006", "memory", "step_000000008"]
    assert rows["restored step"] == ["6", "8"] and rows["failure step"] == ["9", "9"]
    assert rows["steps lost"] == ["3", "1"] and int(rows["steps lost"][1]) <= int(rows["steps lost"][0])
    for name, key in (("restore time", "restore_seconds"), ("kill to first step", "kill_to_first_step")):
        assert [float(rows[name][0]), float(rows[name][2])] == [
            pytest.approx(f[key], abs=0.006),
            pytest.approx(m[key], abs=0.006),
        ]
    assert "exact restart" not in table  # a restart on fewer learners is not bitwise: the table claims nothing
    assert rows["consistent"] == ["YES"]
