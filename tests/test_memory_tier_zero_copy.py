"""Zero-copy reads from the memory tier: a store holds large files as objects it put into the node's object
store; a reader maps them read-only, hashes them in place and decodes tensors over them; a flipped byte is
still caught before anything is loaded, and nothing is ever written through the shared memory."""

from __future__ import annotations

import uuid
import warnings

import numpy as np
import pytest
import torch

from rl_ckpt import CheckpointEngine
from rl_ckpt._core.reader import load_component
from rl_ckpt._run.snapshot_files import read_verified
from rl_ckpt.errors import CorruptSnapshotError
from rl_ckpt._format import safetensors_io
from rl_ckpt._format.checksum import new_hasher


class Big:
    """A component of two tensors, one past the size from which a store keeps files in the object store."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(300_000, generator=g)  # 1.2 MB
        self.b = torch.arange(7, dtype=torch.int64) + seed

    def state_dict(self) -> dict:
        return {"w": self.w, "b": self.b}

    def load_state_dict(self, state: dict) -> None:
        self.w.copy_(state["w"])
        self.b.copy_(state["b"])


@pytest.fixture
def mem(ray_cluster):
    from rl_ckpt._storage import open_storage

    storage = open_storage(f"raymem://mem/zc-{uuid.uuid4().hex[:8]}", {"replicas": 0})
    yield storage
    storage.destroy()


def _saved(storage, seed: int = 1):
    state = Big(seed)
    engine = CheckpointEngine(
        base_dir="raymem://mem",
        run_name=storage.key.split("/", 1)[1],
        storage=storage,
        keep_latest=5,
        keep_best=0,
        post_load_check=False,
    )
    engine.register("big", state)
    sid = engine.save(1).snapshot_id
    manifest = engine.catalog.get(sid).manifest
    return engine, state, manifest


def _tensor_entry(manifest):
    return next(f for f in manifest.files_of("big") if f.role == "tensors")


@pytest.mark.ray
def test_read_view_is_read_only_shared_and_hashed_in_place(mem):
    engine, _state, manifest = _saved(mem)
    entry = _tensor_entry(manifest)
    path = f"{manifest.snapshot_id}/{entry.path}"
    seen = []
    view = mem.read_view(path, on_chunk=lambda piece: seen.append(bytes(piece)))
    assert view.readonly and view.nbytes == entry.size
    assert b"".join(seen) == bytes(view)  # on_chunk saw exactly the bytes returned
    with pytest.raises(TypeError):
        view[0] = 1
    again = mem.read_view(path)
    # Both views map the same object of the store (no copy per read).
    assert np.frombuffer(view, np.uint8).ctypes.data == np.frombuffer(again, np.uint8).ctypes.data
    copied = mem.read(path)  # the writable read is a private copy, equal byte for byte
    assert bytes(copied) == bytes(view) and not memoryview(copied).readonly
    copied[0] ^= 0xFF
    assert bytes(mem.read_view(path)) == bytes(view)  # writing the copy left the store's bytes alone
    engine.close()


@pytest.mark.ray
def test_zero_copy_load_decodes_over_the_store_and_loads_bitwise(mem):
    engine, state, manifest = _saved(mem)
    loaded = load_component(mem, manifest, "big", readonly_ok=True)
    view = mem.read_view(f"{manifest.snapshot_id}/{_tensor_entry(manifest).path}")
    start = np.frombuffer(view, np.uint8).ctypes.data
    assert start <= loaded["w"].data_ptr() < start + view.nbytes  # the tensor is over the store's memory
    fresh = Big(seed=9)
    fresh.load_state_dict(loaded)
    assert torch.equal(fresh.w, state.w) and torch.equal(fresh.b, state.b)
    engine.close()


@pytest.mark.ray
def test_zero_copy_read_detects_a_flipped_byte(mem, ray_cluster):
    engine, _state, manifest = _saved(mem)
    entry = _tensor_entry(manifest)
    path = f"{manifest.snapshot_id}/{entry.path}"
    data = bytearray(mem.read(path))
    data[len(data) // 2] ^= 0x01
    store = next(iter(mem.stores().values()))
    ray_cluster.get(store.put.remote(path, bytes(data)))  # the store now holds a corrupted copy
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):
        read_verified(mem, manifest.snapshot_id, entry, readonly_ok=True)
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):
        load_component(mem, manifest, "big", readonly_ok=True)
    engine.close()


@pytest.mark.ray
def test_open_read_streams_the_view(mem):
    payload = np.random.default_rng(4).integers(0, 255, (1 << 20) + 13, dtype=np.uint8)
    mem.write("step_000000001/x.bin", [payload[:1000], payload[1000:]])  # two pieces: held as one object
    hasher = new_hasher("xxh3_128")
    with mem.open_read("step_000000001/x.bin") as f:
        got = f.read()
    hasher.update(got)
    assert got == payload.tobytes()
    assert mem.read_range("step_000000001/x.bin", 999, 3) == payload[999:1002].tobytes()


def test_decoding_a_read_only_buffer():
    """Pure logic: safetensors decodes a read-only buffer; tensors are views over it, without warnings."""
    arrays = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, dtype=torch.int16)}
    chunks, _meta = safetensors_io.encode(arrays)
    blob = b"".join(bytes(c) for c in chunks)  # bytes: read-only memory
    view = memoryview(blob)
    assert view.readonly
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = {
            k: safetensors_io.to_torch(code, shape, v)
            for k, (code, shape, v) in safetensors_io.decode(view, where="x").items()
        }
    assert torch.equal(out["a"], arrays["a"]) and torch.equal(out["b"], arrays["b"])
    base = np.frombuffer(blob, np.uint8).ctypes.data
    assert base <= out["a"].data_ptr() < base + len(blob)  # no copy


def test_optimizer_state_restored_from_memory_into_its_own_tensors(mem):
    """An optimizer keeps the tensors it is given: from the memory tier they are copied into the optimizer's own
    state tensors (same objects after the restore, no fresh memory), never handed over as shared memory."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Linear(300, 4))  # 360 KB of exp_avg
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = CheckpointEngine(
        base_dir="raymem://mem",
        run_name=mem.key.split("/", 1)[1],
        storage=mem,
        keep_latest=5,
        keep_best=0,
        post_load_check=False,
    )
    engine.register("model", model)
    engine.register("optim", optim)
    for _ in range(2):
        model(torch.randn(3, 300)).sum().backward()
        optim.step()
    saved = {
        k: v.clone() for i, s in optim.state_dict()["state"].items() for k, v in ((f"{i}.{n}", t) for n, t in s.items())
    }
    engine.save(2)
    model(torch.randn(3, 300)).sum().backward()
    optim.step()  # the state moves on; the restore must bring back step 2's
    before = {i: {n: t for n, t in s.items()} for i, s in optim.state_dict()["state"].items()}
    engine.restore(snapshot_id="step_000000002")
    after = optim.state_dict()["state"]
    for i, s in after.items():
        for n, t in s.items():
            assert t is before[i][n], f"{i}.{n} is a new tensor"  # copied into the optimizer's own memory
            assert torch.equal(t, saved[f"{i}.{n}"]), f"{i}.{n}"
    model(torch.randn(3, 300)).sum().backward()
    optim.step()  # writes the state in place: it must be the optimizer's memory, not the store's
    engine.close()


