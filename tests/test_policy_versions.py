"""Policy versions on one node: the puller's delta and verification (local storage, no Ray), then pins against
retention and the budget, publishing cast to bf16, and the fall back to durable storage (session Ray cluster)."""

from __future__ import annotations

import uuid

import pytest
import torch

from rl_ckpt import CheckpointEngine
from rl_ckpt.errors import CorruptSnapshotError, StateMismatchError
from rl_ckpt._run.snapshot_files import read_manifest
from rl_ckpt._sharded.weight_pull import WeightPuller, component_pieces


def policy(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_puller_moves_only_changed_pieces_and_never_a_bad_one(tmp_path):
    learner, worker = policy(0), policy(1)
    # Tensors from 4 KiB are objects; the biases and the norm share the snapshot's small-tensor file.
    engine = CheckpointEngine(
        base_dir=str(tmp_path), run_name="p", dedup=True, dedup_min_tensor_bytes=4096, keep_best=0
    )
    engine.register("policy", learner)
    puller = WeightPuller(worker)
    stats = puller.pull(engine.storage, read_manifest(engine.storage, engine.save(1).snapshot_id))
    assert same(learner, worker) and stats.bytes_moved == stats.bytes_total and stats.pieces_moved == 3
    with torch.no_grad():
        learner[1].weight.mul_(0.5)  # one layer's weight: one object
    stats = puller.pull(engine.storage, read_manifest(engine.storage, engine.save(2).snapshot_id))
    assert same(learner, worker) and (stats.bytes_moved, stats.pieces_moved) == (64 * 64 * 4, 1)
    with torch.no_grad():
        learner[2].bias.add_(1.0)  # a small tensor: its file moves
    manifest = read_manifest(engine.storage, engine.save(3).snapshot_id)
    stats = puller.pull(engine.storage, manifest)
    assert same(learner, worker) and stats.pieces_moved == 1 and stats.bytes_moved < 64 * 64 * 4
    # Version 4 changes both weights; one of its new objects rots on disk: nothing of version 4 is loaded.
    with torch.no_grad():
        learner[0].weight.add_(1.0)
        learner[1].weight.add_(1.0)
    before = {k: v.clone() for k, v in worker.state_dict().items()}
    manifest4 = read_manifest(engine.storage, engine.save(4).snapshot_id)
    pieces = component_pieces(manifest4, "policy")
    bad = sorted(p for p in pieces.paths() if p.startswith("objects/"))[-1]
    path = tmp_path / "p" / bad
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshotError, match="does not match its content address"):
        puller.pull(engine.storage, manifest4)
    assert all(torch.equal(before[k], v) for k, v in worker.state_dict().items())
    assert puller.snapshot_id == manifest.snapshot_id  # it still holds version 3
    with pytest.raises(StateMismatchError, match="does not fit"):
        WeightPuller(torch.nn.Linear(3, 3)).pull(engine.storage, manifest)
    engine.close()


def test_chunks_next_to_each_other_in_a_tensor_are_put_as_one_buffer():
    """A publish's batch object holds one buffer per run of chunks lying next to each other in one tensor's memory
    (a slice of it, not a copy); anything else is a buffer of its own; each chunk is found again, bytes exact."""
    import numpy as np

    from actors._memory.reads import as_index, item_of
    from actors._versions.storage import contiguous_spans

    a = np.arange(40, dtype=np.uint8)
    b = np.arange(100, 130, dtype=np.uint8)
    whole_a, whole_b = memoryview(a).cast("B"), memoryview(b).cast("B")
    views = [
        whole_a[0:10],
        whole_a[10:20],  # next to the one before: the same buffer
        whole_a[30:40],  # a gap (a chunk reused, not in the batch): a new buffer
        whole_b[0:15],  # another tensor: a new buffer, even if its memory happened to follow
        whole_b[15:30],
        memoryview(b"abcdef"),  # an exporter of its own
        memoryview(bytearray(b"ghij")),
    ]
    spans, where = contiguous_spans(views)
    assert len(spans) == 5 and [w[0] for w in where] == [0, 0, 1, 2, 2, 3, 4]
    for view, at in zip(views, where):
        assert bytes(item_of(spans, at)) == bytes(view)
        assert bytes(item_of(spans, as_index(list(at)))) == bytes(view)  # as a call may return it: a list
    assert np.shares_memory(spans[0], a) and np.shares_memory(spans[2], b)  # slices of the tensors: not copied
    assert spans[0].nbytes == 20 and spans[2].nbytes == 30
    assert item_of([b"x", b"yz"], 1) == b"yz"  # a batch put before spans: one item per file


