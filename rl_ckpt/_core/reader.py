"""Read snapshots back: load and decode components — checksums first.

Nothing is decoded before its bytes matched the manifest's checksum: a file is read once, hashed as it lands,
compared (``read_verified``), and only then parsed. Where the object a component is for has a tensor of the right
shape and dtype for a stored tensor (a module's parameters and buffers, an optimizer's state), that tensor's bytes
are read straight into it (``own_slots``; the file's layout is taken from the manifest, its header is parsed only
once the file matched its checksum and must agree): one read, no buffer to copy from. Reading the manifest and
verifying files is :mod:`rl_ckpt._run.snapshot_files`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

from rl_ckpt.errors import CheckpointError, CorruptSnapshotError
from rl_ckpt._format import safetensors_io
from rl_ckpt._format.arrow_io import read_table
from rl_ckpt._format.manifest import FileEntry, Manifest
from rl_ckpt._format.state_codec import decode_state
from rl_ckpt._format.state_decode import tensor_refs
from rl_ckpt._format.untrusted import parse_json
from rl_ckpt._run.dedup import read_tensor_bytes
from rl_ckpt._run.snapshot_files import read_verified, read_verified_into
from rl_ckpt._storage import Storage
from rl_ckpt._storage.buffers import alloc_bytes, prefault_ranges

__all__ = [
    "LoadReport",
    "aligned",
    "copies_on_load",
    "into_optimizer_state",
    "load_arrays",
    "load_component",
    "own_slots",
]

MAX_JSON_BYTES = 256 * 1024 * 1024


@dataclasses.dataclass
class LoadReport:
    """What loading components did: seconds per phase (``read``, ``hash``, ``decode``; the loader adds ``copy``),
    and the components whose objects' own tensors received a file's bytes before its checksum was compared."""

    timing: dict = dataclasses.field(default_factory=dict)
    placed: list = dataclasses.field(default_factory=list)

    def add(self, phase: str, seconds: float) -> None:
        self.timing[phase] = self.timing.get(phase, 0.0) + seconds

    def merge(self, other: "LoadReport") -> None:
        """Add what loading another component did."""
        for phase, seconds in other.timing.items():
            self.add(phase, seconds)
        self.placed += other.placed

    def overlapped(self, wall: float) -> None:
        """Files were read at once (``Storage.files_at_once``): ``read`` becomes the wall time of that phase less
        the hashing and decoding summed over the files, so that the phases still add up to the restore's time."""
        self.timing["read"] = max(0.0, wall - self.timing.get("hash", 0.0) - self.timing.get("decode", 0.0))


