"""After a restore, committed snapshots newer than what was loaded (the failed timeline) are retired:
moved whole into history/retired/ with a record saying why, never deleted; a retire interrupted at any
storage operation is finished by the next one and the catalog never lists a broken snapshot."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import PPOState
from rl_ckpt import CheckpointEngine
from rl_ckpt._run.snapshot_files import verify_snapshot
from rl_ckpt._run.catalog import Catalog
from rl_ckpt._run.quarantine import quarantine, quarantined
from rl_ckpt._run.retire import retire_newer
from rl_ckpt._storage.local import LocalStorage
from rl_ckpt.tools.faults import FaultyStorage

S = "step_{:09d}".format


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def _engine(tmp_path, seed=0, **cfg):
    state = PPOState(seed=seed)
    return state, state.register(CheckpointEngine(base_dir=str(tmp_path), run_name="r", retention=False, **cfg))


def _records(run: Path) -> dict[str, dict]:
    """The retire records in history/retired, by snapshot id (one each, or the test fails)."""
    out: dict[str, dict] = {}
    for path in sorted((run / "history" / "retired").glob("*.json")):
        body = json.loads(path.read_text())
        assert body["snapshot_id"] not in out, f"two retire records for {body['snapshot_id']}"
        out[body["snapshot_id"]] = body
    return out


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_restore_after_a_corrupt_newest_retires_it_and_the_step_saves_again(tmp_path):
    state, e = _engine(tmp_path)
    for step, kind in ((5, "full"), (10, "full"), (12, "light"), (15, "full")):
        state.train(1)
        e.save(step, metrics={"avg_reward": float(step)}, kind=kind)
    e.close()
    run = tmp_path / "r"
    original = _tree(run / S(15))
    _flip(run / S(15) / "policy.safetensors")

    state, e = _engine(tmp_path, seed=1)
    r = e.restore()
    assert (r.snapshot_id, r.light_snapshot_id, r.global_step) == (S(10), S(12) + ".light", 12)
    assert r.retired == [S(15)] and S(15) in r.skipped
    assert "retired:   step_000000015" in str(r.plan)
    assert [i.snapshot_id for i in e.snapshots()] == [S(5), S(10), S(12) + ".light"]
    assert not (run / S(15)).exists()
    (moved,) = (run / "history" / "retired").glob(S(15) + ".*/")
    assert _tree(moved).keys() == original.keys()  # moved whole, the corrupt file too (forensics)
    record = _records(run)[S(15)]
    assert record["restored"] == f"{S(10)} + light {S(12)}.light" and record["restored_step"] == 12
    assert record["reason"].startswith("newer than the snapshot a restore loaded") and record["retired_at"]
    assert record["moved_to"] == f"history/retired/{moved.name}" and record["kind"] == "full"
    from rl_ckpt._timeline import load as load_timeline

    drawn = {s["id"]: s["state"] for s in load_timeline(e.storage)["snapshots"]}
    assert drawn[S(15)] == "retired" and drawn[S(10)] == "kept"  # the picture tells a retire from a deletion

    state.train(3)
    info = e.save(15, metrics={"avg_reward": 15.0})  # the step of the failed timeline commits again
    assert info.snapshot_id == S(15) and verify_snapshot(e.storage, S(15)).ok
    again = _engine(tmp_path, seed=2)[1].restore()
    assert (again.snapshot_id, again.global_step, again.retired) == (S(15), 15, [])


def test_restore_without_light_retires_the_light_layer_and_it_saves_again(tmp_path):
    state, e = _engine(tmp_path)
    for step, kind in ((5, "full"), (10, "full"), (12, "light")):
        state.train(1)
        e.save(step, kind=kind)
    e.close()
    state, e = _engine(tmp_path, seed=1)
    r = e.restore(light=False)
    assert (r.snapshot_id, r.light_snapshot_id, r.global_step, r.retired) == (S(10), None, 10, [S(12) + ".light"])
    assert list(_records(tmp_path / "r")) == [S(12) + ".light"]
    state.train(2)
    assert e.save(12, kind="light").snapshot_id == S(12) + ".light"
    assert _engine(tmp_path, seed=2)[1].restore().light_snapshot_id == S(12) + ".light"


def test_on_s3_the_newer_snapshot_is_copied_then_uncommitted(s3_url):
    url, options = s3_url
    base, run = url.rsplit("/", 1)
    cfg = {"base_dir": base, "run_name": run, "storage_options": options, "retention": False}
    state = PPOState(seed=0)
    e = state.register(CheckpointEngine(**cfg))
    for step in (1, 2):
        state.train(1)
        e.save(step)
    manifest = e.catalog.get(S(2)).manifest
    victim = next(f.path for f in manifest.files if f.path.endswith("policy.safetensors"))
    data = bytearray(e.storage.read(f"{S(2)}/{victim}"))
    data[len(data) // 2] ^= 1
    e.storage.write(f"{S(2)}/{victim}", [bytes(data)])
    e.close()
    state = PPOState(seed=1)
    e = state.register(CheckpointEngine(**cfg))
    r = e.restore()
    assert (r.snapshot_id, r.retired) == (S(1), [S(2)])
    assert not e.storage.exists(f"{S(2)}/meta.json") and e.storage.list(S(2)) == []
    (record,) = [x for x in e.storage.list("history/retired") if x.name.endswith(".json")]
    moved = json.loads(bytes(e.storage.read(f"history/retired/{record.name}")))["moved_to"]
    assert e.storage.exists(f"{moved}/meta.json") and bytes(e.storage.read(f"{moved}/{victim}")) == bytes(data)
    state.train(1)
    assert e.save(2).snapshot_id == S(2) and e.verify().ok


def test_restore_of_the_newest_retires_nothing(tmp_path):
    state, e = _engine(tmp_path)
    for step in (1, 2):
        state.train(1)
        e.save(step)
    r = _engine(tmp_path, seed=1)[1].restore()
    assert (r.snapshot_id, r.retired) == (S(2), []) and not (tmp_path / "r" / "history").exists()


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_newer_snapshot_with_a_broken_manifest_stays_for_a_person(tmp_path, damage):
    state, e = _engine(tmp_path)
    for step in (1, 2):
        state.train(1)
        e.save(step)
    meta = tmp_path / "r" / S(2) / "meta.json"
    meta.write_bytes(meta.read_bytes()[:40]) if damage == "truncate" else meta.unlink()
    listing = sorted(p.name for p in (tmp_path / "r" / S(2)).iterdir())
    r = _engine(tmp_path, seed=1)[1].restore()
    assert (r.snapshot_id, r.retired) == (S(1), [])
    assert any(S(2) in w and "unreadable" in w for w in r.warnings)
    assert sorted(p.name for p in (tmp_path / "r" / S(2)).iterdir()) == listing  # verify and ls still report it


def test_a_named_snapshot_retires_nothing_and_quarantined_ones_stay(tmp_path):
    state, e = _engine(tmp_path)
    for step in (1, 2, 3):
        state.train(1)
        e.save(step)
    quarantine(e.storage, S(3), "probe disagrees (test)", source="test")
    looked = _engine(tmp_path, seed=1)[1].restore(snapshot_id=S(1))  # a look at an old snapshot
    assert (looked.snapshot_id, looked.retired) == (S(1), []) and (tmp_path / "r" / S(2)).is_dir()
    r = _engine(tmp_path, seed=2)[1].restore()
    assert (r.snapshot_id, r.retired) == (S(2), [])
    assert any(S(3) in w and "quarantine" in w for w in r.warnings)
    assert (tmp_path / "r" / S(3) / "meta.json").exists() and quarantined(e.storage) == {S(3): "probe disagrees (test)"}


class Crash(BaseException):
    """A kill -9 at a storage operation: nothing after it runs (not caught as a CheckpointError)."""


def _template(root: Path, manifest_last: bool) -> Path:
    """A run with 5, 10, light 12 (on 10), 15, light 17 (on 15, quarantined)."""
    state, e = _engine(root, atomic_write=not manifest_last)
    for step, kind in ((5, "full"), (10, "full"), (12, "light"), (15, "full"), (17, "light")):
        state.train(1)
        e.save(step, kind=kind)
    e.close()
    quarantine(LocalStorage(str(root / "r")), S(17) + ".light", "post-load check failed (test)", source="test")
    return root / "r"


def _retire(storage, retire_storage=None):
    return retire_newer(
        retire_storage or storage,
        Catalog(retire_storage or storage),
        continue_step=10,
        loaded=[S(10)],
        restored=S(10),
        by="test",
    )


CHANGES = ("write", "write_atomic", "remove", "remove_tree", "rename_dir", "sync_dir")
NEWER = [S(12) + ".light", S(15)]
QUARANTINED = S(17) + ".light"


@pytest.mark.parametrize("rename", [True, False], ids=["rename", "copy-then-uncommit"])
def test_a_retire_killed_at_any_storage_operation_is_finished_by_the_next(tmp_path, rename):
    template = _template(tmp_path / "template", manifest_last=not rename)
    originals = {sid: _tree(template / sid) for sid in NEWER}
    quarantined_tree = _tree(template / QUARANTINED)
    probe = FaultyStorage(LocalStorage(str(shutil.copytree(template, tmp_path / "probe"))))
    probe.supports_rename = rename
    assert _retire(probe).retired == NEWER
    # A crash before a read leaves what a crash before the next change does: crash before each change.
    changes = [op for op, _path in probe.ops if op in CHANGES]
    points = [(op, changes[: i + 1].count(op)) for i, op in enumerate(changes)]
    assert len(points) >= 4 * len(NEWER)  # per snapshot at least: record, move, two syncs or three removes
    for k, (op, nth) in enumerate(points, start=1):
        run = Path(shutil.copytree(template, tmp_path / f"k{k}"))
        faulty = FaultyStorage(LocalStorage(str(run)))
        faulty.supports_rename = rename
        faulty.fail(op, nth=nth, error=Crash())
        with pytest.raises(Crash):
            _retire(faulty)
        # What the crash left: every listed snapshot whole, none unreadable; each newer one either
        # still committed in place or moved whole.
        storage = LocalStorage(str(run))
        catalog = Catalog(storage)
        catalog.refresh()
        assert catalog.unreadable() == [], f"crash at operation {k}"
        for info in catalog.snapshots():
            assert verify_snapshot(storage, info.snapshot_id).ok, f"crash at operation {k}: {info.snapshot_id}"
        listed = {i.snapshot_id for i in catalog.snapshots()}
        for sid in NEWER:
            copies = [p for p in (run / "history" / "retired").glob(sid + ".*") if p.is_dir()]
            whole = [p for p in copies if (p / "meta.json").exists()]
            assert sid in listed or (len(whole) == 1 and _tree(whole[0]) == originals[sid]), f"crash at {k}: {sid}"
        # The next restore's pass finishes the job.
        plain = FaultyStorage(storage)
        plain.supports_rename = rename
        outcome = _retire(plain)
        catalog.refresh()
        assert [i.snapshot_id for i in catalog.snapshots()] == [S(5), S(10), QUARANTINED]
        assert catalog.unreadable() == [] and any(QUARANTINED in w for w in outcome.warnings)
        assert sorted(_records(run)) == NEWER, f"crash at operation {k}"
        for sid in NEWER:
            (copy,) = [p for p in (run / "history" / "retired").glob(sid + ".*") if p.is_dir()]
            assert _tree(copy) == originals[sid], f"crash at operation {k}: {sid}"
        assert quarantined(storage) == {QUARANTINED: "post-load check failed (test)"}  # left for a person
        assert _tree(run / QUARANTINED) == quarantined_tree
        assert _retire(plain).retired == []  # done: nothing more to retire
    # A step of the failed timeline saves again once the interrupted retire was finished.
    state = PPOState(seed=3)
    e = state.register(
        CheckpointEngine(base_dir=str(tmp_path), run_name=f"k{len(points)}", retention=False, atomic_write=rename)
    )
    state.train(1)
    assert e.save(15).snapshot_id == S(15) and verify_snapshot(e.storage, S(15)).ok
    e.close()


def test_the_manager_retires_once_for_every_participant(ray_cluster, tmp_path):
    import uuid

    from actors import CheckpointManager
    from ray_workers import Participant

    ray = ray_cluster
    name = f"retire-{uuid.uuid4().hex[:8]}"
    base = str(tmp_path)
    mgr = CheckpointManager.get_or_create(run_name=name, base_dir=base, keep_latest=10)
    parts = ["learner-0", "learner-1"]
    actor = ray.remote(num_cpus=0)(Participant)
    try:
        group = [actor.remote(base, name, mgr, rank, 2, "learner", parts) for rank in (0, 1)]
        for step in (1, 2):
            assert ray.get([p.save.remote(step) for p in group]) == [S(step)] * 2
        run = Path(base) / name
        newest = next((run / S(2)).rglob("learner-1/*.safetensors"))
        _flip(newest)
        restored = ray.get([p.restore.remote() for p in group])
        assert [r[:3] for r in restored] == [(S(1), 1, 1)] * 2  # both restore the older one
        plan = ray.get(mgr.plan.remote())
        assert plan["retired"] == [S(2)] and plan["target"] == S(1)
        assert list(_records(run)) == [S(2)] and _records(run)[S(2)]["retired_by"] == "manager"
        assert len([p for p in (run / "history" / "retired").iterdir() if p.is_dir()]) == 1
        assert [s["snapshot_id"] for s in ray.get(mgr.snapshots.remote())] == [S(1)]
        assert ray.get([p.save.remote(2) for p in group]) == [S(2)] * 2  # the step saves again
        assert ray.get([p.restore.remote() for p in group])[0][:2] == (S(2), 2)
        assert list(_records(run)) == [S(2)]  # retired once
    finally:
        ray.kill(mgr)


def test_participants_without_light_layers_get_a_plan_that_retires_the_newer_light(ray_cluster, tmp_path):
    """Participants that apply no light layer (``restore(light=False)``) ask the manager for such a plan: its target
    is the full snapshot and the light layer built on it, newer, is retired with the failed timeline; the new
    timeline saves that light step again instead of colliding with it."""
    import uuid

    from actors import CheckpointManager
    from ray_workers import Participant

    ray = ray_cluster
    name = f"nolight-{uuid.uuid4().hex[:8]}"
    base = str(tmp_path)
    mgr = CheckpointManager.get_or_create(run_name=name, base_dir=base, keep_latest=10, healthz_port=None)
    parts = ["learner-0", "learner-1"]
    actor = ray.remote(num_cpus=0)(Participant)
    try:
        group = [actor.remote(base, name, mgr, rank, 2, "learner", parts) for rank in (0, 1)]
        assert ray.get([p.save.remote(10) for p in group]) == [S(10)] * 2
        light = S(15) + ".light"
        assert ray.get([p.save.remote(15, "light") for p in group]) == [light] * 2
        ray.get(mgr.record_failure.remote({"kind": "process_killed", "step": 17, "participant": "learner-1"}))
        restored = ray.get([p.restore.remote(False) for p in group])
        assert [r[:2] for r in restored] == [(S(10), 10)] * 2
        plan = ray.get(mgr.plan.remote(False))
        assert (plan["target"], plan["light"], plan["continue_from_step"]) == (S(10), None, 10)
        assert plan["retired"] == [light] and light in _records(Path(base) / name)
        assert ray.get([p.save.remote(15, "light") for p in group]) == [light] * 2  # saved again, no collision
    finally:
        ray.kill(mgr)


def test_memory_tier_deletes_the_failed_timeline_but_not_a_save_of_the_new_one_beside_it():
    """The memory tier's delete of the failed timeline (by the leading participant, as it restores) removes each
    newer committed snapshot's manifest and the files it names, and nothing else: another participant that
    restored sooner may be saving the new timeline's next step into the same folders meanwhile. (On a storage
    without rename, as the memory stores are: snapshots commit by their create-only manifest.)"""
    import uuid

    from rl_ckpt._run.delete import delete_committed_after

    state = PPOState(seed=0)
    engine = state.register(
        CheckpointEngine(base_dir=f"memory://del-{uuid.uuid4().hex[:8]}", run_name="r", retention=False)
    )
    storage = engine.storage
    assert not storage.supports_rename
    for step in (2, 4, 6):
        state.train_step()
        engine.save(step)

    def files(folder):
        return {f"{folder}/{e.name}" for e in storage.list(folder) if not e.is_dir} | {
            p for e in storage.list(folder) if e.is_dir for p in files(f"{folder}/{e.name}")
        }

    own = files(S(4))
    # A participant of the new timeline, restored to step 2, already writing its parts of steps 4 and 8.
    beside = [f"{S(4)}/w-new/learner-1/progress.json", f"{S(8)}/w-new/learner-1/progress.json"]
    for rel in beside:
        storage.write_atomic(rel, b'{"step": 1}')
    storage.write_atomic(f"{S(6)}/meta.json", b"{not json")  # a damaged manifest of the failed timeline

    assert delete_committed_after(storage, 2) == [S(4), S(6)]
    assert all(bytes(storage.read(rel)) == b'{"step": 1}' for rel in beside)  # the new timeline's files stay
    assert not any(storage.exists(rel) for rel in own)  # step 4's own files and manifest are gone
    assert not storage.exists(f"{S(6)}/meta.json")
    assert [s.snapshot_id for s in Catalog(storage).snapshots()] == [S(2)]
    assert verify_snapshot(storage, S(2)).ok
    assert delete_committed_after(storage, 2) == []  # nothing committed is left to delete
    state.train_step()
    assert engine.save(4).snapshot_id == S(4)  # the new timeline commits the step the failed one held
    assert bytes(storage.read(beside[0])) == b'{"step": 1}'
