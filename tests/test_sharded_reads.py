"""How a sharded restore reads: one request per (rank, stored file), every block still verified before use.

In one process (no torch.distributed): a ``ShardedState`` over a plain module is saved by "rank 0" of one; DCP's
load plan then holds one read item per tensor, all in the same stored file.
"""

from __future__ import annotations

import pytest
import torch

from rl_ckpt import CheckpointEngine
from rl_ckpt.errors import NoValidSnapshotError
from rl_ckpt._sharded import ShardedState
from rl_ckpt._sharded.dcp_reader import ChunkReader
from rl_ckpt._sharded.layout import Layout
from rl_ckpt._run.snapshot_files import read_manifest
from rl_ckpt._storage import LocalStorage


class Counting(LocalStorage):
    """Counts the read requests per file (a ``read_ranges`` of many ranges is one request)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requests: dict[str, int] = {}

    def read_range(self, path, start, length):
        self.requests[path] = self.requests.get(path, 0) + 1
        return super().read_range(path, start, length)

    def read_ranges(self, path, ranges):
        self.requests[path] = self.requests.get(path, 0) + 1
        return [LocalStorage.read_range(self, path, start, length) for start, length in ranges]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])  # 12 tensors


def _saved(tmp_path) -> torch.nn.Module:
    model = _model(0)
    engine = CheckpointEngine(base_dir=str(tmp_path), run_name="run", retention=False)
    engine.register("policy", ShardedState(model, min_block_bytes=0))
    engine.save(1)
    engine.close()
    return model


def _restore(tmp_path) -> tuple[torch.nn.Module, Counting, object]:
    model = _model(1)
    storage = Counting(str(tmp_path / "run"))
    engine = CheckpointEngine(base_dir=str(tmp_path), run_name="run", retention=False, storage=storage)
    engine.register("policy", ShardedState(model, min_block_bytes=0))
    try:
        return model, storage, engine.restore()
    finally:
        engine.close()


def test_each_stored_file_is_read_with_one_request(tmp_path):
    saved = _saved(tmp_path)
    model, storage, result = _restore(tmp_path)
    assert result.snapshot_id == "step_000000001"
    shard_reads = {p: n for p, n in storage.requests.items() if p.endswith(".safetensors")}
    assert shard_reads == {"step_000000001/policy.rank0.safetensors": 1}, storage.requests
    for key, tensor in saved.state_dict().items():
        assert torch.equal(model.state_dict()[key], tensor), key


def test_a_corrupt_block_read_in_one_request_is_still_refused(tmp_path):
    _saved(tmp_path)
    path = tmp_path / "run" / "step_000000001" / "policy.rank0.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a byte of the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(NoValidSnapshotError, match="checksum mismatch"):
        _restore(tmp_path)


def test_fetch_merges_adjacent_and_overlapping_ranges_of_a_file(tmp_path):
    _saved(tmp_path)
    storage = Counting(str(tmp_path / "run"))
    manifest = read_manifest(storage, "step_000000001")
    layout = Layout.from_json(manifest.components["policy"]["layout"], "policy")
    files = {f.path: f for f in manifest.files_of("policy")}
    reader = ChunkReader(storage, "step_000000001", layout, files)
    fqn = next(k for k, t in layout.tensors.items() if len(t.shape) == 2)
    chunk = layout.tensors[fqn].chunks[0]
    assert chunk.block_rows == 1, chunk  # 16 rows, a block each (min_block_bytes=0)
    reader.fetch([(fqn, chunk, 0, 4), (fqn, chunk, 3, 5), (fqn, chunk, 12, 1)])  # rows 0-3, 3-7 and 12
    row = chunk.row_bytes(layout.tensors[fqn].dtype)
    # Rows 0-7 (the overlap merged) and row 12, in one request.
    assert [(at, len(data)) for at, data in reader.fetched[chunk.file]] == [
        (chunk.start, 8 * row),
        (chunk.start + 12 * row, row),
    ]
    assert storage.requests == {f"step_000000001/{chunk.file}": 1}
    fresh = ChunkReader(storage, "step_000000001", layout, files)
    assert torch.equal(reader.rows(fqn, chunk, 3, 4), fresh.rows(fqn, chunk, 3, 4))
    assert storage.requests == {f"step_000000001/{chunk.file}": 2}  # only the fresh reader's own read
    reader.drop()
    assert not reader.fetched
