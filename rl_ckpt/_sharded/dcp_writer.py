"""Saving sharded state with ``torch.distributed.checkpoint``'s planners into rl_ckpt's storage.

DCP's save planner decides which chunk of which tensor each rank writes (one
owner per replica group: :func:`owns`); :class:`StagedSavePlanner` copies this
rank's chunks out of the trainer's hands and :class:`RlckptStorageWriter` puts
them where rl_ckpt keeps them: one plain safetensors file per rank per
component inside the commit attempt (or content-addressed dedup objects),
checksummed per block; the layout goes into the manifest as JSON. DCP's own
``.metadata`` pickle is never written, and non-tensor values travel as JSON,
never through ``torch.save``. Loading is :mod:`rl_ckpt._sharded.dcp_reader`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from rl_ckpt.errors import SerializationError
from rl_ckpt._format import safetensors_io
from rl_ckpt._format.checksum import digest_bytes
from rl_ckpt._format.hashed_io import verify_written, write_hashed
from rl_ckpt._format.manifest import FileEntry
from rl_ckpt._format.state_codec import encode_state
from rl_ckpt._run.dedup import ObjectWriter
from rl_ckpt._run.layout import Attempt
from rl_ckpt._sharded.layout import Chunk, Layout, TensorLayout
from rl_ckpt._storage import Storage


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
