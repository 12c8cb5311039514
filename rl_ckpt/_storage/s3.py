"""S3 (through s3fs): what plain fsspec calls do not give, each checked against moto's S3 server in
``tests/test_storage_contract.py``.

- Create-only: one ``PutObject`` with ``IfNoneMatch="*"`` (what s3fs
  ``pipe_file(mode="create")`` sends, issued directly so an s3fs without
  ``mode`` cannot silently drop it; a botocore whose model lacks the parameter
  is refused). S3 answers ``412 PreconditionFailed`` (``Condition:
  If-None-Match``) when the key exists, which s3fs raises as
  ``FileExistsError`` (the botocore ``ClientError`` is its ``__cause__``).
  That, and only that, becomes ``CommitConflictError``.
  ``409 ConditionalRequestConflict`` (another conditional write of the key is
  in flight) is retried: the retry either wins or gets the 412.
- A retried PUT whose first try did land (response lost, botocore/s3fs retried)
  would see its *own* object and get a 412. Each create-only PUT therefore
  carries a random token in its user metadata; on a 412 (or on any error) the
  object is HEADed and, if it carries our token, the write succeeded.
- Listings: s3fs caches directory listings per instance (and instances are
  shared per options), so ``exists``/``list``/``size`` could answer from a
  listing taken before another process wrote or deleted. The listings cache is
  off by default here (``use_listings_cache=False``) and every metadata call
  also drops the cached entries for its path first.
- Retries: botocore runs in ``standard`` retry mode with 5 attempts (5xx,
  throttling, connection errors; exponential backoff with jitter) unless the
  caller set ``config_kwargs["retries"]``; s3fs adds its own ``retries=5`` loop
  for timeouts and dropped connections.
- ``remove_tree`` lists the keys under ``<path>/`` and deletes them with
  ``DeleteObjects`` (1000 per call, per-key errors raised).
- ``makedirs`` is a no-op (S3 has no folders; s3fs would even create the bucket).
- ``write`` of ``PARALLEL_UPLOAD_BYTES`` and more is one multipart upload with
  ``UPLOAD_CONCURRENCY`` parts in flight; smaller writes stream through
  ``open("wb")`` (multipart in ``block_size`` parts above one block). A failed
  upload is aborted, and ``abort_incomplete_uploads`` (``rl-ckpt gc``) aborts
  those a killed writer left.
- ``read_range`` is one ranged GET; ``read(max_bytes=)`` HEADs first and never
  GETs more than the cap.
"""

from __future__ import annotations

import time
import uuid
from typing import Iterable

from rl_ckpt.errors import StorageError
from rl_ckpt._storage.base import check_range, range_past_end
from rl_ckpt._storage.fsspec_store import FsspecStorage, client_error, is_exists, log

PARALLEL_UPLOAD_BYTES = 64 * 1024 * 1024  # larger S3 writes go as one multipart upload with parallel parts
PART_BYTES = 16 * 1024 * 1024
UPLOAD_CONCURRENCY = 8
_TOKEN_META = "rl-ckpt-writer"  # S3 user-metadata keys are lower-case
_CONFLICT_RETRIES = 8
_DELETE_BATCH = 1000


def _is_busy(exc: BaseException) -> bool:
    """S3 ``409 ConditionalRequestConflict``: another conditional write of the key is in flight."""
    code, _status = client_error(exc)
    return code == "ConditionalRequestConflict"


