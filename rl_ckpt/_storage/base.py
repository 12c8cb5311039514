"""The storage boundary: a handful of methods every backend implements.

Abstract methods are what every backend must do. Optional operations are
declared here too, with a default that says what it does where a backend has
no better way (``read_range`` seeks a stream, ``abort_incomplete_uploads``
aborts nothing, ``rename_dir`` refuses): callers use them directly, never
``getattr``.

Paths are ``/``-separated and relative to the storage root (a run folder).
Every method checks its path with :func:`check_relpath` first, so nothing
outside the root is ever opened, listed or deleted.

Call order of a save (what a kill -9 between two calls leaves is debris that
no reader trusts, see ``rl_ckpt._commit``)::

    makedirs(staging) -> write(file, chunks) ... -> [read back to verify]
    -> commit strategy publishes (rename_dir, or write(meta.json, create_only))
"""

from __future__ import annotations

import abc
import concurrent.futures as cf
import contextlib
import dataclasses
import os
import re
import socket
import threading
import uuid
from typing import Any, BinaryIO, Callable, Iterable, Sequence

from rl_ckpt.errors import FileTooLargeError, ReadRangeError, StorageArgumentError, StorageError, UnsafePathError

_BAD_PART = re.compile(r"[\x00\\]")


def check_relpath(path: str) -> str:
    """Return ``path`` normalised, or raise :class:`UnsafePathError`.

    Allowed: plain relative names joined by ``/``. Refused: absolute paths,
    ``..``/``.`` parts, empty parts, backslashes and NUL bytes.
    """
    if not isinstance(path, str) or path == "":
        raise UnsafePathError(f"refused path {path!r}: not a non-empty string", path=path)
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path) or "://" in path:
        raise UnsafePathError(f"refused path {path!r}: absolute paths are not allowed in a checkpoint", path=path)
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", "..") or _BAD_PART.search(part):
            raise UnsafePathError(
                f"refused path {path!r}: only plain relative names are allowed ('{part}' is not)", path=path
            )
    return "/".join(parts)


_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname().split(".")[0]) or "host"


def unique_suffix() -> str:
    """A name part no other host, process or thread will produce (temp and attempt names)."""
    return f"{_HOST}-{os.getpid()}-{threading.get_ident() % 100000}-{uuid.uuid4().hex[:8]}"


def check_max_bytes(max_bytes: int | None) -> None:
    """Refuse a ``max_bytes`` that is not None or a non-negative int."""
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
        raise StorageArgumentError(
            f"max_bytes must be None or an int >= 0, not {max_bytes!r}", name="max_bytes", value=max_bytes
        )


def too_large(path: str, size: int, max_bytes: int) -> FileTooLargeError:
    """The error for a file over the caller's cap (raised before reading it)."""
    return FileTooLargeError(
        f"refused to read {path}: it is {size} bytes, more than the {max_bytes} bytes allowed for it. Nothing was "
        "read; rl_ckpt never writes a file that large there, so it is damaged or was planted: inspect and remove it",
        path=path,
        size=size,
        max_bytes=max_bytes,
    )


