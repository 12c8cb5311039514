"""Split a component's ``state_dict`` into tensors, tables and JSON — and back.

Tensors and NumPy arrays go to safetensors, pyarrow tables to Arrow IPC, the
rest to JSON. The JSON tree keeps the structure; values that plain JSON cannot
carry exactly are tagged with a one-key object whose key starts with ``$``:

    {"$tensor": name}  {"$ndarray": name}  {"$table": name}
    {"$tuple": [...]}  {"$dict": [[key, value], ...]}  (non-str keys, or keys starting with "$")
    {"$float": "nan"|"inf"|"-inf"}  {"$np": [dtype, value]}  {"$bytes": base64}

Anything else is a :class:`SerializationError` naming the component and key:
nothing is ever pickled.
"""

from __future__ import annotations

import base64
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .errors import SerializationError

_ALLOWED = (
    "tensors (torch.Tensor), NumPy arrays, pyarrow tables, and plain data "
    "(str, int, float, bool, None, bytes, list, tuple, dict with str/int keys)"
)


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


def encode_state(component: str, state: Any, *, host: bool = True) -> EncodedState:
    """Split ``state`` (what ``state_dict()`` returned) into an :class:`EncodedState`.

    ``host=True`` makes every tensor a contiguous CPU tensor (no copy when it
    already is one); ``host=False`` leaves tensors where they are, for a
    staging area that copies them into its own buffers anyway.
    """
    if not isinstance(state, Mapping):
        raise SerializationError(
            f"component {component!r}: state_dict() returned {type(state).__name__}, expected a dict",
            component=component, key="",
        )
    out = EncodedState(tree=None)
    pa = _pyarrow()

    def name_for(path: tuple) -> str:
        base = "/".join(str(p) for p in path)
        name, i = base or "_", 1
        while name in out.arrays or name in out.tables:
            name, i = f"{base}#{i}", i + 1
        return name

    def enc(value: Any, path: tuple) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return value
        if isinstance(value, float):
            if math.isfinite(value):
                return value
            return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
        if isinstance(value, torch.Tensor):
            if value.is_sparse or value.layout != torch.strided or value.is_quantized:
                raise _bad(component, path, value, "sparse/quantized tensors are not supported; convert to dense")
            if value.device.type == "meta":
                raise _bad(component, path, value, "a meta tensor has no data")
            name = name_for(path)
            out.arrays[name] = value.detach().cpu().contiguous() if host else value.detach()
            return {"$tensor": name}
        if isinstance(value, np.ndarray):
            if value.dtype == object or value.dtype.kind in "USV":
                raise _bad(component, path, value, "object/string arrays go in a pyarrow.Table")
            name = name_for(path)
            arr = value if not host else np.ascontiguousarray(value)
            if not arr.dtype.isnative and arr.dtype.itemsize > 1:
                arr = arr.astype(arr.dtype.newbyteorder("="))
            out.arrays[name] = arr
            return {"$ndarray": name}
        if isinstance(value, np.generic):
            if value.dtype == object or value.dtype.kind in "USVcmM":
                raise _bad(component, path, value, "only numeric NumPy scalars are supported")
            item = value.item()
            if isinstance(item, float) and not math.isfinite(item):
                item = {"$float": "nan" if math.isnan(item) else ("inf" if item > 0 else "-inf")}
            return {"$np": [value.dtype.name, item]}
        if isinstance(value, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(value)).decode()}
        if pa is not None and isinstance(value, (pa.Table, pa.RecordBatch)):
            name = name_for(path)
            out.tables[name] = value if isinstance(value, pa.Table) else pa.Table.from_batches([value])
            return {"$table": name}
        if isinstance(value, tuple):
            return {"$tuple": [enc(v, path + (i,)) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [enc(v, path + (i,)) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            keys = list(value.keys())
            for k in keys:
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise _bad(component, path + (k,), k, "dict keys must be str or int")
            if all(isinstance(k, str) and not k.startswith("$") for k in keys):
                return {k: enc(value[k], path + (k,)) for k in keys}
            return {"$dict": [[k, enc(value[k], path + (k,))] for k in keys]}
        raise _bad(component, path, value, "")

    out.tree = enc(state, ())
    return out


def _bad(component: str, path: tuple, value: Any, why: str) -> SerializationError:
    key = "/".join(str(p) for p in path) or "<root>"
    reason = why or f"a {type(value).__module__}.{type(value).__qualname__} fits none of: {_ALLOWED}"
    return SerializationError(
        f"component {component!r}, key {key!r}: cannot save value: {reason}. "
        "Return only such values from state_dict() (e.g. convert objects to dicts); nothing is pickled.",
        component=component, key=key,
    )


def decode_state(tree: Any, arrays: Mapping[str, Any], tables: Mapping[str, Any], *, where: str = "") -> Any:
    """Rebuild a state dict from its JSON tree and loaded arrays/tables.

    ``arrays`` maps name -> ``torch.Tensor`` or ``np.ndarray`` per the tag.
    """
    from .errors import CorruptSnapshotError

    def fail(msg: str):
        return CorruptSnapshotError(f"{where}: {msg}", problems=[msg], path=where)

    def dec(node: Any) -> Any:
        if isinstance(node, list):
            return [dec(v) for v in node]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            (tag, val), = node.items()
            if tag in ("$tensor", "$ndarray", "$table"):
                src = tables if tag == "$table" else arrays
                if not isinstance(val, str) or val not in src:
                    raise fail(f"JSON names {tag[1:]} {val!r}, which is not in the snapshot")
                got = src[val]
                if tag == "$ndarray" and isinstance(got, torch.Tensor):
                    got = got.numpy()
                if tag == "$tensor" and isinstance(got, np.ndarray):
                    got = torch.from_numpy(got)
                return got
            if tag == "$tuple":
                if not isinstance(val, list):
                    raise fail("$tuple must hold a list")
                return tuple(dec(v) for v in val)
            if tag == "$dict":
                if not isinstance(val, list) or not all(isinstance(p, list) and len(p) == 2 for p in val):
                    raise fail("$dict must hold [key, value] pairs")
                return {k: dec(v) for k, v in val}
            if tag == "$float":
                if val not in ("nan", "inf", "-inf"):
                    raise fail(f"bad $float {val!r}")
                return float(val)
            if tag == "$np":
                if not (isinstance(val, list) and len(val) == 2 and isinstance(val[0], str)):
                    raise fail("$np must hold [dtype, value]")
                try:
                    dtype = np.dtype(val[0])
                except TypeError:
                    raise fail(f"unknown NumPy dtype {val[0]!r}") from None
                if dtype.kind not in "biuf":
                    raise fail(f"NumPy scalar dtype {val[0]!r} is not numeric")
                inner = dec(val[1])
                return dtype.type(inner)
            if tag == "$bytes":
                try:
                    return base64.b64decode(val, validate=True)
                except (ValueError, TypeError):
                    raise fail("bad base64 in $bytes") from None
            if tag.startswith("$"):
                raise fail(f"unknown tag {tag!r}")
        return {k: dec(v) for k, v in node.items()}

    return dec(tree)
