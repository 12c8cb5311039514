"""Storage backends behind one small interface (:class:`Storage`).

``open_storage(url)`` picks the backend: plain paths and ``file://`` go to
:class:`LocalStorage` (real fsync, atomic rename: local disks and NFS); every
other scheme goes to :class:`FsspecStorage` (``memory://``, ``s3://``, ...).
"""

from __future__ import annotations

from .base import Entry, Storage, check_relpath, join
from .fsspec_store import FsspecStorage
from .local import LocalStorage


def open_storage(url: str, storage_options: dict | None = None) -> Storage:
    """Open the storage rooted at ``url`` (a run folder)."""
    if url.startswith("file://"):
        return LocalStorage(url[len("file://"):])
    if "://" not in url:
        return LocalStorage(url)
    return FsspecStorage(url, storage_options)


__all__ = ["Entry", "Storage", "LocalStorage", "FsspecStorage", "open_storage", "check_relpath", "join"]
