"""Flip a bit in, truncate, or delete any file of the newest snapshot: verify reports it,
restore falls back to the previous snapshot exactly, and `rl-ckpt verify` exits 1."""

from __future__ import annotations

import json
import os

import pytest

from helpers import PPOState, assert_same_state
from rl_ckpt import CheckpointEngine, NoValidSnapshotError
from rl_ckpt.cli import main as cli


def _two_snapshots(tmp_path):
    cfg = {"base_dir": str(tmp_path), "run_name": "run"}
    s = PPOState(seed=3)
    engine = s.register(CheckpointEngine(**cfg))
    s.train(2)
    engine.save(2, metrics={"avg_reward": 1.0})
    reference = PPOState(seed=3)
    reference.register(CheckpointEngine(**cfg)).restore()  # exact copy of the state at step 2
    s.train(2)
    engine.save(4, metrics={"avg_reward": 2.0})
    return cfg, reference, tmp_path / "run" / "step_000000004"


def _files(tmp_path):
    cfg, _, newest = _two_snapshots(tmp_path / "probe")
    return sorted(p.name for p in newest.iterdir())


CORRUPTIONS = ["flip", "truncate", "delete"]


def _corrupt(path, how: str) -> None:
    if how == "delete":
        os.unlink(path)
        return
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x10
    else:
        data = data[: max(0, len(data) - 7)]
    path.write_bytes(bytes(data))


# Every file kind a snapshot of this state has: tensors, JSON structure, Arrow table, and the manifest.
FILES = [
    "policy.safetensors",
    "policy.json",
    "value.safetensors",
    "value.json",
    "optimizer.safetensors",
    "optimizer.json",
    "lr_scheduler.json",
    "rng.safetensors",
    "rng.json",
    "progress.json",
    "replay_buffer.safetensors",
    "replay_buffer.json",
    "replay_buffer.t0.arrow",
    "meta.json",
]


def test_file_list_covers_every_file(tmp_path):
    assert _files(tmp_path) == sorted(FILES)


@pytest.mark.parametrize("how", CORRUPTIONS)
@pytest.mark.parametrize("name", FILES)
def test_corruption_detected_and_restore_falls_back(tmp_path, name, how):
    cfg, reference, newest = _two_snapshots(tmp_path)
    _corrupt(newest / name, how)

    report = CheckpointEngine(**cfg).verify()
    assert not report.ok and report.bad_snapshots == ["step_000000004"], str(report)
    assert any(p.path == name for p in report.problems), str(report)

    fresh = PPOState(seed=77)
    result = fresh.register(CheckpointEngine(**cfg)).restore()
    assert result.snapshot_id == "step_000000002"
    assert "step_000000004" in result.skipped
    assert_same_state(fresh, reference)

    # A corrupt newer snapshot whose manifest reads was retired by the restore (history/retired/); one whose
    # manifest cannot be read stays for a person, and verify still reports it.
    assert cli(["verify", cfg["base_dir"] + "/run"]) == (1 if name == "meta.json" else 0)
    assert cli(["verify", cfg["base_dir"] + "/run", "step_000000002"]) == 0


def test_all_snapshots_corrupt_is_an_error_not_a_fresh_start(tmp_path):
    cfg, _, newest = _two_snapshots(tmp_path)
    _corrupt(newest / "policy.safetensors", "flip")
    _corrupt(newest.parent / "step_000000002" / "policy.safetensors", "truncate")
    with pytest.raises(NoValidSnapshotError) as err:
        PPOState().register(CheckpointEngine(**cfg)).restore()
    assert set(err.value.reasons) == {"step_000000002", "step_000000004"}


def test_manifest_with_tampered_checksum_field_is_caught(tmp_path):
    cfg, reference, newest = _two_snapshots(tmp_path)
    meta = json.loads((newest / "meta.json").read_text())
    meta["files"][0]["checksum"] = "0" * 64
    (newest / "meta.json").write_text(json.dumps(meta))
    fresh = PPOState(seed=5)
    assert fresh.register(CheckpointEngine(**cfg)).restore().snapshot_id == "step_000000002"
    assert_same_state(fresh, reference)


def test_every_bit_flip_in_the_manifest_is_refused(tmp_path):
    """Each single-bit flip of meta.json, including in the key names (``manifest_checksum`` itself), is caught:
    the manifest is never read as something else."""
    from rl_ckpt.errors import CorruptSnapshotError
    from rl_ckpt._format.manifest import Manifest

    _cfg, _reference, newest = _two_snapshots(tmp_path)
    raw = (newest / "meta.json").read_bytes()
    key_at = raw.index(b'"manifest_checksum"')
    positions = list(range(key_at, key_at + len(b'"manifest_checksum"'))) + list(range(0, len(raw), 7))
    accepted = []
    for pos in positions:
        for bit in range(8):
            data = bytearray(raw)
            data[pos] ^= 1 << bit
            try:
                Manifest.from_bytes(bytes(data), newest.name)
            except CorruptSnapshotError:
                continue
            except Exception as exc:  # noqa: BLE001 - anything else is a bug in the reader
                raise AssertionError(f"flip at byte {pos} bit {bit} raised {type(exc).__name__}: {exc}") from exc
            accepted.append((pos, bit, bytes(data[max(0, pos - 10) : pos + 10])))
    # Only flips that leave the very same JSON document (whitespace <-> whitespace) may pass.
    assert all(json.loads(bytes(_flip(raw, p, b))) == json.loads(raw) for p, b, _ in accepted), accepted[:5]


def _flip(raw: bytes, pos: int, bit: int) -> bytearray:
    data = bytearray(raw)
    data[pos] ^= 1 << bit
    return data
