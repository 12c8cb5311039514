"""A committed snapshot's weights into a plain module, piece by piece, moving only the pieces that changed.

A *piece* is a part of a component that its manifest vouches for with one content address:

- a dedup object of a plain tensor (a byte range of it; its digest is its name),
- a chunk of a sharded tensor (the digests of its dedup objects, or its block checksums),
- a plain component's own safetensors file of small tensors (its checksum).

Each piece has a *slot* (which tensor and where in it). :class:`WeightPuller` remembers the address it
placed at each slot; asked for another snapshot of the same weights, it moves only the pieces whose
address at their slot changed, so frozen layers, identical embeddings or LoRA-style updates cost nothing.
The module must not be changed between pulls by anything else (a rollout worker only reads it).

Every piece is verified in full (its bytes hashed against the manifest) before any byte of it reaches the
module, and nothing reaches the module until every changed piece verified: a bad piece leaves the module
as it was, holding the version it held. On a storage with ``read_view`` (the memory tier) a piece is
hashed where it lies (the node's shared memory) and copied once, into the module. A policy version's chunk
that its publisher read back whole as the very object this node's store holds (``vouched``: the reader maps
that same immutable object) is checked once, by that read-back, not again by each reader on that node.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import torch

from rl_ckpt.errors import CorruptSnapshotError, StateMismatchError, StorageError
from rl_ckpt._format.checksum import new_hasher
from rl_ckpt._format.manifest import FileEntry, Manifest
from rl_ckpt._format.safetensors_io import CODE_TO_TORCH, ITEMSIZE, decode, to_torch
from rl_ckpt._run.dedup import object_path
from rl_ckpt._run.snapshot_files import read_verified
from rl_ckpt._sharded.layout import Chunk, Layout, is_sharded_section
from rl_ckpt._storage import Storage

HASH_STEP = 8 << 20


@dataclasses.dataclass(frozen=True)
class Piece:
    """One verifiable part of a component: where it goes (``slot``), its content ``address`` and size."""

    slot: tuple
    address: str
    size: int
    fqn: str = ""
    start: int = 0  # byte offset within the tensor (plain dedup objects)
    objects: tuple[tuple[str, int], ...] = ()  # dedup objects holding it, in order
    entry: FileEntry | None = None  # a plain component's small-tensor file
    chunk: Chunk | None = None  # a sharded chunk

    def paths(self, algo: str) -> list[str]:
        """The run-relative storage paths this piece is read from (objects; a file's path needs its snapshot)."""
        return [object_path(algo, d) for d, _n in self.objects]


@dataclasses.dataclass
class Pieces:
    """Every piece of one component of one snapshot, with the tensors they fill: fqn -> (dtype code, shape)."""

    manifest: Manifest
    key: str
    algo: str
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    pieces: list[Piece]
    sharded: bool

    @property
    def total_bytes(self) -> int:
        return sum(p.size for p in self.pieces)

    def paths(self) -> list[str]:
        """Every storage path (run-relative) holding this component's bytes, its manifest last."""
        sid = self.manifest.snapshot_id
        out = [f"{sid}/{f.path}" for f in self.manifest.files_of(self.key)]
        for p in self.pieces:
            out += p.paths(self.algo)
        return list(dict.fromkeys(out + [f"{sid}/meta.json"]))


def component_pieces(manifest: Manifest, key: str) -> Pieces:
    """The pieces of component ``key`` of ``manifest`` (plain or sharded); CorruptSnapshotError if malformed."""
    sid = manifest.snapshot_id
    section = manifest.components.get(key)
    if not isinstance(section, dict):
        raise CorruptSnapshotError(
            f"{sid}: no component {key!r} (it has {sorted(manifest.components)})",
            snapshot_id=sid,
            problems=[f"no component {key}"],
        )
    if is_sharded_section(section):
        layout = Layout.from_json(section["layout"], f"{sid}/{key}")
        layout.check_complete(f"{sid}/{key}")
        pieces, tensors = [], {}
        for fqn, t in sorted(layout.tensors.items()):
            tensors[fqn] = (t.dtype, tuple(t.shape))
            for c in t.chunks:
                size = math.prod(c.sizes) * ITEMSIZE[t.dtype]
                address = "+".join(d for d, _n in c.objects) if c.objects else "blocks:" + "".join(c.checksums)
                pieces.append(
                    Piece(
                        ("chunk", fqn, tuple(c.offsets), tuple(c.sizes)),
                        address,
                        size,
                        fqn,
                        objects=tuple(c.objects),
                        chunk=c,
                    )
                )
        return Pieces(manifest, key, layout.algo, tensors, pieces, True)
    meta = section.get("tensors") or {}
    tensors = {}
    for fqn, m in meta.items():
        if not isinstance(m, dict) or m.get("dtype") not in ITEMSIZE or not isinstance(m.get("shape"), list):
            raise CorruptSnapshotError(
                f"{sid}: tensor {fqn!r} of {key!r} has no valid dtype/shape",
                snapshot_id=sid,
                problems=["bad tensor meta"],
            )
        tensors[fqn] = (m["dtype"], tuple(m["shape"]))
    algo = section.get("objects_algo") or ""
    pieces = []
    for fqn, chunks in sorted((section.get("objects") or {}).items()):
        start = 0
        for digest, size in chunks:
            pieces.append(Piece(("obj", fqn, start), digest, size, fqn, start, objects=((digest, size),)))
            start += size
        if fqn in tensors and start != math.prod(tensors[fqn][1]) * ITEMSIZE[tensors[fqn][0]]:
            raise CorruptSnapshotError(
                f"{sid}: tensor {fqn!r} of {key!r}: its objects do not add up to its shape",
                snapshot_id=sid,
                problems=["object size mismatch"],
            )
    for entry in manifest.files_of(key):
        if entry.role == "tensors":
            pieces.append(Piece(("file", entry.path), entry.checksum, entry.size, entry=entry))
    return Pieces(manifest, key, algo, tensors, pieces, False)


def check_fits(pieces: Pieces, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s tensors by name, if they match the component's names, shapes and dtypes; else
    StateMismatchError listing what differs (the module is not touched)."""
    targets = {k: v.detach() for k, v in module.state_dict(keep_vars=True).items()}
    problems = [f"{k}: in snapshot, not in module" for k in pieces.tensors if k not in targets]
    if pieces.sharded or pieces.tensors:
        problems += [f"{k}: in module, not in snapshot" for k in targets if k not in pieces.tensors]
    for k, (code, shape) in pieces.tensors.items():
        have = targets.get(k)
        if have is not None and (tuple(have.shape) != shape or have.dtype != CODE_TO_TORCH[code]):
            problems.append(f"{k}: snapshot {code}{list(shape)} != module {have.dtype}{list(have.shape)}")
        elif have is not None and not have.is_contiguous():
            problems.append(f"{k}: the module's tensor is not contiguous")
    if problems:
        sid = pieces.manifest.snapshot_id
        raise StateMismatchError(
            f"{sid}: component {pieces.key!r} does not fit {type(module).__name__}:\n  " + "\n  ".join(problems[:50]),
            component=pieces.key,
            mismatches=problems,
            snapshot_id=sid,
        )
    return targets


def read_object(
    storage: Storage,
    algo: str,
    digest: str,
    size: int,
    sid: str,
    view: memoryview | None = None,
    vouched: bool = False,
) -> memoryview:
    """A dedup object's bytes, hashed where they lie (``read_view``: no copy) and checked against its name.
    ``view``: its bytes read already (unverified), hashed here the same way. ``vouched``: ``view`` maps the very
    bytes (an immutable object on this node) that the publisher's read-back hashed against this name: only its
    size is checked."""
    if view is not None and vouched and view.nbytes == size:
        return memoryview(view).cast("B")
    path = object_path(algo, digest)
    hasher = new_hasher(algo)
    reader: Callable[..., Any] = getattr(storage, "read_view", None) or storage.read
    try:
        if view is None:
            data = memoryview(reader(path, on_chunk=hasher.update)).cast("B")
        else:
            data = memoryview(view).cast("B")
            for start in range(0, data.nbytes, HASH_STEP):
                hasher.update(data[start : start + HASH_STEP])
    except StorageError as exc:
        raise CorruptSnapshotError(
            f"{sid}: object {path}: {exc}", snapshot_id=sid, path=path, problems=["object unreadable"]
        ) from exc
    if data.nbytes != size or hasher.hexdigest() != digest:
        raise CorruptSnapshotError(
            f"{sid}: object {path} does not match its content address (corrupt): not loaded",
            snapshot_id=sid,
            path=path,
            problems=["object checksum mismatch"],
        )
    return data


@dataclasses.dataclass
class PullStats:
    """What one pull did: the snapshot, bytes moved (changed pieces) of the component's total."""

    snapshot_id: str
    bytes_moved: int
    bytes_total: int
    pieces_moved: int
    pieces_total: int
    bytes_vouched: int = 0  # of ``bytes_moved``: chunks this node's store had checked already (not hashed here)


class WeightPuller:
    """Pulls snapshots of one component into one module, remembering what it placed where (module docstring)."""

    def __init__(self, module: torch.nn.Module, key: str = "policy") -> None:
        self.module = module
        self.key = key
        self.held: dict[tuple, str] = {}  # slot -> content address now in the module
        self.snapshot_id: str | None = None

    def needed(self, pieces: Pieces) -> list[Piece]:
        """The pieces whose content at their slot differs from what the module holds."""
        return [p for p in pieces.pieces if self.held.get(p.slot) != p.address]

    def pull(
        self,
        storage: Storage,
        manifest: Manifest,
        pieces: Pieces | None = None,
        *,
        views: dict[str, memoryview] | None = None,
        vouched: set[str] | frozenset[str] = frozenset(),
    ) -> PullStats:
        """Move the changed pieces of ``manifest`` into the module; every one verified before any is applied.
        ``views``: run-relative path -> bytes read already (e.g. many in one call), verified here like any but
        those in ``vouched`` (objects read back whole by their publisher as the object mapped, see ``read_object``)."""
        pieces = pieces or component_pieces(manifest, self.key)
        targets = check_fits(pieces, self.module)
        todo = self.needed(pieces)
        sid = manifest.snapshot_id
        views = views or {}
        fetched = [(p, self._fetch(storage, pieces, p, views, vouched)) for p in todo]  # phase 1: read, verify all
        with torch.no_grad():  # phase 2: apply (nothing here can fail on the data)
            for piece, src in fetched:
                self._apply(targets, pieces, piece, src)
        # A slot the new snapshot does not have (a layout change) is forgotten: what sits there is unknown.
        self.held = {p.slot: p.address for p in pieces.pieces}
        self.snapshot_id = sid
        named = [(object_path(pieces.algo, d), n) for p in todo for d, n in p.objects]
        trusted = sum(n for path, n in named if path in vouched and path in views and views[path].nbytes == n)
        return PullStats(sid, sum(p.size for p in todo), pieces.total_bytes, len(todo), len(pieces.pieces), trusted)

    def forget(self) -> None:
        """Forget what the module holds (the next pull moves everything)."""
        self.held, self.snapshot_id = {}, None

    @staticmethod
    def _fetch(storage: Storage, pieces: Pieces, piece: Piece, views: dict, vouched=frozenset()) -> Any:
        sid = pieces.manifest.snapshot_id
        if piece.entry is not None:
            raw = read_verified(storage, sid, piece.entry, readonly_ok=True)
            where = f"{sid}/{piece.entry.path}"
            out = {}
            for k, (code, shape, view) in decode(raw, where=where).items():
                if pieces.tensors.get(k, (code, tuple(shape))) != (code, tuple(shape)):
                    raise CorruptSnapshotError(
                        f"{where}: tensor {k!r} is {code}{shape} in the file but {pieces.tensors[k]} in the manifest",
                        snapshot_id=sid,
                        problems=["tensor meta mismatch"],
                    )
                out[k] = to_torch(code, shape, view)
            return out
        if piece.objects:
            paths = [object_path(pieces.algo, d) for d, _n in piece.objects]
            got = [
                read_object(storage, pieces.algo, d, n, sid, views.get(path), path in vouched)
                for (d, n), path in zip(piece.objects, paths)
            ]
            if len(got) == 1:
                return got[0]
            joined = bytearray(sum(v.nbytes for v in got))
            pos = 0
            for v in got:
                joined[pos : pos + v.nbytes] = v
                pos += v.nbytes
            return memoryview(joined)
        from rl_ckpt._sharded.component import chunk_reader  # (lazy: torch.distributed.checkpoint)

        reader = chunk_reader(storage, pieces.manifest, pieces.key)  # a sharded chunk in a file: blocks verified
        return reader.rows(piece.fqn, piece.chunk, 0, piece.chunk.rows)

    @staticmethod
    def _apply(targets: dict, pieces: Pieces, piece: Piece, src: Any) -> None:
        if piece.entry is not None:
            for k, t in src.items():
                targets[k].copy_(t)
            return
        dest = targets[piece.fqn]
        if piece.chunk is not None:
            code = pieces.tensors[piece.fqn][0]
            if isinstance(src, memoryview):
                src = to_torch(code, list(piece.chunk.sizes), src)
            view = dest
            for dim, (off, size) in enumerate(zip(piece.chunk.offsets, piece.chunk.sizes)):
                view = view.narrow(dim, off, size)
            view.copy_(src.reshape(view.shape))
            return
        flat = dest.reshape(-1).view(torch.uint8)
        flat[piece.start : piece.start + piece.size].copy_(to_torch("U8", [piece.size], src))
