"""Light layers on full snapshots, and retention through the engine (including a crash mid-deletion)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

from helpers import PPOState, assert_same_state
from kill_child import StepState, retention_crash
from rl_ckpt import CheckpointEngine, StorageError
from rl_ckpt.cli import main as cli


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def test_restore_is_full_plus_newest_light_on_it(tmp_path):
    cfg = {"base_dir": str(tmp_path), "keep_latest": 10}
    s = PPOState(seed=4)
    e = s.register(CheckpointEngine(**cfg))
    s.train(2)
    e.save(2)
    weights_at_2 = PPOState(seed=4)
    weights_at_2.register(CheckpointEngine(**cfg)).restore()
    s.train(3)
    e.save(5, kind="light")
    s.train(2)
    light7 = e.save(7, kind="light")
    assert light7.base_snapshot_id == "step_000000002" and light7.kind == "light"
    progress_at_7 = s.progress.state_dict()
    sched_at_7 = s.lr_scheduler.state_dict()

    fresh = PPOState(seed=9)
    r = fresh.register(CheckpointEngine(**cfg)).restore()
    assert (r.snapshot_id, r.light_snapshot_id, r.global_step) == ("step_000000002", "step_000000007.light", 7)
    assert fresh.progress.state_dict() == progress_at_7 and fresh.lr_scheduler.state_dict() == sched_at_7
    for a, b in zip(fresh.policy.parameters(), weights_at_2.policy.parameters()):  # weights from the full one
        assert (a == b).all()

    full_only = PPOState(seed=9)
    r2 = full_only.register(CheckpointEngine(**cfg)).restore(light=False)
    assert r2.light_snapshot_id is None and r2.global_step == 2
    assert_same_state(full_only, weights_at_2)  # full-only restore is exact


def test_corrupt_light_is_skipped_and_light_without_valid_base_is_never_used(tmp_path):
    cfg = {"base_dir": str(tmp_path), "retention": False}  # retention keeps one light per full: keep them all here
    s = PPOState(seed=4)
    e = s.register(CheckpointEngine(**cfg))
    e.save(1)
    s.train(1)
    e.save(2, kind="light")  # on step 1
    s.train(1)
    e.save(3)
    s.train(1)
    e.save(4, kind="light")  # on step 3
    s.train(1)
    e.save(5, kind="light")  # on step 3
    run = tmp_path / "run"
    _flip(run / "step_000000005.light" / "progress.json")
    r = PPOState(seed=1).register(CheckpointEngine(**cfg)).restore()
    assert (r.snapshot_id, r.light_snapshot_id) == ("step_000000003", "step_000000004.light")
    assert "step_000000005.light" in r.skipped
    _flip(run / "step_000000003" / "policy.safetensors")  # the base of lights 4 and 5
    r = PPOState(seed=1).register(CheckpointEngine(**cfg)).restore()
    assert (r.snapshot_id, r.light_snapshot_id, r.global_step) == ("step_000000001", "step_000000002.light", 2)


def test_light_needs_a_full_base(tmp_path):
    e = PPOState().register(CheckpointEngine(base_dir=str(tmp_path)))
    with pytest.raises(Exception, match="full snapshot"):
        e.save(1, kind="light")


def test_retention_example_and_best_alias(tmp_path):
    e = PPOState().register(CheckpointEngine(base_dir=str(tmp_path), keep_latest=2, keep_best=1))
    for step, reward in zip(range(1, 7), [5, 9, 1, 2, 3, 4]):
        e.save(step, metrics={"avg_reward": reward})
    assert [i.global_step for i in e.snapshots()] == [2, 5, 6]
    assert [i.global_step for i in CheckpointEngine(base_dir=str(tmp_path)).snapshots()] == [2, 5, 6]
    best = json.loads((tmp_path / "run" / "best" / "avg_reward.json").read_text())
    assert best["snapshot_id"] == "step_000000002" and best["value"] == 9
    assert e.best().snapshot_id == "step_000000002"
    assert not any((tmp_path / "run" / ".trash").iterdir())


def test_retention_keeps_archive_points_and_multi_objective(tmp_path):
    e = PPOState().register(
        CheckpointEngine(
            base_dir=str(tmp_path),
            keep_latest=1,
            keep_best=1,
            keep_interval_steps=4,
            best_metric=["success", "violations"],
            best_mode=["max", "min"],
        )
    )
    rows = [(1, 0.5, 3), (2, 0.9, 5), (3, 0.9, 1), (4, 0.1, 9), (5, 0.2, 0), (6, 0.3, 0), (7, 0.2, 2), (8, 0.1, 1)]
    for step, success, violations in rows:
        e.save(step, metrics={"success": success, "violations": violations})
    assert [i.global_step for i in e.snapshots()] == [3, 4, 8]  # best (0.9, 1), archive 4 and 8, latest 8


@pytest.mark.parametrize(
    "atomic_write,op,nth,partial",
    [
        (True, "rename_dir", 2, False),  # after the commit rename of step 3, before retiring step 1
        (True, "remove_tree", 1, False),  # retired into .trash, not yet deleted
        (True, "remove_tree", 1, True),  # the deletion cut short halfway
        (False, "rename_dir", 1, False),  # manifest-last layout on a local disk: retired by rename too
        (False, "remove_tree", 1, True),
    ],
    ids=["staged-before-retire", "staged-in-trash", "staged-half-deleted", "ml-before-retire", "ml-half-deleted"],
)
def test_crash_during_retention_never_leaves_a_half_deleted_listed_snapshot(tmp_path, atomic_write, op, nth, partial):
    """A real process is SIGKILLed at the chosen storage operation of a retention pass."""
    cfg = {"base_dir": str(tmp_path), "keep_latest": 2, "keep_best": 0, "atomic_write": atomic_write}
    proc = mp.get_context("forkserver").Process(target=retention_crash, args=(cfg, op, nth, partial))
    proc.start()
    proc.join(60)
    assert proc.exitcode in (-9, 0)
    e = CheckpointEngine(**cfg)
    listed = [i.global_step for i in e.snapshots()]
    assert listed in ([1, 2, 3], [2, 3]), listed
    report = e.verify()
    assert report.ok, str(report)  # whatever is listed is complete
    model = StepState(nbytes=64 * 1024)
    e.register("model", model)
    assert e.restore().global_step == 3 and model.consistent_step() == 3
    assert cli(["gc", str(tmp_path / "run"), "--grace", "0"]) == 0
    assert [i.global_step for i in CheckpointEngine(**cfg).snapshots()] == listed
    leftovers = {p.name for p in (tmp_path / "run").iterdir()} - {
        "step_000000001",
        "step_000000002",
        "step_000000003",
        ".staging",
        ".trash",
        "history",
    }
    assert leftovers == set()
    assert not (tmp_path / "run" / ".trash").exists() or not any((tmp_path / "run" / ".trash").iterdir())
    assert proc.exitcode == -9, "the kill point was never reached"


@pytest.mark.parametrize("fail_op", ["remove", "remove_tree"])
def test_without_rename_the_manifest_goes_first(fail_op):
    """Object stores: retiring removes the manifest before the data, so a crash never lists a partial snapshot."""
    import uuid

    from rl_ckpt.tools.faults import FaultyStorage
    from rl_ckpt._storage import open_storage

    base = f"memory://ret-{uuid.uuid4().hex}"
    storage = FaultyStorage(open_storage(base + "/run"))
    e = CheckpointEngine(base_dir=base, storage=storage, keep_latest=2, keep_best=0)
    model = StepState(nbytes=4096)
    e.register("model", model)
    for step in (1, 2):
        model.set_step(step)
        e.save(step)
    storage.fail(fail_op, nth=1, error=5)  # EIO: the process "dies" at this point of the deletion
    model.set_step(3)
    info = e.save(3)  # the deletion is housekeeping after the commit: a warning, not a failed save
    assert info.global_step == 3 and len(info.warnings) == 1 and "injected fault" in info.warnings[0]
    listed = [i.global_step for i in CheckpointEngine(base_dir=base, storage=storage.inner).snapshots()]
    assert listed == ([1, 2, 3] if fail_op == "remove" else [2, 3])
    assert CheckpointEngine(base_dir=base, storage=storage.inner).verify().ok


# -- housekeeping after a commit never fails the save -------------------------------------------------------------
def _faulty(tmp_path, **cfg):
    from rl_ckpt.tools.faults import FaultyStorage
    from rl_ckpt._storage import open_storage

    storage = FaultyStorage(open_storage(str(tmp_path / "run")))
    return CheckpointEngine(base_dir=str(tmp_path), storage=storage, **cfg), storage


@pytest.mark.parametrize("atomic_write", [True, False])
def test_snapshot_deleted_outside_the_engine_leaves_the_catalog_and_retention_goes_on(tmp_path, atomic_write):
    import shutil

    s = PPOState()
    e = s.register(CheckpointEngine(base_dir=str(tmp_path), keep_latest=2, atomic_write=atomic_write))
    e.save(1)
    e.save(2)
    shutil.rmtree(tmp_path / "run" / "step_000000001")  # by hand, or by another engine on the same run
    for step in range(3, 10):
        info = e.save(step)
        assert info.warnings == []
    assert [i.global_step for i in e.snapshots()] == [8, 9]
    on_disk = sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith("step_"))
    assert on_disk == ["step_000000008", "step_000000009"]
    assert not (tmp_path / "run" / "history" / "retired" / "step_000000001.json").exists()  # not retention's doing
    assert (tmp_path / "run" / "history" / "retired" / "step_000000002.json").exists()


def test_best_alias_heals_when_its_snapshot_is_deleted_outside_the_engine(tmp_path):
    import shutil

    s = PPOState()
    e = s.register(CheckpointEngine(base_dir=str(tmp_path), keep_latest=10, keep_best=1))
    e.save(1, metrics={"avg_reward": 9.0})
    e.save(2, metrics={"avg_reward": 5.0})
    alias = tmp_path / "run" / "best" / "avg_reward.json"
    assert json.loads(alias.read_text())["snapshot_id"] == "step_000000001"
    shutil.rmtree(tmp_path / "run" / "step_000000001")
    info = e.save(3, metrics={"avg_reward": 1.0})
    assert info.warnings == []
    assert json.loads(alias.read_text())["snapshot_id"] == "step_000000002"
    assert [i.global_step for i in e.snapshots()] == [2, 3]


def test_disk_full_on_the_best_alias_is_a_warning_about_a_committed_snapshot(tmp_path):
    e, storage = _faulty(tmp_path, keep_latest=10, keep_best=1)
    s = PPOState()
    s.register(e)
    storage.fail(
        "write_atomic",
        path_contains="best/",
        nth=1,
        error=StorageError(
            "cannot write best/avg_reward.json: No space left on device (disk full: free "
            "space on the checkpoint volume; nothing was committed by this save)"
        ),
    )
    info = e.save(1, metrics={"avg_reward": 1.0})  # does not raise: the snapshot is committed
    assert len(info.warnings) == 1 and "best-snapshot alias" in info.warnings[0]
    assert "No space left" in info.warnings[0] and "nothing was committed" not in info.warnings[0]
    assert CheckpointEngine(base_dir=str(tmp_path)).verify("step_000000001").ok
    assert not (tmp_path / "run" / "best" / "avg_reward.json").exists()
    info = e.save(2, metrics={"avg_reward": 0.5})  # the next save heals the alias
    assert info.warnings == []
    assert json.loads((tmp_path / "run" / "best" / "avg_reward.json").read_text())["snapshot_id"] == "step_000000001"


def test_failed_retire_rename_is_a_warning_and_the_next_pass_retries(tmp_path):
    import errno as _errno

    e, storage = _faulty(tmp_path, keep_latest=1)
    s = PPOState()
    s.register(e)
    e.save(1)
    storage.fail("rename_dir", path_contains=".trash", nth=1, error=_errno.EIO)
    info = e.save(2)
    assert info.global_step == 2 and len(info.warnings) == 1
    assert "could not delete step_000000001" in info.warnings[0]
    assert [i.global_step for i in e.snapshots()] == [1, 2]  # still there, still listed
    assert e.save(3).warnings == []
    assert [i.global_step for i in e.snapshots()] == [3]
    assert [i.global_step for i in CheckpointEngine(base_dir=str(tmp_path)).snapshots()] == [3]


def test_scheduler_reports_a_post_commit_error_through_on_error_not_as_a_failed_save(tmp_path):
    import errno as _errno

    from rl_ckpt.errors import PostCommitError

    e, storage = _faulty(tmp_path, keep_latest=1, save_interval_steps=1, save_interval_seconds=None)
    s = PPOState()
    s.register(e)
    storage.fail("rename_dir", path_contains=".trash", nth=1, error=_errno.ENOSPC)
    errors, commits = [], []
    sched = e.scheduler(on_error=lambda exc, step: errors.append((exc, step)), on_commit=commits.append)
    sched.step(0)
    sched.step(1).wait(timeout=60)
    handle = sched.step(2)
    assert handle.wait(timeout=60).global_step == 2
    sched.close()
    assert handle.warnings and [c.global_step for c in commits] == [1, 2]
    assert sched.failures == 0 and sched.warnings == 1
    ((exc, step),) = errors
    assert isinstance(exc, PostCommitError) and step == 2 and exc.snapshot_id == "step_000000002"
    assert "is committed" in str(exc) and "nothing was committed" not in str(exc)


def test_real_disk_full_while_writing_the_best_alias_does_not_claim_nothing_was_committed(tmp_path, monkeypatch):
    """The local storage's own ENOSPC error (not an injected one), raised only for files under best/."""
    import errno as _errno

    s = PPOState()
    e = s.register(CheckpointEngine(base_dir=str(tmp_path), keep_latest=10, keep_best=1))
    real = os.write
    best = str(tmp_path / "run" / "best")

    def full(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(best):
            raise OSError(_errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", full)
    info = e.save(1, metrics={"avg_reward": 1.0})
    monkeypatch.setattr(os, "write", real)
    assert len(info.warnings) == 1 and "disk full" in info.warnings[0]
    assert "nothing was committed" not in info.warnings[0]
    assert CheckpointEngine(base_dir=str(tmp_path)).verify().ok
    assert [i.global_step for i in CheckpointEngine(base_dir=str(tmp_path)).snapshots()] == [1]
