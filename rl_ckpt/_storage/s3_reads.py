"""S3 reads made of parallel ranged GETs (:class:`~rl_ckpt._storage.s3_transfer.Transfer`): a whole object into one
buffer, hashed in file order as its pieces land; byte ranges; and a read-ahead stream for ``open_read``.

No HEAD goes before a read: the first answer's ``Content-Range`` says how large the object is.
"""

from __future__ import annotations

import asyncio
import io
import os
from typing import BinaryIO, Callable

from rl_ckpt.errors import StorageError
from rl_ckpt._storage.base import check_max_bytes, check_pieces, check_range, range_past_end, too_large
from rl_ckpt._storage.buffers import alloc_bytes, prefault
from rl_ckpt._storage.fsspec_store import client_error
from rl_ckpt._storage.s3_transfer import Transfer, gathered, leading

_FIRST_PIECE = 1024 * 1024  # what a read of unknown size asks for first (it learns the size from the answer)


def pieces_of(start: int, view: memoryview, part: int) -> list[tuple[int, memoryview]]:
    """``view`` (the bytes from object offset ``start``) cut into pieces of at most ``part`` bytes."""
    return [(start + i, view[i : i + part]) for i in range(0, view.nbytes, part)] or [(start, view)]


class InOrder:
    """Calls ``on_chunk`` with each piece's bytes in object order as the pieces land in any order."""

    def __init__(self, pieces: list[tuple[int, memoryview]], on_chunk: Callable | None) -> None:
        self.pieces, self.on_chunk = pieces, on_chunk
        self.landed: dict[int, int] = {}
        self.next = 0

    def __call__(self, index: int, got: int) -> None:
        self.landed[index] = got
        while self.next in self.landed:
            got = self.landed.pop(self.next)
            if self.on_chunk is not None and got:
                for view in leading(self.pieces[self.next][1], got):
                    self.on_chunk(view)
            self.next += 1


def read_object(t: Transfer, cap: int | None, on_chunk: Callable | None) -> tuple[object, int | None]:
    """The whole object in a fresh buffer, ``on_chunk`` fed in order: ``(buffer, size)``.

    A first GET asks for the first piece (the whole object when ``cap`` fits in one part) and learns the size
    from its ``Content-Range``: an object larger than ``cap`` is left there (``size`` says how large; nothing
    was handed to ``on_chunk``). Then a buffer of that size takes the first piece and the rest follows in
    parallel, straight into it. ``size`` is None when S3 refused even the first byte (an empty object: 416)."""
    first_n = cap if cap is not None and cap <= t.part_bytes else min(_FIRST_PIECE, t.part_bytes, cap or _FIRST_PIECE)
    head = alloc_bytes(first_n)
    state = t.fetch([(0, memoryview(head).cast("B"))])
    size, got = state["size"], state["got"][0]
    if size is None or (cap is not None and size > cap):
        return head[:0], size
    if size <= got:
        if on_chunk is not None and got:
            on_chunk(memoryview(head)[:got])
        return head[:got], size
    buf = alloc_bytes(size)
    stop = prefault(buf)  # page faults on a helper thread, not in the event loop's copies
    view = memoryview(buf).cast("B")
    view[:got] = memoryview(head).cast("B")[:got]
    del head
    if on_chunk is not None:
        on_chunk(view[:got])
    pieces = pieces_of(got, view[got:], t.part_bytes)
    try:
        state = t.fetch(pieces, on_piece=InOrder(pieces, on_chunk))
    finally:
        stop()
    if sum(state["got"]) != size - got:  # the object shrank meanwhile (a replaced one fails on its ETag)
        return buf[: got + sum(state["got"])], size
    return buf, size


def read_ranges_into(t: Transfer, ranges: list[tuple[int, memoryview]]) -> list[int]:
    """Fill each ``(start, destination view)`` from the object, all in parallel; returns the bytes each received
    (fewer than asked where the object ends first)."""
    pieces: list[tuple[int, memoryview]] = []
    owner: list[int] = []
    for i, (start, view) in enumerate(ranges):
        for piece in pieces_of(start, view, t.part_bytes):
            pieces.append(piece)
            owner.append(i)
    state = t.fetch(pieces)
    got = [0] * len(ranges)
    complete = [True] * len(ranges)
    for (_start, view), i, n in zip(pieces, owner, state["got"]):
        if complete[i]:
            got[i] += n
            complete[i] = n == view.nbytes
    return got


