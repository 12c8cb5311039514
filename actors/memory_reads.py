"""What a :class:`~actors.memory_store.MemoryStore` answers readers in one call: several stats, several ranges of
one file, whether a path is held. ``RayMemoryStorage`` asks the stores it already knows first (as its reads do),
so a restore makes one call per file it reads, one per batch of stats, and lists the cluster's stores only for
a folder listing or a path none of the known stores holds.

A mixin of ``MemoryStore``: it uses the store's lock, files, sizes and versions.
"""

from __future__ import annotations


class StoreReads:
    def stat_many(self, paths: list[str]) -> list[tuple[str, int, int] | None]:
        """(this store's node, size, version) of each path, or None where this store does not hold it."""
        with self._lock:
            return [None if p not in self._sizes else (self.node_id, self._sizes[p], self._versions[p]) for p in paths]

    def holds(self, path: str) -> bool | None:
        """True if ``path`` is a held file or a folder holding one, else None (so a reader asks the next store)."""
        with self._lock:
            if path in self._sizes or (not path and self._sizes):
                return True
            folder = path.rstrip("/") + "/"
            return True if any(p.startswith(folder) for p in self._sizes) else None

    def get_ranges(self, path: str, ranges: list[tuple[int, int]]):
        """The bytes of each ``(start, length)`` of ``path``, in one reply (None: absent; an int: the file's size,
        when a range runs past it)."""
        import ray

        with self._lock:
            data, size = self._files.get(path), self._sizes.get(path)
        if data is None:
            return None
        if any(start + length > size for start, length in ranges):
            return size
        view = memoryview(data if isinstance(data, bytes) else ray.get(data))
        return [bytes(view[start : start + length]) for start, length in ranges]
