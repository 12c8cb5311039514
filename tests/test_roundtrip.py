"""Round trip of a PPO-like training state into fresh objects, on every backend and commit strategy."""

from __future__ import annotations

import enum
import uuid
import warnings

import numpy as np
import pytest
import torch

from helpers import Bag, PPOState, assert_same_state, next_draws
from rl_ckpt import CheckpointEngine, CheckpointError, SerializationError
from rl_ckpt._commit import ManifestLastCommit, StagedRenameCommit


@pytest.fixture(params=["local", "local-manifest-last", "memory"])
def cfg(request, tmp_path) -> dict:
    if request.param == "local":
        return {"base_dir": str(tmp_path), "run_name": "run"}
    if request.param == "local-manifest-last":
        return {"base_dir": f"file://{tmp_path}", "run_name": "run", "atomic_write": False}
    return {"base_dir": f"memory://rt-{uuid.uuid4().hex}", "run_name": "run"}


def test_round_trip_is_exact(cfg):
    a = PPOState(seed=1)
    engine = a.register(CheckpointEngine(**cfg, train_config={"lr": 3e-3}))
    expected = (
        ManifestLastCommit
        if (cfg.get("atomic_write") is False or cfg["base_dir"].startswith("memory"))
        else StagedRenameCommit
    )
    assert type(engine.commit) is expected
    a.train(5)
    info = engine.save(global_step=5, metrics={"avg_reward": 12.5, "loss": float("nan")}, tags={"phase": "warmup"})
    assert info.global_step == 5 and info.kind == "full" and info.size_bytes > 0
    assert np.isnan(info.metrics["loss"]) and info.tags == {"phase": "warmup"}

    b = PPOState(seed=999)  # different weights, RNGs and buffer: nothing shared by accident
    result = b.register(CheckpointEngine(**cfg, train_config={"lr": 3e-3})).restore()
    assert result.snapshot_id == "step_000000005" and result.global_step == 5 and not result.warnings
    assert_same_state(a, b)

    # The next RNG draws are equal: draw after the save, restore, draw again.
    draws_a = next_draws(), a.explore.normal()
    restore_into(b, cfg)
    draws_b = next_draws(), b.explore.normal()
    assert draws_a == draws_b

    # The next optimizer step gives bitwise-equal parameters (each step starts from the restored RNGs).
    restore_into(a, cfg)
    a.train_step()
    restore_into(b, cfg)
    b.train_step()
    assert_same_state(a, b)


def restore_into(state: PPOState, cfg: dict):
    return state.register(CheckpointEngine(**cfg)).restore()


def test_snapshots_listed_oldest_first_and_verify_ok(cfg):
    s = PPOState()
    engine = s.register(CheckpointEngine(**cfg))
    for step in (3, 1, 2):
        engine.save(step)
    assert [i.global_step for i in engine.snapshots()] == [1, 2, 3]
    assert [i.global_step for i in CheckpointEngine(**cfg).snapshots()] == [1, 2, 3]  # rebuilt from storage
    report = engine.verify()
    assert report.ok and len(report.checked) == 3


def test_one_step_commits_once(cfg):
    s = PPOState()
    engine = s.register(CheckpointEngine(**cfg))
    first = engine.save(7, metrics={"avg_reward": 1.0})
    s.train(1)
    with pytest.raises(CheckpointError, match="already committed"):
        engine.save(7, metrics={"avg_reward": 2.0})
    again = CheckpointEngine(**cfg).snapshots()
    assert [(i.snapshot_id, i.metrics["avg_reward"]) for i in again] == [(first.snapshot_id, 1.0)]
    assert engine.verify().ok


def test_unsupported_value_names_component_and_key(cfg):
    class Weird:
        def state_dict(self):
            return {"ok": 1, "nested": {"bad": object()}}

        def load_state_dict(self, state):
            pass

    engine = CheckpointEngine(**cfg)
    engine.register("env", Weird())
    with pytest.raises(SerializationError) as err:
        engine.save(1)
    assert err.value.component == "env" and err.value.key == "nested/bad"
    assert "env" in str(err.value) and "nested/bad" in str(err.value)
    assert engine.snapshots() == []


