"""Object stores and in-memory storage through fsspec (``memory://``, ``s3://``, ...).

Object stores have no atomic rename (``supports_rename = False``): the commit
strategy writes data objects first and the manifest last with a create-only
PUT, so two writers of one snapshot can never both commit. A single PUT is
atomic, so ``write_atomic`` is a plain PUT.

S3 (s3fs) specifics, each checked against moto's S3 server in
``tests/test_storage_contract.py``:

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
  ``DeleteObjects`` (1000 per call, per-key errors raised). It never goes
  through fsspec's ``rm``, which expands glob characters (``[``, ``*``, ``?``)
  that are legal in a checkpoint name.
- ``makedirs`` is a no-op (S3 has no folders; s3fs would even create the bucket).
- ``write`` streams through ``open("wb")`` (multipart in ``block_size`` parts
  above one block); if the chunk iterator fails the multipart upload is
  aborted, so no truncated object is published.
"""

from __future__ import annotations

import io
import logging
import threading
import time
import uuid
from typing import BinaryIO, Iterable

from ..errors import CommitConflictError, StorageError
from .base import Entry, Storage, check_relpath

log = logging.getLogger("rl_ckpt")
_S3_PROTOCOLS = ("s3", "s3a")
PARALLEL_UPLOAD_BYTES = 64 * 1024 * 1024  # larger S3 writes go as one multipart upload with parallel parts
PART_BYTES = 16 * 1024 * 1024
UPLOAD_CONCURRENCY = 8
_TOKEN_META = "rl-ckpt-writer"  # S3 user-metadata keys are lower-case
_CONFLICT_RETRIES = 8
_DELETE_BATCH = 1000
_memory_lock = threading.Lock()  # memory:// is process-local: a process lock makes create-only exact


def _client_error(exc: BaseException) -> tuple[str, int | None]:
    """(code, HTTP status) of the botocore ClientError behind ``exc``, if any."""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 6:
        response = getattr(cur, "response", None)
        if isinstance(response, dict) and "Error" in response:
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return str(response["Error"].get("Code", "")), status
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return "", None


def _is_exists(exc: BaseException) -> bool:
    """A create-only write found the path taken (only meaningful for create-only writes)."""
    if isinstance(exc, FileExistsError):
        return True
    code, status = _client_error(exc)
    return code == "PreconditionFailed" or status == 412


def _is_busy(exc: BaseException) -> bool:
    """S3 ``409 ConditionalRequestConflict``: another conditional write of the key is in flight."""
    code, _status = _client_error(exc)
    return code == "ConditionalRequestConflict"


def _as_bytes(data) -> bytes:
    return data if isinstance(data, bytes) else bytes(memoryview(data).cast("B"))


