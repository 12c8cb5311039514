"""RLlib state values <-> what rl_ckpt stores: the explicit conversion rules, and the live learner read as views.

Rules (``to_storable`` at save, ``from_stored`` at restore; both name the key path of what they refuse):

- a ``None`` dict key (RLlib's single-agent id, e.g. in ``MeanStdFilter``'s state) is stored as ``NONE_KEY``;
- an array RLlib keeps as text (base64 of zlib of a ``.npy`` file: ``MeanStdFilter``'s running statistics,
  a space's bounds) is decoded by rl_ckpt with ``allow_pickle=False`` and stored as a plain array
  (safetensors), ``{NPY_KEY: array}``; on restore RLlib gets text rl_ckpt re-encoded from that verified array.
  Text RLlib's decoder would hand to ``np.load`` that is not a plain array (an object dtype, a pickle stream)
  is refused at save and at restore: ``np.load(allow_pickle=True)``, which RLlib uses, would run it;
- a ``set`` of trainable policy ids is stored as a sorted list (``learner_value``).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import numpy as np

from rl_ckpt.errors import CorruptSnapshotError, SerializationError
from rl_ckpt._format.npy_payload import encode_npy, load_npy, npy_bytes

NONE_KEY = "rl_ckpt:None"
NPY_KEY = "rl_ckpt:npy"


def _leaf_types() -> tuple[frozenset, frozenset]:
    """Types that hold no key, no text and nothing to walk: returned as they are (the walks skip them fast). The
    immutable ones, then all of them (with arrays and tensors)."""
    import torch

    numpy_scalars = {np.dtype(c).type for c in "?bhilqBHILQefdgFD"}
    immutable = frozenset({int, float, bool, complex, bytes, type(None), *numpy_scalars})
    return immutable, immutable | {np.ndarray, torch.Tensor}


_IMMUTABLE, _LEAVES = _leaf_types()


def to_storable(tree: Any, path: str = "", *, component: str | None = None, detach: bool = False) -> Any:
    """``tree`` with every ``None`` dict key renamed ``NONE_KEY`` (the state codec stores str and int keys only)
    and every array RLlib keeps as ``.npy`` text replaced by ``{NPY_KEY: the plain array}``. Its containers are
    new ones; ``detach``: its arrays, tensors and bytearrays are copies too (a tree nothing RLlib does later
    changes: ``checkpoint_detached_state``).

    Raises:
        SerializationError: a dict holds both ``None`` and ``NONE_KEY`` as keys, a dict is ``{NPY_KEY: ...}``
            itself, or a text value hides what ``np.load`` would unpickle (naming the key path).
    """
    leaves = _IMMUTABLE if detach else _LEAVES
    if type(tree) in leaves:
        return tree
    if isinstance(tree, dict):
        if None in tree and NONE_KEY in tree:
            raise _refused(
                path,
                component,
                f"holds both None and {NONE_KEY!r} as keys: rl_ckpt stores a None key under that name; rename the "
                "other",
            )
        if len(tree) == 1 and NPY_KEY in tree:
            raise _refused(path, component, f"is a dict of the one key {NPY_KEY!r}, rl_ckpt's mark for an array")
        return {
            NONE_KEY if k is None else k: v
            if type(v) in leaves
            else to_storable(v, f"{path}/{k}", component=component, detach=detach)
            for k, v in tree.items()
        }
    if isinstance(tree, (list, tuple)):
        out = [
            v if type(v) in leaves else to_storable(v, f"{path}/{i}", component=component, detach=detach)
            for i, v in enumerate(tree)
        ]
        return out if isinstance(tree, list) else tuple(out)
    if isinstance(tree, str):
        try:
            array = _plain_array(tree)
        except ValueError as exc:
            raise _refused(path, component, f"is text RLlib would load with NumPy's loader, {exc}") from None
        return tree if array is None else {NPY_KEY: array}  # (a new array: decoded from the text)
    if detach:
        return _copy_of(tree)
    return tree


def _copy_of(value: Any) -> Any:
    """A copy of a mutable leaf (array, tensor, bytearray); any other value as it is (immutable, or a type the
    state codec refuses when it encodes the tree, naming its key)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, bytearray):
        return bytearray(value)
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def from_stored(tree: Any, path: str = "", *, component: str | None = None) -> Any:
    """The inverse of :func:`to_storable`: ``{NPY_KEY: array}`` becomes RLlib's text again, encoded here from the
    verified plain array. Text that RLlib's decoder would load (a snapshot written before this rule) is decoded
    here first, as a plain array, and re-encoded.

    Raises:
        CorruptSnapshotError: a mark holding no plain numeric array, or text hiding what ``np.load`` would
            unpickle (an object dtype, a pickle stream); naming the key path. Nothing is handed to RLlib.
    """
    if type(tree) in _LEAVES:
        return tree
    if isinstance(tree, dict):
        if len(tree) == 1 and NPY_KEY in tree:
            array = tree[NPY_KEY]
            if not isinstance(array, np.ndarray) or array.dtype.hasobject:
                raise _corrupt(path, component, f"{NPY_KEY!r} holds a {type(array).__name__}, not a numeric array")
            return encode_npy(array)
        return {
            None if k == NONE_KEY else k: v
            if type(v) in _LEAVES
            else from_stored(v, f"{path}/{k}", component=component)
            for k, v in tree.items()
        }
    if isinstance(tree, (list, tuple)):
        out = [
            v if type(v) in _LEAVES else from_stored(v, f"{path}/{i}", component=component) for i, v in enumerate(tree)
        ]
        return out if isinstance(tree, list) else tuple(out)
    if isinstance(tree, str):
        try:
            array = _plain_array(tree)
        except ValueError as exc:
            raise _corrupt(path, component, f"text RLlib would load with NumPy's loader is {exc}") from None
        return tree if array is None else encode_npy(array)
    return tree


