"""NumPy arrays that third-party state carries as text, read without ever unpickling.

RLlib keeps some arrays in its state as text: base64 of zlib of a ``.npy`` file (``MeanStdFilter``'s running
statistics, the bounds of a gymnasium ``Box`` space), and reads them back with ``np.load(allow_pickle=True)``.
That loader unpickles an object-dtype array, and unpickles anything that is not a ``.npy`` or ``.npz`` file at
all, so such a string in a snapshot is code that runs when RLlib sets the state. rl_ckpt never hands it one:

- :func:`npy_bytes` says whether RLlib's decoder would reach ``np.load`` with a string (it decodes base64
  leniently, ignoring characters outside the alphabet, then zlib), and returns those bytes;
- :func:`load_npy` reads them as a plain array (``allow_pickle=False``), or says why it refuses;
- :func:`encode_npy` writes an array the way RLlib does, from a verified plain array;
- :func:`unsafe_strings` lists the strings of a parsed JSON tree that NumPy's loader would unpickle (an
  object-dtype ``.npy`` or a pickle stream behind the base64 and zlib): ``verify`` reports them.
"""

from __future__ import annotations

import base64
import binascii
import io
import zlib
from typing import Any

import numpy as np

NPY_MAGIC = b"\x93NUMPY"
MAX_NPY_BYTES = 64 * 1024 * 1024  # a decoded array larger than this is refused (a zlib bomb costs nothing to write)
_MIN_CHARS = 8  # base64 of a zlib header and the shortest stream is longer
_SKIP_TAGS = ("$bytes", "$bytearray")  # rl_ckpt's own base64: decoded to bytes by rl_ckpt, never handed to NumPy


def npy_bytes(text: Any) -> bytes | None:
    """The bytes RLlib's ``_deserialize_ndarray`` would hand to ``np.load`` for ``text``; None when it would fail
    before (not a str, not base64, not a complete zlib stream): such a value reaches no decoder.

    Raises:
        ValueError: it would decode to more than ``MAX_NPY_BYTES``.
    """
    if not isinstance(text, str) or len(text) < _MIN_CHARS:
        return None
    try:
        raw = base64.b64decode(text)  # lenient, as RLlib decodes: characters outside the alphabet are dropped
    except (ValueError, binascii.Error):
        return None
    if len(raw) < 2 or raw[0] & 0x0F != 8 or (raw[0] << 8 | raw[1]) % 31:
        return None  # no zlib header: zlib.decompress raises before np.load
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(raw, MAX_NPY_BYTES + 1)
    except zlib.error:
        return None
    if len(data) > MAX_NPY_BYTES:
        raise ValueError(f"it decompresses to more than {MAX_NPY_BYTES} bytes")
    if not inflater.eof:
        return None  # truncated: zlib.decompress raises
    return data


def load_npy(data: bytes) -> np.ndarray:
    """``data`` (a ``.npy`` file) as a plain array, never unpickled.

    Raises:
        ValueError: not a ``.npy`` file (NumPy's loader would unpickle it), an object dtype, or malformed.
    """
    if not data.startswith(NPY_MAGIC):
        what = "a pickle stream" if data[:1] == b"\x80" else "not a .npy array"
        raise ValueError(f"{what}: NumPy's loader would unpickle it")
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise ValueError("an object-dtype array: NumPy's loader would unpickle it") from None
        raise ValueError(f"a malformed .npy array ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - whatever a crafted header provokes in NumPy's parser
        raise ValueError(f"a malformed .npy array ({type(exc).__name__}: {exc})") from None
    if not isinstance(array, np.ndarray) or array.dtype.hasobject:
        raise ValueError("an object-dtype array: NumPy's loader would unpickle it")
    return array


def encode_npy(array: np.ndarray) -> str:
    """``array`` as RLlib's ``_serialize_ndarray`` writes it (base64 of zlib of ``np.save``); never pickles."""
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(zlib.compress(buf.getvalue())).decode("ascii")


def unsafe_strings(tree: Any, path: str = "") -> list[tuple[str, str]]:
    """``(key path, why)`` for every string in a parsed JSON tree whose base64 and zlib hide an object-dtype
    ``.npy`` or a pickle stream (protocol 2 or later): what NumPy's ``np.load(allow_pickle=True)`` would run.

    Other base64+zlib text is left alone here (it may be anything a user stores); RLlib's integration refuses
    every such string in RLlib's state that is not a plain array (:func:`load_npy`)."""
    found: list[tuple[str, str]] = []
    stack = [(tree, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            if len(node) == 1 and next(iter(node)) in _SKIP_TAGS:
                continue
            stack.extend((v, f"{where}/{k}") for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{where}/{i}") for i, v in enumerate(node))
        elif isinstance(node, str):
            why = _unsafe(node)
            if why:
                found.append((where.lstrip("/") or "<root>", why))
    return sorted(found)


def _unsafe(text: str) -> str | None:
    try:
        data = npy_bytes(text)
    except ValueError as exc:
        return f"a base64+zlib value: {exc}"
    if data is None:
        return None
    if data.startswith(NPY_MAGIC):
        try:
            load_npy(data)
        except ValueError as exc:
            return f"a base64+zlib NumPy value: {exc}"
        return None
    if data[:1] == b"\x80" and data[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a base64+zlib pickle stream: NumPy's loader would unpickle it"
    return None