def check_range(start: int, length: int) -> None:
    """Refuse a ranged read whose ``start`` or ``length`` is not a non-negative int."""
    for name, value in (("start", start), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise StorageArgumentError(f"read_range: {name} must be an int >= 0, not {value!r}", name=name, value=value)


def range_past_end(path: str, start: int, length: int, size: int) -> ReadRangeError:
    """The error for a ranged read that reaches past the end of the file."""
    return ReadRangeError(
        f"cannot read bytes {start}..{start + length} of {path}: the file has only {size} bytes "
        "(it is shorter than its manifest says: damaged or truncated)",
        path=path,
        start=start,
        length=length,
        size=size,
    )


PIECE_STEP = 8 * 1024 * 1024  # bytes per read into a piece (``Storage.read_into``): hashed while in the CPU cache


def check_pieces(path: str, pieces: Sequence[tuple[int, Any]]) -> tuple[int, list[memoryview]]:
    """The bytes ``pieces`` cover and their byte views; StorageArgumentError unless they tile ``[0, total)`` in
    order (``Storage.read_into``)."""
    views, pos = [], 0
    for offset, buffer in pieces:
        view = memoryview(buffer).cast("B")
        if offset != pos or view.readonly:
            raise StorageArgumentError(
                f"read_into {path}: pieces must be writable and cover the file in order (a piece at {offset}, "
                f"expected {pos})",
                name="pieces",
                value=offset,
            )
        views.append(view)
        pos += view.nbytes
    return pos, views


def per_file(storage: "Storage", items: list, job: Callable, *, at_once: bool = True) -> list:
    """``[job(item) for item in items]``, up to ``storage.files_at_once`` at a time (``at_once``), in order. Every
    job has ended when this returns (none goes on writing into memory or storage after a failure); the first
    failure in ``items``' order is raised."""
    n = min(storage.files_at_once, len(items)) if at_once else 1
    if n <= 1:
        return [job(item) for item in items]
    with cf.ThreadPoolExecutor(n, thread_name_prefix="rl-ckpt-files") as pool:
        futures = [pool.submit(job, item) for item in items]
        cf.wait(futures)
    return [f.result() for f in futures]


def join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One listing entry: ``name`` is the last path part."""

    name: str
    is_dir: bool
    size: int = 0
    mtime: float | None = None
    #: From :meth:`Storage.stat`: changes whenever the file is rewritten or replaced (None: cannot tell).
    version: str | None = None


class Storage(abc.ABC):
    """Minimal storage interface. Implementations: ``LocalStorage``, ``FsspecStorage`` and its ``S3Storage``,
    ``MemoryStorage``; ``open_storage`` picks one by URL protocol (``rl_ckpt._storage.registry``)."""

    url: str
    #: True when directories can be renamed atomically (local disks, NFS).
    supports_rename: bool = False
    # ``read_view`` returns read-only memory the backend shares (no copy was made): a reader that needs writable
    # tensors copies them where they go (e.g. into an optimizer's existing state) rather than into fresh memory.
    shares_views: bool = False
    # ``read_into`` places a file's bytes in the caller's memory without a buffer of its own (local disks, the
    # memory tier): a restore then reads tensors straight into the objects' own (``rl_ckpt._core.reader``).
    reads_into: bool = False
    # How many of a snapshot's component files a save writes, and a restore reads, at once: 1 where one stream
    # keeps the medium busy (a local disk); more where each request waits on the network (S3), so that one
    # file's last parts and first request do not leave the connections idle.
    files_at_once: int = 1
    # ``Entry.version`` names immutable contents: a file with the version it had when it was verified still holds
    # the bytes verified then (the memory tier: replacing a file makes a new object under a new version, unique
    # across a node's store restarts). A deep recovery plan then re-hashes only what changed (``deep_check``).
    versions_name_content: bool = False

    @abc.abstractmethod
    def write(self, path: str, chunks: Iterable, *, create_only: bool = False, durable: bool = True) -> int:
        """Write a whole file from ``chunks`` (bytes-like) and return its size.

        ``durable``: the data is on stable storage when this returns (fsync).
        ``create_only``: fail with ``CommitConflictError`` if ``path`` exists,
        atomically (no window where two writers both succeed).
        The file is not atomic by itself: write it inside a staging area, or
        use :meth:`write_atomic`.
        """

    def read_back_verified(self, path: str) -> None:
        """The writer read ``path`` back right after writing it and found it to be what it wrote (verify-after-write
        of a file named by its content). Nothing here; a storage that can tell its readers so may note it (the
        policy-version stores: readers on the publisher's node then do not hash those very bytes again)."""

    def write_attested(self, path: str, size: int) -> bool:
        """Whether the storage itself checked that the last :meth:`write` of ``path`` (``size`` bytes) stored exactly
        the bytes it was handed, so verify-after-write need not read it back (asked once per write: it forgets the
        answer). False unless the backend can show it: S3 when the endpoint was seen to refuse a body whose
        checksum is wrong and every part of the write carried one (``rl_ckpt._storage.s3``)."""
        return False

    @abc.abstractmethod
    def write_atomic(self, path: str, data: bytes, *, create_only: bool = False) -> None:
        """Publish a small standalone file all-or-nothing (temp + fsync + rename, or one PUT)."""

    def write_stream_atomic(self, path: str, chunks: Iterable) -> int:
        """Publish a file of any size all-or-nothing, streamed from ``chunks``; durable when this returns.

        Readers see the whole file or no file, and a failure (or a kill) leaves no partial file
        under ``path``. This default suits object stores, where an object appears only when its
        upload completes (an aborted upload leaves nothing); local backends write a temp file,
        fsync it and rename it into place.
        """
        return self.write(path, chunks, durable=True)

    def write_many_atomic(self, items: list[tuple[str, object]]) -> None:
        """Publish several standalone files (``(path, bytes-like)``, parents existing), each all-or-nothing
        and all durable when this returns. Backends may batch the syncs (local: write all, then fsync
        all, then rename all, then fsync each folder once); the default publishes one by one."""
        for path, data in items:
            self.write_atomic(path, data)

    @abc.abstractmethod
    def read(self, path: str, *, on_chunk: Callable[[memoryview], object] | None = None, max_bytes: int | None = None):
        """Read a whole regular file (links refused) into a writable bytes-like buffer.

        ``on_chunk`` is called with consecutive pieces of the buffer as they
        are filled (the reader hashes there, while each piece is still in the
        CPU cache and the next one is being read ahead); a backend that reads
        in one piece calls it once.
        ``max_bytes``: refuse a file larger than this with ``FileTooLargeError``
        before any buffer is allocated (the size is taken first, and no more
        than the cap is ever read, even if the file grows meanwhile).
        """

    def read_view(
        self, path: str, *, on_chunk: Callable[[memoryview], object] | None = None, max_bytes: int | None = None
    ):
        """Like ``read``, but the result may be a READ-ONLY view of memory the backend shares (no copy).

        For callers that only read the bytes (decode, copy out, write elsewhere) and never write to
        them. The default is ``read``; the memory tier returns its object store's memory.
        """
        return self.read(path, on_chunk=on_chunk, max_bytes=max_bytes)

    def read_into(
        self, path: str, pieces: Sequence[tuple[int, Any]], *, on_chunk: Callable[[memoryview], object] | None = None
    ) -> None:
        """Read a whole regular file (links refused) into the caller's memory: ``pieces`` are ``(offset, buffer)``
        pairs in file order that cover the file exactly (each buffer writable and C-contiguous; offset 0 first,
        each next one where the last ended). A reader places a file's bytes where they are used (a tensor's own
        memory) instead of into a buffer it copies from.

        ``on_chunk`` sees every byte once, in file order, as the pieces fill (part of a piece at a time, after
        it landed: the reader hashes there). A file larger than the pieces is refused with ``FileTooLargeError``
        before it is read, a shorter one with ``StorageError``. This default reads the file (``read``) and copies
        it into the pieces; a backend that places bytes without that buffer overrides it and sets ``reads_into``.
        """
        total, views = check_pieces(path, pieces)
        data = memoryview(self.read(path, max_bytes=total)).cast("B")
        if data.nbytes != total:
            raise StorageError(f"short read of {path}: it has {data.nbytes} bytes, {total} expected", path=path)
        pos = 0
        for view in views:
            for start in range(0, view.nbytes, PIECE_STEP):
                end = min(start + PIECE_STEP, view.nbytes)
                view[start:end] = data[pos + start : pos + end]
                if on_chunk is not None:
                    on_chunk(view[start:end])
            pos += view.nbytes

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """``length`` bytes of a regular file from offset ``start``.

        The whole range must lie inside the file: a range past its end raises
        ``ReadRangeError`` (nothing is allocated for it), negative or non-integer
        arguments ``StorageArgumentError``. This default seeks an ``open_read``
        stream; backends override it with a positioned or ranged read.
        """
        check_range(start, length)
        with self.open_read(path) as f:
            size = f.seek(0, os.SEEK_END)
            if start + length > size:
                raise range_past_end(path, start, length, size)
            f.seek(start)
            parts, got = [], 0
            while got < length:
                part = f.read(length - got)
                if not part:
                    raise range_past_end(path, start, length, start + got)  # the file shrank meanwhile
                parts.append(part)
                got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(start, length)`` range of one file, in order, each checked as by ``read_range``.

        One request for all of them where the backend can (the memory tier: one call to one store); this
        default makes one ``read_range`` per range."""
        return [self.read_range(path, start, length) for start, length in ranges]

    @abc.abstractmethod
    def open_read(self, path: str) -> BinaryIO:
        """Open a regular file for streaming reads (links refused)."""

    @abc.abstractmethod
    def list(self, path: str = "") -> list[Entry]:
        """Entries directly under ``path`` (empty list if it does not exist)."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    @abc.abstractmethod
    def size(self, path: str) -> int: ...

    def read_ranges_into(self, path: str, ranges: Sequence[tuple[int, Any]]) -> None:
        """Fill each ``(start, destination)`` (a writable bytes-like object as long as the range) with that range of
        one file, checked as by ``read_range``: the reader hands over where the bytes go (a tensor's memory, a
        staging buffer) and nothing else is allocated for them where the backend can (S3: parallel ranged GETs
        straight into the destinations). This default copies what ``read_ranges`` returns."""
        views = [(start, memoryview(dest).cast("B")) for start, dest in ranges]
        for (_start, view), data in zip(views, self.read_ranges(path, [(s, v.nbytes) for s, v in views])):
            view[:] = memoryview(data).cast("B")

    def stat(self, path: str) -> Entry | None:
        """One file's entry, or None if it does not exist; ``version`` lets callers cache what they parsed."""
        if not self.exists(path):
            return None
        return Entry(path.rsplit("/", 1)[-1], False, self.size(path))

    def stat_many(self, paths: Sequence[str]) -> list[Entry | None]:
        """``stat`` of each path, in order: one request for all where the backend can (the memory tier: one call
        per store); this default stats them one by one."""
        return [self.stat(p) for p in paths]

    def views_many(self, paths: Sequence[str]) -> dict[str, Any]:
        """Those of ``paths`` the backend can hand over at once as READ-ONLY views of memory it shares, in one
        request (the memory tier: the files this node's store holds, mapped, not copied): path -> view. The
        others are left out (read them as usual). Nothing is verified here. This default hands over none."""
        return {}

    def warm_up(self) -> None:
        """Make first contact with the backend now, on a thread of its own, and return at once: what the first
        read would otherwise pay on a restore's critical path (the memory tier: listing the run's stores and
        getting their actor handles). The engine calls it when it is built. Nothing is read or trusted
        ahead: every byte a restore uses is still read and checked then. This default does nothing."""

    def read_session(self) -> contextlib.AbstractContextManager:
        """A context (on the calling thread) within which the backend may answer listings, stats and reads from
        one view of the run taken at its first use, as a listing taken then would (writes and removals through
        this object are seen; another client's are not). A restore wraps its planning and loading in one. For
        the memory tier that is one round trip per store instead of one per listing, stat and file; this
        default is no view (every call asks the backend)."""
        return contextlib.nullcontext(self)

    @abc.abstractmethod
    def remove(self, path: str) -> None:
        """Remove one file (missing is fine)."""

    @abc.abstractmethod
    def remove_tree(self, path: str) -> None:
        """Remove a folder and everything under it (missing is fine)."""

    @abc.abstractmethod
    def makedirs(self, path: str) -> None: ...

    def rename_dir(self, src: str, dst: str) -> None:
        """Atomically rename a folder; ``CommitConflictError`` if ``dst`` exists."""
        raise NotImplementedError(f"{type(self).__name__} has no atomic rename")

    def sync_dir(self, path: str) -> None:
        """Make a folder's entries durable (fsync the directory). No-op on object stores."""

    def free_bytes(self) -> int | None:
        """Free space at the root, or None when the backend cannot tell."""
        return None

    def abort_incomplete_uploads(self, older_than_seconds: float) -> list[str]:
        """Abort multipart uploads under the root started more than ``older_than_seconds`` ago; return their keys.

        Only object stores have such uploads (a writer killed mid-upload leaves
        invisible, billed parts). Every other backend has nothing to abort: this
        default does nothing and returns an empty list.
        """
        return []

    def close(self) -> None:
        """Release resources (connections, thread pools)."""
