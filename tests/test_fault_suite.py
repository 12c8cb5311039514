"""The fault-injection suite (rl_ckpt.tools.fault_suite) and the power-loss model
(rl_ckpt.tools.faults.PowerLossStorage).

``test_quick_suite_*`` run ``python -m rl_ckpt.tools.fault_suite --quick --json`` once (in a subprocess:
its own forkserver with its own preloads, its own moto S3 endpoint, and the real entry point) and
assert every invariant figure.

The bugs the suite found (docs/reliability.md, "Findings") each have a small regression test
below (``test_regression_*``); they were strict xfail tests until the fixes landed. If the suite
finds a new bug, pin it the same way: a strict xfail test naming the file and function; the figure
tests below then fail until it is fixed.
"""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys

import pytest

from rl_ckpt import CheckpointEngine
from rl_ckpt.errors import StorageError, UnsafePathError
from rl_ckpt.tools.fault_suite import (
    MALICIOUS,
    PROFILES,
    SCENARIOS,
    ScenarioResult,
    SuiteReport,
    build,
    engine_cfg,
    machine_info,
    observed,
    op_phases,
    run_url,
    save_step,
)
from rl_ckpt.tools.faults import FaultyStorage, PowerCut, PowerLossStorage

pytestmark = pytest.mark.slow  # the quick fault suite runs once for the module (~3.5 min)

