"""Encode plans (core/encode_plans.py): a reused encoding is exactly what a full ``encode_state`` gives."""

from __future__ import annotations

import json

import torch
from torch import nn

from rl_ckpt._core.encode_plans import EncodePlans
from rl_ckpt._format.state_codec import encode_state


def _same_as_full(plans: EncodePlans, name: str, state) -> None:
    got, want = plans.encode(name, state), encode_state(name, state, host=False)
    assert json.dumps(got.tree) == json.dumps(want.tree)
    assert list(got.arrays) == list(want.arrays)
    for key, a in got.arrays.items():
        b = want.arrays[key]
        assert (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype), key


def _model_and_adam():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def test_a_module_and_adam_reuse_their_plan_and_match_a_full_encode():
    model, opt = _model_and_adam()
    plans = EncodePlans()
    for name, obj in (("model", model), ("optimizer", opt)):
        _same_as_full(plans, name, obj.state_dict())
        _same_as_full(plans, name, obj.state_dict())
    assert (plans.hits, plans.misses) == (2, 2)


def test_a_changed_scalar_gets_a_new_node_and_the_cached_tree_is_left_alone():
    _model, opt = _model_and_adam()
    plans = EncodePlans()
    first = plans.encode("optimizer", opt.state_dict())
    before = json.dumps(first.tree)
    for lr in (0.5, float("nan"), -0.0, 2**70):  # a scheduler's lr; NaN, a negative zero and a big int too
        opt.param_groups[0]["lr"] = lr
        _same_as_full(plans, "optimizer", opt.state_dict())
    assert json.dumps(first.tree) == before  # (a save being written shares it)
    assert plans.misses == 2  # the big int changed the scalar's type (int after float): encoded in full


def test_a_changed_structure_type_or_tensor_falls_back_to_a_full_encode():
    state = {"a": torch.zeros(3), "b": [1, 2.0, "s", None, True], "c": (1, 2), 3: {"x": torch.ones(2)}}
    plans = EncodePlans()
    _same_as_full(plans, "c", state)
    changes = [
        lambda s: s.__setitem__("a", torch.zeros(4)),  # another tensor (shape)
        lambda s: s["b"].__setitem__(0, True),  # int -> bool (equal, but another type)
        lambda s: s.__setitem__("d", 1),  # a new key
        lambda s: s.__setitem__("c", [1, 2]),  # tuple -> list
        lambda s: s[3].__setitem__("x", torch.ones(2, dtype=torch.float64)),  # another dtype
    ]
    for change in changes:
        change(state)
        misses = plans.misses
        _same_as_full(plans, "c", state)
        assert plans.misses == misses + 1
    _same_as_full(plans, "c", state)
    assert plans.misses == misses + 1  # and the new plan is used next time


def test_ordered_dict_metadata_and_shared_storage():
    model = nn.Linear(3, 3)
    plans = EncodePlans()
    sd = model.state_dict()
    _same_as_full(plans, "m", sd)
    sd2 = model.state_dict()
    sd2._metadata[""]["version"] = 7  # the OrderedDict's _metadata is part of the state too
    _same_as_full(plans, "m", sd2)
    flat = torch.zeros(10)
    views = {"whole": flat, "part": flat[2:5]}  # views of one storage: stored as a span, no plan (full encode)
    _same_as_full(plans, "v", views)
    assert plans.plans["v"] is None
    _same_as_full(plans, "v", views)
    tied = {"a": flat, "b": flat}  # the same view twice: one stored tensor, and a plan
    _same_as_full(plans, "t", tied)
    assert plans.plans["t"] is not None
    _same_as_full(plans, "t", tied)
    odd = {"n": __import__("numpy").zeros(2), "e": torch.zeros(0)}  # NumPy arrays, empty tensors: no plan
    plans.encode("o", odd)
    assert plans.plans["o"] is None
    plans.forget({"m"})
    assert set(plans.plans) == {"m"}
