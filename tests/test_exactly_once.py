"""Exactly once through three failures (``ray.cluster_utils.Cluster``: a head and a worker node on this machine).

A prompt dataset (12 prompts, 3 epochs) is trained on by a learner fed by two rollout workers whose partial
rollouts are saved in the same two-phase commit as the learner's weights, sampler and auditor. Failures: the
learner SIGKILLed, a rollout worker SIGKILLed, and the worker node removed (a learner and a rollout worker lost
together); each time every participant restores the manager's snapshot. The auditor, as of the final state,
and its append-only log replayed, both count 0 skipped and 0 duplicated across the epoch boundaries, and the
rollouts half-generated at a snapshot were resumed from their saved tokens, not generated again."""

from __future__ import annotations


import pytest
from node_cluster import run_node_script
from data_workers import GEN, expected_tokens

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    pytest.importorskip("ray")
    return run_node_script("exactly_once_nodes.py", str(tmp_path_factory.mktemp("once")), lines=1)[0]


def test_every_prompt_trained_exactly_once_through_learner_rollout_and_node_loss(outcome):
    o = outcome
    assert o["nodes"][0] == o["nodes"][1] != o["nodes"][2]  # learner and rollout-0 on the worker node
    assert all(len(set(s)) == 1 for s in o["saves"])  # every snapshot: the three parts in one commit
    for r in o["restores"]:
        assert len(set(r["snapshots"])) == 1 and len(set(r["steps"])) == 1, r  # the same cut everywhere
        assert r["from_step"] > r["steps"][0], r  # each failure undid updates...
        assert r["in_flight"] > 0, r  # ...and caught rollouts half-generated
    assert len(set(o["restores"][-1]["nodes"])) == 1  # after the node loss, everything runs on the head node
    report, epochs, size = o["report"], o["epochs"], o["size"]
    assert (report["skipped"], report["duplicated"], report["epochs"]) == (0, 0, epochs), report
    assert report["consumed"] == size * epochs
    assert o["replayed"] == report  # the append-only log, with the rolled-back updates dropped, agrees
    trained = o["trained"]
    assert sorted((r["epoch"], r["prompt"]) for r in trained) == [(e, p) for e in range(epochs) for p in range(size)]
    for r in trained:  # a resumed rollout went on from its saved tokens and generator: the uninterrupted answer
        assert r["tokens"] == expected_tokens(r["epoch"], r["prompt"])
    resumed = [r for r in trained if r["resumed"]]
    assert report["resumed_in_flight"] == len(resumed) > 0
    # Resumed, not regenerated: what a resumed rollout had generated came from the snapshot, only the rest was
    # generated after the restore (a rollout handed out just before a snapshot had nothing yet).
    assert all(0 <= r["restored_tokens"] < GEN for r in resumed), resumed
    assert sum(r["restored_tokens"] > 0 for r in resumed) >= 2, resumed