class FsspecStorage(Storage):
    supports_rename = False

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        import fsspec
        from fsspec.core import split_protocol

        self.url = url.rstrip("/")
        options = dict(storage_options or {})
        protocol = split_protocol(self.url)[0]
        self._s3 = protocol in _S3_PROTOCOLS
        if self._s3:
            options.setdefault("use_listings_cache", False)
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("retries", {"mode": "standard", "max_attempts": 5})
            options["config_kwargs"] = config
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        self.root = self.root.rstrip("/")
        from fsspec.implementations.memory import MemoryFileSystem

        self._memory = isinstance(self.fs, MemoryFileSystem)
        self._conditional_put: bool | None = None

    # -- paths -------------------------------------------------------------
    def _abs(self, path: str, *, allow_root: bool = False) -> str:
        if path == "" and allow_root:
            return self.root
        return f"{self.root}/{check_relpath(path)}"

    def _fresh(self, full: str) -> None:
        """Drop cached listings for ``full`` and its parents (another writer may have changed them)."""
        try:
            self.fs.invalidate_cache(full)
        except Exception:  # pragma: no cover - a cache drop never fails a call
            pass

    def _error(self, exc: BaseException, what: str, path: str) -> StorageError:
        return StorageError(f"{what} {self.url}/{path}: {type(exc).__name__}: {exc}", path=path)

    def _conflict(self, path: str) -> CommitConflictError:
        return CommitConflictError(f"{path} already exists: another writer committed it first", path=path, snapshot_id=path)

    # -- writes ------------------------------------------------------------
    def write(self, path: str, chunks: Iterable, *, create_only: bool = False, durable: bool = True) -> int:
        full = self._abs(path)
        if create_only:
            # Create-only writes are manifests (small): one conditional PUT (up to 5 GB).
            data = b"".join(memoryview(c).cast("B") for c in chunks)
            self._create_only(full, path, data)
            return len(data)
        if hasattr(self.fs, "_call_s3"):
            views = [memoryview(c).cast("B") for c in chunks]  # zero-copy; errors of the producer propagate
            total = sum(v.nbytes for v in views)
            if total >= PARALLEL_UPLOAD_BYTES:
                self._parallel_upload(full, path, views)
                return total
            chunks = views
        try:
            f = self.fs.open(full, "wb")
        except Exception as exc:
            raise self._error(exc, "cannot write", path) from exc
        total = 0
        try:
            for chunk in chunks:  # errors of the chunk producer propagate unchanged
                view = memoryview(chunk).cast("B")
                try:
                    f.write(view)  # uploads a part each time a block fills
                except Exception as exc:
                    raise self._error(exc, "cannot write", path) from exc
                total += view.nbytes
        except BaseException:
            self._abandon(f, full)
            raise
        try:
            f.close()  # the last part / one-shot PUT happens here
        except Exception as exc:
            raise self._error(exc, "cannot write", path) from exc
        return total

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
                    out = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id,
                                            PartNumber=number, Body=body)
                    return {"PartNumber": number, "ETag": out["ETag"]}

            try:
                done = await asyncio.gather(*(put(i + 1, body) for i, body in enumerate(parts)))
                await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id,
                                  MultipartUpload={"Parts": list(done)})
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
        """Abort multipart uploads under this root started more than ``older_than_seconds`` ago (S3 only)."""
        if not hasattr(self.fs, "_call_s3"):
            return []
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

    def _abandon(self, f, full: str) -> None:
        """Throw away a half-written file without publishing it (best effort)."""
        from fsspec.spec import AbstractBufferedFile

        try:
            if isinstance(f, AbstractBufferedFile):
                f.discard()  # s3fs: abort the multipart upload
                f.closed = True  # skip close()'s final flush, which would publish the partial object
            else:
                f.close()
                self.fs.rm_file(full)  # e.g. memory://, where the file is visible from open()
        except Exception as exc:  # best effort: gc removes whatever remains
            log.warning("could not abandon partial upload of %s: %s", full, exc)

    def write_atomic(self, path: str, data: bytes, *, create_only: bool = False) -> None:
        full = self._abs(path)
        if create_only:
            self._create_only(full, path, _as_bytes(data))
            return
        try:
            self.fs.pipe_file(full, _as_bytes(data), mode="overwrite")
        except Exception as exc:
            raise self._error(exc, "cannot write", path) from exc

    def _create_only(self, full: str, path: str, data: bytes) -> None:
        if self._memory:
            with _memory_lock:
                if self.fs.exists(full):
                    raise self._conflict(path)
                try:
                    self.fs.pipe_file(full, data, mode="overwrite")
                except Exception as exc:  # e.g. a parent is a file
                    raise self._error(exc, "cannot write", path) from exc
            return
        if not self._s3:
            # Other fsspec backends: their own mode="create" (atomic where the backend supports it).
            try:
                self.fs.pipe_file(full, data, mode="create")
            except Exception as exc:
                if _is_exists(exc):
                    raise self._conflict(path) from exc
                raise self._error(exc, "cannot write", path) from exc
            return
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
                if _is_exists(exc) and ours is False:
                    raise self._conflict(path) from exc
                outcome = ("it did not land" if ours is False
                           else f"whether it landed is unknown: the check failed too ({check_error})")
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
    def read(self, path: str, *, on_chunk=None) -> bytearray:
        full = self._abs(path)
        try:
            data = bytearray(self.fs.cat_file(full))
        except Exception as exc:
            raise self._error(exc, "cannot read", path) from exc
        if on_chunk is not None:
            on_chunk(memoryview(data))
        return data

    def open_read(self, path: str) -> BinaryIO:
        full = self._abs(path)
        self._fresh(full)
        try:
            if self._memory:
                # memory:// hands out the stored object itself (one shared position): copy it
                return io.BytesIO(self.fs.cat_file(full))
            return self.fs.open(full, "rb")
        except Exception as exc:
            raise self._error(exc, "cannot open", path) from exc

    # -- namespace ---------------------------------------------------------
    def list(self, path: str = "") -> list[Entry]:
        full = self._abs(path, allow_root=True)
        self._fresh(full)
        try:
            items = self.fs.ls(full, detail=True, refresh=True) if "refresh" in _ls_params(self.fs) else self.fs.ls(full, detail=True)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return []
        except Exception as exc:
            raise self._error(exc, "cannot list", path or ".") from exc
        out = []
        prefix = full.rstrip("/") + "/"
        for item in items:
            name_full = item["name"].rstrip("/")
            if name_full == full.rstrip("/") or not (name_full + "/").startswith(prefix):
                continue  # the path itself (a file, or an S3 folder marker)
            name = name_full.rsplit("/", 1)[-1]
            if not name:
                continue
            mtime = item.get("LastModified") or item.get("mtime") or item.get("created")
            out.append(Entry(name, item.get("type") == "directory", int(item.get("size") or 0), _ts(mtime)))
        return out

    def exists(self, path: str) -> bool:
        full = self._abs(path, allow_root=True)
        self._fresh(full)
        try:
            return bool(self.fs.exists(full))
        except Exception as exc:
            raise self._error(exc, "cannot check", path) from exc

    def size(self, path: str) -> int:
        full = self._abs(path)
        self._fresh(full)
        try:
            return int(self.fs.size(full))
        except Exception as exc:
            raise self._error(exc, "cannot stat", path) from exc

    def stat(self, path: str) -> Entry | None:
        full = self._abs(path)
        self._fresh(full)
        try:
            info = self.fs.info(full)
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._error(exc, "cannot stat", path) from exc
        size = int(info.get("size") or 0)
        mtime = info.get("LastModified") or info.get("mtime") or info.get("created")
        tag = info.get("ETag") or info.get("VersionId")
        # An object store replaces whole objects: its ETag (or time of the last PUT) names this content.
        version = f"{tag}:{size}" if tag else (f"{mtime}:{size}" if mtime is not None else None)
        return Entry(path.rsplit("/", 1)[-1], info.get("type") == "directory", size, _ts(mtime), version)

    def remove(self, path: str) -> None:
        full = self._abs(path)
        try:
            self.fs.rm_file(full)
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._error(exc, "cannot remove", path) from exc
        finally:
            self._fresh(full)

    def remove_tree(self, path: str) -> None:
        full = self._abs(path)  # never the root: "" is refused
        self._fresh(full)
        try:
            if self._s3:
                self._remove_tree_s3(full)
            else:
                self._remove_tree_generic(full)
        except FileNotFoundError:
            pass
        except StorageError:
            raise
        except Exception as exc:
            raise self._error(exc, "cannot remove", path) from exc
        finally:
            self._fresh(full)

    def _remove_tree_s3(self, full: str) -> None:
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
                    f"cannot remove {len(errors)} object(s) under {self.url}/{full[len(self.root) + 1:]}: "
                    f"{first.get('Key')}: {first.get('Code')} {first.get('Message', '')}",
                    path=full[len(self.root) + 1 :],
                )

    def _remove_tree_generic(self, full: str) -> None:
        found = self.fs.find(full, withdirs=True, detail=True)
        files = [n for n, info in found.items() if info.get("type") != "directory"]
        dirs = [n for n, info in found.items() if info.get("type") == "directory"]
        for name in files:
            try:
                self.fs.rm_file(name)
            except FileNotFoundError:
                pass
        if self.fs.isdir(full) and full not in dirs:
            dirs.append(full)
        for name in sorted(dirs, key=len, reverse=True):  # deepest first
            try:
                self.fs.rmdir(name)
            except (FileNotFoundError, NotADirectoryError):
                pass

    def makedirs(self, path: str) -> None:
        full = self._abs(path)
        if self._s3:
            return  # S3 has no folders (and s3fs.makedirs would create a missing bucket)
        try:
            self.fs.makedirs(full, exist_ok=True)
        except Exception as exc:
            raise self._error(exc, "cannot create folder", path) from exc

    def sync_dir(self, path: str) -> None:
        self._abs(path, allow_root=True)  # checked like every other path; nothing to sync


def _ls_params(fs) -> tuple:
    import inspect

    try:
        return tuple(inspect.signature(fs.ls).parameters)
    except (TypeError, ValueError):
        return ()


def _ts(value) -> float | None:
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "timestamp"):
        return value.timestamp()
    return None
