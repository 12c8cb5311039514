"""``PowerLossStorage``: undo on a power cut whatever was not durable yet (see the class docstring)."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import stat as _stat
import tempfile
import threading
import uuid
import weakref
from typing import Callable, Iterable

from rl_ckpt.errors import CommitConflictError, UnsafePathError
from rl_ckpt._storage import LocalStorage


class PowerCut(BaseException):
    """The machine lost power: raised by every call of a :class:`PowerLossStorage` after ``power_cut()``.

    A ``BaseException``, so no ``except Exception`` / ``except CheckpointError``
    in the code under test can swallow it and carry on writing.
    """


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder + "/")


def _moved(path: str, src: str, dst: str) -> str:
    return dst + path[len(src) :] if _under(path, src) else path


@dataclasses.dataclass
class Effect:
    """One change to the namespace or to file data that may not survive a power cut.

    ``path`` is where the affected entry is *now* (a later rename of a folder
    moves the paths of the effects inside it).
    """

    kind: str  # "mkdir" | "create" | "overwrite" | "rename" | "remove"
    path: str
    src: str = ""  # rename: the old name
    data_durable: bool = True  # create/overwrite: the data was fsynced
    name_durable: bool = False  # the folder holding ``path`` was fsynced after the change
    src_durable: bool = False  # rename: the folder that held ``src`` was fsynced after the change
    backup: str | None = None  # remove: a copy of what was removed, to put back

    @property
    def durable(self) -> bool:
        if self.kind in ("create", "overwrite"):
            return self.name_durable and self.data_durable
        return self.name_durable

    def __str__(self) -> str:
        if self.kind == "rename":
            return f"rename {self.src} -> {self.path}"
        extra = "" if self.data_durable else " (data not fsynced)"
        return f"{self.kind} {self.path}{extra}"


# -- seeing the fsyncs that really happen ---------------------------------------------
# A folder fsync may be issued anywhere inside LocalStorage (sync_dir, after a rename, after a
# mkdir...). Rather than trusting one method to be the only way, every live PowerLossStorage
# observes os.fsync itself: a folder fsynced under its root makes the entry changes in it durable.
_LIVE: "weakref.WeakSet[PowerLossStorage]" = weakref.WeakSet()
_INSTALL_LOCK = threading.Lock()
_real_fsync: Callable[[int], None] | None = None


def _observing_fsync(fd: int) -> None:
    _real_fsync(fd)  # type: ignore[misc]  # errors propagate exactly as before
    if not _LIVE:
        return
    try:
        if not _stat.S_ISDIR(os.fstat(fd).st_mode):
            return
        path = os.readlink(f"/proc/self/fd/{fd}")  # Linux; elsewhere only sync_dir() is seen
    except OSError:
        return
    for storage in list(_LIVE):
        if path == storage.root or path.startswith(storage.root + os.sep):
            storage._observed_fsync(os.path.relpath(path, storage.root).replace(os.sep, "/"))


def _observe_fsync() -> None:
    global _real_fsync
    with _INSTALL_LOCK:
        if _real_fsync is None:
            _real_fsync = os.fsync
            os.fsync = _observing_fsync


class PowerSwitchStorage(LocalStorage):
    """A :class:`LocalStorage` with a power switch: while ``halted``, every call raises :class:`PowerCut`.

    The reads only check the switch; :class:`PowerLossStorage` adds the journal of what a cut undoes.
    """

    def __init__(self, root: "LocalStorage | str") -> None:
        super().__init__(root.root if isinstance(root, LocalStorage) else root)
        self.halted = False
        self._lock = threading.RLock()

    def _alive(self) -> None:
        if self.halted:
            raise PowerCut(f"power is off ({self.url}); call restart() to boot again")

    def restart(self) -> None:
        """Power is back: calls work again (after a cut, everything on disk is durable)."""
        with self._lock:
            self.halted = False

    # -- reads -------------------------------------------------------------------
    def read(self, path: str, *, on_chunk=None, max_bytes=None) -> bytearray:
        self._alive()
        return super().read(path, on_chunk=on_chunk, max_bytes=max_bytes)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        self._alive()
        return super().read_range(path, start, length)

    def open_read(self, path: str):
        self._alive()
        return super().open_read(path)

    def list(self, path: str = ""):
        self._alive()
        return super().list(path)

    def exists(self, path: str) -> bool:
        self._alive()
        return super().exists(path)

    def size(self, path: str) -> int:
        self._alive()
        return super().size(path)

    def stat(self, path: str):
        self._alive()
        return super().stat(path)


class PowerLossStorage(PowerSwitchStorage):
    """A local disk that can lose power: ``power_cut()`` undoes every effect that was not made durable.

    A :class:`LocalStorage` (the real one: same files, same fsyncs) that keeps
    a journal of the effects of each call. The folder fsyncs that really
    happen count, wherever LocalStorage issues them (``sync_dir``, after the
    rename of ``write_atomic``, after a create-only link, after a mkdir): while
    an instance is alive, ``os.fsync`` is observed and a folder fsynced under
    its root (the path read from ``/proc/self/fd``) makes the entry changes in
    that folder durable. The model is strict POSIX, the worst case a file
    system may legally show after a crash:

    - File data is durable only once fsynced: ``write(..., durable=False)``
      data is lost (the file is left empty); ``durable=True`` data survives.
    - A *name* (a created file or folder, the new name of a rename, the
      removal of an entry) survives only if its parent folder was fsynced
      (``sync_dir``) after the change.
    - Undoing the creation of a folder loses everything in it. A rename whose
      new parent was not fsynced is rolled back to the old name, unless the
      old parent was fsynced (then the folder is in neither place: lost). An
      unsynced removal is undone from a copy taken before the removal. A file
      replaced by rename (``write_atomic``) gets its old content back.
    - The run folder (the root) itself is taken as durable.

    ``power_cut()`` undoes the pending effects newest first (all of them, or
    with ``rng`` each one independently kept with ``keep_probability``: the
    mixed outcomes a real disk may show), then makes every further call raise
    :class:`PowerCut` until ``restart()``. A cut lands between two calls of
    this interface; what happens *inside* one call (a temp file of
    ``write_atomic``) is not modelled.
    """

    def __init__(self, root: "LocalStorage | str", journal_dir: str | None = None) -> None:
        super().__init__(root)
        self.journal: list[Effect] = []
        self._own_journal_dir = journal_dir is None
        self.journal_dir = journal_dir or tempfile.mkdtemp(prefix="rlckpt-powerloss-")
        os.makedirs(self.journal_dir, exist_ok=True)
        self._backups = 0
        _observe_fsync()
        _LIVE.add(self)

    # -- helpers -------------------------------------------------------------
    def _full(self, path: str) -> str:
        return os.path.join(self.root, *path.split("/")) if path else self.root

    def _backup(self, path: str) -> str | None:
        full = self._full(path)
        if not os.path.lexists(full):
            return None
        self._backups += 1
        dest = os.path.join(self.journal_dir, f"saved-{uuid.uuid4().hex[:8]}-{self._backups}")
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.copytree(full, dest, symlinks=True)
        else:
            shutil.copy2(full, dest, follow_symlinks=False)
        return dest

    def _drop(self, effect: Effect) -> None:
        if effect in self.journal:
            self.journal.remove(effect)
        if effect.backup:
            _rmtree_or_unlink(effect.backup)

    def _synced(self, folder: str) -> None:
        """The folder ``folder`` was fsynced: every entry change in it is durable."""
        for e in self.journal:
            if _parent(e.path) == folder:
                e.name_durable = True
            if e.kind == "rename" and _parent(e.src) == folder:
                e.src_durable = True
        self._prune()

    def _observed_fsync(self, folder: str) -> None:
        """``os.fsync`` of the folder ``folder`` (relative to the root; "." is the root) just returned."""
        with self._lock:
            self._synced("" if folder == "." else folder)

    def _prune(self) -> None:
        for e in [e for e in self.journal if e.durable]:
            self._drop(e)

    @property
    def pending(self) -> list[str]:
        """What a power cut now would undo, oldest first."""
        with self._lock:
            return [str(e) for e in self.journal]

    # -- the cut ---------------------------------------------------------------
    def power_cut(
        self, rng: random.Random | None = None, *, keep_probability: float = 0.5, halt: bool = True
    ) -> list[str]:
        """Lose power now: undo the pending effects on the real files; returns what was undone."""
        undone = []
        with self._lock:
            for i in range(len(self.journal) - 1, -1, -1):
                e = self.journal[i]
                if rng is not None and rng.random() < keep_probability:
                    continue  # this one happened to reach the disk
                if _undo(e, self.journal[:i], self._full):
                    undone.append(str(e))
            for e in list(self.journal):
                self._drop(e)
            self.halted = halt
        return undone

    # -- writes ------------------------------------------------------------------
    def write(self, path: str, chunks: Iterable, *, create_only: bool = False, durable: bool = True) -> int:
        with self._lock:
            self._alive()
            if not _safe(path):
                return super().write(path, chunks, create_only=create_only, durable=durable)
            existed = os.path.lexists(self._full(path))
            if create_only or not existed:
                effect = Effect("create", path, data_durable=durable)
            else:
                effect = Effect("overwrite", path, data_durable=durable, name_durable=True)
            self.journal.append(effect)  # before the call: the folder fsync inside it counts
            try:
                size = super().write(path, chunks, create_only=create_only, durable=durable)
            except CommitConflictError:
                self._drop(effect)  # someone else's file: not ours to undo
                raise
            except BaseException:
                if os.path.lexists(self._full(path)) and not (create_only and existed):
                    effect.data_durable = False  # whatever reached the file is not durable
                else:
                    self._drop(effect)
                raise
            self._prune()
            return size

    def write_atomic(self, path: str, data: bytes, *, create_only: bool = False) -> None:
        with self._lock:
            self._alive()
            if not _safe(path):
                return super().write_atomic(path, data, create_only=create_only)
            effect = self._atomic_effect(path, create_only)
            try:
                super().write_atomic(path, data, create_only=create_only)
            except BaseException:
                if create_only or not os.path.lexists(self._full(path)):
                    self._drop(effect)
                raise
            self._published(effect)
            self._prune()

    def write_many_atomic(self, items) -> None:
        """The real batched write; each file is journaled as one ``write_atomic`` (a cut lands before
        or after the whole call, like any other)."""
        with self._lock:
            self._alive()
            if not all(_safe(path) for path, _data in items):
                return super().write_many_atomic(items)
            effects = [self._atomic_effect(path, False) for path, _data in items]
            try:
                super().write_many_atomic(items)
            except BaseException:
                for (path, _data), effect in zip(items, effects):
                    if not os.path.lexists(self._full(path)):
                        self._drop(effect)
                raise
            for effect in effects:
                self._published(effect)
            self._prune()

    def _atomic_effect(self, path: str, create_only: bool) -> Effect:
        if os.path.lexists(self._full(path)) and not create_only:
            effect = Effect("replace", path, name_durable=False, backup=self._backup(path))
        else:
            effect = Effect("create", path)
        self.journal.append(effect)  # before the call: the folder fsync inside it counts
        return effect

    def _published(self, effect: Effect) -> None:
        # a new inode with fsynced data now has this name: older data effects on it are moot
        for e in [
            e
            for e in self.journal
            if e is not effect and e.path == effect.path and e.kind in ("create", "overwrite", "replace")
        ]:
            if e.kind == "create" and not e.name_durable:
                effect.kind, effect.backup = "create", None
            self._drop(e)

    # -- namespace -------------------------------------------------------------
    def remove(self, path: str) -> None:
        self._remove(path, super().remove)

    def remove_tree(self, path: str) -> None:
        self._remove(path, super().remove_tree)

    def _remove(self, path: str, fn: Callable[[str], None]) -> None:
        with self._lock:
            self._alive()
            if not _safe(path):
                return fn(path)
            effect = Effect("remove", path, backup=self._backup(path))
            self.journal.append(effect)
            try:
                fn(path)
            finally:
                if effect.backup is None or os.path.lexists(self._full(path)):
                    self._drop(effect)  # nothing (or not all) removed: not journaled
                self._prune()

    def makedirs(self, path: str) -> None:
        with self._lock:
            self._alive()
            parts = path.split("/") if _safe(path) else []
            missing = [
                Effect("mkdir", p)
                for p in ("/".join(parts[: i + 1]) for i in range(len(parts)))
                if not os.path.lexists(self._full(p))
            ]
            self.journal += missing
            try:
                super().makedirs(path)
            finally:
                for e in missing:
                    if not os.path.isdir(self._full(e.path)):
                        self._drop(e)
                self._prune()

    def rename_dir(self, src: str, dst: str) -> None:
        with self._lock:
            self._alive()
            super().rename_dir(src, dst)
            for e in self.journal:
                e.path = _moved(e.path, src, dst)
                if e.kind == "rename":
                    e.src = _moved(e.src, src, dst)
            self.journal.append(Effect("rename", dst, src=src))

    def sync_dir(self, path: str) -> None:
        with self._lock:
            self._alive()
            super().sync_dir(path)
            self._synced(path)

    def close(self) -> None:
        _LIVE.discard(self)
        with self._lock:
            for e in list(self.journal):
                self._drop(e)
            if self._own_journal_dir:
                shutil.rmtree(self.journal_dir, ignore_errors=True)
        super().close()


def _undo(e: Effect, earlier: list[Effect], full_of: Callable[[str], str]) -> bool:
    """Undo one pending effect on the real files (``full_of`` maps a storage path to the file); ``earlier``:
    the effects before it, whose paths follow a rolled-back rename. Returns whether anything changed."""
    full = full_of(e.path)
    if e.kind == "mkdir":
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full)
            return True
        return False
    if e.kind in ("create", "overwrite", "replace"):
        if not os.path.lexists(full):
            return False
        if e.kind == "create" and not e.name_durable:
            _rmtree_or_unlink(full)
        elif e.kind == "replace" and not e.name_durable and e.backup:
            _rmtree_or_unlink(full)
            shutil.copy2(e.backup, full, follow_symlinks=False)  # the old inode is what the folder still names
        else:
            os.truncate(full, 0)  # the name is there, the unsynced data is not
        return True
    if e.kind == "rename":
        if not os.path.lexists(full):
            return False
        src_full = full_of(e.src)
        if e.src_durable or os.path.lexists(src_full) or not os.path.isdir(os.path.dirname(src_full)):
            _rmtree_or_unlink(full)  # gone from the old folder, never reached the new one
            return True
        os.rename(full, src_full)
        for other in earlier:  # what was inside is back under the old name
            other.path = _moved(other.path, e.path, e.src)
            if other.kind == "rename":
                other.src = _moved(other.src, e.path, e.src)
        return True
    if e.kind == "remove":
        if e.backup is None or os.path.lexists(full) or not os.path.isdir(os.path.dirname(full)):
            return False
        if os.path.isdir(e.backup) and not os.path.islink(e.backup):
            shutil.copytree(e.backup, full, symlinks=True)
        else:
            shutil.copy2(e.backup, full, follow_symlinks=False)
        return True
    return False  # pragma: no cover


def _safe(path: str) -> bool:
    """A path the inner storage would accept (it refuses the others before touching anything)."""
    from rl_ckpt._storage import check_relpath

    try:
        check_relpath(path)
    except UnsafePathError:
        return False
    return True


def _rmtree_or_unlink(full: str) -> None:
    try:
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full)
        else:
            os.unlink(full)
    except FileNotFoundError:
        pass