def test_into_optimizer_state_copies_only_into_places_of_their_own():
    """Copied in place: a state tensor of the same shape and dtype that nothing else shares. Cloned: one of another
    shape, one the optimizer holds at two places, and views that overlap."""
    from rl_ckpt._core.reader import into_optimizer_state

    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(4)]
    optim = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    common, buf = torch.zeros(4), torch.zeros(6)
    optim.state[params[0]] = {"momentum_buffer": torch.zeros(4)}  # its own: copied into
    optim.state[params[1]] = {"momentum_buffer": torch.zeros(3)}  # another shape: cloned
    optim.state[params[2]] = {"momentum_buffer": common}  # held at two places: cloned
    optim.state[params[3]] = {"momentum_buffer": common}
    before = {i: s["momentum_buffer"] for i, s in optim.state_dict()["state"].items()}
    loaded = optim.state_dict()
    loaded["state"] = {i: {"momentum_buffer": torch.full((4,), float(i + 1))} for i in range(4)}
    out = into_optimizer_state(optim, loaded)
    got = {i: s["momentum_buffer"] for i, s in out["state"].items()}
    assert got[0] is before[0] and torch.equal(before[0], torch.full((4,), 1.0))
    for i in (1, 2, 3):
        assert got[i] is not before[i] and torch.equal(got[i], torch.full((4,), float(i + 1)))
    assert torch.equal(common, torch.zeros(4))  # the shared tensor was never written
    # Overlapping views of one buffer: neither is written.
    optim.state[params[2]] = {"momentum_buffer": buf[0:4]}
    optim.state[params[3]] = {"momentum_buffer": buf[2:6]}
    out = into_optimizer_state(optim, loaded)
    assert torch.equal(buf, torch.zeros(6)) and torch.equal(out["state"][3]["momentum_buffer"], torch.full((4,), 4.0))
