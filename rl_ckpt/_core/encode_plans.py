"""Encode plans: reuse a component's last encoding while its ``state_dict()`` keeps its shape.

``encode_state`` walks a whole state (~640 tensors for a 1 GiB model + Adam:
about 5 ms of Python, and thousands of new objects that trigger the garbage
collector) on every ``save_async`` call. Between two saves the structure of a
trainer's state rarely changes: the same keys, the same tensors (same storage,
offset, shape, stride, dtype, device), the same scalars. A plan records that
structure after a full encode; the next save walks the new state against it
(no new objects unless something changed) and reuses the last JSON tree and
array names. A scalar that changed (a scheduler's ``lr``) gets a new node and
only the containers above it are copied (the cached tree is never mutated: a
save being written shares it). Anything else that differs (a key, a type, a
tensor's storage or layout) encodes the state in full again and rebuilds the
plan. The arrays are always the tensors ``state_dict()`` returned at this call.

A state holding anything but dicts, OrderedDicts, lists, tuples, tensors and
plain scalars (NumPy arrays, tables, TensorDicts, complex or empty tensors, ...)
has no plan: it is encoded in full every time, as before.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import torch

from rl_ckpt._format.state_codec import EncodedState, encode_state

_SAME = object()  # a node that matches its plan and kept its value: the cached tree node is reused
_SCALARS = (type(None), bool, int, float, str)


class NoPlan(Exception):
    """The state has a value a plan does not cover, or does not match the plan (internal: never escapes)."""


class EncodePlans:
    """Per-component encode plans of one pipeline (``encode`` is called on the trainer's thread only)."""

    def __init__(self) -> None:
        self.plans: dict[str, _Plan | None] = {}
        self.hits = 0  # encodes that reused a plan
        self.misses = 0  # full encodes

    def encode(self, name: str, state: Any) -> EncodedState:
        """``encode_state(name, state, host=False)``, from the component's plan when the state still fits it."""
        plan = self.plans.get(name)
        if plan is not None:
            try:
                enc = plan.reuse(state)
            except NoPlan:
                enc = None
            if enc is not None:
                self.hits += 1
                return enc
        self.misses += 1
        enc = encode_state(name, state, host=False)  # every refusal (type, dtype, cycle) happens here
        self.plans[name] = _Plan.build(state, enc)
        return enc

    def forget(self, live: set[str]) -> None:
        """Drop the plans of components not in ``live``."""
        for name in list(self.plans):
            if name not in live:
                del self.plans[name]


class _Plan:
    def __init__(self, skeleton: tuple, tree: Any, sigs: list, arrays: list) -> None:
        self.skeleton = skeleton
        self.tree = tree
        self.sigs = sigs  # per tensor leaf, in walk order: (storage pointer, offset, shape, stride, dtype, device)
        self.arrays = arrays  # (array name, index of the tensor leaf stored under it)

    @classmethod
    def build(cls, state: Any, enc: EncodedState) -> "_Plan | None":
        """The plan of ``state`` as ``enc`` encoded it; None when it has none (see the module docstring)."""
        if enc.tables or not all(isinstance(a, torch.Tensor) for a in enc.arrays.values()):
            return None
        leaves: list[torch.Tensor] = []
        try:
            skeleton = _skeleton(state, enc.tree, leaves, 0)
        except NoPlan:
            return None
        if any(t.numel() == 0 or t.is_complex() for t in leaves):
            return None
        sigs = [_sig(t) for t in leaves]
        first: dict[tuple, int] = {}
        for i, t in enumerate(leaves):
            first.setdefault((t.device, sigs[i][0], t.dtype), i)
        arrays = []
        for name, a in enc.arrays.items():
            i = first.get((a.device, a.untyped_storage().data_ptr(), a.dtype))
            if i is None or _sig(a) != sigs[i]:  # a span of several views of one storage: left to the full encode
                return None
            arrays.append((name, i))
        return cls(skeleton, enc.tree, sigs, arrays)

    def reuse(self, state: Any) -> EncodedState | None:
        """``state`` encoded from this plan, or None when its tensors moved (raises NoPlan on other mismatches)."""
        leaves: list[torch.Tensor] = []
        node = _match(state, self.skeleton, leaves)
        sigs = [
            (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype, t.device) for t in leaves
        ]  # (``_sig`` inlined: this runs for every tensor at every call)
        if sigs != self.sigs:
            return None
        tree = self.tree if node is _SAME else node
        return EncodedState(tree=tree, arrays={name: leaves[i] for name, i in self.arrays})  # (staging detaches)


def _sig(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype, t.device)


def _scalar_node(value: Any) -> Any:
    """The JSON node ``encode_state`` writes for a plain scalar (checked against it when a plan is built)."""
    if type(value) is int and value.bit_length() > 64:
        return {"$int": format(value, "x")}
    if type(value) is float and not math.isfinite(value):
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    return value


# Skeleton nodes: ("t", kind) a tensor leaf; ("s", type, value) a scalar; ("c", type, form, keys, children, tree,
# leading) a container whose tree node is ``tree``, whose children sit in it as ``form`` says and whose first
# ``leading`` children are tensor leaves (checked in one loop: a module's state_dict, Adam's per-parameter state).


def _container(kind: type, form: str, keys: Any, children: list, tree: Any) -> tuple:
    leading = 0
    while leading < len(children) and children[leading][0] == "t":
        leading += 1
    return ("c", kind, form, keys, children, tree, leading)


def _skeleton(value: Any, tree: Any, leaves: list, depth: int) -> tuple:
    """The skeleton of ``value``, checked against its node in the encoded ``tree``; tensor leaves go to ``leaves``."""
    if depth > 64:
        raise NoPlan()
    kind = type(value)
    if kind is torch.Tensor:
        if not (type(tree) is dict and "$tensor" in tree):
            raise NoPlan()
        leaves.append(value)
        return ("t", kind)
    if kind in _SCALARS:
        if _scalar_node(value) != tree or (type(tree) is not dict and type(tree) is not kind):
            raise NoPlan()
        return ("s", kind, value)
    if kind is dict and type(tree) is dict and all(type(k) is str and not k.startswith("$") for k in value):
        keys = list(value)
        if list(tree) != keys:
            raise NoPlan()
        children = [_skeleton(value[k], tree[k], leaves, depth + 1) for k in keys]
        return _container(kind, "dict", keys, children, tree)
    if kind is list and type(tree) is list and len(tree) == len(value):
        return _container(kind, "list", None, [_skeleton(v, n, leaves, depth + 1) for v, n in zip(value, tree)], tree)
    if kind is tuple and type(tree) is dict and list(tree) == ["$tuple"] and len(tree["$tuple"]) == len(value):
        children = [_skeleton(v, n, leaves, depth + 1) for v, n in zip(value, tree["$tuple"])]
        return _container(kind, "tuple", None, children, tree)
    if kind is dict and type(tree) is dict and list(tree) == ["$dict"]:
        return _pairs_skeleton(value, kind, "pairs", tree["$dict"], tree, leaves, depth)
    if kind is collections.OrderedDict and type(tree) is dict and list(tree) == ["$odict"]:
        node = tree["$odict"]
        meta = vars(value)
        if set(meta) - {"_metadata"} or ("meta" in node) != ("_metadata" in meta):
            raise NoPlan()
        skel = _pairs_skeleton(value, kind, "odict", node["items"], tree, leaves, depth)
        if "_metadata" in meta:
            skel[4].append(_skeleton(meta["_metadata"], node["meta"], leaves, depth + 1))  # (after the items)
        return skel
    raise NoPlan()


def _pairs_skeleton(value: Any, kind: type, form: str, pairs: list, tree: Any, leaves: list, depth: int) -> tuple:
    keys = list(value)
    if [p[0] for p in pairs] != [_scalar_node(k) for k in keys] or any(type(k) not in (str, int) for k in keys):
        raise NoPlan()
    children = [_skeleton(value[k], p[1], leaves, depth + 1) for k, p in zip(keys, pairs)]
    return _container(kind, form, (keys, [type(k) for k in keys]), children, tree)


def _match(value: Any, skel: tuple, leaves: list) -> Any:
    """``_SAME`` when ``value`` matches ``skel`` with the same scalars, else its new tree node; raises NoPlan
    when the structure differs. Tensor leaves go to ``leaves``."""
    tag, kind = skel[0], skel[1]
    if type(value) is not kind:
        raise NoPlan()
    if tag == "t":
        leaves.append(value)
        return _SAME
    if tag == "s":
        old = skel[2]
        if value == old:  # (a float's sign too: -0.0 == 0.0 but they are written differently)
            return _SAME if kind is not float or math.copysign(1, value) == math.copysign(1, old) else value
        return _SAME if value != value and old != old else _scalar_node(value)
    form, keys, children, tree, leading = skel[2], skel[3], skel[4], skel[5], skel[6]
    if form == "dict":
        if list(value) != keys:
            raise NoPlan()
        items = list(value.values())
    elif form in ("pairs", "odict"):
        if list(value) != keys[0] or [type(k) for k in value] != keys[1]:
            raise NoPlan()
        items = list(value.values())
        if form == "odict":
            meta = vars(value)
            if len(meta) != len(children) - len(keys[0]) or set(meta) - {"_metadata"}:
                raise NoPlan()
            if meta:
                items.append(meta["_metadata"])
    else:
        if len(value) != len(children):
            raise NoPlan()
        items = value
    for v in items[:leading]:
        if type(v) is not torch.Tensor:
            raise NoPlan()
    leaves.extend(items[:leading])
    changed = None
    for i in range(leading, len(children)):
        node = _match(items[i], children[i], leaves)
        if node is not _SAME:
            changed = changed or {}
            changed[i] = node
    return _SAME if changed is None else _rebuild(form, keys, tree, changed)


def _rebuild(form: str, keys: Any, tree: Any, changed: dict[int, Any]) -> Any:
    """A copy of container node ``tree`` with the children at ``changed`` replaced (``tree`` is left as it is)."""
    if form == "dict":
        out = dict(tree)
        for i, node in changed.items():
            out[keys[i]] = node
        return out
    if form == "list":
        out = list(tree)
        for i, node in changed.items():
            out[i] = node
        return out
    if form == "tuple":
        items = list(tree["$tuple"])
        for i, node in changed.items():
            items[i] = node
        return {"$tuple": items}
    if form == "pairs":
        pairs = list(tree["$dict"])
        for i, node in changed.items():
            pairs[i] = [pairs[i][0], node]
        return {"$dict": pairs}
    inner = dict(tree["$odict"])
    pairs = list(inner["items"])
    for i, node in changed.items():
        if i == len(pairs):
            inner["meta"] = node
        else:
            pairs[i] = [pairs[i][0], node]
    inner["items"] = pairs
    return {"$odict": inner}


__all__ = ["EncodePlans"]
