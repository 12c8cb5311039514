"""Distributed restore: ranks load their own shards, compare probe outputs (all-gather over gloo) and,
if any rank fails its checks, all roll back together to the previous valid snapshot."""

from __future__ import annotations

import socket
import uuid

import pytest

from ray_workers import GlooLearner

pytestmark = pytest.mark.ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_rank_fails_all_roll_back_together(ray_cluster, tmp_path):
    ray = ray_cluster
    from actors import CheckpointManager

    name = f"dist-{uuid.uuid4().hex[:6]}"
    mgr = CheckpointManager.get_or_create(run_name=name, base_dir=str(tmp_path))
    init = f"tcp://127.0.0.1:{_free_port()}"
    cls = ray.remote(num_cpus=0)(GlooLearner)
    ranks = [cls.remote(str(tmp_path), name, mgr, r, 2, init) for r in range(2)]
    for step in (1, 2):
        assert ray.get([r.save.remote(step) for r in ranks], timeout=120) == [f"step_00000000{step}"] * 2
    plan = ray.get(mgr.plan.remote())  # planned (and verified) while every file was intact
    assert plan["target"] == "step_000000002"
    # Then only rank 1's own shard of the target is damaged: rank 0 could load it alone.
    shard = tmp_path / name / "step_000000002" / "learner-1" / "rng.safetensors"
    data = bytearray(shard.read_bytes())
    data[64] ^= 0xFF
    shard.write_bytes(bytes(data))
    results = ray.get([r.restore.remote() for r in ranks], timeout=120)
    assert [r[0] for r in results] == ["step_000000001", "step_000000001"]  # both fell back, together
    assert all(r[1] == 1.0 for r in results)
    assert "rank 1" in results[0][2]["step_000000002"]  # rank 0 says why it rolled back
    assert all(r[3]["agree"] > 0 for r in results)  # the seconds in the ranks' agreement, apart from the load
    ray.kill(mgr)
    for r in ranks:
        ray.kill(r)
