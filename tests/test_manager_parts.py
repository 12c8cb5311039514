"""The manager's pieces without Ray: the commit protocol (actors/_manager/commits.py) on real storage, the
participant registry (actors/_manager/participants.py), and recovery planning from explicit inputs."""

from __future__ import annotations

import pytest

from rl_ckpt._commit.two_phase import CommitProtocol, Pending
from actors._manager.participants import ParticipantRegistry
from rl_ckpt.config import CheckpointConfig
from rl_ckpt._format.manifest import FileEntry, Manifest
from rl_ckpt.errors import SnapshotAbortedError, UnknownParticipantError
from rl_ckpt._recovery.coordinator import Action, CoordinatorConfig, FailureInfo
from rl_ckpt._recovery.history import (
    failure_to_answer,
    load_decisions,
    load_failures,
    record_decision,
    record_failure,
)
from rl_ckpt._recovery.plan import build_plan
from rl_ckpt._run import layout
from rl_ckpt._run.catalog import Catalog
from rl_ckpt._commit import strategy_for
from rl_ckpt._run.maintenance import RunMaintenance
from rl_ckpt._storage import open_storage

PARTS = ["learner-0", "rollout-0"]


class Counts:
    """Stands in for the Prometheus metrics (unit logic): what was counted."""

    def __init__(self) -> None:
        self.commits: list[int] = []
        self.aborts = 0

    def committed(self, seconds: float, step: int, nbytes: int) -> None:
        self.commits.append(step)

    def aborted(self) -> None:
        self.aborts += 1


@pytest.fixture(params=[True, False], ids=["staged-rename", "manifest-last"])
def run(request, tmp_path):
    cfg = CheckpointConfig(base_dir=str(tmp_path), run_name="r", keep_latest=1, atomic_write=request.param)
    storage = open_storage(cfg.run_url)
    yield cfg, storage
    storage.close()


def protocol(cfg, storage) -> CommitProtocol:
    catalog = Catalog(storage)
    maintenance = RunMaintenance.from_config(storage, catalog, cfg, sweep_objects=False)
    return CommitProtocol(storage, strategy_for(storage, cfg.atomic_write), catalog, maintenance, 60.0, Counts())


def write_part(storage, attempt: dict, participant: str, step: int) -> bytes:
    """What a participant does before ``report``: its file in the attempt folder, then its part."""
    a = layout.Attempt(**attempt)
    data = participant.encode() * 10
    storage.write(a.data_path(f"{participant}.bin"), [data])
    entry = FileEntry(a.manifest_path(f"{participant}.bin"), len(data), "0" * 32, "xxh3_128", participant, "json")
    part = Manifest(
        a.snapshot_id, step, files=[entry], metrics={participant: 1.0}, components={participant: {"kind": "rng"}}
    ).to_bytes()
    storage.write(a.data_path(layout.report_name(participant)), [part])
    return part


def test_commit_when_every_part_is_in_then_maintenance(run):
    cfg, storage = run
    commits = protocol(cfg, storage)
    for step in (1, 2):
        sid = layout.snapshot_id(step)
        attempts = [commits.begin(sid, PARTS, p) for p in PARTS]
        assert attempts[0] == attempts[1]  # one attempt for every participant
        first = commits.report(
            sid, attempts[0]["attempt_id"], PARTS[0], write_part(storage, attempts[0], PARTS[0], step)
        )
        assert isinstance(first, Pending) and not first.done.is_set()
        commits.report(sid, attempts[0]["attempt_id"], PARTS[1], write_part(storage, attempts[0], PARTS[1], step))
        assert first.done.is_set() and first.error is None
        merged = Manifest.from_bytes(first.manifest, sid)
        assert {f.component for f in merged.files} == set(PARTS) and merged.metrics == {p: 1.0 for p in PARTS}
        folder = layout.committed_data_prefix(layout.Attempt(**attempts[0]))
        names = {e.name for e in storage.list(folder)}
        assert {f"{p}.bin" for p in PARTS} <= names  # the data stays, the coordination files go
        assert layout.ATTEMPT_FILE not in names and not any(n.endswith(".report.json") for n in names)
        # a retried report of a committed snapshot gets the manifest again
        assert commits.report(sid, attempts[0]["attempt_id"], PARTS[0], b"{}") == first.manifest
    assert [i.snapshot_id for i in commits.catalog.snapshots()] == ["step_000000002"]  # keep_latest=1 ran
    assert commits.metrics.commits == [1, 2] and commits.committed == 2 and commits.maintenance_warnings == {}


def test_a_restarted_protocol_resumes_the_pending_commit(run):
    cfg, storage = run
    sid = layout.snapshot_id(7)
    attempt = protocol(cfg, storage).begin(sid, PARTS, PARTS[0])
    write_part(storage, attempt, PARTS[0], 7)  # reported, then the manager died
    resumed: list[str] = []
    commits = protocol(cfg, storage)
    commits.resume(on_resumed=resumed.append)
    assert resumed == [sid] and set(commits.pending[sid].reports) == {PARTS[0]}
    assert commits.begin(sid, PARTS, PARTS[1]) == attempt  # the same attempt as before the restart
    pending = commits.report(sid, attempt["attempt_id"], PARTS[1], write_part(storage, attempt, PARTS[1], 7))
    assert pending.done.is_set() and storage.exists(layout.manifest_path(sid))
    assert layout.uncommitted_attempts(storage) == []