def test_torch_dtypes_and_special_values_round_trip(cfg):
    state = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "f16": torch.randn(2).half(),
        "i8": torch.arange(-3, 3, dtype=torch.int8),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "noncontig": torch.arange(12.0).reshape(3, 4).t(),
        "u32": np.arange(5, dtype=np.uint32),
        "big": 2**100,
        "inf": float("inf"),
        "nan": float("nan"),
        "tuple": (1, (2, "x")),
        "intkeys": {3: "a", 1: "b"},
        "dollar": {"$tensor": "not a tag"},
        "bytes": b"\x00\xff",
        "np_scalar": np.float32(1.25),
        "none": None,
    }
    engine = CheckpointEngine(**cfg)
    engine.register("bag", Bag(state))
    engine.save(1)
    out = Bag()
    e2 = CheckpointEngine(**cfg)
    e2.register("bag", out)
    e2.restore()
    got = out.state
    for k in ("bf16", "f16", "i8", "bool", "scalar", "empty", "noncontig"):
        assert got[k].dtype == state[k].dtype and torch.equal(got[k], state[k]), k
    assert got["u32"].dtype == np.uint32 and np.array_equal(got["u32"], state["u32"])
    assert got["big"] == 2**100 and got["inf"] == float("inf") and np.isnan(got["nan"])
    assert got["tuple"] == (1, (2, "x")) and got["intkeys"] == {3: "a", 1: "b"}
    assert got["dollar"] == {"$tensor": "not a tag"} and got["bytes"] == b"\x00\xff"
    assert type(got["np_scalar"]) is np.float32 and got["np_scalar"] == np.float32(1.25) and got["none"] is None


def round_trip(cfg, state: dict, *, use_async: bool = False) -> dict:
    engine = CheckpointEngine(**cfg)
    engine.register("bag", Bag(state))
    if use_async:
        engine.save_async(1).wait()
    else:
        engine.save(1)
    engine.close()
    out = Bag()
    e2 = CheckpointEngine(**cfg)
    e2.register("bag", out)
    e2.restore()
    return out.state


class Color(enum.IntEnum):
    RED = 1


class Mode(enum.Enum):
    TRAIN = "train"


def exact_state() -> dict:
    from collections import OrderedDict, defaultdict

    od = OrderedDict([("z", 1), ("a", [2.5])])
    od._metadata = OrderedDict([("", {"version": 3})])
    return {
        "odict": od,
        "ddict": defaultdict(list, {"x": [1, 2]}),
        "ddict_none": defaultdict(None, {1: "a"}),
        "f64": np.float64(0.1),
        "f32": np.float32(0.25),
        "i64": np.int64(-(2**63)),
        "u64": np.uint64(2**64 - 1),
        "npbool": np.bool_(True),
        "npc": np.complex128(1 - 2j),
        "size": torch.Size([3, 4]),
        "device": torch.device("cpu"),
        "dtype": torch.bfloat16,
        "complex": complex(1.5, float("-inf")),
        "huge": -(3**5000),
        "bytearray": bytearray(b"\x01"),
        "c64": torch.randn(3, 2, dtype=torch.complex64),
        "c128": torch.randn(4, dtype=torch.complex128).conj(),
        "np_c64": (np.arange(3) * 1j).astype(np.complex64),
        "np_c128": np.arange(4).astype(np.complex128) + 0.5j,
        "np_0d": np.array(2.5),
        "np_0d_int": np.array(7, dtype=np.int8),
        "big_endian": np.arange(3, dtype=">i4"),
        "np_fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "t_0d": torch.tensor(1.0),
        "param": torch.nn.Parameter(torch.ones(2)),
        "frozen": torch.nn.Parameter(torch.zeros(1), requires_grad=False),
        "int_keys": {2**70: "big key", -1: "neg"},
    }


@pytest.mark.parametrize("use_async", [False, True], ids=["save", "save_async"])
def test_every_supported_type_comes_back_exactly(cfg, use_async):
    state = exact_state()
    got = round_trip(cfg, state, use_async=use_async)
    assert list(got) == list(state)
    for key, want in state.items():
        value = got[key]
        assert type(value) is type(want), f"{key}: {type(value).__name__} is not {type(want).__name__}"
        if isinstance(want, torch.Tensor):
            assert (
                value.dtype == want.dtype and value.shape == want.shape and torch.equal(value, want.resolve_conj())
            ), key
            assert value.requires_grad == want.requires_grad, key
        elif isinstance(want, np.ndarray):
            assert value.dtype == want.dtype and value.shape == want.shape and np.array_equal(value, want), key
        elif isinstance(want, complex):
            assert value.real == want.real and value.imag == want.imag
        else:
            assert value == want and getattr(value, "dtype", None) == getattr(want, "dtype", None), key
    assert got["odict"]._metadata == state["odict"]._metadata and list(got["odict"]) == ["z", "a"]
    assert got["ddict"].default_factory is list and got["ddict"]["new"] == []
    assert got["ddict_none"].default_factory is None


