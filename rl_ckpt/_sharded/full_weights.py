"""Full weights from a sharded snapshot into an ordinary module: for rollout workers (no process group).

Streams tensor by tensor and chunk by chunk: peak memory is the module plus
one chunk buffer. Every block read is verified against the manifest.
"""

from __future__ import annotations

import torch

from rl_ckpt.errors import StateMismatchError
from rl_ckpt._format.manifest import Manifest
from rl_ckpt._storage import Storage


def load_full_weights(storage: Storage, manifest: Manifest, key: str, module: torch.nn.Module) -> int:
    """Copy component ``key`` of ``manifest`` into ``module``'s tensors in place; returns bytes read.

    The module's state dict keys, shapes and dtypes must match the saved
    FQNs, or :class:`StateMismatchError` lists what differs (nothing is changed then).
    """
    from rl_ckpt._sharded.component import chunk_reader  # (lazy: torch.distributed.checkpoint, see __init__)

    reader = chunk_reader(storage, manifest, key)
    layout = reader.layout
    targets = module.state_dict(keep_vars=True)
    problems = [f"{k}: in snapshot, not in module" for k in layout.tensors if k not in targets]
    problems += [f"{k}: in module, not in snapshot" for k in targets if k not in layout.tensors]
    from rl_ckpt._format.safetensors_io import CODE_TO_TORCH

    for k, t in layout.tensors.items():
        if k in targets:
            have = targets[k]
            if tuple(have.shape) != t.shape or have.dtype != CODE_TO_TORCH[t.dtype]:
                problems.append(f"{k}: snapshot {t.dtype}{list(t.shape)} != module {have.dtype}{list(have.shape)}")
    if problems:
        raise StateMismatchError(
            f"{manifest.snapshot_id}: component {key!r} does not fit {type(module).__name__}:\n  "
            + "\n  ".join(problems[:50]),
            component=key,
            mismatches=problems,
            snapshot_id=manifest.snapshot_id,
        )
    with torch.no_grad():
        for fqn, t in layout.tensors.items():
            dest = targets[fqn].detach()
            for chunk in t.chunks:
                src = reader.rows(fqn, chunk, 0, chunk.rows)
                view = dest
                for dim, (off, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
                    view = view.narrow(dim, off, size)
                view.copy_(src)
    return reader.bytes_read
