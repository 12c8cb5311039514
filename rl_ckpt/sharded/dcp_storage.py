"""``torch.distributed.checkpoint`` plugins over rl_ckpt's storage: DCP plans, rl_ckpt stores.

DCP's planners decide which chunk of which tensor each rank writes and, on
load, which stored byte ranges overlap each rank's local shards (any layout
to any layout). These plugins put the bytes where rl_ckpt keeps them: one
plain safetensors file per rank per component inside the commit attempt,
checksummed per block; the layout goes into the manifest as JSON. DCP's own
``.metadata`` pickle is never written or read: :meth:`RlckptStorageReader.read_metadata`
rebuilds DCP's ``Metadata`` from the JSON layout, and non-tensor values
travel as JSON, never through ``torch.save``/``torch.load``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from rl_ckpt.format import safetensors_io
from rl_ckpt.format.checksum import digest_bytes
from rl_ckpt.run.layout import Attempt
from rl_ckpt.run.dedup import ObjectWriter, object_path
from rl_ckpt.errors import CorruptSnapshotError, SerializationError, StorageError
from rl_ckpt.format.manifest import FileEntry
from rl_ckpt.format.state_codec import decode_state, encode_state
from rl_ckpt.storage import Storage, join
from rl_ckpt.format.hashed_io import verify_written, write_hashed
from rl_ckpt.sharded.layout import Chunk, Layout, TensorLayout


class TensorStager(Protocol):
    """Where a save's shards are copied to host memory (``core/staging.py``'s ``StagingArea`` is one): the copy
    of ``tensor`` under ``key``, complete once the stager's ``finish()`` returned."""

    def stage_tensor(self, key: tuple, tensor: torch.Tensor) -> torch.Tensor: ...


DEFAULT_BLOCK_BYTES = 4 * 1024 * 1024
MIN_BLOCK_BYTES = 64 * 1024  # smaller blocks cost more manifest than the bytes they save a resharding read
# At least this many checksum blocks per chunk: a resharding read overshoots by <= 2/32 of a chunk.
BLOCKS_PER_CHUNK = 32


def owns(obj: Any, rank: int) -> bool:
    """Whether this rank writes ``obj``: one owner per replica group (coordinate 0 on every replicated mesh dim)."""
    if isinstance(obj, DTensor):
        coord = obj.device_mesh.get_coordinate()
        if coord is None:
            return False
        return all(c == 0 for c, p in zip(coord, obj.placements) if not p.is_shard())
    return rank == 0  # plain tensors and values are the same on every rank: rank 0 writes them


