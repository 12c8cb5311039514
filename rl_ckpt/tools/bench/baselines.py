"""The floor and the peers: raw writev/read, hashing, torch.save, safetensors and torch.distributed.checkpoint."""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING

from rl_ckpt.tools.bench.common import IOV_MAX, IO_CHUNK, fsync_path, rmtree

if TYPE_CHECKING:
    import torch


def raw_write(path: str, views: list[memoryview]) -> int:
    """One file, writev() calls of up to 64 MiB (small tensors coalesced without copying), fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    total = 0
    try:
        batch: list[memoryview] = []
        size = 0

        def flush() -> None:
            nonlocal total
            pending = [v for v in batch if v.nbytes]
            while pending:
                n = os.writev(fd, pending)
                total += n
                while pending and n >= pending[0].nbytes:
                    n -= pending[0].nbytes
                    pending.pop(0)
                if pending and n:
                    pending[0] = pending[0][n:]
            batch.clear()

        for view in views:
            for start in range(0, view.nbytes, IO_CHUNK):
                part = view[start : start + IO_CHUNK]
                if size + part.nbytes > IO_CHUNK or len(batch) >= IOV_MAX:
                    flush()
                    size = 0
                batch.append(part)
                size += part.nbytes
        flush()
        os.fsync(fd)
    finally:
        os.close(fd)
    parent = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(parent)
    finally:
        os.close(parent)
    return total


def raw_read(path: str) -> torch.Tensor:
    """The whole file into one preallocated buffer, 64 MiB readinto() calls."""
    import torch

    size = os.path.getsize(path)
    buf = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buf.numpy()).cast("B") if size else memoryview(b"")
    got = 0
    with open(path, "rb", buffering=0) as f:
        while got < size:
            n = f.readinto(view[got : got + IO_CHUNK])
            if not n:
                break
            got += n
    if got != size:
        raise OSError(f"short read of {path}: {got} of {size}")
    return buf


def time_raw_floor(sm, cache, path: str, views: list[memoryview]) -> None:
    """The floor every run is measured against: ``raw_write`` + fsync, then a cold ``raw_read`` (timed into ``sm``)."""
    sm.timed("raw_write", lambda: raw_write(path, views))
    cache.drop(path)
    buf = sm.timed("raw_read", lambda: raw_read(path))
    del buf
    rmtree(path)


def hash_all(views: list[memoryview], algo: str) -> str:
    from rl_ckpt._format.checksum import new_hasher

    h = new_hasher(algo)
    for v in views:
        for start in range(0, v.nbytes, 16 << 20):
            h.update(v[start : start + (16 << 20)])
    return h.hexdigest()


# ----------------------------------------------------------------------------- peers
def quiet_dcp() -> None:
    """Silence torch DCP's single-process warnings in the bench output."""
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def torch_save(path: str, state: dict) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def st_save(path: str, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, path)
    fsync_path(path)


def dcp_save(path: str, state: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save(state, storage_writer=FileSystemWriter(path))


def dcp_async_save(path: str, state: dict):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    return dcp.async_save(state, storage_writer=FileSystemWriter(path))


def dcp_load(path: str, state: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    dcp.load(state, storage_reader=FileSystemReader(path))