# -- the quick suite ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("fault-suite")
    proc = subprocess.run(
        [sys.executable, "-m", "rl_ckpt.tools.fault_suite", "--quick", "--json", "-q", "--base-dir", str(base)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    report["returncode"] = proc.returncode
    return report


def _scenario(report: dict, key: str) -> dict:
    return next(s for s in report["scenarios"] if s["key"] == key)


def test_quick_suite_runs_every_scenario_and_exit_status_matches(quick):
    assert [s["key"] for s in quick["scenarios"]] == list(SCENARIOS)
    assert quick["machine"]["cpus"] == os.cpu_count()
    assert (quick["returncode"] == 0) == quick["ok"] == (quick["totals"]["violations"] == 0)
    for s in quick["scenarios"]:
        assert s["tried"] > 0 and s["faults_injected"] > 0, s["key"]


def test_quick_suite_has_no_violation(quick):
    violations = [v for s in quick["scenarios"] for v in s["violations"]]
    assert not violations, "\n".join(
        f"[{v['scenario']} {v['variant']}] {v['case']}: {v['kind']}: {v['message']}" for v in violations[:20]
    )


@pytest.mark.parametrize(
    "figure,kind",
    [
        ("corrupt_loads", "corrupt_load"),
        ("acked_lost", "acked_lost"),
        ("escapes", "escape"),
        ("broken_listed", "broken_listed"),
    ],
)
def test_quick_suite_invariant_figures(quick, figure, kind):
    # every increment of a figure comes with a violation of that kind: none
    for s in quick["scenarios"]:
        assert s[figure] == 0, (s["key"], figure, s[figure])
        assert not [v for v in s["violations"] if v["kind"] == kind], (s["key"], kind)


def test_quick_suite_sigkill_figures(quick):
    s = _scenario(quick, "sigkill")
    assert s["ok"], s["violations"][:5]
    assert s["injected"]["SIGKILL before op"] >= 80  # every operation of 4 variants' saves
    assert s["injected"]["SIGKILL after op"] >= 30
    assert s["injected"]["SIGKILL at a random moment"] == PROFILES["quick"].random_kills
    assert s["max_rolled_back"] <= 1  # only the save in flight is ever lost
    assert s["notes"]["random kills after at least one acknowledged save"] >= 5  # not all in a child's first save
    for phase in ("write", "commit", "after-commit"):
        assert s["notes"][f"kill points in phase {phase}"] > 0


def test_quick_suite_power_cuts_cover_every_operation(quick):
    s = _scenario(quick, "power")
    assert s["injected"]["power cut after the save returned"] == 8  # 4 variants x first/third save
    assert s["injected"]["power cut before op"] >= 150
    assert s["ok"], s["violations"][:5]


def test_quick_suite_corruption_detected_equals_injected(quick):
    s = _scenario(quick, "corruption")
    assert s["ok"], s["violations"][:5]
    assert s["corruptions_injected"] >= 80
    assert s["corruptions_detected"] == s["corruptions_injected"]
    for kind in ("safetensors shard", "JSON", "Arrow table", "manifest", "dedup object", "dedup object (shared)"):
        detected, injected = map(int, s["notes"][f"{kind} detected"].split("/"))
        assert detected == injected and injected > 0, kind
    assert s["notes"]["manifest bit flips"] >= 48
    outcomes = (
        "caught by verify",
        "caught by restore only",
        "restore refused, no fallback",
        "unnoticed, load unaffected",
        "corrupt load",
    )
    assert sum(s["notes"][f"manifest flips {o}"] for o in outcomes) == s["notes"]["manifest bit flips"]
    assert s["notes"]["manifest flips corrupt load"] == 0


def test_quick_suite_errors_surface_as_checkpoint_errors_naming_a_path(quick):
    for key in ("errors", "s3"):
        s = _scenario(quick, key)
        assert s["ok"], s["violations"][:5]
        assert s["max_rolled_back"] <= 1
    errors = _scenario(quick, "errors")
    for name in ("ENOSPC", "EIO", "ETIMEDOUT"):
        assert errors["injected"][f"{name} (before the call)"] > 20
    assert errors["notes"]["faults in gc"] > 10
    for phase in ("write", "commit", "after-commit"):
        assert errors["notes"][f"faults in phase {phase}"] > 0
    assert sum(_scenario(quick, "s3")["injected"].values()) >= 10


def test_quick_suite_concurrent_writers_exactly_one_commits(quick):
    s = _scenario(quick, "concurrent")
    assert s["ok"], s["violations"][:5]
    for backend in ("local/rename", "local/manifest-last", "s3"):
        races = s["notes"][f"{backend}: races"]
        assert races == len(PROFILES["quick"].race_writers) * PROFILES["quick"].race_rounds
        assert s["notes"][f"{backend}: exactly one committed"] == races
        assert s["notes"][f"{backend}: losers got CommitConflictError"] == sum(PROFILES["quick"].race_writers) - races


def test_quick_suite_malicious_inputs_all_refused(quick):
    s = _scenario(quick, "malicious")
    assert s["ok"], s["violations"][:5]
    assert s["notes"].get("refused with a CheckpointError", 0) + s["notes"].get("refused: never listed", 0) == len(
        MALICIOUS
    )
    generated = s["tried"] - len(MALICIOUS)
    for family in ("wrong JSON type", "nesting depth", "number size", "non-canonical name"):
        assert s["injected"][family] > 0, family
    assert generated == sum(
        s["injected"][f] for f in ("wrong JSON type", "nesting depth", "number size", "non-canonical name")
    )
    # every generated case either made restore fall back or was loaded exactly (a field the core ignores)
    assert (
        s["notes"]["refused: restore fell back to step 1"] + s["notes"]["harmless: step 2 loaded exactly"] == generated
    )
    assert s["notes"]["refused: restore fell back to step 1"] > generated / 2


def test_quick_suite_sharded_kills_and_damaged_chunks(quick):
    # 2-rank FSDP2 saves: one rank SIGKILLed before its storage calls (writing, the commit, after it), and
    # damaged chunks of a committed sharded snapshot, each detected and rolled back on both ranks together.
    s = _scenario(quick, "sharded")
    assert s["ok"], s["violations"][:5]
    assert s["injected"]["SIGKILL of rank 0 before a storage call"] >= 5
    assert s["injected"]["SIGKILL of rank 1 before a storage call"] >= 3
    for phase in ("write", "commit", "after-commit"):
        assert s["notes"][f"rank 0 kill points in phase {phase}"] > 0
    assert s["notes"]["rank 1 kill points in phase write"] > 0
    assert s["max_rolled_back"] <= 1
    assert s["injected"]["flip in a rank's chunk"] == 4 and s["injected"]["truncate in a rank's chunk"] >= 1
    assert s["corruptions_detected"] == s["corruptions_injected"] >= 5


def test_hostile_cases_cover_every_manifest_field():
    from rl_ckpt.tools.fault_suite import HOSTILE_TYPES, hostile_cases, json_paths

    meta = {"global_step": 2, "tags": {"a": "b"}, "files": [{"size": 1, "role": "json"}]}
    every = [c for c in hostile_cases({False: meta}, None) if c.family == "wrong JSON type" and "/" not in c.name]
    fields = {c.name.split(" = ")[0] for c in every}
    assert fields == {"global_step", "tags", "tags.a", "files", "files[0]", "files[0].size", "files[0].role"}
    assert len(json_paths(meta)) == len(fields)
    # all but the in-range int 7
    assert sum(c.name.startswith("global_step = ") for c in every) == len(HOSTILE_TYPES) - 1
    rotated = [c for c in hostile_cases({False: meta}, 2) if c.family == "wrong JSON type" and "/" not in c.name]
    assert len(rotated) == 2 * len(fields)


def test_cli_exit_status_and_table(tmp_path, capsys):
    from rl_ckpt.tools.fault_suite import main

    assert main(["--quick", "--only", "concurrent", "-q", "--base-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| concurrent" in out and "| TOTAL" in out and "OK: quick suite" in out
    assert os.listdir(tmp_path) == []  # nothing failed: the working folder is gone


def test_report_table_flags_violations():
    res = ScenarioResult("x", "x", tried=2)
    res.violate("v", "case", "corrupt_load", "boom")
    report = SuiteReport("quick", "now", machine_info(), [res], 1.0)
    assert not report.ok and report.totals()["corrupt_loads"] == 1
    assert "VIOLATIONS (1)" in report.table() and "FAILED" in report.table()
    assert json.loads(json.dumps(report.to_json()))["scenarios"][0]["violations"][0]["kind"] == "corrupt_load"


def test_op_phases():
    ops = [
        ("exists", "step_000000003/meta.json"),
        ("write", ".staging/x/a"),
        ("write", ".staging/x/meta.json"),
        ("rename_dir", ".staging/x -> step_000000003"),
        ("sync_dir", ""),
        ("sync_dir", ".staging"),
        ("rename_dir", "step_000000001 -> .trash/step_000000001.y"),
        ("sync_dir", ""),
    ]
    assert op_phases(ops) == ["write"] * 3 + ["commit"] * 3 + ["after-commit"] * 2
    ml = [
        ("makedirs", "step_000000003/a"),
        ("write", "step_000000003/a/x"),
        ("write", "step_000000003/meta.json"),
        ("sync_dir", "step_000000003"),
        ("exists", "best/avg_reward.json"),
    ]
    assert op_phases(ml) == ["write", "write", "commit", "commit", "after-commit"]


# -- regression tests for the bugs the suite found (fixed in their modules; docs/reliability.md) -----


def _save_then_cut(tmp_path, *, dedup: bool, atomic_write: bool, prior: tuple[int, ...]) -> tuple[dict, int]:
    cfg = engine_cfg(str(tmp_path), dedup=dedup, atomic_write=atomic_write)
    os.makedirs(run_url(cfg))
    engine, model, buf = build(cfg)
    for step in prior:
        save_step(engine, model, buf, step)
    storage = PowerLossStorage(run_url(cfg))
    engine, model, buf = build(cfg, storage)
    step = (max(prior) if prior else 0) + 1
    save_step(engine, model, buf, step)  # acknowledged
    storage.power_cut()
    return cfg, step


def _assert_survived(cfg: dict, step: int) -> None:
    engine, model, buf = build(cfg)
    assert step in [i.global_step for i in engine.snapshots()], "the acknowledged snapshot is gone"
    report = engine.verify()
    assert report.ok, str(report)
    assert engine.restore().global_step == step and observed(model, buf)[0] == step


def test_regression_power_cut_keeps_the_dedup_objects_of_an_acknowledged_save(tmp_path):
    """Finding 1, storage/local.py:LocalStorage.makedirs: new folders are fsynced into their parent."""
    cfg, step = _save_then_cut(tmp_path, dedup=True, atomic_write=True, prior=(1, 2))
    _assert_survived(cfg, step)


def test_regression_power_cut_keeps_an_acknowledged_manifest_last_snapshot_whole(tmp_path):
    """Finding 2, commit.py:ManifestLastCommit.commit: the data folder is fsynced before the manifest."""
    # retention syncs the run folder
    cfg, step = _save_then_cut(tmp_path, dedup=False, atomic_write=False, prior=(1, 2))
    _assert_survived(cfg, step)


def test_regression_power_cut_keeps_the_first_manifest_last_snapshot(tmp_path):
    """Findings 1 + 2: the first manifest-last save of a run survives a power cut."""
    cfg, step = _save_then_cut(tmp_path, dedup=False, atomic_write=False, prior=())
    _assert_survived(cfg, step)


def test_regression_dedup_rewrites_an_object_that_rotted(tmp_path):
    """Finding 3, dedup.py:ObjectWriter.put: a reused object is checked, and rewritten if it rotted."""
    cfg = engine_cfg(str(tmp_path), dedup=True)
    engine, model, buf = build(cfg)
    save_step(engine, model, buf, 1)
    from rl_ckpt._run.dedup import object_path
    from rl_ckpt._run.snapshot_files import read_manifest
    from rl_ckpt._storage import open_storage

    section = read_manifest(open_storage(run_url(cfg)), "step_000000001").components["model"]
    ((digest, _size),) = section["objects"]["frozen"]  # the same in every snapshot: one shared object
    path = os.path.join(run_url(cfg), *object_path(section["objects_algo"], digest).split("/"))
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10  # bit rot after commit
    open(path, "wb").write(bytes(data))
    save_step(engine, model, buf, 2)  # returns: acknowledged
    report = CheckpointEngine(**cfg).verify("step_000000002")
    assert report.ok, str(report)


def _two_saves_then_flip(tmp_path, needle: bytes, offset: int, expected: bytes) -> dict:
    """Save steps 1 and 2, then flip the lowest bit of the byte ``offset`` past ``needle`` in step 2's manifest."""
    cfg = engine_cfg(str(tmp_path))
    engine, model, buf = build(cfg)
    for step in (1, 2):
        save_step(engine, model, buf, step)
    path = os.path.join(run_url(cfg), "step_000000002", "meta.json")
    data = bytearray(open(path, "rb").read())
    at = data.find(needle) + offset
    assert data[at : at + 1] == expected
    data[at] ^= 0x01
    open(path, "wb").write(bytes(data))
    return cfg


def test_regression_flip_in_manifest_global_step_is_detected(tmp_path):
    """Finding 4, reader.py:read_manifest + the manifest checksum: a wrong step is never restored."""
    cfg = _two_saves_then_flip(tmp_path, b'"global_step": ', len(b'"global_step": '), b"2")  # "2" -> "3"
    engine, model, buf = build(cfg)
    assert not engine.verify().ok
    result = engine.restore()
    assert result.global_step == observed(model, buf)[0]


def test_regression_flip_in_a_manifest_key_falls_back(tmp_path):
    """Finding 4, manifest.py: a flipped key name is caught by the manifest checksum; restore falls back."""
    cfg = _two_saves_then_flip(tmp_path, b'"components"', 8, b"n")  # "components" -> "componeots"
    engine, model, buf = build(cfg)
    assert not engine.verify().ok
    assert engine.restore().global_step == 1 and observed(model, buf)[0] == 1


# -- PowerLossStorage -----------------------------------------------------------------------------


@pytest.fixture
def disk(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    storage = PowerLossStorage(str(root), journal_dir=str(tmp_path / "journal"))
    yield storage, root
    storage.close()


def _tree(root) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.relpath(os.path.join(dirpath, name), root) + "/"] = None
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                out[os.path.relpath(os.path.join(dirpath, name), root)] = f.read()
    return out


def test_power_loss_new_names_need_a_folder_fsync(disk):
    storage, root = disk
    storage.write("synced.bin", [b"a" * 10])
    storage.sync_dir("")
    storage.write("unsynced.bin", [b"b" * 10])  # data fsynced, the name not
    assert storage.pending == ["create unsynced.bin"]
    undone = storage.power_cut()
    assert undone == ["create unsynced.bin"]
    assert _tree(root) == {"synced.bin": b"a" * 10}


def test_power_loss_after_a_batched_publish_loses_nothing(disk):
    """write_many_atomic fsyncs data before each rename and each folder after: a cut right after it
    keeps every file; a batch that failed half way leaves each name complete or absent."""
    storage, root = disk
    storage.makedirs("objects/aa")
    storage.makedirs("objects/bb")
    storage.write_many_atomic([("objects/aa/x", b"x" * 100), ("objects/bb/y", b"y" * 5000)])
    assert storage.pending == []
    storage.power_cut()
    assert _tree(root) == {
        "objects/": None,
        "objects/aa/": None,
        "objects/bb/": None,
        "objects/aa/x": b"x" * 100,
        "objects/bb/y": b"y" * 5000,
    }
    storage.restart()
    with pytest.raises(StorageError):  # the second file's folder is missing: nothing half-written stays
        storage.write_many_atomic([("objects/aa/z", b"z" * 10), ("objects/cc/w", b"w")])
    tree = _tree(root)
    assert tree.get("objects/aa/z", b"z" * 10) == b"z" * 10 and "objects/cc/w" not in tree
    assert not [p for p in tree if ".tmp-" in p]


def test_power_loss_unsynced_data_is_lost_even_when_the_name_survives(disk):
    storage, root = disk
    storage.write("f.bin", [b"old"])
    storage.sync_dir("")
    storage.write("f.bin", [b"new data"], durable=False)  # overwritten, never fsynced
    storage.write("g.bin", [b"x"], durable=False)
    storage.sync_dir("")  # the names are durable now, the data of both is not
    storage.power_cut()
    assert _tree(root) == {"f.bin": b"", "g.bin": b""}


def test_power_loss_unsynced_folder_takes_its_content_along(disk, monkeypatch):
    from rl_ckpt._storage import LocalStorage

    # the model, whatever LocalStorage.makedirs itself fsyncs: a plain mkdir that syncs nothing
    monkeypatch.setattr(LocalStorage, "makedirs", lambda self, path: os.makedirs(self._abs(path), exist_ok=True))
    storage, root = disk
    storage.makedirs("a/b")
    storage.write("a/b/x", [b"1"])
    storage.sync_dir("a/b")  # x is durable in b, but b's and a's own names are not
    storage.power_cut()
    assert _tree(root) == {}
    storage.restart()
    storage.makedirs("a/b")
    storage.sync_dir("")
    storage.sync_dir("a")
    storage.write("a/b/x", [b"1"])
    storage.sync_dir("a/b")
    assert storage.pending == []
    storage.power_cut()
    assert _tree(root) == {"a/": None, "a/b/": None, "a/b/x": b"1"}


def test_power_loss_rename_rolls_back_and_follows_the_folder(disk):
    storage, root = disk
    storage.makedirs("stage/s1")
    storage.sync_dir("")
    storage.sync_dir("stage")
    storage.write("stage/s1/data", [b"d"])
    storage.sync_dir("stage/s1")
    storage.rename_dir("stage/s1", "snap")  # not yet durable: neither folder fsynced
    storage.write("snap/late", [b"l"])  # a file created in the renamed folder (unsynced)
    assert storage.pending == ["rename stage/s1 -> snap", "create snap/late"]
    storage.power_cut()
    assert _tree(root) == {"stage/": None, "stage/s1/": None, "stage/s1/data": b"d"}


def test_power_loss_rename_durable_once_the_new_parent_is_synced(disk):
    storage, root = disk
    storage.makedirs("stage/s1")
    for folder in ("", "stage"):
        storage.sync_dir(folder)
    storage.write("stage/s1/data", [b"d"])
    storage.sync_dir("stage/s1")
    storage.rename_dir("stage/s1", "snap")
    storage.sync_dir("")  # the new name is on disk
    storage.power_cut()
    assert _tree(root) == {"stage/": None, "snap/": None, "snap/data": b"d"}


def test_power_loss_rename_with_only_the_old_parent_synced_loses_the_folder(disk):
    storage, root = disk
    storage.makedirs("s1")
    storage.makedirs("trash")
    storage.sync_dir("")
    storage.write("s1/f", [b"f"])
    storage.sync_dir("s1")
    storage.rename_dir("s1", "trash/s1")
    storage.sync_dir("")  # gone from the run folder for good; trash/ never fsynced
    storage.power_cut()
    assert _tree(root) == {"trash/": None}


def test_power_loss_unsynced_removal_comes_back(disk):
    storage, root = disk
    storage.makedirs("d")
    storage.write("d/f", [b"f"])
    storage.write("g", [b"g"])
    storage.sync_dir("")
    storage.sync_dir("d")
    storage.remove_tree("d")
    storage.remove("g")
    assert not (root / "d").exists() and not (root / "g").exists()
    storage.power_cut()
    assert _tree(root) == {"d/": None, "d/f": b"f", "g": b"g"}
    storage.restart()
    storage.remove("g")
    storage.sync_dir("")
    storage.power_cut()
    assert "g" not in _tree(root)


def test_power_loss_write_atomic_and_create_only_are_durable_by_their_own_fsync(disk):
    storage, root = disk
    storage.write("a.json", [b"v1"])
    storage.sync_dir("")
    storage.write_atomic("a.json", b"v2")  # temp + fsync + rename + folder fsync inside LocalStorage
    storage.write("m.json", [b"manifest"], create_only=True)  # link + folder fsync inside LocalStorage
    assert storage.pending == []
    storage.power_cut()
    assert _tree(root) == {"a.json": b"v2", "m.json": b"manifest"}


def test_power_loss_halts_until_restart_and_mixes_with_rng(disk):
    storage, root = disk
    storage.power_cut()
    with pytest.raises(PowerCut):
        storage.write("x", [b"x"])
    with pytest.raises(PowerCut):
        storage.list("")
    storage.restart()
    for name in "abcdefgh":
        storage.write(name, [name.encode()])
    storage.power_cut(random.Random(1), keep_probability=1.0, halt=False)  # every effect happened to land
    assert len(_tree(root)) == 8
    for name in "ijklmnop":
        storage.write(name, [name.encode()])
    kept = 8 + (8 - len(storage.power_cut(random.Random(3))))
    assert len(_tree(root)) == kept and 8 < kept < 16


def test_power_loss_refuses_what_local_storage_refuses(disk, tmp_path):
    storage, root = disk
    (tmp_path / "outside").write_text("x")
    with pytest.raises(UnsafePathError):
        storage.write("../outside", [b"y"])
    with pytest.raises(UnsafePathError):
        storage.remove_tree("../outside")
    os.symlink(tmp_path / "outside", root / "link")
    with pytest.raises(UnsafePathError):
        storage.write("link/x", [b"y"])
    assert (tmp_path / "outside").read_text() == "x" and storage.pending == []


def test_power_loss_under_a_real_save_staged_rename_survives(tmp_path):
    cfg, step = _save_then_cut(tmp_path, dedup=False, atomic_write=True, prior=(1, 2))
    _assert_survived(cfg, step)


def test_power_loss_mid_save_never_lists_a_partial_snapshot(tmp_path):
    cfg = engine_cfg(str(tmp_path))
    os.makedirs(run_url(cfg))
    engine, model, buf = build(cfg)
    save_step(engine, model, buf, 1)
    storage = PowerLossStorage(run_url(cfg))
    faulty = FaultyStorage(storage)
    engine, model, buf = build(cfg, faulty)
    engine.catalog.refresh()

    def cut() -> None:
        storage.power_cut()
        raise PowerCut("cut")

    faulty.before("rename_dir", cut)  # right at the commit
    with pytest.raises(PowerCut):
        save_step(engine, model, buf, 2)
    engine, model, buf = build(cfg)
    assert [i.global_step for i in engine.snapshots()] == [1] and engine.verify().ok


# -- FaultyStorage additions -----------------------------------------------------------------------


def test_faulty_storage_any_operation_and_root_errors_name_the_folder(tmp_path):
    from rl_ckpt._storage import LocalStorage

    seen = []
    storage = FaultyStorage(LocalStorage(str(tmp_path)))
    storage.before("*", lambda: seen.append(storage.ops[-1][0]), nth=3)
    storage.makedirs("a")
    storage.write("a/x", [b"x"])
    storage.sync_dir("a")
    assert seen == ["sync_dir"]
    storage.fail("sync_dir", error=errno.EIO)
    with pytest.raises(StorageError) as err:
        storage.sync_dir("")
    assert err.value.path == "." and err.value.errno == errno.EIO
    with pytest.raises(ValueError):
        storage.fail("rename", error=errno.EIO)
