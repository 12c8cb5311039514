"""The two-phase commit of several participants: one attempt per snapshot, committed once every participant
reported. Pure Python, no Ray: the ``CheckpointManager`` actor drives it (``actors/_manager/commits.py``), a test drives
it directly.

``begin`` gives every participant the same attempt folder (laid out by the
run's commit strategy) and writes ``attempt.json`` there: who is expected.
Each participant writes its files, then its part of the manifest
(``<participant>.report.json``, see ``participant.py``), and calls
``report``. When the last expected part is in, the parts are merged into one
manifest and committed through the strategy, then run maintenance (aliases,
retention) runs; its warnings are kept for ``stats()``/``health()``. A
participant that fails aborts the snapshot for all.

Nothing here lives only in memory: after a restart :meth:`CommitProtocol.resume`
finds the pending commits again from the ``attempt.json`` and report files.
The caller (the manager) holds its lock around every call but the wait in
``report``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import Callable, Protocol

from rl_ckpt._commit.base import CommitStrategy
from rl_ckpt._commit.parts import merge_parts
from rl_ckpt.errors import CheckpointError, CommitConflictError, SnapshotAbortedError
from rl_ckpt._format.manifest import Manifest, now_iso
from rl_ckpt._format.untrusted import read_json
from rl_ckpt._run.catalog import Catalog, SnapshotInfo
from rl_ckpt._run.layout import (
    ATTEMPT_FILE,
    Attempt,
    committed_data_prefix,
    manifest_path,
    report_name,
    uncommitted_attempts,
)
from rl_ckpt._run.maintenance import RunMaintenance
from rl_ckpt._run.snapshot_files import read_manifest
from rl_ckpt._storage import Storage, join

log = logging.getLogger("rl_ckpt")
# Test hook: with this set to a folder, the manager pauses where ``<folder>/pause-<point>-<snapshot id>``
# exists (after writing ``paused-<point>-<snapshot id>`` there) until that file is removed.
PAUSE_DIR_ENV = "RL_CKPT_TEST_PAUSE_DIR"
MAX_ABORT_ERRORS = 256  # aborted attempts remembered for late reports


class CommitCounters(Protocol):
    """Where the protocol counts what it did (the manager's Prometheus metrics; :class:`NoCounters` in tests)."""

    def committed(self, seconds: float, step: int, nbytes: int) -> None: ...

    def aborted(self) -> None: ...


class NoCounters:
    """Counts nothing."""

    def committed(self, seconds: float, step: int, nbytes: int) -> None:
        pass

    def aborted(self) -> None:
        pass


@dataclasses.dataclass
class Pending:
    attempt: Attempt
    expected: list[str]
    deadline: float
    reports: dict[str, Manifest] = dataclasses.field(default_factory=dict)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: CheckpointError | None = None
    manifest: bytes | None = None
    bytes_received: int = 0
    begun: set = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class Refusal:
    """A snapshot a participant failed: the others are told at ``begin`` instead of waiting out the timeout."""

    error: SnapshotAbortedError
    by: str
    waiting: set | None  # participants still to be told; None: every participant but ``by``


def pause_point(point: str, snapshot_id: str) -> None:
    """The test hook (``RL_CKPT_TEST_PAUSE_DIR``): hold here while the test's pause file exists."""
    folder = os.environ.get(PAUSE_DIR_ENV)
    if not folder:
        return
    gate = os.path.join(folder, f"pause-{point}-{snapshot_id}")
    if not os.path.exists(gate):
        return
    with open(os.path.join(folder, f"paused-{point}-{snapshot_id}"), "w") as f:
        f.write(str(os.getpid()))
    log.warning("test hook: paused at %s of %s", point, snapshot_id)
    while os.path.exists(gate):
        time.sleep(0.05)


class CommitProtocol:
    """Pending sharded commits of one run: begin, report, abort, commit, resume after a restart."""

    def __init__(
        self,
        storage: Storage,
        strategy: CommitStrategy,
        catalog: Catalog,
        maintenance: RunMaintenance,
        commit_timeout: float,
        metrics: CommitCounters | None = None,
        on_commit: Callable[[SnapshotInfo], None] = lambda info: None,
    ) -> None:
        self.storage = storage
        self.strategy = strategy
        self.catalog = catalog
        self.maintenance = maintenance
        self.timeout = commit_timeout
        self.metrics = metrics if metrics is not None else NoCounters()
        self.on_commit = on_commit  # after each commit (the manager forgets older steps' decisions)
        self.pending: dict[str, Pending] = {}
        self.refused: dict[str, Refusal] = {}
        self.abort_errors: dict[str, SnapshotAbortedError] = {}  # attempt id -> why (late reports hear it)
        self.bytes_received: dict[str, int] = {}
        self.reported_metrics: dict = {}  # from Ray Train's reports, when the engine had none
        self.committed = 0
        self.aborted = 0
        self.maintenance_warnings: dict[str, list[str]] = {}  # the newest commit's, when maintenance warned

    def begin(self, snapshot_id: str, expected: list[str], participant: str) -> dict:
        """The attempt every participant of ``snapshot_id`` writes into; the abort error if it was refused."""
        refusal = self.refused.get(snapshot_id)
        if refusal is not None:
            if participant == refusal.by:  # the failed participant tries again: a new attempt for everyone
                del self.refused[snapshot_id]
            elif refusal.waiting is None or participant in refusal.waiting:
                if refusal.waiting is not None:
                    refusal.waiting.discard(participant)
                    if not refusal.waiting:
                        del self.refused[snapshot_id]
                raise refusal.error
        pending = self.pending.get(snapshot_id)
        if pending is not None and pending.error is None and not pending.done.is_set():
            pending.begun.add(participant)
            return dataclasses.asdict(pending.attempt)
        attempt = self.strategy.begin(snapshot_id)
        body = {"expected": sorted(set(expected)), "created_at": now_iso()}
        self.storage.write_atomic(attempt.data_path(ATTEMPT_FILE), json.dumps(body).encode())
        pending = Pending(attempt, body["expected"], time.monotonic() + self.timeout)
        pending.begun.add(participant)
        self.pending[snapshot_id] = pending
        return dataclasses.asdict(attempt)

    def report(self, snapshot_id: str, attempt_id: str, participant: str, part: bytes) -> bytes | Pending:
        """Take ``participant``'s part: the committed manifest if it is committed already, else the pending
        commit to wait on (it commits here when this was the last part)."""
        self.bytes_received[snapshot_id] = self.bytes_received.get(snapshot_id, 0) + len(part)
        done = self._committed_manifest(snapshot_id, attempt_id)
        if done is not None:
            return done
        pending = self.pending.get(snapshot_id)
        if attempt_id in self.abort_errors and (pending is None or pending.attempt.attempt_id != attempt_id):
            raise self.abort_errors[attempt_id]
        if pending is None or pending.attempt.attempt_id != attempt_id:
            raise CheckpointError(
                f"{snapshot_id}: attempt {attempt_id} is not pending (aborted or superseded)", snapshot_id=snapshot_id
            )
        if pending.error is not None:
            raise pending.error
        if participant not in pending.expected:
            raise CheckpointError(
                f"{snapshot_id}: {participant!r} is not one of the expected participants {pending.expected}",
                snapshot_id=snapshot_id,
            )
        manifest = Manifest.from_bytes(part, snapshot_id)
        self._check_files(pending, participant, manifest)
        pending.reports[participant] = manifest
        if set(pending.reports) >= set(pending.expected):
            pause_point("before-commit", snapshot_id)
            self._commit(snapshot_id, pending)
        return pending

    def abort(self, snapshot_id: str, attempt_id: str | None, participant: str, reason: str) -> None:
        """``participant``'s save failed: abort the snapshot for every participant (also before it began)."""
        pending = self.pending.get(snapshot_id)
        if pending is not None and not pending.done.is_set() and attempt_id in (None, pending.attempt.attempt_id):
            self._abort(snapshot_id, pending, f"{participant} failed: {reason}", by=participant)
        elif attempt_id is None and not self.storage.exists(manifest_path(snapshot_id)):
            error = abort_error(snapshot_id, f"{participant} failed: {reason}", participant)
            self.refused[snapshot_id] = Refusal(error, participant, None)
            self.aborted += 1
            self.metrics.aborted()
            log.warning("manager aborted %s before it began: %s failed: %s", snapshot_id, participant, reason)

    def awaiting(self, participant: str) -> list[str]:
        """Snapshots pending that still wait for ``participant``'s part (a replaced participant completes them)."""
        return sorted(
            sid
            for sid, p in self.pending.items()
            if participant in p.expected and participant not in p.reports and p.error is None and not p.done.is_set()
        )

    def abort_all(self, reason: str) -> None:
        """Abort every pending commit and forget refusals (a recovery plan starts a new timeline)."""
        for sid, pending in list(self.pending.items()):
            self._abort(sid, pending, reason)
        self.refused.clear()

    def expire(self, now: float) -> None:
        """Abort the pending commits whose participants did not all report within the commit timeout."""
        for sid, pending in list(self.pending.items()):
            if now > pending.deadline and not pending.done.is_set():
                missing = sorted(set(pending.expected) - set(pending.reports))
                self._abort(sid, pending, f"participants {missing} did not report within {self.timeout:.0f} s")

    def _check_files(self, pending: Pending, participant: str, part: Manifest) -> None:
        attempt = pending.attempt
        for f in part.files:
            rel = f.path[len(attempt.file_prefix) :] if f.path.startswith(attempt.file_prefix) else f.path
            path = attempt.data_path(rel)
            size = self.storage.size(path) if self.storage.exists(path) else None
            if size != f.size:
                raise CheckpointError(
                    f"{attempt.snapshot_id}: {participant} reported {f.path} ({f.size} bytes) but storage has {size}",
                    snapshot_id=attempt.snapshot_id,
                )

    def _commit(self, snapshot_id: str, pending: Pending) -> None:
        started = time.monotonic()
        try:
            merged = merge_parts(
                pending.reports,
                pending.attempt.attempt_id,
                pending.expected,
                head=self._head(pending.reports),
                extra_metrics=self._reported(pending.reports),
            )
        except CheckpointError as exc:
            self._abort(snapshot_id, pending, str(exc))
            return
        data = merged.to_bytes()
        try:
            self.strategy.commit(pending.attempt, data)
        except CommitConflictError as exc:
            self._abort(snapshot_id, pending, str(exc))
            return
        except CheckpointError as exc:
            self._abort(snapshot_id, pending, f"commit failed: {exc}")
            return
        self._tidy(pending)
        info = SnapshotInfo.from_manifest(merged)
        self.catalog.add(info)
        try:
            info.warnings = self.maintenance.after_commit()  # logged there, one line each
        except CheckpointError as exc:  # committed: aliases and retention must not fail the save
            info.warnings = [f"housekeeping after the commit failed: {exc}"]
            log.warning("%s committed, but housekeeping after the commit failed: %s", snapshot_id, exc)
        self.maintenance_warnings = {snapshot_id: info.warnings} if info.warnings else {}
        self.on_commit(info)
        pending.manifest = data
        pending.done.set()
        del self.pending[snapshot_id]
        self.committed += 1
        self.metrics.committed(time.monotonic() - started, info.global_step, self.bytes_received.get(snapshot_id, 0))
        log.info("manager committed %s from %s", snapshot_id, ", ".join(pending.expected))

    @staticmethod
    def _head(reports: dict[str, Manifest]) -> str:
        """The part whose header the merged manifest keeps: ``learner-0``'s, else the first by name."""
        return next((p for p in sorted(reports) if p.startswith("learner-0")), sorted(reports)[0])

    def _reported(self, reports: dict[str, Manifest]) -> dict:
        """Ray Train's reported metrics, when they are not newer than the snapshot."""
        step = self.reported_metrics.get("step")
        if step is not None and step > reports[self._head(reports)].global_step:
            return {}
        return {k: v for k, v in self.reported_metrics.items() if k != "step"}

    def _tidy(self, pending: Pending) -> None:
        """Coordination files are not part of the snapshot: remove them (gc would too)."""
        folder = committed_data_prefix(pending.attempt)
        for name in [ATTEMPT_FILE] + [report_name(p) for p in pending.expected]:
            try:
                self.storage.remove(join(folder, name))
            except CheckpointError as exc:
                log.warning("could not remove %s/%s: %s", folder, name, exc)

    def _abort(self, snapshot_id: str, pending: Pending, reason: str, by: str | None = None) -> None:
        pending.error = abort_error(snapshot_id, reason, by)
        self.abort_errors[pending.attempt.attempt_id] = pending.error
        while len(self.abort_errors) > MAX_ABORT_ERRORS:
            del self.abort_errors[next(iter(self.abort_errors))]
        if by is not None:  # participants that have not begun yet hear it at begin, not after the timeout
            waiting = set(pending.expected) - pending.begun - {by}
            if waiting:
                self.refused[snapshot_id] = Refusal(pending.error, by, waiting)
        pending.done.set()
        self.pending.pop(snapshot_id, None)
        self.aborted += 1
        self.metrics.aborted()
        log.warning("manager aborted %s: %s", snapshot_id, reason)
        try:  # a restarted manager must not resume (and commit) what was aborted, should every report land
            self.storage.remove(pending.attempt.data_path(ATTEMPT_FILE))
        except CheckpointError as exc:
            log.warning("could not remove attempt.json of aborted %s (gc removes it): %s", snapshot_id, exc)

    def _committed_manifest(self, snapshot_id: str, attempt_id: str) -> bytes | None:
        if not self.storage.exists(manifest_path(snapshot_id)):
            return None
        try:
            manifest = read_manifest(self.storage, snapshot_id)
        except CheckpointError:
            return None
        if manifest.writer.get("attempt") != attempt_id:
            raise CommitConflictError(f"{snapshot_id} was committed by another attempt", snapshot_id=snapshot_id)
        return manifest.to_bytes()

    def resume(self, on_resumed: Callable[[str], None] = lambda sid: None) -> None:
        """After a restart: the pending commits from the attempt folders on storage.

        ``on_resumed(snapshot id)`` is called for each before anything else
        happens to it. One folder that cannot be resumed is aborted (debris for
        gc); the others still are. A commit whose every report is in is finished here.
        """
        for attempt in uncommitted_attempts(self.storage):
            sid = attempt.snapshot_id
            try:
                if not self.storage.exists(attempt.data_path(ATTEMPT_FILE)):
                    continue
                body = read_json(self.storage, attempt.data_path(ATTEMPT_FILE))
                pending = Pending(attempt, list(body["expected"]), time.monotonic() + self.timeout)
                for p in pending.expected:
                    path = attempt.data_path(report_name(p))
                    if self.storage.exists(path):
                        report = Manifest.from_bytes(self.storage.read(path), sid)
                        self._check_files(pending, p, report)
                        pending.reports[p] = report
            except Exception as exc:
                log.warning("cannot resume pending commit in %s (aborted; debris for gc): %s", attempt.data_prefix, exc)
                continue
            self.pending[sid] = pending
            on_resumed(sid)
            log.info(
                "resumed pending commit of %s (%d of %d reports)", sid, len(pending.reports), len(pending.expected)
            )
            if set(pending.reports) >= set(pending.expected):
                try:
                    self._commit(sid, pending)
                except Exception as exc:
                    self._abort(sid, pending, f"could not finish the commit after a manager restart: {exc}")


def abort_error(snapshot_id: str, reason: str, by: str | None) -> SnapshotAbortedError:
    """The error every participant of an aborted snapshot gets."""
    return SnapshotAbortedError(
        f"snapshot {snapshot_id} aborted, not committed: {reason}. Its files are debris for `rl-ckpt gc`.",
        snapshot_id=snapshot_id,
        participant=by,
        reason=reason,
    )
