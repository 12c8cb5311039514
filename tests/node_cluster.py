"""The simulated multi-node Ray cluster the ``*_nodes.py`` scripts run on (each in a subprocess of its test, so
the session's own cluster is untouched), and how a test runs such a script and reads its JSON lines."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHONPATH = os.pathsep.join([HERE, os.path.dirname(HERE)])  # tests/ and the project, in every Ray worker too


@contextlib.contextmanager
def node_cluster(namespace: str, head_resources: int, worker_resources: int = 0):
    """``(ray, cluster)``: a head node with 1 CPU and ``head_resources`` of resource ``head`` (plus a worker node
    with as many of resource ``worker`` when given), joined by this process; shut down on exit."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": head_resources}})
    if worker_resources:
        cluster.add_node(num_cpus=1, resources={"worker": worker_resources})
        cluster.wait_for_nodes()
    ray.init(
        address=cluster.address,
        namespace=namespace,
        logging_level="ERROR",
        runtime_env={"env_vars": {"PYTHONPATH": PYTHONPATH}},
    )
    try:
        yield ray, cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def run_node_script(script: str, *args: str, lines: int) -> list[dict]:
    """Run ``tests/<script>`` in a subprocess; the ``lines`` JSON objects it printed (assert that it printed them
    and exited 0, with its output's tail otherwise)."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, script), *args], env=env, capture_output=True, text=True, timeout=900
    )
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(out) == lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out
