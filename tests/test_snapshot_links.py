"""A snapshot's files must be regular files inside the run, opened without following links: a symbolic link
with the right bytes behind it (inside or outside the run), or a linked snapshot folder, is reported by
``rl-ckpt verify`` and ``ls``, and a restore falls back past it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from rl_ckpt import CheckpointEngine
from rl_ckpt.cli import main as cli_main


def cli(capsys, *args: str) -> tuple[int, str]:
    """The CLI as ``rl-ckpt`` runs it, in this process (a subprocess per call would mostly import torch)."""
    code = cli_main(list(args))
    return code, capsys.readouterr().out


def two_snapshots(tmp_path):
    torch.manual_seed(0)
    with CheckpointEngine(base_dir=str(tmp_path), run_name="r") as engine:
        engine.register("policy", torch.nn.Linear(3, 2))
        engine.save(1)
        engine.save(2)  # same weights: step 2's tensor file has exactly step 1's bytes
    return tmp_path / "r"


@pytest.mark.parametrize("where", ["file inside the run", "file outside the run", "snapshot folder"])
def test_links_with_the_right_bytes_are_reported_and_skipped(tmp_path, capsys, where):
    run = two_snapshots(tmp_path)
    step2 = run / "step_000000002"
    if where == "snapshot folder":
        shutil.copytree(step2, tmp_path / "elsewhere")
        shutil.rmtree(step2)
        os.symlink(tmp_path / "elsewhere", step2)
        expect = "a symbolic link, not a folder of the run"
    else:
        target = run / "step_000000001" / "policy.safetensors"
        if where == "file outside the run":
            target = shutil.copy(target, tmp_path / "outside.safetensors")
        assert (step2 / "policy.safetensors").read_bytes() == Path(target).read_bytes()
        (step2 / "policy.safetensors").unlink()
        os.symlink(os.path.relpath(target, step2), step2 / "policy.safetensors")
        expect = "is a symbolic link"
    code, out = cli(capsys, "verify", str(run))
    assert code == 1 and "step_000000002" in out and expect in out, out
    code, listing = cli(capsys, "ls", str(run))
    row = next(line for line in listing.splitlines() if line.startswith("step_000000002"))
    assert code == 1 and "NO:" in row and expect in row, listing

    torch.manual_seed(1)
    model = torch.nn.Linear(3, 2)
    with CheckpointEngine(base_dir=str(tmp_path), run_name="r") as engine:
        engine.register("policy", model)
        result = engine.restore()
    assert result.snapshot_id == "step_000000001" and expect in result.skipped["step_000000002"], result
    torch.manual_seed(0)
    assert torch.equal(model.weight, torch.nn.Linear(3, 2).weight)


@pytest.mark.parametrize("scheme", ["local://", "simplecache::file://"])
def test_a_local_disk_behind_fsspec_refuses_links_too(tmp_path, capsys, scheme):
    """fsspec's local filesystem follows links: a shard linked to the right bytes outside the run passed
    ``verify`` through a ``local://`` URL. Such URLs get the local disk's checks (every path part lstat-ed)."""
    run = two_snapshots(tmp_path)
    shard = run / "step_000000002" / "policy.safetensors"
    outside = shutil.copy(shard, tmp_path / "outside.safetensors")
    shard.unlink()
    os.symlink(outside, shard)
    url = f"{scheme}{tmp_path}"
    with CheckpointEngine(base_dir=url, run_name="r") as engine:
        report = engine.verify()
        assert not report.ok and "is a symbolic link" in str(report), report
        torch.manual_seed(1)
        model = torch.nn.Linear(3, 2)
        engine.register("policy", model)
        result = engine.restore()
    assert result.snapshot_id == "step_000000001" and "is a symbolic link" in result.skipped["step_000000002"]
    code, out = cli(capsys, "verify", f"{url}/r")
    assert code == 1 and "step_000000002" in out and "is a symbolic link" in out, out
