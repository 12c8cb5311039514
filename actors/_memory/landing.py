"""What a :class:`~actors._memory.store.MemoryStore` does for a publisher that commits before its placement lands.

A policy version is committed in the publisher's node's store first; the stores of the nodes it is *placed* on
(``VersionsStorage.push_to``) receive its files in the background and its manifest last:

- **Expected files** (:meth:`StoreLanding.expect`). Before its local commit the publisher announces to each
  placement target the files on their way there (and the manifest). A reader's ``fetch`` of an expected file
  waits for it to land (``WAIT_EXPECTED_SECONDS`` at most) instead of copying it from another node a second
  time; once it lands, fails to land (the transfer raised, no room) or the wait runs out, the fetch copies what
  is still missing, as for any file. An announcement not followed by a landing expires (``EXPECT_SECONDS``).
- **Commit after landing** (:meth:`StoreLanding.commit_after`). The manifest is stored only once every file it
  vouches for is held here, checked under the store's lock at the moment it is stored: a store never holds a
  manifest whose files it does not hold (readers trust a committed manifest). A file that failed to land, or
  that is neither held nor on its way (e.g. evicted here), means no commit here: the workers of this node place
  the version when they pull, as for a store the publisher never reached. The wait blocks one of the actor's
  threads on a condition (the lock is released meanwhile): its other calls go on.

``hold_landing`` (a test hook) holds the placed borrows of files before their transfer, so a test sees a target
holding some of a version's files but no manifest, deterministically (and can kill the publisher meanwhile).

A mixin of ``MemoryStore``: it uses the store's lock, files and ``_store`` (which calls :meth:`_landed_here`).
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("rl_ckpt")

EXPECT_SECONDS = 60.0  # an announced file not landed by then is not waited for any more (its sender is gone)
WAIT_EXPECTED_SECONDS = 5.0  # a reader's fetch waits this long at most for announced files before copying them
COMMIT_WAIT_SECONDS = 120.0  # a manifest whose files have not all landed by then is not committed here


class StoreLanding:
    def _init_landing(self) -> None:
        self._expected: dict[str, float] = {}  # path -> until when it is expected (monotonic)
        self._landing = threading.Condition(self._lock)
        self._land_gate = threading.Event()  # cleared by ``hold_landing`` (tests): placed borrows wait
        self._land_gate.set()
        self.refused_commits: list[str] = []  # manifests not committed here: a file they vouch for is missing

    def expect(self, paths: list[str], seconds: float = EXPECT_SECONDS) -> int:
        """Announce ``paths`` as on their way to this store (those not held already); returns how many.
        ``seconds`` <= 0: forget the announcement (the sender gave up)."""
        with self._lock:
            if seconds <= 0:
                self._not_landing(paths)
                return 0
            until = time.monotonic() + seconds
            new = [p for p in paths if p not in self._files]
            for p in new:
                self._expected[p] = until
            return len(new)

    def _landed_here(self, path: str) -> None:
        """``path`` is held now (called by ``_store``, under the lock)."""
        if self._expected.pop(path, None) is not None:
            self._landing.notify_all()

    def _not_landing(self, paths) -> None:
        """``paths`` will not land (their transfer failed): nobody waits for them any more."""
        with self._lock:
            if any([self._expected.pop(p, None) is not None for p in paths]):
                self._landing.notify_all()

    def _awaited(self, paths) -> list[str]:
        """Those of ``paths`` not held and still expected (under the lock)."""
        now = time.monotonic()
        return [p for p in paths if p not in self._files and self._expected.get(p, 0.0) > now]

    def wait_landed(self, paths: list[str], timeout: float = WAIT_EXPECTED_SECONDS) -> list[str]:
        """Wait until none of ``paths`` is still on its way here (landed or failed), ``timeout`` at most; returns
        those still awaited then."""
        with self._lock:
            self._landing.wait_for(lambda: not self._awaited(paths), timeout=timeout)
            return self._awaited(paths)

    def commit_after(self, path: str, data: bytes, paths: list[str], timeout: float = COMMIT_WAIT_SECONDS) -> int:
        """Store the manifest ``path`` (``data``) once every one of ``paths`` (the files it vouches for) is held
        here; returns the bytes stored (0: not stored, because a file failed to land, was neither held nor on
        its way, or ``timeout`` passed; or because the manifest was held already, copied by a reader's fetch)."""
        with self._lock:
            self._landing.wait_for(lambda: not self._awaited(paths), timeout=timeout)
            missing = [p for p in paths if p not in self._files]
            if not missing and path not in self._files:
                try:
                    owned, size = self.take(data)
                    self._store(path, owned, size)
                    return size
                except Exception as exc:  # e.g. no room: not committed here, its workers place it when they pull
                    missing = [f"{type(exc).__name__}: {exc}"]
            self._not_landing([path])
            if missing:
                self.refused_commits.append(f"{path}: {len(missing)} missing, first {missing[0]}"[:500])
                del self.refused_commits[:-50]
                log.warning(
                    "memory store %s: %s not committed here: %d of the files it vouches for did not land (%s)",
                    self.node_id[:12],
                    path,
                    len(missing),
                    missing[0],
                )
            return 0

    def hold_landing(self, on: bool) -> None:
        """Hold (True) or release the placed borrows before their transfer (a test hook: a target holding some
        of a version's files but no manifest, deterministically)."""
        if on:
            self._land_gate.clear()
        else:
            self._land_gate.set()
