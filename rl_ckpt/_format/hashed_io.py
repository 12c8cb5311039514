"""Files on storage with their checksums: hash while writing, re-hash what is stored, verify after write.

Each checksum is computed from the very bytes handed to storage (``write_hashed``);
``verify_written`` compares it with an independent re-read (``hash_file``) before a
snapshot may commit, unless the storage checked the bytes it stored itself (``Storage.write_attested``).
"""

from __future__ import annotations

import io
import os
from typing import Iterable, Iterator, Sequence

from rl_ckpt.errors import CorruptSnapshotError, StorageError, UnsafePathError
from rl_ckpt._format.checksum import new_hasher
from rl_ckpt._format.manifest import FileEntry
from rl_ckpt._storage import Storage

READ_CHUNK = 16 * 1024 * 1024
MIN_READ_BUFFER = 64 * 1024
HASH_SLICE = 4 * 1024 * 1024


def write_hashed(storage: Storage, path: str, chunks: Iterable, algo: str) -> tuple[int, str]:
    """Write ``chunks`` to ``path`` durably; return (size, checksum of what was written)."""
    hasher = new_hasher(algo)

    def hashing() -> Iterator:
        # Hash each slice right before it is written, while it is still in the CPU cache.
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            for start in range(0, view.nbytes, HASH_SLICE):
                piece = view[start : start + HASH_SLICE]
                hasher.update(piece)
                yield piece
            if not view.nbytes:
                yield view

    size = storage.write(path, hashing(), durable=True)
    return size, hasher.hexdigest()


def hash_file(storage: Storage, path: str, algo: str, throttle=None, size_hint: int | None = None) -> tuple[int, str]:
    """Stream a stored file through the hasher: (size, checksum). ``throttle(n)`` paces reads. ``size_hint``: the
    size the file should have (its manifest's): the read buffer is sized to it (a file of any size is still read
    to its end), so a snapshot of many small files does not allocate and zero 16 MiB for each."""
    hasher = new_hasher(algo)
    size = 0
    with storage.open_read(path) as f:
        view = memoryview(bytearray(read_buffer_bytes(f, size_hint)))
        while n := f.readinto(view):
            hasher.update(view[:n])
            size += n
            if throttle is not None:
                throttle(n)
    return size, hasher.hexdigest()


def read_buffer_bytes(f, size_hint: int | None) -> int:
    """The buffer to stream ``f`` through: as large as the file (its ``size_hint``, else its size on disk when it
    has a descriptor), at least 64 KiB and at most ``READ_CHUNK``."""
    if size_hint is None:
        try:
            size_hint = os.fstat(f.fileno()).st_size
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            return READ_CHUNK
    return min(READ_CHUNK, max(size_hint, MIN_READ_BUFFER))


def hash_files(
    storage: Storage, paths: list[str], algo: str, sizes: Sequence[int] | None = None
) -> list[tuple[int, str] | None]:
    """``(size, checksum)`` of each stored file as the backend holds it now, re-read, in order; None for one that
    cannot be read or is not a regular file. What the backend hands over at once (``Storage.views_many``: the
    memory tier maps the files of this node's store with one call) is hashed where it lies; every other file is
    streamed through a bounded buffer (``hash_file``; ``sizes``: the sizes they should have, in order)."""
    views = storage.views_many(paths) if paths else {}
    out: list[tuple[int, str] | None] = []
    for i, path in enumerate(paths):
        view = views.get(path)
        if view is None:
            try:
                out.append(hash_file(storage, path, algo, size_hint=sizes[i] if sizes is not None else None))
            except (StorageError, UnsafePathError):  # missing, unreadable, or not a regular file
                out.append(None)
            continue
        hasher = new_hasher(algo)
        for start in range(0, view.nbytes, HASH_SLICE):
            hasher.update(view[start : start + HASH_SLICE])
        out.append((view.nbytes, hasher.hexdigest()))
    return out


def verify_written(storage: Storage, path: str, entry: FileEntry) -> None:
    """Refuse ``path`` unless what is stored is what ``entry`` hashed: re-read and re-hashed, or (S3 where the
    endpoint checks them) checked by the storage against checksums of the very bytes hashed, on the way in."""
    if storage.write_attested(path, entry.size):
        return
    size, digest = hash_file(storage, path, entry.algo, size_hint=entry.size)
    if size != entry.size or digest != entry.checksum:
        raise CorruptSnapshotError(
            f"verify-after-write failed for {path}: wrote {entry.size} bytes ({entry.checksum[:16]}…), "
            f"read back {size} bytes ({digest[:16]}…). The storage is not returning what was written; "
            "nothing was committed.",
            path=path,
            problems=["verify-after-write mismatch"],
        )
