"""After a restore skips a corrupt snapshot (and retires it with the failed timeline), or a quarantined snapshot
leaves the run, ``rl-ckpt verify`` and ``ls`` say what was taken out, when and why, as notes: exit code 0
while everything still in the run is fine."""

from __future__ import annotations

import shutil

import torch

from rl_ckpt import CheckpointEngine
from rl_ckpt.cli import main as cli_main
from rl_ckpt._run.quarantine import quarantine


def cli(capsys, *args: str) -> tuple[int, str]:
    """The CLI as ``rl-ckpt`` runs it, in this process (a subprocess per call would mostly import torch)."""
    code = cli_main(list(args))
    return code, capsys.readouterr().out


def test_verify_and_ls_name_what_a_restore_took_out(tmp_path, capsys):
    with CheckpointEngine(base_dir=str(tmp_path), run_name="r") as engine:
        engine.register("policy", torch.nn.Linear(3, 2))
        for step in (1, 2, 3):
            engine.save(step)
    damaged = tmp_path / "r" / "step_000000003" / "policy.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-3] ^= 0x40
    damaged.write_bytes(bytes(data))
    with CheckpointEngine(base_dir=str(tmp_path), run_name="r") as engine:
        engine.register("policy", torch.nn.Linear(3, 2))
        result = engine.restore()
    assert result.snapshot_id == "step_000000002" and result.retired == ["step_000000003"]
    quarantine(engine.storage, "step_000000001", "post-load check failed for component 'policy'", source="a test")
    shutil.rmtree(tmp_path / "r" / "step_000000001")  # a person deleted the quarantined snapshot; the mark stays

    for args in (("verify",), ("ls",)):
        code, out = cli(capsys, *args, str(tmp_path / "r"))
        assert code == 0, out
        notes = out.split("taken out of the run (notes, not failures):\n", 1)[1].splitlines()
        retired = next(n for n in notes if n.strip().startswith("step_000000003"))
        assert "retired 20" in retired and "by engine rank 0" in retired and "checksum mismatch" in retired, retired
        assert "history/retired/step_000000003." in retired
        fenced = next(n for n in notes if n.strip().startswith("step_000000001"))
        assert "quarantined 20" in fenced and "by a test" in fenced and "post-load check failed" in fenced, fenced
    assert "all OK" in cli(capsys, "verify", str(tmp_path / "r"))[1]
