"""Policy versions published without the stores' copies on the critical path (session Ray cluster).

At publish the version stores *borrow* the publisher's chunk objects (no copy) and own copies of their own in the
background (``MemoryStore.borrow``, ``PolicyVersions.wait_owned``). Tested with a publisher actor that is killed:
after ``wait_owned`` (``ray.kill`` and a real SIGKILL) a new subscriber pulls the version bitwise; inside the
ownership window (the stores' owning thread held by ``hold_owning``, an event) a pull of the version gets it
bitwise or falls back to the previous one, logged and in the health section, never a partial module. The stores'
counters show no copy at publish, every byte owned after ``wait_owned``, and the budget held throughout.
"""

from __future__ import annotations

import hashlib
import os
import signal
import uuid

import pytest
import torch

from rl_ckpt.errors import VersionNotFoundError

pytestmark = pytest.mark.ray
WIDTH = 512  # a Linear(WIDTH, WIDTH) weight: 1 MiB, above the 256 KiB under which files travel inside calls
WEIGHT_BYTES = WIDTH * WIDTH * 4


def make_policy(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(module.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Publisher:
    """A learner that publishes policy versions (an actor of its own, so it can be killed)."""

    def __init__(self, run: str, budget_bytes: int | None) -> None:
        from actors.policy_versions import PolicyVersions

        torch.set_num_threads(1)
        self.model = make_policy()
        self.versions = PolicyVersions(run, self.model, keep=4, replicas=0, budget_bytes=budget_bytes)

    def publish(self, step: int, layers: tuple = (0, 1)) -> str:
        """Change the weights of ``layers`` and publish version ``step``; returns the digest of the weights."""
        with torch.no_grad():
            for i in layers:
                self.model[i].weight.mul_(0.5).add_(0.01 * step)
        self.versions.publish(step)
        return digest(self.model)

    def wait_owned(self) -> bool:
        return self.versions.wait_owned(timeout=120)

    def pid(self) -> int:
        return os.getpid()


def hang() -> None:
    import threading

    threading.Event().wait()  # never set: the object this task returns is never made


class Ghost:
    """Owns an object that will never exist (a task's result that never comes): once this actor is killed, a
    ``ray.get`` of it raises ``OwnerDiedError`` at once, wherever it is asked, what a chunk whose publisher died
    before the stores owned it gives once Ray has freed it (after ``kill`` Ray takes a moment to free a dead
    owner's objects; this one is lost deterministically)."""

    def pending(self) -> list:
        import ray

        return [ray.remote(num_cpus=0, max_retries=0)(hang).remote()]

    def pid(self) -> int:
        return os.getpid()


@pytest.fixture
def run(ray_cluster):
    from actors.policy_versions import versions_storage

    name = f"pvb-{uuid.uuid4().hex[:6]}"
    yield name
    storage = versions_storage(name)
    storage.each("hold_owning", False)
    storage.destroy()


def publisher(ray, run: str, budget_bytes: int | None = None):
    return ray.remote(num_cpus=0, max_restarts=0)(Publisher).remote(run, budget_bytes)


def kill(ray, actor, how: str) -> None:
    """Kill the publisher and wait until Ray knows it is dead (a call to it fails)."""
    if how == "sigkill":
        os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)
    else:
        ray.kill(actor, no_restart=True)
    while True:  # the kill lands asynchronously: calls made before it may still be answered
        try:
            ray.get(actor.pid.remote())
        except ray.exceptions.RayActorError:
            return


def counters(storage) -> dict:
    """Summed over the stores: bytes held, borrowed, copied into owned objects, owned from borrowed, lost files."""
    info = storage.store_info().values()
    keys = ("bytes_held", "borrowed_bytes", "copied_bytes", "owned_bytes")
    out = {k: sum(i[k] for i in info) for k in keys}
    out["lost"] = sorted(p for i in info for p in i["lost"])
    out["lost_versions"] = sorted(p for i in info for p in i["lost_versions"])
    out["over_budget"] = [i["node_id"] for i in info if i["budget_bytes"] and i["bytes_held"] > i["budget_bytes"]]
    return out


@pytest.mark.parametrize("how", ["ray_kill", "sigkill"])
def test_owned_versions_outlive_the_publisher(run, how):
    import ray

    from actors.policy_versions import versions_status, versions_storage
    from actors.weight_subscriber import WeightSubscriber

    pub = publisher(ray, run)
    digests = {1: ray.get(pub.publish.remote(1))}
    assert ray.get(pub.wait_owned.remote())
    storage = versions_storage(run)
    owned = counters(storage)
    assert owned["borrowed_bytes"] == 0 and owned["owned_bytes"] >= 2 * WEIGHT_BYTES
    # A delta: only layer 1's weight changed. The objects already owned stay owned; only the new one is borrowed.
    storage.each("hold_owning", True)
    digests[2] = ray.get(pub.publish.remote(2, (1,)))
    delta = counters(storage)
    assert delta["borrowed_bytes"] == WEIGHT_BYTES
    assert delta["copied_bytes"] == owned["copied_bytes"]  # the publish made no copy in the stores
    storage.each("hold_owning", False)
    assert ray.get(pub.wait_owned.remote())
    after = counters(storage)
    assert after["borrowed_bytes"] == 0 and after["copied_bytes"] == owned["copied_bytes"] + WEIGHT_BYTES
    assert versions_status(storage)["borrowed_bytes"] == {n: 0 for n in storage.stores()}
    kill(ray, pub, how)
    for version in (2, 1):
        module = make_policy(seed=7)
        got = WeightSubscriber(run).pull(module, version)
        assert (got.version, got.source, got.fell_back_from) == (version, "memory", None)
        assert digest(module) == digests[version]  # bitwise, from the stores' own copies
    assert versions_status(storage)["status"] == "ok"


def test_publisher_killed_inside_the_ownership_window(run):
    import ray

    from actors._versions.health import lookup
    from actors.policy_versions import versions_status, versions_storage
    from actors.weight_subscriber import WeightSubscriber
    from rl_ckpt._run.snapshot_files import read_manifest
    from rl_ckpt._sharded.weight_pull import component_pieces

    budget = 5 * 2 * WEIGHT_BYTES
    pub = publisher(ray, run, budget)
    digests = {1: ray.get(pub.publish.remote(1))}
    assert ray.get(pub.wait_owned.remote())
    storage = versions_storage(run)
    before = counters(storage)
    storage.each("hold_owning", True)  # the ownership window stays open until released
    digests[2] = ray.get(pub.publish.remote(2))
    held = counters(storage)
    assert held["borrowed_bytes"] == 2 * WEIGHT_BYTES and held["copied_bytes"] == before["copied_bytes"]
    assert held["over_budget"] == [] and held["bytes_held"] >= before["bytes_held"] + 2 * WEIGHT_BYTES
    assert versions_status(storage)["borrowed_bytes"][storage.node_id] == 2 * WEIGHT_BYTES
    kill(ray, pub, "sigkill")  # with version 2's new chunks still borrowed from it
    # Ray frees a dead owner's objects a moment later (until then they read): one of those chunks is made lost
    # now, deterministically, by a ref of the same size whose owner is dead and whose object does not exist.
    manifest = read_manifest(storage, "step_000000002")
    old = set(component_pieces(read_manifest(storage, "step_000000001"), "policy").paths())
    new = sorted(p for p in component_pieces(manifest, "policy").paths() if p not in old and p.startswith("objects/"))
    new = [p for p in new if storage.stat(p).size == WEIGHT_BYTES]
    lost = new[0]
    ghost = ray.remote(num_cpus=0, max_restarts=0)(Ghost).remote()
    ghost_ref = ray.get(ghost.pending.remote())
    kill(ray, ghost, "ray_kill")
    for handle in storage.stores().values():
        assert ray.get(handle.borrow.remote(lost, ghost_ref, WEIGHT_BYTES))

    module = make_policy(seed=7)
    sub = WeightSubscriber(run)
    got = sub.pull(module)  # version 2 cannot be read whole: version 1, bitwise, and why
    assert (got.version, got.fell_back_from, got.source) == (1, 2, "memory")
    assert any(p in got.reason for p in new) and "lost" in got.reason  # the first chunk found lost, named
    assert digest(module) == digests[1]
    assert sub.status()["status"] == "degraded" and sub.status()["faults"][-1]["snapshot_id"] == "step_000000002"
    assert lookup(run)["status"] == "degraded"  # the manager's /healthz "policy_versions" section

    storage.each("hold_owning", False)  # the owning thread meets the dead owner: the lost files are dropped
    assert all(storage.each("wait_owned", 120).values())
    after = counters(storage)
    assert after["borrowed_bytes"] == 0 and after["over_budget"] == []
    assert lost in after["lost"]  # dropped: the store no longer answers a ref that cannot be read
    assert not {p for files in storage.inventory("objects").values() for p in files} & set(after["lost"])
    status = versions_status(storage)
    assert status["status"] == "degraded" and sorted(status["lost"][storage.node_id]) == after["lost"]
    # A version whose file is lost is no longer listed: latest is the newest whole one, pulled without a fault.
    assert after["lost_versions"] == ["step_000000002"] and status["lost_versions"] == {
        storage.node_id: ["step_000000002"]
    }
    fresh = WeightSubscriber(run)
    assert fresh.versions() == [1] and fresh.latest() == 1
    again = make_policy(seed=8)
    got = fresh.pull(again)
    assert (got.version, got.fell_back_from, got.source) == (1, None, "memory") and digest(again) == digests[1]
    with pytest.raises(VersionNotFoundError) as info:  # asked by name: unknown now, naming the newest whole one
        fresh.pull(make_policy(seed=9), 2)
    assert info.value.newest == 1 and "2" in str(info.value)


def test_a_hold_placed_while_the_owning_thread_waits_for_quiet_keeps_every_file_borrowed(run):
    """``hold_owning`` right after a publish, while the stores' owning thread is waiting for the store to be quiet
    before taking that publish's files: once held, the thread takes nothing, neither those files nor the next
    publish's (it once took both when its wait ended, and a file it owns is no longer vouched for)."""
    import ray

    from actors._memory.borrow import OWN_DEFER_SECONDS
    from actors.policy_versions import versions_storage

    pub = publisher(ray, run)
    ray.get(pub.publish.remote(1))  # both weights borrowed; the owning thread waits for quiet before it takes them
    storage = versions_storage(run)
    storage.each("hold_owning", True)
    ray.get(pub.publish.remote(2, (1,)))  # one more weight borrowed while held
    # Longer than the thread ever waits for quiet: had it gone on, nothing would be borrowed by then.
    assert not any(storage.each("wait_owned", OWN_DEFER_SECONDS + 1.0).values())
    assert counters(storage)["borrowed_bytes"] == 3 * WEIGHT_BYTES
    storage.each("hold_owning", False)
    assert ray.get(pub.wait_owned.remote())
    assert counters(storage)["borrowed_bytes"] == 0
    kill(ray, pub, "ray_kill")
