"""Bitwise digests the sharded GRPO demo logs to compare runs: a rollout batch, every learner rank's batch of a
step, the whole policy gathered from its shards. Equal digests, equal bytes; the drills compare a faulted or
resumed run with an uninterrupted one by them."""

from __future__ import annotations

import hashlib

import torch


def batch_digest(batch: dict[str, torch.Tensor]) -> bytes:
    """A bitwise digest of a rollout batch (sequences, log-probs, rewards): equal digests, equal rollouts."""
    h = hashlib.sha256()
    for key in ("seqs", "logps", "rewards"):
        h.update(batch[key].contiguous().numpy().tobytes())
    return h.digest()


def gathered(digest: bytes, world: int) -> list[str]:
    """Every rank's ``digest`` (its rollouts of a step), in rank order (a collective: every rank calls it)."""
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(world)]
    torch.distributed.all_gather(out, mine)
    return [bytes(t.tolist()).hex()[:16] for t in out]


def weights_digest(model: torch.nn.Module) -> str:
    """A bitwise digest of the whole policy, gathered from the shards (a collective: every rank calls it); the same
    weights give the same digest on any number of ranks."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for key, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        h.update(key.encode())
        h.update(full.detach().contiguous().numpy().tobytes())
    return h.hexdigest()