def _plain_array(text: str) -> np.ndarray | None:
    """The plain array RLlib's decoder would make of ``text``; None for text it would not decode at all.
    ValueError (the reason) for anything ``np.load(allow_pickle=True)`` would unpickle."""
    data = npy_bytes(text)
    return None if data is None else load_npy(data)


def _where(path: str, component: str | None) -> str:
    key = path.lstrip("/") or "<root>"
    return f"component {component!r}, key {key!r}" if component else f"RLlib state key {key!r}"


def _refused(path: str, component: str | None, why: str) -> SerializationError:
    key = path.lstrip("/") or "<root>"
    return SerializationError(
        f"{_where(path, component)} {why}; nothing was saved",
        key=key,
        **({"component": component} if component else {}),
    )


def _corrupt(path: str, component: str | None, why: str) -> CorruptSnapshotError:
    key = path.lstrip("/") or "<root>"
    return CorruptSnapshotError(
        f"{_where(path, component)}: {why}; refusing the snapshot (nothing was handed to RLlib)",
        problems=[f"{key}: {why}"],
        key=key,
        component=component,
    )


def learner_value(key: str, value: Any) -> Any:
    """Trainable policy ids given as a set are stored as a sorted list (RLlib's ``policies_to_train`` takes either)."""
    if key == "should_module_be_updated" and isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return value


def plain_arrays(tree: Any) -> Any:
    """RLlib's ``convert_to_numpy`` without its copy: the same values (0-d tensors as Python numbers, other
    floats as float32 and the integers it narrows as int32, converted as it converts them), but an array
    already of that dtype is a view of the live tensor, not a copy. For a caller that copies what it keeps
    (staging, ``ray.put``) before training changes the tensors again.

    Dicts, OrderedDicts, lists and tuples (what state dicts are made of) are walked here; any other container is
    left to ``dm_tree.map_structure``, as RLlib does."""
    import torch

    def leaf(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            item = item.cpu().item() if item.dim() == 0 else item.detach().cpu().numpy()
        if isinstance(item, np.ndarray):
            kind = item.dtype.kind
            if kind == "f":
                return item if item.dtype == np.float32 else item.astype(np.float32)
            if item.dtype.type is np.int_:  # (``np.issubdtype(dtype, int)``: the platform's default int only)
                return item.astype(np.int32)
        return item

    def walk(item: Any) -> Any:
        kind = type(item)
        if kind is dict:
            return {k: walk(v) for k, v in item.items()}
        if kind is list:
            return [walk(v) for v in item]
        if kind is tuple:
            return tuple(walk(v) for v in item)
        if kind is collections.OrderedDict:
            return collections.OrderedDict((k, walk(v)) for k, v in item.items())
        if isinstance(item, (Mapping, list, tuple)):
            import tree as dm_tree

            return dm_tree.map_structure(leaf, item)
        return leaf(item)

    return walk(tree)


def module_weights(learner: Any, mid: str, *, inference_only: bool = False) -> dict:
    """What ``learner.module[mid].get_state(inference_only=...)`` returns, as views of the live weights
    (:func:`plain_arrays`) for a torch RLModule that keeps RLlib's ``get_state``; any other module's own."""
    from ray.rllib.core.rl_module.apis import InferenceOnlyAPI
    from ray.rllib.core.rl_module.torch.torch_rl_module import TorchRLModule

    module = learner.module[mid]
    if type(module).get_state is not TorchRLModule.get_state:
        return module.get_state(inference_only=inference_only)
    state = module.state_dict()
    if inference_only and not module.inference_only and isinstance(module, InferenceOnlyAPI):
        drop = module.get_non_inference_attributes()
        state = {
            k: v
            for k, v in state.items()
            if not any(k.startswith(a) and (len(k) == len(a) or k[len(a)] == ".") for a in drop)
        }
    return plain_arrays(state)


def optimizer_state(learner: Any) -> dict | None:
    """The learner's optimizer state as ``get_state`` gives it (``{<module id>_<name>: {"module_id", "state"}}``),
    as views of the live moments (:func:`plain_arrays`); None for a Learner that is not RLlib's torch one with
    its own ``get_state`` (its state then comes from ``get_state``)."""
    from ray.rllib.core import ALL_MODULES
    from ray.rllib.core.learner.learner import Learner
    from ray.rllib.core.learner.torch.torch_learner import TorchLearner

    if not isinstance(learner, TorchLearner) or type(learner).get_state is not Learner.get_state:
        return None
    out = {}
    for mid in [*learner.module.keys(), ALL_MODULES]:
        for name, optim in learner.get_optimizers_for_module(mid):
            out[f"{mid}_{name}"] = {"module_id": mid, "state": plain_arrays(optim.state_dict())}
    return out
