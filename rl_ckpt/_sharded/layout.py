"""The global layout of a sharded component, as it sits in the manifest.

A sharded component's manifest section holds ``"layout"``: for every tensor
FQN its global shape, dtype and chunks. A chunk is the part one rank wrote:
its global offsets and sizes, the file and byte range holding it, and one
checksum per *block* of ``block_rows`` consecutive rows (dim 0), so a rank
that needs a few rows of a chunk reads and verifies only the blocks around
them. Non-tensor values (optimizer hyperparameters) are JSON under
``"values"``. Every rank writes its own part; :func:`merge_components`
unions the parts before the commit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from rl_ckpt._format.checksum import digest_bytes
from rl_ckpt.errors import CheckpointError, CorruptSnapshotError
from rl_ckpt._format.dtypes import ITEMSIZE
from rl_ckpt._storage.base import check_relpath

LAYOUT_VERSION = 1
HEX = "0123456789abcdef"


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One stored piece of a tensor: ``sizes`` elements at global ``offsets``, at ``start`` in ``file``,
    or (with dedup) the concatenation of the content-addressed ``objects`` ``((digest, size), ...)``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the snapshot folder ("" for a chunk stored as objects)
    start: int  # byte offset of the chunk's data in the file
    block_rows: int  # rows (dim 0) per checksum block; 0-d chunks count as one row
    checksums: tuple[str, ...]  # one hex digest per block; one concatenated string in JSON (compact, fast)
    objects: tuple[tuple[str, int], ...] = ()  # dedup objects named by the layout's algo, in order

    @property
    def rows(self) -> int:
        return self.sizes[0] if self.sizes else 1

    def row_bytes(self, dtype: str) -> int:
        return math.prod(self.sizes[1:]) * ITEMSIZE[dtype] if self.sizes else ITEMSIZE[dtype]

    def to_json(self) -> dict:
        out = {
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "block_rows": self.block_rows,
            "checksums": "".join(self.checksums),
        }
        if self.objects:
            out["objects"] = [[d, n] for d, n in self.objects]
        else:
            out.update(file=self.file, start=self.start)
        return out


@dataclasses.dataclass
class TensorLayout:
    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "chunks": [c.to_json() for c in self.chunks]}


@dataclasses.dataclass
class Layout:
    """Everything a reader needs to find, verify and place every byte of a sharded component."""

    algo: str
    tensors: dict[str, TensorLayout] = dataclasses.field(default_factory=dict)
    values: dict[str, Any] = dataclasses.field(default_factory=dict)  # fqn -> state_codec JSON tree
    saved_by: dict = dataclasses.field(default_factory=dict)  # the writers' mesh: world_size, mesh shape

    def to_json(self) -> dict:
        return {
            "version": LAYOUT_VERSION,
            "algo": self.algo,
            "saved_by": dict(self.saved_by),
            "tensors": {k: t.to_json() for k, t in sorted(self.tensors.items())},
            "values": dict(self.values),
        }

    @classmethod
    def from_json(cls, d: Any, where: str) -> "Layout":
        """Parse and check a layout: types, bounds, byte counts; CorruptSnapshotError naming the tensor."""

        def bad(reason: str) -> CorruptSnapshotError:
            return CorruptSnapshotError(
                f"{where}: sharded layout: {reason}", snapshot_id=where.split("/")[0], problems=[reason]
            )

        if not isinstance(d, dict) or d.get("version") != LAYOUT_VERSION:
            raise bad(f"not a version {LAYOUT_VERSION} layout object")
        if (
            not isinstance(d.get("algo"), str)
            or not isinstance(d.get("tensors"), dict)
            or not isinstance(d.get("values", {}), dict)
            or not isinstance(d.get("saved_by", {}), dict)
        ):
            raise bad("algo/tensors/values/saved_by malformed")
        out = cls(d["algo"], values=dict(d.get("values", {})), saved_by=dict(d.get("saved_by", {})))
        try:
            width = len(digest_bytes(d["algo"], b""))
        except CheckpointError:
            raise bad(f"unknown checksum algorithm {d['algo']!r}") from None
        for fqn, t in d["tensors"].items():
            if (
                not isinstance(t, dict)
                or t.get("dtype") not in ITEMSIZE
                or not _ints(t.get("shape"))
                or not isinstance(t.get("chunks"), list)
            ):
                raise bad(f"tensor {fqn!r}: dtype/shape/chunks malformed")
            shape = tuple(t["shape"])
            tl = TensorLayout(t["dtype"], shape)
            for c in t["chunks"]:
                tl.chunks.append(_chunk(c, fqn, tl, width, bad))
            out.tensors[fqn] = tl
        return out

    def check_complete(self, where: str) -> None:
        """Every tensor's chunks cover it exactly (no rank's part missing); CorruptSnapshotError otherwise."""
        for fqn, t in self.tensors.items():
            covered = sum(math.prod(c.sizes) for c in t.chunks)
            overlap = any(_overlaps(a, b) for i, a in enumerate(t.chunks) for b in t.chunks[i + 1 :])
            if covered != math.prod(t.shape) or overlap:
                raise CorruptSnapshotError(
                    f"{where}: sharded layout: the chunks of tensor {fqn!r} cover {covered} of {math.prod(t.shape)} "
                    f"elements{' and overlap' if overlap else ''}: a rank's part is missing or duplicated",
                    snapshot_id=where.split("/")[0],
                    problems=[f"incomplete tensor {fqn}"],
                )


def is_sharded_section(section: Any) -> bool:
    """A manifest component section that holds a sharded component (it has a global layout)."""
    return isinstance(section, dict) and "layout" in section


def _overlaps(a: Chunk, b: Chunk) -> bool:
    return (
        all(x < y + m and y < x + n for x, n, y, m in zip(a.offsets, a.sizes, b.offsets, b.sizes))
        and math.prod(a.sizes) > 0
        and math.prod(b.sizes) > 0
    )


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def _chunk_objects(c: dict, fqn: str, tl: TensorLayout, width: int, bad) -> tuple[tuple[str, int], ...]:
    """A deduplicated chunk's objects, checked: hex digests of the layout's algo, sizes adding up to the chunk."""
    objs = c["objects"]
    if (
        not isinstance(objs, list)
        or not objs
        or not all(
            isinstance(o, list)
            and len(o) == 2
            and isinstance(o[0], str)
            and len(o[0]) == width
            and not o[0].strip(HEX)
            and isinstance(o[1], int)
            and not isinstance(o[1], bool)
            and o[1] >= 0
            for o in objs
        )
    ):
        raise bad(f"tensor {fqn!r}: chunk objects must be a list of [hex digest, size] pairs")
    want = math.prod(c["sizes"]) * ITEMSIZE[tl.dtype]
    if sum(o[1] for o in objs) != want:
        raise bad(
            f"tensor {fqn!r}: chunk at {c['offsets']} has objects of {sum(o[1] for o in objs)} bytes, "
            f"its {c['sizes']} elements take {want}"
        )
    return tuple((d, n) for d, n in objs)


def _chunk(c: Any, fqn: str, tl: TensorLayout, width: int, bad) -> Chunk:
    keys = {"offsets", "sizes", "file", "start", "block_rows", "checksums"}
    in_objects = {"offsets", "sizes", "objects", "block_rows", "checksums"}
    deduped = isinstance(c, dict) and set(c) == in_objects
    if deduped:
        c = {**c, "file": "", "start": 0}
    elif not isinstance(c, dict) or set(c) != keys:
        raise bad(f"tensor {fqn!r}: a chunk must have exactly {sorted(keys)} (or objects in place of file/start)")
    if not (_ints(c["offsets"]) and _ints(c["sizes"]) and len(c["offsets"]) == len(c["sizes"]) == len(tl.shape)):
        raise bad(f"tensor {fqn!r}: chunk offsets/sizes do not match shape {list(tl.shape)}")
    if any(o + s > n for o, s, n in zip(c["offsets"], c["sizes"], tl.shape)):
        raise bad(f"tensor {fqn!r}: chunk at {c['offsets']} of {c['sizes']} runs past shape {list(tl.shape)}")
    if (
        not isinstance(c["file"], str)
        or not isinstance(c["start"], int)
        or isinstance(c["start"], bool)
        or c["start"] < 0
        or not isinstance(c["block_rows"], int)
        or c["block_rows"] < 1
        or not isinstance(c["checksums"], str)
        or len(c["checksums"]) % width
    ):
        raise bad(f"tensor {fqn!r}: chunk file/start/block_rows/checksums malformed")
    objects = _chunk_objects(c, fqn, tl, width, bad) if deduped else ()
    if not deduped:
        check_relpath(c["file"])
    sums = tuple(c["checksums"][i : i + width] for i in range(0, len(c["checksums"]), width))
    chunk = Chunk(tuple(c["offsets"]), tuple(c["sizes"]), c["file"], c["start"], c["block_rows"], sums, objects)
    if len(chunk.checksums) != math.ceil(chunk.rows / chunk.block_rows):
        raise bad(
            f"tensor {fqn!r}: chunk at {list(chunk.offsets)} has {len(chunk.checksums)} block checksums, "
            f"expected {math.ceil(chunk.rows / chunk.block_rows)}"
        )
    return chunk


def merge_layouts(a: Layout, b: Layout, where: str = "") -> Layout:
    """The union of two ranks' parts of one component (ValueError-free: conflicts are CorruptSnapshotError)."""
    if a.algo != b.algo:
        raise CorruptSnapshotError(
            f"{where}: ranks used different checksum algorithms ({a.algo}, {b.algo})", problems=["algo mismatch"]
        )
    out = Layout(
        a.algo,
        {k: TensorLayout(t.dtype, t.shape, list(t.chunks)) for k, t in a.tensors.items()},
        dict(a.values),
        dict(a.saved_by or b.saved_by),
    )
    for fqn, t in b.tensors.items():
        mine = out.tensors.get(fqn)
        if mine is None:
            out.tensors[fqn] = TensorLayout(t.dtype, t.shape, list(t.chunks))
            continue
        if (mine.dtype, mine.shape) != (t.dtype, t.shape):
            raise CorruptSnapshotError(
                f"{where}: ranks disagree on tensor {fqn!r}: {mine.dtype}{list(mine.shape)} "
                f"vs {t.dtype}{list(t.shape)}",
                problems=["tensor mismatch"],
            )
        seen = {c.offsets for c in mine.chunks}
        mine.chunks += [c for c in t.chunks if c.offsets not in seen]  # a replica written twice is kept once
    for fqn, v in b.values.items():
        out.values.setdefault(fqn, v)
    return out