def read_object_into(t: Transfer, views: list[memoryview], total: int, on_chunk: Callable | None) -> int:
    """The whole object straight into the caller's ``views`` (its bytes in order, ``total`` of them), ``on_chunk``
    fed in object order as the pieces land; returns the object's size (None: S3 refused the first byte, empty).

    A first GET of at most one part goes to a small buffer of its own and tells the size from its
    ``Content-Range``: an object of another size leaves the caller's memory untouched. The rest then goes in
    parallel, each piece straight into the memory it belongs to."""
    first_n = max(1, min(_FIRST_PIECE, t.part_bytes, total))
    head = alloc_bytes(first_n)
    state = t.fetch([(0, memoryview(head).cast("B"))])
    size, got = state["size"], state["got"][0]
    if size != total:
        return size
    rest: list[memoryview] = []  # the caller's memory after the head's bytes, in order
    pos = 0
    for view in views:
        if pos + view.nbytes <= got:  # wholly in the head
            view[:] = memoryview(head).cast("B")[pos : pos + view.nbytes]
        elif pos < got:  # the head's end falls inside this view
            view[: got - pos] = memoryview(head).cast("B")[pos:got]
            rest.append(view[got - pos :])
        elif view.nbytes:
            rest.append(view)
        pos += view.nbytes
    pieces = gathered(got, rest, t.part_bytes)
    if on_chunk is not None and got:
        on_chunk(memoryview(head).cast("B")[:got])
    del head
    state = t.fetch(pieces, on_piece=InOrder(pieces, on_chunk))
    if sum(state["got"]) != total - got:  # the object shrank meanwhile (a replaced one fails on its ETag)
        return got + sum(state["got"])
    return size


class ReadAhead(io.RawIOBase):
    """A stream over one object that keeps ``concurrency`` ranged GETs of one part each in flight ahead of the
    reader (what ``S3Storage.open_read`` returns: verify-after-write and ``rl-ckpt verify`` hash through it)."""

    def __init__(self, t: Transfer, size_of: Callable[[], int], error: Callable[[Exception], Exception]) -> None:
        super().__init__()
        self.t = t
        self.size_of = size_of  # a HEAD, only for seek(0, SEEK_END) before anything was read
        self.error = error  # turns a client error into the StorageError raised
        self.pos = 0
        self.size: int | None = None
        self.ahead: list[tuple[int, bytearray, object]] = []  # (start, buffer, future of bytes received)
        self.state = {"size": None, "etag": None}
        self.next = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_END:
            if self.size is None:
                self.size = self.size_of()
            offset += self.size
        elif whence == os.SEEK_CUR:
            offset += self.pos
        if offset != self.pos:
            self._drop()
            self.pos = self.next = max(0, offset)
        return self.pos

    def _drop(self) -> None:
        for _start, _buf, future in self.ahead:
            future.cancel()
        self.ahead = []

    def _submit(self, start: int, n: int) -> None:
        buf = bytearray(n)
        coro = self.t.get_piece(start, memoryview(buf), self.state)
        self.ahead.append((start, buf, asyncio.run_coroutine_threadsafe(coro, self.t.fs.loop)))
        self.next = start + n

    def _fill(self) -> None:
        if not self.ahead and self.size is None and self.state["size"] is None:
            self._submit(self.pos, min(_FIRST_PIECE, self.t.part_bytes))  # learns the size
            return
        size = self.size if self.size is not None else self.state["size"]
        while len(self.ahead) < self.t.concurrency and size is not None and self.next < size:
            self._submit(self.next, min(self.t.part_bytes, size - self.next))

    def prime(self) -> None:
        """Ask for the first piece and wait for its answer: a missing object fails here, at open."""
        self._fill()
        self._result(self.ahead[0][2])

    def _result(self, future) -> int:
        try:
            return future.result()  # a piece that failed ATTEMPTS times raises here
        except Exception as exc:
            raise self.error(exc) from exc

    def readinto(self, out) -> int:
        view = memoryview(out).cast("B")
        if not view.nbytes:
            return 0
        self._fill()
        if not self.ahead:
            return 0
        start, buf, future = self.ahead[0]
        got = self._result(future)
        if self.size is None and self.state["size"] is not None:
            self.size = self.state["size"]
        self._fill()
        lo = self.pos - start
        n = min(view.nbytes, got - lo)
        if n <= 0:
            self.ahead.pop(0)
            return 0 if got < len(buf) else self.readinto(out)
        view[:n] = memoryview(buf)[lo : lo + n]
        self.pos += n
        if self.pos >= start + got:
            self.ahead.pop(0)
        return n

    def close(self) -> None:
        self._drop()
        super().close()


