"""Read snapshots back: load and decode components — checksums first.

Nothing is deserialized before its bytes matched the manifest's checksum: a
file is read once into memory, hashed, compared (``read_verified``), and only
then parsed. Reading the manifest and verifying files is
:mod:`rl_ckpt._run.snapshot_files`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rl_ckpt.errors import CheckpointError, CorruptSnapshotError
from rl_ckpt._format import safetensors_io
from rl_ckpt._format.arrow_io import read_table
from rl_ckpt._format.manifest import Manifest
from rl_ckpt._format.state_codec import decode_state
from rl_ckpt._format.untrusted import parse_json
from rl_ckpt._run.dedup import read_tensor_bytes
from rl_ckpt._run.snapshot_files import read_verified
from rl_ckpt._storage import Storage

__all__ = ["load_arrays", "load_component", "aligned", "into_optimizer_state"]

MAX_JSON_BYTES = 256 * 1024 * 1024


def load_component(
    storage: Storage,
    manifest: Manifest,
    name: str,
    *,
    as_numpy: bool = False,
    readonly_ok: bool = False,
    into: Any = None,
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
    ``into``: the object the state is for. For an optimizer, from a storage whose ``read_view`` shares memory (the
    memory tier), the tensors are read without a copy and then copied into the optimizer's own state tensors of
    the same shape and dtype (memory it already has; :func:`into_optimizer_state`): one copy, nothing allocated.
    """
    sid = manifest.snapshot_id
    section = manifest.components.get(name)
    if section is None:
        raise CorruptSnapshotError(
            f"{sid}: component {name!r} is not in this snapshot", snapshot_id=sid, problems=[f"no component {name}"]
        )
    entries = {f.role: f for f in manifest.files_of(name) if f.role != "table"}
    by_path = {f.path: f for f in manifest.files_of(name)}
    # An optimizer that holds state (a restore into a running process) gets its tensors copied into that state; one
    # that holds none yet (a new process) gets them copied once into one buffer of its own, hashed as it fills.
    in_place = not readonly_ok and storage.shares_views and isinstance(into, torch.optim.Optimizer) and bool(into.state)
    arrays = load_arrays(storage, manifest, name, readonly_ok=readonly_ok or in_place)
    if not readonly_ok and not in_place:
        # The stored arrays, not the decoded tensors: views of one stored array stay views of one array.
        arrays = {key: aligned(t) for key, t in arrays.items()}
    tables = {}
    for table_name, rel in (section.get("tables") or {}).items():
        entry = by_path.get(rel)
        if entry is None:
            raise CorruptSnapshotError(
                f"{sid}: table {table_name!r} file {rel!r} not listed",
                snapshot_id=sid,
                problems=["table file missing from manifest"],
            )
        tables[table_name] = read_table(read_verified(storage, sid, entry), f"{sid}/{rel}")
    if "json" not in entries:
        raise CorruptSnapshotError(
            f"{sid}: component {name!r} has no JSON structure file", snapshot_id=sid, problems=["json missing"]
        )
    where = f"{sid}/{entries['json'].path}"
    tree = parse_json(
        read_verified(storage, sid, entries["json"]),
        where,
        error=CorruptSnapshotError,
        snapshot_id=sid,
        problems=["bad json"],
    )
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
                raise CorruptSnapshotError(
                    f"{sid}: tensor {key!r} of {name!r} has no valid dtype",
                    snapshot_id=sid,
                    problems=["bad tensor meta"],
                )
            raw = read_tensor_bytes(storage, section.get("objects_algo", ""), chunks)
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
        raw = read_verified(storage, sid, entry, readonly_ok=readonly_ok)
        listed = section.get("tensors") or {}
        for key, (code, shape, view) in safetensors_io.decode(raw, where=f"{sid}/{entry.path}").items():
            if key in arrays:
                raise CorruptSnapshotError(
                    f"{sid}: tensor {key!r} of {name!r} is both in {entry.path} and in objects/",
                    snapshot_id=sid,
                    problems=["tensor stored twice"],
                )
            if key in listed and (listed[key].get("dtype"), listed[key].get("shape")) != (code, shape):
                raise CorruptSnapshotError(
                    f"{sid}/{entry.path}: tensor {key!r} is {code} {shape} in the file but "
                    f"{listed[key].get('dtype')} {listed[key].get('shape')} in the manifest",
                    snapshot_id=sid,
                    path=entry.path,
                    problems=["tensor meta mismatch"],
                )
            arrays[key] = safetensors_io.to_torch(code, shape, view)
    return arrays


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
