"""Split a component's ``state_dict`` into tensors, tables and JSON — and back.

Tensors and NumPy arrays go to safetensors, pyarrow tables to Arrow IPC, the
rest to JSON. The JSON tree keeps the structure; values that plain JSON cannot
carry exactly are tagged with a one-key object whose key starts with ``$``:

    {"$tensor": name}  {"$ndarray": name}  {"$table": name}
    {"$tuple": [...]}  {"$dict": [[key, value], ...]}  (non-str keys, or keys starting with "$")
    {"$float": "nan"|"inf"|"-inf"}  {"$np": [dtype, value]}  {"$bytes": base64}

and tags added later (files written before them never hold them; an older rl_ckpt refuses
them as unknown tags, so it skips such a snapshot rather than misreading it):

    {"$odict": {"items": [[key, value], ...], "meta": ...}}   OrderedDict (+ its ``_metadata``)
    {"$ddict": [factory, [[key, value], ...]]}                  defaultdict of a builtin factory
    {"$counter": [[key, value], ...]}                           collections.Counter (MultiStepLR milestones)
    {"$td": {"batch_size": [...], "device": str|None, "names": [...]?, "items": [[key, value], ...]}}
    {"$ntd": value}                                             non-tensor entry of a TensorDict
    {"$view": [name, offset, shape, stride]}                    tensor sharing storage with others
    {"$param": [tensor, requires_grad]}                         torch.nn.Parameter
    {"$c128": name}  {"$nd": [name, dtype]}                     complex128 / non-native-order arrays
    {"$size": [...]}  {"$device": str}  {"$dtype": str}  {"$complex": [re, im]}  {"$int": hex}
    {"$bytearray": base64}

Every value is kept with its exact type or refused at save time with a
:class:`SerializationError` naming the component and key: nothing is ever
pickled, and decoding never imports a class named in a file. Decoding
treats its input as hostile: anything malformed is a
:class:`CorruptSnapshotError` naming the file.

This module encodes; :mod:`rl_ckpt._format.state_decode` decodes (``decode_state``,
importable from here too).
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from rl_ckpt._format import safetensors_io
from rl_ckpt.errors import SerializationError
from rl_ckpt._format.state_decode import DEFAULTDICT_FACTORIES, MAX_DEPTH, NP_SCALAR_DTYPES, decode_state

__all__ = ["MAX_DEPTH", "EncodedState", "array_nbytes", "decode_state", "encode_state"]

_ALLOWED = (
    "tensors (torch.Tensor, nn.Parameter), NumPy arrays and scalars, pyarrow tables, TensorDicts, and plain data "
    "(str, int, float, complex, bool, None, bytes, bytearray, list, tuple, "
    "dict/OrderedDict/defaultdict/Counter with str/int keys, torch.Size, torch.device, torch.dtype)"
)
SMALL_INT_BITS = 64  # larger ints are stored as hex: exact in any JSON reader, and no 4300-digit limit
_CONTAINERS = (tuple, list, dict, collections.OrderedDict, collections.defaultdict, collections.Counter)


@dataclasses.dataclass
class EncodedState:
    """One component's state, split by storage kind."""

    tree: Any
    arrays: dict[str, Any] = dataclasses.field(default_factory=dict)  # name -> contiguous CPU tensor/ndarray
    tables: dict[str, Any] = dataclasses.field(default_factory=dict)  # name -> pyarrow.Table

    @property
    def nbytes(self) -> int:
        return sum(array_nbytes(a) for a in self.arrays.values()) + sum(int(t.nbytes) for t in self.tables.values())


def array_nbytes(a: Any) -> int:
    """Bytes of a tensor or ndarray's data."""
    return int(a.nbytes) if isinstance(a, np.ndarray) else a.numel() * a.element_size()


def _pyarrow():
    try:
        import pyarrow as pa
    except ImportError:  # pragma: no cover - a hard dependency
        return None
    return pa


def _tensordict_type(value: Any) -> Any:
    """``tensordict.TensorDict`` when ``value`` comes from that library (imported only then)."""
    if not type(value).__module__.startswith("tensordict"):
        return None
    import tensordict

    return tensordict


