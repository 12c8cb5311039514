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
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from rl_ckpt.format import safetensors_io
from rl_ckpt.errors import CheckpointError, CorruptSnapshotError, SerializationError

_ALLOWED = (
    "tensors (torch.Tensor, nn.Parameter), NumPy arrays and scalars, pyarrow tables, TensorDicts, and plain data "
    "(str, int, float, complex, bool, None, bytes, bytearray, list, tuple, dict/OrderedDict/defaultdict/Counter with str/int "
    "keys, torch.Size, torch.device, torch.dtype)"
)
MAX_DEPTH = 100  # real state dicts nest < 20 deep; the limit keeps hostile files off Python's recursion limit
MAX_INT_HEX_DIGITS = 1 << 20  # $int: 4 Mbit, far above any real counter or RNG state
SMALL_INT_BITS = 64  # larger ints are stored as hex: exact in any JSON reader, and no 4300-digit limit

# defaultdict factories that can be rebuilt without importing anything.
_FACTORIES: dict[str, Any] = {f.__name__: f for f in (list, dict, set, frozenset, int, float, complex, str, bytes, bool, tuple)}
_FACTORIES["OrderedDict"] = collections.OrderedDict
_CONTAINERS = (tuple, list, dict, collections.OrderedDict, collections.defaultdict, collections.Counter)
_NP_SCALARS = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
               "float16", "float32", "float64", "complex64", "complex128"}
_HEX = re.compile(r"-?[0-9a-f]+")
# vars(), not getattr(): torch's module __getattr__ imports submodules by name, and a name read from a file
# must never import anything.
_TORCH_DTYPES = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}


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
            component=component, key="",
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
            raise _bad(component, path, value, f"dtype {value.dtype} has no safetensors encoding; convert it "
                       f"(supported: {', '.join(names)}, complex128)")
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
            if value.dtype.name not in _NP_SCALARS or not value.dtype.isnative:
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
                why = ("object/string arrays go in a pyarrow.Table" if value.dtype == object or value.dtype.kind in "USV"
                       else f"dtype {value.dtype} has no safetensors encoding; convert it")
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
                arr = (arr.view(np.float64).reshape(arr.shape + (2,)) if arr.flags.c_contiguous
                       else np.stack([arr.real, arr.imag], axis=-1))
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
                raise _bad(component, path, value, f"an OrderedDict with attributes {sorted(extra)} (only _metadata is kept)")
            node: dict = {"items": pairs(value, path, depth)}
            if "_metadata" in vars(value):
                node["meta"] = enc(value._metadata, path + ("_metadata",), depth + 1)
            return {"$odict": node}
        if kind is collections.defaultdict:
            factory = value.default_factory
            name = getattr(factory, "__name__", None)
            if factory is not None and _FACTORIES.get(name) is not factory:
                raise _bad(component, path, value, f"a defaultdict whose default_factory is {factory!r}: only None and "
                           f"{', '.join(sorted(_FACTORIES))} can be restored without importing code; convert it to a dict")
            return {"$ddict": [name if factory is not None else None, pairs(value, path, depth)]}
        if kind is collections.Counter:
            return {"$counter": pairs(value, path, depth)}
        return tensordict(value, path, depth)

    def tensordict(value: Any, path: tuple, depth: int) -> Any:
        td = _tensordict_type(value)
        if type(value) is not td.TensorDict:
            raise _bad(component, path, value, "only plain tensordict.TensorDict is supported; convert with "
                       ".to_tensordict()")
        items = []
        for k, v in value.items():
            if type(v) is td.TensorDict or type(v) is torch.Tensor:
                items.append([k, enc(v, path + (k,), depth + 1)])
            elif type(v) is td.NonTensorData:
                items.append([k, {"$ntd": enc(v.data, path + (k,), depth + 1)}])
            else:
                raise _bad(component, path + (k,), v, "a TensorDict entry must be a tensor, a TensorDict or "
                           "non-tensor data")
        node: dict = {"batch_size": [int(d) for d in value.batch_size],
                      "device": None if value.device is None else str(value.device), "items": items}
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
        return (f"an enum member ({kind.__qualname__}.{value.name}): store its .value or .name and rebuild the enum "
                "in load_state_dict (rl_ckpt never imports a class named in a file)")
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return f"a namedtuple ({kind.__qualname__}): store value._asdict() and rebuild it in load_state_dict"
    if isinstance(value, (set, frozenset)):
        return "a set: store sorted(value) as a list"
    for base in (str, int, float, list, tuple, dict, bytes, np.ndarray, torch.Tensor):
        if isinstance(value, base):
            return (f"a {kind.__module__}.{kind.__qualname__} (a subclass of {base.__name__}) would come back as a plain "
                    f"{base.__name__}; convert it to one")
    if isinstance(value, Mapping):
        return f"a {kind.__module__}.{kind.__qualname__} mapping would come back as a dict; convert it to dict(value)"
    return f"a {kind.__module__}.{kind.__qualname__} fits none of: {_ALLOWED}"