class S3Reads:
    """``S3Storage``'s reads (a mixin over ``FsspecStorage``): parallel ranged GETs, no HEAD before a read."""

    def read(self, path: str, *, on_chunk=None, max_bytes: int | None = None):
        """Parallel ranged GETs into one fresh buffer, ``on_chunk`` fed in file order as the pieces land.

        No HEAD: the first GET (of the first piece, or of the whole object when ``max_bytes`` fits in one part)
        tells the size, and an object larger than ``max_bytes`` is refused then, before the buffer is allocated
        and before anything reaches ``on_chunk``."""
        check_max_bytes(max_bytes)
        full = self._abs(path)
        self._fresh(full)
        try:
            if max_bytes == 0:
                size, data = self._file_size(full), b""
            else:
                data, size = read_object(self._transfer(full), max_bytes, on_chunk)
                if size is None:  # S3 refused even the first byte (416): empty, or a folder marker
                    size = self._file_size(full)
        except StorageError:
            raise
        except Exception as exc:
            raise self._error(exc, "cannot read", path) from exc
        if max_bytes is not None and size > max_bytes:
            raise too_large(path, size, max_bytes)
        if len(data) != size:
            raise StorageError(
                f"short read of {path}: {len(data)} of {size} bytes (object changed while reading?)", path=path
            )
        if size == 0 and on_chunk is not None:
            on_chunk(memoryview(b""))
        return data if size else bytearray()

    reads_into = True

    def read_into(self, path: str, pieces, *, on_chunk=None) -> None:
        """The object straight into the caller's pieces (``Storage.read_into``): parallel ranged GETs, each into
        the memory its bytes belong to, hashed in file order as they land; no HEAD (the first GET tells the size,
        and an object of another size is refused before anything reaches the pieces)."""
        total, views = check_pieces(path, pieces)
        full = self._abs(path)
        self._fresh(full)
        try:
            size = read_object_into(self._transfer(full), views, total, on_chunk) if total else None
            if size is None:  # S3 refused even the first byte (416): empty, or a folder marker
                size = self._file_size(full)
        except StorageError:
            raise
        except Exception as exc:
            raise self._error(exc, "cannot read", path) from exc
        if size > total:
            raise too_large(path, size, total)
        if size != total:
            raise StorageError(f"short read of {path}: it has {size} bytes, {total} expected", path=path)
        if total == 0 and on_chunk is not None:
            on_chunk(memoryview(b""))

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """One ranged GET (parallel pieces above one part; the server sends no more than the object has); only a
        short or refused answer costs a HEAD, to tell a range past the end from an object replaced meanwhile."""
        check_range(start, length)
        if length > self._transfer_part():
            return self.read_ranges(path, [(start, length)])[0]
        full = self._abs(path)
        self._fresh(full)
        data = b""
        try:
            data = self.fs.cat_file(full, start=start, end=start + length) if length else b""
            if len(data) == length and length:
                return bytes(data)
            size = self._file_size(full)  # short, or empty: is the range inside the file?
        except Exception as exc:
            if client_error(exc)[0] != "InvalidRange":  # S3 416: the range starts past the end
                raise self._error(exc, "cannot read", path) from exc
            try:
                size = self._file_size(full)
            except Exception as exc2:
                raise self._error(exc2, "cannot read", path) from exc2
        if start + length > size:
            raise range_past_end(path, start, length, size)
        if length:  # inside the file yet short: the object changed between the two calls
            raise range_past_end(path, start, length, start + len(data))
        return b""

    def read_ranges(self, path: str, ranges) -> list[bytearray]:
        """Every range of one object at once: their pieces are ranged GETs in parallel, each straight into its
        range's buffer."""
        for start, length in ranges:
            check_range(start, length)
        if sum(length for _start, length in ranges) > self._transfer_part():  # size first: allocate only what is there
            full = self._abs(path)
            try:
                size = self._file_size(full)
            except Exception as exc:
                raise self._error(exc, "cannot read", path) from exc
            for start, length in ranges:
                if start + length > size:
                    raise range_past_end(path, start, length, size)
        out = [bytearray(length) for _start, length in ranges]
        self.read_ranges_into(path, [(start, memoryview(buf)) for (start, _n), buf in zip(ranges, out)])
        return out

    def read_ranges_into(self, path: str, ranges) -> None:
        full = self._abs(path)
        self._fresh(full)
        views = [(start, memoryview(dest).cast("B")) for start, dest in ranges]
        for start, view in views:
            check_range(start, view.nbytes)
        try:
            got = read_ranges_into(self._transfer(full), views)
        except Exception as exc:
            raise self._error(exc, "cannot read", path) from exc
        for (start, view), n in zip(views, got):
            if n != view.nbytes:
                try:
                    size = self._file_size(full)
                except Exception as exc:
                    raise self._error(exc, "cannot read", path) from exc
                raise range_past_end(path, start, view.nbytes, min(size, start + n))

    def open_read(self, path: str) -> BinaryIO:
        """A stream with ``max_concurrency`` ranged GETs of one part each in flight ahead of the reader."""
        full = self._abs(path)
        self._fresh(full)
        stream = ReadAhead(
            self._transfer(full),
            lambda: self._file_size(full),
            lambda exc: exc if isinstance(exc, StorageError) else self._error(exc, "cannot read", path),
        )
        try:
            stream.prime()  # a missing object fails here
        except Exception:
            stream.close()
            raise
        return stream  # type: ignore[return-value]

    def _transfer_part(self) -> int:
        return int(self.fs.default_block_size)