def load_component(
    storage: Storage,
    manifest: Manifest,
    name: str,
    *,
    as_numpy: bool = False,
    readonly_ok: bool = False,
    into: Any = None,
    report: LoadReport | None = None,
) -> Any:
    """Verify and decode one component's state dict from a snapshot.

    By default every tensor is at least as good as what ``torch.load`` gives: writable, and at an address
    aligned as torch's allocator aligns (``ALIGN``), copied when it is not. An object that keeps the tensors
    it is given (an optimizer, a replay buffer) computes with them, and a tensor at an odd address is not
    equivalent: BLAS reductions (``dot`` in LBFGS) split their work by the address's alignment, so the same
    bytes elsewhere sum in another order and the run diverges after a restore. Files written since lay the
    large tensors out aligned (``safetensors_io.encode``), so read into an aligned buffer they are not copied.
    ``readonly_ok``: its tensors may be views of read-only memory the storage shares (``read_view``: no copy);
    only for a caller that copies them out (e.g. into a module's parameters) and never writes to them.
    ``into``: the object the state is for. A module (with ``torch.nn.Module``'s own ``load_state_dict``) or an
    optimizer gets each stored tensor that fits one of its own (``own_slots``) read straight into that tensor,
    which the decoded state then holds (loading it copies nothing). An optimizer with state, from a storage
    whose ``read_view`` shares memory, when its file could not be read that way, gets the tensors copied into its
    state tensors (:func:`into_optimizer_state`). ``report``: timings, and whether objects were written.
    """
    report = report if report is not None else LoadReport()
    started = time.perf_counter()
    before = report.timing.get("read", 0.0) + report.timing.get("hash", 0.0)
    sid = manifest.snapshot_id
    section = manifest.components.get(name)
    if section is None:
        raise CorruptSnapshotError(
            f"{sid}: component {name!r} is not in this snapshot", snapshot_id=sid, problems=[f"no component {name}"]
        )
    entries = {f.role: f for f in manifest.files_of(name) if f.role != "table"}
    by_path = {f.path: f for f in manifest.files_of(name)}
    if "json" not in entries:
        raise CorruptSnapshotError(
            f"{sid}: component {name!r} has no JSON structure file", snapshot_id=sid, problems=["json missing"]
        )
    where = f"{sid}/{entries['json'].path}"
    tree = parse_json(  # first: which stored tensor goes where
        read_verified(storage, sid, entries["json"], timing=report.timing),
        where,
        error=CorruptSnapshotError,
        snapshot_id=sid,
        problems=["bad json"],
    )
    slots = own_slots(into, tree, section.get("tensors") or {})
    in_place = not readonly_ok and storage.shares_views and isinstance(into, torch.optim.Optimizer) and bool(into.state)
    arrays = load_arrays(storage, manifest, name, readonly_ok=readonly_ok or in_place, slots=slots, report=report)
    in_place = in_place and name not in report.placed  # read into memory of its own already: nothing to copy
    if not readonly_ok and not in_place:
        # The stored arrays, not the decoded tensors: views of one stored array stay views of one array.
        arrays = {key: t if slots.get(key) is t else aligned(t) for key, t in arrays.items()}
    tables = {}
    for table_name, rel in (section.get("tables") or {}).items():
        entry = by_path.get(rel)
        if entry is None:
            raise CorruptSnapshotError(
                f"{sid}: table {table_name!r} file {rel!r} not listed",
                snapshot_id=sid,
                problems=["table file missing from manifest"],
            )
        tables[table_name] = read_table(read_verified(storage, sid, entry, timing=report.timing), f"{sid}/{rel}")
    try:
        state = decode_state(tree, arrays, tables, where=where)
        return into_optimizer_state(into, state) if in_place else state
    except CheckpointError:
        raise
    except (RecursionError, ValueError, TypeError, OverflowError, KeyError, IndexError, AttributeError) as exc:
        # The codec's own checks name the key; this net makes sure a forged structure they did not foresee
        # still reads as a bad snapshot (recovery falls back) and never as a crash.
        raise CorruptSnapshotError(
            f"{where}: cannot decode the state structure ({type(exc).__name__}: {str(exc)[:200]})",
            snapshot_id=sid,
            problems=["bad state structure"],
        ) from None
    finally:
        spent = report.timing.get("read", 0.0) + report.timing.get("hash", 0.0) - before
        report.add("decode", time.perf_counter() - started - spent)


