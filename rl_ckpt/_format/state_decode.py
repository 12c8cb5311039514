"""Rebuild a state dict from the JSON tree, arrays and tables :mod:`rl_ckpt._format.state_codec` wrote.

The tags are listed in :mod:`rl_ckpt._format.state_codec`. The input is treated as hostile: depth,
sizes and ranges are checked, nothing is imported by a name read from a file, and anything malformed
is a :class:`CorruptSnapshotError` naming the file.
"""

from __future__ import annotations

import base64
import collections
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from rl_ckpt.errors import CheckpointError, CorruptSnapshotError

MAX_DEPTH = 100  # real state dicts nest < 20 deep; the limit keeps hostile files off Python's recursion limit
MAX_INT_HEX_DIGITS = 1 << 20  # $int: 4 Mbit, far above any real counter or RNG state

# defaultdict factories that can be rebuilt without importing anything (the encoder refuses any other).
DEFAULTDICT_FACTORIES: dict[str, Any] = {
    f.__name__: f for f in (list, dict, set, frozenset, int, float, complex, str, bytes, bool, tuple)
}
DEFAULTDICT_FACTORIES["OrderedDict"] = collections.OrderedDict
# NumPy scalar types kept as themselves ({"$np": [dtype, value]}).
NP_SCALAR_DTYPES = {
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
}
_HEX = re.compile(r"-?[0-9a-f]+")
# vars(), not getattr(): torch's module __getattr__ imports submodules by name, and a name read from a file
# must never import anything.
_TORCH_DTYPES = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}


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


def tensor_refs(tree: Any, *, ndarrays: bool = False) -> list[tuple[tuple, str]]:
    """``(path, name)`` of each whole stored tensor (``{"$tensor": name}``; with ``ndarrays``, each NumPy array
    ``{"$ndarray": name}`` too, which ``decode_state`` makes a view of its stored tensor) in ``tree``: the keys and
    indexes that lead to it in the state ``decode_state`` rebuilds (a ``$param``'s tensor counts at the parameter's
    place).
    Nothing is decoded or trusted here: parts that are not plain containers of such tensors are passed over, and
    ``decode_state`` judges the whole tree as always."""
    out: list[tuple[tuple, str]] = []

    def pairs(val: Any, path: tuple, depth: int) -> None:
        for pair in val if isinstance(val, list) else ():
            if isinstance(pair, list) and len(pair) == 2 and type(pair[0]) in (str, int):
                walk(pair[1], (*path, pair[0]), depth + 1)

    def walk(node: Any, path: tuple, depth: int) -> None:
        if depth > MAX_DEPTH:
            return
        if isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, (*path, i), depth + 1)
            return
        if not isinstance(node, dict):
            return
        if len(node) == 1:
            ((tag, val),) = node.items()
            if tag.startswith("$"):
                if (tag == "$tensor" or (ndarrays and tag == "$ndarray")) and isinstance(val, str):
                    out.append((path, val))
                elif tag == "$param" and isinstance(val, list) and len(val) == 2:
                    walk(val[0], path, depth + 1)
                elif tag == "$tuple" and isinstance(val, list):
                    walk(val, path, depth)
                elif tag in ("$dict", "$counter"):
                    pairs(val, path, depth)
                elif tag == "$odict" and isinstance(val, dict):
                    pairs(val.get("items"), path, depth)
                elif tag == "$ddict" and isinstance(val, list) and len(val) == 2:
                    pairs(val[1], path, depth)
                return
        for k, v in node.items():
            walk(v, (*path, k), depth + 1)

    walk(tree, (), 0)
    return out


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
            ((tag, val),) = node.items()
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
            if not (isinstance(val, list) and len(val) == 2) or not (
                val[0] is None or (isinstance(val[0], str) and val[0] in DEFAULTDICT_FACTORIES)
            ):
                raise self.fail(
                    f"$ddict must hold [factory, pairs] with a factory among {sorted(DEFAULTDICT_FACTORIES)}"
                )
            return collections.defaultdict(DEFAULTDICT_FACTORIES[val[0]] if val[0] else None, self.pairs(val[1], depth))
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
        if val[0] not in NP_SCALAR_DTYPES:
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
            "batch_size",
            "device",
            "items",
            "names",
        }:
            raise self.fail("$td must hold {batch_size, device, items, names?}")
        import tensordict

        batch = self.ints(val["batch_size"], "$td batch_size")
        device = val["device"]
        if device is not None and not (isinstance(device, str) and len(device) <= 64):
            raise self.fail("$td device must be a device name or null")
        names = val.get("names")
        if names is not None and not (
            isinstance(names, list) and len(names) == len(batch) and all(n is None or isinstance(n, str) for n in names)
        ):
            raise self.fail("$td names must be one str/null per batch dimension")
        if not isinstance(val["items"], list) or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in val["items"]
        ):
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
