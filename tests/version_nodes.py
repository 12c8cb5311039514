"""Policy versions on a Ray cluster of two nodes on this machine (``ray.cluster_utils.Cluster``).

Run by test_policy_versions_nodes.py in a process of its own: ``python version_nodes.py`` prints one JSON line per
scenario ("replicated": 2 plain learners; "fsdp2": 2 FSDP2 learners on a gloo group). Per scenario the learners
publish 5 versions (1 and 3 change every layer, 2, 4 and 5 only one layer's weight); 4 rollout workers, 2 on each
node, pull each (version 3 once its placement landed, while the stores still borrow it); then a worker on the
worker node is killed and a new one pulls the newest; then every copy of a chunk only version 6 has is corrupted
and workers pull again; then version 7 is published with its placement on the workers' node held (a store's test
hook) and released, and version 8 the same way with the learners SIGKILLed before it is released. The 4 rollout
workers serve both scenarios.
"""

from __future__ import annotations

import socket
import sys
import time
import uuid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scenario(ray, kind: str, namespace: str, workers: list, on: dict) -> dict:
    from actors._memory.reads import picked
    from actors.policy_versions import versions_status, versions_storage
    from rl_ckpt._run.snapshot_files import read_manifest
    from rl_ckpt._sharded.weight_pull import component_pieces
    from version_workers import Learner

    started = time.monotonic()
    run = f"{kind}-{uuid.uuid4().hex[:6]}"
    learner = ray.remote(num_cpus=0, max_restarts=0)(Learner).options(resources={"head": 1})
    master = f"127.0.0.1:{free_port()}" if kind == "fsdp2" else None
    learners = [learner.remote(run, r, 2, namespace, master) for r in range(2)]
    storage = versions_storage(run, namespace=namespace, replicas=0)
    out: dict = {"kind": kind, "versions": []}
    for version in range(1, 6):
        if version == 3:  # every layer new: the stores keep borrowing it (and vouching for it) until its pulls end
            storage.each("hold_owning", True)
        published = ray.get([lr.publish.remote(version) for lr in learners])
        if version == 3:
            assert all(ray.get([lr.wait_placed.remote() for lr in learners]))
        pulls = ray.get([w.pull.remote(run) for w in workers])
        if version == 3:
            storage.each("hold_owning", False)
        fetched = {n: i["fetched_bytes"] for n, i in storage.store_info().items()}  # pulled into each store
        for placed in ray.get([lr.placed.remote() for lr in learners]):  # and placed there by the publishes
            for n, nbytes in placed.items():
                fetched[n] = fetched.get(n, 0) + nbytes
        out["versions"].append({"version": version, "published": published, "pulls": pulls, "fetched": fetched})
    out["worker_nodes"] = sorted({p["node"] for p in out["versions"][0]["pulls"]})
    out["status_before_faults"] = versions_status(storage)
    # A worker killed and a new one started on the worker node: it asks the stores, not the learners.
    ray.kill(workers[3], no_restart=True)
    workers[3] = on["worker"].remote(namespace)
    out["restarted"] = ray.get(workers[3].pull.remote(run))
    # Asking for a retired or unknown version.
    out["retired"] = ray.get(workers[0].try_pull.remote(run, 1))
    out["unknown"] = ray.get(workers[0].try_pull.remote(run, 77))
    # Version 6 changes one layer; every copy of one of its new chunks is corrupted before the workers pull.
    published = ray.get([lr.publish.remote(6) for lr in learners])
    new = component_pieces(read_manifest(storage, "step_000000006"), "policy")
    old = component_pieces(read_manifest(storage, "step_000000005"), "policy")
    old_paths = set(old.paths())
    bad = next(p for p in new.paths() if p.startswith("objects/") and p not in old_paths)
    corrupted = 0
    for handle in storage.stores().values():
        got = ray.get(handle.get.remote(bad))
        if got is None:
            continue
        data = bytearray(picked(got, ray.get(got[0])) if isinstance(got, list) else got)
        data[len(data) // 2] ^= 0xFF
        ray.get(handle.put.remote(bad, bytes(data)))
        corrupted += 1
    out["corrupted"] = {"path": bad, "copies": corrupted, "published": published}
    # workers[0] holds version 5; the restarted one on the other node held nothing before version 5.
    out["after_corruption"] = ray.get([w.pull.remote(run) for w in (workers[0], workers[3])])
    out["worker_status"] = ray.get(workers[0].status.remote(run))
    out["status"] = versions_status(storage)
    target = out["versions"][0]["pulls"][2]["node"]  # the workers' other node (workers 2 and 3 run there)
    out["held"] = held_placement(ray, run, storage, learners, workers, target)
    out["killed"] = killed_before_placement(ray, run, storage, learners, workers, target)
    for actor in learners:
        ray.kill(actor, no_restart=True)
    storage.destroy()
    out["seconds"] = time.monotonic() - started
    return out


def vouched(storage, sid: str) -> list[str]:
    """The files ``sid``'s manifest vouches for (itself left out)."""
    from rl_ckpt._run.snapshot_files import read_manifest
    from rl_ckpt._sharded.weight_pull import component_pieces

    return [p for p in component_pieces(read_manifest(storage, sid), "policy").paths() if p != f"{sid}/meta.json"]


def holdings(ray, storage, sid: str) -> dict:
    """node -> whether its store holds ``sid``'s manifest, and how many of the files it vouches for it holds."""
    manifest, paths = f"{sid}/meta.json", vouched(storage, sid)
    out = {}
    for node, handle in storage.stores().items():
        files = ray.get(handle.inventory.remote(""))
        out[node] = {"manifest": manifest in files, "files": sum(p in files for p in paths), "of": len(paths)}
    return out


def held_placement(ray, run: str, storage, learners: list, workers: list, target: str, version: int = 7) -> dict:
    """Version ``version`` published with its placement on the workers' other node held (``hold_landing``, an
    event): the publish returns once committed on the learners' node; the target holds some of its files and
    no manifest; released, it commits; its workers then find it placed."""
    from actors.policy_versions import published

    sid = f"step_{version:09d}"
    handle = storage.stores()[target]
    ray.get(handle.hold_landing.remote(True))
    try:
        out = {"target": target, "published": ray.get([lr.publish.remote(version) for lr in learners])}
        out["during"] = holdings(ray, storage, sid)
        out["versions"] = list(published(storage))
    finally:
        ray.get(handle.hold_landing.remote(False))
    out["placed"] = ray.get([lr.wait_placed.remote() for lr in learners])
    out["after"] = holdings(ray, storage, sid)
    out["pulls"] = ray.get([w.pull.remote(run) for w in workers[2:]])
    return out


def killed_before_placement(ray, run: str, storage, learners: list, workers: list, target: str, version: int = 8):
    """Version ``version`` published with its placement held on the workers' other node, then every learner
    SIGKILLed before it lands, then the placement released: every store holding the manifest holds its files,
    and every worker gets the version bitwise or the previous one, never a partial module."""
    import os
    import signal

    handle = storage.stores()[target]
    ray.get(handle.hold_landing.remote(True))
    try:
        published = ray.get([lr.publish.remote(version) for lr in learners])
        pids = ray.get([lr.pid.remote() for lr in learners])
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for lr in learners:  # dead once a call to it fails
            while True:
                try:
                    ray.get(lr.pid.remote())
                except ray.exceptions.RayActorError:
                    break
    finally:
        ray.get(handle.hold_landing.remote(False))
    sid = f"step_{version:09d}"
    left = ray.get(handle.wait_landed.remote(vouched(storage, sid), 60))  # the held transfers: landed or failed
    return {
        "target": target,
        "published": published,
        "left": left,
        "holdings": holdings(ray, storage, sid),
        "pulls": ray.get([w.pull.remote(run) for w in workers]),
    }


def main() -> None:
    from node_cluster import emit, node_cluster

    namespace = "versions-nodes"
    with node_cluster(namespace, head_resources=16, worker_resources=16) as (ray, _cluster):
        from version_workers import Rollout

        rollout = ray.remote(num_cpus=0, max_restarts=0)(Rollout)
        on = {"head": rollout.options(resources={"head": 1}), "worker": rollout.options(resources={"worker": 1})}
        workers = [on[n].remote(namespace) for n in ("head", "head", "worker", "worker")]
        for kind in sys.argv[1:] or ("replicated", "fsdp2"):
            emit(scenario(ray, kind, namespace, workers, on))


if __name__ == "__main__":
    main()
