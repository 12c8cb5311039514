"""Sharded state through the Ray CheckpointManager: every rank reports its part, the manager unions the layouts."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

import sharded_workers as w

pytestmark = pytest.mark.ray


def test_manager_merges_rank_layouts_and_a_smaller_group_restores(ray_cluster, tmp_path):
    ray = ray_cluster
    from actors import CheckpointManager

    name = f"sharded-{uuid.uuid4().hex[:6]}"
    mgr = CheckpointManager.get_or_create(run_name=name, base_dir=str(tmp_path))
    cls = ray.remote(num_cpus=0)(w.ManagedFSDPLearner)
    init = f"tcp://127.0.0.1:{w.free_port()}"
    ranks = [cls.remote(str(tmp_path), name, mgr, r, 3, init, 0) for r in range(3)]
    assert ray.get([r.train_and_save.remote(2, 1) for r in ranks], timeout=180) == ["step_000000001"] * 3
    saved = ray.get([r.full_state.remote() for r in ranks], timeout=120)[0]  # a collective: every rank joins
    for r in ranks:
        ray.kill(r)
    meta = json.loads((tmp_path / name / "step_000000001" / "meta.json").read_text())
    chunks = meta["components"]["policy"]["layout"]["tensors"]["0.weight"]["chunks"]
    assert sorted(c["file"] for c in chunks) == [f"policy.rank{r}.safetensors" for r in range(3)]

    init = f"tcp://127.0.0.1:{w.free_port()}"
    ranks = [cls.remote(str(tmp_path), name, mgr, r, 2, init, 99) for r in range(2)]
    assert ray.get([r.restore.remote() for r in ranks], timeout=180) == ["step_000000001"] * 2
    got = ray.get([r.full_state.remote() for r in ranks], timeout=120)[0]
    assert set(got) == set(saved)
    for k, v in saved.items():
        assert np.array_equal(got[k], v), k
    for r in ranks:
        ray.kill(r)
