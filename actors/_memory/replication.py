"""What a :class:`~actors._memory.store.MemoryStore` does to copy files to its peers: a queue of (file, peer
stores) served by a thread of the store, so a writer never waits for replication. A snapshot's manifest
follows its data to every peer that received the data. ``wait_replicated`` and ``replication_lag`` tell how
far behind the copies are.

A mixin of ``MemoryStore``: it uses the store's lock, files, sizes, queue and its ``_queued``/``_idle``
conditions.
"""

from __future__ import annotations

import time

from rl_ckpt._format.manifest import MANIFEST_NAME

from .reads import Slice, resolved, snapshot_of


class StoreReplication:
    # -- replication -------------------------------------------------------------
    def replicate(self, paths: list[str], peers: list) -> None:
        """Queue ``paths`` for a copy to each peer store (returns at once)."""
        with self._lock:
            for p in paths:
                self._enqueue(p, list(peers))

    def _enqueue(self, path: str, peers: list) -> None:
        self._queue.append((path, peers, time.monotonic()))
        self._queued.notify()

    def _replicate_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._queued.wait()
                path, peers, _queued_at = self._queue.popleft()
                self._busy += 1
            try:
                self._copy(path, peers)
            finally:
                with self._lock:
                    self._busy -= 1
                    if not self._queue and not self._busy:
                        self._idle.notify_all()

    def _copy(self, path: str, peers: list) -> None:
        """Copy ``path`` to each peer; then the snapshot's manifest too once this store has it, so a peer that
        received data also learns the snapshot is committed (the manifest always arrives after its data)."""
        import ray

        sid = snapshot_of(path)
        manifest = f"{sid}/{MANIFEST_NAME}" if sid is not None else None
        for item in [path] + ([manifest] if manifest and path != manifest else []):
            with self._lock:
                data, size = self._files.get(item), self._sizes.get(item)
            if data is None:
                continue  # removed or evicted before it was copied; or no manifest yet (it follows later)
            # An ObjectRef goes as is: Ray moves the object to the peer's node, and the peer puts its own copy. An
            # item of a borrowed batch object goes as its bytes (mapped here, copied into the call).
            if isinstance(data, Slice):
                data = resolved(data)
            refs = [peer.put_replica.remote(item, data, self.node_id) for peer in peers]
            for ref in refs:
                try:
                    ray.get(ref)
                    self.replicated_bytes += size
                except Exception as exc:  # a peer gone: its copy is missing, which the tier view shows
                    self.replication_errors.append(f"{item}: {type(exc).__name__}: {exc}"[:500])
                    del self.replication_errors[:-50]

    def wait_replicated(self, timeout: float | None = None) -> bool:
        """Block until every queued copy was acked or failed (True) or ``timeout`` passed (False)."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._queue and not self._busy, timeout=timeout)

    def replication_lag(self) -> float:
        """Seconds the oldest queued copy has waited (0 when nothing is queued)."""
        with self._lock:
            if not self._queue:
                return 0.0
            return time.monotonic() - self._queue[0][2]
