"""Local disks and NFS mounts, through the OS directly (fsspec's local backend never fsyncs).

Durability rules (what a kill -9 or a power cut leaves):
- ``write`` fsyncs the file before returning; an fsync error fails the write
  and is never retried (the page cache may already have dropped the data).
- ``write_atomic`` writes a temp file with a name unique per host, process and
  call in the same folder, fsyncs it, publishes it with ``rename`` (or with
  ``link`` for create-only, the NFS-safe exclusive create), then fsyncs the
  folder so the new name itself survives a crash.
- ``rename_dir`` refuses to replace an existing folder (``RENAME_NOREPLACE``
  where the kernel and filesystem have it, else check + ``rename``, which
  fails on a non-empty target).
Links are never followed: every path part is checked with ``lstat`` and files
are opened with ``O_NOFOLLOW``. The OS calls themselves (durable writes, O_DIRECT reads,
no-replace renames, error mapping) are in :mod:`rl_ckpt._storage.local_io`.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from typing import BinaryIO, Iterable

from rl_ckpt.errors import CheckpointError, StorageError, UnsafePathError
from rl_ckpt._storage.base import Entry, Storage, check_max_bytes, check_pieces, check_range, too_large
from rl_ckpt._storage.local_dirs import free_bytes_at, fsync_dir, makedirs_durable, rename_noreplace
from rl_ckpt._storage.local_io import (
    MAX_WRITE,
    conflict,
    create_temp,
    open_regular,
    read_into_fd,
    read_range_fd,
    read_whole,
    resolve,
    start_writeback,
    storage_error,
    write_fd,
)


class LocalStorage(Storage):
    supports_rename = True
    reads_into = True

    def __init__(self, root: str, storage_options: dict | None = None) -> None:
        """``root``: a path or ``file://`` URL. ``storage_options`` exist for the registry's uniform
        ``cls(url, options)`` call; local folders take none (fsspec-only options are ignored)."""
        if root.startswith("file://"):
            root = root[len("file://") :]
        self.root = os.path.realpath(os.path.expanduser(root))
        self.url = self.root

    # -- paths -------------------------------------------------------------
    def _abs(
        self, path: str, *, check_links: bool = True, allow_root: bool = False, last_may_be_link: bool = False
    ) -> str:
        """Absolute path of ``path`` under the root; links in it are refused (``local_io.resolve``)."""
        return resolve(
            self.root, path, check_links=check_links, allow_root=allow_root, last_may_be_link=last_may_be_link
        )

    # -- writes ------------------------------------------------------------
    def write(self, path: str, chunks: Iterable, *, create_only: bool = False, durable: bool = True) -> int:
        full = self._abs(path)
        if create_only:
            return self._publish_via_temp(path, full, chunks, create_only=True, durable=durable)
        try:
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(f"refused {path!r}: it is a symbolic link", path=path) from exc
            raise storage_error(exc, "cannot create", path) from exc
        return write_fd(fd, chunks, durable, path)

    def write_atomic(self, path: str, data: bytes, *, create_only: bool = False) -> None:
        self._publish_via_temp(path, self._abs(path), [data], create_only=create_only, durable=True)

    def write_stream_atomic(self, path: str, chunks: Iterable) -> int:
        return self._publish_via_temp(path, self._abs(path), chunks, create_only=False, durable=True)

    def write_many_atomic(self, items: list[tuple[str, object]]) -> None:
        """Write every temp file first (writeback started), then fsync each, rename each into place,
        and fsync each folder once: the disk works on all files at once instead of one fsync at a
        time. A crash leaves each name absent or complete (data is fsynced before its rename); the
        names are durable when this returns."""
        temps: list[tuple[int | None, str, str, str]] = []  # (fd, temp, full, path)
        try:
            for path, data in items:
                full = self._abs(path)
                fd, tmp = create_temp(full, path)
                temps.append((fd, tmp, full, path))
                view = memoryview(data).cast("B")
                try:
                    written = 0
                    while written < view.nbytes:
                        written += os.write(fd, view[written : written + MAX_WRITE])
                    start_writeback(fd, 0, written)
                except OSError as exc:
                    raise storage_error(exc, "cannot write", path) from exc
            for i, (fd, tmp, full, path) in enumerate(temps):
                try:
                    os.fsync(fd)
                except OSError as exc:
                    raise storage_error(exc, "cannot write", path) from exc
                finally:
                    os.close(fd)
                    temps[i] = (None, tmp, full, path)
            folders = []
            for _fd, tmp, full, path in temps:
                try:
                    os.replace(tmp, full)
                except OSError as exc:
                    raise storage_error(exc, "cannot publish", path) from exc
                if os.path.dirname(path) not in folders:
                    folders.append(os.path.dirname(path))
            for folder in folders:
                self.sync_dir(folder)
        finally:
            for fd, tmp, _full, _path in temps:
                if fd is not None:
                    os.close(fd)
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass

    def _publish_via_temp(self, path: str, full: str, chunks: Iterable, *, create_only: bool, durable: bool) -> int:
        fd, tmp = create_temp(full, path)
        try:
            size = write_fd(fd, chunks, durable, path)
            if create_only:
                # link() is atomic and exclusive on local filesystems and NFS alike
                # (O_EXCL is not on old NFS clients); it fails if the name exists.
                try:
                    os.link(tmp, full)
                except FileExistsError as exc:
                    raise conflict(path) from exc
                except OSError as exc:
                    # NFS may report an error for a link that a retransmitted request made:
                    # a link count of 2 on the temp means the link does exist.
                    if os.stat(tmp).st_nlink != 2:
                        raise storage_error(exc, "cannot publish", path) from exc
            else:
                os.replace(tmp, full)
            if durable:
                self.sync_dir(os.path.dirname(path) if "/" in path else "")
            return size
        except CheckpointError:
            raise  # already says what happened (CommitConflictError, StorageError)
        except OSError as exc:
            raise storage_error(exc, "cannot publish", path) from exc
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    # -- reads -------------------------------------------------------------
    def _open_regular(self, path: str) -> tuple[int, int]:
        return open_regular(self._abs(path), path)

    def read(self, path: str, *, on_chunk=None, max_bytes: int | None = None):
        """The whole file in a fresh, writable buffer (not zero-filled first: that alone costs a pass).

        Large files that are not in the page cache are read with O_DIRECT into
        page-aligned memory whose pages a helper thread populates ahead of the
        reads, two reads in flight: no page-cache copy or allocation, and the
        first-touch faults and the hashing overlap the disk. Cached files (a
        restore right after a save) and filesystems without O_DIRECT use
        ordinary reads (the kernel reads ahead).
        ``max_bytes`` is checked against the open file's size before anything
        is allocated; the reads never go past that size.
        """
        check_max_bytes(max_bytes)
        fd, size = self._open_regular(path)
        if max_bytes is not None and size > max_bytes:
            os.close(fd)
            raise too_large(path, size, max_bytes)
        return read_whole(fd, size, path, on_chunk)

    def read_into(self, path: str, pieces, *, on_chunk=None) -> None:
        """The file straight into the caller's pieces (``Storage.read_into``): ordinary reads into them, the next
        one read while the last is hashed (``local_io.read_into_fd``). The size is checked against the pieces
        before anything is read."""
        total, views = check_pieces(path, pieces)
        fd, size = self._open_regular(path)
        if size != total:
            os.close(fd)
            if size > total:
                raise too_large(path, size, total)
            raise StorageError(f"short read of {path}: it has {size} bytes, {total} expected", path=path)
        read_into_fd(fd, size, path, views, on_chunk)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """Positioned reads (``pread``) of one range; checked against the file's size before allocating."""
        check_range(start, length)
        fd, size = self._open_regular(path)
        return read_range_fd(fd, size, path, start, length)

    def open_read(self, path: str) -> BinaryIO:
        fd, _size = self._open_regular(path)
        return os.fdopen(fd, "rb", buffering=0)

    # -- namespace ---------------------------------------------------------
    def list(self, path: str = "") -> list[Entry]:
        full = self._abs(path, allow_root=True)
        try:
            with os.scandir(full) as it:
                out = []
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed since the folder was read: not listed (not the whole folder lost)
                    out.append(Entry(e.name, stat.S_ISDIR(st.st_mode), st.st_size, st.st_mtime))
                return out
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return []
        except OSError as exc:
            raise storage_error(exc, "cannot list", path or ".") from exc

    def exists(self, path: str) -> bool:
        try:
            os.lstat(self._abs(path, check_links=False, allow_root=True))
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:  # e.g. a folder on the way may not be searched: "no" would be a lie
            raise storage_error(exc, "cannot check", path or ".") from exc
        return True

    def size(self, path: str) -> int:
        full = self._abs(path)  # its own errors already say what happened: not wrapped again below
        try:
            return os.lstat(full).st_size
        except OSError as exc:
            raise storage_error(exc, "cannot stat", path) from exc

    def stat(self, path: str) -> Entry | None:
        full = self._abs(path)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise storage_error(exc, "cannot stat", path) from exc
        # ctime cannot be set from user space: an in-place edit that restores mtime still changes it.
        version = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
        return Entry(path.rsplit("/", 1)[-1], stat.S_ISDIR(st.st_mode), st.st_size, st.st_mtime, version)

    def is_link(self, path: str) -> bool:
        return os.path.islink(self._abs(path, check_links=False))

    def remove(self, path: str) -> None:
        full = self._abs(path, last_may_be_link=True)
        try:
            os.unlink(full)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise storage_error(exc, "cannot remove", path) from exc

    def remove_tree(self, path: str) -> None:
        full = self._abs(path, last_may_be_link=True)
        try:
            if os.path.islink(full) or not os.path.isdir(full):
                os.unlink(full)  # a link is removed, never followed
            else:
                shutil.rmtree(full)  # fd-based on Linux: does not follow links
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise storage_error(exc, "cannot remove", path) from exc

    def makedirs(self, path: str) -> None:
        """Create missing folders, fsyncing each new folder's parent so its name survives a power cut."""
        makedirs_durable(self._abs(path), path)

    def rename_dir(self, src: str, dst: str) -> None:
        rename_noreplace(self._abs(src), self._abs(dst), dst)

    def sync_dir(self, path: str) -> None:
        fsync_dir(self._abs(path, allow_root=True), path or ".")

    def free_bytes(self) -> int | None:
        return free_bytes_at(self.root)
