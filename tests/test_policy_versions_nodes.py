"""Policy versions on two nodes (``ray.cluster_utils.Cluster``: a head and a worker node on this machine).

2 learners (plain replicated ones, then FSDP2 ones on a gloo group) publish 5 versions; 4 rollout workers, 2
per node, pull each: bitwise the learners' weights, a one-layer change moves that layer's bytes, one transfer
per node; a killed worker's replacement gets the newest from the stores; retired and unknown versions are
named errors; a corrupted chunk is never loaded (the workers fall back to the previous version and say so); a
publish returns once committed on its own node, and the workers' node commits the version only once its files
landed there, also when the learners are killed before they do."""

from __future__ import annotations


import pytest
from node_cluster import run_node_script

pytestmark = pytest.mark.ray
LAYER_BYTES = 512 * 512 * 4  # version_workers.LAYER: the one weight versions 2, 4 and 5 change


@pytest.fixture(scope="module")
def outcomes():
    pytest.importorskip("ray")
    return {o["kind"]: o for o in run_node_script("version_nodes.py", lines=2)}


KINDS = ("replicated", "fsdp2")


@pytest.mark.parametrize("kind", KINDS)
def test_every_worker_pulls_every_version_bitwise(outcomes, kind):
    o = outcomes[kind]
    assert len(o["worker_nodes"]) == 2  # the workers ran on both nodes
    for v in o["versions"]:
        sids, digests = zip(*v["published"])
        assert len(set(digests)) == 1  # both learners hold the same weights
        writers = [s for s in sids if s is not None]
        assert writers and set(writers) == {f"step_{v['version']:09d}"}
        if kind == "replicated":
            assert sids[1] is None  # the same weights on every rank: written once
        for pull in v["pulls"]:
            assert (pull["version"], pull["source"], pull["fell_back_from"]) == (v["version"], "memory", None)
            assert pull["digest"] == digests[0]


@pytest.mark.parametrize("kind", KINDS)
def test_each_node_checks_a_version_once_for_its_workers(outcomes, kind):
    """Version 3 (every layer new), pulled once placed: on the learners' node the publishers' read-back checked
    its chunks, on the workers' other node its store as they landed; no worker hashed them again."""
    (v3,) = [v for v in outcomes[kind]["versions"] if v["version"] == 3]
    vouched = {(p["node"], p["bytes_vouched"]) for p in v3["pulls"]}
    assert len({node for node, _n in vouched}) == 2
    assert len({n for _node, n in vouched}) == 1 and next(iter(vouched))[1] > 0  # the same chunks on both nodes
    assert all(p["bytes_vouched"] <= p["bytes_moved"] for p in v3["pulls"])


@pytest.mark.parametrize("kind", KINDS)
def test_delta_moves_only_the_changed_layer(outcomes, kind):
    o = outcomes[kind]
    total = o["versions"][0]["pulls"][0]["bytes_total"]
    for v in o["versions"]:
        for pull in v["pulls"]:
            if v["version"] in (1, 3):  # every layer changed
                assert pull["bytes_moved"] == total
            else:
                assert 0 < pull["bytes_moved"] <= 1.1 * LAYER_BYTES


@pytest.mark.parametrize("kind", KINDS)
def test_a_node_receives_each_version_once(outcomes, kind):
    o = outcomes[kind]
    before: dict = {}
    for v in o["versions"]:
        nodes = {p["node"] for p in v["pulls"]}
        moved = v["pulls"][0]["bytes_moved"]
        into = {n: v["fetched"].get(n, 0) - before.get(n, 0) for n in nodes}  # copied into each node's store
        before = v["fetched"]
        head = [n for n in nodes if into[n] == 0]
        assert len(head) == 1  # the learners' node holds it already
        (worker,) = nodes - set(head)  # one transfer to the other node: what changed, plus the snapshot's files
        assert moved <= into[worker] <= moved + 32 * 1024
        copied = sorted(p["node_bytes_copied"] for p in v["pulls"] if p["node"] == worker)
        if v["version"] == 1:  # the first pull: the workers' node was not known yet, one of them had it placed
            assert copied[0] == 0 and copied[1] == into[worker]
        else:  # the publisher placed it there as it wrote it: the workers found it on their node
            assert copied == [0, 0]