@pytest.fixture
def versions_run(ray_cluster):
    from actors.policy_versions import versions_storage

    run = f"pv-{uuid.uuid4().hex[:6]}"
    yield run
    versions_storage(run).destroy()


def test_pinned_version_outlives_retention_and_the_budget_holds(versions_run):
    from actors._memory.store import MemoryBudgetError
    from actors.policy_versions import PolicyVersions
    from actors.weight_subscriber import WeightSubscriber

    learner, worker = policy(0), policy(1)
    size = sum(t.numel() * 4 for t in learner.state_dict().values())
    pv = PolicyVersions(versions_run, learner, keep=1, replicas=0, budget_bytes=int(2.6 * size))
    pv.publish(1)
    sub = WeightSubscriber(versions_run)
    manifest = read_manifest(pv.storage, "step_000000001")
    pins = pv.storage.each("pin", "step_000000001", "reader", component_pieces(manifest, "policy").paths(), 60)
    assert any(pins.values())

    def bump():
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(1.0)

    bump()
    pv.publish(2)  # retention keeps 1 version: version 1 is pinned, so it stays, whole
    assert pv.versions() == [1, 2]
    assert sub.pull(worker, 1).version == 1 and same(worker, policy(0))
    bump()
    with pytest.raises(MemoryBudgetError, match="budget"):
        pv.publish(3)  # 3 versions do not fit and the pinned one is not evicted: refused, nothing lost
    assert pv.versions() == [1, 2] and sub.pull(worker, 1).bytes_moved == 0
    pv.storage.each("unpin", "step_000000001", "reader")
    pv.publish(3)  # version 1 retired now, its objects swept; version 3 fits
    assert pv.versions() == [3]
    assert sub.pull(worker).version == 3 and same(worker, learner)
    live = set(component_pieces(read_manifest(pv.storage, "step_000000003"), "policy").paths())
    held = {p for files in pv.storage.inventory("").values() for p in files if p.startswith("objects/")}
    assert held <= live  # the retired versions' objects are gone
    pv.close()


def test_publish_cast_to_bf16(versions_run):
    from actors.policy_versions import PolicyVersions
    from actors.weight_subscriber import WeightSubscriber

    learner = policy(0)
    pv = PolicyVersions(versions_run, learner, replicas=0, dtype=torch.bfloat16)
    pv.publish(5)
    manifest = read_manifest(pv.storage, "step_000000005")
    assert manifest.tags["policy_dtype"] == "bfloat16"
    assert {m["dtype"] for m in manifest.components["policy"]["tensors"].values()} == {"BF16"}
    worker = policy(1).to(torch.bfloat16)
    got = WeightSubscriber(versions_run).pull(worker)
    assert got.bytes_total == sum(t.numel() * 2 for t in learner.state_dict().values())
    assert same(worker, policy(0).to(torch.bfloat16))
    assert all(t.dtype == torch.float32 for t in learner.state_dict().values())  # the learner keeps fp32
    with pytest.raises(StateMismatchError, match="BF16"):
        WeightSubscriber(versions_run).pull(policy(1))  # an fp32 module does not take a bf16 version
    pv.close()


