"""Read snapshots back: manifest, verification, and decoding — checksums first.

Nothing is deserialized before its bytes matched the manifest's checksum: a
file is read once into memory, hashed, compared, and only then parsed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rl_ckpt.format import safetensors_io
from rl_ckpt.format.checksum import new_hasher
from rl_ckpt.errors import CheckpointError, CorruptSnapshotError, StorageError, UnsafePathError
from rl_ckpt.format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, FileEntry, Manifest, parse_snapshot_id
from rl_ckpt.format.state_codec import decode_state
from rl_ckpt.storage import Storage, join
from rl_ckpt.format.untrusted import parse_json
from rl_ckpt.run.dedup import check_object, manifest_objects, object_path, read_tensor_bytes
from rl_ckpt.core.writer import hash_file

MAX_JSON_BYTES = 256 * 1024 * 1024


@dataclasses.dataclass
class FileProblem:
    snapshot_id: str
    path: str
    problem: str

    def __str__(self) -> str:
        return f"{self.snapshot_id}/{self.path}: {self.problem}"


@dataclasses.dataclass
class VerifyReport:
    """Result of checking snapshots against their manifests. ``ok`` is True when nothing is wrong."""

    checked: list[str] = dataclasses.field(default_factory=list)
    problems: list[FileProblem] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bad_snapshots(self) -> list[str]:
        return sorted({p.snapshot_id for p in self.problems})

    def problems_of(self, snapshot_id: str) -> list[FileProblem]:
        return [p for p in self.problems if p.snapshot_id == snapshot_id]

    def __str__(self) -> str:
        lines = [f"verified {len(self.checked)} snapshot(s): " + ("all OK" if self.ok else f"{len(self.bad_snapshots)} bad")]
        lines += [f"  BAD {p}" for p in self.problems]
        return "\n".join(lines)


def read_manifest(storage: Storage, snapshot_id: str, *, size: int | None = None) -> Manifest:
    """Read and check ``<id>/meta.json``; CorruptSnapshotError / SchemaVersionError / UnsafePathError.

    The size (``size`` when the caller has just listed it, else a stat) is checked before reading, so a
    sparse 1 GiB or a 64 GiB manifest is refused without being read.
    """
    path = join(snapshot_id, MANIFEST_NAME)
    try:
        size = storage.size(path) if size is None else size
        if size > MAX_MANIFEST_BYTES:
            raise CorruptSnapshotError(
                f"{snapshot_id}: {MANIFEST_NAME} is {size} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may "
                "have; refusing to read it", snapshot_id=snapshot_id, problems=["manifest too large"])
        data = storage.read(path)
    except StorageError as exc:
        raise CorruptSnapshotError(f"{snapshot_id}: cannot read manifest ({exc})", snapshot_id=snapshot_id,
                                   problems=[str(exc)]) from exc
    manifest = Manifest.from_bytes(data, snapshot_id)
    parsed = parse_snapshot_id(snapshot_id)
    if parsed is not None and (parsed[0] != manifest.global_step or parsed[2] != manifest.kind):
        raise CorruptSnapshotError(
            f"{snapshot_id}: manifest says step {manifest.global_step} ({manifest.kind}); the folder name says "
            f"step {parsed[0]} ({parsed[2]}). The manifest is corrupt; refusing it",
            snapshot_id=snapshot_id, problems=["step/kind mismatch"])
    if manifest.snapshot_id != snapshot_id:
        raise CorruptSnapshotError(
            f"{snapshot_id}: manifest names snapshot {manifest.snapshot_id!r}; it was copied or renamed, refusing it",
            snapshot_id=snapshot_id, problems=["snapshot_id mismatch"],
        )
    return manifest


def check_file(storage: Storage, snapshot_id: str, entry: FileEntry, throttle=None) -> str | None:
    """Re-hash one file; the problem as text, or None when it matches."""
    path = join(snapshot_id, entry.path)
    try:
        if not storage.exists(path):
            return "missing"
        size, digest = hash_file(storage, path, entry.algo, throttle)
    except UnsafePathError as exc:
        return f"unsafe: {exc}"
    except CheckpointError as exc:
        return f"unreadable: {exc}"
    if size != entry.size:
        return f"size {size} != {entry.size} in manifest (truncated or overwritten)"
    if digest != entry.checksum:
        return f"{entry.algo} checksum mismatch (content changed)"
    return None


def verify_snapshot(storage: Storage, snapshot_id: str, report: VerifyReport | None = None, *, progress=None,
                    throttle=None) -> VerifyReport:
    """Check the manifest and every file of one snapshot; problems go into ``report``."""
    report = report or VerifyReport()
    report.checked.append(snapshot_id)
    try:
        manifest = read_manifest(storage, snapshot_id)
    except CheckpointError as exc:
        report.problems.append(FileProblem(snapshot_id, MANIFEST_NAME, str(exc)))
        return report
    for entry in manifest.files:
        problem = check_file(storage, snapshot_id, entry, throttle)
        if progress is not None:
            progress(entry.size)
        if problem:
            report.problems.append(FileProblem(snapshot_id, entry.path, problem))
    for digest, (algo, size) in manifest_objects(manifest).items():
        try:
            check_object(storage, algo, digest, size)
            if throttle is not None:
                throttle(size)
        except CheckpointError as exc:
            report.problems.append(FileProblem(snapshot_id, "../" + object_path(algo, digest), str(exc)))
        if progress is not None:
            progress(size)
    return report


def read_verified(storage: Storage, snapshot_id: str, entry: FileEntry, *, readonly_ok: bool = False):
    """The file's bytes, only if they match the manifest (else CorruptSnapshotError).

    ``readonly_ok``: a storage with ``read_view`` (the memory tier) may return a read-only view of memory it
    shares (no copy); the hash covers exactly the bytes of that view, and the caller must never write to it.
    """
    path = join(snapshot_id, entry.path)
    try:
        if storage.size(path) != entry.size:
            raise CorruptSnapshotError(
                f"{snapshot_id}/{entry.path}: size {storage.size(path)} != {entry.size} in manifest",
                snapshot_id=snapshot_id, path=entry.path, problems=["size mismatch"],
            )
        hasher = new_hasher(entry.algo)
        read = getattr(storage, "read_view", None) if readonly_ok else None
        data = (read or storage.read)(path, on_chunk=hasher.update)
    except StorageError as exc:
        raise CorruptSnapshotError(f"{snapshot_id}/{entry.path}: {exc}", snapshot_id=snapshot_id, path=entry.path,
                                   problems=["unreadable"]) from exc
    if len(data) != entry.size or hasher.hexdigest() != entry.checksum:
        raise CorruptSnapshotError(
            f"{snapshot_id}/{entry.path}: {entry.algo} checksum mismatch; the file changed after commit",
            snapshot_id=snapshot_id, path=entry.path, problems=["checksum mismatch"],
        )
    return data


def load_component(storage: Storage, manifest: Manifest, name: str, *, as_numpy: bool = False,
                   readonly_ok: bool = False) -> Any:
    """Verify and decode one component's state dict from a snapshot.

    ``readonly_ok``: its tensors may be views of read-only memory the storage shares (``read_view``: no copy);
    only for a caller that copies them out (e.g. into a module's parameters) and never writes to them.
    """
    sid = manifest.snapshot_id
    section = manifest.components.get(name)
    if section is None:
        raise CorruptSnapshotError(f"{sid}: component {name!r} is not in this snapshot", snapshot_id=sid,
                                   problems=[f"no component {name}"])
    entries = {f.role: f for f in manifest.files_of(name) if f.role != "table"}
    by_path = {f.path: f for f in manifest.files_of(name)}
    arrays = load_arrays(storage, manifest, name, readonly_ok=readonly_ok)
    tables = {}
    for table_name, rel in (section.get("tables") or {}).items():
        entry = by_path.get(rel)
        if entry is None:
            raise CorruptSnapshotError(f"{sid}: table {table_name!r} file {rel!r} not listed", snapshot_id=sid,
                                       problems=["table file missing from manifest"])
        tables[table_name] = _read_arrow(read_verified(storage, sid, entry), f"{sid}/{rel}")
    if "json" not in entries:
        raise CorruptSnapshotError(f"{sid}: component {name!r} has no JSON structure file", snapshot_id=sid,
                                   problems=["json missing"])
    where = f"{sid}/{entries['json'].path}"
    tree = parse_json(read_verified(storage, sid, entries["json"]), where, error=CorruptSnapshotError,
                      snapshot_id=sid, problems=["bad json"])
    try:
        return decode_state(tree, arrays, tables, where=where)
    except CheckpointError:
        raise
    except (RecursionError, ValueError, TypeError, OverflowError, KeyError, IndexError, AttributeError) as exc:
        # The codec's own checks name the key; this net makes sure a forged structure they did not foresee
        # still reads as a bad snapshot (recovery falls back) and never as a crash.
        raise CorruptSnapshotError(f"{where}: cannot decode the state structure ({type(exc).__name__}: "
                                   f"{str(exc)[:200]})", snapshot_id=sid, problems=["bad state structure"]) from None


def load_arrays(storage: Storage, manifest: Manifest, name: str, *, readonly_ok: bool = False) -> dict:
    """A component's tensors (verified), from its safetensors file or from dedup objects (``readonly_ok``:
    see :func:`load_component`)."""
    sid = manifest.snapshot_id
    section = manifest.components.get(name) or {}
    arrays: dict = {}
    if section.get("objects"):
        for key, chunks in section["objects"].items():
            meta = section.get("tensors", {}).get(key)
            if not isinstance(meta, dict) or meta.get("dtype") not in safetensors_io.ITEMSIZE:
                raise CorruptSnapshotError(f"{sid}: tensor {key!r} of {name!r} has no valid dtype", snapshot_id=sid,
                                           problems=["bad tensor meta"])
            raw = read_tensor_bytes(storage, section.get("objects_algo", ""), chunks)
            shape = meta.get("shape")
            if not isinstance(shape, list) or len(raw) != math.prod(shape) * safetensors_io.ITEMSIZE[meta["dtype"]]:
                raise CorruptSnapshotError(f"{sid}: tensor {key!r} of {name!r}: bytes do not match its shape",
                                           snapshot_id=sid, problems=["object size mismatch"])
            arrays[key] = safetensors_io.to_torch(meta["dtype"], shape, memoryview(raw))
    # Without dedup every tensor is here; with dedup, the small ones are.
    entry = next((f for f in manifest.files_of(name) if f.role == "tensors"), None)
    if entry is not None:
        raw = read_verified(storage, sid, entry, readonly_ok=readonly_ok)
        listed = section.get("tensors") or {}
        for key, (code, shape, view) in safetensors_io.decode(raw, where=f"{sid}/{entry.path}").items():
            if key in arrays:
                raise CorruptSnapshotError(f"{sid}: tensor {key!r} of {name!r} is both in {entry.path} and in objects/",
                                           snapshot_id=sid, problems=["tensor stored twice"])
            if key in listed and (listed[key].get("dtype"), listed[key].get("shape")) != (code, shape):
                raise CorruptSnapshotError(
                    f"{sid}/{entry.path}: tensor {key!r} is {code} {shape} in the file but "
                    f"{listed[key].get('dtype')} {listed[key].get('shape')} in the manifest", snapshot_id=sid,
                    path=entry.path, problems=["tensor meta mismatch"])
            arrays[key] = safetensors_io.to_torch(code, shape, view)
    return arrays


def _read_arrow(data: bytearray, where: str):
    import pyarrow as pa

    try:
        table = pa.ipc.open_file(pa.py_buffer(bytes(data))).read_all()
        table.validate(full=True)
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise CorruptSnapshotError(f"{where}: not a valid Arrow IPC file ({exc})", problems=["bad arrow"]) from None
    return table
