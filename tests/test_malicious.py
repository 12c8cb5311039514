"""Malicious snapshots: path traversal, absolute paths, symlinks, a pickle in place of a shard,
oversized/malformed safetensors headers, bad JSON, corrupt Arrow, a future schema version.

Each is refused with a clear CheckpointError, nothing outside the snapshot is
touched, and nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
import pickle
import struct

import pytest
import torch

from rl_ckpt import CheckpointEngine, CheckpointError, NoValidSnapshotError, SchemaVersionError, UnsafePathError
from rl_ckpt._format.checksum import digest_bytes
from rl_ckpt._format.manifest import manifest_checksum
from rl_ckpt._run.snapshot_files import read_manifest
from rl_ckpt._storage import open_storage


class Payload:
    """Unpickling this creates a marker file: proof that something unpickled our data."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _setup(tmp_path):
    base = tmp_path / "ckpt"
    cfg = {"base_dir": str(base), "run_name": "run"}
    model = torch.nn.Linear(3, 2)
    engine = CheckpointEngine(**cfg)
    engine.register("policy", model)
    engine.save(1)
    snap = base / "run" / "step_000000001"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("do not touch")
    return cfg, snap, outside


def _rewrite_manifest(snap, mutate) -> None:
    meta = json.loads((snap / "meta.json").read_text())
    mutate(meta)
    meta.pop("manifest_checksum", None)
    meta["manifest_checksum"] = manifest_checksum(meta)  # an attacker recomputes it (a damage check, not a signature)
    (snap / "meta.json").write_text(json.dumps(meta))


def _set_file(meta, name, data: bytes, new_path=None):
    for f in meta["files"]:
        if f["path"] == name:
            f["size"], f["checksum"] = len(data), digest_bytes(f["algo"], data)
            if new_path:
                f["path"] = new_path


def _restore(cfg):
    engine = CheckpointEngine(**cfg)
    engine.register("policy", torch.nn.Linear(3, 2))
    return engine.restore()


def _snapshot_of_outside(outside):
    return {p.name: p.read_bytes() for p in outside.iterdir()}


@pytest.mark.parametrize(
    "bad_path", ["../../outside/secret.txt", "/etc/passwd", "a/../../x", "policy.safetensors/..", "", "a//b"]
)
def test_bad_paths_in_manifest_are_refused(tmp_path, bad_path):
    cfg, snap, outside = _setup(tmp_path)
    before = _snapshot_of_outside(outside)
    _rewrite_manifest(snap, lambda m: m["files"][0].update(path=bad_path))
    with pytest.raises(UnsafePathError):
        read_manifest(open_storage(str(snap.parent)), snap.name)
    with pytest.raises(NoValidSnapshotError) as err:
        _restore(cfg)
    assert "refused path" in str(err.value)
    assert _snapshot_of_outside(outside) == before
    report = CheckpointEngine(**cfg).verify()
    assert not report.ok


def test_symlinked_shard_is_refused(tmp_path):
    cfg, snap, outside = _setup(tmp_path)
    target = snap / "policy.safetensors"
    data = target.read_bytes()
    (outside / "shard").write_bytes(data)  # identical bytes: only the link itself is wrong
    target.unlink()
    os.symlink(outside / "shard", target)
    before = _snapshot_of_outside(outside)
    with pytest.raises(NoValidSnapshotError) as err:
        _restore(cfg)
    assert "symbolic link" in str(err.value)
    assert not CheckpointEngine(**cfg).verify().ok
    assert _snapshot_of_outside(outside) == before


def test_symlinked_snapshot_folder_is_not_listed(tmp_path):
    cfg, snap, outside = _setup(tmp_path)
    os.rename(snap, outside / "moved")
    os.symlink(outside / "moved", snap)
    assert CheckpointEngine(**cfg).snapshots() == []


