"""``copy_pieces``: the copy out of mapped memory (the memory tier's object store) into the caller's tensors, the
next step copied on a helper thread while this one's pieces are hashed."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from rl_ckpt._storage.buffers import COPY_STEP, copy_pieces


def _views(sizes: list[int]) -> tuple[list[np.ndarray], list[memoryview]]:
    bufs = [np.zeros(n, dtype=np.uint8) for n in sizes]
    return bufs, [memoryview(b) for b in bufs]


@pytest.mark.parametrize(
    "sizes",
    [
        [3, 0, 4096, COPY_STEP + 7, 1, 2 * COPY_STEP, 5],  # tiny, empty, a page, across steps, exact steps, a tail
        [1000] * 300,  # many small views: copied by shared steps
        [COPY_STEP // 2, COPY_STEP // 2 + 1, COPY_STEP],  # a step's room just missed
        [17],
    ],
)
@pytest.mark.parametrize("hashed", [True, False])
def test_every_byte_lands_and_on_chunk_sees_each_once_in_order(sizes, hashed):
    src = np.random.default_rng(len(sizes)).integers(0, 256, size=sum(sizes), dtype=np.uint8)
    bufs, views = _views(sizes)
    seen: list[bytes] = []
    copy_pieces(memoryview(src).toreadonly(), views, (lambda v: seen.append(bytes(v))) if hashed else None)
    assert np.concatenate(bufs).tobytes() == src.tobytes()
    if hashed:
        assert b"".join(seen) == src.tobytes()
        assert all(len(s) <= COPY_STEP for s in seen)


def test_on_chunk_sees_a_piece_only_once_it_landed_and_the_copy_runs_beside_it():
    """Each piece handed over holds its final bytes; the copy of the next step is made on another thread."""
    sizes = [COPY_STEP] * 4
    src = np.random.default_rng(7).integers(0, 256, size=sum(sizes), dtype=np.uint8)
    bufs, views = _views(sizes)
    copied_on: set[int] = set()
    import rl_ckpt._storage.buffers as buffers

    real = buffers._copy

    def spy(group):
        copied_on.add(threading.get_ident())
        real(group)

    buffers._copy = spy
    try:
        checks = []
        copy_pieces(memoryview(src), views, lambda v: checks.append(bytes(v)))
    finally:
        buffers._copy = real
    assert b"".join(checks) == src.tobytes()
    assert copied_on and threading.get_ident() not in copied_on


def test_a_failing_on_chunk_leaves_no_copy_running():
    """``on_chunk`` raising (a checksum mismatch found early) propagates, and no step is still being copied into
    the caller's memory when it does: nothing lands afterwards."""
    sizes = [COPY_STEP] * 6
    src = np.full(sum(sizes), 9, dtype=np.uint8)
    bufs, views = _views(sizes)

    def fail_at_second(view, calls=[]):  # noqa: B006 - a counter across calls
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("checksum mismatch")

    with pytest.raises(ValueError, match="checksum mismatch"):
        copy_pieces(memoryview(src), views, fail_at_second)
    after = [b.copy() for b in bufs]
    import rl_ckpt._storage.buffers as buffers

    buffers.COPIER.get().submit(lambda: None).result()  # (one helper thread, in order: whatever was queued is done)
    assert all(np.array_equal(a, b) for a, b in zip(after, bufs))
    assert not bufs[-1].any()  # the steps after the failure's next one were never copied


def _read_local(root: str) -> bool:
    """A local file of two read steps read into two buffers (the next step read by the reader pool)."""
    from rl_ckpt._storage.local import LocalStorage
    from rl_ckpt._storage.local_io import READ_CALL

    store = LocalStorage(root)
    store.makedirs("snap")
    data = np.random.default_rng(5).integers(0, 256, size=2 * READ_CALL + 3, dtype=np.uint8).tobytes()
    store.write("snap/f.bin", [data])
    pieces = [(0, bytearray(READ_CALL)), (READ_CALL, bytearray(READ_CALL + 3))]
    store.read_into("snap/f.bin", pieces, on_chunk=lambda v: None)
    return b"".join(bytes(b) for _o, b in pieces) == data


