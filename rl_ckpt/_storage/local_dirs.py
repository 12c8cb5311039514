"""Folders of a local run through the OS: durable creation, no-replace renames, folder fsync, free space.

Under :class:`~rl_ckpt._storage.local.LocalStorage`, beside :mod:`rl_ckpt._storage.local_io` (file writes and reads);
every ``OSError`` leaves as a :class:`~rl_ckpt.errors.StorageError` (``local_io.storage_error``).
"""

from __future__ import annotations

import ctypes
import errno
import os

from rl_ckpt._storage.local_io import conflict, storage_error

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
try:
    _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
except (OSError, AttributeError):  # pragma: no cover - non-glibc systems
    _renameat2 = None


def makedirs_durable(full: str, path: str) -> None:
    """Create missing folders, fsyncing each new folder's parent so its name survives a power cut."""
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
        raise storage_error(exc, "cannot create folder", path) from exc


def rename_noreplace(s: str, d: str, dst: str) -> None:
    """Rename the folder ``s`` to ``d`` (shown as ``dst``), never replacing one: ``CommitConflictError``."""
    if _renameat2 is not None:
        rc = _renameat2(_AT_FDCWD, s.encode(), _AT_FDCWD, d.encode(), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise conflict(dst)
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise storage_error(OSError(err, os.strerror(err)), "cannot rename to", dst)
    # Filesystems without RENAME_NOREPLACE (some NFS servers): rename() still
    # fails on a non-empty target, and a committed snapshot is never empty.
    if os.path.lexists(d):
        raise conflict(dst)
    try:
        os.rename(s, d)
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise conflict(dst) from exc
        raise storage_error(exc, "cannot rename to", dst) from exc


def fsync_dir(full: str, shown: str) -> None:
    """fsync the folder ``full`` (shown as ``shown``) so the names in it survive a crash; missing: nothing."""
    try:
        fd = os.open(full, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise storage_error(exc, "cannot open folder", shown) from exc
    try:
        os.fsync(fd)
    except OSError as exc:
        raise storage_error(exc, "cannot fsync folder", shown) from exc
    finally:
        os.close(fd)


def free_bytes_at(root: str) -> int:
    """Bytes free to an unprivileged user on the filesystem of ``root`` (or its nearest existing parent)."""
    probe = root
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        st = os.statvfs(probe)
    except OSError as exc:
        raise storage_error(exc, "cannot query free space of", probe) from exc
    return st.f_bavail * st.f_frsize