class StagedSavePlanner(DefaultSavePlanner):
    """DCP's default save plan, cut to what this rank owns, with the data taken out of the trainer's hands.

    ``copy=True`` (async saves) copies every local shard (``DTensor.to_local()``)
    to the host now, so training may change the live tensors while the snapshot
    is written: into ``staging``'s reused buffers when given (pinned, on a side
    stream, for CUDA shards; complete after ``staging.finish()``), else into
    fresh CPU tensors.
    """

    def __init__(self, rank: int, copy: bool, *, name: str = "", staging: "TensorStager | None" = None) -> None:
        super().__init__()
        self.rank = rank
        self.copy = copy
        self.name = name
        self.staging = staging
        self.staged: dict[MetadataIndex, Any] = {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            if not owns(self.state_dict[item.index.fqn], self.rank):
                continue
            if item.tensor_data is not None and math.prod(item.tensor_data.chunk.sizes) == 0:
                continue  # an empty shard (more ranks than rows) holds nothing to write
            items.append(item)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def stage(self) -> None:
        for item in self.plan.items:
            obj = self.lookup_object(item.index)
            if item.type == WriteItemType.BYTE_IO:
                enc = encode_state(item.index.fqn, {"v": obj})
                if enc.arrays or enc.tables:
                    raise SerializationError(
                        f"sharded state value {item.index.fqn!r} holds tensors inside a "
                        "non-tensor value; keep tensors at the top level of the state dict",
                        component=item.index.fqn,
                        key=item.index.fqn,
                    )
                self.staged[item.index] = enc.tree
            elif self.copy and self.staging is not None:
                key = f"{item.index.fqn}@{','.join(map(str, item.index.offset or ()))}"
                self.staged[item.index] = self.staging.stage_tensor((self.name, key), obj.detach())
            else:
                t = obj.detach()
                t = t.to("cpu", copy=True).contiguous() if self.copy else t.cpu().contiguous()
                self.staged[item.index] = t

    def resolve_data(self, write_item):
        data = self.staged[write_item.index]
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(json.dumps(data, allow_nan=False).encode())
        return data


@dataclasses.dataclass
class StagedShards:
    """One sharded component, planned and staged on this rank; what ``persist`` writes."""

    planner: StagedSavePlanner
    metadata: Metadata
    saved_by: dict


def stage_shards(
    state_dict: dict, rank: int, *, copy: bool, saved_by: dict, name: str = "", staging: "TensorStager | None" = None
) -> StagedShards:
    """Plan this rank's part of ``state_dict`` with DCP's planner (no collectives) and stage its data."""
    planner = StagedSavePlanner(rank, copy, name=name, staging=staging)
    planner.set_up_planner(state_dict, None, rank == 0)
    plan = planner.create_local_plan()
    plans, metadata = planner.create_global_plan([plan])
    planner.finish_plan(plans[0])
    planner.stage()
    return StagedShards(planner, metadata, saved_by)


def _block_rows(chunk_sizes, itemsize: int, block_bytes: int, min_block_bytes: int) -> int:
    """Rows per checksum block: >= BLOCKS_PER_CHUNK blocks of <= block_bytes, but none under min_block_bytes."""
    rows = chunk_sizes[0] if chunk_sizes else 1
    row_bytes = max(1, math.prod(chunk_sizes[1:]) * itemsize if chunk_sizes else itemsize)
    target = min(max(1, block_bytes // row_bytes), math.ceil(rows / BLOCKS_PER_CHUNK))
    return max(1, target, min(rows, math.ceil(min_block_bytes / row_bytes)))


class RlckptStorageWriter(StorageWriter):
    """Writes one rank's chunks of one component as ``<key>.rank<r>.safetensors`` inside the attempt."""

    def __init__(
        self,
        storage: Storage,
        attempt: Attempt,
        key: str,
        rank: int,
        *,
        algo: str,
        verify: bool,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        min_block_bytes: int = MIN_BLOCK_BYTES,
        objects: ObjectWriter | None = None,
    ) -> None:
        super().__init__()
        self.storage, self.attempt, self.key, self.rank = storage, attempt, key, rank
        self.algo, self.verify, self.block_bytes, self.min_block_bytes = algo, verify, block_bytes, min_block_bytes
        self.objects = objects  # dedup: chunks of at least objects.min_bytes go to the content-addressed store
        if objects is not None and objects.algo != algo:
            raise ValueError(f"dedup objects named by {objects.algo}, layout checksums by {algo}: they must match")
        self.files: list[FileEntry] = []
        self.layout: Layout | None = None
        self.values: dict[str, Any] = {}

    def reset(self, checkpoint_id=None) -> None:
        self.files, self.layout, self.values = [], None, {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        arrays: dict[str, torch.Tensor] = {}
        names: dict[str, Any] = {}
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                self.values[item.index.fqn] = json.loads(data.getvalue())
                continue
            name, i = item.index.fqn, 1
            while name in arrays:  # a rank holding two chunks of one tensor
                name, i = f"{item.index.fqn}#{i}", i + 1
            arrays[name] = data
            names[name] = item
        results: list[WriteResult] = []
        if self.objects is not None:
            for name in [n for n, t in arrays.items() if t.numel() * t.element_size() >= self.objects.min_bytes]:
                t = arrays.pop(name)
                view = safetensors_io.byte_view(t)
                refs = tuple((d, n) for d, n in self.objects.put(view, self.verify))
                results.append(self._result(names[name], t.element_size(), view, "", 0, refs))
            # Every object a chunk names is durable (and read back with verify) before the part is returned.
            self.objects.flush(self.verify)
        if arrays:
            file_name = f"{self.key}.rank{self.rank}.safetensors"
            chunks, _meta = safetensors_io.encode(
                arrays,
                metadata={"component": self.key, "rank": str(self.rank), "format": "rl_ckpt sharded: local shards"},
            )
            header = json.loads(bytes(chunks[0][8:]))
            base = len(chunks[0])
            path = self.attempt.data_path(file_name)
            size, digest = write_hashed(self.storage, path, chunks, self.algo)
            entry = FileEntry(self.attempt.manifest_path(file_name), size, digest, self.algo, self.key, "tensors")
            if self.verify:
                verify_written(self.storage, path, entry)
            self.files.append(entry)
            for name, t in arrays.items():
                results.append(
                    self._result(
                        names[name],
                        t.element_size(),
                        safetensors_io.byte_view(t),
                        entry.path,
                        base + header[name]["data_offsets"][0],
                        (),
                    )
                )
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _result(self, item, itemsize: int, view: memoryview, file: str, start: int, objects: tuple) -> WriteResult:
        """The chunk record of one written piece: where it is, and one checksum per block of rows."""
        sizes = tuple(item.tensor_data.chunk.sizes)
        br = _block_rows(sizes, itemsize, self.block_bytes, self.min_block_bytes)
        step = br * (view.nbytes // (sizes[0] if sizes else 1) if view.nbytes else 0)
        sums = tuple(digest_bytes(self.algo, view[s : s + step]) for s in range(0, view.nbytes, step)) if step else ()
        chunk = Chunk(tuple(item.tensor_data.chunk.offsets), sizes, file, start, br, sums, objects)
        return WriteResult(index=item.index, size_in_bytes=view.nbytes, storage_data=chunk)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        layout = Layout(self.algo, values=dict(self.values))
        for rank_results in results:
            for r in rank_results:
                md = metadata.state_dict_metadata[r.index.fqn]
                code = safetensors_io.TORCH_TO_CODE[md.properties.dtype]
                tl = layout.tensors.setdefault(r.index.fqn, TensorLayout(code, tuple(md.size)))
                tl.chunks.append(r.storage_data)
        self.layout = layout

    def storage_meta(self):
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


def write_shards(
    storage: Storage,
    attempt: Attempt,
    key: str,
    staged: StagedShards,
    rank: int,
    *,
    algo: str,
    verify: bool,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    min_block_bytes: int = MIN_BLOCK_BYTES,
    objects: ObjectWriter | None = None,
) -> tuple[list[FileEntry], dict]:
    """Write this rank's part; returns its file entries and its manifest section (with its part of the layout).

    With ``objects`` (dedup), each local chunk of at least ``objects.min_bytes``
    is stored content-addressed: a chunk whose bytes a committed snapshot
    already holds is referenced, not written again."""
    writer = RlckptStorageWriter(
        storage,
        attempt,
        key,
        rank,
        algo=algo,
        verify=verify,
        block_bytes=block_bytes,
        min_block_bytes=min_block_bytes,
        objects=objects,
    )
    writer.set_up_storage_writer(rank == 0)
    results = writer.write_data(staged.planner.plan, staged.planner).wait()
    writer.finish(staged.metadata, [results])
    layout = writer.layout
    layout.saved_by = dict(staged.saved_by)
    section = {
        "tensors": {k: {"dtype": t.dtype, "shape": list(t.shape)} for k, t in sorted(layout.tensors.items())},
        "tables": {},
        "layout": layout.to_json(),
    }
    return writer.files, section


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