def merge_components(components: dict, new: dict) -> dict:
    """``components`` updated with one participant's sections; sharded sections of the same key are unioned.

    The pure function the commit (manager or rank 0) applies to every
    participant's manifest part, in place of a plain ``dict.update``.
    """
    for key, section in new.items():
        old = components.get(key)
        if isinstance(old, dict) and isinstance(section, dict) and "layout" in old and "layout" in section:
            merged = merge_layouts(Layout.from_json(old["layout"], key), Layout.from_json(section["layout"], key), key)
            components[key] = {
                **old,
                "layout": merged.to_json(),
                "tensors": {k: {"dtype": t.dtype, "shape": list(t.shape)} for k, t in sorted(merged.tensors.items())},
            }
        else:
            components[key] = section
    return components


def mesh_name(saved_by: dict) -> str:
    """A layout as people name it: ``FSDP(4)``, ``HSDP(2x2)``, ``unsharded``, else the mesh and placements."""
    mesh = [n for n in saved_by.get("mesh") or [] if _count(n, 0)]  # the manifest is untrusted JSON
    placements = [str(p) for p in saved_by.get("placements") or []]
    if not mesh:
        return "unsharded"
    shard = [p[:1] == "S" for p in placements]  # Shard(dim=0) prints as S(0), Replicate() as R
    if len(mesh) == 1 and shard == [True]:
        return f"FSDP({mesh[0]})"
    if len(mesh) == 2 and shard == [False, True]:
        return f"HSDP({mesh[0]}x{mesh[1]})"
    return f"mesh {'x'.join(map(str, mesh))} {placements}"