@pytest.mark.parametrize("kind", KINDS)
def test_restarted_worker_gets_the_newest(outcomes, kind):
    o = outcomes[kind]
    r = o["restarted"]
    assert (r["version"], r["source"], r["bytes_moved"]) == (5, "memory", r["bytes_total"])
    assert r["digest"] == o["versions"][-1]["published"][0][1]


@pytest.mark.parametrize("kind", KINDS)
def test_retired_and_unknown_versions_are_named(outcomes, kind):
    o = outcomes[kind]
    for asked, got in ((1, o["retired"]), (77, o["unknown"])):
        assert got["error"] == "VersionNotFoundError"
        assert got["fields"]["version"] == asked and got["fields"]["newest"] == 5
        assert f"policy version {asked}" in got["message"] and "newest available: 5" in got["message"]


@pytest.mark.parametrize("kind", KINDS)
def test_corrupted_chunk_is_never_loaded(outcomes, kind):
    o = outcomes[kind]
    bad = o["corrupted"]["path"]
    assert o["corrupted"]["copies"] >= 1
    v5 = o["versions"][-1]["published"][0][1]
    for pull in o["after_corruption"]:
        assert (pull["version"], pull["fell_back_from"], pull["source"]) == (5, 6, "memory")
        assert pull["digest"] == v5  # bitwise version 5: nothing of the bad chunk reached the module
        assert bad in pull["reason"]
    assert o["worker_status"]["status"] == "degraded" and o["worker_status"]["faults"][-1]["path"] == bad
    assert o["status"]["status"] == "degraded"
    assert {f["path"] for f in o["status"]["faults"]} == {bad}
    assert o["status"]["pinned"] == {}  # every pull let go of its pins


@pytest.mark.parametrize("kind", KINDS)
def test_a_target_commits_a_version_only_once_its_files_landed(outcomes, kind):
    h = outcomes[kind]["held"]
    target, during, after = h["target"], h["during"], h["after"]
    (head,) = set(during) - {target}
    # The publishes returned with the placement held: committed and whole on the learners' node, listed,
    # and on the target some of the version's files but no manifest.
    assert during[head]["manifest"] and during[head]["files"] == during[head]["of"]
    assert not during[target]["manifest"] and 0 < during[target]["files"] < during[target]["of"]
    assert h["versions"][-1] == 7
    # Released: the target commits it with every file; its workers find it there (nothing copied), bitwise.
    assert h["placed"] == [True, True]
    assert after[target]["manifest"] and after[target]["files"] == after[target]["of"]
    for pull in h["pulls"]:
        assert (pull["version"], pull["source"], pull["node_bytes_copied"]) == (7, "memory", 0)
        assert pull["node"] == target and pull["digest"] == h["published"][0][1]


@pytest.mark.parametrize("kind", KINDS)
def test_learners_killed_before_the_placement_landed(outcomes, kind):
    k, v7 = outcomes[kind]["killed"], outcomes[kind]["held"]["published"][0][1]
    assert k["left"] == []  # every held transfer ended (landed, or failed with its owner dead)
    for node, held in k["holdings"].items():  # a store holding the manifest holds every file it vouches for
        assert not held["manifest"] or held["files"] == held["of"], node
    for pull in k["pulls"]:  # version 8 whole, or version 7 and why: never a partial module
        assert pull["source"] == "memory"
        if pull["version"] == 8:
            assert pull["digest"] == k["published"][0][1] and pull["fell_back_from"] is None
        else:
            assert (pull["version"], pull["fell_back_from"], pull["digest"]) == (7, 8, v7)
