"""A restore reads each file once, straight into the registered objects' own tensors where the state fits: a
module's parameters and buffers, an optimizer's state. The bytes are checked against the manifest as they land and
the file's header is decoded only after; every optimizer stays bitwise; a file laid out otherwise than planned
still loads; a refused file falls back, and when nothing loads the error says the objects hold its bytes."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from rl_ckpt import CheckpointEngine, NoValidSnapshotError
from rl_ckpt._format.checksum import digest_bytes
from test_optim_resume import OPTIMIZERS, Run, differences


def _engine(tmp_path, **kw) -> CheckpointEngine:
    return CheckpointEngine(base_dir=str(tmp_path), run_name="run", post_load_check=False, keep_latest=5, **kw)


def _model_and_adam(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    model.register_buffer("count", torch.arange(5))
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, optim


def _step(model, optim) -> None:
    optim.zero_grad()
    model(torch.randn(8, 64)).pow(2).mean().backward()
    optim.step()


def _tensors(model, optim) -> dict:
    out = {f"m.{k}": v for k, v in model.state_dict().items()}
    for i, s in optim.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v for k, v in s.items()})
    return out


def test_restore_reads_into_the_objects_own_tensors(tmp_path):
    model, optim = _model_and_adam(0)
    engine = _engine(tmp_path)
    engine.register("model", model)
    engine.register("optim", optim)
    _step(model, optim)
    engine.save(1)
    saved = {k: v.clone() for k, v in _tensors(model, optim).items()}
    _step(model, optim)  # the state moves on; the restore brings back step 1's
    with torch.no_grad():
        model[0].weight.add_(1.0)
    before = _tensors(model, optim)
    places = {k: (v.data_ptr(), v) for k, v in before.items()}
    result = engine.restore()
    after = _tensors(model, optim)
    assert set(after) == set(saved)
    for key, tensor in after.items():
        assert torch.equal(tensor, saved[key]), key
        assert tensor.data_ptr() == places[key][0], f"{key} was not read in place"
    for i, s in optim.state.items():  # the optimizer keeps its very tensors (no new memory)
        for k, t in s.items():
            idx = next(j for j, p in enumerate(model.parameters()) if p is i)
            assert t is places[f"o.{idx}.{k}"][1], (idx, k)
    assert {"plan", "read", "hash", "decode", "copy", "total"} <= set(result.timings)
    assert result.timings["total"] >= result.timings["read"] > 0
    _step(model, optim)  # and training goes on from there
    engine.close()


@pytest.mark.parametrize("case", sorted(OPTIMIZERS))
def test_running_optimizers_restored_in_place_stay_bitwise(tmp_path, case):
    """Restored into the same running objects (their state read in place), one more step equals a run that never
    stopped, bit for bit: parameters and optimizer state (LBFGS's BLAS ``dot`` included)."""
    ref, run = Run(case, None, seed=3), Run(case, None, seed=3)
    engine = _engine(tmp_path)
    engine.register("model", run.model)
    engine.register("optim", run.opt)
    for _ in range(3):
        ref.step()
        run.step()
    engine.save(3)
    for _ in range(2):
        run.step()  # moves on: the restore must bring step 3 back into these very objects
    run.i = 3
    held = {(id(p), k): t for p, s in run.opt.state.items() for k, t in s.items() if isinstance(t, torch.Tensor)}
    engine.restore(snapshot_id="step_000000003")
    assert differences(ref.states(), run.states()) == []
    if not isinstance(run.opt, torch.optim.LBFGS):  # (its history grew since the save: new lists, not in place)
        now = {(id(p), k): t for p, s in run.opt.state.items() for k, t in s.items() if isinstance(t, torch.Tensor)}
        assert held and all(now[key] is t for key, t in held.items() if t.shape == now[key].shape)
    ref.step()
    run.step()
    assert differences(ref.states(), run.states()) == []
    engine.close()


def _relayout(snap, name: str) -> None:
    """Rewrite ``name``'s safetensors file with its tensors in reverse name order (valid safetensors, another
    layout than rl_ckpt writes), its manifest entry and checksum updated as a writer would."""
    from rl_ckpt.tools.fault_suite import forge_json, reseal

    path = snap / f"{name}.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    names = sorted((k for k in header if k != "__metadata__"), reverse=True)
    new_header, chunks, pos = {}, [], 0
    for key in names:
        start, end = header[key]["data_offsets"]
        new_header[key] = {**header[key], "data_offsets": [pos, pos + end - start]}
        chunks.append(data[start:end])
        pos += end - start
    blob = json.dumps(new_header).encode()
    blob += b" " * (-(len(blob) + 8) % 8)
    out = struct.pack("<Q", len(blob)) + blob + b"".join(chunks)
    path.write_bytes(out)
    meta = json.loads((snap / "meta.json").read_text())
    meta.pop("manifest_checksum")
    for entry in meta["files"]:
        if entry["path"] == f"{name}.safetensors":
            entry["size"], entry["checksum"] = len(out), digest_bytes(entry["algo"], out)
    (snap / "meta.json").write_text(reseal(forge_json(meta, None)))


def test_a_file_laid_out_otherwise_than_planned_still_loads(tmp_path):
    model, optim = _model_and_adam(0)
    engine = _engine(tmp_path)
    engine.register("model", model)
    engine.register("optim", optim)
    _step(model, optim)
    engine.save(1)
    saved = {k: v.clone() for k, v in _tensors(model, optim).items()}
    for name in ("model", "optim"):
        _relayout(tmp_path / "run" / "step_000000001", name)
    other, other_optim = _model_and_adam(9)
    _step(other, other_optim)
    fresh = _engine(tmp_path)
    fresh.register("model", other)
    fresh.register("optim", other_optim)
    assert fresh.restore().snapshot_id == "step_000000001"
    assert all(torch.equal(v, saved[k]) for k, v in _tensors(other, other_optim).items())


def _flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_file_refused_after_it_was_read_in_place_falls_back(tmp_path):
    model, optim = _model_and_adam(0)
    engine = _engine(tmp_path)
    engine.register("model", model)
    engine.register("optim", optim)
    _step(model, optim)
    engine.save(1)
    first = {k: v.clone() for k, v in _tensors(model, optim).items()}
    _step(model, optim)
    engine.save(2)
    _flip_last_byte(tmp_path / "run" / "step_000000002" / "optim.safetensors")
    result = engine.restore()
    assert result.snapshot_id == "step_000000001" and "step_000000002" in result.skipped
    assert all(torch.equal(v, first[k]) for k, v in _tensors(model, optim).items())
    engine.close()


def test_when_nothing_loads_the_error_says_the_objects_hold_refused_bytes(tmp_path):
    model, optim = _model_and_adam(0)
    engine = _engine(tmp_path)
    engine.register("model", model)
    engine.register("optim", optim)
    _step(model, optim)
    engine.save(1)
    _flip_last_byte(tmp_path / "run" / "step_000000001" / "model.safetensors")
    with pytest.raises(NoValidSnapshotError, match="checksum mismatch") as info:
        engine.restore()
    assert "model hold part of the bytes of a refused snapshot" in str(info.value)
    engine.close()


def test_a_state_that_does_not_fit_is_not_read_into_the_objects(tmp_path):
    """A stored optimizer state for other parameter groups is refused by ``load_state_dict`` as before, with none
    of its bytes read into the optimizer's state."""
    model, optim = _model_and_adam(0)
    engine = _engine(tmp_path)
    engine.register("optim", optim)
    _step(model, optim)
    engine.save(1)
    params = list(model.parameters())
    other = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}], lr=0.01)
    _step(model, other)  # state of the same shapes, in two groups
    kept = {k: v.clone() for k, v in _tensors(model, other).items() if k.startswith("o.")}
    fresh = _engine(tmp_path)
    fresh.register("optim", other)
    with pytest.raises(Exception, match="optim"):
        fresh.restore()
    assert all(torch.equal(v, kept[k]) for k, v in _tensors(model, other).items() if k.startswith("o."))
