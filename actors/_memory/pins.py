"""What a :class:`~actors._memory.store.MemoryStore` adds for readers of policy versions: pins and placement.

- **Pins.** A reader pins the files it is about to read (a snapshot's files and the dedup objects it
  references) in every store; a pinned file is neither removed (retention, object sweeps) nor evicted
  (budget) until the reader unpins it or its lease runs out (a reader that died lets go that way). The
  budget still holds: a put that does not fit without evicting a pinned file is refused.
- **Placement.** ``fetch`` copies files this store lacks from peer stores, store to store, once per file
  however many readers on the node ask at the same time; files a publisher is placing here are waited for
  rather than copied again, and a manifest is copied only once the data asked for with it is held
  (``actors/_memory/landing.py``).

A mixin of ``MemoryStore``: it uses the store's lock, files and ``_store``.
"""

from __future__ import annotations

import time

from rl_ckpt._format.manifest import MANIFEST_NAME

from .reads import picked

FETCH_BATCH = 16  # files moved from a peer at once (objects of up to 8 MiB each)


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

    def get_many(self, paths: list[str]) -> list:
        """``get`` of each of ``paths`` in one call (a reader of many files pays one round trip, not one each)."""
        return [self.get(p) for p in paths]

    # -- placement: copies pulled in from peer stores ------------------------------
    def fetch(self, paths: list[str], sources: list, placing: bool = False) -> int:
        """Copy each of ``paths`` this store lacks from the first of ``sources`` (peer stores) holding it: data
        first, manifests last and only once every data file asked for is held here (a manifest tells this store
        the snapshot is whole here), many at once. Callers asking at once for the same file wait for the copy
        in flight instead of making another, so N readers on a node cost one transfer to it; files a publisher
        announced as on their way here (``expect``) are waited for (``WAIT_EXPECTED_SECONDS`` at most) rather
        than copied. ``placing``: the publisher's own placement (it waits for nobody; what it could not copy is
        no longer expected). Returns the bytes this call copied in."""
        import ray

        if not placing:
            self.wait_landed(list(paths))
        with self._lock:
            mine = [p for p in dict.fromkeys(paths) if p not in self._files and p not in self._fetching]
            self._fetching.update(mine)
        moved = 0
        try:
            manifests = [p for p in mine if p.endswith("/" + MANIFEST_NAME)]
            moved += self._fetch_many(ray, [p for p in mine if p not in manifests], sources)
            if manifests and self._holds_data_of(paths, mine):
                moved += self._fetch_many(ray, manifests, sources)
        finally:
            with self._lock:
                self._fetching.difference_update(mine)
                self._fetched.notify_all()
            if placing:
                self._not_landing([p for p in mine if p not in self._files])
        with self._lock:  # copies of the same files that other callers are making
            self._fetched.wait_for(lambda: not self._fetching.intersection(paths))
        return moved

    def _holds_data_of(self, paths: list[str], mine: list[str]) -> bool:
        """Whether every file of ``paths`` but the manifests is held here (first waiting for those other callers
        are copying; ``mine``: this call's, copied already)."""
        data = set(p for p in paths if not p.endswith("/" + MANIFEST_NAME))
        others = data - set(mine)
        with self._lock:
            self._fetched.wait_for(lambda: not self._fetching.intersection(others))
            return all(p in self._files for p in data)

    def _fetch_many(self, ray, paths: list[str], sources: list) -> int:
        moved, todo = 0, list(paths)
        for source in sources:
            if not todo:
                break
            try:
                answers = ray.get([source.get.remote(p) for p in todo])
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
                continue  # that peer died: another may hold the files
            found = [(p, a) for p, a in zip(todo, answers) if a is not None and not isinstance(a, int)]
            for i in range(0, len(found), FETCH_BATCH):  # objects move in parallel, a batch at a time
                batch = found[i : i + FETCH_BATCH]
                try:
                    datas = ray.get([a[0] for _p, a in batch if isinstance(a, list)])
                except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
                    continue
                datas.reverse()
                for path, answer in batch:
                    owned, size = self.take(picked(answer, datas.pop()) if isinstance(answer, list) else answer)
                    with self._lock:
                        if path not in self._files:
                            self._store(path, owned, size)
                            self.fetched_bytes += size
                            moved += size
            todo = [p for p in todo if p not in self._files]
        return moved
