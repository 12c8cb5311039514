"""The memory tier on a real Ray cluster: per-node store actors, the raymem:// storage, budget eviction,
flush from memory, the tier view and recovery across tiers. Node loss and replication across nodes are in
test_memory_tier_nodes.py (a cluster of two nodes)."""

from __future__ import annotations

import contextlib
import uuid

import numpy as np
import pytest
import torch

from helpers import PPOState, assert_same_state, tensors_of
from rl_ckpt import CheckpointEngine
from rl_ckpt.errors import CommitConflictError, NoValidSnapshotError, StorageError
from rl_ckpt._format.manifest import MANIFEST_NAME
from rl_ckpt._recovery.plan import RecoveryPlan
from rl_ckpt._recovery.tiers import choose_tier
from rl_ckpt._commit.flush import FlushPolicy

pytestmark = pytest.mark.ray


@pytest.fixture
def mem(ray_cluster):
    """A fresh raymem:// storage (one node, no replicas); its stores are killed afterwards."""
    from rl_ckpt._storage import open_storage

    made = []

    def make(name: str | None = None, **options):
        storage = open_storage(f"raymem://mem/{name or 't-' + uuid.uuid4().hex[:8]}", {"replicas": 0, **options})
        made.append(storage)
        return storage

    yield make
    for storage in made:
        storage.destroy()


def _engine(storage, tmp_path, **cfg) -> CheckpointEngine:
    return CheckpointEngine(
        base_dir="raymem://mem",
        run_name=storage.key.split("/", 1)[1],
        storage=storage,
        keep_latest=cfg.pop("keep_latest", 10),
        keep_best=0,
        **cfg,
    )


# -- the store and the storage -----------------------------------------------------------------------------
def test_store_owns_bytes_after_writer_dies(ray_cluster, mem):
    """A writer process killed after its put: the store still serves every byte (it owns a copy)."""
    storage = mem()
    payload = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8)

    @ray_cluster.remote(num_cpus=0)
    class Writer:
        def write(self, url, options, data):
            from rl_ckpt._storage import open_storage

            return open_storage(url, options).write("step_000000001/x.bin", [data])

    writer = Writer.remote()
    assert ray_cluster.get(writer.write.remote(storage.url, {"replicas": 0}, payload)) == payload.nbytes
    ray_cluster.kill(writer, no_restart=True)
    got = storage.read("step_000000001/x.bin")
    assert bytes(got) == payload.tobytes()
    assert storage.read_range("step_000000001/x.bin", 5, 7) == payload[5:12].tobytes()
    assert [e.name for e in storage.list("")] == ["step_000000001"]
    assert storage.size("step_000000001/x.bin") == payload.nbytes


def test_create_only_and_missing_and_refusals(mem):
    storage = mem()
    storage.write("step_000000001/meta.json", [b"{}"], create_only=True)
    with pytest.raises(CommitConflictError):
        storage.write("step_000000001/meta.json", [b"{}"], create_only=True)
    with pytest.raises(StorageError, match="no live memory store holds it"):
        storage.read("step_000000002/meta.json")
    with pytest.raises(StorageError):
        storage.read_range("step_000000001/meta.json", 1, 5)
    from rl_ckpt.errors import FileTooLargeError, UnsafePathError

    storage.write("step_000000001/big.bin", [b"x" * 1000])
    with pytest.raises(FileTooLargeError):
        storage.read("step_000000001/big.bin", max_bytes=999)
    with pytest.raises(UnsafePathError):
        storage.write("../escape", [b"x"])
    storage.remove_tree("step_000000001")
    assert storage.list("") == [] and not storage.exists("step_000000001")


def test_bad_options_are_refused():
    from actors._memory.storage import RayMemoryStorage
    from rl_ckpt.errors import ConfigError

    with pytest.raises(ConfigError, match="replicas"):
        RayMemoryStorage("raymem://mem/r", {"replicas": -1})
    with pytest.raises(ConfigError, match="unknown"):
        RayMemoryStorage("raymem://mem/r", {"replica": 1})
    with pytest.raises(ConfigError, match="plain name"):
        RayMemoryStorage("raymem://../r", {})


# -- snapshots through the engine ---------------------------------------------------------------------------
def test_engine_roundtrip_bitwise_and_corruption_is_caught(mem, tmp_path):
    storage = mem()
    a = PPOState(seed=3)
    a.train(4)
    with a.register(_engine(storage, tmp_path)) as engine:
        engine.save(4).snapshot_id
        a.train(3)
        engine.save_async(7).wait()
    b = PPOState(seed=99)
    with b.register(_engine(storage, tmp_path)) as engine:
        result = engine.restore()
    assert result.snapshot_id == "step_000000007"
    assert_same_state(a, b)

    # A flipped byte in the store: loading refuses it and falls back to the older snapshot.
    manifest_files = [e for e in storage.list("step_000000007") if e.is_dir]
    attempt = manifest_files[0].name
    victim = next(e.name for e in storage.list(f"step_000000007/{attempt}") if e.name.endswith(".safetensors"))
    path = f"step_000000007/{attempt}/{victim}"
    data = bytearray(storage.read(path))
    data[-1] ^= 0xFF
    store = next(iter(storage.stores().values()))
    ray = pytest.importorskip("ray")
    ray.get(store.put.remote(path, bytes(data)))
    c = PPOState(seed=5)
    with c.register(_engine(storage, tmp_path)) as engine:
        result = engine.restore()
        assert result.snapshot_id == "step_000000004"
        assert "step_000000007" in result.skipped
        assert not engine.verify("step_000000007").ok


def test_a_managers_plan_rehashes_only_the_memory_files_replaced_since_their_commit(ray_cluster, mem, tmp_path):
    """The memory tier's manager notes the versions of a snapshot's files once it committed (a store's objects are
    immutable: a replaced file is a new object, a new version); its deep plan re-hashes only files whose version
    changed since, and a manager that noted nothing (restarted) re-hashes every candidate file, as before."""
    import rl_ckpt._recovery.plan as plan_module
    from actors.manager import CheckpointManager

    storage = mem()
    a = PPOState(seed=3)
    with a.register(_engine(storage, tmp_path)) as engine:
        engine.save(4)
        a.train(3)
        engine.save(7)
    hashed: list[str] = []
    real = plan_module.hash_files

    def spy(storage_, paths, algo, sizes=None):
        hashed.extend(paths)
        return real(storage_, paths, algo, sizes)

    config = {"base_dir": "raymem://mem", "run_name": storage.key.split("/", 1)[1], "keep_best": 0}
    config["storage_options"] = {"replicas": 0}
    mgr = CheckpointManager(config, healthz_port=None)
    noted = CheckpointManager(config, healthz_port=None)
    try:
        for info in noted.catalog.snapshots():  # what its commits would have noted
            noted.recovery.committed(info).result()
        assert set(noted.recovery.verified) == {"step_000000004", "step_000000007"}
        plan_module.hash_files = spy
        assert noted.plan()["target"] == "step_000000007" and hashed == []  # nothing re-hashed
        assert mgr.plan()["target"] == "step_000000007"  # noted nothing: the target's files re-hashed
        assert hashed and all(p.startswith("step_000000007/") for p in hashed)
        files_7 = len(hashed)

        # One file of step 7 replaced by a same-size corrupt copy: a new object, a new version.
        attempt = next(e.name for e in storage.list("step_000000007") if e.is_dir)
        victim = next(e.name for e in storage.list(f"step_000000007/{attempt}") if e.name.endswith(".safetensors"))
        path = f"step_000000007/{attempt}/{victim}"
        data = bytearray(storage.read(path))
        data[-1] ^= 0xFF
        ray_cluster.get(next(iter(storage.stores().values())).put.remote(path, bytes(data)))
        hashed.clear()
        noted.recovery.plan_cache = None
        plan = noted.plan()
        assert plan["target"] == "step_000000004", plan  # passed over before anyone loads
        assert hashed == [path]  # only the replaced file re-hashed; step 4's files were noted
        assert files_7 > 1
    finally:
        plan_module.hash_files = real
        for m in (mgr, noted):
            m._monitor.stop()


def _calls_of(storage, fn) -> dict:
    before = dict(storage.calls)
    fn()
    return {k: storage.calls[k] - before[k] for k in before}


def test_local_files_hashed_in_one_call_and_dedup_reuse_checks_each_tensor_at_once(mem, tmp_path):
    """``hash_files`` on the memory tier: the files this node's store holds are mapped in one call (``views_many``)
    and hashed where they lie. A dedup save reusing a committed snapshot's chunks checks each tensor's chunks with
    one such call (not a stat, a size and a read per chunk), reuses the good ones and writes again one that rotted
    in place."""
    import torch

    from rl_ckpt._format.checksum import new_hasher
    from rl_ckpt._format.hashed_io import hash_files
    from rl_ckpt._run.dedup import CHUNK_BYTES, object_path

    ray = pytest.importorskip("ray")
    storage = mem()
    data = [bytes([i]) * 300_000 for i in range(5)]
    for i, d in enumerate(data):
        storage.write(f"objects/x/{i}", [d])
    paths = [f"objects/x/{i}" for i in range(5)] + ["objects/x/none"]
    calls = _calls_of(storage, lambda: hash_files(storage, paths[:-1], "xxh3_128"))
    assert calls == {"store_listings": 0, "store_calls": 1}  # (one none holds is asked of every store)
    got = hash_files(storage, paths, "xxh3_128")
    assert got[-1] is None and [g[0] for g in got[:-1]] == [300_000] * 5

    class Policy:
        def __init__(self):
            self.w = torch.arange(3 * CHUNK_BYTES // 4, dtype=torch.float32)  # three whole chunks

        def state_dict(self):
            return {"w": self.w}

        def load_state_dict(self, state):
            self.w.copy_(state["w"])

    policy = Policy()
    engine = _engine(storage, tmp_path, dedup=True)
    engine.register("policy", policy)
    engine.save(1)
    chunks = engine.catalog.get("step_000000001").manifest.components["policy"]["objects"]["w"]
    objects = [object_path("xxh3_128", digest) for digest, _size in chunks]
    # Rot the second chunk in place (same size, other bytes), as a bit flip in the store would.
    store = next(iter(storage.stores().values()))
    ray.get(store.put.remote(objects[1], bytes(chunks[1][1])))
    before = storage.stat_many(objects)
    with torch.no_grad():
        policy.w[0] += 1  # the first chunk changes; the second (rotten) and the third do not
    engine.save(2)
    after = storage.stat_many(objects)
    assert after[2].version == before[2].version  # reused as it was: not written again
    assert after[1].version != before[1].version  # the rotten one was written again...
    hasher = new_hasher("xxh3_128")
    hasher.update(storage.read(objects[1]))
    assert hasher.hexdigest() == chunks[1][0]  # ...with the right bytes
    restored = Policy()
    restored.w.zero_()
    fresh = _engine(storage, tmp_path, dedup=True)
    fresh.register("policy", restored)
    assert fresh.restore().snapshot_id == "step_000000002"
    assert torch.equal(restored.w, policy.w)


def test_restore_lists_stores_per_folder_listing_not_per_file(mem, tmp_path):
    """Outside a read session, stat, exists and reads ask the stores already known first (the cluster's stores are
    listed again only for a file none of them holds): a restore lists the stores once per folder it lists, never
    per file, and reads each file with one call to one store. A ranged read of several ranges is one call too."""
    from rl_ckpt._storage import open_storage

    storage = mem()
    modules = {f"m{i}": torch.nn.Linear(4, 4) for i in range(5)}  # 10 files: a .safetensors and a .json each
    writer = _engine(storage, tmp_path)
    for name, module in modules.items():
        writer.register(name, module)
    writer.save(1)
    writer.close()
    reader = _engine(open_storage(storage.url, {"replicas": 0}), tmp_path, post_load_check=False)
    for name in modules:
        reader.register(name, torch.nn.Linear(4, 4))
    lists = []
    listing = reader.storage.list
    reader.storage.list = lambda path="": lists.append(path) or listing(path)
    reader.storage.read_session = contextlib.nullcontext  # outside a read session (engine.restore opens one)
    counts = _calls_of(reader.storage, lambda: reader.restore(snapshot_id="step_000000001"))
    assert lists and counts["store_listings"] == len(lists), (counts, lists)
    # One listing per folder listed and one call to the (one) store for it, one per file read (the manifest and the 10
    # files), one for the stats (stat_many: the catalog's manifest stats and the plan's file stats).
    assert counts["store_calls"] == len(lists) + 11 + 2, counts
    sid = reader.snapshots()[-1].snapshot_id
    path = next(f"{sid}/{f.path}" for f in reader.catalog.get(sid).manifest.files if f.path.endswith(".safetensors"))
    whole = bytes(reader.storage.read(path))
    got = []
    counts = _calls_of(reader.storage, lambda: got.append(reader.storage.read_ranges(path, [(0, 8), (8, 4), (20, 3)])))
    assert got[0] == [whole[:8], whole[8:12], whole[20:23]] and counts == {"store_listings": 0, "store_calls": 1}
    assert reader.storage.exists(sid) and reader.storage.exists(path) and not reader.storage.exists(f"{sid}/nope")
    reader.close()


def test_restore_in_a_read_session_is_one_round_trip_per_store(ray_cluster, mem, tmp_path):
    """In a read session a restore lists the cluster's stores once and asks each store once (its view: every path,
    and the newest committed snapshot's files), whatever the number of files; the state is loaded bitwise and
    every file is still checked against the manifest (a file changed in the store fails the restore)."""
    from rl_ckpt._storage import open_storage

    storage = mem()
    modules = {f"m{i}": torch.nn.Linear(64, 64) for i in range(3)}
    modules["big"] = torch.nn.Linear(512, 256)  # 512 KiB of weights: held in the object store, mapped
    writer = _engine(storage, tmp_path)
    for name, module in modules.items():
        writer.register(name, module)
    writer.save(1)
    writer.close()
    reader = _engine(open_storage(storage.url, {"replicas": 0}), tmp_path, post_load_check=False)
    loaded = {name: torch.nn.Linear(m.in_features, m.out_features) for name, m in modules.items()}
    for name, module in loaded.items():
        reader.register(name, module)

    def restore():
        with reader.storage.read_session():
            assert reader.restore(snapshot_id="step_000000001").snapshot_id == "step_000000001"

    assert _calls_of(reader.storage, restore) == {"store_listings": 1, "store_calls": 1}
    for name, module in modules.items():
        for key, value in module.state_dict().items():
            assert torch.equal(value, loaded[name].state_dict()[key]), (name, key)
    # A small file replaced in the store under the manifest: the session serves it, the checksum refuses it.
    sid = "step_000000001"
    manifest = reader.catalog.get(sid).manifest
    victim = next(f"{sid}/{f.path}" for f in manifest.files if f.path.endswith("m0.safetensors"))
    data = bytearray(storage.read(victim))
    data[-1] ^= 0xFF
    ray_cluster.get(storage.store_of(storage.node_id).put.remote(victim, bytes(data)))
    with reader.storage.read_session(), pytest.raises(NoValidSnapshotError, match="checksum"):
        reader.restore(snapshot_id=sid)
    reader.close()


def test_read_session_sees_its_own_writes_and_the_run_as_it_was(mem):
    """A session answers from one view: writes and removals through the same storage are seen at once (the view is
    retaken), another client's only after the session; reads of files the view did not carry (an older snapshot)
    come with the rest of their folder in one call; refusals (too large, past the end, missing) are the same."""
    from rl_ckpt.errors import FileTooLargeError, ReadRangeError
    from rl_ckpt._storage import open_storage

    storage = mem()
    other = open_storage(storage.url, {"replicas": 0})
    for step in (1, 2):
        for i in range(3):
            storage.write_atomic(f"step_00000000{step}/r/f{i}.bin", bytes([step, i]) * 100)
        storage.write_atomic(f"step_00000000{step}/{MANIFEST_NAME}", b"{}", create_only=True)
    with storage.read_session():
        assert [e.name for e in storage.list("")] == ["step_000000001", "step_000000002"]
        first = _calls_of(storage, lambda: storage.read("step_000000002/r/f0.bin"))
        assert first == {"store_listings": 0, "store_calls": 0}  # the newest snapshot came with the view
        older = _calls_of(storage, lambda: storage.read("step_000000001/r/f0.bin"))
        assert older == {"store_listings": 0, "store_calls": 1}
        assert _calls_of(storage, lambda: storage.read("step_000000001/r/f2.bin")) == older | {"store_calls": 0}
        assert bytes(storage.read("step_000000001/r/f1.bin")) == bytes([1, 1]) * 100
        assert storage.read_range("step_000000001/r/f1.bin", 2, 3) == bytes([1, 1, 1])
        assert storage.read_ranges("step_000000002/r/f1.bin", [(0, 1), (3, 2)]) == [b"\x02", b"\x01\x02"]
        with pytest.raises(FileTooLargeError):
            storage.read("step_000000002/r/f0.bin", max_bytes=10)
        with pytest.raises(ReadRangeError):
            storage.read_range("step_000000002/r/f0.bin", 150, 100)
        with pytest.raises(StorageError):
            storage.read("step_000000002/r/nope.bin")
        assert storage.stat("step_000000002/r/f0.bin").size == 200 and storage.stat("step_000000002/nope") is None
        other.write_atomic("step_000000003/r/f0.bin", b"new")
        assert not storage.exists("step_000000003")  # another client's write: not in this session's view
        storage.write_atomic("step_000000002/r/f9.bin", b"mine")
        assert storage.exists("step_000000003") and bytes(storage.read("step_000000002/r/f9.bin")) == b"mine"
        storage.remove_tree("step_000000001")
        assert [e.name for e in storage.list("")] == ["step_000000002", "step_000000003"]
    assert storage.exists("step_000000003") and not storage.exists("step_000000001")


def test_a_prefetched_view_is_asked_for_at_once_and_answers_as_a_view_taken_at_first_use(mem):
    """``prefetch_view`` sends the session's view calls before anything is listed (a restore sends them before its
    plan's manager call): the first listing then makes no store call, and answers as a view taken then would; a
    write through the storage since drops it; outside a session it does nothing."""
    storage = mem()
    other = mem(storage.key.split("/", 1)[1])
    storage.write_atomic(f"step_000000001/{MANIFEST_NAME}", b"{}", create_only=True)
    storage.prefetch_view()  # no session: nothing
    with storage.read_session():
        sent = _calls_of(storage, storage.prefetch_view)
        assert sent["store_calls"] == len(storage.known_stores()) >= 1
        listed = []
        assert _calls_of(storage, lambda: listed.extend(e.name for e in storage.list(""))) == {
            "store_listings": 1,  # the cluster's stores listed, while their answers are already there
            "store_calls": 0,
        }
        assert listed == ["step_000000001"]
    with storage.read_session():
        storage.prefetch_view()
        other.write_atomic(f"step_000000002/{MANIFEST_NAME}", b"{}", create_only=True)  # after the view was asked
        storage.write_atomic("step_000000001/x.bin", b"x")  # through this storage: the prefetched view is dropped
        assert [e.name for e in storage.list("")] == ["step_000000001", "step_000000002"]


def test_budget_evicts_oldest_never_newest_committed(mem, tmp_path):
    probe = mem()
    state = {"w": torch.arange(64 * 1024, dtype=torch.float32)}  # 256 KiB per snapshot

    class Weights:
        def state_dict(self):
            return state

        def load_state_dict(self, s):
            state.update(s)

    with _engine(probe, tmp_path, post_load_check=False) as engine:
        engine.register("weights", Weights())
        engine.save(1)
        one = sum(probe.inventory()[probe.node_id].values())
    budget = int(one * 2.5)
    storage = mem(budget_bytes=budget)
    with _engine(storage, tmp_path, post_load_check=False) as engine:
        engine.register("weights", Weights())
        for step in range(1, 6):
            state["w"] += 1
            engine.save(step)
            info = next(iter(storage.store_info().values()))
            assert info["bytes_held"] <= budget
            assert f"step_{step:09d}" in info["snapshots"]  # the newest committed is always kept
        info = next(iter(storage.store_info().values()))
        assert info["snapshots"] == ["step_000000004", "step_000000005"]
        assert info["evicted"] == ["step_000000001", "step_000000002", "step_000000003"]
        # One snapshot larger than the whole budget is refused, and nothing held is lost.
        state["w"] = torch.zeros(budget // 4 + 1024)
        from actors._memory.store import MemoryBudgetError

        with pytest.raises(MemoryBudgetError, match="nothing already held was lost"):
            engine.save(6)
        assert next(iter(storage.store_info().values()))["snapshots"] == ["step_000000004", "step_000000005"]
        assert engine.verify("step_000000005").ok


# -- flush, tier view, recovery across tiers -------------------------------------------------------------
@pytest.fixture
def tier(ray_cluster, tmp_path):
    """A durable engine + MemoryTier + MemoryTierService on a fresh run; everything torn down afterwards."""
    from actors.memory_tier import MemoryTierService
    from rl_ckpt.integrations.memory_tier import MemoryTier

    made = []

    def make(seed: int = 0, **cfg):
        values = dict(
            base_dir=str(tmp_path / "durable"),
            run_name=f"t-{uuid.uuid4().hex[:8]}" if not made else made[0][2],
            keep_best=0,
            memory_replicas=0,
            memory_interval_steps=2,
            memory_flush_every=None,
            **cfg,
        )
        engine = CheckpointEngine(**values)
        service = MemoryTierService.get_or_create(engine.config, interval=3600)
        t = MemoryTier(engine, service=None)
        state = PPOState(seed=seed)
        for name, obj in state.components().items():
            t.register(name, obj)
        made.append((t, service, values["run_name"]))
        return t, state, service

    yield make
    for t, service, _ in made:
        t.close()
    if made:
        ray_cluster.get(made[0][1].stop.remote())
        ray_cluster.kill(made[0][1], no_restart=True)
        made[0][0].memory.storage.destroy()


def test_flush_from_memory_then_restore_prefers_memory(ray_cluster, tier):
    t, a, service = tier(seed=1)
    assert t.restore().snapshot_id is None  # nothing anywhere: start fresh
    for step in range(1, 7):
        a.train_step()
        t.maybe_save(step)
        t.wait()  # (a save still in flight when the next is due skips it)
        if step == 4:
            t.wait()
            assert ray_cluster.get(service.flush_now.remote()) == "step_000000004"
    t.wait()
    status = ray_cluster.get(service.tick.remote())
    assert status["memory_snapshots"] == ["step_000000002", "step_000000004", "step_000000006"]
    assert status["durable_snapshots"] == ["step_000000004"]
    assert status["not_flushed"] == ["step_000000006"] and status["flush_lag_s"] >= 0
    # The durable copy is the memory snapshot: same manifest bytes, every file verified.
    assert bytes(t.durable.storage.read(f"step_000000004/{MANIFEST_NAME}")) == bytes(
        t.memory.storage.read(f"step_000000004/{MANIFEST_NAME}")
    )
    assert t.durable.verify("step_000000004").ok

    # `rl-ckpt ls --tiers`: durable from storage, memory from the stores on this cluster, one table.
    import contextlib
    import io
    import json

    from rl_ckpt.cli import main as cli_main

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert cli_main(["ls", t.durable.storage.url, "--tiers", "--replicas", "0", "--json"]) == 0
    listed = {r["snapshot_id"]: r["tiers"] for r in json.loads(text.getvalue())}
    assert listed == {
        "step_000000002": ["memory"],
        "step_000000004": ["memory", "durable"],
        "step_000000006": ["memory"],
    }

    t2, b, _ = tier(seed=7)
    plan = t2.plan()
    assert plan.tier == "memory" and plan.plan.target == "step_000000006"
    assert "step_000000004" in plan.reason  # says what durable storage had
    result = t2.restore()
    assert result.snapshot_id == "step_000000006" and t2.tier_restored == "memory"
    assert_same_state(a, b)
    # Where the restore's plan went: each tier's plan (planned at once), the wait for the durable plan after
    # memory loaded, and the memory stores' view its read session took.
    timings = result.timings
    assert {"plan", "plan_memory", "plan_durable", "durable_wait", "memory_views", "total"} <= set(timings), timings
    assert 0 < timings["plan_memory"] <= timings["plan"] and 0 < timings["plan_durable"] <= timings["total"]
    assert 0 <= timings["durable_wait"] <= timings["plan_durable"]
    assert 0 < timings["memory_views"] <= timings["total"]
    # A store holds bytes: its process never imports torch, through saves, a flush and a restore
    from ray_workers import loads_torch

    assert not any(loads_torch(i["pid"]) for i in t2.memory.storage.store_info().values())


def _save_steps(t, state, steps) -> None:
    for step in steps:
        state.train_step()
        t.maybe_save(step)
        t.wait()  # (a save still in flight when the next is due skips it)


def test_memory_loads_while_the_durable_plan_is_still_being_made(ray_cluster, tier):
    """Durable storage holds nothing newer than memory's newest: memory's snapshot loads before the durable plan
    is done (the durable plan here waits for that load: it would wait in vain if the restore waited for it), and
    the restore still answers with both plans, as ``plan()`` does."""
    import threading

    t, a, service = tier(seed=3)
    _save_steps(t, a, range(1, 5))
    assert ray_cluster.get(service.flush_now.remote()) == "step_000000004"  # durable: step 4, memory: 2 and 4
    t2, b, _ = tier(seed=9)
    memory_loaded = threading.Event()
    seen = {}
    load_memory, plan_durable = t2.memory.restore, t2.durable.plan_recovery

    def memory_restore(*args, **kwargs):
        result = load_memory(*args, **kwargs)
        memory_loaded.set()
        return result

    def durable_plan(*args, **kwargs):
        seen["memory loaded first"] = memory_loaded.wait(timeout=60)
        return plan_durable(*args, **kwargs)

    t2.memory.restore, t2.durable.plan_recovery = memory_restore, durable_plan
    result = t2.restore()
    assert seen == {"memory loaded first": True}
    assert result.snapshot_id == "step_000000004" and t2.tier_restored == "memory"
    assert "durable storage's newest usable is step_000000004" in result.warnings[0]  # chose with both plans
    assert_same_state(a, b)
    assert result.timings["durable_wait"] <= result.timings["plan_durable"]


def test_a_newer_durable_snapshot_is_restored_without_loading_memory_first(ray_cluster, tier):
    """Durable storage holds a newer snapshot than memory's newest (memory lost it): memory is not loaded at all."""
    t, a, service = tier(seed=5)
    _save_steps(t, a, range(1, 5))
    assert ray_cluster.get(service.flush_now.remote()) == "step_000000004"
    at_4 = {k: v.clone() for k, v in tensors_of(a).items()}
    t.memory.storage.remove(f"step_000000004/{MANIFEST_NAME}")  # memory's newest gone: memory has step 2
    t2, b, _ = tier(seed=10)
    loads = []
    load_memory = t2.memory.restore
    t2.memory.restore = lambda *args, **kwargs: loads.append(1) or load_memory(*args, **kwargs)
    result = t2.restore()
    assert loads == [] and result.snapshot_id == "step_000000004" and t2.tier_restored == "durable"
    got = tensors_of(b)
    assert got.keys() == at_4.keys() and all(torch.equal(got[k], at_4[k]) for k in got)


def test_memory_falling_back_past_durable_storage_restores_durable(ray_cluster, tier):
    """Memory's newest fails while loading and its fallback is older than durable storage's newest: the durable
    snapshot is restored (memory chose itself by its newest, which did not load)."""
    t, a, service = tier(seed=6)
    _save_steps(t, a, range(1, 5))
    assert ray_cluster.get(service.flush_now.remote()) == "step_000000004"
    at_4 = {k: v.clone() for k, v in tensors_of(a).items()}
    _save_steps(t, a, range(5, 7))  # memory: 2, 4, 6; durable: 4
    storage = t.memory.storage
    storage.remove(f"step_000000004/{MANIFEST_NAME}")  # memory: 2 and 6
    victim = next(p for p in storage.inventory("step_000000006")[storage.node_id] if p.endswith(".safetensors"))
    data = bytearray(storage.read(victim))
    data[-1] ^= 0xFF  # the same size: the plan's checks pass, the load refuses it
    ray_cluster.get(next(iter(storage.stores().values())).put.remote(victim, bytes(data)))
    t2, b, _ = tier(seed=11)
    result = t2.restore()
    assert result.snapshot_id == "step_000000004" and t2.tier_restored == "durable", result.warnings
    assert result.warnings[0].startswith("tier: durable - memory fell back to step_000000002"), result.warnings[0]
    got = tensors_of(b)
    assert got.keys() == at_4.keys() and all(torch.equal(got[k], at_4[k]) for k in got)


def test_store_killed_drops_its_copies_and_recovery_falls_back_to_durable(ray_cluster, tier):
    t, a, service = tier(seed=2)
    for step in range(1, 5):
        a.train_step()
        t.maybe_save(step)
        t.wait()  # (a save still in flight when the next is due skips it)
        if step == 2:
            t.wait()
            ray_cluster.get(service.flush_now.remote())
            at_2 = {k: v.clone() for k, v in tensors_of(a).items()}
    t.wait()
    status = ray_cluster.get(service.tick.remote())
    assert status["memory_snapshots"] == ["step_000000002", "step_000000004"]
    for handle in t.memory.storage.stores().values():
        ray_cluster.kill(handle, no_restart=True)
    status = ray_cluster.get(service.tick.remote())
    assert status["memory_snapshots"] == [] and status["bytes_per_node"] == {}
    assert [s["tiers"] for s in status["tiers"]] == [["durable"]]

    t2, b, _ = tier(seed=8)
    plan = t2.plan()
    assert plan.tier == "durable" and plan.plan.target == "step_000000002"
    assert "memory tier has no usable snapshot" in plan.reason
    result = t2.restore()
    assert result.snapshot_id == "step_000000002" and t2.tier_restored == "durable"
    got = tensors_of(b)
    assert got.keys() == at_2.keys() and all(torch.equal(got[k], at_2[k]) for k in got)


def test_lost_file_makes_memory_snapshot_incomplete_and_dropped(ray_cluster, tier):
    """One participant's file gone (as with its node): the whole memory snapshot leaves the memory tier."""
    t, a, service = tier(seed=4)
    for step in range(1, 5):
        a.train_step()
        t.maybe_save(step)
        t.wait()  # (a save still in flight when the next is due skips it)
    t.wait()
    storage = t.memory.storage
    victim = next(p for p in storage.inventory("step_000000004")[storage.node_id] if p.endswith(".safetensors"))
    storage.remove(victim)
    status = ray_cluster.get(service.tick.remote())
    assert status["memory_snapshots"] == ["step_000000002"]
    assert status["dropped"] == ["step_000000004"]
    assert not storage.exists(f"step_000000004/{MANIFEST_NAME}")


# -- unit logic ---------------------------------------------------------------------------------------------------
def _plan(action: str, target: str | None = None, step: int = 0) -> RecoveryPlan:
    return RecoveryPlan("x", action, f"{action} because", target=target, continue_from_step=step)


def test_choose_tier():
    m, d = _plan("restore", "step_000000020", 20), _plan("restore", "step_000000010", 10)
    assert choose_tier(m, d).tier == "memory"
    assert choose_tier(_plan("restore", "step_000000010", 10), d).tier == "memory"  # a tie: memory loads fastest
    older = choose_tier(_plan("restore", "step_000000005", 5), d)
    assert older.tier == "durable" and "older" in older.reason
    gone = choose_tier(_plan("give_up"), d)
    assert gone.tier == "durable" and "no usable snapshot" in gone.reason
    assert choose_tier(None, d).tier == "durable"
    assert choose_tier(_plan("start_fresh"), _plan("start_fresh")).tier is None


def test_flush_policy():
    ids = [f"step_{s:09d}" for s in (2, 4, 6, 8)]
    every3 = FlushPolicy(every_snapshots=3)
    assert every3.due(ids, ["step_000000002"], None) == "step_000000008"
    assert every3.due(ids, ["step_000000004"], None) is None
    timed = FlushPolicy(every_snapshots=None, every_seconds=60)
    assert timed.due(ids, ["step_000000006"], last_flush=100.0, now=150.0) is None
    assert timed.due(ids, ["step_000000006"], last_flush=100.0, now=161.0) == "step_000000008"
    assert FlushPolicy(None, None).due(ids, [], None) is None
    assert FlushPolicy(1).due(ids, ["step_000000008"], None) is None
