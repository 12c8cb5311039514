"""The simulated multi-node Ray cluster the ``*_nodes.py`` scripts run on (each in a subprocess of its test, so
the session's own cluster is untouched), and how a test runs such a script and reads the results it emits.

A script's results go to a file its test names (``emit``), not to its standard output: Ray forwards the workers'
log lines to the driver's standard output from a thread of its own, which can land between a ``print``'s text
and its newline (seen: a result line with Ray's "the actor is dead because it was killed by ``ray.kill``"
glued to its end)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHONPATH = os.pathsep.join([HERE, os.path.dirname(HERE)])  # tests/ and the project, in every Ray worker too
RESULTS = "RL_CKPT_NODE_RESULTS"  # the environment variable naming the file a script's results go to


def emit(result: dict) -> None:
    """One result of a ``*_nodes.py`` script: a JSON line appended, in one write, to the file its test named."""
    with open(os.environ[RESULTS], "a", encoding="utf-8") as f:
        f.write(json.dumps(result) + "\n")


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
    """Run ``tests/<script>`` in a subprocess; the ``lines`` results it emitted (``emit``; assert that it emitted
    them and exited 0, with its output's tail otherwise)."""
    with tempfile.TemporaryDirectory(prefix="rl_ckpt-node-results-") as folder:
        results = os.path.join(folder, "results.jsonl")
        env = {**os.environ, "PYTHONPATH": PYTHONPATH, RESULTS: results}
        proc = subprocess.run(
            [sys.executable, os.path.join(HERE, script), *args], env=env, capture_output=True, text=True, timeout=900
        )
        text = open(results, encoding="utf-8").read() if os.path.exists(results) else ""
    out = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert proc.returncode == 0 and len(out) == lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out