def _count(v: Any, default: int = 1) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else default


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def layout_change(components: dict, restart: dict | None) -> str:
    """One line naming the saved layout of a manifest's sharded components and the layout they restore onto.

    ``components``: a manifest's component sections; ``restart``: the
    ``saved_by()`` of the restarting process's sharded state (world size,
    mesh, placements), or None when unknown (planning from the CLI). Empty
    when the snapshot holds no sharded component.
    """
    groups: dict[tuple, list[str]] = {}
    for key, section in sorted(components.items()):
        if isinstance(section, dict) and isinstance(section.get("layout"), dict):
            saved = section["layout"].get("saved_by") or {}
            if not isinstance(saved, dict):
                saved = {}
            sig = (_count(saved.get("world_size")), mesh_name(saved))
            groups.setdefault(sig, []).append(key)
    if not groups:
        return ""
    after = ""
    if restart is not None:
        world = _count(restart.get("world_size"))
        after = f" -> restored on {_ranks(world)} as {mesh_name(restart)}"
    parts = []
    for (world, name), keys in groups.items():
        same = restart is not None and (world, name) == (_count(restart.get("world_size")), mesh_name(restart))
        parts.append(
            f"{', '.join(keys)} saved by {_ranks(world)} as {name}{after}"
            + (" (same layout)" if same else " (resharded)" if restart is not None else "")
        )
    return "; ".join(parts)
