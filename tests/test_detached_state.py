"""Detached states (``checkpoint_detached_state``): only ``state_dict()`` (or ``state_dict_later()``) runs at a
background save's call; the encoding, and the later function, run on the writer. The snapshot is still the state
at the call, a refusal fails that save alone through its handle, and the order of the components is kept."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from rl_ckpt import CheckpointEngine, SerializationError
from rl_ckpt.tools.faults import FaultyStorage
from rl_ckpt._storage import open_storage


class Counters:
    """Counters and a small array, whose ``state_dict()`` is a tree of its own (copied)."""

    checkpoint_detached_state = True

    def __init__(self) -> None:
        self.step = 0
        self.history: list[float] = []
        self.stats = np.zeros(4)
        self.extra: object = None
        self.calls: list[str] = []  # the thread of each state_dict() call

    def advance(self, by: float) -> None:
        self.step += 1
        self.history.append(by)
        self.stats += by

    def state_dict(self) -> dict:
        self.calls.append(threading.current_thread().name)
        out = {"step": self.step, "history": list(self.history), "stats": self.stats.copy()}
        if self.extra is not None:
            out["extra"] = self.extra
        return out

    def load_state_dict(self, state: dict) -> None:
        self.step, self.history, self.stats = state["step"], list(state["history"]), np.array(state["stats"])


class Remote(Counters):
    """Asked for its state at the call; the answer is produced by the function ``state_dict_later`` returns."""

    def __init__(self) -> None:
        super().__init__()
        self.answered: list[str] = []  # the thread each later function ran on
        self.fail_later = False
        self.hold: threading.Event | None = None  # the later function waits for it (the remote answers late)

    def state_dict_later(self):
        asked = self.state_dict()  # what the call asked for: the state as of now

        def answer() -> dict:
            self.answered.append(threading.current_thread().name)
            if self.hold is not None:
                assert self.hold.wait(timeout=60)
            if self.fail_later:
                raise RuntimeError("the remote process died")
            return asked

        return answer


def _engine(tmp_path):
    storage = FaultyStorage(open_storage(str(tmp_path / "run")))
    return CheckpointEngine(base_dir=str(tmp_path), storage=storage, keep_latest=10), storage


def _model():
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    return module, torch.optim.Adam(module.parameters())


def test_the_snapshot_is_the_state_at_the_call_and_encoding_runs_on_the_writer(tmp_path):
    engine, storage = _engine(tmp_path)
    module, optim = _model()
    counters, remote = Counters(), Remote()
    engine.register("model", module)
    engine.register("counters", counters)
    engine.register("remote", remote)
    engine.register("optimizer", optim)
    for c in (counters, remote):
        c.advance(1.5)
        c.advance(2.0)
    gate = threading.Event()
    remote.hold = gate  # the writer waits in the later function until the live objects moved on
    storage.before("write", gate.wait, nth=1)  # (and before its first write)
    handle = engine.save_async(2)
    for c in (counters, remote):
        c.advance(100.0)
    gate.set()
    info = handle.wait(timeout=60)
    assert counters.calls == [threading.current_thread().name]  # state_dict() at the call, once
    assert remote.calls == [threading.current_thread().name]  # asked at the call (by state_dict_later)...
    assert len(remote.answered) == 1 and remote.answered[0] != threading.current_thread().name  # ...answered later
    assert list(info.manifest.components) == ["model", "counters", "remote", "optimizer"]  # registration order

    fresh_counters, fresh_remote = Counters(), Remote()
    fresh = CheckpointEngine(base_dir=str(tmp_path))
    fresh.register("model", torch.nn.Linear(3, 2))
    fresh.register("counters", fresh_counters)
    fresh.register("remote", fresh_remote)
    fresh.restore()
    for c in (fresh_counters, fresh_remote):
        assert c.step == 2 and c.history == [1.5, 2.0]
        assert c.stats.tolist() == [3.5] * 4


def _saved_once(tmp_path, name: str, component: Counters) -> CheckpointEngine:
    """An engine with ``component`` registered as ``name`` and one snapshot of it (step 1) committed."""
    engine, _ = _engine(tmp_path)
    engine.register(name, component)
    component.advance(1.0)
    engine.save_async(1).wait(timeout=60)
    return engine


def test_a_detached_state_the_format_refuses_fails_that_save_alone(tmp_path):
    counters = Counters()
    engine = _saved_once(tmp_path, "counters", counters)
    counters.advance(1.0)
    counters.extra = {"ids": {1, 2}}  # a set: no encoding for it
    handle = engine.save_async(2)  # not refused at the call: encoding happens on the writer
    with pytest.raises(SerializationError) as err:
        handle.wait(timeout=60)
    assert err.value.component == "counters" and err.value.key == "extra/ids"
    assert [s.global_step for s in engine.snapshots()] == [1]
    # The same value in an ordinary component is refused at the call.
    counters.checkpoint_detached_state = False
    with pytest.raises(SerializationError):
        engine.save_async(3)
    counters.extra = None
    counters.checkpoint_detached_state = True
    engine.save_async(4).wait(timeout=60)
    assert [s.global_step for s in engine.snapshots()] == [1, 4]
    fresh = Counters()
    reader = CheckpointEngine(base_dir=str(tmp_path))
    reader.register("counters", fresh)
    reader.restore()
    assert fresh.step == 2


def test_a_later_function_that_raises_names_the_component_and_commits_nothing(tmp_path):
    remote = Remote()
    engine = _saved_once(tmp_path, "remote", remote)
    remote.fail_later = True
    handle = engine.save_async(2)
    with pytest.raises(SerializationError, match="'remote'.*state_dict_later.*RuntimeError.*died") as err:
        handle.wait(timeout=60)
    assert err.value.component == "remote"
    assert [s.global_step for s in engine.snapshots()] == [1]


def test_a_synchronous_save_takes_a_detached_state_at_the_call(tmp_path):
    engine, _ = _engine(tmp_path)
    remote = Remote()
    engine.register("remote", remote)
    remote.advance(4.0)
    engine.save(1)
    assert remote.answered == []  # save() calls state_dict(), not state_dict_later()
    fresh = Remote()
    reader = CheckpointEngine(base_dir=str(tmp_path))
    reader.register("remote", fresh)
    reader.restore()
    assert fresh.history == [4.0]


def test_prepare_allocates_no_staging_for_a_detached_state(tmp_path):
    engine, _ = _engine(tmp_path)
    counters = Counters()
    counters.stats = torch.zeros(1 << 16)  # a tensor: staged if the component were not detached
    counters.state_dict = lambda: {"stats": counters.stats.clone()}
    engine.register("counters", counters)
    assert engine.prepare() == 0
    engine.save_async(1).wait(timeout=60)
    assert engine.pipeline.staging.allocations == 0
    counters.checkpoint_detached_state = False  # the same component, not detached: staged
    assert engine.prepare() == counters.stats.numel() * 4