def _bad(component: str, path: tuple, value: Any, why: str) -> SerializationError:
    key = "/".join(str(p) for p in path) or "<root>"
    reason = why or _hint(value)
    return SerializationError(
        f"component {component!r}, key {key!r}: cannot save value: {reason}. "
        "Return only supported values from state_dict(); nothing is pickled.",
        component=component, key=key,
    )


def decode_state(tree: Any, arrays: Mapping[str, Any], tables: Mapping[str, Any], *, where: str = "") -> Any:
    """Rebuild a state dict from its JSON tree and loaded arrays/tables.

    ``arrays`` maps name -> ``torch.Tensor`` or ``np.ndarray`` per the tag.
    Any malformed input raises :class:`CorruptSnapshotError` naming ``where``.
    """
    try:
        return _Decoder(arrays, tables, where).dec(tree, 0)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a crafted file provokes in json/numpy/torch/tensordict
        msg = f"cannot decode the state ({type(exc).__name__}: {exc})"
        raise CorruptSnapshotError(f"{where}: {msg}", problems=[msg], path=where) from None


class _Decoder:
    def __init__(self, arrays: Mapping[str, Any], tables: Mapping[str, Any], where: str) -> None:
        self.arrays, self.tables, self.where = arrays, tables, where

    def fail(self, msg: str) -> CorruptSnapshotError:
        return CorruptSnapshotError(f"{self.where}: {msg}", problems=[msg], path=self.where)

    def stored(self, tag: str, val: Any, src: Mapping[str, Any]) -> Any:
        if not isinstance(val, str) or val not in src:
            raise self.fail(f"JSON names {tag[1:]} {val!r}, which is not in the snapshot")
        return src[val]

    def tensor(self, tag: str, val: Any) -> torch.Tensor:
        got = self.stored(tag, val, self.arrays)
        return torch.from_numpy(got) if isinstance(got, np.ndarray) else got

    def ints(self, val: Any, what: str) -> list[int]:
        if not isinstance(val, list) or not all(type(v) is int and 0 <= v < 1 << 62 for v in val):
            raise self.fail(f"{what} must be a list of non-negative integers")
        return val

    def pairs(self, val: Any, depth: int) -> list:
        if not isinstance(val, list) or not all(isinstance(p, list) and len(p) == 2 for p in val):
            raise self.fail("a mapping must hold [key, value] pairs")
        out = []
        for k, v in val:
            k = self.dec(k, depth + 1) if isinstance(k, dict) else k
            if type(k) not in (str, int):
                raise self.fail(f"a mapping key must be str or int, not {type(k).__name__}")
            out.append((k, self.dec(v, depth + 1)))
        return out

    def dec(self, node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise self.fail(f"the state is nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, list):
            return [self.dec(v, depth + 1) for v in node]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            (tag, val), = node.items()
            if tag.startswith("$"):
                return self.tagged(tag, val, depth)
        return {k: self.dec(v, depth + 1) for k, v in node.items()}

    def tagged(self, tag: str, val: Any, depth: int) -> Any:
        if tag == "$tensor":
            return self.tensor(tag, val)
        if tag == "$ndarray":
            got = self.stored(tag, val, self.arrays)
            return got.numpy() if isinstance(got, torch.Tensor) else got
        if tag == "$table":
            return self.stored(tag, val, self.tables)
        if tag == "$tuple":
            if not isinstance(val, list):
                raise self.fail("$tuple must hold a list")
            return tuple(self.dec(v, depth + 1) for v in val)
        if tag == "$dict":
            return dict(self.pairs(val, depth))
        if tag == "$float":
            if val not in ("nan", "inf", "-inf"):
                raise self.fail(f"bad $float {val!r}")
            return float(val)
        if tag == "$int":
            if not isinstance(val, str) or len(val) > MAX_INT_HEX_DIGITS or not _HEX.fullmatch(val):
                raise self.fail("$int must hold a hex string")
            return int(val, 16)
        if tag == "$complex":
            if not (isinstance(val, list) and len(val) == 2):
                raise self.fail("$complex must hold [real, imag]")
            re_, im = (self.dec(v, depth + 1) for v in val)
            if not all(type(x) in (int, float) for x in (re_, im)):
                raise self.fail("$complex parts must be numbers")
            return complex(re_, im)
        if tag == "$np":
            return self.np_scalar(val, depth)
        if tag in ("$bytes", "$bytearray"):
            if not isinstance(val, str):
                raise self.fail(f"{tag} must hold base64 text")
            try:
                raw = base64.b64decode(val, validate=True)
            except (ValueError, TypeError):
                raise self.fail(f"bad base64 in {tag}") from None
            return raw if tag == "$bytes" else bytearray(raw)
        if tag == "$odict":
            if not isinstance(val, dict) or not set(val) <= {"items", "meta"} or "items" not in val:
                raise self.fail("$odict must hold {items, meta?}")
            od = collections.OrderedDict(self.pairs(val["items"], depth))
            if "meta" in val:
                od._metadata = self.dec(val["meta"], depth + 1)
            return od
        if tag == "$ddict":
            if not (isinstance(val, list) and len(val) == 2) or not (val[0] is None or (isinstance(val[0], str)
                                                                                       and val[0] in _FACTORIES)):
                raise self.fail(f"$ddict must hold [factory, pairs] with a factory among {sorted(_FACTORIES)}")
            return collections.defaultdict(_FACTORIES[val[0]] if val[0] else None, self.pairs(val[1], depth))
        if tag == "$counter":
            return collections.Counter(dict(self.pairs(val, depth)))
        if tag == "$size":
            return torch.Size(self.ints(val, "$size"))
        if tag == "$device":
            if not isinstance(val, str) or len(val) > 64:
                raise self.fail("$device must hold a device name")
            return torch.device(val)
        if tag == "$dtype":
            dtype = _TORCH_DTYPES.get(val) if isinstance(val, str) else None
            if dtype is None:
                raise self.fail(f"unknown torch dtype {val!r}")
            return dtype
        if tag == "$param":
            if not (isinstance(val, list) and len(val) == 2 and isinstance(val[1], bool)):
                raise self.fail("$param must hold [tensor, requires_grad]")
            t = self.dec(val[0], depth + 1)
            if type(t) is not torch.Tensor:
                raise self.fail("$param must hold a tensor")
            return torch.nn.Parameter(t, requires_grad=val[1])
        if tag == "$view":
            return self.view(val)
        if tag == "$c128":
            t = self.tensor(tag, val)
            if t.dtype != torch.float64 or t.dim() == 0 or t.shape[-1] != 2:
                raise self.fail("$c128 must name a float64 tensor of [..., 2]")
            return torch.view_as_complex(t.contiguous())
        if tag == "$nd":
            return self.ndarray(val)
        if tag == "$td":
            return self.tensordict(val, depth)
        raise self.fail(f"unknown tag {tag!r}")

    def np_scalar(self, val: Any, depth: int) -> Any:
        if not (isinstance(val, list) and len(val) == 2 and isinstance(val[0], str)):
            raise self.fail("$np must hold [dtype, value]")
        if val[0] not in _NP_SCALARS:
            raise self.fail(f"NumPy scalar dtype {val[0]!r} is not a supported numeric type")
        dtype = np.dtype(val[0])
        inner = self.dec(val[1], depth + 1)
        ok = {"b": (bool,), "i": (int,), "u": (int,), "f": (int, float), "c": (int, float, complex)}[dtype.kind]
        if type(inner) not in ok:
            raise self.fail(f"$np {val[0]} holds a {type(inner).__name__}")
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            if not info.min <= inner <= info.max:
                raise self.fail(f"$np {val[0]} value {inner} is out of range")
        try:
            with np.errstate(over="raise", invalid="raise"):
                return dtype.type(inner)
        except (FloatingPointError, OverflowError):
            raise self.fail(f"$np {val[0]} value {inner!r:.40} is out of range") from None

    def view(self, val: Any) -> torch.Tensor:
        if not (isinstance(val, list) and len(val) == 4):
            raise self.fail("$view must hold [name, offset, shape, stride]")
        base = self.tensor("$view", val[0])
        offset = self.ints([val[1]], "$view offset")[0]
        shape, stride = self.ints(val[2], "$view shape"), self.ints(val[3], "$view stride")
        if base.dim() != 1 or len(shape) != len(stride):
            raise self.fail("$view needs a 1-d stored tensor and one stride per dimension")
        if math.prod(shape) and offset + sum((n - 1) * s for n, s in zip(shape, stride)) >= base.numel():
            raise self.fail(f"$view of {val[0]!r} runs past its {base.numel()} stored elements")
        return torch.as_strided(base, shape, stride, base.storage_offset() + offset)

    def ndarray(self, val: Any) -> np.ndarray:
        if not (isinstance(val, list) and len(val) == 2 and isinstance(val[1], str)):
            raise self.fail("$nd must hold [name, dtype]")
        got = self.stored("$nd", val[0], self.arrays)
        arr = got.numpy() if isinstance(got, torch.Tensor) else got
        try:
            dtype = np.dtype(val[1]) if re.fullmatch(r"[<>=|][biufc][1-9][0-9]?", val[1]) else None
        except TypeError:
            dtype = None
        if dtype is None:
            raise self.fail(f"$nd dtype {val[1]!r} is not a numeric array type")
        if dtype.kind == "c" and dtype.itemsize == 16:
            if arr.dtype != np.float64 or arr.ndim == 0 or arr.shape[-1] != 2:
                raise self.fail("a complex128 array must be stored as float64 [..., 2]")
            arr = np.ascontiguousarray(arr).view(np.complex128)[..., 0]
        if arr.dtype.newbyteorder("=") != dtype.newbyteorder("="):
            raise self.fail(f"$nd dtype {val[1]} does not match the stored {arr.dtype}")
        return arr.astype(dtype)

    def tensordict(self, val: Any, depth: int) -> Any:
        if not isinstance(val, dict) or not {"batch_size", "device", "items"} <= set(val) <= {
                "batch_size", "device", "items", "names"}:
            raise self.fail("$td must hold {batch_size, device, items, names?}")
        import tensordict

        batch = self.ints(val["batch_size"], "$td batch_size")
        device = val["device"]
        if device is not None and not (isinstance(device, str) and len(device) <= 64):
            raise self.fail("$td device must be a device name or null")
        names = val.get("names")
        if names is not None and not (isinstance(names, list) and len(names) == len(batch)
                                      and all(n is None or isinstance(n, str) for n in names)):
            raise self.fail("$td names must be one str/null per batch dimension")
        if not isinstance(val["items"], list) or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                                         for p in val["items"]):
            raise self.fail("$td items must be [str key, value] pairs")
        tensors, others = {}, {}
        for k, v in val["items"]:
            if isinstance(v, dict) and len(v) == 1 and "$ntd" in v:
                others[k] = self.dec(v["$ntd"], depth + 1)
                continue
            got = self.dec(v, depth + 1)
            if not isinstance(got, (torch.Tensor, tensordict.TensorDict)):
                raise self.fail(f"$td entry {k!r} is neither a tensor nor a TensorDict")
            tensors[k] = got
        td = tensordict.TensorDict(tensors, batch_size=batch, device=device, names=names)
        for k, v in others.items():
            td.set_non_tensor(k, v)
        return td
