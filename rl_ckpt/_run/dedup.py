"""Content-addressed tensor storage (``dedup: true``): unchanged data is stored once.

Each tensor's bytes are cut into fixed-size chunks; a chunk is stored as
``objects/<algo>/<hh>/<digest>`` where ``digest`` is its checksum, so an object
verifies itself. A manifest lists, per tensor, its chunk digests. A frozen
reference model, frozen layers, or the unchanged rows of a large tensor cost
nothing after the first snapshot.

Safety:
- A chunk is reused only when a *committed* manifest known to this writer
  references it and the object is present with the right size; anything else
  is (re)written, durably, before the manifest that references it commits.
- Nothing here deletes. Unreferenced objects are swept by ``gc``
  (mark-and-sweep over committed manifests), only when every manifest could be
  read and only for objects older than the grace period, so a crash or an
  in-flight save can never lose live data.
"""

from __future__ import annotations

from typing import Iterable

from rl_ckpt._format.checksum import new_hasher
from rl_ckpt._format.hashed_io import hash_files
from rl_ckpt.config import CHECKSUM_ALGOS, FIELDS
from rl_ckpt.errors import CorruptSnapshotError, StorageError
from rl_ckpt._format.manifest import Manifest
from rl_ckpt._run.layout import OBJECTS
from rl_ckpt._storage import Storage

CHUNK_BYTES = 8 * 1024 * 1024
BATCH_BYTES = 64 * 1024 * 1024  # new objects are published in batches (one sync pass each) of about this size
BATCH_FILES = 64


def object_path(algo: str, digest: str) -> str:
    return f"{OBJECTS}/{algo}/{digest[:2]}/{digest}"


def parse_object_path(path: str) -> tuple[str, str] | None:
    """``(algo, digest)`` of a content-addressed object's path (:func:`object_path`); None for any other path."""
    parts = path.split("/")
    if len(parts) != 4 or parts[0] != OBJECTS or not parts[3] or parts[2] != parts[3][:2]:
        return None
    return parts[1], parts[3]


def manifest_objects(manifest: Manifest) -> dict[str, tuple[str, int]]:
    """Every object a manifest references: digest -> (algo, size).

    Plain components list theirs under ``objects``; a sharded component's
    chunks name theirs in its layout. A malformed layout reference raises
    CorruptSnapshotError (so gc, unable to tell what is live, sweeps nothing)."""
    out = {}
    for section in manifest.components.values():
        algo = section.get("objects_algo")
        for tensor in (section.get("objects") or {}).values():
            for digest, size in tensor:
                out[digest] = (algo, size)
        if isinstance(section, dict) and isinstance(section.get("layout"), dict):
            out.update(layout_objects(section["layout"], manifest.snapshot_id))
    return out


def layout_objects(layout: dict, where: str) -> dict[str, tuple[str, int]]:
    """The objects the chunks of one sharded layout (its JSON) reference: digest -> (algo, size)."""
    out: dict[str, tuple[str, int]] = {}
    algo = layout.get("algo")
    tensors = layout.get("tensors")
    if not isinstance(tensors, dict):
        return out
    for fqn, tensor in tensors.items():
        chunks = tensor.get("chunks") if isinstance(tensor, dict) else None
        for chunk in chunks if isinstance(chunks, list) else ():
            refs = chunk.get("objects") if isinstance(chunk, dict) else None
            if refs is None:
                continue
            if (
                algo not in CHECKSUM_ALGOS
                or not isinstance(refs, list)
                or not all(
                    isinstance(r, list)
                    and len(r) == 2
                    and isinstance(r[0], str)
                    and r[0]
                    and not r[0].strip("0123456789abcdef")
                    and isinstance(r[1], int)
                    and not isinstance(r[1], bool)
                    for r in refs
                )
            ):
                raise CorruptSnapshotError(
                    f"{where}: sharded layout of {fqn!r}: malformed dedup object references",
                    snapshot_id=where,
                    problems=["malformed object reference"],
                )
            for digest, size in refs:
                out[digest] = (algo, size)
    return out


