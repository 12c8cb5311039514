"""What a :class:`~actors._memory.store.MemoryStore` answers readers in one call: several stats, several ranges of
one file, whether a path is held, and a reader's whole view of the run (:meth:`StoreReads.view`).

``RayMemoryStorage`` asks the stores it already knows first (as its reads do), so outside a read session a
restore makes one call per file it reads and one per batch of stats, and lists the cluster's stores only for
a folder listing or a path none of the known stores holds. Inside a read session
(``RayMemoryStorage.read_session``, ``actors/_memory/view.py``) one ``view`` call per store answers every listing
and stat of the session and carries the newest committed snapshot's files.

A mixin of ``MemoryStore``: it uses the store's lock, files, sizes and versions.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from rl_ckpt._format.manifest import MANIFEST_NAME, parse_snapshot_id


def snapshot_of(path: str) -> str | None:
    """The snapshot folder ``path`` is in (None: a file of the run outside snapshots, e.g. ``decisions/``)."""
    top = path.split("/", 1)[0]
    return top if parse_snapshot_id(top) is not None else None


def under(path: str, prefix: str) -> bool:
    """Whether ``path`` is ``prefix`` or inside the folder ``prefix`` ("" : everything)."""
    return not prefix or path == prefix or path.startswith(prefix.rstrip("/") + "/")


class Slice(NamedTuple):
    """A file held as part of an object that holds a list of buffers: a publish's batch of chunks is one object
    (``ray.put`` of the list), not one per chunk, while the stores borrow it; each file is owned later as an
    object of its own (``actors/_memory/borrow.py``). ``index``: where the file is in the list (:func:`item_of`)."""

    ref: Any
    index: Any


def as_index(index: Any) -> Any:
    """An item index as :func:`item_of` takes it, in one form (a span's ``[item, start, size]`` may come back from a
    call as a list): an int, or a tuple."""
    return index if isinstance(index, int) else tuple(index)


def item_of(value: Any, index: Any) -> Any:
    """The file at ``index`` of a batch object's ``value`` (its list of buffers): item ``index``, or, for
    ``(item, start, size)``, those bytes of item ``item`` (a *span*: chunks lying next to each other in the
    publisher's memory are put as one buffer, ``actors/_versions/storage.py`` ``contiguous_spans``). Not copied."""
    if isinstance(index, int):
        return value[index]
    item, start, size = index
    return value[item][start : start + size]


def answer_of(held: Any) -> Any:
    """What a reader is answered for a held file: ``bytes`` (a small file), ``[ObjectRef]`` (an object of its own)
    or ``[ObjectRef, index]`` (its place in the object's list); the reader picks it out (``picked``)."""
    if isinstance(held, bytes):
        return held
    return [held.ref, held.index] if isinstance(held, Slice) else [held]


def resolved(held: Any) -> Any:
    """The bytes of a held file: itself, or the (read-only, not copied) object, or the part of it, behind its ref."""
    if isinstance(held, bytes):
        return held
    import ray

    return item_of(ray.get(held.ref), held.index) if isinstance(held, Slice) else ray.get(held)


def picked(answer: list, value: Any) -> Any:
    """The file a store's ``[ObjectRef]`` / ``[ObjectRef, index]`` answer names, given ``value``, the object behind
    the ref (``ray.get``, by the reader)."""
    return item_of(value, as_index(answer[1])) if len(answer) > 1 else value


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
        with self._lock:
            data, size = self._files.get(path), self._sizes.get(path)
        if data is None:
            return None
        if any(start + length > size for start, length in ranges):
            return size
        view = memoryview(resolved(data)).cast("B")
        return [bytes(view[start : start + length]) for start, length in ranges]

    def view(self, prefix: str = "", inline_bytes: int = 4 << 20, max_refs: int = 64) -> dict:
        """A reader's view of what this store holds under ``prefix``, in one reply:

        - ``files``: every held path -> (size, version);
        - ``data``: the files of the newest committed snapshot, as :meth:`get` answers them (``bytes`` for a small
          file, ``[ObjectRef]`` for one in the object store): its own files (manifest, meta) first, then its
          folders in name order, while the small files' bytes fit in ``inline_bytes`` and there are at most
          ``max_refs`` refs. A reader fetches what is left out when it reads it (one call per folder).
        """
        with self._lock:
            files = {p: (n, self._versions[p]) for p, n in self._sizes.items() if under(p, prefix)}
            committed = [s for s in {snapshot_of(p) for p in files} if s and f"{s}/{MANIFEST_NAME}" in files]
            data: dict = {}
            if committed:
                newest = max(committed, key=parse_snapshot_id)
                paths = sorted((p for p in files if p.startswith(newest + "/")), key=lambda p: (p.count("/"), p))
                room, refs = inline_bytes, max_refs
                for p in paths:
                    held = self._files[p]
                    if isinstance(held, bytes):
                        if len(held) > room:
                            continue
                        room -= len(held)
                        data[p] = held
                    elif refs > 0:
                        refs -= 1
                        data[p] = answer_of(held)
        return {"node": self.node_id, "files": files, "data": data}
