"""``FaultyStorage``: fail, block or kill at chosen storage operations (see the package docstring)."""

from __future__ import annotations

import dataclasses
import errno as _errno
import os
import threading
from typing import Callable

from rl_ckpt.errors import StorageError
from rl_ckpt._storage import Storage


OPERATIONS = (
    "write",
    "write_atomic",
    "read",
    "open_read",
    "list",
    "exists",
    "size",
    "stat",
    "remove",
    "remove_tree",
    "makedirs",
    "rename_dir",
    "sync_dir",
)
ANY = "*"


@dataclasses.dataclass
class Rule:
    op: str
    nth: int | None  # 1-based index among matching calls; None = every matching call
    path_contains: str | None
    error: int | BaseException | None
    hook: Callable[[], None] | None
    after: bool = False
    seen: int = 0
    fired: int = 0

    def matches(self, op: str, path: str) -> bool:
        if (op != self.op and self.op != ANY) or (self.path_contains and self.path_contains not in path):
            return False
        self.seen += 1
        return self.nth is None or self.seen == self.nth


class FaultyStorage(Storage):
    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url
        self.supports_rename = inner.supports_rename
        self.ops: list[tuple[str, str]] = []
        self.rules: list[Rule] = []
        self._lock = threading.Lock()

    # -- rules -------------------------------------------------------------
    def fail(
        self,
        op: str,
        *,
        nth: int | None = None,
        path_contains: str | None = None,
        error: int | BaseException = _errno.EIO,
        after: bool = False,
    ) -> Rule:
        """Make matching calls raise ``error`` (an errno or an exception); ``after``: once the call has run."""
        return self._add(Rule(op, nth, path_contains, error, None, after))

    def before(
        self, op: str, hook: Callable[[], None], *, nth: int | None = None, path_contains: str | None = None
    ) -> Rule:
        """Run ``hook`` before matching calls (block, kill the process, count...)."""
        return self._add(Rule(op, nth, path_contains, None, hook))

    def after(
        self, op: str, hook: Callable[[], None], *, nth: int | None = None, path_contains: str | None = None
    ) -> Rule:
        """Run ``hook`` after matching calls succeeded."""
        return self._add(Rule(op, nth, path_contains, None, hook, after=True))

    def _add(self, rule: Rule) -> Rule:
        if rule.op not in OPERATIONS and rule.op != ANY:
            raise ValueError(f"unknown storage operation {rule.op!r}; one of {OPERATIONS} or {ANY!r}")
        self.rules.append(rule)
        return rule

    def count(self, op: str) -> int:
        return sum(1 for o, _ in self.ops if o == op)

    # -- forwarding --------------------------------------------------------
    def _call(self, op: str, path: str, fn: Callable):
        with self._lock:
            self.ops.append((op, path))
            fired = [r for r in self.rules if r.matches(op, path)]
        for rule in fired:
            if not rule.after:
                self._fire(rule, op, path)
        result = fn()
        for rule in fired:
            if rule.after:
                self._fire(rule, op, path)
        return result

    @staticmethod
    def _fire(rule: Rule, op: str, path: str) -> None:
        rule.fired += 1
        if rule.hook is not None:
            rule.hook()
        if rule.error is not None:
            if isinstance(rule.error, BaseException):
                raise rule.error
            shown = path or "."  # the run folder itself, named as LocalStorage names it in its own errors
            raise StorageError(f"injected fault: {op} {shown}: {os.strerror(rule.error)}", path=shown, errno=rule.error)

    def write(self, path, chunks, *, create_only=False, durable=True):
        return self._call(
            "write", path, lambda: self.inner.write(path, chunks, create_only=create_only, durable=durable)
        )

    def write_atomic(self, path, data, *, create_only=False):
        return self._call("write_atomic", path, lambda: self.inner.write_atomic(path, data, create_only=create_only))

    def read(self, path, *, on_chunk=None, max_bytes=None):
        return self._call("read", path, lambda: self.inner.read(path, on_chunk=on_chunk, max_bytes=max_bytes))

    def open_read(self, path):
        return self._call("open_read", path, lambda: self.inner.open_read(path))

    def list(self, path=""):
        return self._call("list", path, lambda: self.inner.list(path))

    def exists(self, path):
        return self._call("exists", path, lambda: self.inner.exists(path))

    def size(self, path):
        return self._call("size", path, lambda: self.inner.size(path))

    def stat(self, path):
        return self._call("stat", path, lambda: self.inner.stat(path))

    def remove(self, path):
        return self._call("remove", path, lambda: self.inner.remove(path))

    def remove_tree(self, path):
        return self._call("remove_tree", path, lambda: self.inner.remove_tree(path))

    def makedirs(self, path):
        return self._call("makedirs", path, lambda: self.inner.makedirs(path))

    def rename_dir(self, src, dst):
        return self._call("rename_dir", f"{src} -> {dst}", lambda: self.inner.rename_dir(src, dst))

    def sync_dir(self, path):
        return self._call("sync_dir", path, lambda: self.inner.sync_dir(path))

    def free_bytes(self):
        return self.inner.free_bytes()

    def abort_incomplete_uploads(self, older_than_seconds):
        return self.inner.abort_incomplete_uploads(older_than_seconds)

    def close(self):
        self.inner.close()