def test_pickle_in_place_of_shard_is_never_unpickled(tmp_path):
    cfg, snap, outside = _setup(tmp_path)
    marker = tmp_path / "PWNED"
    payload = pickle.dumps({"weight": Payload(str(marker))})
    (snap / "policy.safetensors").write_bytes(payload)
    _rewrite_manifest(snap, lambda m: _set_file(m, "policy.safetensors", payload))  # checksum "fixed" by the attacker
    with pytest.raises(NoValidSnapshotError) as err:
        _restore(cfg)
    assert "policy.safetensors" in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    "case", ["huge-header", "header-past-end", "bad-json", "offsets-overlap", "bad-dtype", "short"]
)
def test_malformed_safetensors_is_a_clean_error(tmp_path, case):
    cfg, snap, _ = _setup(tmp_path)
    good = (snap / "policy.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8 : 8 + n])
    if case == "huge-header":
        data = struct.pack("<Q", 2**40) + good[8:]
    elif case == "header-past-end":
        data = struct.pack("<Q", len(good) + 10) + good[8:]
    elif case == "bad-json":
        data = good[:8] + b"{" * n + good[8 + n :]
    elif case == "short":
        data = b"\x01\x02"
    else:
        key = next(k for k in header if k != "__metadata__")
        if case == "offsets-overlap":
            header[key]["data_offsets"] = [0, 10**12]
        else:
            header[key]["dtype"] = "OBJ"
        blob = json.dumps(header).encode()
        data = struct.pack("<Q", len(blob)) + blob + good[8 + n :]
    (snap / "policy.safetensors").write_bytes(data)
    _rewrite_manifest(snap, lambda m: _set_file(m, "policy.safetensors", data))
    with pytest.raises(NoValidSnapshotError) as err:
        _restore(cfg)
    assert "policy.safetensors" in str(err.value)


def test_corrupt_arrow_is_a_clean_error(tmp_path):
    import pyarrow as pa

    class Buf:
        def state_dict(self):
            return {"t": pa.table({"x": [1, 2, 3]})}

        def load_state_dict(self, s):
            self.s = s

    cfg = {"base_dir": str(tmp_path), "run_name": "run"}
    e = CheckpointEngine(**cfg)
    e.register("replay_buffer", Buf())
    e.save(1)
    snap = tmp_path / "run" / "step_000000001"
    arrow = snap / "replay_buffer.t0.arrow"
    data = bytearray(arrow.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = b"\xff" * 16
    arrow.write_bytes(bytes(data))
    _rewrite_manifest(snap, lambda m: _set_file(m, "replay_buffer.t0.arrow", bytes(data)))
    e2 = CheckpointEngine(**cfg)
    e2.register("replay_buffer", Buf())
    with pytest.raises(NoValidSnapshotError):
        e2.restore()


def test_bad_manifest_json_is_a_clean_error(tmp_path):
    cfg, snap, _ = _setup(tmp_path)
    (snap / "meta.json").write_bytes(b"\x80not json{")
    with pytest.raises(NoValidSnapshotError) as err:
        _restore(cfg)
    assert "not valid JSON" in str(err.value)


@pytest.mark.parametrize("version", [2, 99, 0])
def test_unknown_schema_version_is_refused(tmp_path, version):
    cfg, snap, _ = _setup(tmp_path)
    _rewrite_manifest(snap, lambda m: m.update(schema_version=version))
    with pytest.raises(SchemaVersionError):
        read_manifest(open_storage(str(snap.parent)), snap.name)
    with pytest.raises(NoValidSnapshotError) as err:
        _restore(cfg)
    assert f"schema_version {version}" in str(err.value)


def test_every_error_is_a_checkpoint_error(tmp_path):
    import rl_ckpt.errors as errors

    for name in dir(errors):
        obj = getattr(errors, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, CheckpointError), name
    err = errors.StateMismatchError("x", component="policy", mismatches=["a"])
    clone = pickle.loads(pickle.dumps(err))  # errors cross Ray actor boundaries
    assert type(clone) is errors.StateMismatchError and clone.component == "policy" and clone.mismatches == ["a"]


def test_a_manifest_edited_without_its_checksum_updated_is_refused(tmp_path):
    cfg, snap, _ = _setup(tmp_path)
    meta = json.loads((snap / "meta.json").read_text())
    meta["global_step"] = 1  # same step, just rewritten: the recorded checksum no longer matches the bytes
    meta["tags"] = {"edited": True}
    (snap / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(NoValidSnapshotError, match="manifest checksum mismatch"):
        _restore(cfg)


# -- hostile input of every class: recovery falls back, the CLI answers in one line ---------------------------


def _two_steps(tmp_path):
    """A run with steps 1 and 2 of a Linear policy; returns (cfg, run folder, step-1 weights)."""
    cfg = {"base_dir": str(tmp_path / "ckpt"), "run_name": "run"}
    model = torch.nn.Linear(3, 2)
    engine = CheckpointEngine(**cfg)
    engine.register("policy", model)
    engine.save(1)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    engine.save(2)
    engine.close()
    return cfg, tmp_path / "ckpt" / "run", first


def _forge(snap, mutate=None, raw: dict | None = None, checksum: bool = True) -> None:
    """Rewrite a manifest as someone who can write the storage would: checksum recomputed. ``raw`` puts text
    Python's json cannot write (a 5000-digit number, nesting 100 000 deep) in place of string values."""
    from rl_ckpt.tools.fault_suite import forge_json, reseal

    meta = json.loads((snap / "meta.json").read_text())
    meta.pop("manifest_checksum")
    if mutate:
        mutate(meta)
    text = forge_json(meta, raw)
    (snap / "meta.json").write_text(reseal(text) if checksum else text)


def _falls_back_to_step_1(cfg, first) -> None:
    engine = CheckpointEngine(**cfg)
    model = torch.nn.Linear(3, 2)
    engine.register("policy", model)
    result = engine.restore()
    assert result.snapshot_id == "step_000000001"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in first.items())


def _cli_one_line(capsys, *argv) -> tuple[int, str]:
    from rl_ckpt.cli import main

    rc = main(list(argv))
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("rl-ckpt ")]
    assert "Traceback" not in captured.err and len(errors) <= 1, captured.err
    return rc, captured.out + captured.err


def _header_with(snap, change) -> None:
    shard = snap / "policy.safetensors"
    good = shard.read_bytes()
    (n,) = struct.unpack("<Q", good[:8])
    text = change(json.loads(good[8 : 8 + n]), good[8 + n :])
    blob = text.encode() + b" " * (-(len(text) + 8) % 8)
    data = struct.pack("<Q", len(blob)) + blob + good[8 + n :]
    shard.write_bytes(data)
    _forge(snap, lambda m: _set_file(m, "policy.safetensors", data))


def _deep_metadata(header, data):
    return json.dumps({**header, "__metadata__": "@"}).replace('"@"', "[" * 100000 + "]" * 100000)


def _huge_offset(header, data):
    header["weight"]["data_offsets"][1] = "@"
    return json.dumps(header).replace('"@"', "9" * 5000)


def _overflowing_shape(header, data):  # no bytes, so only the shape can be wrong: torch.empty raised TypeError
    header["empty"] = {"dtype": "F32", "shape": [0, 2**64], "data_offsets": [len(data), len(data)]}
    return json.dumps(header)


@pytest.mark.parametrize("change", [_deep_metadata, _huge_offset, _overflowing_shape])
def test_hostile_safetensors_header_falls_back(tmp_path, capsys, change):
    cfg, run, first = _two_steps(tmp_path)
    _header_with(run / "step_000000002", change)
    # The CLI first: the restore below retires the refused newer snapshot (history/retired/).
    rc, out = _cli_one_line(
        capsys, "export", str(run), "step_000000002", "policy", "-o", str(tmp_path / "x.safetensors")
    )
    assert rc == 1 and "policy.safetensors" in out
    engine = CheckpointEngine(**cfg)
    engine.register("policy", torch.nn.Linear(3, 2))
    result = engine.restore()
    assert "policy.safetensors" in result.skipped["step_000000002"] and result.retired == ["step_000000002"]
    _falls_back_to_step_1(cfg, first)


MANIFEST_CASES = {
    "5000-digit global_step": (lambda m: m.update(global_step="@"), {"@": "9" * 5000}, "not valid JSON"),
    "20-digit global_step": (lambda m: m.update(global_step=10**19), None, "global_step must be an integer"),
    "tags: 5": (lambda m: m.update(tags=5), None, "tags must be an object"),
    "a component that is not an object": (lambda m: m["components"].update(policy=[1]), None, "components.policy"),
    "a file whose role is a list": (lambda m: m["files"][0].update(role=["json"]), None, "files[0].role"),
    "a file size of -1": (lambda m: m["files"][0].update(size=-1), None, "files[0].size"),
    "a probe that is not an object": (lambda m: m["extra"]["probes"].update(policy=5), None, "extra.probes.policy"),
    "an unknown checksum algorithm": (lambda m: m["files"][0].update(algo="md5"), None, "files[0].algo"),
    "a tensor dtype that is an object": (
        lambda m: m["components"]["policy"]["tensors"]["weight"].update(dtype={}),
        None,
        "dtype",
    ),
    "tags nested 100000 deep": (lambda m: m.update(tags="@"), {"@": "[" * 100000 + "]" * 100000}, "not valid JSON"),
    "tags nested 70 deep": (lambda m: m.update(tags={"x": "@"}), {"@": "[" * 70 + "]" * 70}, "nested more than"),
    "a light snapshot without a base": (lambda m: m.update(kind="light"), None, "base_snapshot_id"),
    "a snapshot_id in Arabic-Indic digits": (
        lambda m: m.update(snapshot_id="step_" + "\u0660" * 8 + "\u0662"),
        None,
        "not a snapshot name",
    ),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_hostile_manifest_falls_back_and_the_cli_answers(tmp_path, capsys, case):
    mutate, raw, reason = MANIFEST_CASES[case]
    cfg, run, first = _two_steps(tmp_path)
    _forge(run / "step_000000002", mutate, raw)
    engine = CheckpointEngine(**cfg)
    assert [i.snapshot_id for i in engine.snapshots()] == ["step_000000001"]
    assert [u.snapshot_id for u in engine.catalog.unreadable()] == ["step_000000002"]
    assert reason in engine.catalog.unreadable()[0].reason
    _falls_back_to_step_1(cfg, first)
    for argv, want in (
        (["ls"], 1),
        (["verify"], 1),
        (["plan"], 0),
        (["inspect", "step_000000002"], 1),
        (["export", "step_000000002", "policy", "-o", str(tmp_path / "x")], 1),
    ):
        rc, out = _cli_one_line(capsys, argv[0], str(run), *argv[1:])
        assert rc == want, (argv, out)
        assert "step_000000002" in out
    rc, out = _cli_one_line(capsys, "plan", str(run))
    assert "target:    step_000000001" in out


def test_a_manifest_without_its_checksum_is_refused(tmp_path):
    cfg, run, first = _two_steps(tmp_path)
    _forge(run / "step_000000002", checksum=False)  # otherwise untouched: the key alone is missing
    with pytest.raises(CheckpointError, match="no manifest_checksum"):
        read_manifest(open_storage(str(run)), "step_000000002")
    _falls_back_to_step_1(cfg, first)


@pytest.mark.parametrize("size", [2**30, 2**36])  # a sparse 1 GiB and 64 GiB manifest
def test_manifest_size_is_checked_before_reading(tmp_path, size):
    from rl_ckpt._storage import LocalStorage

    class Recording(LocalStorage):
        reads: list = []

        def read(self, path, **kw):
            self.reads.append(path)
            return super().read(path, **kw)

    cfg, run, first = _two_steps(tmp_path)
    os.truncate(run / "step_000000002" / "meta.json", size)
    storage = Recording(str(run))
    engine = CheckpointEngine(**cfg, storage=storage)
    model = torch.nn.Linear(3, 2)
    engine.register("policy", model)
    assert engine.restore().snapshot_id == "step_000000001"
    assert "more than the" in engine.catalog.unreadable()[0].reason
    assert "step_000000002/meta.json" not in storage.reads
    with pytest.raises(CheckpointError, match="more than the"):
        read_manifest(storage, "step_000000002")
    assert "step_000000002/meta.json" not in storage.reads


FOREIGN = [
    "step_0000000003",
    "step_" + "\u0660" * 8 + "\u0663",
    "step_" + "\uff10" * 8 + "\uff13",
    "step_000000003\n",
    "step_000000003.b0",
    "step_000000003.b01",
    "step_000000003.light\n",
    "step_00000003",
]


def test_only_canonical_names_are_snapshots():
    from rl_ckpt._format.manifest import parse_snapshot_id, snapshot_id

    for name in FOREIGN + [
        "step_000000003.b1.light.light",
        "STEP_000000003",
        "step_" + "9" * 5000,
        "step_000000003.b" + "1" * 5000,
    ]:
        assert parse_snapshot_id(name) is None, repr(name)
    for step, branch, kind in [(3, 0, "full"), (3, 2, "light"), (10**12, 0, "full"), (0, 1, "full")]:
        assert parse_snapshot_id(snapshot_id(step, kind, branch)) == (step, branch, kind)


def test_non_canonical_folders_are_never_listed_restored_or_collected(tmp_path, capsys):
    import shutil

    cfg, run, first = _two_steps(tmp_path)
    for name in FOREIGN:  # copies of step 2 whose manifests claim to be step 3: newer, if they were believed
        shutil.copytree(run / "step_000000002", run / name)
        _forge(run / name, lambda m: m.update(snapshot_id="step_000000003", global_step=3))
    engine = CheckpointEngine(**cfg)
    model = torch.nn.Linear(3, 2)
    engine.register("policy", model)
    assert [i.snapshot_id for i in engine.snapshots()] == ["step_000000001", "step_000000002"]
    assert engine.restore().snapshot_id == "step_000000002"
    rc, out = _cli_one_line(capsys, "ls", str(run))
    assert rc == 0 and "FOREIGN" not in out
    rc, out = _cli_one_line(capsys, "ls", str(run), "--deep")
    assert rc == 1 and out.count("FOREIGN") == len(FOREIGN)
    rc, out = _cli_one_line(capsys, "inspect", str(run), "step_000000003\n")
    assert rc == 2 and "not a snapshot id" in out
    assert _cli_one_line(capsys, "gc", str(run), "--grace", "0")[0] == 0
    assert all((run / name).is_dir() for name in FOREIGN)


@pytest.mark.parametrize(
    "body",
    [
        "[" * 100000 + "]" * 100000,
        '{"version": 1, "action": "' + "9" * 5000 + '"}',
        '{"version": 1, "step": ' + "9" * 5000 + "}",
        "[1, 2]",
        '"x"',
        "5",
        '{"version": 1, "action": "restore", "snapshot_id": [1], "global_step": 2, '
        '"failure": {"version": 1, "kind": "exception"}, "charged_to": [2]}',
    ],
)
def test_run_records_are_parsed_as_untrusted(tmp_path, capsys, body):
    cfg, run, first = _two_steps(tmp_path)
    for folder, name in (
        ("decisions", "2026-01-01T000000p0000-restore.json"),
        ("failures", "x.json"),
        ("history/retired", "step_000000000.json"),
        ("best", "avg_reward.json"),
    ):
        (run / folder).mkdir(parents=True, exist_ok=True)
        (run / folder / name).write_text(body)
    engine = CheckpointEngine(**cfg)
    engine.register("policy", torch.nn.Linear(3, 2))
    assert engine.decisions() == []
    assert engine.restore().snapshot_id == "step_000000002"
    from rl_ckpt._timeline import load

    assert [s["id"] for s in load(open_storage(str(run)))["snapshots"]] == ["step_000000001", "step_000000002"]
    assert _cli_one_line(capsys, "plan", str(run), "--failure", "exception", "--step", "3")[0] == 0
    # a planted quarantine record fences its snapshot (the safe reading), never crashes
    (run / "quarantine").mkdir()
    (run / "quarantine" / "step_000000002.json").write_text(body)
    _falls_back_to_step_1(cfg, first)


def test_untrusted_json_helpers():
    from rl_ckpt._format.untrusted import depth, parse_json

    for bad in (b"[" * 100000 + b"]" * 100000, b"9" * 5000, b"\xff{", b"{"):
        with pytest.raises(CheckpointError, match="where.json: not valid JSON"):
            parse_json(bad, "where.json")
    assert parse_json(b'{"a": [1]}', "x") == {"a": [1]}
    assert depth({"a": [1, {"b": []}]}) == 4 and depth(5) == 0
    assert depth(json.loads("[" * 500 + "]" * 500)) == 65  # stops counting past the limit


@pytest.mark.parametrize("body", [b"[1, 2]", b'{"snapshot_id": 5}', b"[" * 5000, b"1" * 5000])
def test_planted_best_alias_never_fails_a_save(tmp_path, body):
    """A best/ pointer someone else wrote is only a hint: saves go on and the alias is rewritten."""
    eng = CheckpointEngine(base_dir=str(tmp_path), run_name="r", keep_best=1, keep_latest=1, post_load_check=False)
    w = torch.nn.Linear(2, 2)
    eng.register("model", w)
    eng.save(1, metrics={"avg_reward": 1.0})
    (tmp_path / "r" / "best" / "avg_reward.json").write_bytes(body)
    info = eng.save(2, metrics={"avg_reward": 2.0})
    assert not info.warnings
    assert eng.best().global_step == 2
    assert json.loads((tmp_path / "r" / "best" / "avg_reward.json").read_bytes())["snapshot_id"] == info.snapshot_id
    eng.close()
