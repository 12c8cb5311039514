"""Sharded state (FSDP2 / DTensor) on CPU with gloo: real processes, real files.

Heavy: run under ``flock /tmp/heavy.lock``. Each test spawns a few small
ranks; every comparison is bitwise (``torch.equal``) on state gathered with
``full_tensor()``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

import sharded_workers as w
from rl_ckpt import CheckpointEngine
from rl_ckpt.errors import CorruptSnapshotError, StateMismatchError


def spawn(fn, world: int, *args) -> None:
    mp.spawn(fn, args=(world, w.free_port(), *args), nprocs=world)


@pytest.fixture(scope="module")
def fsdp_snapshot(tmp_path_factory):
    """An FSDP2 snapshot saved by 2 ranks (step 1) and the full state it holds."""
    out = tmp_path_factory.mktemp("sharded")
    run = out / "run"
    spawn(w.save_job, 2, str(run), str(out), (2,), 2, 1)
    return run, out


def test_fsdp2_save_writes_local_shards_and_global_layout(fsdp_snapshot):
    run, out = fsdp_snapshot
    meta = json.loads((run / "step_000000001" / "meta.json").read_text())
    full = load_file(str(out / "full_1.safetensors"))
    layout = meta["components"]["policy"]["layout"]
    assert layout["saved_by"]["world_size"] == 2
    # One plain safetensors file per rank per component, each holding only that rank's shards.
    files = sorted(f["path"] for f in meta["files"])
    assert files == [
        "optim.rank0.safetensors",
        "optim.rank1.safetensors",
        "policy.rank0.safetensors",
        "policy.rank1.safetensors",
    ]
    for rank in (0, 1):
        local = load_file(str(run / "step_000000001" / f"policy.rank{rank}.safetensors"))
        for fqn, t in local.items():
            rows = full[f"model.{fqn}"].shape[0]
            assert t.shape[0] == (rows + 1) // 2 if rank == 0 else rows - (rows + 1) // 2
    for fqn, t in layout["tensors"].items():
        assert t["shape"] == list(full[f"model.{fqn}"].shape)
        assert sum(c["sizes"][0] for c in t["chunks"]) == t["shape"][0]  # chunks tile dim 0 exactly once
    # Plain optimizer tensors (Adam's step) and hyperparameters are written once, by rank 0.
    optim = meta["components"]["optim"]["layout"]
    step_chunks = optim["tensors"]["state.0.weight.step"]["chunks"]
    assert [c["file"] for c in step_chunks] == ["optim.rank0.safetensors"]
    assert optim["values"]["param_groups.0.lr"] == {"v": 0.01}


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_restore_on_any_number_of_ranks_is_bitwise_equal(fsdp_snapshot, ranks):
    run, out = fsdp_snapshot
    spawn(w.restore_job, ranks, str(run), str(out), (ranks,), 1)
    reports = [json.loads((out / f"read_{ranks}_{r}.json").read_text()) for r in range(ranks)]
    for rep in reports:
        assert rep["range_bytes"] <= 1.25 * rep["share"], rep


def test_hsdp_and_fsdp_restore_into_each_other(tmp_path):
    hsdp = tmp_path / "hsdp"
    spawn(w.save_job, 4, str(hsdp), str(tmp_path), (2, 2), 2, 1)
    meta = json.loads((hsdp / "step_000000001" / "meta.json").read_text())
    # Replicas are written once: only the ranks at replica coordinate 0 (ranks 0 and 1) wrote shards.
    assert sorted({f["path"].split(".")[1] for f in meta["files"]}) == ["rank0", "rank1"]
    spawn(w.restore_job, 2, str(hsdp), str(tmp_path), (2,), 1)

    fsdp = tmp_path / "fsdp"
    spawn(w.save_job, 2, str(fsdp), str(tmp_path), (2,), 3, 2)
    spawn(w.restore_job, 4, str(fsdp), str(tmp_path), (2, 2), 2)


def test_same_layout_resume_continues_bitwise_like_an_uninterrupted_run(tmp_path):
    spawn(w.resume_job, 2, str(tmp_path / "run"), str(tmp_path))


def test_corrupt_chunk_all_ranks_roll_back_and_failed_save_fails_everywhere(tmp_path):
    spawn(w.corrupt_job, 2, str(tmp_path / "run"), str(tmp_path))


def test_sharded_snapshot_restores_into_plain_module_and_optimizer(fsdp_snapshot):
    run, out = fsdp_snapshot
    full = load_file(str(out / "full_1.safetensors"))
    model = w.make_model(5)
    optim = torch.optim.Adam(model.parameters(), lr=0.5)
    engine = CheckpointEngine(base_dir=str(run.parent), run_name=run.name, retention=False)
    engine.register("policy", model)
    engine.register("optim", optim)
    assert engine.restore().snapshot_id == "step_000000001"
    for fqn, t in model.state_dict().items():
        assert torch.equal(t, full[f"model.{fqn}"]), fqn
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optim)
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            assert torch.equal(v, full[f"optim.{fqn}.{k}"]), (fqn, k)
    assert optim.param_groups[0]["lr"] == 0.01
    engine.close()


def test_rollout_worker_loads_full_weights_streaming_and_verified(fsdp_snapshot, tmp_path):
    run, out = fsdp_snapshot
    full = load_file(str(out / "full_1.safetensors"))
    engine = CheckpointEngine(base_dir=str(run.parent), run_name=run.name, retention=False)
    policy = w.make_model(11)
    assert engine.load_full_weights("policy", policy) == "step_000000001"
    for fqn, t in policy.state_dict().items():
        assert torch.equal(t, full[f"model.{fqn}"]), fqn
    with pytest.raises(StateMismatchError, match="2.weight"):
        engine.load_full_weights("policy", torch.nn.Sequential(torch.nn.Linear(16, 24)))
    engine.close()

    # A flipped byte in any chunk is caught before it reaches the module.
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    f = copy / "step_000000001" / "policy.rank1.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01
    f.write_bytes(bytes(data))
    engine = CheckpointEngine(base_dir=str(tmp_path), run_name="copy", retention=False)
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch in tensor"):
        engine.load_full_weights("policy", w.make_model(11))
    engine.close()
