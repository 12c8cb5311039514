"""What a :class:`~actors.memory_store.MemoryStore` adds for readers of policy versions: pins and placement.

- **Pins.** A reader pins the files it is about to read (a snapshot's files and the dedup objects it
  references) in every store; a pinned file is neither removed (retention, object sweeps) nor evicted
  (budget) until the reader unpins it or its lease runs out (a reader that died lets go that way). The
  budget still holds: a put that does not fit without evicting a pinned file is refused.
- **Placement.** ``fetch`` copies files this store lacks from peer stores, store to store, once per file
  however many readers on the node ask at the same time.

A mixin of ``MemoryStore``: it uses the store's lock, files and ``_store``.
"""

from __future__ import annotations

import time

from rl_ckpt.format.manifest import MANIFEST_NAME


class PinsAndFetch:
    # -- pins: files a reader is using are not removed under it ------------------------
    def pin(self, snapshot: str, holder: str, paths: list[str], seconds: float) -> bool:
        """Keep ``paths`` (a snapshot's files and the objects it references) from removal and eviction until
        :meth:`unpin` or ``seconds`` pass (a reader that died lets go that way). Returns whether this store
        holds the snapshot's manifest now (pinned first, looked at after: a removal that came before the pin
        shows as False)."""
        with self._lock:
            self._pins[(snapshot, holder)] = (time.monotonic() + seconds, frozenset(paths))
            return f"{snapshot}/{MANIFEST_NAME}" in self._files

    def unpin(self, snapshot: str, holder: str) -> None:
        with self._lock:
            self._pins.pop((snapshot, holder), None)

    def _live_pins(self) -> list[tuple[str, frozenset]]:
        now = time.monotonic()
        for k in [k for k, (until, _p) in self._pins.items() if until < now]:
            del self._pins[k]
        return [(sid, paths) for (sid, _h), (_u, paths) in self._pins.items()]

    def _pinned_paths(self) -> frozenset:
        return frozenset().union(*(paths for _s, paths in self._live_pins()))

    def _pinned_snapshots(self) -> set[str]:
        return {sid for sid, _p in self._live_pins()}

    def pins(self) -> dict[str, int]:
        """Snapshot -> how many readers pin it now."""
        with self._lock:
            out: dict[str, int] = {}
            for sid, _p in self._live_pins():
                out[sid] = out.get(sid, 0) + 1
            return out

    # -- placement: copies pulled in from peer stores ------------------------------
    def fetch(self, paths: list[str], sources: list) -> int:
        """Copy each of ``paths`` this store lacks from the first of ``sources`` (peer stores) holding it, in
        order (a manifest last: it tells this store the snapshot is whole here). Callers asking at once for
        the same file wait for the copy in flight instead of making another, so N readers on a node cost one
        transfer to it. Returns the bytes this call copied in."""
        import ray

        moved = 0
        for path in paths:
            with self._lock:
                self._fetched.wait_for(lambda p=path: p not in self._fetching)
                if path in self._files:
                    continue
                self._fetching.add(path)
            try:
                moved += self._fetch_one(ray, path, sources)
            finally:
                with self._lock:
                    self._fetching.discard(path)
                    self._fetched.notify_all()
        return moved

    def _fetch_one(self, ray, path: str, sources: list) -> int:
        for source in sources:
            try:
                got = ray.get(source.get.remote(path))
                if got is None or isinstance(got, int):
                    continue
                owned, size = self.take(ray.get(got[0]) if isinstance(got, list) else got)
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
                continue  # that peer died: another may hold the file
            with self._lock:
                if path in self._files:
                    return 0
                self._store(path, owned, size)
                self.fetched_bytes += size
            return size
        return 0

