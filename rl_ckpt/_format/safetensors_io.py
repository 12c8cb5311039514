"""The safetensors format, written as a stream and read with strict checks.

We write the format ourselves (it is small: 8-byte header length, a JSON
header, then the raw tensor bytes) so tensors stream to storage straight from
their memory without first building one big ``bytes``, and so the header is
validated before a single tensor is made. Files are plain safetensors:
``safetensors.torch.load_file`` reads them (see ``rl-ckpt export``).
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from typing import Iterator

import numpy as np
import torch

from rl_ckpt.errors import CorruptSnapshotError, SerializationError
from rl_ckpt._format.dtypes import CODE_TO_NUMPY, ITEMSIZE, MAX_NUMEL, NUMPY_TO_CODE, check_shape  # noqa: F401

MAX_HEADER_BYTES = 100 * 1024 * 1024  # same limit as the safetensors library
ALIGN = 64  # torch's CPU allocator aligns this much; BLAS and SIMD kernels split work by it

TORCH_TO_CODE = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
CODE_TO_TORCH = {v: k for k, v in TORCH_TO_CODE.items()}


def array_code(value) -> str:
    """The safetensors dtype code of a tensor or ndarray (SerializationError if none)."""
    if isinstance(value, torch.Tensor):
        code = TORCH_TO_CODE.get(value.dtype)
    else:
        code = NUMPY_TO_CODE.get(value.dtype.name) if value.dtype.isnative or value.dtype.itemsize == 1 else None
    if code is None:
        raise SerializationError(f"dtype {value.dtype} has no safetensors encoding", dtype=str(value.dtype))
    return code


def byte_view(value) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor or ndarray."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return memoryview(b"")
        return memoryview(value.reshape(-1).view(torch.uint8).numpy()).cast("B")
    return memoryview(np.ascontiguousarray(value).reshape(-1).view(np.uint8)).cast("B")


def encode(arrays: dict, metadata: dict[str, str] | None = None) -> tuple[list, dict]:
    """Chunks of a safetensors file for ``arrays`` (name -> contiguous CPU tensor/ndarray).

    Returns ``(chunks, tensor_meta)``; ``tensor_meta`` maps name -> {dtype, shape}.
    The data starts ``ALIGN``-byte aligned and tensors whose size is a multiple of ``ALIGN`` come first,
    so each of them lies at an ``ALIGN``-aligned offset (read into an aligned buffer, it is used where it
    lies: see ``rl_ckpt._core.reader.load_component``); the rest follow largest item size first, so each
    stays aligned to its item size.
    """
    order = sorted(
        arrays, key=lambda n: (byte_view(arrays[n]).nbytes % ALIGN != 0, -ITEMSIZE[array_code(arrays[n])], n)
    )
    header: dict = {}
    meta: dict = {}
    views = []
    offset = 0
    for name in order:
        value = arrays[name]
        code = array_code(value)
        view = byte_view(value)
        shape = list(value.shape)
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + view.nbytes]}
        meta[name] = {"dtype": code, "shape": shape}
        offset += view.nbytes
        views.append(view)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(len(blob) + 8) % ALIGN)  # data starts aligned (the library pads to 8; spaces are allowed)
    return [struct.pack("<Q", len(blob)) + blob, *views], meta


def planned_layout(meta: dict, file_size: int) -> dict[str, tuple[int, int]] | None:
    """Where :func:`encode` puts each tensor of ``meta`` (name -> ``{dtype, shape}``, as a manifest lists a file's
    tensors) in a file of ``file_size`` bytes: name -> (start, end) offsets in the file (the header before the
    first). None when ``meta`` cannot describe such a file (an unknown dtype, a bad shape, more data than the file).

    Nothing of the file is read: a reader places the tensors' bytes from it (``Storage.read_into``), and once the
    file matched its checksum, :func:`decode` of its header must agree with this layout before anything is used.
    """
    sizes = {}
    for name, m in meta.items():
        code, shape = (m.get("dtype"), m.get("shape")) if isinstance(m, dict) else (None, None)
        if code not in ITEMSIZE or check_shape(shape) is not None:
            return None
        sizes[name] = (math.prod(shape) * ITEMSIZE[code], code)
    order = sorted(sizes, key=lambda n: (sizes[n][0] % ALIGN != 0, -ITEMSIZE[sizes[n][1]], n))
    data = sum(n for n, _code in sizes.values())
    if data + 8 > file_size:
        return None
    pos, out = file_size - data, {}
    for name in order:
        out[name] = (pos, pos + sizes[name][0])
        pos += sizes[name][0]
    return out


def data_offsets(buf, decoded: dict) -> dict[str, int]:
    """The offset in ``buf`` of each non-empty tensor of ``decoded`` (what :func:`decode` returned for ``buf``)."""
    base = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    return {
        name: np.frombuffer(view, dtype=np.uint8).ctypes.data - base
        for name, (_code, _shape, view) in decoded.items()
        if view.nbytes
    }


def decode(buf, *, where: str = "") -> dict[str, tuple[str, list[int], memoryview]]:
    """Parse and validate a safetensors buffer; returns name -> (dtype code, shape, bytes).

    Raises CorruptSnapshotError on anything malformed: oversized or bad JSON
    header, unknown dtype, offsets that overlap, leave gaps or run past the end.
    """
    view = memoryview(buf).cast("B")

    def bad(reason: str) -> CorruptSnapshotError:
        return CorruptSnapshotError(f"{where or 'safetensors data'}: {reason}", path=where, problems=[reason])

    if view.nbytes < 8:
        raise bad("file shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", view[:8])
    if n > MAX_HEADER_BYTES:
        raise bad(f"header of {n} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > view.nbytes:
        raise bad(f"header length {n} runs past the end of the file ({view.nbytes} bytes)")
    try:
        header = json.loads(bytes(view[8 : 8 + n]))
    except (ValueError, RecursionError) as exc:  # bad JSON or UTF-8, a 5000-digit number, deep nesting
        why = "nested too deep" if isinstance(exc, RecursionError) else exc
        raise bad(f"header is not valid JSON ({why})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    data = view[8 + n :]
    spans = []
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets")
        code, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
        if code not in ITEMSIZE:
            raise bad(f"tensor {name!r}: unknown dtype {code!r}")
        problem = check_shape(shape)
        if problem:
            raise bad(f"tensor {name!r}: {problem}")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not 0 <= offs[0] <= offs[1]
        ):
            raise bad(f"tensor {name!r}: bad data_offsets {offs!r}")
        if offs[1] - offs[0] != math.prod(shape) * ITEMSIZE[code]:
            raise bad(f"tensor {name!r}: {offs[1] - offs[0]} bytes do not match shape {shape} of {code}")
        spans.append((offs[0], offs[1], name))
        out[name] = (code, shape, data[offs[0] : offs[1]])
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            raise bad(f"tensor {name!r}: data_offsets leave a gap or overlap at byte {pos}")
        pos = end
    if pos != data.nbytes:
        raise bad(f"tensor data covers {pos} bytes but the file holds {data.nbytes}")
    return out


def to_torch(code: str, shape: list[int], view: memoryview) -> torch.Tensor:
    """A tensor over ``view`` without copying (copied only when misaligned).

    A read-only ``view`` gives a tensor over read-only memory: torch cannot mark it so, and the caller must
    not write to it (copy it first when writable memory is needed)."""
    problem = check_shape(shape)
    if problem:
        raise CorruptSnapshotError(f"tensor of shape {shape!r}: {problem}", problems=[problem])
    dtype = CODE_TO_TORCH[code]
    if view.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if view.readonly and not _READONLY_WARNING_SPENT:
        raw = _frombuffer_quietly(view)
    else:
        raw = torch.frombuffer(view, dtype=torch.uint8)
    if raw.data_ptr() % ITEMSIZE[code]:
        raw = raw.clone()
    return raw.view(dtype).reshape(shape)


# torch warns once per process that a read-only buffer is not writable (the caller only reads it): the first
# such call is made with the warning filtered; after it torch stays silent, so no later call pays for a filter.
_READONLY_WARNING_SPENT = False


def _frombuffer_quietly(view: memoryview) -> torch.Tensor:
    global _READONLY_WARNING_SPENT
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(view, dtype=torch.uint8)
    _READONLY_WARNING_SPENT = True
    return raw


def to_numpy(code: str, shape: list[int], view: memoryview) -> np.ndarray:
    if code not in CODE_TO_NUMPY:
        raise CorruptSnapshotError(f"dtype {code} cannot be loaded as a NumPy array", problems=[code])
    return np.frombuffer(view, dtype=np.dtype(CODE_TO_NUMPY[code]).newbyteorder("<")).reshape(shape)


def iter_tensor_bytes(chunks: list) -> Iterator[memoryview]:
    for chunk in chunks:
        yield memoryview(chunk).cast("B")