def test_disagreeing_parts_abort_and_an_aborted_attempt_is_never_resumed(run):
    cfg, storage = run
    commits = protocol(cfg, storage)
    sid = layout.snapshot_id(3)
    attempt = commits.begin(sid, PARTS, PARTS[0])
    commits.report(sid, attempt["attempt_id"], PARTS[0], write_part(storage, attempt, PARTS[0], 3))
    pending = commits.report(sid, attempt["attempt_id"], PARTS[1], write_part(storage, attempt, PARTS[1], 4))
    assert isinstance(pending.error, SnapshotAbortedError) and "disagree on step/kind" in str(pending.error)
    with pytest.raises(SnapshotAbortedError):
        commits.report(sid, attempt["attempt_id"], PARTS[0], b"{}")
    again = protocol(cfg, storage)
    again.resume()
    assert again.pending == {} and not storage.exists(layout.manifest_path(sid))


def test_a_failure_before_begin_refuses_the_others_at_once(run):
    cfg, storage = run
    commits = protocol(cfg, storage)
    sid = layout.snapshot_id(5)
    commits.abort(sid, None, PARTS[1], "out of memory")
    with pytest.raises(SnapshotAbortedError, match="rollout-0 failed: out of memory"):
        commits.begin(sid, PARTS, PARTS[0])
    assert commits.begin(sid, PARTS, PARTS[1])["snapshot_id"] == sid  # the failed one tries again: a new attempt
    commits.expire(float("inf"))  # nobody reports: the commit timeout aborts it
    assert commits.pending == {} and commits.aborted == 2


def test_registry_blames_the_dead_process_and_finds_silent_participants():
    reg = ParticipantRegistry("r", heartbeat_interval=1.0)
    with pytest.raises(UnknownParticipantError, match="learner-0"):
        reg.check("learner-0")
    reg.register("learner-0", {"pid": 10}, None, now=0.0)
    reg.register("learner-1", {"pid": 11}, None, now=0.0)
    assert reg.heartbeat("learner-0", 40, "step_000000040", now=1.0) is True
    assert reg.heartbeat("learner-1", 35, None, now=1.0) is True
    info = FailureInfo("process_killed")
    reg.blame(info, [{"pid": 11}])
    assert (info.participant, info.step) == ("learner-1", 35)  # where the dead one was, not the survivor
    assert reg.participants["learner-1"].lost and reg.lost_count() == 1
    assert reg.furthest_step() is None  # the group restarts: steps are reported anew
    reg.heartbeat("learner-0", 41, None, now=2.0)
    assert [n for n, _ in reg.newly_lost(now=4.5)] == ["learner-0"] and reg.newly_lost(now=9.0) == []
    reg.unregister("learner-0")
    assert reg.heartbeat("learner-0", 42, None, now=9.0) is None and reg.heartbeat("x", 1, None, now=9.0) is False


def test_plan_from_explicit_inputs_and_recorded_history(run):
    cfg, storage = run
    commits = protocol(cfg, storage)
    for step in (1, 2):
        sid = layout.snapshot_id(step)
        attempt = commits.begin(sid, PARTS[:1], PARTS[0])
        commits.report(sid, attempt["attempt_id"], PARTS[0], write_part(storage, attempt, PARTS[0], step))
    failure = FailureInfo("exception", 9)
    record_failure(storage, failure)
    record_failure(storage, failure)  # a retried call writes nothing new
    assert load_failures(storage) == [failure.to_json()]
    catalog = Catalog(storage)

    def plan():
        return build_plan(
            catalog,
            storage,
            schema_version=1,
            components=None,
            coordinator=CoordinatorConfig(max_same_snapshot_failures=1),
            history=load_decisions(storage),
            failure=FailureInfo("exception", 9),
            deep=False,
        )

    first = plan()
    assert (first.action, first.target, first.decision.action) == ("restore", "step_000000002", Action.restore_latest)
    assert [a.component for a in first.actions] == ["learner-0"]  # no components given: what the snapshot holds
    assert plan().decision.attempt == 1  # planning writes nothing: the same inputs, the same plan
    record_decision(storage, first.decision)
    second = plan()  # 2 was restored and failed again: charged to it, and it is used up
    assert (second.decision.attempt, second.decision.charged_to, second.decision.action) == (
        2,
        "step_000000002",
        Action.give_up,
    )
    other = build_plan(
        catalog, storage, schema_version=2, components={"policy": "module"}, coordinator=CoordinatorConfig(), deep=False
    )
    assert other.action == "give_up" and all("schema_version 1" in c.reason for c in other.candidates)


def test_a_plan_answers_the_reported_failure_of_an_incident_before_a_heartbeat_loss():
    """The failures since the last answered one are one incident: the newest reported one is answered, a heartbeat
    loss only when nothing was reported; older unanswered records are not taken over a newer incident."""

    def rec(t: str, kind: str, step: int) -> dict:
        return {"time": t, "kind": kind, "step": step}

    killed, silent = rec("t2", "process_killed", 23), rec("t3", "heartbeat_lost", 21)  # the silence noticed last
    assert failure_to_answer([killed, silent], set()) == killed
    assert failure_to_answer([rec("t1", "heartbeat_lost", 21), killed], set()) == killed  # noticed first
    assert failure_to_answer([silent], set()) == silent  # a hang: nothing else says what happened
    old = rec("t0", "exception", 5)
    history = [old, killed, silent, rec("t4", "heartbeat_lost", 40)]
    # killed was answered: the incident is what came after it, heartbeat losses only (the newest is answered);
    # the older unanswered exception belongs to an earlier incident
    assert failure_to_answer(history, {"t2"}) == history[-1]
    assert failure_to_answer(history[:2], {"t2"}) == old  # nothing since: the newest no decision answered
    assert failure_to_answer([old, killed], {"t0", "t2"}) is None and failure_to_answer([], set()) is None
