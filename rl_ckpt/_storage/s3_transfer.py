"""Parallel S3 transfers on s3fs's event loop: uploads streamed part by part from the caller's buffers, and
ranged GETs straight into destination memory.

Uploads (:func:`upload`): the caller's chunks are cut into parts of ``part_bytes`` as they are produced;
each part is a list of views of the caller's memory (no joined copy), sent as soon as it is full, with at
most ``concurrency`` parts in flight (the producer waits for a free slot). A stream shorter than one part
is one PUT. A multipart upload that fails, or whose producer fails, is aborted; one a killed process left
is aborted by ``S3Storage.abort_incomplete_uploads`` (``rl-ckpt gc``).

The views reach aiohttp unchanged: botocore accepts only bytes or file objects as a ``Body``, so
:func:`zero_copy` registers two event handlers on the client that carry a :class:`Body` past its
parameter check and put it back into the request before it is sent.

Reads (:meth:`Transfer.fetch`): the byte ranges wanted, cut into pieces of at most ``part_bytes``, are
fetched with ``concurrency`` ranged GETs in flight, each read straight into its place in the destination
buffer. All pieces must carry one ETag (one version of the object; a read that meets two fails). A piece
that fails (a reset connection, a short body) is fetched again, up to ``ATTEMPTS`` times in all; then the
read fails. Callers hash the pieces in file order as they land (``on_piece``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import queue
import threading
import weakref
import zlib
from typing import Callable, Iterable, Sequence

from rl_ckpt.errors import StorageError
from rl_ckpt._storage.fsspec_store import client_error

REFUSED_DIGEST = ("BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch")  # "the body does not match"
DEFAULT_PART_BYTES = 8 * 1024 * 1024
DEFAULT_CONCURRENCY = 16
MIN_PART_BYTES = 5 * 1024 * 1024  # S3's smallest part (but the last)
ATTEMPTS = 3
_SMALL_VIEW = 64 * 1024  # views this small are joined (one copy) rather than sent one by one
_SEND_SLICE = 1024 * 1024


class Body:
    """A request body made of views of the caller's memory, sent without a copy.

    aiohttp sends it as an async iterable (``Content-Length`` is set from ``ContentLength``); ``seek``,
    ``tell`` and ``read`` serve botocore where it rewinds a body for a retry, or reads one to sign or
    checksum it itself (a client configured so: copies then)."""

    def __init__(self, views: list[memoryview]) -> None:
        self.views = views
        self.nbytes = sum(v.nbytes for v in views)
        self._pos = 0

    def __len__(self) -> int:
        return self.nbytes

    def __bool__(self) -> bool:
        return self.nbytes > 0

    def __aiter__(self):
        async def pieces():
            for view in self.views:
                for start in range(0, view.nbytes, _SEND_SLICE):
                    yield view[start : start + _SEND_SLICE]

        return pieces()

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else (self._pos + pos if whence == 1 else self.nbytes + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self.nbytes if n is None or n < 0 else min(self.nbytes, self._pos + n)
        out, base = [], 0
        for view in self.views:
            lo, hi = max(self._pos, base), min(end, base + view.nbytes)
            if lo < hi:
                out.append(view[lo - base : hi - base])
            base += view.nbytes
        self._pos = end
        return b"".join(out)


def _before_build(params, context, **_kw) -> None:
    body = params.get("Body")
    if isinstance(body, Body):
        context["rl_ckpt_body"] = body
        params["Body"] = b""
        params["ContentLength"] = body.nbytes


def _before_call(params, context, **_kw) -> None:
    body = context.pop("rl_ckpt_body", None)
    if body is not None:
        params["body"] = body


_ZERO_COPY: weakref.WeakSet = weakref.WeakSet()  # clients whose handlers are registered


def zero_copy(client) -> None:
    """Let ``client`` (an aiobotocore S3 client) take a :class:`Body` for ``PutObject``/``UploadPart`` (once)."""
    if client in _ZERO_COPY:
        return
    for op in ("PutObject", "UploadPart"):
        client.meta.events.register(f"before-parameter-build.s3.{op}", _before_build)
        client.meta.events.register(f"before-call.s3.{op}", _before_call)
    _ZERO_COPY.add(client)


CHECKSUMS = ("CRC32", "SHA256")  # what a part or PUT can carry (S3's ``ChecksumAlgorithm``), from the stdlib


def raw_checksum(algo: str, views: Sequence[memoryview]) -> bytes:
    """S3's ``algo`` checksum (``CHECKSUMS``) of the concatenated views, as raw bytes."""
    if algo == "CRC32":
        crc = 0
        for view in views:
            crc = zlib.crc32(view, crc)
        return crc.to_bytes(4, "big")
    hasher = hashlib.sha256()
    for view in views:
        hasher.update(view)
    return hasher.digest()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def composite(algo: str, parts: Sequence[bytes]) -> str:
    """The checksum S3 states for a multipart object: the checksum of the parts' raw checksums, ``-<parts>``."""
    return f"{b64(raw_checksum(algo, [memoryview(p) for p in parts]))}-{len(parts)}"