def load_arrays(
    storage: Storage,
    manifest: Manifest,
    name: str,
    *,
    readonly_ok: bool = False,
    slots: dict | None = None,
    report: LoadReport | None = None,
) -> dict:
    """A component's tensors (verified), from its safetensors file or from dedup objects (``readonly_ok``:
    see :func:`load_component`; ``slots``: stored tensor name -> a tensor of the object to read it into,
    from :func:`own_slots`)."""
    report = report if report is not None else LoadReport()
    sid = manifest.snapshot_id
    section = manifest.components.get(name) or {}
    arrays: dict = {}
    if section.get("objects"):
        for key, chunks in section["objects"].items():
            meta = section.get("tensors", {}).get(key)
            if not isinstance(meta, dict) or meta.get("dtype") not in safetensors_io.ITEMSIZE:
                raise CorruptSnapshotError(
                    f"{sid}: tensor {key!r} of {name!r} has no valid dtype",
                    snapshot_id=sid,
                    problems=["bad tensor meta"],
                )
            started = time.perf_counter()
            raw = read_tensor_bytes(storage, section.get("objects_algo", ""), chunks)
            report.add("read", time.perf_counter() - started)
            shape = meta.get("shape")
            if not isinstance(shape, list) or len(raw) != math.prod(shape) * safetensors_io.ITEMSIZE[meta["dtype"]]:
                raise CorruptSnapshotError(
                    f"{sid}: tensor {key!r} of {name!r}: bytes do not match its shape",
                    snapshot_id=sid,
                    problems=["object size mismatch"],
                )
            arrays[key] = safetensors_io.to_torch(meta["dtype"], shape, memoryview(raw))
    # Without dedup every tensor is here; with dedup, the small ones are.
    entry = next((f for f in manifest.files_of(name) if f.role == "tensors"), None)
    if entry is not None:
        listed = section.get("tensors") or {}
        in_file = {k: m for k, m in listed.items() if k not in (section.get("objects") or {})}
        where = f"{sid}/{entry.path}"
        got = read_in_place(storage, sid, entry, in_file, slots or {}, report, name)
        if got is None:
            raw = read_verified(storage, sid, entry, readonly_ok=readonly_ok, timing=report.timing)
            got = {k: safetensors_io.to_torch(c, s, v) for k, (c, s, v) in checked(raw, where, listed, sid).items()}
        for key, tensor in got.items():
            if key in arrays:
                raise CorruptSnapshotError(
                    f"{sid}: tensor {key!r} of {name!r} is both in {entry.path} and in objects/",
                    snapshot_id=sid,
                    problems=["tensor stored twice"],
                )
            arrays[key] = tensor
    return arrays


def checked(raw: Any, where: str, listed: dict, sid: str) -> dict:
    """The tensors of the safetensors bytes ``raw`` (``safetensors_io.decode``), each as the manifest lists it."""
    out = safetensors_io.decode(raw, where=where)
    for key, (code, shape, _view) in out.items():
        if key in listed and (listed[key].get("dtype"), listed[key].get("shape")) != (code, shape):
            raise CorruptSnapshotError(
                f"{where}: tensor {key!r} is {code} {shape} in the file but "
                f"{listed[key].get('dtype')} {listed[key].get('shape')} in the manifest",
                snapshot_id=sid,
                path=where.split("/", 1)[-1],
                problems=["tensor meta mismatch"],
            )
    return out


def read_in_place(
    storage: Storage, sid: str, entry: FileEntry, in_file: dict, slots: dict, report: LoadReport, name: str
) -> dict | None:
    """The tensors of ``entry`` (a safetensors file), those of ``slots`` read straight into their slot, the rest
    into one buffer of the file's size of which only those pages are touched; None when no slot fits the file's
    layout as the manifest implies it (``safetensors_io.planned_layout``: the caller reads it whole). Once the
    file matched its checksum its header is decoded from the buffer; where it disagrees with the planned layout
    (a file laid out by another writer), the slots' bytes go back into the buffer and its tensors are used."""
    layout = safetensors_io.planned_layout(in_file, entry.size) if slots and storage.reads_into else None
    placed = {k: t for k, t in slots.items() if layout and k in layout and layout[k][1] > layout[k][0]}
    if not placed:
        return None
    buf = alloc_bytes(entry.size)
    view = memoryview(buf).cast("B")
    pieces, gaps, pos = [], [], 0
    for key in sorted(placed, key=lambda k: layout[k][0]):
        start, end = layout[key]
        if pos < start:
            pieces.append((pos, view[pos:start]))
            gaps.append((pos, start))
        pieces.append((start, safetensors_io.byte_view(placed[key])))
        pos = end
    if pos < entry.size:
        pieces.append((pos, view[pos:]))
        gaps.append((pos, entry.size))
    stop = prefault_ranges(buf, gaps)
    report.placed.append(name)
    try:
        read_verified_into(storage, sid, entry, pieces, timing=report.timing)
    finally:
        stop()
    where = f"{sid}/{entry.path}"
    decoded = checked(buf, where, in_file, sid)
    at = safetensors_io.data_offsets(buf, decoded)
    if any(at.get(k) != layout[k][0] for k in placed):
        for key, (start, end) in layout.items():
            if key in placed:
                view[start:end] = safetensors_io.byte_view(placed[key])
        decoded, placed = checked(buf, where, in_file, sid), {}
    to_torch = safetensors_io.to_torch
    return {k: placed[k] if k in placed else to_torch(code, shape, v) for k, (code, shape, v) in decoded.items()}