class S3Storage(FsspecStorage):
    """``s3://`` and ``s3a://`` run folders (AWS S3 and compatible servers, via s3fs)."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        super().__init__(url, storage_options)
        self._conditional_put: bool | None = None

    def write_stream_atomic(self, path: str, chunks) -> int:
        # An object appears only when its (multipart) upload completes; an abandoned upload is aborted.
        return self.write(path, chunks, durable=True)

    def _options(self, options: dict) -> dict:
        options.setdefault("use_listings_cache", False)
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"mode": "standard", "max_attempts": 5})
        options["config_kwargs"] = config
        return options

    # -- writes ------------------------------------------------------------
    def write(self, path: str, chunks: Iterable, *, create_only: bool = False, durable: bool = True) -> int:
        if create_only:
            return super().write(path, chunks, create_only=True, durable=durable)
        full = self._abs(path)
        views = [memoryview(c).cast("B") for c in chunks]  # zero-copy; errors of the producer propagate
        total = sum(v.nbytes for v in views)
        if total >= PARALLEL_UPLOAD_BYTES:
            self._parallel_upload(full, path, views)
            return total
        return super().write(path, views, durable=durable)

    def _parallel_upload(self, full: str, path: str, views: list) -> None:
        """One multipart upload with up to ``UPLOAD_CONCURRENCY`` parts in flight; aborted on any failure."""
        import asyncio

        from fsspec.asyn import sync

        parts: list[bytes] = []
        pending: list[memoryview] = []
        size = 0
        for view in views:
            while view.nbytes:
                take = min(view.nbytes, PART_BYTES - size)
                pending.append(view[:take])
                size += take
                view = view[take:]
                if size == PART_BYTES:
                    parts.append(b"".join(pending))
                    pending, size = [], 0
        if pending:
            parts.append(b"".join(pending))
        bucket, key, _ = self.fs.split_path(full)
        fs = self.fs

        async def upload() -> None:
            mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
            upload_id = mpu["UploadId"]
            gate = asyncio.Semaphore(UPLOAD_CONCURRENCY)

            async def put(number: int, body: bytes) -> dict:
                async with gate:
                    out = await fs._call_s3(
                        "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
                    )
                    return {"PartNumber": number, "ETag": out["ETag"]}

            try:
                done = await asyncio.gather(*(put(i + 1, body) for i, body in enumerate(parts)))
                await fs._call_s3(
                    "complete_multipart_upload",
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": list(done)},
                )
            except BaseException:
                try:  # nothing half-written may be published; gc aborts what this could not
                    await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
                except Exception as abort_error:
                    log.warning("could not abort multipart upload of %s: %s", full, abort_error)
                raise

        try:
            sync(self.fs.loop, upload)
        except Exception as exc:
            raise self._error(exc, "cannot upload", path) from exc
        self.fs.invalidate_cache(full)

    def abort_incomplete_uploads(self, older_than_seconds: float) -> list[str]:
        """Abort multipart uploads under this root started more than ``older_than_seconds`` ago."""
        import datetime as dt

        from fsspec.asyn import sync

        bucket, prefix, _ = self.fs.split_path(self.root)
        fs = self.fs
        now = dt.datetime.now(dt.timezone.utc)

        async def sweep() -> list[str]:
            out = await fs._call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix.rstrip("/") + "/")
            aborted = []
            for up in out.get("Uploads", []):
                if (now - up["Initiated"]).total_seconds() >= older_than_seconds:
                    await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
                    aborted.append(up["Key"])
            return aborted

        try:
            return sync(self.fs.loop, sweep)
        except Exception as exc:
            raise self._error(exc, "cannot list multipart uploads under", ".") from exc

    def _create_only(self, full: str, path: str, data: bytes) -> None:
        self._check_conditional_put()
        bucket, key, _ = self.fs.split_path(full)
        token = uuid.uuid4().hex
        for attempt in range(_CONFLICT_RETRIES):
            try:
                # put_object directly (not pipe_file(mode="create"), which older s3fs
                # releases do not know and would turn into a plain PUT without a word).
                self.fs.call_s3(
                    "put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*", Metadata={_TOKEN_META: token}
                )
                return
            except Exception as exc:
                if _is_busy(exc) and attempt + 1 < _CONFLICT_RETRIES:
                    time.sleep(min(0.05 * 2**attempt, 2.0))
                    continue
                ours, check_error = self._written_by(bucket, key, token)
                if ours:
                    return  # an earlier try of this call landed; a retry then met our own object
                if is_exists(exc) and ours is False:
                    raise self._conflict(path) from exc
                outcome = (
                    "it did not land"
                    if ours is False
                    else f"whether it landed is unknown: the check failed too ({check_error})"
                )
                raise StorageError(
                    f"cannot write {self.url}/{path}: {type(exc).__name__}: {exc} (create-only write; {outcome})",
                    path=path,
                ) from exc
            finally:
                self._fresh(full)

    def _check_conditional_put(self) -> None:
        """Refuse create-only writes if this botocore cannot send ``If-None-Match`` on PutObject.

        s3fs drops request parameters the botocore model does not know, so an
        old botocore would turn the conditional PUT into a plain overwrite.
        """
        if self._conditional_put is None:
            try:
                members = self.fs.s3.meta.service_model.operation_model("PutObject").input_shape.members
                self._conditional_put = "IfNoneMatch" in members
            except Exception:  # cannot tell (unusual client): rely on the server
                self._conditional_put = True
        if not self._conditional_put:
            raise StorageError(
                f"cannot write create-only on {self.url}: this botocore has no If-None-Match for PutObject, "
                "so two writers could both commit. Upgrade botocore (>= 1.35.20) / aiobotocore.",
                path=self.url,
            )

    def _written_by(self, bucket: str, key: str, token: str) -> tuple[bool | None, str]:
        """Whether the object carries our token: True, False (absent or another writer's), or None (cannot
        tell: the second item says why; the caller puts it in the StorageError it raises)."""
        try:
            head = self.fs.call_s3("head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return False, ""
        except Exception as exc:  # noqa: BLE001 - any failure of the check means "unknown"; it is reported, not lost
            return None, f"{type(exc).__name__}: {exc}"
        return (head.get("Metadata") or {}).get(_TOKEN_META) == token, ""

    # -- reads -------------------------------------------------------------
    def read_range(self, path: str, start: int, length: int) -> bytes:
        """One ranged GET (the server sends no more than the object has); only a short or refused answer
        costs a HEAD, to tell a range past the end from an object replaced meanwhile."""
        check_range(start, length)
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

    # -- namespace ---------------------------------------------------------
    def _remove_tree_contents(self, full: str) -> None:
        bucket, key, _ = self.fs.split_path(full)
        keys: list[str] = []
        token = None
        while True:  # every key equal to ``key`` or under ``key/`` (not ``key2``)
            kw = {"Bucket": bucket, "Prefix": key + "/"}
            if token:
                kw["ContinuationToken"] = token
            page = self.fs.call_s3("list_objects_v2", **kw)
            keys.extend(obj["Key"] for obj in page.get("Contents", []))
            if not page.get("IsTruncated"):
                break
            token = page["NextContinuationToken"]
        keys.append(key)  # a file at the path itself (deleting a missing key is fine on S3)
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = keys[i : i + _DELETE_BATCH]
            out = self.fs.call_s3(
                "delete_objects", Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
            )
            errors = [e for e in out.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise StorageError(
                    f"cannot remove {len(errors)} object(s) under {self.url}/{full[len(self.root) + 1 :]}: "
                    f"{first.get('Key')}: {first.get('Code')} {first.get('Message', '')}",
                    path=full[len(self.root) + 1 :],
                )

    def makedirs(self, path: str) -> None:
        self._abs(path)  # checked like every other path
        # S3 has no folders (and s3fs.makedirs would create a missing bucket): nothing to do.
