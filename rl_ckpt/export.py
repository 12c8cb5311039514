"""Export one component of a snapshot as a plain safetensors file others can load."""

from __future__ import annotations

import os

from . import safetensors_io
from .errors import CheckpointError, StorageError
from .manifest import Manifest
from .reader import read_verified
from .storage import Storage


def export_component(storage: Storage, manifest: Manifest, component: str, out_path: str) -> dict:
    """Verify and write ``component``'s tensors to ``out_path``; returns name -> {dtype, shape}.

    The output is written to a temp file, fsynced and renamed, so a crash never
    leaves a half-written export under ``out_path``.
    """
    sid = manifest.snapshot_id
    if component not in manifest.components:
        have = ", ".join(sorted(manifest.components)) or "(none)"
        raise CheckpointError(f"{sid} has no component {component!r}; it has: {have}", component=component)
    entry = next((f for f in manifest.files_of(component) if f.role == "tensors"), None)
    if entry is None:
        raise CheckpointError(f"{sid}: component {component!r} holds no tensors (only JSON/tables); nothing to export",
                              component=component)
    raw = read_verified(storage, sid, entry)
    arrays = {k: safetensors_io.to_torch(c, s, v) for k, (c, s, v) in safetensors_io.decode(raw, where=f"{sid}/{entry.path}").items()}
    chunks, meta = safetensors_io.encode(arrays, metadata={"format": "pt", "rl_ckpt_snapshot": sid, "component": component})
    tmp = f"{out_path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_path)
    except OSError as exc:
        raise StorageError(f"cannot write export {out_path}: {exc.strerror or exc}", path=out_path) from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return meta
