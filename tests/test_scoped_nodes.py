"""A rollout worker's node removed mid-run, on a Ray cluster of two nodes of its own (``ray.cluster_utils.Cluster``,
in a subprocess: tests/scoped_nodes.py): both rollout workers of the Ray PPO demo go with the node, and so do
their memory snapshots; each is restarted by Ray on a new node, takes back its newest durable snapshot (if its
copy from memory was made) and replays the collects since, while the learners wait for the missing batches only.
The run ends bitwise equal to the same run uninterrupted on that cluster, every batch trained on exactly once."""

from __future__ import annotations

import json

import pytest
from node_cluster import run_node_script

pytestmark = pytest.mark.ray
STEPS, REMOVE_AT = 16, 12
# a durable full snapshot at step 10, light layers at 5 and 15, memory snapshots every 2 steps
ENGINE = {"save_interval_steps": 10, "light_interval_steps": 5, "keep_latest": 2, "dedup": True}


def test_rollout_workers_lost_with_their_node_are_recovered_alone(tmp_path):
    pytest.importorskip("ray")
    out = run_node_script("scoped_nodes.py", str(tmp_path), str(STEPS), str(REMOVE_AT), json.dumps(ENGINE), lines=1)[0]
    log = out["log"]
    assert out["error"] is None and out["removed_at"] is not None, out
    steps = [m["step"] for m in log if m["event"] == "step"]
    assert steps == list(range(1, STEPS + 1)) and len([m for m in log if m["event"] == "attempt"]) == 1, steps
    on_node = sorted(f"rollout-{n[-1]}" for n, node in out["placed"].items() if "rollout" in n and node == out["node"])
    assert on_node == ["rollout-0", "rollout-1"], out["placed"]  # both started on the node removed
    recovered = {m["participant"]: m for m in log if m["event"] == "scoped_recovery"}
    assert set(recovered) == {"rollout-0", "rollout-1"}, recovered
    for r in recovered.values():
        # The memory copies left with the node: the newest durable snapshot (none if its copy from memory was not
        # made yet), then the journal of collects since; Ray restarted the worker on the new node.
        assert r["tier"] in ("durable", None) and r["replacement"] == "restart", json.dumps(r)
        assert r["replayed_steps"] == list(range((r["restored_step"] or 0) + 1, r["step"])), json.dumps(r)
        assert r["step"] > out["removed_at"] - 1, json.dumps(r)
    done = next(m for m in log if m["event"] == "done")
    assert done["step"] == out["reference"]["step"] == STEPS
    assert done["digest"] == out["reference"]["digest"]
    audits = [m for m in log if m["event"] == "audit"]
    assert len(audits) == 2 and all(a["skipped"] == a["duplicated"] == 0 for a in audits), audits
    assert all(a["consumed"] == STEPS for a in audits), audits
