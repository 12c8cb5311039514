"""save_async copies guarded state after the call returns, and the trainer waits only before changing it.

The stager thread is held at a gate (``StageRound.run`` waits for an event), so
nothing is copied in the background while the test changes the state: every
copy the snapshot holds was made by a hook on the trainer's thread before the
change (or at the call, for a component the engine cannot guard). The
snapshot restored into fresh objects must equal, bitwise, a copy taken at the
call.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from rl_ckpt import CheckpointEngine
from rl_ckpt._core.stage_guard import StageRound, background_names
from rl_ckpt._core.staging import StagingArea


class Gate:
    """Holds every stager thread until ``open()``; records which threads allocated staging buffers."""

    def __init__(self, monkeypatch) -> None:
        self.event = threading.Event()
        self.alloc_threads: list[str] = []
        run = StageRound.run

        def gated_run(rnd: StageRound) -> None:
            if threading.current_thread() is not threading.main_thread():
                self.event.wait()
            run(rnd)

        monkeypatch.setattr(StageRound, "run", gated_run)

    def allocator(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        self.alloc_threads.append(threading.current_thread().name)
        return torch.empty(numel, dtype=dtype)

    def open(self) -> None:
        self.event.set()


@pytest.fixture
def gate(monkeypatch):
    g = Gate(monkeypatch)
    yield g
    g.open()  # a failed test must not leave a stager (and the writer behind it) held


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 6)).pow(2).mean().backward()
        opt.step()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(opt.state_dict())}


def _bitwise(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _bitwise(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _bitwise(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def _engine(tmp_path, gate: Gate | None = None) -> CheckpointEngine:
    engine = CheckpointEngine(base_dir=str(tmp_path), run_name="run", post_load_check=False, keep_latest=10)
    if gate is not None:
        engine.pipeline.staging = StagingArea(gate.allocator)
    return engine


def _restored(tmp_path, snapshot_id: str) -> dict:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with CheckpointEngine(base_dir=str(tmp_path), run_name="run", post_load_check=False) as engine:
        engine.register("model", model)
        engine.register("optimizer", opt)
        engine.restore(snapshot_id=snapshot_id)
    return _state(model, opt)


def test_guarded_changes_wait_for_the_copy_and_the_snapshot_is_the_state_at_the_call(tmp_path, gate):
    torch.manual_seed(0)
    model, opt = _model(), None
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt)  # Adam has its exp_avg/exp_avg_sq/step tensors
    engine = _engine(tmp_path, gate)
    engine.register("model", model)
    engine.register("optimizer", opt)
    assert background_names(engine.registry) == {"model", "optimizer"}
    at_call = _state(model, opt)

    handle = engine.save_async(1)
    # The call captured references only: no buffer is allocated and nothing is copied yet.
    assert not handle.staged() and gate.alloc_threads == [] and handle.hook_wait_seconds == 0.0
    assert handle.stage_seconds == handle.call_seconds

    # A forward changes BatchNorm's running stats: its forward pre-hook copies the buffers first.
    model(torch.randn(8, 6))
    assert gate.alloc_threads and set(gate.alloc_threads) == {threading.current_thread().name}
    assert not handle.staged()  # only the buffers were copied: the parameters still wait
    # The optimizer step changes every parameter and Adam tensor: its pre-hook copies the rest first.
    _train(model, opt, 2)
    opt.load_state_dict(_state(model, opt)["optimizer"])
    model.load_state_dict(_model().state_dict())
    assert handle.hook_wait_seconds > 0 and handle.stage_seconds == handle.call_seconds + handle.hook_wait_seconds
    assert not handle.done()  # the writer still waits for the stager, held at the gate
    gate.open()
    info = handle.wait(timeout=60)
    assert handle.staged() and engine.pipeline.guard.armed  # a finished round's hooks return at once ...
    engine.wait()
    assert not engine.pipeline.guard.armed  # ... and the next engine call removes them
    _bitwise(at_call, _restored(tmp_path, info.snapshot_id))

    # Without a save in flight the hooks are gone (no cost on ordinary steps), and a second save reuses buffers.
    allocations = engine.pipeline.staging.allocations
    _train(model, opt)
    at_call = _state(model, opt)
    handle = engine.save_async(2)
    assert engine.pipeline.guard.armed
    _train(model, opt, 3)
    _bitwise(at_call, _restored(tmp_path, handle.wait(timeout=60).snapshot_id))
    assert engine.pipeline.staging.allocations == allocations
    engine.close()


def test_state_the_engine_cannot_guard_is_copied_at_the_call(tmp_path, gate):
    torch.manual_seed(1)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    target = _model()  # a target network updated in place (Polyak): no registered optimizer owns its parameters
    declared = nn.Linear(3, 3)  # declared: changed only after handle.wait_staged()
    pinned_sync = nn.Linear(3, 3)  # its optimizer is registered, but the user asks for a copy at the call
    opt2 = torch.optim.SGD(list(declared.parameters()) + list(pinned_sync.parameters()), lr=0.1)
    _train(model, opt)
    engine = _engine(tmp_path, gate)
    engine.register("model", model)
    engine.register("optimizer", opt)
    engine.register("target", target)
    engine.register("declared", declared, background=True)
    engine.register("pinned_sync", pinned_sync, background=False)
    engine.register("opt2", opt2)
    assert background_names(engine.registry) == {"model", "optimizer", "declared", "opt2"}
    with pytest.raises(Exception, match="background must be True, False or None"):
        engine.register("bad", nn.Linear(2, 2), background="yes")
    at_call = {
        "target": copy.deepcopy(target.state_dict()),
        "pinned_sync": copy.deepcopy(pinned_sync.state_dict()),
        "declared": copy.deepcopy(declared.state_dict()),
    }

    handle = engine.save_async(1)
    assert not handle.staged()
    with torch.no_grad():  # in place, outside any hook, while the stager is held: these were copied at the call
        for p in list(target.parameters()) + list(target.buffers()) + list(pinned_sync.parameters()):
            p.add_(1)
    handle.wait_staged()  # the declared component: change it only after the copy
    assert handle.hook_wait_seconds > 0
    with torch.no_grad():
        for p in declared.parameters():
            p.mul_(-2.0)
    gate.open()
    info = handle.wait(timeout=60)
    with CheckpointEngine(base_dir=str(tmp_path), run_name="run", post_load_check=False) as reader:
        fresh = {"target": _model(), "pinned_sync": nn.Linear(3, 3), "declared": nn.Linear(3, 3)}
        for name, obj in fresh.items():
            reader.register(name, obj)
        reader.restore(snapshot_id=info.snapshot_id, strict=False)
    for name, obj in fresh.items():
        _bitwise(at_call[name], obj.state_dict(), name)
    engine.close()


def test_an_error_while_staging_surfaces_on_the_handle_and_commits_nothing(tmp_path):
    torch.manual_seed(2)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt)
    calls = []

    def failing(numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        calls.append(numel)
        if len(calls) == 3:  # a few tensors in: the round is half staged when it fails
            raise MemoryError("staging allocator: out of host memory")
        return torch.empty(numel, dtype=dtype)

    engine = _engine(tmp_path)
    engine.pipeline.staging = StagingArea(failing)
    engine.register("model", model)
    engine.register("optimizer", opt)
    handle = engine.save_async(5)
    _train(model, opt)  # the hooks never block or raise on a failed round: training goes on
    with pytest.raises(MemoryError, match="out of host memory"):
        handle.wait(timeout=60)
    assert handle.staged() and engine.snapshots() == []
    at_call = _state(model, opt)
    info = engine.save_async(6).wait(timeout=60)  # the next save stages everything again
    assert [s.global_step for s in engine.snapshots()] == [6]
    _bitwise(at_call, _restored(tmp_path, info.snapshot_id))
    engine.close()


class FakeStream:
    """A CUDA stream stand-in recording what it was ordered after (no GPU on the test machine)."""

    def __init__(self, name: str) -> None:
        self.name, self.waited, self.synced = name, [], 0

    def wait_stream(self, other: "FakeStream") -> None:
        self.waited.append(other.name)

    def record_event(self) -> "FakeStream":
        return self

    def synchronize(self) -> None:
        self.synced += 1


def test_gpu_copies_are_ordered_after_the_trainer_at_the_call_and_before_its_next_change(monkeypatch):
    import contextlib

    from rl_ckpt._core.staging import DeviceCopies

    streams = {"trainer": FakeStream("trainer"), "stager": FakeStream("stager")}
    current = ["trainer"]
    side = FakeStream("side")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams[current[0]])
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: side)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    copied = []

    class Src:
        is_cuda, device = True, "cuda:0"

        def record_stream(self, s) -> None:
            copied.append(("recorded", s.name))

    class Dst:
        def copy_(self, src, non_blocking=False) -> None:
            copied.append(("copy", non_blocking))

    copies = DeviceCopies()
    copies.mark(["cuda:0"])  # the trainer's thread, at the end of the save call
    assert side.waited == ["trainer"]
    current[0] = "stager"  # the stager thread: its current stream is not the trainer's
    copies.copy(Dst(), Src())
    assert side.waited == ["trainer"] and copied == [("copy", True), ("recorded", "side")]
    current[0] = "trainer"  # the trainer's optimizer step pre-hook, once the copy is issued
    copies.order_current_after()
    assert streams["trainer"].waited == ["side"] and side.synced == 0  # ordered on the GPU, the host goes on
    copies.finish()  # the writer: every copy landed on the host
    assert side.synced == 1
    copies.copy(Dst(), Src())  # an unmarked copy (the call's own): after the caller's stream
    assert side.waited == ["trainer", "trainer"]


def test_prepare_allocates_the_staging_buffers_ahead_and_the_first_save_reuses_them(tmp_path, gate):
    torch.manual_seed(3)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # no state yet: prepared again after its first step
    engine = _engine(tmp_path, gate)
    engine.register("model", model)
    engine.register("optimizer", opt)
    staging = engine.pipeline.staging
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert engine.prepare() == model_bytes
    assert staging.warmed.wait(60) and set(gate.alloc_threads) == {"rl_ckpt-staging-warm-up"}
    assert staging.allocations == len(model.state_dict())

    _train(model, opt)  # the optimizer's step post-hook prepares its new state (Adam's tensors)
    assert staging.warmed.wait(60)
    tensors = len(model.state_dict()) + sum(len(s) for s in opt.state_dict()["state"].values())
    assert staging.allocations == tensors
    gate.alloc_threads.clear()
    at_call = _state(model, opt)
    handle = engine.save_async(1)
    _train(model, opt, 2)  # the hooks copy into the prepared buffers: nothing is allocated
    gate.open()
    _bitwise(at_call, _restored(tmp_path, handle.wait(timeout=60).snapshot_id))
    assert gate.alloc_threads == [] and staging.allocations == tensors
    assert engine.prepare() == 0  # every buffer is there already
    engine.close()
