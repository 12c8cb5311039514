"""Export one component of a snapshot as a plain safetensors file others can load."""

from __future__ import annotations

import os

from rl_ckpt.format import safetensors_io
from rl_ckpt.errors import CheckpointError, StorageError
from rl_ckpt.format.manifest import Manifest
from rl_ckpt.core.reader import load_arrays
from rl_ckpt.storage import Storage


def export_component(storage: Storage, manifest: Manifest, component: str, out_path: str) -> dict:
    """Verify and write ``component``'s tensors to ``out_path``; returns name -> {dtype, shape}.

    The output is written to a temp file, fsynced and renamed, so a crash never
    leaves a half-written export under ``out_path``.
    """
    sid = manifest.snapshot_id
    if component not in manifest.components:
        have = ", ".join(sorted(manifest.components)) or "(none)"
        raise CheckpointError(f"{sid} has no component {component!r}; it has: {have}", component=component)
    arrays = load_arrays(storage, manifest, component)
    if not arrays:
        raise CheckpointError(f"{sid}: component {component!r} holds no tensors (only JSON/tables); nothing to export",
                              component=component)
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
