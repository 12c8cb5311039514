"""Background saves of sharded state: local shards staged into reused host buffers (CPU/gloo here; CUDA/NCCL
where GPUs are present, skipped elsewhere). Real ranks, real files; comparisons are bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

import sharded_store_workers as sw
import sharded_workers as w


def spawn(fn, world: int, *args) -> None:
    mp.spawn(fn, args=(world, w.free_port(), *args), nprocs=world)


def test_async_sharded_saves_reuse_host_buffers_and_restore_the_staged_state(tmp_path):
    spawn(sw.staging_job, 2, str(tmp_path / "run"), str(tmp_path))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA staging path is not run here")
def test_cuda_fsdp2_shards_staged_pinned_and_complete_when_save_async_returns(tmp_path):
    spawn(sw.cuda_staging_job, min(2, torch.cuda.device_count()), str(tmp_path / "run"), str(tmp_path))
