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
from rl_ckpt.checksum import digest_bytes
from rl_ckpt.manifest import manifest_checksum
from rl_ckpt.reader import read_manifest
from rl_ckpt.storage import open_storage


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


@pytest.mark.parametrize("bad_path", ["../../outside/secret.txt", "/etc/passwd", "a/../../x", "policy.safetensors/..", "", "a//b"])
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


@pytest.mark.parametrize("case", ["huge-header", "header-past-end", "bad-json", "offsets-overlap", "bad-dtype", "short"])
def test_malformed_safetensors_is_a_clean_error(tmp_path, case):
    cfg, snap, _ = _setup(tmp_path)
    good = (snap / "policy.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8:8 + n])
    if case == "huge-header":
        data = struct.pack("<Q", 2**40) + good[8:]
    elif case == "header-past-end":
        data = struct.pack("<Q", len(good) + 10) + good[8:]
    elif case == "bad-json":
        data = good[:8] + b"{" * n + good[8 + n:]
    elif case == "short":
        data = b"\x01\x02"
    else:
        key = next(k for k in header if k != "__metadata__")
        if case == "offsets-overlap":
            header[key]["data_offsets"] = [0, 10**12]
        else:
            header[key]["dtype"] = "OBJ"
        blob = json.dumps(header).encode()
        data = struct.pack("<Q", len(blob)) + blob + good[8 + n:]
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
    data[len(data) // 2: len(data) // 2 + 16] = b"\xff" * 16
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
