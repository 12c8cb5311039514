"""Staging buffers for background saves: the pool logic on CPU; the CUDA path where a GPU is present.

The CPU tests check the buffer pool (reuse, growth, release of vanished keys,
the allocator's pinned flag) and that the bytes staged equal the source. The
CUDA tests (skipped without a GPU) check pinned buffers, and that the staged
copy is complete when the blocking phase ends: the GPU tensor is changed right
after it and the staged bytes are still the old ones, bitwise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl_ckpt._core.staging import HostBufferPool, StagingArea, torch_allocator
from rl_ckpt._format.state_codec import encode_state

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA staging path is not run here")


class RecordingAllocator:
    """torch.empty on the host, recording every call (numel, dtype, pinned)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.dtype, bool]] = []

    def __call__(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        self.calls.append((numel, dtype, pinned))
        return torch.empty(numel, dtype=dtype)


def test_pool_reuses_a_buffer_while_dtype_and_size_stay():
    alloc = RecordingAllocator()
    pool = HostBufferPool(alloc)
    a = pool.buffer(("m", "w"), (4, 8), torch.float32)
    assert a.shape == (4, 8) and pool.allocations == 1
    b = pool.buffer(("m", "w"), (4, 8), torch.float32)
    c = pool.buffer(("m", "w"), (8, 4), torch.float32)  # same element count, another shape: same memory
    assert b.data_ptr() == a.data_ptr() == c.data_ptr() and c.shape == (8, 4)
    assert pool.allocations == 1 and alloc.calls == [(32, torch.float32, False)]
    assert pool.nbytes == 32 * 4


def test_pool_reallocates_on_growth_dtype_change_or_pinning():
    alloc = RecordingAllocator()
    pool = HostBufferPool(alloc)
    first = pool.buffer("k", (10,), torch.float32)
    grown = pool.buffer("k", (20,), torch.float32)
    assert grown.numel() == 20 and grown.data_ptr() != first.data_ptr() and pool.allocations == 2
    pool.buffer("k", (20,), torch.bfloat16)
    pool.buffer("k", (20,), torch.bfloat16, pinned=True)  # a CUDA source now: page-locked memory wanted
    assert alloc.calls == [
        (10, torch.float32, False),
        (20, torch.float32, False),
        (20, torch.bfloat16, False),
        (20, torch.bfloat16, True),
    ]
    assert pool.nbytes == 20 * 2  # one buffer per key: the old ones were dropped


def test_pool_releases_buffers_of_vanished_keys():
    pool = HostBufferPool(RecordingAllocator())
    for key in ("a", "b", "c"):
        pool.buffer(key, (3,), torch.int64)
    pool.release_unused({"a", "c"})
    assert sorted(pool.keys()) == ["a", "c"] and "b" not in pool
    pool.buffer("b", (3,), torch.int64)  # comes back: a new buffer
    assert pool.allocations == 4


def test_pool_rejects_an_allocator_that_returns_the_wrong_thing():
    pool = HostBufferPool(lambda numel, dtype, pinned: torch.empty(numel + 1, dtype=dtype))
    with pytest.raises(ValueError, match="staging allocator returned"):
        pool.buffer("k", (4,), torch.float32)


def test_default_allocator_pins_only_when_asked():
    assert not torch_allocator(4, torch.float32, False).is_pinned()


def test_staging_area_copies_exact_bytes_reuses_and_releases():
    alloc = RecordingAllocator()
    area = StagingArea(alloc)
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(64, 32, generator=g),
        "ids": torch.arange(100),
        "half": torch.randn(7, generator=g).half(),
        "np": np.arange(12, dtype=np.int32).reshape(3, 4),
    }
    staged = area.stage("c", encode_state("c", state, host=False))
    area.finish()
    for key, value in encode_state("c", state, host=False).arrays.items():
        src = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
        dst = (
            staged.arrays[key] if isinstance(staged.arrays[key], torch.Tensor) else torch.from_numpy(staged.arrays[key])
        )
        assert dst.dtype == src.dtype and dst.shape == src.shape
        assert dst.contiguous().view(torch.uint8).equal(src.contiguous().view(torch.uint8)), key  # bitwise
    assert (
        area.bytes_copied == sum(t.nbytes for t in state.values() if not isinstance(t, np.ndarray)) + state["np"].nbytes
    )
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v.copy() for k, v in staged.arrays.items()}
    state["w"].add_(1.0)  # the trainer changes its tensor right after the blocking phase
    for k, v in staged.arrays.items():
        assert v.equal(before[k]) if isinstance(v, torch.Tensor) else (v == before[k]).all(), k
    allocated = area.allocations
    assert allocated == 4 and all(not pinned for *_, pinned in alloc.calls)  # CPU sources: plain memory

    # The next round reuses every buffer; a key that vanished loses its buffer.
    del state["ids"]
    staged2 = area.stage("c", encode_state("c", state, host=False))
    area.finish()
    assert area.allocations == allocated
    assert staged2.arrays["w"].data_ptr() == staged.arrays["w"].data_ptr()
    assert torch.equal(staged2.arrays["w"], state["w"])
    assert set(area.buffers) == {("c", k) for k in staged2.arrays} and not any("ids" in k for _c, k in area.buffers)