def test_no_good_version_in_memory_falls_back_to_durable(versions_run, tmp_path):
    import ray

    from actors._memory.reads import picked
    from actors.policy_versions import PolicyVersions
    from actors.weight_subscriber import WeightSubscriber

    learner = policy(0)
    durable = CheckpointEngine(base_dir=str(tmp_path), run_name="d", keep_best=0)
    durable.register("policy", learner)
    durable.save(1)
    expected = {k: v.clone() for k, v in learner.state_dict().items()}
    with torch.no_grad():
        learner[0].weight.add_(1.0)
    pv = PolicyVersions(versions_run, learner, replicas=0)
    pv.publish(2)
    bad = next(
        p
        for p in component_pieces(read_manifest(pv.storage, "step_000000002"), "policy").paths()
        if p.startswith("objects/")
    )
    for handle in pv.storage.stores().values():
        got = ray.get(handle.get.remote(bad))
        data = bytearray(picked(got, ray.get(got[0])) if isinstance(got, list) else got)
        data[0] ^= 0xFF
        ray.get(handle.put.remote(bad, bytes(data)))
    worker = policy(1)
    sub = WeightSubscriber(versions_run, durable={"base_dir": str(tmp_path), "run_name": "d"})
    got = sub.pull(worker)
    assert (got.source, got.version, got.fell_back_from) == ("durable", 1, 2) and bad in got.reason
    assert all(torch.equal(expected[k], v) for k, v in worker.state_dict().items())
    assert sub.status()["status"] == "degraded" and pv.status()["faults"][0]["path"] == bad
    from actors._versions.health import lookup

    section = lookup(versions_run)  # what the manager's /healthz shows as "policy_versions"
    assert section["status"] == "degraded" and section["faults"][0]["snapshot_id"] == "step_000000002"
    pv.close()
    durable.close()


def test_publish_writes_a_batch_at_once_and_verifies_what_the_store_holds(versions_run):
    from actors.policy_versions import PolicyVersions, versions_storage
    from actors.weight_subscriber import WeightSubscriber
    from rl_ckpt._format.checksum import new_hasher

    storage = versions_storage(versions_run, replicas=0)
    big, small = bytes(range(256)) * 2048, b"small file"  # 512 KiB: an object of the store; 10 bytes: inline
    storage.write_many_atomic([("objects/x/a", big), ("objects/x/b", small)])
    for path, data in (("objects/x/a", big), ("objects/x/b", small)):
        hasher, want = new_hasher("xxh3_128"), new_hasher("xxh3_128")
        want.update(data)
        got = storage.read(path, on_chunk=hasher.update)  # the read-back that verifies the write
        assert bytes(got) == data and hasher.hexdigest() == want.hexdigest()
        assert memoryview(got).readonly  # the store's own bytes, mapped, hashed in place: not copied
        again = storage.read(path)  # any other read: a fresh writable copy, as from any storage
        assert bytes(again) == data and not memoryview(again).readonly
    assert storage.written == {}

    learner, worker = policy(0), policy(1)
    pv = PolicyVersions(versions_run, learner, keep=1, replicas=0)
    pv.publish(1)
    sub = WeightSubscriber(versions_run)
    assert sub.pull(worker).version == 1 and same(worker, learner)
    node = sub.storage.node_id
    assert pv.storage.subscriber_nodes() == [node]  # the worker told the stores where it pulls
    with torch.no_grad():
        for p in learner.parameters():
            p.mul_(0.5)
    pv.publish(2)  # the worker's node is the learner's: nothing to place, nothing in flight after
    # Version 1 is retired on a thread while the learner goes on; what looks at the versions waits for it.
    assert pv.retiring is not None
    assert pv.versions() == [2] and pv.retiring is None
    assert (pv.storage.pushed_bytes, pv.storage.pushing, pv.storage.removing, pv.storage.written) == (0, [], [], {})
    assert pv.storage.listing is None
    listings = sub.storage.calls["store_listings"]
    got = sub.pull(worker)
    assert (got.version, got.node_bytes_copied) == (2, 0) and same(worker, learner)
    # The stores are listed once per pull (the versions published, then the read: its manifest, pins, placement
    # and unpin), not once per step.
    assert sub.storage.calls["store_listings"] - listings == 1 and sub.storage.listing is None
    live = set(component_pieces(read_manifest(pv.storage, "step_000000002"), "policy").paths())
    held = {p for files in pv.storage.inventory("objects/xxh3_128").values() for p in files}
    assert held <= live  # version 1 retired and its objects swept (in the background, all at once)
    pv.close()