def _float_node(x: float) -> Any:
    if math.isfinite(x):
        return x
    return {"$float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}


def _int_node(x: int) -> Any:
    if x.bit_length() <= SMALL_INT_BITS:
        return x
    return {"$int": format(x, "x")}


def _extent(t: torch.Tensor) -> int:
    """One past the last storage element a (non-empty) tensor view touches."""
    return t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1


def encode_state(component: str, state: Any, *, host: bool = True) -> EncodedState:
    """Split ``state`` (what ``state_dict()`` returned) into an :class:`EncodedState`.

    ``host=True`` makes every tensor a contiguous CPU tensor (no copy when it
    already is one); ``host=False`` leaves tensors where they are, for a
    staging area that copies them into its own buffers anyway. Every refusal
    (type, dtype, nesting, cycle) happens here, at the ``save`` call, naming
    the component and key.
    """
    if not isinstance(state, Mapping):
        raise SerializationError(
            f"component {component!r}: state_dict() returned {type(state).__name__}, expected a dict",
            component=component,
            key="",
        )
    out = EncodedState(tree=None)
    pa = _pyarrow()
    tensors: list[tuple[tuple, torch.Tensor, dict]] = []  # filled in once every tensor is known (shared storage)
    active: set[int] = set()

    def name_for(path: tuple) -> str:
        base = "/".join(str(p) for p in path)
        name, i = base or "_", 1
        while name in out.arrays or name in out.tables:
            name, i = f"{base}#{i}", i + 1
        return name

    def pairs(mapping: Any, path: tuple, depth: int) -> list:
        result = []
        for k in list(mapping.keys()):
            if type(k) not in (str, int):
                raise _bad(component, path + (k,), k, "dict keys must be str or int")
            result.append([_int_node(k) if type(k) is int else k, enc(mapping[k], path + (k,), depth + 1)])
        return result

    def tensor(value: torch.Tensor, path: tuple) -> dict:
        if value.is_sparse or value.layout != torch.strided or value.is_quantized:
            raise _bad(component, path, value, "sparse/quantized tensors are not supported; convert to dense")
        if value.device.type == "meta":
            raise _bad(component, path, value, "a meta tensor has no data")
        if value.dtype != torch.complex128 and value.dtype not in safetensors_io.TORCH_TO_CODE:
            names = sorted(str(d).removeprefix("torch.") for d in safetensors_io.TORCH_TO_CODE)
            raise _bad(
                component,
                path,
                value,
                f"dtype {value.dtype} has no safetensors encoding; convert it "
                f"(supported: {', '.join(names)}, complex128)",
            )
        node: dict = {}
        tensors.append((path, value.detach(), node))
        return node

    def enc(value: Any, path: tuple, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise _bad(component, path, value, f"nested more than {MAX_DEPTH} levels deep")
        kind = type(value)
        if value is None or kind is bool or kind is str:
            return value
        if kind is int:
            return _int_node(value)
        if kind is float:
            return _float_node(value)
        if kind is complex:
            return {"$complex": [_float_node(value.real), _float_node(value.imag)]}
        if isinstance(value, np.generic):  # np.float64 subclasses float: kept as itself, not as a float
            if value.dtype.name not in NP_SCALAR_DTYPES or not value.dtype.isnative:
                raise _bad(component, path, value, "only numeric NumPy scalars are supported")
            item = value.item()
            if isinstance(item, complex):
                item = {"$complex": [_float_node(item.real), _float_node(item.imag)]}
            elif isinstance(item, float):
                item = _float_node(item)
            elif type(item) is int:
                item = _int_node(item)
            return {"$np": [value.dtype.name, item]}
        if kind is torch.Tensor:
            return tensor(value, path)
        if kind is torch.nn.Parameter:
            return {"$param": [tensor(value, path), bool(value.requires_grad)]}
        if kind is np.ndarray:
            if value.dtype.name not in safetensors_io.NUMPY_TO_CODE and value.dtype.name != "complex128":
                why = (
                    "object/string arrays go in a pyarrow.Table"
                    if value.dtype == object or value.dtype.kind in "USV"
                    else f"dtype {value.dtype} has no safetensors encoding; convert it"
                )
                raise _bad(component, path, value, why)
            arr = value
            if host and not arr.flags.c_contiguous:
                arr = arr.copy(order="C")  # not ascontiguousarray: that makes a 0-d array 1-d
            restore_as = None  # the dtype to convert back to, when what is stored differs
            if not arr.dtype.isnative and arr.dtype.itemsize > 1:
                restore_as = arr.dtype.str
                arr = arr.astype(arr.dtype.newbyteorder("="))
            if arr.dtype.name == "complex128":  # safetensors has no C128: float64 (real, imag) pairs
                restore_as = value.dtype.str
                arr = (
                    arr.view(np.float64).reshape(arr.shape + (2,))
                    if arr.flags.c_contiguous
                    else np.stack([arr.real, arr.imag], axis=-1)
                )
            name = name_for(path)
            out.arrays[name] = arr
            return {"$ndarray": name} if restore_as is None else {"$nd": [name, restore_as]}
        if kind in (bytes, bytearray):
            return {"$bytes" if kind is bytes else "$bytearray": base64.b64encode(bytes(value)).decode()}
        if pa is not None and kind in (pa.Table, pa.RecordBatch):
            name = name_for(path)
            out.tables[name] = value if kind is pa.Table else pa.Table.from_batches([value])
            return {"$table": name}
        if kind is torch.Size:
            return {"$size": [int(d) for d in value]}
        if kind is torch.device:
            return {"$device": str(value)}
        if kind is torch.dtype:
            return {"$dtype": str(value).removeprefix("torch.")}
        if kind in _CONTAINERS or _tensordict_type(value):
            if id(value) in active:
                raise _bad(component, path, value, "the value contains itself (a reference cycle)")
            active.add(id(value))
            try:
                return container(value, kind, path, depth)
            finally:
                active.discard(id(value))
        raise _bad(component, path, value, _hint(value))

    def container(value: Any, kind: type, path: tuple, depth: int) -> Any:
        if kind is tuple:
            return {"$tuple": [enc(v, path + (i,), depth + 1) for i, v in enumerate(value)]}
        if kind is list:
            return [enc(v, path + (i,), depth + 1) for i, v in enumerate(value)]
        if kind is dict:
            keys = list(value.keys())
            if all(type(k) is str and not k.startswith("$") for k in keys):
                return {k: enc(value[k], path + (k,), depth + 1) for k in keys}
            return {"$dict": pairs(value, path, depth)}
        if kind is collections.OrderedDict:
            extra = set(vars(value)) - {"_metadata"}
            if extra:
                raise _bad(
                    component, path, value, f"an OrderedDict with attributes {sorted(extra)} (only _metadata is kept)"
                )
            node: dict = {"items": pairs(value, path, depth)}
            if "_metadata" in vars(value):
                node["meta"] = enc(value._metadata, path + ("_metadata",), depth + 1)
            return {"$odict": node}
        if kind is collections.defaultdict:
            factory = value.default_factory
            name = getattr(factory, "__name__", None)
            if factory is not None and DEFAULTDICT_FACTORIES.get(name) is not factory:
                raise _bad(
                    component,
                    path,
                    value,
                    f"a defaultdict whose default_factory is {factory!r}: only None and "
                    f"{', '.join(sorted(DEFAULTDICT_FACTORIES))} can be restored without importing code; "
                    "convert it to a dict",
                )
            return {"$ddict": [name if factory is not None else None, pairs(value, path, depth)]}
        if kind is collections.Counter:
            return {"$counter": pairs(value, path, depth)}
        return tensordict(value, path, depth)

    def tensordict(value: Any, path: tuple, depth: int) -> Any:
        td = _tensordict_type(value)
        if type(value) is not td.TensorDict:
            raise _bad(
                component, path, value, "only plain tensordict.TensorDict is supported; convert with .to_tensordict()"
            )
        items = []
        for k, v in value.items():
            if type(v) is td.TensorDict or type(v) is torch.Tensor:
                items.append([k, enc(v, path + (k,), depth + 1)])
            elif type(v) is td.NonTensorData:
                items.append([k, {"$ntd": enc(v.data, path + (k,), depth + 1)}])
            else:
                raise _bad(
                    component, path + (k,), v, "a TensorDict entry must be a tensor, a TensorDict or non-tensor data"
                )
        node: dict = {
            "batch_size": [int(d) for d in value.batch_size],
            "device": None if value.device is None else str(value.device),
            "items": items,
        }
        names = value.names if value.batch_dims else []
        if any(n is not None for n in names):
            node["names"] = list(names)
        return {"$td": node}

    out.tree = enc(state, (), 0)
    _place_tensors(tensors, out, name_for, host)
    return out


def _place_tensors(tensors: list, out: EncodedState, name_for, host: bool) -> None:
    """Name each tensor and fill its node; tensors sharing storage are written once.

    Several names for one view (tied weights) share one stored tensor. Distinct
    views of one storage (slices of a buffer) store the span of the storage they
    cover, as ``torch.save`` does, and come back as views of it again.
    """
    groups: dict[tuple, list] = {}
    for entry in tensors:
        t = entry[1]
        if t.numel() == 0 or t.dtype == torch.complex128:
            groups[("own", id(entry))] = [entry]
        else:
            groups.setdefault((t.device, t.untyped_storage().data_ptr(), t.dtype), []).append(entry)
    for members in groups.values():
        first = members[0][1]
        views = {(t.storage_offset(), tuple(t.shape), t.stride()) for _, t, _ in members}
        if len(views) == 1:
            name = name_for(members[0][0])
            stored = first.resolve_conj().resolve_neg()  # a lazy conj()/neg() view holds the un-negated bytes
            if first.dtype == torch.complex128:
                stored = torch.view_as_real(stored)  # safetensors has no C128: stored as float64 pairs
            out.arrays[name] = stored.cpu().contiguous() if host else stored
            for _, _, node in members:
                node["$c128" if first.dtype == torch.complex128 else "$tensor"] = name
            continue
        lo = min(t.storage_offset() for _, t, _ in members)
        hi = max(_extent(t) for _, t, _ in members)
        name = name_for(members[0][0])
        span = torch.as_strided(first, (hi - lo,), (1,), lo).resolve_conj().resolve_neg()
        out.arrays[name] = span.cpu().contiguous() if host else span
        for _, t, node in members:
            node["$view"] = [name, t.storage_offset() - lo, list(t.shape), list(t.stride())]


def _hint(value: Any) -> str:
    import enum

    kind = type(value)
    if isinstance(value, enum.Enum):
        return (
            f"an enum member ({kind.__qualname__}.{value.name}): store its .value or .name and rebuild the enum "
            "in load_state_dict (rl_ckpt never imports a class named in a file)"
        )
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return f"a namedtuple ({kind.__qualname__}): store value._asdict() and rebuild it in load_state_dict"
    if isinstance(value, (set, frozenset)):
        return "a set: store sorted(value) as a list"
    for base in (str, int, float, list, tuple, dict, bytes, np.ndarray, torch.Tensor):
        if isinstance(value, base):
            return (
                f"a {kind.__module__}.{kind.__qualname__} (a subclass of {base.__name__}) "
                f"would come back as a plain {base.__name__}; convert it to one"
            )
    if isinstance(value, Mapping):
        return f"a {kind.__module__}.{kind.__qualname__} mapping would come back as a dict; convert it to dict(value)"
    return f"a {kind.__module__}.{kind.__qualname__} fits none of: {_ALLOWED}"


def _bad(component: str, path: tuple, value: Any, why: str) -> SerializationError:
    key = "/".join(str(p) for p in path) or "<root>"
    reason = why or _hint(value)
    return SerializationError(
        f"component {component!r}, key {key!r}: cannot save value: {reason}. "
        "Return only supported values from state_dict(); nothing is pickled.",
        component=component,
        key=key,
    )