def refusals() -> list:
    from collections import defaultdict, namedtuple

    class MyDict(dict):
        pass

    class Flt(float):
        pass

    Point = namedtuple("Point", "x y")
    with warnings.catch_warnings():  # complex32 and np.matrix warn that they are experimental/deprecated
        warnings.simplefilter("ignore")
        chalf, matrix = torch.zeros(2, dtype=torch.complex32), np.matrix([[1, 2]])
    return [
        ("int_enum", Color.RED, "enum"),
        ("enum", Mode.TRAIN, "enum"),
        ("namedtuple", Point(1, 2), "namedtuple"),
        ("set", {1, 2}, "set"),
        ("dict_subclass", MyDict(a=1), "subclass of dict"),
        ("float_subclass", Flt(1.0), "subclass of float"),
        ("lambda_ddict", defaultdict(lambda: 0), "default_factory"),
        ("chalf", chalf, "complex32"),
        ("matrix", matrix, "subclass of ndarray"),
        ("datetimes", np.zeros(2, dtype="datetime64[s]"), "datetime64"),
        ("longdouble", np.zeros(2, dtype=np.longdouble), "float128"),
        ("too_deep", nest(200), "levels deep"),
        ("bool_key", {True: 1}, "keys must be str or int"),
        ("obj", object(), "fits none of"),
    ]


def nest(depth: int):
    node: list = []
    for _ in range(depth):
        node = [node]
    return node


@pytest.mark.parametrize("use_async", [False, True], ids=["save", "save_async"])
@pytest.mark.parametrize("key,value,why", refusals(), ids=[r[0] for r in refusals()])
def test_unsupported_types_are_refused_at_the_call_naming_component_and_key(cfg, use_async, key, value, why):
    engine = CheckpointEngine(**cfg)
    engine.register("env", Bag({"fine": torch.ones(2), "nested": {key: value}}))
    with pytest.raises(SerializationError) as err:
        (engine.save_async if use_async else engine.save)(1)
    assert err.value.component == "env" and err.value.key.startswith(f"nested/{key}"), err.value.key
    assert why in str(err.value) and "'env'" in str(err.value)
    engine.close()
    assert CheckpointEngine(**cfg).snapshots() == []


def test_a_state_that_contains_itself_is_refused(cfg):
    loop: dict = {"a": 1}
    loop["self"] = loop
    engine = CheckpointEngine(**cfg)
    engine.register("env", Bag({"loop": loop}))
    with pytest.raises(SerializationError, match="contains itself") as err:
        engine.save(1)
    assert err.value.key == "loop/self"


def test_the_deepest_allowed_nesting_round_trips(cfg):
    from collections import OrderedDict

    from rl_ckpt._format.state_codec import MAX_DEPTH

    node: object = torch.ones(1)
    for depth in range(MAX_DEPTH - 1):  # the component's own dict is the first level
        node = [node] if depth % 3 == 0 else (node,) if depth % 3 == 1 else OrderedDict([(f"${depth}", node)])
    got = round_trip(cfg, {"deep": node})["deep"]
    for depth in reversed(range(MAX_DEPTH - 1)):
        assert type(got) is (list if depth % 3 == 0 else tuple if depth % 3 == 1 else OrderedDict)
        got = got[0] if depth % 3 != 2 else got[f"${depth}"]
    assert torch.equal(got, torch.ones(1))


@pytest.mark.parametrize("use_async", [False, True], ids=["save", "save_async"])
def test_a_state_dict_that_raises_is_named(cfg, use_async):
    class Broken:
        def state_dict(self):
            raise KeyError("episode_stats")

        def load_state_dict(self, state):
            pass

    engine = CheckpointEngine(**cfg)
    engine.register("env", Broken())
    with pytest.raises(SerializationError, match="component 'env': state_dict\\(\\) raised KeyError") as err:
        (engine.save_async if use_async else engine.save)(1)
    assert err.value.component == "env" and isinstance(err.value.__cause__, KeyError)
    engine.close()