class ObjectWriter:
    """Writes the chunks of one save; reuses chunks that committed snapshots already hold."""

    def __init__(
        self,
        storage: Storage,
        algo: str,
        committed: Iterable[str] = (),
        *,
        min_bytes: int = FIELDS["dedup_min_tensor_bytes"][0],
    ) -> None:
        self.storage = storage
        self.algo = algo
        self.min_bytes = min_bytes  # smaller tensors stay in the snapshot's safetensors file
        self.committed = set(committed)
        self.seen: set[str] = set()
        self.bytes_written = 0
        self.bytes_reused = 0
        self._pending: list[tuple[str, memoryview, str, int]] = []  # (path, bytes, digest, size), not yet written
        self._pending_bytes = 0
        self._folders: set[str] = set()  # object folders known to exist

    def put(self, view: memoryview, verify: bool) -> list[list]:
        """Store a tensor's bytes; returns its chunk list ``[[digest, size], ...]``.

        Every chunk is hashed first; the chunks a committed snapshot already holds are then checked all at once
        (``hash_files`` with ``verify``, else ``stat_many``: one request for the tensor where the backend
        can) and reused; the rest are written, in batches."""
        chunks, fresh = [], []  # fresh: (digest, chunk) of the chunks this save has not met yet
        for start in range(0, max(view.nbytes, 1), CHUNK_BYTES):
            chunk = view[start : start + CHUNK_BYTES]
            hasher = new_hasher(self.algo)
            hasher.update(chunk)
            digest = hasher.hexdigest()
            chunks.append([digest, chunk.nbytes])
            if digest in self.seen:
                self.bytes_reused += chunk.nbytes
                continue
            self.seen.add(digest)
            fresh.append((digest, chunk))
        reusable = self._reusable([(d, c.nbytes) for d, c in fresh if d in self.committed], verify)
        for digest, chunk in fresh:
            if digest in reusable:
                self.bytes_reused += chunk.nbytes
                continue
            self._pending.append((object_path(self.algo, digest), chunk, digest, chunk.nbytes))
            self._pending_bytes += chunk.nbytes
            if self._pending_bytes >= BATCH_BYTES or len(self._pending) >= BATCH_FILES:
                self.flush(verify)
        return chunks

    def _reusable(self, candidates: list[tuple[str, int]], verify: bool) -> set[str]:
        """Of ``candidates`` (digest, size), objects that committed snapshots reference, those present with that
        size and, with ``verify``, whose stored bytes hash to their name: with verify-after-write the new
        snapshot vouches only for bytes it has read back, so an object that rotted in place (or is missing,
        short, or not a regular file) is written again, a good copy over the bad one."""
        if not candidates:
            return set()
        paths = [object_path(self.algo, digest) for digest, _size in candidates]
        try:
            if verify:
                got = hash_files(self.storage, paths, self.algo)
                return {d for (d, size), g in zip(candidates, got) if g == (size, d)}
            entries = self.storage.stat_many(paths)
        except StorageError:
            return set()
        return {d for (d, size), e in zip(candidates, entries) if e is not None and not e.is_dir and e.size == size}

    def flush(self, verify: bool) -> None:
        """Publish the pending objects durably (one batch), then read each back if ``verify``.

        Callers flush before a manifest may reference what ``put`` returned;
        the bytes handed to ``put`` must stay unchanged until then.
        """
        if not self._pending:
            return
        batch, self._pending, self._pending_bytes = self._pending, [], 0
        for folder in sorted({path.rsplit("/", 1)[0] for path, *_ in batch} - self._folders):
            self.storage.makedirs(folder)
            self._folders.add(folder)
        self.storage.write_many_atomic([(path, chunk) for path, chunk, _digest, _size in batch])
        self.bytes_written += sum(size for *_, size in batch)
        if verify:
            for _path, _chunk, digest, size in batch:
                check_written(self.storage, self.algo, digest, size)


def check_object(storage: Storage, algo: str, digest: str, size: int) -> bytearray:
    """Read an object and prove it is what its name says; CorruptSnapshotError otherwise."""
    path = object_path(algo, digest)
    hasher = new_hasher(algo)
    try:
        data = storage.read(path, on_chunk=hasher.update)
    except StorageError as exc:
        raise CorruptSnapshotError(f"object {path}: {exc}", path=path, problems=["object unreadable"]) from exc
    if len(data) != size or hasher.hexdigest() != digest:
        raise CorruptSnapshotError(
            f"object {path}: content does not match its name (corrupt)",
            path=path,
            problems=["object checksum mismatch"],
        )
    return data


def check_written(storage: Storage, algo: str, digest: str, size: int) -> None:
    """Verify-after-write of an object just written (:func:`check_object`); the storage is told it passed."""
    check_object(storage, algo, digest, size)
    storage.read_back_verified(object_path(algo, digest))


def read_tensor_bytes(storage: Storage, algo: str, chunks: list):
    """Reassemble one tensor's bytes from its verified chunks (into a buffer that is not zero-filled first)."""
    import numpy as np

    from rl_ckpt._storage.buffers import alloc_bytes

    total = sum(size for _digest, size in chunks)
    out = alloc_bytes(total)
    pos = 0
    for digest, size in chunks:
        out[pos : pos + size] = np.frombuffer(check_object(storage, algo, digest, size), dtype=np.uint8)
        pos += size
    return out
