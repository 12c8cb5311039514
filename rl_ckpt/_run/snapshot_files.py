"""A committed snapshot's files against its manifest: read the manifest, read a file only if it
matches, re-hash files and dedup objects (``verify``).

Nothing is deserialized before its bytes matched the manifest's checksum: a file is read once
into memory, hashed as it lands, compared, and only then handed on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

from rl_ckpt.errors import CheckpointError, CorruptSnapshotError, FileTooLargeError, StorageError, UnsafePathError
from rl_ckpt._format.checksum import new_hasher
from rl_ckpt._format.hashed_io import hash_file
from rl_ckpt._format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, FileEntry, Manifest, parse_snapshot_id
from rl_ckpt._run.dedup import check_object, manifest_objects, object_path
from rl_ckpt._storage import Storage, join


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
        lines = [
            f"verified {len(self.checked)} snapshot(s): " + ("all OK" if self.ok else f"{len(self.bad_snapshots)} bad")
        ]
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
                "have; refusing to read it",
                snapshot_id=snapshot_id,
                problems=["manifest too large"],
            )
        data = storage.read(path)
    except StorageError as exc:
        raise CorruptSnapshotError(
            f"{snapshot_id}: cannot read manifest ({exc})", snapshot_id=snapshot_id, problems=[str(exc)]
        ) from exc
    manifest = Manifest.from_bytes(data, snapshot_id)
    parsed = parse_snapshot_id(snapshot_id)
    if parsed is not None and (parsed[0] != manifest.global_step or parsed[2] != manifest.kind):
        raise CorruptSnapshotError(
            f"{snapshot_id}: manifest says step {manifest.global_step} ({manifest.kind}); the folder name says "
            f"step {parsed[0]} ({parsed[2]}). The manifest is corrupt; refusing it",
            snapshot_id=snapshot_id,
            problems=["step/kind mismatch"],
        )
    if manifest.snapshot_id != snapshot_id:
        raise CorruptSnapshotError(
            f"{snapshot_id}: manifest names snapshot {manifest.snapshot_id!r}; it was copied or renamed, refusing it",
            snapshot_id=snapshot_id,
            problems=["snapshot_id mismatch"],
        )
    return manifest


def check_file(storage: Storage, snapshot_id: str, entry: FileEntry, throttle=None) -> str | None:
    """Re-hash one file; the problem as text, or None when it matches."""
    path = join(snapshot_id, entry.path)
    try:
        if not storage.exists(path):
            return "missing"
        size, digest = hash_file(storage, path, entry.algo, throttle, size_hint=entry.size)
    except UnsafePathError as exc:
        return f"unsafe: {exc}"
    except CheckpointError as exc:
        return f"unreadable: {exc}"
    if size != entry.size:
        return f"size {size} != {entry.size} in manifest (truncated or overwritten)"
    if digest != entry.checksum:
        return f"{entry.algo} checksum mismatch (content changed)"
    return None


def verify_snapshot(
    storage: Storage, snapshot_id: str, report: VerifyReport | None = None, *, progress=None, throttle=None
) -> VerifyReport:
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


def read_verified(
    storage: Storage, snapshot_id: str, entry: FileEntry, *, readonly_ok: bool = False, timing: dict | None = None
):
    """The file's bytes, only if they match the manifest (else CorruptSnapshotError).

    ``readonly_ok``: a storage with ``read_view`` (the memory tier) may return a read-only view of memory it
    shares (no copy); the hash covers exactly the bytes of that view, and the caller must never write to it.
    ``timing``: seconds spent reading and hashing are added to its ``read`` and ``hash`` keys.
    """
    path = join(snapshot_id, entry.path)
    started = time.perf_counter()
    hasher = _Hashing(entry.algo)
    try:
        # No stat first (one metadata call less per file): the read itself refuses a file larger than the manifest
        # says before reading it, and a shorter one is caught by its length below.
        with _refused(snapshot_id, entry):
            read = storage.read_view if readonly_ok else storage.read
            data = read(path, on_chunk=hasher.update, max_bytes=entry.size)
    finally:
        hasher.account(timing, started)
    if len(data) != entry.size:
        raise CorruptSnapshotError(
            f"{snapshot_id}/{entry.path}: size {len(data)} != {entry.size} in manifest",
            snapshot_id=snapshot_id,
            path=entry.path,
            problems=["size mismatch"],
        )
    _check_digest(snapshot_id, entry, hasher)
    return data


def read_verified_into(
    storage: Storage, snapshot_id: str, entry: FileEntry, pieces, *, timing: dict | None = None
) -> None:
    """The file read into the caller's ``pieces`` (``Storage.read_into``: ``(offset, buffer)`` covering it in
    order), hashed as each piece lands; CorruptSnapshotError unless it matches the manifest. The pieces hold the
    file's bytes either way: a caller that placed them where they are used must not use them after an error."""
    path = join(snapshot_id, entry.path)
    started = time.perf_counter()
    hasher = _Hashing(entry.algo)
    try:
        with _refused(snapshot_id, entry):
            storage.read_into(path, pieces, on_chunk=hasher.update)
    finally:
        hasher.account(timing, started)
    _check_digest(snapshot_id, entry, hasher)


@contextlib.contextmanager
def _refused(snapshot_id: str, entry: FileEntry):
    """A read of ``entry`` that storage refused, as the snapshot's ``CorruptSnapshotError`` naming the file."""
    try:
        yield
    except FileTooLargeError as exc:
        raise CorruptSnapshotError(
            f"{snapshot_id}/{entry.path}: size {exc.size} != {entry.size} in manifest",
            snapshot_id=snapshot_id,
            path=entry.path,
            problems=["size mismatch"],
        ) from None
    except StorageError as exc:
        raise CorruptSnapshotError(
            f"{snapshot_id}/{entry.path}: {exc}", snapshot_id=snapshot_id, path=entry.path, problems=["unreadable"]
        ) from exc


class _Hashing:
    """A hasher whose ``update`` keeps the seconds it took (the restore's breakdown: read vs hash)."""

    def __init__(self, algo: str) -> None:
        self.hasher = new_hasher(algo)
        self.seconds = 0.0

    def update(self, piece) -> None:
        started = time.perf_counter()
        self.hasher.update(piece)
        self.seconds += time.perf_counter() - started

    def account(self, timing: dict | None, started: float) -> None:
        if timing is not None:
            timing["hash"] = timing.get("hash", 0.0) + self.seconds
            timing["read"] = timing.get("read", 0.0) + time.perf_counter() - started - self.seconds


def _check_digest(snapshot_id: str, entry: FileEntry, hasher: _Hashing) -> None:
    if hasher.hasher.hexdigest() != entry.checksum:
        raise CorruptSnapshotError(
            f"{snapshot_id}/{entry.path}: {entry.algo} checksum mismatch; the file changed after commit",
            snapshot_id=snapshot_id,
            path=entry.path,
            problems=["checksum mismatch"],
        )
