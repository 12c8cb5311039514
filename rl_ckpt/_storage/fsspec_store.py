"""Any fsspec filesystem as a :class:`Storage` (the fallback for protocols without a class of their own).

Object stores have no atomic rename (``supports_rename = False``): the commit
strategy writes data objects first and the manifest last with a create-only
write, so two writers of one snapshot can never both commit. A single PUT is
atomic, so ``write_atomic`` is a plain PUT.

Protocols that need more than plain fsspec calls have a subclass, chosen by
``open_storage`` (``rl_ckpt._storage.registry``): :class:`~rl_ckpt._storage.s3.S3Storage`
(conditional PUTs, parallel multipart uploads, batch deletes, aborting stale
uploads) and :class:`~rl_ckpt._storage.memory.MemoryStorage`. Subclasses
override the hooks ``_create_only``, ``_remove_tree_contents`` and ``_options``.

``write`` streams through ``open("wb")`` (``rl_ckpt._storage.fsspec_upload``); if
the chunk iterator fails the partial file is thrown away (block-buffered files,
such as s3fs's, abort their multipart upload), so no truncated object is published.
"""

from __future__ import annotations

import logging
import os
from typing import BinaryIO, Iterable

from rl_ckpt.errors import CommitConflictError, StorageError, StoragePermissionError
from rl_ckpt._storage.base import (
    Entry,
    Storage,
    check_max_bytes,
    check_range,
    check_relpath,
    range_past_end,
    too_large,
    unique_suffix,
)
from rl_ckpt._storage.fsspec_upload import stream_file
from rl_ckpt._storage.local_io import resolve

log = logging.getLogger("rl_ckpt")


def local_root_of(fs, root: str) -> str | None:
    """The local folder behind ``root`` when ``fs`` is the local disk (``local://``, chained ``simplecache::``,
    ``dir::``), else None. A local disk can hold symbolic links, which fsspec follows: a snapshot file linked
    to bytes elsewhere would pass its checksum, so such paths get LocalStorage's checks (every part lstat-ed)."""
    from fsspec.implementations.dirfs import DirFileSystem
    from fsspec.implementations.local import LocalFileSystem

    prefix = ""
    for _ in range(4):  # wrappers: a caching layer passes paths through, a dir:: one prefixes its own path
        if isinstance(fs, LocalFileSystem):
            return os.path.abspath(os.path.join(prefix, root) if prefix else root)
        if isinstance(fs, DirFileSystem):
            prefix = f"{fs.path.rstrip('/')}/{prefix}" if prefix else fs.path
        inner = getattr(fs, "fs", None)
        if inner is None or inner is fs:
            return None
        fs = inner
    return None


def client_error(exc: BaseException) -> tuple[str, int | None]:
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


def is_exists(exc: BaseException) -> bool:
    """A create-only write found the path taken (only meaningful for create-only writes)."""
    if isinstance(exc, FileExistsError):
        return True
    code, status = client_error(exc)
    return code == "PreconditionFailed" or status == 412


def _as_bytes(data) -> bytes:
    return data if isinstance(data, bytes) else bytes(memoryview(data).cast("B"))


