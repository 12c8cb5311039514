"""Staging for background saves: copy the state into host buffers the trainer never touches.

The only part of an async save that blocks training is this copy. Buffers are
allocated on the first save (or ahead of it, on a thread: ``StagingArea.warm``)
and reused by every later one (re-allocated only when a tensor's dtype or
element count changes), so steady-state saves do no allocation. One staging
area holds one staged copy: the engine waits for the save in flight to finish
before staging again.

CUDA tensors go to *pinned* host buffers, copied with ``non_blocking=True`` on
a side stream of their device (after the stream has waited for the trainer's
current stream, so every kernel that produced the tensor has run); ``finish``
records an event on each side stream used and waits for it, so when the
blocking phase ends the bytes are on the host and the trainer may change its
GPU tensors at once. CPU tensors are copied synchronously into ordinary buffers.

The buffer logic (:class:`HostBufferPool`) takes its allocator as an argument
and knows nothing of CUDA; the CUDA calls sit in :class:`DeviceCopies`.
"""

from __future__ import annotations

import threading
from typing import Callable, Hashable

import numpy as np
import torch

from rl_ckpt._format.state_codec import EncodedState
from rl_ckpt._storage.buffers import alloc_bytes

# allocate(numel, dtype, pinned) -> a 1-D tensor of numel elements on the host
Allocator = Callable[[int, torch.dtype, bool], torch.Tensor]


def torch_allocator(numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """Host memory from torch; page-locked when ``pinned`` (the target of an asynchronous device-to-host copy)."""
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pinned)


class HostBufferPool:
    """Host buffers kept by key and reused from one save to the next.

    A key's buffer is reused while its (dtype, element count, pinned) stays the
    same (a reshape reuses it too) and re-allocated when it changes; the
    buffers of keys a round did not ask for are released by ``release_unused``.
    """

    def __init__(self, allocate: Allocator = torch_allocator) -> None:
        self.allocate = allocate
        self._buffers: dict[Hashable, torch.Tensor] = {}
        self._pinned: dict[Hashable, bool] = {}
        self.allocations = 0  # how many buffers were (re)allocated: flat after the first save

    def __contains__(self, key: Hashable) -> bool:
        return key in self._buffers

    def keys(self) -> list:
        return list(self._buffers)

    def get(self, key: Hashable) -> torch.Tensor | None:
        return self._buffers.get(key)

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool's buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def buffer(self, key: Hashable, shape, dtype: torch.dtype, *, pinned: bool = False) -> torch.Tensor:
        """A host tensor of ``shape``/``dtype`` for ``key``: last round's one when it fits, else a new one."""
        numel = 1
        for n in shape:
            numel *= int(n)
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != dtype or buf.numel() != numel or self._pinned[key] != pinned:
            buf = self.allocate(numel, dtype, pinned)
            if buf.dtype != dtype or buf.numel() != numel or buf.device.type != "cpu":
                raise ValueError(
                    f"staging allocator returned {buf.dtype}[{buf.numel()}] on {buf.device} "
                    f"for {dtype}[{numel}] on the host"
                )
            self._buffers[key] = buf
            self._pinned[key] = pinned
            self.allocations += 1
        return buf.view(tuple(shape))

    def fits(self, key: Hashable, numel: int, dtype: torch.dtype, pinned: bool) -> bool:
        """True when ``key``'s buffer would be reused for ``numel`` elements of ``dtype``."""
        buf = self._buffers.get(key)
        return buf is not None and buf.dtype == dtype and buf.numel() == numel and self._pinned[key] == pinned

    def offer(self, key: Hashable, buf: torch.Tensor, pinned: bool) -> bool:
        """Keep ``buf`` (allocated ahead, e.g. by a warm-up) as ``key``'s buffer unless one that fits is there."""
        if self.fits(key, buf.numel(), buf.dtype, pinned):
            return False
        self._buffers[key] = buf
        self._pinned[key] = pinned
        self.allocations += 1
        return True

    def release_unused(self, live: set) -> None:
        """Drop the buffers of keys not in ``live`` (a tensor or component that is gone)."""
        for key in list(self._buffers):
            if key not in live:
                del self._buffers[key]
                del self._pinned[key]


