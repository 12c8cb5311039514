"""``memory://``: fsspec's in-process memory filesystem (tests, demos).

Two things differ from other fsspec backends: its store is shared by every
client in the process, so a process lock makes create-only exact (fsspec's own
``mode="create"`` is check-then-write); and ``open`` hands out the stored
object itself (one shared read position), so ``open_read`` returns a copy.
"""

from __future__ import annotations

import io
import threading
from typing import BinaryIO

from rl_ckpt._storage.fsspec_store import FsspecStorage

_memory_lock = threading.Lock()  # memory:// is process-local: a process lock makes create-only exact


class MemoryStorage(FsspecStorage):
    """``memory://`` run folders, visible to every client in this process."""

    def _create_only(self, full: str, path: str, data: bytes) -> None:
        with _memory_lock:
            if self.fs.exists(full):
                raise self._conflict(path)
            try:
                self.fs.pipe_file(full, data, mode="overwrite")
            except Exception as exc:  # e.g. a parent is a file
                raise self._error(exc, "cannot write", path) from exc

    def write_stream_atomic(self, path: str, chunks) -> int:
        # A memory:// file is visible from open(): gather the bytes, then publish them in one call.
        data = b"".join(memoryview(c).cast("B") for c in chunks)
        self.write_atomic(path, data)
        return len(data)

    def open_read(self, path: str) -> BinaryIO:
        full = self._abs(path)
        self._fresh(full)
        try:
            return io.BytesIO(self.fs.cat_file(full))
        except Exception as exc:
            raise self._error(exc, "cannot open", path) from exc
