"""JSON read back from storage, parsed as untrusted input.

Anyone who can write the storage can plant any bytes under a name we read:
Python's ``json`` then raises ``RecursionError`` on deep nesting and a plain
``ValueError`` on integers of more than 4300 digits, neither of which the
callers treat as a bad file. Every JSON file read from storage goes through
here, so any malformed input becomes a :class:`CheckpointError` naming the
file, and its size is checked before a byte is read.
"""

from __future__ import annotations

from typing import Any

from rl_ckpt.errors import CheckpointError
from rl_ckpt._storage import Storage

MAX_RECORD_BYTES = 1024 * 1024  # aliases, decisions, failures, quarantine and retention notes are a few hundred bytes
MAX_DEPTH = 64  # far deeper than anything rl_ckpt writes in its own records and manifests


def parse_json(
    data: bytes | bytearray | memoryview, where: str, *, error: type[CheckpointError] = CheckpointError, **fields: Any
) -> Any:
    """``data`` parsed as JSON; ``error`` (a CheckpointError) naming ``where`` if it is not valid JSON."""
    import json

    try:
        return json.loads(bytes(data))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, digit limit are ValueErrors
        reason = "nested too deep" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise error(f"{where}: not valid JSON ({reason})", **fields) from None


def read_json(
    storage: Storage,
    path: str,
    *,
    max_bytes: int = MAX_RECORD_BYTES,
    error: type[CheckpointError] = CheckpointError,
    **fields: Any,
) -> Any:
    """Parse the JSON file ``path``: its size is checked (stat) before reading it, so a sparse or huge
    file is refused without being read. StorageError if it cannot be read; ``error`` if malformed."""
    size = storage.size(path)
    if size > max_bytes:
        raise error(
            f"{path}: {size} bytes, more than the {max_bytes} allowed for this file; refusing to read it", **fields
        )
    return parse_json(storage.read(path), path, error=error, **fields)


def depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of a parsed JSON value, counted without recursion (stops past ``limit``)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if not isinstance(v, (dict, list)):
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest
