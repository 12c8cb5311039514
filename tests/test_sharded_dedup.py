"""Dedup for sharded components: 2 FSDP2 ranks on CPU/gloo with a frozen layer; real processes, real files.

A rank's local chunk whose bytes a committed snapshot already holds is
referenced, not written again; restores on 1 and 2 ranks are bitwise; gc and
retention keep every object a committed manifest references; a damaged object
is caught by the rank reading it and every rank falls back.
"""

from __future__ import annotations

import json
import os

import pytest
import torch.multiprocessing as mp

import sharded_store_workers as sw
import sharded_workers as w
from rl_ckpt._run.dedup import layout_objects, manifest_objects, object_path
from rl_ckpt._run.gc import find_unreferenced_objects, remove_debris
from rl_ckpt._format.manifest import Manifest
from rl_ckpt._storage.local import LocalStorage


def spawn(fn, world: int, *args) -> None:
    mp.spawn(fn, args=(world, w.free_port(), *args), nprocs=world)


def chunk_objects(meta: dict, component: str, fqn: str) -> list:
    return [c.get("objects") for c in meta["components"][component]["layout"]["tensors"][fqn]["chunks"]]


def objects_on_disk(run) -> set[str]:
    return {f for _r, _d, fs in os.walk(run / "objects") for f in fs if not f.startswith(".tmp-")}


@pytest.fixture(scope="module")
def dedup_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded_dedup")
    run = out / "run"
    spawn(sw.dedup_save_job, 2, str(run), str(out))
    return run, out


def read_meta(run, sid: str) -> dict:
    return json.loads((run / sid / "meta.json").read_text())


def test_unchanged_shards_are_referenced_not_rewritten(dedup_run):
    run, out = dedup_run
    m1 = json.loads((out / "meta_1.json").read_text())
    m2, m3 = read_meta(run, "step_000000002"), read_meta(run, "step_000000003")
    # The frozen layer's chunks (one per rank) name the same objects in every snapshot; trained ones change.
    frozen = chunk_objects(m1, "policy", "0.weight")
    assert len(frozen) == 2 and all(frozen) and chunk_objects(m3, "policy", "0.weight") == frozen
    assert all(a != b for a, b in zip(chunk_objects(m1, "policy", "2.weight"), chunk_objects(m2, "policy", "2.weight")))
    # The snapshot's size counts the objects its chunks name, not only its own files.
    manifest = Manifest.from_bytes((run / "step_000000002" / "meta.json").read_bytes(), "step_000000002")
    shared = sum(n for d, (_a, n) in manifest_objects(manifest).items())
    assert manifest.size_bytes >= sum(f.size for f in manifest.files) + shared > sum(f.size for f in manifest.files)
    # So does the recovery plan's count of what each component loads.
    from rl_ckpt._recovery.coordinator import CoordinatorConfig
    from rl_ckpt._recovery.plan import build_plan
    from rl_ckpt._run.catalog import Catalog

    storage = LocalStorage(str(run))
    plan = build_plan(
        Catalog(storage),
        storage,
        schema_version=manifest.state_schema_version,
        components=None,
        coordinator=CoordinatorConfig(),
        deep=False,
    )
    assert plan.target == "step_000000003"
    m3 = Manifest.from_bytes((run / "step_000000003" / "meta.json").read_bytes(), "step_000000003")
    assert sum(a.bytes for a in plan.actions) == m3.size_bytes
    # Small tensors (biases, Adam's step) stay in each rank's shard file.
    assert sorted(f["path"] for f in m2["files"]) == [
        "optim.rank0.safetensors",
        "optim.rank1.safetensors",
        "policy.rank0.safetensors",
        "policy.rank1.safetensors",
    ]
    for rank in (0, 1):
        report = json.loads((out / f"written_{rank}.json").read_text())
        first, second, third = report["written"]
        assert report["frozen_bytes"] >= 6144
        # Later saves write everything but the frozen shard: exactly its bytes fewer.
        assert second == third == first - report["frozen_bytes"], report


def test_restore_on_two_and_one_ranks_is_bitwise(dedup_run):
    run, out = dedup_run
    spawn(sw.dedup_restore_job, 2, str(run), str(out), 3, "")
    spawn(sw.dedup_restore_job, 1, str(run), str(out), 3, "")


def test_retention_and_gc_keep_referenced_objects_and_remove_the_rest(dedup_run):
    run, out = dedup_run
    assert not (run / "step_000000001").exists()  # keep_latest=2 deleted it after step 3
    live = {
        d
        for sid in ("step_000000002", "step_000000003")
        for d in manifest_objects(Manifest.from_bytes((run / sid / "meta.json").read_bytes(), sid))
    }
    m1 = Manifest.from_bytes((out / "meta_1.json").read_bytes(), "step_000000001")
    only_1 = set(manifest_objects(m1)) - live
    assert only_1 and live
    on_disk = objects_on_disk(run)
    assert live <= on_disk and not (only_1 & on_disk)  # retention swept what only step 1 named
    # gc (mark-and-sweep over every committed manifest) removes an orphan and nothing referenced.
    storage = LocalStorage(str(run))
    algo = m1.components["policy"]["layout"]["algo"]
    orphan = object_path(algo, "ab" * (len(next(iter(live))) // 2))
    storage.makedirs(orphan.rsplit("/", 1)[0])
    storage.write_atomic(orphan, b"nobody references this")
    debris, refusal = find_unreferenced_objects(storage, grace_seconds=0)
    assert refusal is None and [d.path for d in debris] == [orphan]
    remove_debris(storage, debris)
    assert objects_on_disk(run) == live
    spawn(sw.dedup_restore_job, 2, str(run), str(out), 3, "")  # still whole after gc
    # Export (rollout weights / serving) reads the chunks from the objects too, verified.
    from safetensors.torch import load_file

    from rl_ckpt._export import export_component

    m3 = Manifest.from_bytes((run / "step_000000003" / "meta.json").read_bytes(), "step_000000003")
    export_component(storage, m3, "policy", str(out / "policy_3.safetensors"))
    exported, full = load_file(str(out / "policy_3.safetensors")), load_file(str(out / "full_3.safetensors"))
    assert set(exported) == {k[len("model.") :] for k in full if k.startswith("model.")}
    assert all(exported[k].equal(full[f"model.{k}"]) for k in exported)


def test_corrupt_object_is_caught_by_its_reader_and_all_ranks_roll_back(dedup_run, tmp_path):
    import shutil

    run0, out = dedup_run
    run = tmp_path / "run"
    shutil.copytree(run0, run)
    m2, m3 = read_meta(run, "step_000000002"), read_meta(run, "step_000000003")
    in_2 = {d for objs in chunk_objects(m2, "policy", "2.weight") for d, _n in objs}
    chunk = next(
        c for c in m3["components"]["policy"]["layout"]["tensors"]["2.weight"]["chunks"] if c["offsets"][0] > 0
    )  # rank 1's part
    ((digest, _size),) = chunk["objects"]
    assert digest not in in_2
    path = run / object_path(m3["components"]["policy"]["layout"]["algo"], digest)
    data = bytearray(path.read_bytes())
    data[5] ^= 0x40
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    spawn(sw.dedup_restore_job, 2, str(run), str(out), 2, "rank 1|checksum mismatch|2.weight")


def test_layout_object_references_are_checked():
    from rl_ckpt.errors import CorruptSnapshotError

    good = {"algo": "sha256", "tensors": {"w": {"chunks": [{"objects": [["ab" * 32, 4]]}, {"file": "x"}]}}}
    assert layout_objects(good, "s") == {"ab" * 32: ("sha256", 4)}
    for bad in ([["../../etc", 4]], [["ab", "4"]], "ab", [["AB", 4]]):
        with pytest.raises(CorruptSnapshotError, match="malformed dedup object references"):
            layout_objects({"algo": "sha256", "tensors": {"w": {"chunks": [{"objects": bad}]}}}, "s")
    with pytest.raises(CorruptSnapshotError):
        layout_objects({"algo": "../x", "tensors": {"w": {"chunks": [{"objects": [["ab", 4]]}]}}}, "s")


@pytest.mark.parametrize("nth,partial", [(1, True), (2, False)])
def test_rank_killed_while_publishing_objects_commits_nothing_and_gc_cleans_up(tmp_path, nth, partial):
    from rl_ckpt._run.gc import find_debris

    run = tmp_path / "run"
    with pytest.raises(mp.ProcessExitedException):
        spawn(sw.dedup_kill_job, 2, str(run), str(tmp_path), nth, partial)
    assert (tmp_path / "killed").exists()  # rank 1 died where intended, not earlier
    assert not (run / "step_000000002" / "meta.json").exists()
    storage = LocalStorage(str(run))
    live = set(
        manifest_objects(Manifest.from_bytes((run / "step_000000001" / "meta.json").read_bytes(), "step_000000001"))
    )
    assert objects_on_disk(run) > live  # step 2's published objects are there, named by no manifest
    debris, refusal = find_unreferenced_objects(storage, grace_seconds=0)
    assert refusal is None and debris
    remove_debris(storage, debris + find_debris(storage, grace_seconds=0))
    assert objects_on_disk(run) == live
    spawn(sw.dedup_restore_job, 2, str(run), str(tmp_path), 1, "")


def test_layout_with_object_chunks_round_trips_and_refuses_hostile_ones():
    from rl_ckpt.errors import CorruptSnapshotError
    from rl_ckpt._format.checksum import digest_bytes
    from rl_ckpt._sharded.layout import Chunk, Layout, TensorLayout

    algo = "sha256"
    d = digest_bytes(algo, b"x")
    chunk = Chunk((0, 0), (4, 2), "", 0, 2, (d, d), objects=((d, 16), (d, 16)))
    layout = Layout(algo, {"w": TensorLayout("F32", (4, 2), [chunk])})
    js = layout.to_json()
    assert set(js["tensors"]["w"]["chunks"][0]) == {"offsets", "sizes", "objects", "block_rows", "checksums"}
    assert Layout.from_json(js, "s/c").tensors["w"].chunks == [chunk]
    assert layout_objects(js, "s") == {d: (algo, 16)}

    def broken(**change):
        c = {**js["tensors"]["w"]["chunks"][0], **change}
        return {**js, "tensors": {"w": {**js["tensors"]["w"], "chunks": [c]}}}

    for bad, why in (
        (broken(objects=[["../../../etc/passwd", 32]]), "hex digest"),
        (broken(objects=[[d, 16]]), "objects of 16 bytes"),  # the chunk takes 32
        (broken(objects=[]), "hex digest"),
        (broken(objects=[[d, 16], [d, True]]), "hex digest"),
        (broken(file="w.safetensors"), "exactly"),
    ):  # both a file and objects
        with pytest.raises(CorruptSnapshotError, match=why):
            Layout.from_json(bad, "s/c")
