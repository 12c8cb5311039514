"""Export one component of a snapshot for other tools: one safetensors file, or a Hugging Face folder.

Both formats take a plain component (its verified safetensors file) or a
sharded one (FSDP2 / DTensor: every tensor is put together from the chunks
the ranks wrote, block by verified block). Sharded tensors stream: one whole
tensor plus one read buffer is in memory at a time, never the whole model.
Output goes to a temp file (or folder) that is fsynced and renamed into
place, so a crash or a failed check never leaves a half export under the
target path.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rl_ckpt.errors import CheckpointError, ConfigError, StorageError
from rl_ckpt._format import safetensors_io
from rl_ckpt._format.manifest import Manifest
from rl_ckpt._storage import Storage

READ_BUFFER_BYTES = 16 * 1024 * 1024  # rows of a sharded chunk read (and verified) per storage request
HF_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to export: its name in the output, its name in the snapshot, dtype code and shape."""

    name: str
    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * safetensors_io.ITEMSIZE[self.dtype]


class ComponentSource:
    """The tensors of one component of a committed snapshot, listed up front and read one at a time, verified."""

    def __init__(
        self, storage: Storage, manifest: Manifest, component: str, buffer_bytes: int = READ_BUFFER_BYTES
    ) -> None:
        from rl_ckpt._sharded.component import chunk_reader, is_sharded_section

        sid = manifest.snapshot_id
        if component not in manifest.components:
            have = ", ".join(sorted(manifest.components)) or "(none)"
            raise CheckpointError(
                f"{sid} has no component {component!r}; it has: {have}", component=component, snapshot_id=sid
            )
        self.where = f"{sid}/{component}"
        self.buffer_bytes = max(1, int(buffer_bytes))
        self.bytes_read = 0
        self._arrays: dict[str, torch.Tensor] = {}
        self.sharded = is_sharded_section(manifest.components[component])
        if self.sharded:
            self._reader = chunk_reader(storage, manifest, component)
            self.specs = {k: (t.dtype, tuple(t.shape)) for k, t in self._reader.layout.tensors.items()}
        else:
            from rl_ckpt._core.reader import load_arrays

            # A plain component's file has one checksum for the whole file: it is read (and checked) whole.
            self._arrays = load_arrays(storage, manifest, component)
            self.bytes_read = sum(t.numel() * t.element_size() for t in self._arrays.values())
            self.specs = {k: (safetensors_io.TORCH_TO_CODE[t.dtype], tuple(t.shape)) for k, t in self._arrays.items()}
        if not self.specs:
            raise CheckpointError(
                f"{self.where}: the component holds no tensors (only JSON/tables); nothing to export",
                component=component,
                snapshot_id=sid,
            )

    def tensor(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``; for a sharded component every block it is made of is verified first."""
        if not self.sharded:
            return self._arrays[key]
        t = self._reader.layout.tensors[key]
        out = torch.empty(t.shape, dtype=safetensors_io.CODE_TO_TORCH[t.dtype])
        for chunk in t.chunks:
            if math.prod(chunk.sizes) == 0 and chunk.sizes:
                continue
            view = out
            for dim, (off, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
                view = view.narrow(dim, off, size)
            # Whole checksum blocks per read, about buffer_bytes at a time, so a chunk never sits in memory twice.
            per_read = (
                max(1, self.buffer_bytes // max(1, chunk.row_bytes(t.dtype)) // chunk.block_rows) * chunk.block_rows
            )
            first = 0
            while first < chunk.rows:
                count = min(per_read, chunk.rows - first)
                before = self._reader.bytes_read
                rows = self._reader.rows(key, chunk, first, count)
                self.bytes_read += self._reader.bytes_read - before
                (view.narrow(0, first, count) if chunk.sizes else view).copy_(rows)
                del rows
                first += count
        return out


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5 * 10**9, ``"500MiB"`` -> 500 * 2**20, ``"1000"`` -> 1000 (as Hugging Face reads sizes)."""
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
        if not m:
            raise ConfigError(
                f"size {text!r}: expected a number of bytes or e.g. 5GB, 500MB, 512MiB", key="max_shard_size"
            )
        unit = (m.group(2) or "B").upper()
        scale = {
            "B": 1,
            "KB": 10**3,
            "MB": 10**6,
            "GB": 10**9,
            "TB": 10**12,
            "KIB": 2**10,
            "MIB": 2**20,
            "GIB": 2**30,
            "TIB": 2**40,
        }[unit]
        size = int(float(m.group(1)) * scale)
    if size <= 0:
        raise ConfigError(f"size {text!r} must be positive", key="max_shard_size")
    return size


def output_names(keys: list[str], strip_prefix: str | None, where: str) -> dict[str, str]:
    """snapshot key -> exported name (``strip_prefix`` removed where present); ConfigError on a collision."""
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for key in keys:
        name = key[len(strip_prefix) :] if strip_prefix and key.startswith(strip_prefix) else key
        if not name:
            raise ConfigError(f"{where}: --strip-prefix {strip_prefix!r} leaves tensor {key!r} without a name", key=key)
        if name in seen:
            raise ConfigError(
                f"{where}: --strip-prefix {strip_prefix!r} maps both {seen[name]!r} and {key!r} to "
                f"{name!r}; choose a longer prefix",
                key=key,
            )
        seen[name] = key
        out[key] = name
    return out


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Hugging Face's split: tensors in order, a new shard when the next would pass the limit (a bigger one alone)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _header(specs: list[TensorSpec], metadata: dict[str, str]) -> tuple[bytes, list[TensorSpec]]:
    order = sorted(specs, key=lambda s: (-safetensors_io.ITEMSIZE[s.dtype], s.name))  # keeps every tensor aligned
    header: dict = {}
    offset = 0
    for s in order:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(len(blob) + 8) % 8)
    return struct.pack("<Q", len(blob)) + blob, order


