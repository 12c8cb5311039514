"""Loading sharded state with ``torch.distributed.checkpoint``'s planners from rl_ckpt's storage.

DCP's load planner decides which stored byte ranges overlap each rank's local
shards (any layout to any layout); :class:`RlckptStorageReader` serves them
from a committed snapshot through a :class:`ChunkReader`, which reads only the
checksum blocks a rank needs and verifies each before it is used. DCP's
``.metadata`` pickle is never read: :meth:`RlckptStorageReader.read_metadata`
rebuilds DCP's ``Metadata`` from the manifest's JSON layout, and non-tensor
values arrive as JSON (:class:`JsonLoadPlanner`), never through ``torch.load``.
Saving is :mod:`rl_ckpt._sharded.dcp_writer`.
"""

from __future__ import annotations

import io
import json
import math
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from rl_ckpt.errors import CorruptSnapshotError, StorageError
from rl_ckpt._format import safetensors_io
from rl_ckpt._format.checksum import digest_bytes
from rl_ckpt._format.manifest import FileEntry
from rl_ckpt._format.state_codec import decode_state
from rl_ckpt._run.dedup import object_path
from rl_ckpt._sharded.layout import Chunk, Layout
from rl_ckpt._storage import Storage, join


class ChunkReader:
    """Reads byte ranges of stored chunks, verifying every block it touches; counts what it read."""

    def __init__(self, storage: Storage, snapshot_id: str, layout: Layout, files: dict[str, FileEntry]) -> None:
        self.storage, self.snapshot_id, self.layout, self.files = storage, snapshot_id, layout, files
        self.bytes_read = 0
        self.fetched: dict[str, list[tuple[int, bytearray]]] = {}  # file -> (start, bytes) spans read by fetch()

    def _blocks(self, fqn: str, chunk: Chunk, first: int, count: int) -> tuple[int, int, int, int]:
        """The blocks ``[b0, b1)`` holding rows ``[first, first + count)`` of ``chunk`` and their rows ``[r0, r1)``."""
        b0, b1 = first // chunk.block_rows, math.ceil((first + count) / chunk.block_rows)
        return b0, b1, b0 * chunk.block_rows, min(b1 * chunk.block_rows, chunk.rows)

    def fetch(self, wanted) -> None:
        """Read every block that ``rows(fqn, chunk, first, count)`` will need for each ``wanted`` tuple, with one
        ``read_ranges`` request per stored file (overlapping and adjacent ranges merged); ``rows`` then takes them
        from memory and still verifies each block before it is used. ``drop`` frees them."""
        by_file: dict[str, list[tuple[int, int]]] = {}
        for fqn, chunk, first, count in wanted:
            if chunk.objects:
                continue  # dedup objects are read on their own
            _b0, _b1, r0, r1 = self._blocks(fqn, chunk, first, count)
            row_bytes = chunk.row_bytes(self.layout.tensors[fqn].dtype)
            self._check_bounds(fqn, chunk, r0 * row_bytes, (r1 - r0) * row_bytes)
            by_file.setdefault(chunk.file, []).append((chunk.start + r0 * row_bytes, (r1 - r0) * row_bytes))
        for file, ranges in by_file.items():
            merged: list[list[int]] = []
            for start, length in sorted(ranges):
                if merged and start <= merged[-1][0] + merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], start + length - merged[-1][0])
                else:
                    merged.append([start, length])
            datas = self.storage.read_ranges(join(self.snapshot_id, file), [(a, n) for a, n in merged])
            # Writable (a tensor over it must be): one copy, as rows() makes of each read otherwise.
            self.fetched[file] = [(a, bytearray(d)) for (a, _n), d in zip(merged, datas)]

    def drop(self, file: str | None = None) -> None:
        """Forget what ``fetch`` read (of ``file``; None: of every file)."""
        if file is None:
            self.fetched.clear()
        else:
            self.fetched.pop(file, None)

    def rows(self, fqn: str, chunk: Chunk, first: int, count: int) -> torch.Tensor:
        """Rows ``[first, first + count)`` of ``chunk`` (dim 0), as a tensor, after checking their blocks."""
        t = self.layout.tensors[fqn]
        row_bytes = chunk.row_bytes(t.dtype)
        b0, b1, r0, r1 = self._blocks(fqn, chunk, first, count)
        length = (r1 - r0) * row_bytes
        data = self._read(fqn, chunk, r0 * row_bytes, length)
        self.bytes_read += len(data)
        if len(data) != length:
            raise CorruptSnapshotError(
                f"{self.snapshot_id}/{self._where(chunk)}: short read of {fqn!r} "
                f"({len(data)} of {length} bytes): the file was truncated",
                snapshot_id=self.snapshot_id,
                path=self._where(chunk),
                problems=["short read"],
            )
        if isinstance(data, bytes):
            data = bytearray(data)  # a tensor over it must be writable
        view = memoryview(data).cast("B")
        step = chunk.block_rows * row_bytes
        for i, b in enumerate(range(b0, b1)):
            if digest_bytes(self.layout.algo, view[i * step : (i + 1) * step]) != chunk.checksums[b]:
                raise CorruptSnapshotError(
                    f"{self.snapshot_id}/{self._where(chunk)}: {self.layout.algo} checksum mismatch in tensor {fqn!r}, "
                    f"chunk at {list(chunk.offsets)}, rows {b * chunk.block_rows}-"
                    f"{min((b + 1) * chunk.block_rows, chunk.rows) - 1}: the file changed after commit",
                    snapshot_id=self.snapshot_id,
                    path=self._where(chunk),
                    problems=["chunk checksum mismatch"],
                )
        shape = [r1 - r0, *chunk.sizes[1:]] if chunk.sizes else []
        out = safetensors_io.to_torch(t.dtype, shape, view)
        return out.narrow(0, first - r0, count) if chunk.sizes else out

    def _where(self, chunk: Chunk) -> str:
        if chunk.objects:
            return "dedup object(s) " + ", ".join(object_path(self.layout.algo, d) for d, _n in chunk.objects)
        return chunk.file

    def _check_bounds(self, fqn: str, chunk: Chunk, offset: int, length: int) -> None:
        if chunk.file not in self.files:
            raise CorruptSnapshotError(
                f"{self.snapshot_id}: chunk of {fqn!r} names {chunk.file!r}, which the manifest does not list",
                snapshot_id=self.snapshot_id,
                problems=["unlisted file"],
            )
        if chunk.start + offset + length > self.files[chunk.file].size:
            raise CorruptSnapshotError(
                f"{self.snapshot_id}/{chunk.file}: chunk of {fqn!r} runs past the file's "
                f"{self.files[chunk.file].size} bytes",
                snapshot_id=self.snapshot_id,
                path=chunk.file,
                problems=["chunk out of bounds"],
            )

    def _read(self, fqn: str, chunk: Chunk, offset: int, length: int):
        """``length`` bytes at ``offset`` within ``chunk``: from what ``fetch`` read, else one ranged read of its
        file, or of the objects it spans."""
        if not chunk.objects:
            self._check_bounds(fqn, chunk, offset, length)
            start = chunk.start + offset
            for at, data in self.fetched.get(chunk.file, ()):
                if at <= start and start + length <= at + len(data):
                    return memoryview(data)[start - at : start - at + length]
            return self.storage.read_range(join(self.snapshot_id, chunk.file), start, length)
        parts, pos = [], 0
        for digest, size in chunk.objects:  # their sizes add up to the chunk (checked when the layout was parsed)
            lo, hi = max(offset, pos), min(offset + length, pos + size)
            if lo < hi:
                path = object_path(self.layout.algo, digest)
                try:
                    parts.append(self.storage.read_range(path, lo - pos, hi - lo))
                except StorageError as exc:
                    raise CorruptSnapshotError(
                        f"{self.snapshot_id}: dedup object {path} of tensor {fqn!r} cannot be read: {exc}",
                        snapshot_id=self.snapshot_id,
                        path=path,
                        problems=["object unreadable"],
                    ) from exc
            pos += size
        return parts[0] if len(parts) == 1 else b"".join(parts)