def test_a_sweep_removes_its_objects_with_one_call_per_store_and_keeps_what_a_reader_pins(versions_run):
    from actors.policy_versions import versions_storage

    storage = versions_storage(versions_run, replicas=0)
    paths = [f"objects/x/{i:03d}" for i in range(40)]
    storage.write_many_atomic([(p, bytes([i]) * 1000) for i, p in enumerate(paths)])
    storage.each("pin", "step_000000001", "a-reader", paths[:3], 60.0)
    storage.hold_listing(True)  # as the retention after a publish: objects swept go at the end, all at once
    for p in paths:
        storage.remove(p)
    assert storage.removing == paths and all(storage.stat_many(paths))  # collected, nothing removed yet
    calls = storage.calls["store_calls"]
    storage.hold_listing(False)
    assert storage.calls["store_calls"] - calls == len(storage.stores())  # one call per store, not one per object
    assert storage.removing == [] and storage.listing is None
    left = storage.stat_many(paths)
    assert [e is not None for e in left] == [True] * 3 + [False] * 37  # the pinned ones stay until let go
    storage.each("unpin", "step_000000001", "a-reader")
    storage.hold_listing(True)
    storage.remove(paths[0])
    storage.remove("objects/x/never-written")  # missing is fine
    storage.hold_listing(False)
    assert [e is not None for e in storage.stat_many(paths[:3])] == [False, True, True]
    storage.destroy()