class FsspecStorage(Storage):
    supports_rename = False

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        import fsspec

        self.url = url.rstrip("/")
        options = self._options(dict(storage_options or {}))
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        self.root = self.root.rstrip("/")
        self.local_root = local_root_of(self.fs, self.root)  # links are refused on a local disk behind fsspec

    def _options(self, options: dict) -> dict:
        """The fsspec options to open the filesystem with (subclasses add their defaults)."""
        return options

    # -- paths -------------------------------------------------------------
    def _abs(self, path: str, *, allow_root: bool = False) -> str:
        if path == "" and allow_root:
            return self.root
        rel = check_relpath(path)
        if self.local_root is not None:  # every part lstat-ed, as LocalStorage does: a link is never followed
            resolve(self.local_root, rel)
        return f"{self.root}/{rel}"

    def _fresh(self, full: str) -> None:
        """Drop cached listings for ``full`` and its parents (another writer may have changed them)."""
        try:
            self.fs.invalidate_cache(full)
        except Exception:  # pragma: no cover - a cache drop never fails a call
            pass

    def _error(self, exc: BaseException, what: str, path: str) -> StorageError:
        if isinstance(exc, PermissionError):
            return StoragePermissionError(
                f"{what} {self.url}/{path}: access denied ({exc}): check the credentials in storage_options and "
                "that they may read (and, to save, write) this location",
                path=path,
            )
        return StorageError(f"{what} {self.url}/{path}: {type(exc).__name__}: {exc}", path=path)

    def _conflict(self, path: str) -> CommitConflictError:
        return CommitConflictError(
            f"{path} already exists: another writer committed it first", path=path, snapshot_id=path
        )

    # -- writes ------------------------------------------------------------
    def write(self, path: str, chunks: Iterable, *, create_only: bool = False, durable: bool = True) -> int:
        full = self._abs(path)
        if create_only:
            # Create-only writes are manifests (small): one conditional write.
            data = b"".join(memoryview(c).cast("B") for c in chunks)
            self._create_only(full, path, data)
            return len(data)
        return stream_file(self.fs, full, chunks, lambda exc: self._error(exc, "cannot write", path))

    def write_stream_atomic(self, path: str, chunks: Iterable) -> int:
        # A file may show while written (and is removed when abandoned): write a temp, move it in place.
        target = self._abs(path)  # checked like every other path before anything is written
        tmp = f"{path}.tmp-{unique_suffix()}"
        size = self.write(tmp, chunks, durable=True)
        try:
            self.fs.mv(self._abs(tmp), target)
        except Exception as exc:
            self.remove(tmp)
            raise self._error(exc, "cannot publish", path) from exc
        return size

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
        """Write ``data`` unless ``full`` exists (``CommitConflictError``): the backend's own
        ``mode="create"``. Only as atomic as the backend makes it (fsspec's default checks, then
        writes): a protocol whose writers may race gets a class of its own in the registry."""
        try:
            self.fs.pipe_file(full, data, mode="create")
        except Exception as exc:
            if is_exists(exc):
                raise self._conflict(path) from exc
            raise self._error(exc, "cannot write", path) from exc

    # -- reads -------------------------------------------------------------
    def read(self, path: str, *, on_chunk=None, max_bytes: int | None = None) -> bytearray:
        check_max_bytes(max_bytes)
        full = self._abs(path)
        try:
            if max_bytes is None:
                data = bytearray(self.fs.cat_file(full))
            else:
                data = self._read_capped(full, path, max_bytes)
        except StorageError:
            raise
        except Exception as exc:
            raise self._error(exc, "cannot read", path) from exc
        if on_chunk is not None:
            on_chunk(memoryview(data))
        return data

    def _read_capped(self, full: str, path: str, max_bytes: int) -> bytearray:
        """Size first, then a read of exactly that many bytes (as a local read: an object that grows
        meanwhile is never read past the size that passed the check)."""
        size = self._file_size(full)
        if size > max_bytes:
            raise too_large(path, size, max_bytes)
        if size == 0:
            return bytearray()  # a ranged read of an empty object is refused by S3 (416)
        data = bytearray(self.fs.cat_file(full, start=0, end=size))
        if len(data) != size:
            raise StorageError(
                f"short read of {path}: {len(data)} of {size} bytes (file changed while reading?)", path=path
            )
        return data

    def _file_size(self, full: str) -> int:
        """Size of the file at ``full`` from fresh metadata; a folder is not a file."""
        self._fresh(full)
        info = self.fs.info(full)
        if info.get("type") == "directory":
            raise IsADirectoryError(f"{full} is a folder, not a file")
        return int(info.get("size") or 0)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """Size first (some backends allocate the whole requested range before reading), then one
        ``cat_file(path, start, end)``."""
        check_range(start, length)
        full = self._abs(path)
        try:
            size = self._file_size(full)
            if start + length > size:
                raise range_past_end(path, start, length, size)
            data = self.fs.cat_file(full, start=start, end=start + length) if length else b""
        except StorageError:
            raise
        except Exception as exc:
            raise self._error(exc, "cannot read", path) from exc
        if len(data) != length:  # the file shrank between the two calls
            raise range_past_end(path, start, length, start + len(data))
        return bytes(data)

    def open_read(self, path: str) -> BinaryIO:
        full = self._abs(path)
        self._fresh(full)
        try:
            return self.fs.open(full, "rb")
        except Exception as exc:
            raise self._error(exc, "cannot open", path) from exc

    # -- namespace ---------------------------------------------------------
    def list(self, path: str = "") -> list[Entry]:
        full = self._abs(path, allow_root=True)
        self._fresh(full)
        try:
            items = (
                self.fs.ls(full, detail=True, refresh=True)
                if "refresh" in _ls_params(self.fs)
                else self.fs.ls(full, detail=True)
            )
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return []
        except Exception as exc:
            raise self._error(exc, "cannot list", path or ".") from exc
        return _entries(items, full)

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
        return _entry(path, info)

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
            self._remove_tree_contents(full)
        except FileNotFoundError:
            pass
        except StorageError:
            raise
        except Exception as exc:
            raise self._error(exc, "cannot remove", path) from exc
        finally:
            self._fresh(full)

    def _remove_tree_contents(self, full: str) -> None:
        """Delete ``full`` and everything under it, file by file (never fsspec's ``rm``, which expands
        glob characters such as ``[``, ``*``, ``?`` that are legal in a checkpoint name)."""
        _remove_files_then_folders(self.fs, full)

    def makedirs(self, path: str) -> None:
        full = self._abs(path)
        try:
            self.fs.makedirs(full, exist_ok=True)
        except Exception as exc:
            raise self._error(exc, "cannot create folder", path) from exc

    def sync_dir(self, path: str) -> None:
        self._abs(path, allow_root=True)  # checked like every other path; nothing to sync


def _entries(items: list, full: str) -> list[Entry]:
    """The entries of an ``ls(full, detail=True)`` listing, without ``full`` itself."""
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


def _entry(path: str, info: dict) -> Entry:
    """The entry of ``path`` from its ``info()``, with a version naming this content."""
    size = int(info.get("size") or 0)
    mtime = info.get("LastModified") or info.get("mtime") or info.get("created")
    tag = info.get("ETag") or info.get("VersionId")
    # An object store replaces whole objects: its ETag (or time of the last PUT) names this content.
    version = f"{tag}:{size}" if tag else (f"{mtime}:{size}" if mtime is not None else None)
    return Entry(path.rsplit("/", 1)[-1], info.get("type") == "directory", size, _ts(mtime), version)


def _remove_files_then_folders(fs, full: str) -> None:
    """``full`` and everything under it, file by file, then the folders deepest first."""
    found = fs.find(full, withdirs=True, detail=True)
    files = [n for n, info in found.items() if info.get("type") != "directory"]
    dirs = [n for n, info in found.items() if info.get("type") == "directory"]
    for name in files:
        try:
            fs.rm_file(name)
        except FileNotFoundError:
            pass
    if fs.isdir(full) and full not in dirs:
        dirs.append(full)
    for name in sorted(dirs, key=len, reverse=True):  # deepest first
        try:
            fs.rmdir(name)
        except (FileNotFoundError, NotADirectoryError):
            pass


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