def _coalesce(views: list[memoryview]) -> list[memoryview]:
    """The views, with runs of small ones joined (a part of many tiny chunks is sent as a few pieces)."""
    out: list[memoryview] = []
    run: list[memoryview] = []
    for view in views:
        if view.nbytes < _SMALL_VIEW:
            run.append(view)
            continue
        if run:
            out.append(memoryview(b"".join(run)))
            run = []
        out.append(view)
    if run:
        out.append(memoryview(b"".join(run)))
    return out


class Transfer:
    """Transfers of one object on ``fs`` (an ``s3fs.S3FileSystem``): its loop, client and settings."""

    def __init__(self, fs, bucket: str, key: str, *, part_bytes: int, concurrency: int, checksum: str | None) -> None:
        """``checksum``: each part and PUT carries its ``CRC32`` or ``SHA256`` (``CHECKSUMS``), computed here from
        the very memory sent; None: none."""
        if checksum is not None and checksum not in CHECKSUMS:
            raise ValueError(f"checksum {checksum!r}: allowed {CHECKSUMS} or None")
        self.fs, self.bucket, self.key = fs, bucket, key
        self.part_bytes, self.concurrency, self.checksum = part_bytes, concurrency, checksum

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop)

    async def _call(self, method: str, **kw):
        return await self.fs._call_s3(method, Bucket=self.bucket, Key=self.key, **kw)

    async def _client(self) -> None:
        await self.fs.set_session()
        zero_copy(await self.fs.get_s3(self.bucket))

    # -- uploads -------------------------------------------------------------------------------------
    def upload(self, chunks: Iterable, error: Callable[[Exception], Exception]) -> int:
        """Write ``chunks`` (bytes-like, unchanged until this returns) as the object; returns its size. With a
        ``checksum``, a return means the server took every request with the checksum of its body (and the composite
        it stated, if any, matched ours).

        An error of the producer (the chunk iterator) propagates unchanged; one of a request is raised as
        ``error(exc)`` (the caller's StorageError)."""

        def _request(fn):
            try:
                return fn()
            except Exception as exc:
                raise error(exc) from exc

        _request(lambda: self._run(self._client()).result())
        pending: list[memoryview] = []
        filled = 0
        total = 0
        parts = _Parts(self)
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                total += view.nbytes
                while view.nbytes:
                    take = min(view.nbytes, self.part_bytes - filled)
                    pending.append(view[:take])
                    filled += take
                    view = view[take:]
                    if filled == self.part_bytes:
                        _request(lambda: parts.send(pending))
                        pending, filled = [], 0
            if parts.upload_id is None:
                _request(lambda: self._run(self._put(pending)).result())
                return total
            if pending:
                _request(lambda: parts.send(pending))
            _request(parts.complete)
        except BaseException:
            parts.abort()
            raise
        return total

    async def _put(self, views: list[memoryview]) -> None:
        body = Body(_coalesce(views))
        extra = {f"Checksum{self.checksum}": b64(raw_checksum(self.checksum, body.views))} if self.checksum else {}
        await self.checked_call("put_object", body, **extra)

    async def checked_call(self, method: str, body: Body, **kw) -> dict:
        """Send ``body``; one the server refuses as not matching its checksum (``BadDigest``: damaged on the way)
        is sent again from the same memory, ``ATTEMPTS`` times in all."""
        for attempt in range(ATTEMPTS):
            try:
                return await self._call(method, Body=body, **kw)
            except Exception as exc:
                if attempt + 1 == ATTEMPTS or not _refused_digest(exc):
                    raise
                body.seek(0)
        raise AssertionError("unreachable")  # pragma: no cover

    # -- reads ---------------------------------------------------------------------------------------
    def fetch(
        self,
        pieces: list[tuple[int, memoryview]],
        *,
        on_piece: Callable[[int, int], None] | None = None,
        speculative: bool = False,
    ) -> dict:
        """Fill each ``(object offset, destination view)`` with the object's bytes, ``concurrency`` GETs in
        flight; ``on_piece(index, nbytes)`` runs on the calling thread as each piece lands (any order).

        Returns ``{"size": object size or None, "got": [bytes received per piece], "etag": ...}``. A piece
        that starts past the end of the object gets 0 bytes; one that ends past it, fewer than asked
        (``speculative``: the caller guessed the size; otherwise the caller checks ``got``)."""
        landed: queue.Queue = queue.Queue()
        state = {"size": None, "etag": None, "got": [0] * len(pieces)}
        future = self._run(self._fetch_all(pieces, state, landed))
        done = 0
        try:
            while done < len(pieces):
                item = landed.get()
                if item is None:  # the fetch failed: its exception is in the future
                    break
                done += 1
                if on_piece is not None:
                    on_piece(item, state["got"][item])
        except BaseException:
            future.cancel()  # no GET goes on writing into a buffer its reader gave up
            raise
        future.result()
        return state

    async def _fetch_all(self, pieces, state: dict, landed: queue.Queue) -> None:
        gate = asyncio.Semaphore(self.concurrency)

        async def one(i: int, start: int, view: memoryview) -> None:
            async with gate:
                state["got"][i] = await self.get_piece(start, view, state)
            landed.put(i)

        tasks = [asyncio.ensure_future(one(i, s, v)) for i, (s, v) in enumerate(pieces)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            landed.put(None)
            raise

    async def get_piece(self, start: int, view, state: dict) -> int:
        """Fill ``view`` (a memoryview, or a list of them filled in order: one GET for many small tensors) from
        object offset ``start`` (one ranged GET, fetched again if the body breaks); returns the bytes received
        (0 past the end). ``state`` holds the size and ETag the answers name."""
        segs = view if isinstance(view, list) else [view]
        n = sum(seg.nbytes for seg in segs)
        if n == 0:
            return 0
        error: BaseException | None = None
        for _attempt in range(ATTEMPTS):
            try:
                resp = await self._call("get_object", Range=f"bytes={start}-{start + n - 1}")
            except Exception as exc:
                if _past_end(exc):
                    return 0
                raise  # botocore and s3fs retried it already
            body = resp["Body"]
            try:
                _same_version(state, resp, self)
                size = _total(resp.get("ContentRange"))
                if size is not None:
                    state["size"] = size
                want = min(n, int(resp.get("ContentLength", n)))
                got = 0
                for seg in segs:
                    filled, end = 0, min(seg.nbytes, want - got)
                    while filled < end:
                        k = await body.readinto(seg[filled:end])
                        if not k:
                            raise ConnectionError(f"short body: {got + filled} of {want} bytes")
                        filled += k
                    got += filled
                    if got >= want:
                        break
                return got
            except StorageError:  # the object changed: fetching again cannot help
                body.close()
                raise
            except Exception as exc:  # the connection broke mid-body: fetch the piece again
                error = exc
                body.close()
        raise ConnectionError(
            f"bytes {start}..{start + n} of s3://{self.bucket}/{self.key}: failed {ATTEMPTS} times, last: "
            f"{type(error).__name__}: {error}"
        ) from error


def leading(dest, nbytes: int) -> list[memoryview]:
    """The first ``nbytes`` of a piece's destination (a memoryview or a list of them), as views in order."""
    out = []
    for seg in dest if isinstance(dest, list) else [dest]:
        if nbytes <= 0:
            break
        out.append(seg[:nbytes])
        nbytes -= seg.nbytes
    return out


def gathered(start: int, views: Iterable[memoryview], part: int) -> list[tuple[int, list[memoryview]]]:
    """``views`` (consecutive bytes of the object from offset ``start``) as pieces of ``part`` bytes each (the
    last shorter), a piece being the list of views its bytes land in: many small tensors share one GET, a large
    one is cut across several."""
    pieces: list[tuple[int, list[memoryview]]] = []
    current: list[memoryview] = []
    room, at = part, start
    for view in views:
        pos = 0
        while pos < view.nbytes:
            take = min(room, view.nbytes - pos)
            current.append(view[pos : pos + take])
            pos += take
            room -= take
            if room == 0:
                pieces.append((at, current))
                at += part
                current, room = [], part
    if current:
        pieces.append((at, current))
    return pieces


def _refused_digest(exc: BaseException) -> bool:
    """The server refused a body as not matching the checksum sent with it (S3 ``BadDigest``)."""
    return client_error(exc)[0] in REFUSED_DIGEST


def _same_version(state: dict, resp: dict, transfer: Transfer) -> None:
    etag = resp.get("ETag")
    if state["etag"] is None:
        state["etag"] = etag
    elif etag != state["etag"]:
        raise StorageError(
            f"s3://{transfer.bucket}/{transfer.key} was replaced while it was read (ETag {state['etag']} then "
            f"{etag}); read it again",
            path=transfer.key,
        )


class _Parts:
    """The parts of one multipart upload, sent from the producer thread, ``concurrency`` at most in flight."""

    def __init__(self, transfer: Transfer) -> None:
        self.t = transfer
        self.upload_id: str | None = None
        self.futures: list = []
        self.slots = threading.Semaphore(transfer.concurrency)
        self.failed: list[BaseException] = []
        self.sums: list[bytes] = []  # each part's raw checksum, in part order

    def send(self, views: list[memoryview]) -> None:
        t = self.t
        if self.upload_id is None:
            extra = {"ChecksumAlgorithm": t.checksum} if t.checksum else {}
            self.upload_id = t._run(t._call("create_multipart_upload", **extra)).result()["UploadId"]
        self.slots.acquire()  # at most ``concurrency`` parts in flight: the producer waits here
        if self.failed:
            self.slots.release()
            raise self.failed[0]
        body = Body(_coalesce(views))
        extra = {}
        if t.checksum:  # from the memory about to be sent, on this thread while earlier parts are in flight
            self.sums.append(raw_checksum(t.checksum, body.views))
            extra = {f"Checksum{t.checksum}": b64(self.sums[-1])}
        future = t._run(self._put(len(self.futures) + 1, body, extra))
        future.add_done_callback(self._landed)
        self.futures.append(future)

    def _landed(self, future) -> None:
        if not future.cancelled() and future.exception() is not None:
            self.failed.append(future.exception())
        self.slots.release()

    async def _put(self, number: int, body: Body, extra: dict) -> dict:
        out = await self.t.checked_call("upload_part", body, UploadId=self.upload_id, PartNumber=number, **extra)
        return {"PartNumber": number, "ETag": out["ETag"], **extra}

    def complete(self) -> None:
        done = [f.result() for f in self.futures]  # the first failure raises
        t = self.t
        out = t._run(
            t._call("complete_multipart_upload", UploadId=self.upload_id, MultipartUpload={"Parts": done})
        ).result()
        self.upload_id = None
        stated = out.get(f"Checksum{t.checksum}") if t.checksum else None
        if stated and "-" in stated and stated != composite(t.checksum, self.sums):
            # S3 assembled an object from parts other than the ones sent, in another order: never trust it
            raise StorageError(
                f"s3://{t.bucket}/{t.key}: the server states the {t.checksum} {stated} for the object assembled "
                f"from its {len(self.sums)} parts, not {composite(t.checksum, self.sums)} (the checksums of the "
                "parts sent, in order); the write failed",
                path=t.key,
            )

    def abort(self) -> None:
        """Abort the upload (nothing half-written may be published; ``gc`` aborts what this could not)."""
        if self.upload_id is None:
            return
        for future in self.futures:
            future.cancel()
        for future in self.futures:
            try:
                future.result()
            except BaseException:  # noqa: BLE001 - we are aborting: every part's fate is moot
                pass
        t = self.t
        try:
            t._run(t._call("abort_multipart_upload", UploadId=self.upload_id)).result()
        except Exception as exc:  # noqa: BLE001 - best effort; gc aborts stale uploads
            import logging

            logging.getLogger("rl_ckpt").warning(
                "could not abort multipart upload of s3://%s/%s: %s", t.bucket, t.key, exc
            )
        self.upload_id = None


def _total(content_range: str | None) -> int | None:
    """The object size from ``Content-Range: bytes a-b/size``."""
    if not content_range or "/" not in content_range:
        return None
    tail = content_range.rsplit("/", 1)[1]
    return int(tail) if tail.isdigit() else None


def _past_end(exc: BaseException) -> bool:
    """S3's 416 InvalidRange: the range starts at or past the end of the object."""
    cur: BaseException | None = exc
    for _ in range(6):
        if cur is None:
            return False
        response = getattr(cur, "response", None)
        if isinstance(response, dict) and "Error" in response:
            return response["Error"].get("Code") == "InvalidRange" or (
                response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416
            )
        cur = cur.__cause__ or cur.__context__
    return False
