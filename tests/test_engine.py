"""Engine behaviours: fsync failure, schema and config checks, wrong shapes, strict restore, fresh start."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

from helpers import PPOState
from rl_ckpt import (
    CheckpointEngine,
    ConfigError,
    NoValidSnapshotError,
    StateMismatchError,
    StorageError,
)


def test_fsync_error_fails_the_save_and_commits_nothing(tmp_path, monkeypatch):
    s = PPOState()
    engine = s.register(CheckpointEngine(base_dir=str(tmp_path)))
    engine.save(1)
    real = os.fsync
    calls = {"n": 0}

    def failing(fd):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(StorageError, match="Input/output error"):
        engine.save(2)
    monkeypatch.setattr(os, "fsync", real)
    fresh = CheckpointEngine(base_dir=str(tmp_path))
    assert [i.global_step for i in fresh.snapshots()] == [1]
    assert not any((tmp_path / "run" / ".staging").iterdir())  # the failed attempt cleaned up after itself


def test_disk_full_names_the_file_and_says_what_to_do(tmp_path, monkeypatch):
    s = PPOState()
    engine = s.register(CheckpointEngine(base_dir=str(tmp_path)))
    real = os.write

    def full(fd, data):
        if len(data) > 1000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(StorageError) as err:
        engine.save(1)
    assert "disk full" in str(err.value) and ".safetensors" in str(err.value)
    assert "nothing was committed" in str(err.value)  # true here: the save failed before its commit point
    monkeypatch.setattr(os, "write", real)
    assert CheckpointEngine(base_dir=str(tmp_path)).snapshots() == []


def test_missing_base_dir_starts_fresh(tmp_path):
    s = PPOState()
    result = s.register(CheckpointEngine(base_dir=str(tmp_path / "does-not-exist"))).restore()
    assert result.fresh and result.snapshot_id is None and "starting fresh" in result.warnings[0]


def test_wrong_shapes_name_the_tensors(tmp_path):
    e = CheckpointEngine(base_dir=str(tmp_path))
    e.register("policy", torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    e.save(1)
    other = CheckpointEngine(base_dir=str(tmp_path))
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 2))
    before = [p.clone() for p in model.parameters()]
    other.register("policy", model)
    with pytest.raises(StateMismatchError) as err:
        other.restore()
    text = str(err.value)
    assert "0.weight" in text and "[8, 4]" in text and "[16, 4]" in text and "1.weight" in text
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing half-loaded


def test_schema_version_mismatch_refuses(tmp_path):
    e = CheckpointEngine(base_dir=str(tmp_path), schema_version=3)
    e.register("policy", torch.nn.Linear(2, 2))
    e.save(1)
    other = CheckpointEngine(base_dir=str(tmp_path), schema_version=4)
    other.register("policy", torch.nn.Linear(2, 2))
    with pytest.raises(NoValidSnapshotError, match="saved with schema_version 3, this job declares 4"):
        other.restore()
    e.save(2)  # an older layout never loads into the new one, but a matching snapshot still does
    assert (
        CheckpointEngine(base_dir=str(tmp_path), schema_version=3).restore(strict=False).snapshot_id == "step_000000002"
    )


def test_config_change_warns_with_changed_keys(tmp_path, caplog):
    e = CheckpointEngine(base_dir=str(tmp_path), train_config={"lr": 3e-4, "clip": 0.2, "batch": 64})
    e.register("policy", torch.nn.Linear(2, 2))
    e.save(1)
    other = CheckpointEngine(
        base_dir=str(tmp_path), train_config={"lr": 1e-4, "clip": 0.2, "batch": 64}, save_rng_state=False
    )
    other.register("policy", torch.nn.Linear(2, 2))
    with caplog.at_level(logging.WARNING, logger="rl_ckpt"):
        result = other.restore()
    assert result.snapshot_id == "step_000000001"
    assert any("train.lr" in w and "save_rng_state" in w and "clip" not in w for w in result.warnings)
    assert "train.lr" in caplog.text


def test_registered_component_missing_from_snapshot(tmp_path):
    e = CheckpointEngine(base_dir=str(tmp_path))
    e.register("policy", torch.nn.Linear(2, 2))
    e.save(1)
    other = CheckpointEngine(base_dir=str(tmp_path))
    other.register("policy", torch.nn.Linear(2, 2))
    other.register("value", torch.nn.Linear(2, 1))
    with pytest.raises(StateMismatchError, match="value"):
        other.restore()
    assert other.restore(strict=False).warnings


def test_save_switches_exclude_components(tmp_path):
    s = PPOState()
    e = s.register(
        CheckpointEngine(base_dir=str(tmp_path), save_optimizer=False, save_rng_state=False, save_replay_buffer=False)
    )
    info = e.save(1)
    assert set(info.manifest.components) == {"policy", "value", "lr_scheduler", "progress"}
    s2 = PPOState(seed=5)
    assert (
        s2.register(
            CheckpointEngine(
                base_dir=str(tmp_path), save_optimizer=False, save_rng_state=False, save_replay_buffer=False
            )
        )
        .restore()
        .snapshot_id
        == "step_000000001"
    )


def test_register_checks(tmp_path):
    e = CheckpointEngine(base_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="state_dict"):
        e.register("x", object())
    with pytest.raises(ConfigError, match="not allowed"):
        e.register("../evil", torch.nn.Linear(1, 1))
    with pytest.raises(ConfigError, match="global_step"):
        e.register("m", torch.nn.Linear(1, 1)) and e.save(-1)
    e.close()
    with pytest.raises(Exception, match="closed"):
        e.save(1)


def test_an_error_after_the_manifest_landed_does_not_claim_nothing_was_committed(tmp_path):
    """A failed run-folder fsync right after the commit rename: the save is not acknowledged, but its
    error must not say that nothing was committed (the snapshot is there, and verifies)."""
    from rl_ckpt.tools.faults import FaultyStorage
    from rl_ckpt._storage import open_storage

    storage = FaultyStorage(open_storage(str(tmp_path / "run")))
    engine = CheckpointEngine(base_dir=str(tmp_path), storage=storage)
    engine.register("policy", torch.nn.Linear(4, 2))
    storage.fail(
        "sync_dir",
        nth=2,
        error=StorageError(
            "cannot sync .: No space left on device (disk full: free space on the checkpoint volume; nothing was "
            "committed by this save)",
            path=".",
        ),
    )
    with pytest.raises(StorageError) as err:
        engine.save(1)
    assert "nothing was committed" not in str(err.value) and "manifest landed" in str(err.value)
    ops = [op for op, _ in storage.ops]
    last_rename = len(ops) - 1 - ops[::-1].index("rename_dir")
    assert ops[last_rename + 1] == "sync_dir" and "write" not in ops[last_rename:]  # failed after the rename
    fresh = CheckpointEngine(base_dir=str(tmp_path))
    assert [i.global_step for i in fresh.snapshots()] == [1] and fresh.verify().ok
