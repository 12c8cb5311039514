"""Health patrol: re-hash old snapshots at a bounded read rate, quarantine corrupt ones,
and watch free space (source article §5.3).

``scrub(storage)`` is one pass (``rl-ckpt scrub URL``); ``HealthPatrol`` runs
passes on a background thread (``engine.start_patrol()``). A corrupt snapshot
is quarantined — excluded from recovery, shown by ``ls``/``verify`` — and never
deleted: a person decides.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from rl_ckpt._run.catalog import Catalog
from rl_ckpt._run.quarantine import quarantine
from rl_ckpt._run.snapshot_files import VerifyReport, verify_snapshot
from rl_ckpt._storage import Storage

log = logging.getLogger("rl_ckpt")


class RateLimiter:
    """Paces reads to ``bytes_per_second`` (sleeping is the point here)."""

    def __init__(self, bytes_per_second: float | None, stop: threading.Event | None = None) -> None:
        self.rate = bytes_per_second
        self.stop = stop or threading.Event()
        self.started = time.monotonic()
        self.consumed = 0

    def __call__(self, nbytes: int) -> None:
        self.consumed += nbytes
        if not self.rate:
            return
        ahead = self.consumed / self.rate - (time.monotonic() - self.started)
        if ahead > 0:
            self.stop.wait(ahead)


@dataclasses.dataclass
class ScrubReport:
    checked: list[str] = dataclasses.field(default_factory=list)
    quarantined: dict[str, str] = dataclasses.field(default_factory=dict)  # newly quarantined by this pass
    already_quarantined: list[str] = dataclasses.field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0
    free_bytes: int | None = None
    low_space: bool = False

    @property
    def ok(self) -> bool:
        return not self.quarantined and not self.low_space

    def __str__(self) -> str:
        rate = self.bytes_read / self.seconds / 2**20 if self.seconds else 0.0
        lines = [
            f"scrubbed {len(self.checked)} snapshot(s), {self.bytes_read / 2**20:.1f} MiB in {self.seconds:.1f} s "
            f"({rate:.1f} MiB/s)"
        ]
        for sid, why in self.quarantined.items():
            lines.append(f"  QUARANTINED {sid}: {why}")
        if self.already_quarantined:
            lines.append(f"  already quarantined: {', '.join(self.already_quarantined)}")
        if self.free_bytes is not None:
            lines.append(f"  free space: {self.free_bytes / 2**30:.2f} GiB" + ("  (LOW)" if self.low_space else ""))
        return "\n".join(lines)


def scrub(
    storage: Storage,
    *,
    bytes_per_second: float | None = None,
    min_free_bytes: int = 0,
    stop: threading.Event | None = None,
) -> ScrubReport:
    """Re-hash every committed snapshot, oldest first; quarantine the corrupt ones."""
    started = time.monotonic()
    catalog = Catalog(storage)
    catalog.refresh()
    limiter = RateLimiter(bytes_per_second, stop)
    report = ScrubReport()
    for info in catalog.snapshots():
        if stop is not None and stop.is_set():
            break
        if info.quarantined:
            report.already_quarantined.append(info.snapshot_id)
            continue
        result = verify_snapshot(storage, info.snapshot_id, VerifyReport(), throttle=limiter)
        report.checked.append(info.snapshot_id)
        if not result.ok:
            reason = "; ".join(f"{p.path}: {p.problem}" for p in result.problems[:3])
            quarantine(storage, info.snapshot_id, reason, source="scrub")
            report.quarantined[info.snapshot_id] = reason
            log.error("scrub: quarantined %s: %s", info.snapshot_id, reason)
    report.bytes_read = limiter.consumed
    report.free_bytes = storage.free_bytes()
    if report.free_bytes is not None and report.free_bytes < min_free_bytes:
        report.low_space = True
        log.warning(
            "checkpoint storage %s has %.2f GiB free (< min_free_bytes %.2f GiB)",
            storage.url,
            report.free_bytes / 2**30,
            min_free_bytes / 2**30,
        )
    report.seconds = time.monotonic() - started
    return report


class HealthPatrol:
    """Background scrubbing every ``interval_seconds``; ``status()`` for /healthz."""

    def __init__(
        self,
        storage: Storage,
        *,
        interval_seconds: float,
        bytes_per_second: float | None,
        min_free_bytes: int,
        on_report=None,
    ) -> None:
        self.storage = storage
        self.interval = interval_seconds
        self.rate = bytes_per_second
        self.min_free = min_free_bytes
        self.on_report = on_report
        self.last_report: ScrubReport | None = None
        self.last_error: str | None = None
        self.passes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rl_ckpt-patrol", daemon=True)

    def start(self) -> "HealthPatrol":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.last_report = scrub(
                    self.storage, bytes_per_second=self.rate, min_free_bytes=self.min_free, stop=self._stop
                )
                self.last_error = None
                if self.on_report is not None:
                    self.on_report(self.last_report)
            except Exception as exc:  # the patrol must outlive a bad pass; the error is kept and logged
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.error("health patrol pass failed: %s", self.last_error)
            self.passes += 1
            self._stop.wait(self.interval)

    def status(self) -> dict:
        r = self.last_report
        return {
            "passes": self.passes,
            "last_error": self.last_error,
            "last_checked": len(r.checked) if r else 0,
            "quarantined": sorted(r.quarantined) if r else [],
            "free_bytes": r.free_bytes if r else None,
            "low_space": r.low_space if r else False,
        }

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
