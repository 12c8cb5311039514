"""Node loss with the memory tier (``ray.cluster_utils.Cluster``: a head and a worker node on this machine).

With one replica, the worker node's memory snapshot files survive on the head node's store: both
participants restore the newest memory snapshot, bitwise. With no replica, the memory snapshots lose that
participant's files: the tier drops them and every participant restores the newest durable snapshot."""

from __future__ import annotations


import pytest
from node_cluster import run_node_script

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    pytest.importorskip("ray")
    lines = run_node_script("memory_nodes.py", str(tmp_path_factory.mktemp("durable")), lines=2)
    return {o["replicas"]: o for o in lines}


def test_node_lost_restores_from_the_peer_replica(outcomes):
    o = outcomes[1]
    assert o["nodes"][0] != o["nodes"][1]  # the participants ran on two nodes
    assert o["flushed"] == "step_000000002"
    assert o["memory_before"] == ["step_000000002", "step_000000004", "step_000000006"]
    assert o["replicated_before"] == o["memory_before"]
    assert "step_000000006" in o["memory_after"] and o["dropped"] == []
    for got, want in zip(o["restored"], o["digests_at_6"]):
        assert (got["tier"], got["snapshot"], got["step"]) == ("memory", "step_000000006", 6), got
        assert got["digest"] == want  # bitwise the state at step 6


def test_node_lost_without_replica_falls_back_to_durable(outcomes):
    o = outcomes[0]
    assert o["nodes"][0] != o["nodes"][1]
    assert o["replicated_before"] == []
    assert o["memory_after"] == [] and o["dropped"] == o["memory_before"]
    for got, want in zip(o["restored"], o["digests_at_2"]):
        assert (got["tier"], got["snapshot"], got["step"]) == ("durable", "step_000000002", 2), got
        assert "durable snapshot step_000000002" in got["reason"]
        assert got["digest"] == want  # bitwise the state at step 2, nothing unverified loaded
