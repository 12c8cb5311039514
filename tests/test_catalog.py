"""The catalog re-lists storage without re-reading manifests it already parsed, and still sees every change."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from rl_ckpt import CheckpointEngine
from rl_ckpt._run.catalog import Catalog
from rl_ckpt._run.quarantine import QUARANTINE, quarantine, release
from rl_ckpt._storage import open_storage


def _engine(base, run="run", options=None):
    e = CheckpointEngine(base_dir=base, run_name=run, storage_options=options, retention=False)
    e.register("policy", torch.nn.Linear(4, 3))
    return e


def _steps(catalog: Catalog) -> list[int]:
    return [i.global_step for i in catalog.snapshots()]


@pytest.fixture(params=["local", "memory", "s3"])
def where(request, tmp_path):
    """(base_dir, storage_options) of a run folder on each backend."""
    if request.param == "local":
        return str(tmp_path), None
    if request.param == "memory":
        return f"memory://catalog-{tmp_path.name}", None
    url, options = request.getfixturevalue("s3_url")
    return url.rpartition("/")[0], options


def test_refresh_reads_only_new_manifests(where):
    base, options = where
    writer = _engine(base, options=options)
    for step in (1, 2, 3):
        writer.save(step, {"reward": float(step)})
    catalog = Catalog(open_storage(writer.storage.url, options))
    catalog.refresh()
    assert _steps(catalog) == [1, 2, 3] and catalog.manifest_reads == 3
    version = catalog.version
    catalog.refresh()
    assert catalog.manifest_reads == 3, "unchanged manifests were parsed again"
    assert catalog.version == version
    for step in (4, 5):  # another process commits
        writer.save(step, {"reward": float(step)})
    catalog.refresh()
    assert _steps(catalog) == [1, 2, 3, 4, 5] and catalog.manifest_reads == 5
    assert catalog.version == version, "only additions: caches of derived facts stay valid"
    assert catalog.get("step_000000005").metrics == {"reward": 5.0}

    writer.storage.remove_tree("step_000000002")  # deleted behind its back
    catalog.refresh()
    assert _steps(catalog) == [1, 3, 4, 5] and catalog.version > version


def test_quarantine_and_release_are_seen_without_rereading(where):
    base, options = where
    writer = _engine(base, options=options)
    writer.save(1)
    writer.save(2)
    catalog = Catalog(open_storage(writer.storage.url, options))
    catalog.refresh()
    quarantine(writer.storage, "step_000000002", "probe mismatch", source="test")
    catalog.refresh()
    assert catalog.get("step_000000002").quarantined == "probe mismatch"
    assert [i.global_step for i in catalog.snapshots(usable=True)] == [1]
    release(writer.storage, "step_000000002")
    catalog.refresh()
    assert catalog.get("step_000000002").quarantined is None
    assert catalog.manifest_reads == 2
    assert writer.storage.list(QUARANTINE) == []


def test_manifest_edited_in_place_is_reread(tmp_path):
    """Same size, mtime put back: the catalog still notices (ctime), and the manifest's checksum refuses it."""
    e = _engine(str(tmp_path))
    e.save(1, {"reward": 1.0})
    e.save(2, {"reward": 2.0})
    catalog = Catalog(e.storage)
    catalog.refresh()
    path = os.path.join(e.storage.root, "step_000000002", "meta.json")
    before = os.stat(path)
    raw = open(path, "rb").read()
    edited = (
        raw.replace(b'"reward":2.0', b'"reward":9.0')
        if b'"reward":2.0' in raw
        else raw.replace(b'"reward": 2.0', b'"reward": 9.0')
    )
    assert edited != raw and len(edited) == len(raw)
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.write(edited)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    catalog.refresh()
    assert _steps(catalog) == [1]
    assert [u.snapshot_id for u in catalog.unreadable()] == ["step_000000002"]
    assert "checksum" in catalog.unreadable()[0].reason


def test_replaced_snapshot_is_reread(tmp_path):
    """A snapshot folder swapped for another one under the same name (restored from a backup) is re-read."""
    a = _engine(str(tmp_path), run="a")
    a.save(1, {"reward": 1.0})
    b = _engine(str(tmp_path), run="b")
    b.save(1, {"reward": 7.0})
    catalog = Catalog(a.storage)
    catalog.refresh()
    assert catalog.get("step_000000001").metrics == {"reward": 1.0}
    shutil.rmtree(os.path.join(a.storage.root, "step_000000001"))
    shutil.copytree(os.path.join(b.storage.root, "step_000000001"), os.path.join(a.storage.root, "step_000000001"))
    catalog.refresh()
    assert catalog.get("step_000000001").metrics == {"reward": 7.0}
    assert catalog.manifest_reads == 2


def test_engine_listing_stays_cheap_as_a_run_grows(tmp_path):
    """plan_recovery() re-lists storage but parses only the manifests it has not seen."""
    e = _engine(str(tmp_path))
    for step in range(1, 31):
        e.save(step)
    reads = e.catalog.manifest_reads
    for _ in range(3):
        plan = e.plan_recovery(deep=False)
        assert plan.target == "step_000000030"
    assert e.catalog.manifest_reads == reads, "the engine's own commits were parsed again"


def test_a_planted_link_in_place_of_a_manifest_is_listed_unreadable(tmp_path):
    e = _engine(str(tmp_path))
    e.save(1)
    e.save(2)
    meta = os.path.join(e.storage.root, "step_000000002", "meta.json")
    os.replace(meta, str(tmp_path / "elsewhere.json"))
    os.symlink(str(tmp_path / "elsewhere.json"), meta)
    catalog = Catalog(e.storage)
    catalog.refresh()  # never follows it, never raises
    assert _steps(catalog) == [1]
    assert [u.snapshot_id for u in catalog.unreadable()] == ["step_000000002"]
    assert "link" in catalog.unreadable()[0].reason


def test_look_alike_folders_are_foreign_not_snapshots(tmp_path):
    from rl_ckpt._run.catalog import foreign_names

    e = _engine(str(tmp_path))
    e.save(20)
    run = tmp_path / "run"
    look_alikes = ["step_0000000020", "step_" + "\u0660" * 7 + "\u0662\u0660", "step_000000020\n", "step_000000020.b0"]
    for name in look_alikes:
        shutil.copytree(run / "step_000000020", run / name)
    (run / "objects").mkdir()
    cat = Catalog(open_storage(str(run)))
    cat.refresh()
    assert [i.snapshot_id for i in cat.snapshots()] == ["step_000000020"] and cat.unreadable() == []
    assert cat.manifest_reads == 1  # the look-alikes' manifests are never read
    assert foreign_names(cat.storage) == sorted(look_alikes)
