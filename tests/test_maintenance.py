"""RunMaintenance on its own (as the manager uses it), one verify for engine and CLI, real commit strategies."""

from __future__ import annotations

import json
import os

import torch

from rl_ckpt import CheckpointEngine
from rl_ckpt.cli import main as cli
from rl_ckpt._commit.participant import ParticipantCommit
from rl_ckpt._run.catalog import Catalog
from rl_ckpt._commit import CommitStrategy, ManifestLastCommit, StagedRenameCommit
from rl_ckpt._run.maintenance import RunMaintenance
from rl_ckpt._run.quarantine import quarantine
from rl_ckpt._run.retention import KeepLatest
from rl_ckpt._commit.collective import DistributedCommit
from rl_ckpt._storage import open_storage


def _objects(root) -> set[str]:
    return {os.path.join(r, f) for r, _, fs in os.walk(os.path.join(root, "objects")) for f in fs}


def _three_dedup_snapshots(tmp_path) -> str:
    """Steps 1..3, every tensor changed each time, nothing deleted (retention off)."""
    model = torch.nn.Linear(256, 256)
    e = CheckpointEngine(base_dir=str(tmp_path), dedup=True, dedup_min_tensor_bytes=1024, retention=False)
    e.register("policy", model)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.add_(1.0)
        e.save(step, metrics={"avg_reward": float(step)})
    run = e.storage.url
    e.close()
    return run


def test_maintenance_with_sweep_objects_off_leaves_chunks_to_gc(tmp_path):
    run = _three_dedup_snapshots(tmp_path)
    before = _objects(run)
    storage = open_storage(run)
    catalog = Catalog(storage)
    catalog.refresh()
    m = RunMaintenance(
        storage, catalog, retention=KeepLatest(1), best_metric="avg_reward", keep_best=1, sweep_objects=False
    )
    assert m.after_commit() == []
    assert [i.global_step for i in catalog.snapshots()] == [3]
    assert m.last_retention.delete == ["step_000000001", "step_000000002"]
    assert _objects(run) == before  # the manager's participants may be reusing them: gc's job
    retired = sorted(os.listdir(os.path.join(run, "history", "retired")))
    assert retired == ["step_000000001.json", "step_000000002.json"]
    alias = json.load(open(os.path.join(run, "best", "avg_reward.json")))
    assert alias["snapshot_id"] == "step_000000003"


def test_maintenance_sweeps_the_chunks_only_deleted_snapshots_used(tmp_path):
    run = _three_dedup_snapshots(tmp_path)
    before = _objects(run)
    storage = open_storage(run)
    catalog = Catalog(storage)
    catalog.refresh()
    kept = {
        d
        for i in catalog.snapshots()
        if i.snapshot_id == "step_000000003"
        for chunks in i.manifest.components["policy"]["objects"].values()
        for d, _s in chunks
    }
    m = RunMaintenance(storage, catalog, retention=KeepLatest(1))
    assert m.after_commit() == []
    after = _objects(run)
    assert after < before
    assert {os.path.basename(p) for p in after} == kept
    assert CheckpointEngine(base_dir=str(tmp_path)).verify().ok


def test_engine_and_cli_verify_agree_on_a_quarantined_snapshot(tmp_path, capsys):
    e = CheckpointEngine(base_dir=str(tmp_path))
    e.register("policy", torch.nn.Linear(4, 4))
    e.save(1)
    e.save(2)
    quarantine(e.storage, "step_000000001", "a person fenced it off", source="test")
    report = CheckpointEngine(base_dir=str(tmp_path)).verify("step_000000001")
    assert not report.ok and [p.path for p in report.problems] == ["quarantine"]
    assert cli(["verify", e.storage.url, "step_000000001"]) == 1
    assert "BAD" in capsys.readouterr().out and CheckpointEngine(base_dir=str(tmp_path)).verify("step_000000002").ok


def test_every_commit_path_is_a_commit_strategy():
    for cls in (StagedRenameCommit, ManifestLastCommit, ParticipantCommit, DistributedCommit):
        assert issubclass(cls, CommitStrategy), cls
    # The engine relies on fail() for every strategy, with the default removing the attempt's files.
    assert ParticipantCommit.fail is not CommitStrategy.fail and DistributedCommit.fail is not CommitStrategy.fail