def _file_chunks(specs: list[TensorSpec], source: ComponentSource, metadata: dict[str, str]):
    """One safetensors file's bytes: the header, then each tensor as it is put together (streamed, then dropped)."""
    head, order = _header(specs, metadata)
    yield head
    for s in order:
        t = source.tensor(s.key)
        if t.numel():
            yield safetensors_io.byte_view(t.contiguous())
        del t


def _output(target: str, options: dict | None) -> tuple[Storage, str]:
    """A storage and ``target``'s path in it: for a local path, rooted at the nearest folder that exists
    (missing folders are created durably on the way); for a URL (``s3://...``), at ``target``'s parent."""
    from rl_ckpt._storage import open_storage

    if "://" in target:
        parent, _, name = target.rstrip("/").rpartition("/")
        if "://" not in parent or not name:
            raise ConfigError(f"export target {target!r}: name a file or folder inside a bucket or folder", path=target)
        return open_storage(parent, options or {}), name
    parent, name = os.path.split(os.path.abspath(target))
    while not os.path.isdir(parent) and os.path.dirname(parent) != parent:
        parent, missing = os.path.split(parent)
        name = f"{missing}/{name}"
    return open_storage(parent, {}), name


def _sibling(path: str, prefix: str) -> str:
    """A name next to ``path`` (same folder) starting with ``prefix``."""
    folder, _, base = path.rpartition("/")
    return f"{folder}/{prefix}{base}" if folder else f"{prefix}{base}"


def _guard(where: str, out: str, step: Callable[[], None]) -> None:
    """Run a write step: OSError becomes StorageError naming ``out``; a read error keeps naming the snapshot file."""
    try:
        step()
    except CheckpointError as exc:
        if exc.message.startswith(f"export of {where}"):
            raise
        # Keep the class and facts (file, tensor), and say which export found it.
        raise exc.reworded(
            f"export of {where}: {exc.message}; nothing was written to {out}", component=where.split("/", 1)[1]
        ) from exc
    except OSError as exc:
        raise StorageError(f"{where}: cannot write export {out}: {exc.strerror or exc}", path=out) from exc


def _specs(source: ComponentSource, strip_prefix: str | None) -> list[TensorSpec]:
    names = output_names(list(source.specs), strip_prefix, source.where)
    return [TensorSpec(names[k], k, *source.specs[k]) for k in source.specs]


