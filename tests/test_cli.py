"""The rl-ckpt CLI as a user runs it: a real subprocess, real exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file

from helpers import PPOState
from rl_ckpt import CheckpointEngine


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rl_ckpt.cli", *args], capture_output=True, text=True, timeout=120)


def _run_dir(tmp_path):
    s = PPOState()
    e = s.register(CheckpointEngine(base_dir=str(tmp_path)))
    for step in (1, 2):
        s.train(1)
        e.save(step, metrics={"avg_reward": step * 10.0})
    return s, str(tmp_path / "run")


def test_ls_verify_inspect_export(tmp_path):
    s, url = _run_dir(tmp_path)
    out = run("ls", url)
    assert out.returncode == 0, out.stderr
    assert "step_000000002" in out.stdout and "avg_reward=20" in out.stdout and "yes" in out.stdout
    rows = json.loads(run("ls", url, "--json").stdout)
    assert [r["step"] for r in rows] == ["1", "2"]
    assert run("verify", url).returncode == 0
    ins = run("inspect", url, "step_000000002")
    assert ins.returncode == 0 and "component policy" in ins.stdout and "0.weight" in ins.stdout
    target = tmp_path / "policy.safetensors"
    exp = run("export", url, "step_000000002", "policy", "-o", str(target))
    assert exp.returncode == 0, exp.stderr
    loaded = load_file(str(target))
    for k, v in s.policy.state_dict().items():
        assert torch.equal(loaded[k], v)


def test_exit_codes(tmp_path):
    _, url = _run_dir(tmp_path)
    assert run("inspect", url, "step_000000099").returncode == 2
    assert run("export", url, "step_000000002", "nope", "-o", str(tmp_path / "x")).returncode == 2
    assert run("ls").returncode == 2
    assert run("ls", str(tmp_path)).returncode == 2  # a base_dir holding runs: says which
    shard = tmp_path / "run" / "step_000000002" / "policy.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    v = run("verify", url)
    assert v.returncode == 1 and "policy.safetensors" in v.stdout and "checksum mismatch" in v.stdout
    assert run("ls", url).returncode == 0  # quick: sizes are right
    deep = run("ls", url, "--deep")
    assert deep.returncode == 1 and "checksum mismatch" in deep.stdout
    shard.write_bytes(bytes(data[:-5]))
    assert run("ls", url).returncode == 1
    assert run("verify", url, "step_000000001").returncode == 0


def test_gc_removes_debris_only(tmp_path):
    _, url = _run_dir(tmp_path)
    run_dir = tmp_path / "run"
    (run_dir / ".staging" / "step_000000003.host-1-2-abc").mkdir(parents=True)
    (run_dir / ".staging" / "step_000000003.host-1-2-abc" / "policy.safetensors").write_bytes(b"x" * 100)
    (run_dir / "step_000000004" / "attempt-1").mkdir(parents=True)  # manifest-last save that never committed
    (run_dir / "step_000000002" / "loser-attempt").mkdir()  # not in the manifest
    (run_dir / ".tmp-host-1-2-abc-best.json").write_text("{}")
    dry = run("gc", url, "--dry-run", "--grace", "0")
    assert dry.returncode == 0 and "4 debris entries found" in dry.stdout
    assert (run_dir / ".staging" / "step_000000003.host-1-2-abc").exists()
    young = run("gc", url)  # default grace period: a save may still be writing these
    assert "0 debris" in young.stdout
    time.sleep(0.01)
    assert run("gc", url, "--grace", "0").returncode == 0
    assert not (run_dir / ".staging" / "step_000000003.host-1-2-abc").exists()
    assert not (run_dir / "step_000000004").exists() and not (run_dir / "step_000000002" / "loser-attempt").exists()
    assert run("verify", url).returncode == 0 and len(CheckpointEngine(base_dir=str(tmp_path)).snapshots()) == 2


def test_timeline_draws_kept_deleted_best_and_failures(tmp_path):
    from rl_ckpt._recovery.coordinator import FailureInfo
    from rl_ckpt._timeline import load

    s = PPOState()
    e = s.register(CheckpointEngine(base_dir=str(tmp_path), keep_latest=2, keep_best=1))
    for step, reward in [(10, 1.0), (20, 5.0), (30, 2.0), (40, 3.0)]:
        s.train(1)
        e.save(step, metrics={"avg_reward": reward})
    e.save(45, kind="light")
    e.restore(e.plan_recovery(FailureInfo(kind="process_killed", step=47)))
    data = load(e.storage)
    states = {x["id"]: x["state"] for x in data["snapshots"]}
    assert states == {
        "step_000000010": "deleted",
        "step_000000020": "kept",
        "step_000000030": "kept",
        "step_000000040": "kept",
        "step_000000045.light": "kept",
    }
    assert data["best"]["avg_reward"] == "step_000000020"
    assert data["decisions"][0]["to"] == 40 and data["decisions"][0]["step"] == 47
    out = tmp_path / "t.png"
    assert run("timeline", str(tmp_path / "run"), "-o", str(out)).returncode == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plan_uses_the_config_and_the_runs_schema_version(tmp_path):
    s = PPOState()
    e = s.register(CheckpointEngine(base_dir=str(tmp_path), schema_version=3))
    e.save(1, metrics={"avg_reward": 1.0})
    e.close()
    url = str(tmp_path / "run")
    plan = run("plan", url)  # no config: the run's own schema version (3), not the default (1)
    assert plan.returncode == 0 and "target:    step_000000001" in plan.stdout, plan.stdout + plan.stderr
    config = tmp_path / "job.yaml"
    config.write_text("base_dir: /elsewhere\nrun_name: other\nschema_version: 3\n")  # the URL names the run
    plan = run("plan", url, "--config", str(config), "--failure", "exception", "--step", "2")
    assert plan.returncode == 0 and "target:    step_000000001" in plan.stdout, plan.stdout + plan.stderr
    config.write_text("schema_version: 1\n")  # the job says the layout changed: nothing may load
    plan = run("plan", url, "--config", str(config))
    assert plan.returncode == 1 and "schema_version 3" in plan.stdout


def test_hostile_manifest_is_one_line_not_a_traceback(tmp_path):
    _, url = _run_dir(tmp_path)
    meta_path = tmp_path / "run" / "step_000000002" / "meta.json"
    meta_path.write_text(meta_path.read_text().replace('"global_step": 2', '"global_step": ' + "9" * 5000))
    for args, code in (
        (("ls", url), 1),
        (("verify", url), 1),
        (("inspect", url, "step_000000002"), 1),
        (("export", url, "step_000000002", "policy", "-o", str(tmp_path / "x")), 1),
        (("plan", url), 0),
    ):
        out = run(*args)
        assert out.returncode == code, (args, out.stderr)
        assert "Traceback" not in out.stderr
        assert len([line for line in out.stderr.splitlines() if line.startswith("rl-ckpt ")]) == (
            code == 1 and args[0] in ("inspect", "export")
        )