class RlckptStorageReader(StorageReader):
    """Serves DCP's load plan from a committed snapshot: byte ranges, verified, copied into the local shards."""

    def __init__(self, chunks: ChunkReader) -> None:
        super().__init__()
        self.chunks = chunks
        self.storage_data: dict[MetadataIndex, tuple[str, Chunk]] = {}

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's ``Metadata``, rebuilt from the manifest's JSON layout (there is no pickled ``.metadata``)."""
        layout = self.chunks.layout
        md: dict[str, Any] = {}
        storage_data = {}
        for fqn, t in layout.tensors.items():
            md[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=safetensors_io.CODE_TO_TORCH[t.dtype]),
                torch.Size(t.shape),
                [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks],
            )
            for i, c in enumerate(t.chunks):
                storage_data[MetadataIndex(fqn, c.offsets, i)] = (fqn, c)
        for fqn in layout.values:
            md[fqn] = BytesStorageMetadata()
            storage_data[MetadataIndex(fqn)] = (fqn, None)
        self.storage_data = storage_data
        return Metadata(state_dict_metadata=md, storage_data=storage_data)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # In stored order, one file after the other: each file's blocks that this rank needs are read with one
        # request (ChunkReader.fetch), used, and freed before the next file's.
        items = sorted(plan.items, key=lambda it: self._order(it))
        groups: dict[str, list] = {}
        for item in items:
            _fqn, chunk = self.storage_data[item.storage_index]
            groups.setdefault(chunk.file if chunk is not None else "", []).append(item)
        for file, group in groups.items():
            self.chunks.fetch(
                [
                    (*self.storage_data[it.storage_index], *self._rows(it))
                    for it in group
                    if it.type != LoadItemType.BYTE_IO
                ]
            )
            try:
                self._load(group, planner)
            finally:
                self.chunks.drop(file)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _rows(self, item) -> tuple[int, int]:
        """The rows (dim 0) of its stored chunk that ``item`` reads: (first, count)."""
        _fqn, chunk = self.storage_data[item.storage_index]
        return (item.storage_offsets[0], item.lengths[0]) if chunk.sizes else (0, 1)

    def _load(self, items: list, planner: LoadPlanner) -> None:
        for item in items:
            fqn, chunk = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(json.dumps(self.chunks.layout.values[fqn]).encode()))
                continue
            src = self.chunks.rows(fqn, chunk, *self._rows(item))
            for dim in range(1, len(chunk.sizes)):
                src = src.narrow(dim, item.storage_offsets[dim], item.lengths[dim])
            target = planner.resolve_tensor(item).detach()
            if target.shape != src.shape:
                raise CorruptSnapshotError(
                    f"{self.chunks.snapshot_id}: {fqn!r}: a planned read of "
                    f"{list(src.shape)} does not fit its target {list(target.shape)}",
                    snapshot_id=self.chunks.snapshot_id,
                    problems=["shape mismatch"],
                )
            target.copy_(src)
            planner.commit_tensor(item, target)

    def _order(self, item) -> tuple:
        _fqn, chunk = self.storage_data[item.storage_index]
        if chunk is None:
            return ("", 0, 0)
        return (chunk.file, chunk.start, item.storage_offsets[0] if chunk.sizes else 0)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


class JsonLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values arrive as JSON: nothing is unpickled."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        tree = json.loads(value.getvalue())
        obj = decode_state(tree, {}, {}, where=read_item.dest_index.fqn)["v"]
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # what DCP's own load_bytes uses

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load_shards(state_dict: dict, chunks: ChunkReader, *, strict: bool = True) -> None:
    """Fill ``state_dict`` (local shards, DTensors or plain tensors) from the snapshot, in place, on this rank alone."""
    reader = RlckptStorageReader(chunks)
    metadata = reader.read_metadata()
    planner = JsonLoadPlanner(allow_partial_load=not strict)
    planner.set_up_planner(state_dict, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    plan = planner.finish_plan(reader.prepare_global_plan(planner.create_global_plan([plan]))[0])
    reader.read_data(plan, planner).wait()