def export_component(
    storage: Storage,
    manifest: Manifest,
    component: str,
    out_path: str,
    *,
    strip_prefix: str | None = None,
    storage_options: dict | None = None,
) -> dict:
    """Verify and write ``component``'s tensors to one safetensors file ``out_path``; returns name -> {dtype, shape}.

    Works for plain and sharded components (a sharded one is put together
    tensor by tensor). ``out_path`` is a local path or a storage URL (``s3://...``,
    with ``storage_options``); the file is published all-or-nothing through that
    storage, so a crash or a failed check never leaves a half-written ``out_path``.
    """
    source = ComponentSource(storage, manifest, component)
    specs = _specs(source, strip_prefix)
    meta = {"format": "pt", "rl_ckpt_snapshot": manifest.snapshot_id, "component": component}
    target, name = _output(out_path, storage_options)

    def write() -> None:
        if "/" in name:
            target.makedirs(name.rsplit("/", 1)[0])
        target.write_stream_atomic(name, _file_chunks(specs, source, meta))

    try:
        _guard(source.where, out_path, write)
    finally:
        target.close()
    return {s.name: {"dtype": s.dtype, "shape": list(s.shape)} for s in specs}


@dataclass
class HFExport:
    """What :func:`export_hf` wrote: the folder, its shard files, the tensor count and bytes, bytes read."""

    path: str
    files: list[str]
    tensors: int
    total_size: int
    bytes_read: int


def export_hf(
    storage: Storage,
    manifest: Manifest,
    component: str,
    out_dir: str,
    *,
    max_shard_size: str | int = "5GB",
    strip_prefix: str | None = None,
    buffer_bytes: int = READ_BUFFER_BYTES,
    storage_options: dict | None = None,
) -> HFExport:
    """Write ``component`` as a Hugging Face folder:
    ``model-0000x-of-0000y.safetensors`` + ``model.safetensors.index.json``.

    Tensor names are the snapshot's FQNs (``strip_prefix`` removed); shards
    are cut as ``save_pretrained`` cuts them (``max_shard_size``, default
    5GB). ``out_dir`` (a local path or a storage URL) must not exist or be
    empty. Where folders rename atomically (local disks, NFS) the files are
    written to a sibling temp folder, fsynced and renamed to ``out_dir`` only
    when every tensor was read and verified; on an object store each shard is
    published whole and the index, which loaders read first, is written last.
    """
    limit = parse_size(max_shard_size)
    target, base = _output(out_dir, storage_options)
    try:
        return _export_hf_to(target, base, out_dir, storage, manifest, component, limit, strip_prefix, buffer_bytes)
    finally:
        target.close()


def _export_hf_to(
    target: Storage,
    base: str,
    out_dir: str,
    storage: Storage,
    manifest: Manifest,
    component: str,
    limit: int,
    strip_prefix: str | None,
    buffer_bytes: int,
) -> HFExport:
    entry = target.stat(base)
    if entry is not None and not entry.is_dir or target.list(base):
        raise ConfigError(
            f"export target {out_dir} already exists and is not an empty folder; choose another -o or remove it",
            path=out_dir,
        )
    source = ComponentSource(storage, manifest, component, buffer_bytes)
    specs = _specs(source, strip_prefix)
    shards = plan_shards(specs, limit)
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    meta = {"format": "pt", "rl_ckpt_snapshot": manifest.snapshot_id, "component": component}
    index = {
        "metadata": {"total_size": sum(s.nbytes for s in specs)},
        "weight_map": {s.name: name for name, shard in zip(names, shards) for s in shard},
    }
    index_bytes = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    folder = _sibling(f"{base}.export-{os.getpid()}", ".") if target.supports_rename else base
    written: list[str] = []

    def write_all() -> None:
        if target.supports_rename:
            target.remove_tree(folder)
        target.makedirs(folder)
        for name, shard in zip(names, shards):
            written.append(name)
            target.write_stream_atomic(f"{folder}/{name}", _file_chunks(shard, source, meta))
        written.append(HF_INDEX)
        target.write_atomic(f"{folder}/{HF_INDEX}", index_bytes)  # last: a loader finds the shards through it
        if target.supports_rename:
            target.sync_dir(folder)
            if target.stat(base) is not None and not target.list(base):
                target.remove_tree(base)  # the empty folder the caller made: renamed over below
            target.rename_dir(folder, base)
            target.sync_dir(base.rsplit("/", 1)[0] if "/" in base else "")

    done = False
    try:
        _guard(source.where, out_dir, write_all)
        done = True
    finally:
        if target.supports_rename:
            target.remove_tree(folder)
        elif not done:
            for name in written:  # an object store: take back what was published
                target.remove(f"{base}/{name}")
    return HFExport(out_dir, names, len(specs), sum(s.nbytes for s in specs), source.bytes_read)


__all__ = ["ComponentSource", "HFExport", "TensorSpec", "export_component", "export_hf", "parse_size", "plan_shards"]
