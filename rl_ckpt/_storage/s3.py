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
- Transfers (``rl_ckpt._storage.s3_transfer``): ``write`` streams the chunks as parts of
  ``default_block_size`` bytes (8 MiB unless set) while they are produced, ``max_concurrency``
  parts in flight (16 unless set), without a joined copy; a write shorter than one part is one
  PUT. A failed upload is aborted, and ``abort_incomplete_uploads`` (``rl-ckpt gc``) aborts those
  a killed writer left. ``read``, ``read_ranges``, large ``read_range`` and the stream of
  ``open_read`` are ranged GETs of at most one part each, ``max_concurrency`` in flight, landing
  straight in the buffer returned (no HEAD: the first answer's ``Content-Range`` tells the size).
  ``read(max_bytes=N)`` asks for the first N bytes only and refuses a larger object from the size
  S3 states, so no more than the cap is ever read.
- Checksums the server checks: each part and PUT of a ``write`` carries the CRC32 (storage option
  ``server_checksums``: ``"crc32"``, ``"sha256"``, or ``False``) of its body, computed from the memory
  sent. Before the first such write, one probe PUT with a wrong checksum (no retries) shows whether
  the endpoint refuses it (``BadDigest``), as S3 does; then ``write_attested`` answers True for the
  object, and verify-after-write does not read it back. An endpoint that stores the probe (moto,
  some S3-compatible stores) does not check: the probe object is deleted, and objects are read
  back. The answer is kept per endpoint and bucket for the process.
- The client skips botocore's SHA-256 of every request body over plain-HTTP endpoints
  (``payload_signing_enabled=False``, what it does over HTTPS) and its own CRC32 of every body
  (``request_checksum_calculation="when_required"``): the checksums above, or the read-back, check
  what both would, end to end. A caller's ``config_kwargs`` win (with ``"when_supported"`` and
  ``server_checksums=False``, each part and PUT carries the CRC32 of its body, not trusted).
"""

from __future__ import annotations

import copy
import threading
import time
import uuid
from typing import Iterable

from rl_ckpt.errors import ConfigError, StorageError
from rl_ckpt._storage.fsspec_store import FsspecStorage, client_error, is_exists
from rl_ckpt._storage.s3_reads import S3Reads
from rl_ckpt._storage.s3_view import ReadSessions, S3Views
from rl_ckpt._storage.s3_checksums import S3Checksums, server_checksum
from rl_ckpt._storage.s3_transfer import DEFAULT_CONCURRENCY, DEFAULT_PART_BYTES, Transfer

_TOKEN_META = "rl-ckpt-writer"  # S3 user-metadata keys are lower-case
_CONFLICT_RETRIES = 8
_DELETE_BATCH = 1000


def _is_busy(exc: BaseException) -> bool:
    """S3 ``409 ConditionalRequestConflict``: another conditional write of the key is in flight."""
    code, _status = client_error(exc)
    return code == "ConditionalRequestConflict"


class S3Storage(S3Checksums, S3Views, S3Reads, FsspecStorage):
    """``s3://`` and ``s3a://`` run folders (AWS S3 and compatible servers, via s3fs)."""

    files_at_once = 4

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        super().__init__(url, storage_options)
        self._conditional_put: bool | None = None
        self._reads = ReadSessions()
        self._attested: dict[str, int] = {}  # path -> size of its last write the server checked
        self._attested_lock = threading.Lock()  # component files are written at once

    def write_stream_atomic(self, path: str, chunks) -> int:
        # An object appears only when its (multipart) upload completes; an abandoned upload is aborted.
        return self.write(path, chunks, durable=True)

    def _options(self, options: dict) -> dict:
        self._server_checksum = server_checksum(options.pop("server_checksums", "crc32"))
        options.setdefault("use_listings_cache", False)
        options.setdefault("default_block_size", DEFAULT_PART_BYTES)
        options.setdefault("max_concurrency", DEFAULT_CONCURRENCY)
        for key in ("default_block_size", "max_concurrency"):
            value = options[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"storage option {key!r}: got {value!r}; allowed: an integer >= 1", key=key, allowed="int >= 1"
                )
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"mode": "standard", "max_attempts": 5})
        # No CRC32 of every body by default: computed from the caller's memory it held a save to ~250 MB/s on one
        # core, and what it checks (the bytes arrived as sent) verify-after-write checks end to end, and TLS in
        # transit. "when_supported" has it back (then each part and PUT carries its CRC32, which S3 checks).
        config.setdefault("request_checksum_calculation", "when_required")
        # botocore's 60 s rather than s3fs's 15 s to wait for an answer: with parts in flight on a slow or busy
        # link, 15 s makes parts time out and be sent again while the first copy is still on its way.
        config.setdefault("read_timeout", 60)
        s3_config = dict(config.get("s3") or {})
        s3_config.setdefault("payload_signing_enabled", False)
        config["s3"] = s3_config
        options["config_kwargs"] = config
        self._fs_options = copy.deepcopy(options)  # for the probe's client of its own
        return options

    def _transfer(self, full: str, checksum: str | None = None) -> Transfer:
        bucket, key, _ = self.fs.split_path(full)
        return Transfer(
            self.fs,
            bucket,
            key,
            part_bytes=int(self.fs.default_block_size),
            concurrency=int(self.fs.max_concurrency),
            checksum=checksum,
        )

    # -- writes ------------------------------------------------------------
    def write(self, path: str, chunks: Iterable, *, create_only: bool = False, durable: bool = True) -> int:
        """Write ``chunks`` as one object: parts stream out while the chunks are produced. The chunks are sent
        from the caller's memory: it must not change them until this returns."""
        self._reads.changed()
        if create_only:
            try:
                return super().write(path, chunks, create_only=True, durable=durable)
            finally:
                self._reads.changed()
        full = self._abs(path)
        with self._attested_lock:
            self._attested.pop(path, None)
        checked, checksum = self.part_checksum()
        transfer = self._transfer(full, checksum)
        try:
            # errors of the producer propagate unchanged; a request's become a StorageError naming the path
            size = transfer.upload(chunks, lambda exc: self._error(exc, "cannot upload", path))
            if checked:  # every part carried the checksum the endpoint checks, and every part was taken
                self.attest(path, size)
            return size
        except StorageError:
            raise
        finally:
            self._fresh(full)
            self._reads.changed()

    def write_atomic(self, path: str, data, *, create_only: bool = False) -> None:
        if create_only:
            self._reads.changed()
            try:
                return super().write_atomic(path, data, create_only=True)
            finally:
                self._reads.changed()
        self.write(path, [data])  # one PUT: the object appears whole or not at all

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
