"""Object stores and in-memory storage through fsspec (``memory://``, ``s3://``, ...).

Object stores have no atomic rename (``supports_rename = False``): the commit
strategy writes data objects first and the manifest last with a create-only
PUT (s3fs ``mode="create"`` sends ``If-None-Match: *``), so two writers of one
snapshot can never both commit. A single PUT is atomic, so ``write_atomic`` is
a plain PUT.
"""

from __future__ import annotations

from typing import BinaryIO, Iterable

from ..errors import CommitConflictError, StorageError
from .base import Entry, Storage, check_relpath


def _is_conflict(exc: BaseException) -> bool:
    if isinstance(exc, FileExistsError):
        return True
    text = f"{type(exc).__name__} {exc}"
    return "PreconditionFailed" in text or "412" in text or "ConditionalRequestConflict" in text


class FsspecStorage(Storage):
    supports_rename = False

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = self.root.rstrip("/")

    def _abs(self, path: str) -> str:
        if path == "":
            return self.root
        return f"{self.root}/{check_relpath(path)}"

    def _error(self, exc: BaseException, what: str, path: str) -> StorageError:
        if _is_conflict(exc):
            return CommitConflictError(f"{path} already exists: another writer committed it first", path=path, snapshot_id=path)
        return StorageError(f"{what} {self.url}/{path}: {type(exc).__name__}: {exc}", path=path)

    def write(self, path: str, chunks: Iterable, *, create_only: bool = False, durable: bool = True) -> int:
        full = self._abs(path)
        try:
            if create_only:
                data = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
                self.fs.pipe_file(full, data, mode="create")
                return len(data)
            total = 0
            with self.fs.open(full, "wb") as f:  # s3fs streams large files as multipart parts
                for chunk in chunks:
                    view = memoryview(chunk).cast("B")
                    f.write(view)
                    total += view.nbytes
            return total
        except (OSError, ValueError, RuntimeError) as exc:
            raise self._error(exc, "cannot write", path) from exc
        except Exception as exc:  # botocore/aiohttp errors do not derive from OSError
            raise self._error(exc, "cannot write", path) from exc

    def write_atomic(self, path: str, data: bytes, *, create_only: bool = False) -> None:
        full = self._abs(path)
        try:
            self.fs.pipe_file(full, bytes(data), mode="create" if create_only else "overwrite")
        except Exception as exc:
            raise self._error(exc, "cannot write", path) from exc

    def read(self, path: str) -> bytearray:
        try:
            return bytearray(self.fs.cat_file(self._abs(path)))
        except Exception as exc:
            raise self._error(exc, "cannot read", path) from exc

    def open_read(self, path: str) -> BinaryIO:
        try:
            return self.fs.open(self._abs(path), "rb")
        except Exception as exc:
            raise self._error(exc, "cannot open", path) from exc

    def list(self, path: str = "") -> list[Entry]:
        full = self._abs(path)
        try:
            items = self.fs.ls(full, detail=True, refresh=True) if "refresh" in _ls_params(self.fs) else self.fs.ls(full, detail=True)
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise self._error(exc, "cannot list", path or ".") from exc
        out = []
        for item in items:
            name = item["name"].rstrip("/").rsplit("/", 1)[-1]
            if not name or item["name"].rstrip("/") == full.rstrip("/"):
                continue
            mtime = item.get("LastModified") or item.get("mtime") or item.get("created")
            out.append(Entry(name, item.get("type") == "directory", int(item.get("size") or 0), _ts(mtime)))
        return out

    def exists(self, path: str) -> bool:
        try:
            return bool(self.fs.exists(self._abs(path)))
        except Exception as exc:
            raise self._error(exc, "cannot check", path) from exc

    def size(self, path: str) -> int:
        try:
            return int(self.fs.size(self._abs(path)))
        except Exception as exc:
            raise self._error(exc, "cannot stat", path) from exc

    def remove(self, path: str) -> None:
        try:
            self.fs.rm_file(self._abs(path))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._error(exc, "cannot remove", path) from exc

    def remove_tree(self, path: str) -> None:
        try:
            self.fs.rm(self._abs(path), recursive=True)
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._error(exc, "cannot remove", path) from exc

    def makedirs(self, path: str) -> None:
        try:
            self.fs.makedirs(self._abs(path), exist_ok=True)
        except Exception as exc:
            raise self._error(exc, "cannot create folder", path) from exc


def _ls_params(fs) -> tuple:
    import inspect

    try:
        return tuple(inspect.signature(fs.ls).parameters)
    except (TypeError, ValueError):
        return ()


def _ts(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "timestamp"):
        return value.timestamp()
    return None