def copies_on_load(obj: Any) -> bool:
    """Whether ``obj.load_state_dict`` copies the tensors it is given (``torch.nn.Module``'s own does; another
    object says so with ``copies_on_load = True``, e.g. the RLlib integration's module parts), so that they may be
    read-only views of the read bytes."""
    return getattr(obj, "copies_on_load", None) is True or _module_copies(obj)


def _module_copies(obj: Any) -> bool:
    """Whether ``obj`` is a module with torch's own ``load_state_dict`` (its parameters and buffers are its state)."""
    return isinstance(obj, torch.nn.Module) and type(obj).load_state_dict is torch.nn.Module.load_state_dict


def own_slots(obj: Any, tree: Any, listed: dict) -> dict[str, torch.Tensor]:
    """Stored tensor name -> the tensor of ``obj``'s current state (``state_dict()``) at the place ``tree`` (the
    component's JSON structure) puts it, where its bytes may be read in place: for a module whose
    ``load_state_dict`` copies (its parameters and buffers), for an optimizer (its state, which it then keeps), and
    for an object that names the tensors its state loads into (``live_tensors()``: its state's structure holding
    them, or None; e.g. the RLlib integration's module and optimizer parts: the learner's own weights and Adam
    moments, which RLlib's ``set_state`` then has nothing left to copy into).

    Only when the state fits as a whole: a module whose tensors are exactly the stored ones, each of the dtype and
    shape the manifest lists (``listed``), or an optimizer holding state for the same parameters in groups of the
    same sizes, or an object's live tensors, with every stored tensor fitting its current one; otherwise none (a
    state that does not fit is refused as before, with nothing of it read into the object). A slot is a contiguous,
    non-empty CPU tensor and that stored tensor's alone: a tensor of the object at the places of two stored
    tensors, or overlapping another slot's memory, gets memory of its own instead.
    """
    if _module_copies(obj):
        current = obj.state_dict()
        refs = tensor_refs(tree)
        if any(len(path) != 1 for path, _key in refs) or set(current) != {path[0] for path, _key in refs}:
            return {}
    elif isinstance(obj, torch.optim.Optimizer):
        current = obj.state_dict()
        refs = tensor_refs(tree) if _same_groups(tree, current) else []
    elif callable(getattr(obj, "live_tensors", None)):
        current = obj.live_tensors()
        if not isinstance(current, dict) or not current:
            return {}
        refs = tensor_refs(tree, ndarrays=True)  # an object of its own may keep its state as NumPy arrays
    else:
        return {}
    found: dict[str, torch.Tensor] = {}
    shared: set[str] = set()
    for path, key in refs:
        target = _at(current, path)
        if target is None or not _fits(target, listed.get(key)):
            return {}
        if key in found and not _same_place(found[key], target):
            shared.add(key)
        found.setdefault(key, target)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), k) for k, t in found.items())
    for (_s1, e1, k1), (s2, _e2, k2) in zip(spans, spans[1:]):
        if s2 < e1:  # one tensor at two places, or views that overlap: neither is read in place
            shared.update((k1, k2))
    return {k: t for k, t in found.items() if k not in shared}


