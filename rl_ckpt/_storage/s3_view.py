"""One listing of an S3 run for a read session (``S3Storage.read_session``): a restore plans and loads from it.

Planning a restore lists snapshot folders, reads manifests and stats the files they name; on S3 each listing
and each stat is a request, one after another, each paying the round trip. Within a read session, the first
metadata call takes one recursive listing of the run (``list_objects_v2`` without a delimiter: 1,000 keys per
request) and ``list``, ``exists``, ``size``, ``stat`` and ``stat_many`` are answered from it. A write or
removal through the storage drops it (the next call lists again); another client's changes are not seen until
the session ends, as ``Storage.read_session`` says. A run too large to list in ``MAX_PAGES`` requests gets no
view (every call asks S3, as outside a session).
"""

from __future__ import annotations

import contextlib
import threading

from rl_ckpt._storage.base import Entry

MAX_PAGES = 8


class RunListing:
    """Every object under a root, from one listing: ``rel path -> (size, ETag, mtime)``."""

    def __init__(self, objects: dict[str, tuple[int, str, float | None]], generation: int) -> None:
        self.objects = objects
        self.generation = generation
        self.dirs: dict[str, dict[str, Entry]] = {}
        for rel, (size, _etag, mtime) in objects.items():
            parts = rel.split("/")
            for depth in range(len(parts)):
                parent, name = "/".join(parts[:depth]), parts[depth]
                is_dir = depth < len(parts) - 1
                children = self.dirs.setdefault(parent, {})
                if name not in children or (is_dir and not children[name].is_dir):
                    children[name] = Entry(name, is_dir, 0 if is_dir else size, None if is_dir else mtime)

    def list(self, rel: str) -> list[Entry]:
        return list(self.dirs.get(rel, {}).values())

    def exists(self, rel: str) -> bool:
        return rel in self.objects or rel in self.dirs

    def stat(self, rel: str) -> Entry | None:
        found = self.objects.get(rel)
        if found is None:
            return None
        size, etag, mtime = found
        return Entry(rel.rsplit("/", 1)[-1], False, size, mtime, f"{etag}:{size}" if etag else None)


def take_listing(fs, bucket: str, prefix: str, generation: int) -> RunListing | None:
    """The listing of every key under ``prefix`` (``.../``), or None past ``MAX_PAGES`` requests."""
    objects: dict[str, tuple[int, str, float | None]] = {}
    token = None
    for _page in range(MAX_PAGES):
        kw = {"Bucket": bucket, "Prefix": prefix}
        if token:
            kw["ContinuationToken"] = token
        page = fs.call_s3("list_objects_v2", **kw)
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix) :]
            if rel and not rel.endswith("/"):  # a folder marker is no file
                mtime = obj.get("LastModified")
                objects[rel] = (int(obj.get("Size", 0)), obj.get("ETag", ""), mtime.timestamp() if mtime else None)
        if not page.get("IsTruncated"):
            return RunListing(objects, generation)
        token = page.get("NextContinuationToken")
    return None


class ReadSessions:
    """Per-thread read sessions of one storage object and the generation its writes bump."""

    def __init__(self) -> None:
        self.sessions: dict[int, list] = {}  # thread id -> [depth, (generation, RunListing or None: too large)]
        self.generation = 0
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def session(self):
        key = threading.get_ident()
        with self.lock:
            entry = self.sessions.setdefault(key, [0, None])
            entry[0] += 1
        try:
            yield
        finally:
            with self.lock:
                entry[0] -= 1
                if entry[0] == 0:
                    self.sessions.pop(key, None)

    def changed(self) -> None:
        with self.lock:
            self.generation += 1

    def view(self, take) -> RunListing | None:
        """This thread's listing (``take(generation)`` makes one when there is none or a write came since); None
        outside a session or for a run too large to list."""
        entry = self.sessions.get(threading.get_ident())
        if entry is None:
            return None
        if entry[1] is None or entry[1][0] != self.generation:
            generation = self.generation
            entry[1] = (generation, take(generation))
        return entry[1][1]


class S3Views:
    """``S3Storage``'s read sessions (a mixin over ``FsspecStorage``; the storage sets ``_reads``)."""

    @contextlib.contextmanager
    def read_session(self):
        """Within it (this thread), ``list``/``exists``/``size``/``stat``/``stat_many`` are answered from one
        recursive listing of the run taken at the first such call (this module's docstring says more)."""
        with self._reads.session():
            yield self

    def _view(self):
        def take(generation: int):
            bucket, key, _ = self.fs.split_path(self.root)
            return take_listing(self.fs, bucket, key.rstrip("/") + "/", generation)

        try:
            return self._reads.view(take)
        except Exception:  # noqa: BLE001 - no view: every call asks S3 itself, and reports its own errors
            return None

    def list(self, path: str = ""):
        full = self._abs(path, allow_root=True)
        view = self._view()
        return view.list(full[len(self.root) + 1 :]) if view is not None else super().list(path)

    def exists(self, path: str) -> bool:
        full = self._abs(path, allow_root=True)
        view = self._view()
        return view.exists(full[len(self.root) + 1 :]) if view is not None else super().exists(path)

    def size(self, path: str) -> int:
        entry = self.stat(path) if self._view() is not None else None
        return entry.size if entry is not None else super().size(path)

    def stat(self, path: str):
        full = self._abs(path)
        view = self._view()
        return view.stat(full[len(self.root) + 1 :]) if view is not None else super().stat(path)

    def stat_many(self, paths):
        """One listing within a read session; else the HEADs all at once."""
        if self._view() is not None or len(paths) < 2:
            return [self.stat(p) for p in paths]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(len(paths), int(self.fs.max_concurrency))) as pool:
            return list(pool.map(self.stat, paths))

    def remove(self, path: str) -> None:
        self._reads.changed()
        try:
            super().remove(path)
        finally:
            self._reads.changed()

    def remove_tree(self, path: str) -> None:
        self._reads.changed()
        try:
            super().remove_tree(path)
        finally:
            self._reads.changed()