def wide_policy(seed: int = 0) -> torch.nn.Module:
    """Two 1 MiB weights (each a chunk the stores borrow) and small tensors (sent inside the calls)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512), torch.nn.LayerNorm(512))


def test_the_publishers_store_vouches_for_what_it_read_back_and_readers_there_hash_only_the_rest(
    versions_run, monkeypatch
):
    """The publisher reads each borrowed chunk back (the very object it put, hashed in place) and tells its node's
    store with the commit: readers on that node do not hash those bytes again; what nobody hashed as that very
    object (files sent inside the calls, the store's own copies made later) every reader still hashes."""
    import rl_ckpt._run.dedup as dedup
    import rl_ckpt._sharded.weight_pull as weight_pull
    from actors.policy_versions import PolicyVersions
    from actors.weight_subscriber import WeightSubscriber

    learner = wide_policy(0)
    pv = PolicyVersions(versions_run, learner, keep=2, replicas=0)
    pv.publish(1)
    assert pv.wait_owned(120)
    pv.storage.each("hold_owning", True)  # version 2's chunks stay borrowed (and vouched for) until released
    read_back: list[str] = []
    check_object = dedup.check_object
    monkeypatch.setattr(dedup, "check_object", lambda s, algo, d, n: read_back.append(d) or check_object(s, algo, d, n))
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(1.0)
    pv.publish(2)
    manifest = read_manifest(pv.storage, "step_000000002")
    chunks = {p: pv.storage.stat(p).size for p in component_pieces(manifest, "policy").paths()}
    objects = {p for p in chunks if p.startswith("objects/")}
    big = {p for p in objects if chunks[p] >= 1 << 20}
    assert len(big) == 2 and {p.rsplit("/", 1)[1] for p in big} <= set(read_back)  # verify-after-write, as before

    hashed = []
    new_hasher = weight_pull.new_hasher

    def counting(algo):
        hasher = new_hasher(algo)

        class Counted:
            def update(self, data):
                hashed.append(memoryview(data).nbytes)
                hasher.update(data)

            def hexdigest(self):
                return hasher.hexdigest()

        return Counted()

    monkeypatch.setattr(weight_pull, "new_hasher", counting)
    worker = wide_policy(1)
    got = WeightSubscriber(versions_run).pull(worker)
    assert got.version == 2 and same(worker, learner)
    small = sum(chunks[p] for p in objects - big)
    assert small and sum(hashed) == small  # the borrowed chunks: checked once, by the publisher, not this reader
    assert got.bytes_vouched == sum(chunks[p] for p in big)

    pv.storage.each("hold_owning", False)
    assert pv.wait_owned(120)  # the stores' own copies replace the borrowed objects: nobody hashed those
    hashed.clear()
    other = wide_policy(2)
    again = WeightSubscriber(versions_run).pull(other)
    assert again.version == 2 and same(other, learner) and again.bytes_vouched == 0
    assert sum(hashed) == small + sum(chunks[p] for p in big)
    pv.close()


def test_a_store_vouches_only_for_the_very_object_read_back_whole(versions_run):
    import ray

    from actors.policy_versions import versions_storage
    from rl_ckpt._format.checksum import digest_bytes
    from rl_ckpt._run.dedup import check_written, object_path

    storage = versions_storage(versions_run, replicas=0)
    store = storage.store_of(storage.node_id)
    good, other_bytes = bytes(range(256)) * 4096, bytes(range(255, -1, -1)) * 4096  # 1 MiB each: borrowed
    bad_digest = digest_bytes("xxh3_128", other_bytes)
    storage.write_many_atomic([(object_path("xxh3_128", bad_digest), b"\x01" * len(good))])  # not what it names
    with pytest.raises(CorruptSnapshotError, match="does not match its name"):
        check_written(storage, "xxh3_128", bad_digest, len(good))
    assert storage.vouching == []
    digest = digest_bytes("xxh3_128", good)
    name = object_path("xxh3_128", digest)
    storage.write_many_atomic([(name, good)])
    check_written(storage, "xxh3_128", digest, len(good))
    ((path, wrapped),) = storage.vouching
    assert path == name
    storage.wait_acked()  # (as a commit does first: the store took the batch)
    other = ray.put(good)
    assert ray.get(store.vouch.remote([(name, [other, wrapped[1]])])) == 0  # not the object it holds there
    assert ray.get(store.get_many_vouched.remote([name]))[1] == []
    assert ray.get(store.vouch.remote(storage.vouching)) == 1
    assert ray.get(store.get_many_vouched.remote([name]))[1] == [name]
    ray.get(store.put.remote(name, b"\x02" * len(good)))  # replaced by bytes nobody hashed
    assert ray.get(store.get_many_vouched.remote([name]))[1] == []


def test_a_store_placing_a_chunk_checks_it_once_for_its_node_and_refuses_one_that_does_not_match(versions_run):
    """A placement target (``borrow_many(..., place=True)``: the chunk moved to its node) hashes each chunk as it
    lands, against its content address: readers of that node then map it without hashing it again; a chunk that
    does not match its name is not held there (nobody waits for it), and the error names it."""
    import numpy as np
    import ray

    from actors.policy_versions import versions_storage
    from rl_ckpt._format.checksum import digest_bytes
    from rl_ckpt._run.dedup import object_path

    storage = versions_storage(versions_run, replicas=0)
    store = storage.store_of(storage.node_id)
    good, other = bytes(range(256)) * 4096, bytes(range(255, -1, -1)) * 4096  # 1 MiB each
    name = object_path("xxh3_128", digest_bytes("xxh3_128", good))
    wrong = object_path("xxh3_128", digest_bytes("xxh3_128", other))  # names other bytes than those sent
    batch = ray.put([np.frombuffer(good, dtype=np.uint8), np.frombuffer(good, dtype=np.uint8)])
    assert ray.get(store.expect.remote([name, wrong])) == 2
    assert ray.get(store.borrow_many.remote([(name, batch, len(good), 0)], (), True)) == len(good)
    assert ray.get(store.get_many_vouched.remote([name]))[1] == [name]  # checked here: its readers map it as is
    with pytest.raises(CorruptSnapshotError, match="does not match its content address") as caught:
        ray.get(store.borrow_many.remote([(wrong, batch, len(good), 1)], (), True))
    assert wrong in str(caught.value)
    assert ray.get(store.get.remote(wrong)) is None  # not held
    assert ray.get(store.wait_landed.remote([wrong], 0)) == []  # nor awaited any more: its readers place it
    names = "objects/xxh3_128/not-a-digest"  # a path that is no content address: held, left to its readers
    assert ray.get(store.borrow_many.remote([(names, batch, len(good), 0)], (), True)) == len(good)
    assert ray.get(store.get_many_vouched.remote([names]))[1] == []
    storage.destroy()


def test_a_tensor_of_several_chunks_is_put_as_one_buffer_and_read_exactly(versions_run, monkeypatch):
    """A 20 MiB weight is 3 chunks (8 + 8 + 4 MiB), put as one buffer of the batch object (a span): the read-back
    verifies each chunk in it and the publisher's store vouches for them; a reader gets the weights bitwise; a
    delta that changes the middle chunk alone puts that chunk alone; the stores' own copies, made from the spans,
    read the same."""
    import actors._versions.storage as versions_storage_module
    from actors.policy_versions import PolicyVersions
    from actors.weight_subscriber import WeightSubscriber

    puts: list[tuple[list, list]] = []  # (the batch's chunk sizes, its buffers' sizes) of each publish's batch
    spans_of = versions_storage_module.contiguous_spans

    def recording(views):
        spans, where = spans_of(views)
        puts.append(([v.nbytes for v in views], [s.nbytes for s in spans]))
        return spans, where

    monkeypatch.setattr(versions_storage_module, "contiguous_spans", recording)
    mib = 1 << 20

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        module = torch.nn.Module()
        module.register_parameter("w", torch.nn.Parameter(torch.randn(5 * mib), requires_grad=False))  # 20 MiB
        module.register_parameter("v", torch.nn.Parameter(torch.randn(mib // 4), requires_grad=False))  # 1 MiB
        return module

    learner = model(0)
    pv = PolicyVersions(versions_run, learner, keep=2, replicas=0)
    pv.publish(1)
    assert [(sorted(chunks), sorted(spans)) for chunks, spans in puts] == [
        ([mib, 4 * mib, 8 * mib, 8 * mib], [mib, 20 * mib])
    ]
    worker = model(1)
    sub = WeightSubscriber(versions_run)
    got = sub.pull(worker)
    assert got.version == 1 and same(worker, learner)
    assert got.bytes_moved == got.bytes_vouched == 21 * mib  # the publisher read each chunk back in its span

    puts.clear()
    with torch.no_grad():
        learner.w[3 * mib] += 1.0  # byte 12 MiB: the middle chunk
    pv.publish(2)
    assert puts == [([8 * mib], [8 * mib])]
    got = sub.pull(worker)
    assert got.version == 2 and same(worker, learner)
    assert got.bytes_moved == got.bytes_vouched == 8 * mib

    assert pv.wait_owned(120)  # the stores copy each chunk out of its span into an object of their own
    fresh = model(2)
    again = WeightSubscriber(versions_run).pull(fresh)
    assert again.version == 2 and same(fresh, learner) and again.bytes_vouched == 0  # hashed by this reader
    pv.close()
