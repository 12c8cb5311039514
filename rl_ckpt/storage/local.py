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
are opened with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import os
import shutil
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, Iterable

from rl_ckpt.errors import CheckpointError, CommitConflictError, StorageError, StoragePermissionError, UnsafePathError
from rl_ckpt.storage.base import (Entry, Storage, check_max_bytes, check_range, check_relpath, range_past_end, too_large,
                   unique_suffix)
from rl_ckpt.storage.buffers import alloc_bytes, prefault

_MAX_WRITE = 1 << 30  # Linux caps one write() near 2 GiB; stay well below
READ_CALL = 8 * 1024 * 1024  # bytes per read call: hashed while in the CPU cache, the kernel reads ahead
DIRECT_MIN_BYTES = 32 * 1024 * 1024  # smaller files: the page cache is cheaper than bypassing it
_DIRECT_ALIGN = 4096  # offsets, lengths and addresses of O_DIRECT reads (covers 512 B and 4 KiB sectors)
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100

_WRITEBACK_BYTES = 32 * 1024 * 1024
_SYNC_FILE_RANGE_WRITE = 2

try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _renameat2 = _libc.renameat2
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
except (OSError, AttributeError):  # pragma: no cover - non-glibc systems
    _renameat2 = None
try:
    _sync_file_range = _libc.sync_file_range
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
except (NameError, AttributeError):  # pragma: no cover
    _sync_file_range = None


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing a range back (no wait; errors surface at fsync)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _create_temp(full: str, path: str) -> tuple[int, str]:
    """A new, exclusive temp file next to ``full`` (``.tmp-<host-pid-thread-random>-<name>``: gc removes leftovers)."""
    folder, name = os.path.split(full)
    tmp = os.path.join(folder, f".tmp-{unique_suffix()}-{name}")
    try:
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), tmp
    except OSError as exc:
        raise _storage_error(exc, "cannot create temp file for", path) from exc


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _mostly_cached(fd: int, size: int, samples: int = 16) -> bool:
    """Whether most of a file is in the page cache: reads of sample pages that may not wait for the disk."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return False
    scratch = bytearray(_DIRECT_ALIGN)
    hits = 0
    for i in range(samples):
        try:
            hits += os.preadv(fd, [scratch], (size * i // samples) // _DIRECT_ALIGN * _DIRECT_ALIGN, flag) > 0
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP: cannot tell
            pass
    return hits * 2 > samples


def _read_buffered(fd: int, view: memoryview, size: int, on_chunk) -> int:
    got = 0
    while got < size:
        n = os.preadv(fd, [view[got:got + READ_CALL]], got)
        if not n:
            break
        if on_chunk is not None:
            on_chunk(view[got:got + n])
        got += n
    return got


_reader_pool: ThreadPoolExecutor | None = None
_reader_lock = threading.Lock()


def _read_direct(fd: int, view: memoryview, size: int, on_chunk) -> int | None:
    """O_DIRECT reads, two in flight (no kernel readahead without the page cache), pieces handed to
    ``on_chunk`` in order; None when the first read is refused (the caller reads normally instead)."""
    global _reader_pool
    with _reader_lock:
        if _reader_pool is None:
            _reader_pool = ThreadPoolExecutor(2, thread_name_prefix="rl_ckpt-read")
    offsets = list(range(0, size, READ_CALL))
    pending: collections.deque = collections.deque()

    def submit(i: int) -> None:
        off = offsets[i]
        want = _round_up(min(READ_CALL, size - off), _DIRECT_ALIGN)  # the buffer has room; EOF shortens it
        pending.append(_reader_pool.submit(os.preadv, fd, [view[off:off + want]], off))

    for i in range(min(2, len(offsets))):
        submit(i)
    got = 0
    try:
        for i, off in enumerate(offsets):
            try:
                n = pending.popleft().result()
            except OSError as exc:
                if i == 0 and exc.errno == errno.EINVAL:
                    return None
                raise
            expected = min(READ_CALL, size - off)
            n = min(n, expected)
            if on_chunk is not None and n:
                on_chunk(view[off:off + n])
            got += n
            if n != expected:
                return got  # the file shrank while being read: the caller reports the short read
            if i + 2 < len(offsets):
                submit(i + 2)
    finally:
        for fut in pending:  # never leave a read writing into a buffer that is handed back or freed
            try:
                fut.result()
            except OSError:
                pass
    return got


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for an open file; False where the filesystem has no direct I/O."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return False
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | direct) if on else (flags & ~direct))
    except OSError:
        return False
    return on


def _storage_error(exc: OSError, what: str, path: str) -> StorageError:
    """The StorageError for an OSError of ``what`` on ``path``: every OS error leaves the storage layer this way."""
    hint = ""
    cls = StorageError
    if exc.errno == errno.ENOSPC:
        hint = " (disk full: free space on the checkpoint volume; nothing was committed by this save)"
    elif exc.errno == errno.EDQUOT:
        hint = " (quota exceeded on the checkpoint volume)"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        cls = StoragePermissionError
        where = f" on {exc.filename}" if isinstance(exc.filename, str) else ""
        hint = (f" (permission denied{where} for user id {os.geteuid()}: give that user read access to the run "
                "folder, and write access to save, e.g. with chown/chmod, or run as the folder's owner)")
    elif exc.errno == errno.EROFS:
        hint = " (read-only file system: remount it writable or save to another base_dir)"
    msg = f"{what} {path}: {exc.strerror or exc}{hint}"
    return cls(msg, path=path, errno=exc.errno)


class LocalStorage(Storage):
    supports_rename = True

    def __init__(self, root: str, storage_options: dict | None = None) -> None:
        """``root``: a path or ``file://`` URL. ``storage_options`` exist for the registry's uniform
        ``cls(url, options)`` call; local folders take none (fsspec-only options are ignored)."""
        if root.startswith("file://"):
            root = root[len("file://"):]
        self.root = os.path.realpath(os.path.expanduser(root))
        self.url = self.root

    # -- paths -------------------------------------------------------------
    def _abs(self, path: str, *, check_links: bool = True, allow_root: bool = False, last_may_be_link: bool = False) -> str:
        """Absolute path of ``path`` under the root; links in it are refused.

        Only listing and syncing may name the root itself (``""``): a write,
        read or delete of ``""`` is refused. ``last_may_be_link`` lets a delete
        remove a planted link itself (never what it points to).
        """
        if path == "" and allow_root:
            return self.root
        rel = check_relpath(path)
        parts = rel.split("/")
        full = os.path.join(self.root, *parts)
        if check_links:
            cur = self.root
            for i, part in enumerate(parts):
                cur = os.path.join(cur, part)
                try:
                    st = os.lstat(cur)
                except (FileNotFoundError, NotADirectoryError):
                    break  # the operation itself reports (or tolerates) a missing path
                except OSError as exc:
                    raise _storage_error(exc, "cannot access", path) from exc
                if stat.S_ISLNK(st.st_mode) and not (last_may_be_link and i == len(parts) - 1):
                    raise UnsafePathError(
                        f"refused {path!r}: {os.path.relpath(cur, self.root)!r} is a symbolic link; "
                        "checkpoint folders never contain links",
                        path=path,
                    )
        return full

    # -- writes ------------------------------------------------------------
    def _write_fd(self, fd: int, chunks: Iterable, durable: bool, shown: str) -> int:
        total = 0
        started = 0  # bytes already handed to writeback
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                while view.nbytes:
                    n = os.write(fd, view[:_MAX_WRITE])
                    view = view[n:]
                    total += n
                if durable and total - started >= _WRITEBACK_BYTES:
                    # Start writeback now so the disk works while we hash and write the rest;
                    # the final fsync still decides durability (this is only a head start).
                    _start_writeback(fd, started, total - started)
                    started = total
            if durable:
                os.fsync(fd)
        except OSError as exc:
            raise _storage_error(exc, "cannot write", shown) from exc
        finally:
            os.close(fd)
        return total

    def write(self, path: str, chunks: Iterable, *, create_only: bool = False, durable: bool = True) -> int:
        full = self._abs(path)
        if create_only:
            return self._publish_via_temp(path, full, chunks, create_only=True, durable=durable)
        try:
            fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(f"refused {path!r}: it is a symbolic link", path=path) from exc
            raise _storage_error(exc, "cannot create", path) from exc
        return self._write_fd(fd, chunks, durable, path)

    def write_atomic(self, path: str, data: bytes, *, create_only: bool = False) -> None:
        self._publish_via_temp(path, self._abs(path), [data], create_only=create_only, durable=True)

    def write_many_atomic(self, items: list[tuple[str, object]]) -> None:
        """Write every temp file first (writeback started), then fsync each, rename each into place,
        and fsync each folder once: the disk works on all files at once instead of one fsync at a
        time. A crash leaves each name absent or complete (data is fsynced before its rename); the
        names are durable when this returns."""
        temps: list[tuple[int | None, str, str, str]] = []  # (fd, temp, full, path)
        try:
            for path, data in items:
                full = self._abs(path)
                fd, tmp = _create_temp(full, path)
                temps.append((fd, tmp, full, path))
                view = memoryview(data).cast("B")
                try:
                    written = 0
                    while written < view.nbytes:
                        written += os.write(fd, view[written:written + _MAX_WRITE])
                    _start_writeback(fd, 0, written)
                except OSError as exc:
                    raise _storage_error(exc, "cannot write", path) from exc
            for i, (fd, tmp, full, path) in enumerate(temps):
                try:
                    os.fsync(fd)
                except OSError as exc:
                    raise _storage_error(exc, "cannot write", path) from exc
                finally:
                    os.close(fd)
                    temps[i] = (None, tmp, full, path)
            folders = []
            for _fd, tmp, full, path in temps:
                try:
                    os.replace(tmp, full)
                except OSError as exc:
                    raise _storage_error(exc, "cannot publish", path) from exc
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
        fd, tmp = _create_temp(full, path)
        try:
            size = self._write_fd(fd, chunks, durable, path)
            if create_only:
                # link() is atomic and exclusive on local filesystems and NFS alike
                # (O_EXCL is not on old NFS clients); it fails if the name exists.
                try:
                    os.link(tmp, full)
                except FileExistsError as exc:
                    raise CommitConflictError(
                        f"{path} already exists: another writer committed it first", path=path, snapshot_id=path
                    ) from exc
                except OSError as exc:
                    # NFS may report an error for a link that a retransmitted request made:
                    # a link count of 2 on the temp means the link does exist.
                    if os.stat(tmp).st_nlink != 2:
                        raise _storage_error(exc, "cannot publish", path) from exc
            else:
                os.replace(tmp, full)
            if durable:
                self.sync_dir(os.path.dirname(path) if "/" in path else "")
            return size
        except CheckpointError:
            raise  # already says what happened (CommitConflictError, StorageError)
        except OSError as exc:
            raise _storage_error(exc, "cannot publish", path) from exc
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    # -- reads -------------------------------------------------------------
    def _open_regular(self, path: str) -> tuple[int, int]:
        full = self._abs(path)
        try:
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePathError(f"refused {path!r}: it is a symbolic link", path=path) from exc
            raise _storage_error(exc, "cannot open", path) from exc
        try:
            st = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            raise _storage_error(exc, "cannot stat", path) from exc
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise UnsafePathError(f"refused {path!r}: not a regular file", path=path)
        return fd, st.st_size

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
        direct = size >= DIRECT_MIN_BYTES and not _mostly_cached(fd, size) and _set_direct(fd, True)
        try:
            buf = alloc_bytes(_round_up(size, _DIRECT_ALIGN) if direct else size)
        except (OSError, MemoryError) as exc:  # e.g. ENOMEM for a huge (or sparse) file read without a cap
            os.close(fd)
            raise StorageError(f"cannot read {path}: no memory for its {size} bytes ({exc}); pass max_bytes to refuse "
                               "files this large, or free memory", path=path, size=size) from exc
        if direct and buf.ctypes.data % _DIRECT_ALIGN:  # large buffers are page-aligned mappings; be sure
            direct = _set_direct(fd, False)
        view = memoryview(buf).cast("B")
        stop_prefault = prefault(buf)
        try:
            got = _read_direct(fd, view, size, on_chunk) if direct else None
            if got is None:  # not direct, or the filesystem refused it: ordinary reads from the start
                if direct:
                    _set_direct(fd, False)
                got = _read_buffered(fd, view, size, on_chunk)
        except OSError as exc:
            raise _storage_error(exc, "cannot read", path) from exc
        finally:
            stop_prefault()
            os.close(fd)
        if got != size:
            raise StorageError(f"short read of {path}: {got} of {size} bytes (file changed while reading?)", path=path)
        return buf[:size] if buf.nbytes != size else buf

    def read_range(self, path: str, start: int, length: int) -> bytes:
        """Positioned reads (``pread``) of one range; checked against the file's size before allocating."""
        check_range(start, length)
        fd, size = self._open_regular(path)
        try:
            if start + length > size:
                raise range_past_end(path, start, length, size)
            parts, got = [], 0
            while got < length:
                part = os.pread(fd, min(length - got, _MAX_WRITE), start + got)  # one call: same ~2 GiB cap
                if not part:
                    raise range_past_end(path, start, length, start + got)  # the file shrank meanwhile
                parts.append(part)
                got += len(part)
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            raise _storage_error(exc, "cannot read", path) from exc
        finally:
            os.close(fd)
        return parts[0] if len(parts) == 1 else b"".join(parts)

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
            raise _storage_error(exc, "cannot list", path or ".") from exc

    def exists(self, path: str) -> bool:
        try:
            os.lstat(self._abs(path, check_links=False, allow_root=True))
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:  # e.g. a folder on the way may not be searched: "no" would be a lie
            raise _storage_error(exc, "cannot check", path or ".") from exc
        return True

    def size(self, path: str) -> int:
        full = self._abs(path)  # its own errors already say what happened: not wrapped again below
        try:
            return os.lstat(full).st_size
        except OSError as exc:
            raise _storage_error(exc, "cannot stat", path) from exc

    def stat(self, path: str) -> Entry | None:
        full = self._abs(path)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _storage_error(exc, "cannot stat", path) from exc
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
            raise _storage_error(exc, "cannot remove", path) from exc

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
            raise _storage_error(exc, "cannot remove", path) from exc

    def makedirs(self, path: str) -> None:
        """Create missing folders, fsyncing each new folder's parent so its name survives a power cut."""
        full = self._abs(path)
        missing = []
        cur = full
        while not os.path.isdir(cur):
            missing.append(cur)
            parent = os.path.dirname(cur)
            if parent == cur:
                break
            cur = parent
        try:
            for folder in reversed(missing):
                try:
                    os.mkdir(folder)
                except FileExistsError:
                    continue
                fd = os.open(os.path.dirname(folder), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as exc:
            raise _storage_error(exc, "cannot create folder", path) from exc

    def rename_dir(self, src: str, dst: str) -> None:
        s, d = self._abs(src), self._abs(dst)
        if _renameat2 is not None:
            rc = _renameat2(_AT_FDCWD, s.encode(), _AT_FDCWD, d.encode(), _RENAME_NOREPLACE)
            if rc == 0:
                return
            err = ctypes.get_errno()
            if err == errno.EEXIST:
                raise CommitConflictError(f"{dst} already exists: another writer committed it first", path=dst, snapshot_id=dst)
            if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
                raise _storage_error(OSError(err, os.strerror(err)), "cannot rename to", dst)
        # Filesystems without RENAME_NOREPLACE (some NFS servers): rename() still
        # fails on a non-empty target, and a committed snapshot is never empty.
        if os.path.lexists(d):
            raise CommitConflictError(f"{dst} already exists: another writer committed it first", path=dst, snapshot_id=dst)
        try:
            os.rename(s, d)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise CommitConflictError(f"{dst} already exists: another writer committed it first", path=dst, snapshot_id=dst) from exc
            raise _storage_error(exc, "cannot rename to", dst) from exc

    def sync_dir(self, path: str) -> None:
        full = self._abs(path, allow_root=True)
        try:
            fd = os.open(full, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise _storage_error(exc, "cannot open folder", path or ".") from exc
        try:
            os.fsync(fd)
        except OSError as exc:
            raise _storage_error(exc, "cannot fsync folder", path or ".") from exc
        finally:
            os.close(fd)

    def free_bytes(self) -> int | None:
        probe = self.root
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        try:
            st = os.statvfs(probe)
        except OSError as exc:
            raise _storage_error(exc, "cannot query free space of", probe) from exc
        return st.f_bavail * st.f_frsize