def _copy_in_child(queue, root) -> None:
    sizes = [COPY_STEP] * 3
    src = np.arange(sum(sizes), dtype=np.uint64).view(np.uint8)[: sum(sizes)]
    bufs, views = _views(sizes)
    seen = []
    copy_pieces(memoryview(src), views, lambda v: seen.append(len(v)))
    queue.put(np.concatenate(bufs).tobytes() == src.tobytes() and sum(seen) == src.nbytes and _read_local(root))


def test_a_forked_child_copies_with_a_helper_of_its_own(tmp_path):
    """The helper threads of the parent (the copy's, the local reader pool's) do not exist in a forked child (a
    DataLoader worker, say): the child's first copy or read starts its own instead of queueing work no thread
    will run."""
    import multiprocessing

    sizes = [COPY_STEP] * 2
    src = np.ones(sum(sizes), dtype=np.uint8)
    _bufs, views = _views(sizes)
    copy_pieces(memoryview(src), views, lambda v: None)  # the parent's helper threads exist now
    assert _read_local(str(tmp_path / "parent"))
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_copy_in_child, args=(queue, str(tmp_path / "child")))
    child.start()
    try:
        assert queue.get(timeout=120) is True
    finally:
        child.join(timeout=120)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def _rss_of(addr: int) -> int:
    """Bytes of the mapping holding ``addr`` that are mapped into this process (``/proc/self/smaps``: Rss)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line: "start-end perms offset dev inode [path]"
                start, end = (int(x, 16) for x in head[0].split("-"))
                inside = start <= addr < end
            elif inside and head[0] == "Rss:":
                return int(head[1]) * 1024
    raise AssertionError(f"no mapping holds {addr:#x}")


def _shared_file(tmp_path, nbytes: int):
    """A file mapped shared and read-only, none of its pages touched by this process yet (as a new process maps an
    object of Ray's object store)."""
    import mmap
    import os

    path = os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path), f"rl_ckpt-test-{os.getpid()}")
    data = np.random.default_rng(3).integers(0, 256, size=nbytes, dtype=np.uint8)
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
        os.unlink(path)
    return mapped, data


def test_a_large_source_is_mapped_ahead_on_a_helper_and_copied_exactly(tmp_path):
    """``prefault_source`` maps a shared mapping's pages into this process on a helper thread, nothing read on this
    one; ``copy_pieces`` does it for a large source, unaligned too, every byte lands and the helper is joined on
    return; where the kernel refuses the advice, the copy still lands every byte."""
    import rl_ckpt._storage.buffers as buffers

    if buffers._madvise is None:
        pytest.skip("no madvise in this libc")
    nbytes = 48 << 20
    mapped, data = _shared_file(tmp_path, nbytes)
    view = memoryview(mapped)
    addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
    assert _rss_of(addr) < nbytes // 4  # untouched yet
    stop = buffers.prefault_source(view)
    for helper in [t for t in threading.enumerate() if t.name == "rl_ckpt-prefault"]:
        helper.join()  # (run to its end: ``stop`` would stop it early)
    stop()
    if buffers._madvise(addr - addr % 4096, 4096, buffers._MADV_POPULATE_READ) != 0:
        pytest.skip("this kernel lacks MADV_POPULATE_READ (Linux < 5.14)")
    assert _rss_of(addr) >= nbytes - (8 << 20)  # mapped, though nothing on this thread read it

    sizes = [COPY_STEP, nbytes - COPY_STEP - 5]
    src = view[5:]  # not page aligned: only whole pages inside it are advised
    bufs, views = _views(sizes)
    seen: list[int] = []
    copy_pieces(src, views, lambda v: seen.append(len(v)))
    assert np.concatenate(bufs).tobytes() == data[5:].tobytes() and sum(seen) == nbytes - 5
    assert not [t for t in threading.enumerate() if t.name == "rl_ckpt-prefault"]  # joined on return

    real = buffers._madvise
    buffers._madvise = lambda *a: -1  # a kernel without the advice: the helper stops at its first call
    try:
        bufs, views = _views(sizes)
        copy_pieces(src, views, None)
    finally:
        buffers._madvise = real
    assert np.concatenate(bufs).tobytes() == data[5:].tobytes()
    view.release()
    del src
    mapped.close()
