"""Node loss with the memory tier (``ray.cluster_utils.Cluster``: a head and a worker node on this machine).

With one replica, the worker node's memory snapshot files survive on the head node's store: both
participants restore the newest memory snapshot, bitwise. With no replica, the memory snapshots lose that
participant's files: the tier drops them and every participant restores the newest durable snapshot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    pytest.importorskip("ray")
    base = tmp_path_factory.mktemp("durable")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)])}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "memory_nodes.py"), str(base)], env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(lines) == 2, proc.stdout[-3000:] + proc.stderr[-6000:]
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