class DeviceCopies:
    """Copies into host buffers: synchronous from the CPU, asynchronous on a side stream from a CUDA device.

    ``finish`` waits for every asynchronous copy issued since the last
    ``finish``. The side streams are created once per device and reused.
    Copies may be issued from several threads (a background stager and a
    trainer thread helping it): the stream bookkeeping is locked.

    An unmarked copy makes the side stream wait for the calling thread's
    current stream first. A background save calls ``mark`` on the trainer's
    thread at the end of the save call instead: the side stream of each device
    waits once for the trainer's current stream there, and the copies issued
    later from another thread (whose current stream is not the trainer's) are
    ordered after it, so they read the tensors as of the call.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, object] = {}
        self._active: dict[torch.device, object] = {}  # streams with copies issued since the last finish
        self._marked: set[torch.device] = set()  # side streams ordered after the trainer's work at the save call
        self._lock = threading.Lock()
        self.async_copies = 0

    def _stream(self, device: torch.device) -> object:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        self._active[device] = stream
        return stream

    def mark(self, devices) -> None:
        """On the trainer's thread, at the save call: later copies from ``devices`` wait for its work so far."""
        with self._lock:
            for device in devices:
                self._stream(device).wait_stream(torch.cuda.current_stream(device))
                self._marked.add(device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if not src.is_cuda:
            dst.copy_(src)
            return
        with self._lock:
            stream = self._stream(src.device)
            if src.device not in self._marked:  # copy only what the caller's stream has computed
                stream.wait_stream(torch.cuda.current_stream(src.device))
            self.async_copies += 1
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(stream)  # a temporary freed before ``finish`` is not reused while the copy reads it

    def order_current_after(self) -> None:
        """Make the calling thread's current streams wait for every copy issued so far (the host does not wait).

        A trainer about to change a GPU tensor calls this once the copy reading
        it is issued: its kernels then run after the copy."""
        with self._lock:
            active = list(self._active.items())
        for device, stream in active:
            torch.cuda.current_stream(device).wait_stream(stream)

    def sync(self) -> None:
        """Block until every copy issued so far has landed (the round stays open: ``finish`` ends it)."""
        with self._lock:
            active = list(self._active.values())
        for stream in active:
            stream.record_event().synchronize()

    def finish(self) -> None:
        """Block until every copy issued so far has landed in host memory."""
        with self._lock:
            active, self._active, self._marked = self._active, {}, set()
        for stream in active.values():
            stream.record_event().synchronize()


class StagingArea:
    """Reused host buffers that hold one staged copy of the state.

    A round is ``stage``/``stage_tensor`` calls followed by ``finish``, which
    waits for the device-to-host copies and releases the buffers of keys the
    round did not stage. Keys are ``(component, key)`` pairs.
    """

    def __init__(self, allocate: Allocator = torch_allocator) -> None:
        self.pool = HostBufferPool(allocate)
        self.copies = DeviceCopies()
        self._arrays: dict[tuple[str, str], np.ndarray] = {}  # numpy values (no device, no pinning)
        self._array_allocations = 0
        self._touched: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self.bytes_copied = 0
        self.warmed = threading.Event()  # set when the last ``warm`` has handed over its buffers
        self.warmed.set()
        self.warming: threading.Thread | None = None

    @property
    def allocations(self) -> int:
        """How many buffers were (re)allocated: flat after the first save."""
        return self.pool.allocations + self._array_allocations

    @property
    def buffers(self) -> dict[tuple[str, str], object]:
        """The staging buffers by ``(component, key)`` (a copy of the mapping, not of the buffers)."""
        out: dict = {k: self.pool.get(k) for k in self.pool.keys()}
        out.update(self._arrays)
        return out

    def stage_tensor(self, key: tuple[str, str], value: torch.Tensor) -> torch.Tensor:
        """A host copy of ``value`` in this area's buffer for ``key`` (complete only after ``finish``)."""
        buf = self.reserve(key, value)
        self.copies.copy(buf, value.detach())
        return buf

    def warm(self, specs: list) -> int:
        """Allocate and fault in buffers ahead of a round, on a thread; returns the bytes it prepares.

        ``specs``: ``((component, key), shape, dtype, pinned)``. A buffer is
        handed to the pool only once its pages are touched (``offer``), so a
        round that reserves a key first allocates its own and the warm-up's is
        dropped; the warm-up never writes into a buffer a round copies into."""
        todo = []
        with self._lock:
            for key, shape, dtype, pinned in specs:
                numel = 1
                for n in shape:
                    numel *= int(n)
                if not self.pool.fits(key, numel, dtype, pinned):
                    todo.append((key, numel, dtype, pinned))
        if not todo:
            return 0

        def run() -> None:
            for key, numel, dtype, pinned in todo:
                buf = self.pool.allocate(numel, dtype, pinned)
                if numel:
                    buf.view(torch.uint8).fill_(0)  # touch every page now, not in the round's copy
                with self._lock:
                    self.pool.offer(key, buf, pinned)
            self.warmed.set()

        self.warmed = threading.Event()
        self.warming = threading.Thread(target=run, name="rl_ckpt-staging-warm-up", daemon=True)
        self.warming.start()
        return sum(n * d.itemsize for _k, n, d, _p in todo)

    def reserve(self, key: tuple[str, str], value: torch.Tensor) -> torch.Tensor:
        """The buffer ``value`` is to be copied into for ``key`` (allocated or reused), counted in this round.

        Thread-safe: a background stager and a helping trainer thread reserve
        disjoint keys, then copy outside the lock (``self.copies.copy``)."""
        with self._lock:
            buf = self.pool.buffer(key, value.shape, value.dtype, pinned=value.is_cuda and torch.cuda.is_available())
            self.bytes_copied += value.numel() * value.element_size()
            self._touched.add(key)
            return buf

    def _stage_array(self, key: tuple[str, str], value: np.ndarray) -> np.ndarray:
        if key in self.pool:  # was a tensor last round
            self.pool.release_unused(set(self.pool.keys()) - {key})
        buf = self._arrays.get(key)
        if not (isinstance(buf, np.ndarray) and buf.shape == value.shape and buf.dtype == value.dtype):
            buf = (
                np.empty(value.shape, dtype=value.dtype)
                if value.dtype.hasobject
                else alloc_bytes(value.nbytes).view(value.dtype).reshape(value.shape)
            )
            self._arrays[key] = buf
            self._array_allocations += 1
        np.copyto(buf, value)
        self.bytes_copied += value.nbytes
        self._touched.add(key)
        return buf

    def stage(self, name: str, enc: EncodedState, defer: list | None = None) -> EncodedState:
        """Copy ``enc``'s arrays into this area's buffers; returns the staged state (complete after ``finish``).

        ``defer``: tensors are not copied now; each is appended to it as
        ``((name, key), tensor)`` and left as None in the staged state, for a
        background stager to ``reserve`` and copy (NumPy arrays are copied now).
        """
        staged = {}
        for key, value in enc.arrays.items():
            if isinstance(value, torch.Tensor):
                self._arrays.pop((name, key), None)
                if defer is not None:
                    defer.append(((name, key), value.detach()))
                    staged[key] = None
                else:
                    staged[key] = self.stage_tensor((name, key), value)
            else:
                staged[key] = self._stage_array((name, key), value)
        # The tree is JSON data nobody changes (an encode plan's cached tree is shared, never mutated) and pyarrow
        # tables are immutable: no copy needed.
        return EncodedState(tree=enc.tree, arrays=staged, tables=dict(enc.tables))

    def finish(self) -> None:
        """End the round: wait for every device-to-host copy, then free the buffers the round did not use.

        After this returns the staged bytes are on the host: the trainer may
        change its tensors (CPU or GPU) at once."""
        try:
            self.copies.finish()
        finally:
            touched, self._touched = self._touched, set()
            self.release_unused(touched)

    def release_unused(self, live: set[tuple[str, str]]) -> None:
        """Free the buffers of ``(component, key)`` pairs not in ``live`` (a key or component that is gone).

        Called after each staging round, when no save is using the previous round's buffers."""
        with self._lock:  # (a warm-up may be handing buffers over)
            self.pool.release_unused(live)
        for key in list(self._arrays):
            if key not in live:
                del self._arrays[key]