def _same_groups(tree: Any, current: dict) -> bool:
    """Whether the stored optimizer state (``tree``) is for the parameters ``current`` holds state for, in groups of
    the same sizes (what ``Optimizer.load_state_dict`` checks, and refuses otherwise)."""
    if not isinstance(tree, dict) or not isinstance(tree.get("param_groups"), list):
        return False
    stored = tree.get("state")
    pairs = stored.get("$dict") if isinstance(stored, dict) and len(stored) == 1 and "$dict" in stored else None
    ids = [p[0] for p in pairs if isinstance(p, list) and len(p) == 2] if isinstance(pairs, list) else None
    groups, now = tree["param_groups"], current.get("param_groups", [])
    return (
        ids is not None
        and sorted(ids, key=str) == sorted(current.get("state", {}), key=str)
        and len(groups) == len(now)
        and all(isinstance(g, dict) and len(g.get("params") or ()) == len(n["params"]) for g, n in zip(groups, now))
    )


def _at(state: Any, path: tuple) -> Any:
    for key in path:
        if isinstance(state, dict):
            state = state.get(key)
        elif isinstance(state, (list, tuple)) and isinstance(key, int) and 0 <= key < len(state):
            state = state[key]
        else:
            return None
    return state if isinstance(state, torch.Tensor) else None


def _fits(t: torch.Tensor, meta: Any) -> bool:
    return (
        isinstance(meta, dict)
        and safetensors_io.CODE_TO_TORCH.get(meta.get("dtype")) == t.dtype
        and meta.get("shape") == list(t.shape)
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and t.numel() > 0
        and t.is_contiguous()
        and not t.requires_grad
        and not t.is_conj()
        and not t.is_neg()
    )


def _same_place(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


def into_optimizer_state(optimizer: torch.optim.Optimizer, state: Any) -> Any:
    """``state`` (an optimizer's state dict whose tensors may be read-only shared memory) with every tensor made the
    optimizer's own: copied into its current state tensor at the same place when that one has the same shape,
    dtype and device and overlaps no other such target (views of one buffer are fine), else cloned.
    ``load_state_dict`` then keeps those tensors as they are."""
    current = optimizer.state_dict().get("state", {})
    targets: dict[int, torch.Tensor] = {}
    shared: set[int] = set()

    def fits(x: Any, cur: Any) -> bool:
        return (
            isinstance(x, torch.Tensor)
            and isinstance(cur, torch.Tensor)
            and cur.shape == x.shape
            and cur.dtype == x.dtype
            and cur.device == x.device
            and cur.is_contiguous()
            and not cur.requires_grad
        )

    def walk(x: Any, cur: Any, make) -> Any:
        if isinstance(x, torch.Tensor):
            return make(x, cur if fits(x, cur) else None)
        if isinstance(x, dict):
            return {k: walk(v, cur.get(k) if isinstance(cur, dict) else None, make) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            items = [walk(v, None, make) for v in x]
            return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
        return x

    def collect(x: torch.Tensor, cur: torch.Tensor | None) -> None:
        if cur is not None:
            if id(cur) in targets:
                shared.add(id(cur))  # one tensor at two places: each gets a copy of its own
            targets[id(cur)] = cur

    def own(x: torch.Tensor, cur: torch.Tensor | None) -> torch.Tensor:
        if cur is not None and id(cur) in safe:
            return cur.copy_(x)
        return x.clone(memory_format=torch.contiguous_format)

    walk(state.get("state") if isinstance(state, dict) else None, current, collect)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), key) for key, t in targets.items())
    safe = {
        key
        for i, (start, end, key) in enumerate(spans)
        if key not in shared
        and (i == 0 or spans[i - 1][1] <= start)
        and (i + 1 == len(spans) or end <= spans[i + 1][0])
    }
    if not isinstance(state, dict):
        return walk(state, None, own)
    return {k: walk(v, current if k == "state" else None, own) for k, v in state.items()}


def aligned(tensor):
    """``tensor``, or a copy in memory torch allocated when its address is not ``ALIGN``-byte aligned."""
    if not isinstance(tensor, torch.Tensor) or tensor.data_ptr() % safetensors_io.ALIGN == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