def test_finish_releases_a_component_that_was_not_staged():
    area = StagingArea(RecordingAllocator())
    area.stage("a", encode_state("a", {"t": torch.ones(3)}, host=False))
    area.stage("b", encode_state("b", {"t": torch.ones(3)}, host=False))
    area.finish()
    area.stage("a", encode_state("a", {"t": torch.ones(3)}, host=False))
    area.finish()
    assert set(area.buffers) == {("a", "t")}


def test_non_contiguous_source_is_staged_contiguous_and_equal():
    area = StagingArea(RecordingAllocator())
    src = torch.arange(60, dtype=torch.float64).reshape(6, 10).t()  # a transposed view
    buf = area.stage_tensor(("m", "t"), src)
    area.finish()
    assert buf.is_contiguous() and torch.equal(buf, src)


# -- CUDA (skipped where there is no GPU) -------------------------------------------------------------
@cuda
def test_cuda_tensor_staged_into_pinned_buffer_complete_when_blocking_phase_ends():
    area = StagingArea()
    dev = torch.device("cuda", torch.cuda.current_device())
    big = torch.randn(4096, 1024, device=dev)  # 16 MiB: the copy takes long enough to race with a later kernel
    small = torch.arange(1000, device=dev, dtype=torch.int64)
    expected = {"big": big.cpu(), "small": small.cpu()}
    staged = {"big": area.stage_tensor(("m", "big"), big), "small": area.stage_tensor(("m", "small"), small)}
    area.finish()
    big.mul_(-3).add_(7)  # the trainer changes its GPU tensors right after the blocking phase
    small.zero_()
    torch.cuda.synchronize()
    for key, buf in staged.items():
        assert buf.is_pinned() and buf.device.type == "cpu", key
        assert buf.view(torch.uint8).equal(expected[key].view(torch.uint8)), key
    assert area.copies.async_copies == 2
    again = area.stage_tensor(("m", "big"), big)
    area.finish()
    assert again.data_ptr() == staged["big"].data_ptr() and torch.equal(again, big.cpu()) and area.allocations == 2


@cuda
def test_cuda_copy_waits_for_the_kernel_that_produced_the_tensor():
    area = StagingArea()
    x = torch.randn(2048, 2048, device="cuda")
    y = x @ x  # queued on the trainer's stream; the side stream must wait for it
    buf = area.stage_tensor(("m", "y"), y)
    area.finish()
    assert torch.equal(buf, y.cpu())


@cuda
def test_cuda_async_save_of_a_module_restores_the_pre_mutation_state(tmp_path):
    from rl_ckpt import CheckpointEngine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8)).cuda()
    # No post-load probe: its forward pass recorded on the GPU is replayed on the CPU here.
    engine = CheckpointEngine(base_dir=str(tmp_path), run_name="run", post_load_check=False)
    engine.register("policy", model)
    expected = {k: v.cpu().clone() for k, v in model.state_dict().items()}
    handle = engine.save_async(1)
    with torch.no_grad():  # right after the blocking phase, before the write finishes
        for p in model.parameters():
            p.mul_(-1).add_(1)
    handle.wait(timeout=120)
    assert all(b.is_pinned() for b in engine.pipeline.staging.buffers.values() if isinstance(b, torch.Tensor))
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8))
    restorer = CheckpointEngine(base_dir=str(tmp_path), run_name="run", post_load_check=False)
    restorer.register("policy", fresh)
    restorer.restore()
    for k, v in fresh.state_dict().items():
        assert v.view(torch.uint8).equal(expected[k].view(torch.uint8)), k
    engine.close()
    restorer.close()
