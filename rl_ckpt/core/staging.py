"""Staging for background saves: copy the state into host buffers the trainer never touches.

The only part of an async save that blocks training is this copy. Buffers are
allocated on the first save and reused by every later one (re-allocated only
when a tensor's shape or dtype changes), so steady-state saves do no
allocation. One staging area holds one staged copy: the engine waits for the
save in flight to finish before staging again.
"""

from __future__ import annotations

import numpy as np
import torch

from rl_ckpt.format.state_codec import EncodedState
from rl_ckpt.storage.buffers import alloc_bytes


class StagingArea:
    """Reused host buffers that hold one staged copy of the state."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], object] = {}
        self.allocations = 0  # how many buffers were (re)allocated: flat after the first save
        self.bytes_copied = 0

    @property
    def buffers(self) -> dict[tuple[str, str], object]:
        """The staging buffers by ``(component, key)`` (a copy of the mapping, not of the buffers)."""
        return dict(self._buffers)

    def _buffer_like(self, key: tuple[str, str], value):
        buf = self._buffers.get(key)
        if isinstance(value, torch.Tensor):
            if not (isinstance(buf, torch.Tensor) and buf.shape == value.shape and buf.dtype == value.dtype):
                buf = torch.empty(value.shape, dtype=value.dtype, device="cpu",
                                  pin_memory=value.is_cuda and torch.cuda.is_available())
                self._buffers[key] = buf
                self.allocations += 1
        else:
            if not (isinstance(buf, np.ndarray) and buf.shape == value.shape and buf.dtype == value.dtype):
                buf = (np.empty(value.shape, dtype=value.dtype) if value.dtype.hasobject
                       else alloc_bytes(value.nbytes).view(value.dtype).reshape(value.shape))
                self._buffers[key] = buf
                self.allocations += 1
        return buf

    def stage(self, name: str, enc: EncodedState) -> EncodedState:
        """Copy ``enc``'s arrays into this area's buffers; returns the staged state."""
        staged = {}
        for key, value in enc.arrays.items():
            buf = self._buffer_like((name, key), value)
            if isinstance(value, torch.Tensor):
                buf.copy_(value, non_blocking=False)
                self.bytes_copied += value.numel() * value.element_size()
            else:
                np.copyto(buf, value)
                self.bytes_copied += value.nbytes
            staged[key] = buf
        # The tree is freshly built JSON data and pyarrow tables are immutable: no copy needed.
        return EncodedState(tree=enc.tree, arrays=staged, tables=dict(enc.tables))

    def release_unused(self, live: set[tuple[str, str]]) -> None:
        """Free the buffers of ``(component, key)`` pairs not in ``live`` (a key or component that is gone).

        Called after each staging round, when no save is using the previous round's buffers."""
        for key in list(self._buffers):
            if key not in live:
                del self._buffers[key]
