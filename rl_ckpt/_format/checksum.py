"""Checksums: one tiny hasher interface over sha256, blake3 and xxh3_128.

All three release the GIL on large buffers, so hashing runs alongside writes.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

from rl_ckpt.errors import ConfigError


class Hasher(Protocol):
    def update(self, data) -> None: ...
    def hexdigest(self) -> str: ...


def new_hasher(algo: str) -> Hasher:
    """A fresh hasher for ``algo`` (``sha256``, ``blake3`` or ``xxh3_128``)."""
    if algo == "sha256":
        return hashlib.sha256()
    if algo == "blake3":
        try:
            from blake3 import blake3
        except ImportError as exc:  # pragma: no cover - installed with the package
            raise ConfigError(
                "checksum_algo 'blake3' needs the blake3 package: pip install blake3", key="checksum_algo"
            ) from exc
        return blake3(max_threads=1)
    if algo == "xxh3_128":
        try:
            import xxhash
        except ImportError as exc:  # pragma: no cover
            raise ConfigError(
                "checksum_algo 'xxh3_128' needs the xxhash package: pip install xxhash", key="checksum_algo"
            ) from exc
        return xxhash.xxh3_128()
    raise ConfigError(f"unknown checksum algorithm {algo!r}; allowed: sha256, blake3, xxh3_128", key="checksum_algo")


def digest_bytes(algo: str, data) -> str:
    h = new_hasher(algo)
    h.update(data)
    return h.hexdigest()
