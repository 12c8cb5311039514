"""The ``CheckpointManager``'s failures and recovery plans: it records the failures participants report
(blaming the participant that ran in a process Ray reported dead), lists them, and makes the one recovery plan
every participant follows (``rl_ckpt/_recovery/plan.py``), cached until a failure, a decision or a newer snapshot
changes it. Failures and decisions are files in the run folder, so a restarted manager plans the same.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading

from rl_ckpt._commit.two_phase import CommitProtocol
from rl_ckpt.config import CheckpointConfig
from rl_ckpt._recovery.coordinator import FailureInfo
from rl_ckpt._recovery.history import (
    failure_request,
    failure_to_answer,
    load_decisions,
    load_failures,
    record_decision,
)
from rl_ckpt._recovery.history import record_failure as write_failure
from rl_ckpt._recovery.plan import build_plan, coordinator_config, probe_check
from rl_ckpt.errors import CheckpointError
from rl_ckpt._run.catalog import Catalog, SnapshotInfo
from rl_ckpt._run.retire import retire_for_plan
from rl_ckpt._storage import join
from rl_ckpt._storage.base import Storage

from .decisions import SaveDecisions
from .participants import ParticipantRegistry

log = logging.getLogger("rl_ckpt")


def plan_key(failures: list, decisions: list, catalog: Catalog) -> tuple:
    """What a cached plan stays valid for: the failures and decisions recorded, and the newest snapshot."""
    newest = catalog.snapshots()
    return (len(failures), len(decisions), newest[-1].snapshot_id if newest else None)


class ManagerRecovery:
    """The actor's failure and plan calls, under the manager's lock."""

    def __init__(
        self,
        config: CheckpointConfig,
        storage: Storage,
        catalog: Catalog,
        lock: threading.RLock,
        registry: ParticipantRegistry,
        commits: CommitProtocol,
        save_decisions: SaveDecisions,
    ) -> None:
        self.config = config
        self.storage = storage
        self.catalog = catalog
        self.lock = lock
        self.registry = registry
        self.commits = commits
        self.save_decisions = save_decisions
        self.plan_cache: tuple[tuple, dict] | None = None
        self.last_failure: dict | None = None  # the newest failure recorded by this manager process (for /healthz)
        # snapshot -> path -> the version its file had right after the commit, on storage whose versions name
        # immutable contents (the memory tier), with verify-after-write on: files still at that version hold the
        # bytes their writers verified, and a plan does not re-hash them (``deep_check``). Lost with this process.
        self.verified: dict[str, dict[str, str]] = {}
        self._noting, self._noted = None, None
        if getattr(storage, "versions_name_content", False) and config.verify_after_write:
            self._noting = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rl_ckpt-verified")

    def committed(self, info: SnapshotInfo) -> concurrent.futures.Future | None:
        """Note the versions of a snapshot's files just after its commit (on a thread: the commit is not delayed;
        a plan waits for the newest note, ``_settle``)."""
        if self._noting is None or info.manifest is None:
            return None
        paths = [join(info.snapshot_id, f.path) for f in info.manifest.files]
        self._noted = self._noting.submit(self._note_versions, info.snapshot_id, paths)
        return self._noted

    def _settle(self) -> None:
        """Wait for the newest commit's note (a few milliseconds: one view of the stores), so that a plan asked for
        right after a commit does not re-hash what is being noted. Not under the lock: the note takes it."""
        noted = self._noted
        if noted is not None:
            try:
                noted.result(timeout=30)
            except Exception as exc:  # its files are re-hashed
                log.info("a plan went on without the newest commit's versions: %s", exc)

    def _note_versions(self, sid: str, paths: list[str]) -> None:
        try:
            with self.storage.read_session():  # the view a plan's read session sees: the same holder's version
                stats = self.storage.stat_many(paths)
        except CheckpointError as exc:
            log.info("versions of %s not noted (a plan re-hashes its files): %s", sid, exc)
            return
        versions = {p: st.version for p, st in zip(paths, stats) if st is not None and st.version is not None}
        with self.lock:
            live = {info.snapshot_id for info in self.catalog.snapshots()}
            for gone in [s for s in self.verified if s not in live]:
                del self.verified[gone]
            if sid in live:
                self.verified[sid] = versions

    def record_failure(self, failure: dict, dead: list[dict] | None = None) -> dict:
        """Write a failure (FailureInfo JSON) into the run folder; returns it as stored.

        ``dead``: processes Ray reported dead (``{"actor_id", "pid"}``, see
        ``integrations.ray_train.dead_processes``). The participant that ran in one
        of them is the one that failed: the record names it, and a failure without
        a step takes that participant's last reported step, i.e. where it was when
        it died (a survivor may have run on until its collective failed).
        The failed participant counts as lost (``/healthz`` degraded) until it
        registers again or beats (unless its restarted process registered already).
        """
        info = failure_request(failure)  # refused field by field before anything is written
        with self.lock:
            self.registry.blame(info, dead or [])
            self.last_failure = info.to_json()
        write_failure(self.storage, info)
        log.warning("failure recorded: %s of %s at step %s: %s", info.kind, info.participant, info.step, info.message)
        return info.to_json()

    def failures(self) -> list[dict]:
        return load_failures(self.storage)

    def newest_failure(self) -> dict | None:
        """The newest failure: recorded by this manager process, else read from the run folder (recorded before
        this process started)."""
        if self.last_failure is not None:
            return self.last_failure
        recorded = self.failures()
        return recorded[-1] if recorded else None

    def plan(self, light: bool = True) -> dict:
        """The recovery plan every participant follows (the same for all until something changes).

        The newest failure not yet answered by a decision goes to the coordinator;
        its decision is recorded in the run folder once.
        """
        self._settle()
        # One view of the run for the whole plan (a memory tier: one round trip per store, not one per file).
        with self.lock, self.storage.read_session():
            decisions = load_decisions(self.storage)
            failures = self.failures()
            answered = {d.failure.time for d in decisions}
            key = (*plan_key(failures, decisions, self.catalog), light)
            if self.plan_cache is not None and self.plan_cache[0][0] == key[0] and self.plan_cache[0][2:] == key[2:]:
                return self.plan_cache[1]
            # Saves still pending belong to the timeline being recovered from: finishing one with the
            # restarted participants' reports would mix two timelines in one snapshot.
            self.commits.abort_all("a recovery plan was made; this save belongs to the run that failed")
            self.save_decisions.clear()  # training goes on from the plan's snapshot: its steps are saved anew
            open_failure = failure_to_answer(failures, answered)  # a report before a heartbeat loss of one incident
            failure = FailureInfo.from_json(open_failure) if open_failure else None
            # The manager has no components: the plan loads what the snapshot holds.
            plan = build_plan(
                self.catalog,
                self.storage,
                schema_version=self.config.schema_version,
                components=None,
                coordinator=coordinator_config(self.config),
                history=decisions,
                failure=failure,
                deep=True,
                probes=probe_check(self.config),
                light=light,
                verified=self.verified,
            )
            if plan.decision is not None:
                record_decision(self.storage, plan.decision)
            if plan.action == "restore":  # the failed timeline's newer snapshots, once for all (retire_for_plan)
                plan.retired = retire_for_plan(self.storage, self.catalog, plan, by="manager")
            body = plan.to_json()
            self.plan_cache = ((*plan_key(failures, decisions, self.catalog), light), body)  # as the next caller sees
            return body
