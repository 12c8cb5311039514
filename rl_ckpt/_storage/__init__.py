"""Storage backends behind one small interface (:class:`Storage`).

``open_storage(url)`` picks the backend by URL protocol (``registry.py``):
plain paths and ``file://`` go to :class:`LocalStorage` (real fsync, atomic
rename: local disks and NFS), ``s3://`` to :class:`S3Storage`, ``memory://`` to
:class:`MemoryStorage`, every other protocol to :class:`FsspecStorage`.
"""

from __future__ import annotations

from rl_ckpt._storage.base import Entry, Storage, check_relpath, join
from rl_ckpt._storage.fsspec_store import FsspecStorage
from rl_ckpt._storage.local import LocalStorage
from rl_ckpt._storage.memory import MemoryStorage
from rl_ckpt._storage.registry import open_storage, register_storage, storage_class
from rl_ckpt._storage.s3 import S3Storage

__all__ = [
    "Entry",
    "Storage",
    "LocalStorage",
    "FsspecStorage",
    "S3Storage",
    "MemoryStorage",
    "open_storage",
    "register_storage",
    "storage_class",
    "check_relpath",
    "join",
]
