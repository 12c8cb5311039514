"""One contract for every storage backend: memory://, a local folder, S3 (moto), and the generic
fsspec class (on fsspec's local filesystem, standing for any protocol without a class of its own).

Each test runs against all four through the ``backend`` fixture; a few
local-only extras (atomic folder rename, symbolic links) and S3-only checks
(multipart streaming, stale caches, manifest-last commit race) follow.
"""

from __future__ import annotations

import array
import dataclasses
import os
import threading
import time
import uuid

import pytest

from rl_ckpt._commit import ManifestLastCommit
from rl_ckpt.errors import (
    CommitConflictError,
    ConfigError,
    FileTooLargeError,
    ReadRangeError,
    StorageArgumentError,
    StorageError,
    StoragePermissionError,
    UnsafePathError,
)
from rl_ckpt._format.manifest import MANIFEST_NAME
from rl_ckpt._storage import (
    FsspecStorage,
    LocalStorage,
    MemoryStorage,
    S3Storage,
    Storage,
    join,
    open_storage,
    register_storage,
    storage_class,
)
from rl_ckpt._storage.registry import registry as storage_registry


# --------------------------------------------------------------------------- backends
@dataclasses.dataclass
class Backend:
    name: str
    storage: Storage
    url: str
    options: dict | None
    outside: object  # () -> frozenset: what exists next to (outside) the root

    def reopen(self, **extra) -> Storage:
        """A second, independent client of the same root (another process, in effect)."""
        if self.name == "s3":
            return S3Storage(self.url, {**self.options, "skip_instance_cache": True, **extra})
        if self.name == "fsspec":
            return FsspecStorage(self.url, self.options)
        return open_storage(self.url, self.options)


def _local_backend(tmp_path) -> Backend:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "neighbour.txt").write_bytes(b"not ours")

    def outside():
        out = set()
        for dirpath, dirnames, filenames in os.walk(tmp_path):
            if os.path.abspath(dirpath) == str(root) or os.path.abspath(dirpath).startswith(str(root) + os.sep):
                continue
            for n in dirnames + filenames:
                p = os.path.join(dirpath, n)
                if p != str(root):
                    st = os.lstat(p)
                    out.add((os.path.relpath(p, tmp_path), st.st_size, st.st_mtime_ns))
        return frozenset(out)

    return Backend("local", open_storage(str(root)), str(root), None, outside)


def _fsspec_backend(tmp_path) -> Backend:
    """The generic class (what any protocol without a class of its own gets), on fsspec's local filesystem."""
    b = _local_backend(tmp_path)
    url = f"local://{b.url}"
    return Backend("fsspec", FsspecStorage(url), url, None, b.outside)


def _memory_backend() -> Backend:
    parent = f"/rlckpt-contract-{uuid.uuid4().hex}"
    url = f"memory://{parent}/root"
    storage = open_storage(url)
    storage.fs.pipe_file(f"{parent}/neighbour.txt", b"not ours")

    def outside():
        return frozenset(
            (k, storage.fs.store[k].size)
            for k in list(storage.fs.store)
            if k.startswith(parent + "/") and not k.startswith(f"{parent}/root/")
        )

    return Backend("memory", storage, url, None, outside)


def _s3_backend(s3_url) -> Backend:
    url, options = s3_url
    storage = open_storage(url, options)
    bucket = url[len("s3://") :].split("/", 1)[0]
    storage.fs.call_s3("put_object", Bucket=bucket, Key="runs/neighbour.txt", Body=b"not ours")

    def outside():
        page = storage.fs.call_s3("list_objects_v2", Bucket=bucket)
        return frozenset((o["Key"], o["Size"]) for o in page.get("Contents", []) if not o["Key"].startswith("runs/r1/"))

    return Backend("s3", storage, url, options, outside)


@pytest.fixture(params=["memory", "local", "fsspec", "s3"])
def backend(request, tmp_path):
    if request.param == "local":
        b = _local_backend(tmp_path)
    elif request.param == "fsspec":
        b = _fsspec_backend(tmp_path)
    elif request.param == "memory":
        b = _memory_backend()
    else:
        b = _s3_backend(request.getfixturevalue("s3_url"))
    before = b.outside()
    yield b
    b.storage.close()
    # Whatever a test did through the storage, nothing outside the root changed.
    assert b.outside() == before, f"{b.name}: something outside the root changed"


@pytest.fixture
def store(backend) -> Storage:
    return backend.storage


def _names(entries) -> dict:
    return {e.name: e for e in entries}


def _parent(store, path: str) -> None:
    # The documented call order: makedirs(folder), then write files into it
    # (a no-op on object stores, required on local disks).
    if "/" in path:
        store.makedirs(path.rsplit("/", 1)[0])


def put(store, path: str, chunks, **kw) -> int:
    _parent(store, path)
    return store.write(path, chunks, **kw)


def put_atomic(store, path: str, data, **kw) -> None:
    _parent(store, path)
    store.write_atomic(path, data, **kw)


# --------------------------------------------------------------------------- write / read
CHUNKINGS = {
    "bytes": ([b"hello world"], b"hello world"),
    "bytearray": ([bytearray(b"\x00\x01\x02" * 1000)], b"\x00\x01\x02" * 1000),
    "memoryview": ([memoryview(b"abcdef")[1:5]], b"bcde"),
    "typed-memoryview": ([memoryview(array.array("i", range(100)))], array.array("i", range(100)).tobytes()),
    "multi-chunk": (
        [b"a" * 10, bytearray(b"b" * 100_000), memoryview(b"c" * 7), b""],
        b"a" * 10 + b"b" * 100_000 + b"c" * 7,
    ),
    "empty-file": ([], b""),
    "empty-chunk": ([b""], b""),
}


@pytest.mark.parametrize("kind", sorted(CHUNKINGS))
def test_write_read_round_trip(store, kind):
    chunks, expected = CHUNKINGS[kind]
    size = put(store, f"snap/{kind}.bin", iter(chunks))
    assert size == len(expected)
    got = store.read(f"snap/{kind}.bin")
    assert not memoryview(got).readonly and bytes(got) == expected
    assert store.size(f"snap/{kind}.bin") == len(expected)
    assert store.exists(f"snap/{kind}.bin")


@pytest.mark.parametrize("size", [0, 5, (4 << 20) - 1, 4 << 20, (8 << 20) + 3, (19 << 20) + 7])
def test_read_reports_every_piece_in_order(store, size):
    """``on_chunk`` sees the whole buffer, in order, exactly once (the reader hashes there)."""
    data = os.urandom(size)
    put(store, "snap/pieces.bin", [data])
    pieces = []
    got = store.read("snap/pieces.bin", on_chunk=lambda view: pieces.append(bytes(view)))
    assert bytes(got) == data
    assert b"".join(pieces) == data
    assert not memoryview(got).readonly  # a private, writable buffer: decoding may reuse it in place


def test_write_many_atomic_publishes_every_file(store):
    store.makedirs("objects/ab")
    store.makedirs("objects/cd")
    store.write_atomic("objects/cd/old", b"stale")
    items = [
        ("objects/ab/one", b"1" * 10),
        ("objects/cd/two", memoryview(b"2" * (3 << 20))),
        ("objects/cd/old", bytearray(b"fresh")),
        ("objects/ab/empty", b""),
    ]
    store.write_many_atomic(items)
    for path, data in items:
        assert bytes(store.read(path)) == bytes(data), path
    names = {e.name for e in store.list("objects/ab")} | {e.name for e in store.list("objects/cd")}
    assert names == {"one", "two", "old", "empty"}  # no temp file left behind


def test_write_create_only_round_trip(store):
    assert put(store, "snap/meta.json", [b"{", bytearray(b'"a": 1'), memoryview(b"}")], create_only=True) == 8
    assert bytes(store.read("snap/meta.json")) == b'{"a": 1}'


def test_write_overwrites(store):
    put(store, "f.bin", [b"first version, longer"])
    put(store, "f.bin", [b"second"])
    assert bytes(store.read("f.bin")) == b"second"
    assert store.size("f.bin") == 6


def test_create_only_refuses_existing_and_keeps_original(store):
    put(store, "snap/meta.json", [b"original"], create_only=True)
    with pytest.raises(CommitConflictError) as info:
        put(store, "snap/meta.json", [b"intruder"], create_only=True)
    assert isinstance(info.value, StorageError)
    with pytest.raises(CommitConflictError):
        put(store, "snap/meta.json", [b"original"], create_only=True)  # same bytes: still taken
    assert bytes(store.read("snap/meta.json")) == b"original"
    # create-only also refuses a path a plain write created
    put(store, "plain.bin", [b"plain"])
    with pytest.raises(CommitConflictError):
        put(store, "plain.bin", [b"x"], create_only=True)
    assert bytes(store.read("plain.bin")) == b"plain"


def test_create_only_concurrent_writers_exactly_one_wins(backend, store):
    if backend.name == "fsspec":
        pytest.skip(
            "the generic class's create-only is as atomic as the backend's pipe_file(mode='create'); "
            "fsspec's local filesystem checks, then writes (protocols that need more get a class)"
        )
    n = 8
    barrier = threading.Barrier(n)
    wins, conflicts, other = [], [], []

    def writer(i):
        payload = f"writer-{i}".encode() * 50
        barrier.wait(timeout=30)
        try:
            put(store, "race/meta.json", [payload], create_only=True)
            wins.append(payload)
        except CommitConflictError:
            conflicts.append(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            other.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not other, other
    assert len(wins) == 1 and len(conflicts) == n - 1
    assert bytes(store.read("race/meta.json")) == wins[0]


def test_write_atomic_overwrite_and_create_only(store):
    put_atomic(store, "latest.json", b'{"step": 1}')
    put_atomic(store, "latest.json", bytearray(b'{"step": 2}'))
    assert bytes(store.read("latest.json")) == b'{"step": 2}'
    put_atomic(store, "dir/once.json", b"first", create_only=True)
    with pytest.raises(CommitConflictError):
        put_atomic(store, "dir/once.json", b"second", create_only=True)
    assert bytes(store.read("dir/once.json")) == b"first"
    # no temp files or other debris next to the published files
    assert set(_names(store.list(""))) == {"latest.json", "dir"}
    assert set(_names(store.list("dir"))) == {"once.json"}


def test_failing_chunk_producer_propagates_and_publishes_nothing(backend, store):
    class ProducerBroke(Exception):
        pass

    def chunks():
        yield b"x" * 1000
        raise ProducerBroke("serializer failed")

    with pytest.raises(ProducerBroke):
        put(store, "snap/half.bin", chunks())
    if backend.name != "local":  # local write() is documented as not atomic (staging makes it so)
        assert not store.exists("snap/half.bin")


def test_write_stream_atomic_publishes_whole_or_nothing(store):
    store.makedirs("out")
    assert store.write_stream_atomic("out/model.bin", (bytes([i]) * 4096 for i in range(8))) == 8 * 4096
    assert bytes(store.read("out/model.bin")) == b"".join(bytes([i]) * 4096 for i in range(8))

    class ProducerBroke(Exception):
        pass

    def chunks():
        yield b"y" * 5000
        raise ProducerBroke("tensor read failed")

    with pytest.raises(ProducerBroke):
        store.write_stream_atomic("out/model.bin", chunks())  # the old file stays whole
    with pytest.raises(ProducerBroke):
        store.write_stream_atomic("out/new.bin", chunks())  # no partial new file
    assert bytes(store.read("out/model.bin")) == b"".join(bytes([i]) * 4096 for i in range(8))
    assert list(_names(store.list("out"))) == ["model.bin"]  # and no temp file next to it


# --------------------------------------------------------------------------- namespace
def test_list_names_kinds_sizes_and_nesting(store):
    put(store, "a.bin", [b"abc"])
    put(store, "sub/b.bin", [b"12345"])
    put(store, "sub/deeper/c.bin", [b""])
    put(store, "subway.bin", [b"not in sub/"])
    t0 = time.time()

    top = _names(store.list())
    assert set(top) == {"a.bin", "sub", "subway.bin"}
    assert top["sub"].is_dir and not top["a.bin"].is_dir
    assert top["a.bin"].size == 3
    assert top["a.bin"].mtime is not None and abs(top["a.bin"].mtime - t0) < 300

    sub = _names(store.list("sub"))
    assert set(sub) == {"b.bin", "deeper"}
    assert sub["b.bin"].size == 5 and not sub["b.bin"].is_dir and sub["deeper"].is_dir
    assert isinstance(sub["b.bin"].mtime, float)

    deeper = _names(store.list("sub/deeper"))
    assert set(deeper) == {"c.bin"} and deeper["c.bin"].size == 0
    assert set(_names(store.list(""))) == set(top)


def test_list_missing_empty_or_file_is_empty(store):
    assert store.list("missing") == []
    assert store.list("missing/deeper") == []
    store.makedirs("empty/folder")
    assert store.list("empty/folder") == []
    put(store, "file.bin", [b"x"])
    assert store.list("file.bin") == []


def test_list_sees_latest_state(store):
    assert store.list("snap") == []
    put(store, "snap/one", [b"1"])
    assert set(_names(store.list("snap"))) == {"one"}
    put(store, "snap/two", [b"22"])
    assert set(_names(store.list("snap"))) == {"one", "two"}
    put(store, "snap/two", [b"2222"])
    assert _names(store.list("snap"))["two"].size == 4
    store.remove("snap/one")
    assert set(_names(store.list("snap"))) == {"two"}


def test_exists_and_size(store):
    assert not store.exists("nothing.bin")
    put(store, "d/f.bin", [b"x" * 42])
    assert store.exists("d/f.bin")
    assert store.exists("d")  # a folder with something in it
    assert store.size("d/f.bin") == 42
    with pytest.raises(StorageError) as info:
        store.size("nothing.bin")
    assert not isinstance(info.value, CommitConflictError)


def test_read_missing_is_storage_error_not_conflict(store):
    # a path containing "412" once made a text match treat a 404 as a commit conflict
    for path in ("missing.bin", "step_000412/meta.json"):
        with pytest.raises(StorageError) as info:
            store.read(path)
        assert not isinstance(info.value, CommitConflictError)
        with pytest.raises(StorageError) as info:
            store.open_read(path)
        assert not isinstance(info.value, CommitConflictError)


# --------------------------------------------------------------------------- ranged and capped reads
RANGE_DATA = bytes(range(256)) * 4  # 1024 bytes, every offset tells its value


def _range_reader(store, impl):
    """The backend's own ``read_range``, or the interface's default (seek + read on ``open_read``)."""
    return store.read_range if impl == "own" else (lambda *a: Storage.read_range(store, *a))


@pytest.mark.parametrize("impl", ["own", "default"])
def test_read_range_returns_exact_bytes(store, impl):
    put(store, "snap/r.bin", [RANGE_DATA])
    read_range = _range_reader(store, impl)
    for start, length in [(0, 0), (0, 1), (0, 1024), (5, 10), (255, 2), (1000, 24), (1024, 0), (512, 0)]:
        got = read_range("snap/r.bin", start, length)
        assert isinstance(got, bytes) and got == RANGE_DATA[start : start + length], (start, length)
    put(store, "snap/empty.bin", [])
    assert read_range("snap/empty.bin", 0, 0) == b""


@pytest.mark.parametrize("impl", ["own", "default"])
def test_read_range_past_end_is_a_clear_error(store, impl):
    put(store, "snap/r.bin", [RANGE_DATA])
    put(store, "snap/empty.bin", [])
    read_range = _range_reader(store, impl)
    for path, start, length in [
        ("snap/r.bin", 1000, 25),
        ("snap/r.bin", 1025, 0),
        ("snap/r.bin", 4096, 8),
        ("snap/r.bin", 0, 1 << 40),
        ("snap/empty.bin", 0, 1),
    ]:
        with pytest.raises(ReadRangeError) as info:
            read_range(path, start, length)
        err = info.value
        assert err.path == path and (err.start, err.length) == (start, length)
        assert err.size == (1024 if path == "snap/r.bin" else 0)
        assert path in str(err) and "only" in str(err)
    assert bytes(store.read("snap/r.bin")) == RANGE_DATA  # nothing changed


@pytest.mark.parametrize("impl", ["own", "default"])
def test_read_range_bad_arguments_and_missing_file(store, impl):
    put(store, "snap/r.bin", [RANGE_DATA])
    read_range = _range_reader(store, impl)
    for start, length in [(-1, 4), (0, -1), (-5, -5), (1.5, 2), (0, 2.0), (True, 1), ("0", 1), (None, 1)]:
        with pytest.raises(StorageArgumentError) as info:
            read_range("snap/r.bin", start, length)
        assert isinstance(info.value, ValueError) and "read_range" in str(info.value)
    with pytest.raises(StorageError) as info:
        read_range("snap/missing.bin", 0, 1)
    assert not isinstance(info.value, (ReadRangeError, CommitConflictError))


@pytest.mark.parametrize("impl", ["own", "default"])
def test_read_into_places_every_byte_in_the_callers_pieces(store, impl):
    """``read_into``: the file lands in the caller's pieces as they cover it, ``on_chunk`` sees every byte once in
    file order, and a file of another size than the pieces is refused (larger: before it is read)."""
    import numpy as np

    read_into = store.read_into if impl == "own" else (lambda *a, **k: Storage.read_into(store, *a, **k))
    data = np.random.default_rng(3).integers(0, 256, size=(9 << 20) + 123, dtype=np.uint8).tobytes()
    put(store, "snap/p.bin", [data])
    cuts = [0, 5, 4096, (8 << 20) + 7, len(data)]  # a tiny piece, a page, one across a read step, the tail
    pieces = [(a, bytearray(b - a)) for a, b in zip(cuts, cuts[1:])]
    seen = []
    read_into("snap/p.bin", pieces, on_chunk=lambda v: seen.append(bytes(v)))
    assert b"".join(bytes(buf) for _a, buf in pieces) == data and b"".join(seen) == data
    small = bytearray(len(data) - 1)
    with pytest.raises(FileTooLargeError) as info:
        read_into("snap/p.bin", [(0, small)], on_chunk=lambda v: pytest.fail("read anyway"))
    assert (info.value.size, info.value.max_bytes) == (len(data), len(data) - 1)
    assert not any(small)  # the caller's memory untouched
    put(store, "snap/empty.bin", [b""])
    seen.clear()
    read_into("snap/empty.bin", [(0, bytearray(0))], on_chunk=lambda v: seen.append(bytes(v)))
    assert b"".join(seen) == b""
    with pytest.raises(StorageError, match="short read"):
        read_into("snap/p.bin", [(0, bytearray(len(data))), (len(data), bytearray(1))])
    with pytest.raises(StorageArgumentError):  # pieces must tile the file in order
        read_into("snap/p.bin", [(0, bytearray(10)), (11, bytearray(len(data) - 10))])
    with pytest.raises(StorageError):
        read_into("snap/missing.bin", [(0, bytearray(1))])


def test_local_read_into_a_cold_file_at_odd_addresses(local):
    """A large file out of the page cache lands exactly in pieces at any address and of any length (tensors), every
    byte handed to ``on_chunk`` once, in order, after it landed."""
    import numpy as np

    store, _root, _ = local
    data = np.random.default_rng(5).integers(0, 256, size=(40 << 20) + 4097, dtype=np.uint8).tobytes()
    put(store, "snap/cold.bin", [data])
    fd = os.open(os.path.join(store.root, "snap", "cold.bin"), os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    out = bytearray(len(data) + 3)
    cuts = [0, 64, (8 << 20) + 1, (24 << 20) - 5, len(data)]
    view = memoryview(out)[3:]  # at an odd address
    seen = []
    store.read_into("snap/cold.bin", [(a, view[a:b]) for a, b in zip(cuts, cuts[1:])], on_chunk=seen.append)
    assert bytes(view) == data and b"".join(bytes(v) for v in seen) == data


def test_read_ranges_and_stat_many_answer_like_one_call_each(store):
    put(store, "snap/r.bin", [RANGE_DATA])
    ranges = [(0, 1), (5, 10), (1000, 24), (512, 0)]
    assert store.read_ranges("snap/r.bin", ranges) == [RANGE_DATA[a : a + n] for a, n in ranges]
    with pytest.raises(ReadRangeError) as info:
        store.read_ranges("snap/r.bin", [(0, 4), (1000, 25)])
    assert (info.value.start, info.value.length, info.value.size) == (1000, 25, 1024)
    with pytest.raises(StorageError):
        store.read_ranges("snap/missing.bin", [(0, 1)])
    stats = store.stat_many(["snap/r.bin", "snap/missing.bin"])
    assert stats[0].size == 1024 and not stats[0].is_dir and stats[1] is None


def test_hash_files_rereads_each_file_in_order_and_views_many_hands_over_what_it_can(store):
    """``hash_files`` (format layer, over ``Storage.views_many`` and ``open_read``): (size, checksum) of each stored
    file as read back now, in order; None for a missing one; a file rewritten since gives its new checksum.
    ``views_many`` hands over a subset of the paths asked for, each read-only with the file's bytes."""
    from rl_ckpt._format.checksum import new_hasher
    from rl_ckpt._format.hashed_io import hash_files

    def digest(data: bytes) -> str:
        hasher = new_hasher("xxh3_128")
        hasher.update(data)
        return hasher.hexdigest()

    big = bytes(range(256)) * 5000  # past any inline-size threshold
    put(store, "objects/aa/big", [big])
    put(store, "objects/aa/small", [b"abc"])
    put(store, "objects/bb/empty", [b""])
    paths = ["objects/aa/small", "objects/aa/missing", "objects/aa/big", "objects/bb/empty"]
    got = hash_files(store, paths, "xxh3_128")
    assert got == [(3, digest(b"abc")), None, (len(big), digest(big)), (0, digest(b""))]
    put(store, "objects/aa/small", [b"abd"])
    assert hash_files(store, ["objects/aa/small"], "xxh3_128") == [(3, digest(b"abd"))]
    assert hash_files(store, [], "xxh3_128") == []
    # The sizes the manifest gives only size the read buffer: a file that grew, or shrank, since reads whole.
    hinted = hash_files(store, paths, "xxh3_128", [1, 0, 10, 5])
    assert hinted == [(3, digest(b"abd")), None, (len(big), digest(big)), (0, digest(b""))]
    views = store.views_many(paths)
    assert set(views) <= {"objects/aa/small", "objects/aa/big", "objects/bb/empty"}
    for path, view in views.items():
        assert memoryview(view).readonly and bytes(view) == bytes(store.read(path))


def test_read_session_answers_like_outside_and_sees_own_writes(store):
    """``read_session`` (a restore's one view of the run; the default is none) answers as outside it, nests, and
    sees the writes and removals made through the same storage."""
    put(store, "snap/a.bin", [b"a" * 10])
    with store.read_session() as same, store.read_session():
        assert same is store
        assert [e.name for e in store.list("snap")] == ["a.bin"] and store.stat("snap/a.bin").size == 10
        assert bytes(store.read("snap/a.bin")) == b"a" * 10 and store.read_range("snap/a.bin", 2, 3) == b"aaa"
        put(store, "snap/b.bin", [b"b" * 4])
        assert store.exists("snap/b.bin") and bytes(store.read("snap/b.bin")) == b"bbbb"
        store.remove("snap/a.bin")
        assert not store.exists("snap/a.bin") and [e.name for e in store.list("snap")] == ["b.bin"]
    assert [e.name for e in store.list("snap")] == ["b.bin"]


def test_read_with_max_bytes(store):
    put(store, "snap/meta.json", [b"x" * 100])
    assert bytes(store.read("snap/meta.json", max_bytes=100)) == b"x" * 100
    assert bytes(store.read("snap/meta.json", max_bytes=1 << 40)) == b"x" * 100
    pieces = []
    with pytest.raises(FileTooLargeError) as info:
        store.read("snap/meta.json", max_bytes=99, on_chunk=pieces.append)
    err = info.value
    assert isinstance(err, StorageError) and (err.path, err.size, err.max_bytes) == ("snap/meta.json", 100, 99)
    assert "snap/meta.json" in str(err) and "100 bytes" in str(err)
    assert pieces == []  # refused before reading
    put(store, "snap/empty.json", [])
    assert bytes(store.read("snap/empty.json", max_bytes=0)) == b""
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(StorageArgumentError):
            store.read("snap/meta.json", max_bytes=bad)
    with pytest.raises(StorageError) as info:
        store.read("snap/missing.json", max_bytes=10)
    assert not isinstance(info.value, FileTooLargeError)
    store.makedirs("snap/sub")
    put(store, "snap/sub/f", [b"1"])
    with pytest.raises((StorageError, UnsafePathError)):  # a folder is not a file (local: not a regular file)
        store.read("snap/sub", max_bytes=10)


def test_abort_incomplete_uploads_is_declared_everywhere(backend, store):
    """Declared in the interface: callers use it directly; backends without multipart uploads abort nothing."""
    put(store, "snap/f.bin", [b"x"])
    assert store.abort_incomplete_uploads(0) == []
    if backend.name == "s3":
        bucket = backend.url[len("s3://") :].split("/", 1)[0]
        store.fs.call_s3("create_multipart_upload", Bucket=bucket, Key="runs/r1/step_000000003/big.bin")
        store.fs.call_s3("create_multipart_upload", Bucket=bucket, Key="runs/r1-neighbour/big.bin")  # not ours
        # (moto lists every upload as initiated in 2010, so the age filter cannot be told apart here)
        assert store.abort_incomplete_uploads(0) == ["runs/r1/step_000000003/big.bin"]
        left = store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
        assert [u["Key"] for u in left] == ["runs/r1-neighbour/big.bin"]
        store.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=left[0]["Key"], UploadId=left[0]["UploadId"])
    assert bytes(store.read("snap/f.bin")) == b"x"


def test_remove(store):
    put(store, "r/f.bin", [b"x"])
    put(store, "r/g.bin", [b"y"])
    store.remove("r/f.bin")
    assert not store.exists("r/f.bin")
    assert store.exists("r/g.bin")
    store.remove("r/f.bin")  # missing is fine
    store.remove("never/was.bin")
    assert set(_names(store.list("r"))) == {"g.bin"}


def test_remove_tree(store):
    for p in ("snap/a", "snap/sub/b", "snap/sub/deep/c", "snap2/keep", "snapshot.bin", "step1/keep", "step[12]/x"):
        put(store, p, [p.encode()])
    store.remove_tree("snap")
    assert not store.exists("snap/a") and not store.exists("snap/sub/deep/c")
    assert not store.exists("snap")
    assert store.list("snap") == []
    # siblings that merely share the prefix survive
    assert bytes(store.read("snap2/keep")) == b"snap2/keep"
    assert bytes(store.read("snapshot.bin")) == b"snapshot.bin"
    # glob characters are names, not patterns
    store.remove_tree("step[12]")
    assert not store.exists("step[12]/x")
    assert bytes(store.read("step1/keep")) == b"step1/keep"
    store.remove_tree("snap")  # missing is fine
    store.remove_tree("no/such/folder")
    store.remove_tree("snapshot.bin")  # a file: removed
    assert not store.exists("snapshot.bin")
    assert set(_names(store.list())) == {"snap2", "step1"}


def test_open_read_streams_with_readinto(store):
    data = os.urandom(300_000) + bytes(range(256)) * 100
    put(store, "big/blob.bin", [data[i : i + 65536] for i in range(0, len(data), 65536)])
    buf = bytearray(50_000)
    view = memoryview(buf)
    got = bytearray()
    with store.open_read("big/blob.bin") as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            got += view[:n]
    assert bytes(got) == data


def test_open_read_handles_are_independent(store):
    put(store, "two.bin", [b"0123456789"])
    with store.open_read("two.bin") as a, store.open_read("two.bin") as b:
        assert a.read(4) == b"0123"
        assert b.read(2) == b"01"
        assert a.read() == b"456789"


def test_makedirs_then_write(store):
    store.makedirs("a/b/c")
    store.makedirs("a/b/c")  # idempotent
    put(store, "a/b/c/f", [b"1"])
    assert bytes(store.read("a/b/c/f")) == b"1"


def test_free_bytes(backend, store):
    free = store.free_bytes()
    if backend.name == "local":
        assert isinstance(free, int) and free > 0
    else:
        assert free is None or isinstance(free, int)


def test_supports_rename_matches_backend(backend, store):
    assert store.supports_rename is (backend.name == "local")
    if not store.supports_rename:
        with pytest.raises(NotImplementedError):
            store.rename_dir("a", "b")


# --------------------------------------------------------------------------- unsafe paths
BAD_PATHS = ["../x", "/abs", "a/../b", "a//b", "./a", "a/.", "a/", "..", "a\\b", "nul\x00byte", "s3://bucket/key"]


def _calls(store):
    return {
        "write": lambda p: store.write(p, [b"evil"]),
        "write_create_only": lambda p: store.write(p, [b"evil"], create_only=True),
        "write_atomic": lambda p: store.write_atomic(p, b"evil"),
        "write_atomic_create_only": lambda p: store.write_atomic(p, b"evil", create_only=True),
        "write_stream_atomic": lambda p: store.write_stream_atomic(p, [b"evil"]),
        "read": store.read,
        "read_capped": lambda p: store.read(p, max_bytes=10),
        "read_range": lambda p: store.read_range(p, 0, 1),
        "open_read": store.open_read,
        "list": store.list,
        "exists": store.exists,
        "size": store.size,
        "remove": store.remove,
        "remove_tree": store.remove_tree,
        "makedirs": store.makedirs,
        "sync_dir": store.sync_dir,
    }


@pytest.mark.parametrize("bad", BAD_PATHS)
def test_unsafe_paths_refused_by_every_method(store, bad):
    put(store, "keep/me.bin", [b"keep"])
    for name, call in _calls(store).items():
        with pytest.raises(UnsafePathError):
            call(bad)
            pytest.fail(f"{name}({bad!r}) was not refused")
    if store.supports_rename:
        with pytest.raises(UnsafePathError):
            store.rename_dir("keep", bad)
        with pytest.raises(UnsafePathError):
            store.rename_dir(bad, "elsewhere")
    assert bytes(store.read("keep/me.bin")) == b"keep"
    assert set(_names(store.list())) == {"keep"}


# "" is the root itself: it may be listed, checked and synced, never written, read,
# created or removed (remove_tree("") would delete the whole run).
ROOT_REFUSERS = [
    "write",
    "write_create_only",
    "write_atomic",
    "write_atomic_create_only",
    "write_stream_atomic",
    "read",
    "read_capped",
    "read_range",
    "open_read",
    "size",
    "remove",
    "remove_tree",
    "makedirs",
]


@pytest.mark.parametrize("method", ROOT_REFUSERS)
def test_empty_path_refused(store, method):
    put(store, "keep/me.bin", [b"keep"])
    with pytest.raises(UnsafePathError):
        _calls(store)[method]("")
    assert bytes(store.read("keep/me.bin")) == b"keep"


def test_root_accepted_where_it_makes_sense(store):
    store.write("f", [b"1"])
    assert set(_names(store.list(""))) == {"f"}
    assert store.exists("")
    store.sync_dir("")


# --------------------------------------------------------------------------- caches / other clients
def test_no_stale_answers_after_another_client_changes_things(backend, store):
    other = backend.reopen()
    # prime every cache this client has
    assert store.list("snap") == []
    assert not store.exists("snap/meta.json")
    put(store, "snap/data.bin", [b"d"])
    assert set(_names(store.list("snap"))) == {"data.bin"}
    assert store.exists("snap/data.bin")

    put(other, "snap/meta.json", [b"m"], create_only=True)
    assert store.exists("snap/meta.json")
    assert set(_names(store.list("snap"))) == {"data.bin", "meta.json"}
    assert store.size("snap/meta.json") == 1

    put(other, "snap/meta.json", [b"mmm"])
    assert store.size("snap/meta.json") == 3
    with store.open_read("snap/meta.json") as f:
        assert f.read() == b"mmm"

    other.remove("snap/meta.json")
    assert not store.exists("snap/meta.json")
    assert set(_names(store.list("snap"))) == {"data.bin"}
    other.remove_tree("snap")
    assert not store.exists("snap/data.bin") and not store.exists("snap")
    assert store.list("snap") == []
    other.close()


# --------------------------------------------------------------------------- local only
@pytest.fixture
def local(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    return open_storage(str(root)), root, tmp_path


def test_local_large_read_with_prefault_is_exact(local):
    """Files large enough for the prefault helper (pages populated from a second thread) read back exactly,
    and populating never overwrites bytes already read into the buffer."""
    store, _root, _ = local
    import numpy as np

    from rl_ckpt._storage.buffers import alloc_bytes, prefault

    data = np.random.default_rng(0).integers(0, 256, size=(48 << 20) + 4097, dtype=np.uint8).tobytes()
    put(store, "snap/big.bin", [data])
    pieces = []
    got = store.read("snap/big.bin", on_chunk=lambda v: pieces.append(len(v)))
    assert bytes(got) == data and sum(pieces) == len(data) and len(pieces) > 1
    # Out of the page cache, the same files are read with O_DIRECT (aligned sizes and an unaligned tail).
    import rl_ckpt._storage.local_io as local_mod

    modes = []
    real = local_mod._set_direct
    for size in (32 << 20, (48 << 20) + 4097):
        blob = data[:size]
        put(store, f"snap/cold-{size}.bin", [blob])
        fd = os.open(os.path.join(store.root, "snap", f"cold-{size}.bin"), os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        local_mod._set_direct = lambda fd, on: (modes.append(on), real(fd, on))[1]
        try:
            pieces = []
            got = store.read(f"snap/cold-{size}.bin", on_chunk=lambda v: pieces.append(bytes(v)))
        finally:
            local_mod._set_direct = real
        assert bytes(got) == blob and b"".join(pieces) == blob and len(got) == size
        assert not memoryview(got).readonly
    assert True in modes, "a cold large file was not read with O_DIRECT"
    buf = alloc_bytes(64 << 20)
    buf[: 32 << 20] = 7  # as if a read had already filled the first half
    prefault(buf)()
    assert int(buf[: 32 << 20].min()) == 7 == int(buf[: 32 << 20].max())


def test_local_open_storage_kinds(tmp_path):
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    assert isinstance(open_storage(f"file://{tmp_path}"), LocalStorage)
    assert open_storage(f"file://{tmp_path}").root == open_storage(str(tmp_path)).root == str(tmp_path)
    assert isinstance(open_storage("memory://x/y"), FsspecStorage)


def test_registry_picks_the_class_by_protocol(tmp_path):
    assert type(open_storage(str(tmp_path))) is LocalStorage
    assert type(open_storage("relative/run")) is LocalStorage
    assert type(open_storage("memory://x/y")) is MemoryStorage
    for url in ("s3://bucket/run", "s3a://bucket/run", "S3://bucket/run"):
        assert storage_class(url) is S3Storage, url
    # any other fsspec protocol: the generic class (chained URLs are named by their outer protocol)
    assert type(open_storage(f"local://{tmp_path}")) is FsspecStorage
    for url in ("gcs://bucket/run", "abfs://c/run", "simplecache::s3://bucket/run"):
        assert storage_class(url) is FsspecStorage, url


def test_register_storage_adds_and_guards_protocols():
    class Mine(MemoryStorage):
        pass

    try:
        register_storage("rlckpt-test", Mine)
        assert storage_class("rlckpt-test://x/y") is Mine and storage_class("RLCKPT-TEST://x") is Mine
        register_storage("rlckpt-test", Mine)  # the same class again is fine
        with pytest.raises(ConfigError, match="already served by Mine"):
            register_storage("rlckpt-test", MemoryStorage)
        assert storage_class("rlckpt-test://x") is Mine
        register_storage("rlckpt-test", MemoryStorage, clobber=True)
        assert storage_class("rlckpt-test://x") is MemoryStorage
        with pytest.raises(ConfigError, match="not a Storage subclass"):
            register_storage("rlckpt-other", dict)
        with pytest.raises(ConfigError, match="already served"):
            register_storage("s3", MemoryStorage)
    finally:
        storage_registry.pop("rlckpt-test", None)
    assert storage_class("s3://b/k") is S3Storage


def test_local_sparse_huge_files_refused_before_allocating(local, monkeypatch):
    """A 1 GiB and a 64 GiB sparse meta.json: refused from the open file's size, nothing allocated or read."""
    import rl_ckpt._storage.local_io as local_mod

    store, root, _ = local
    (root / "snap").mkdir()

    def no_allocation(size):
        raise AssertionError(f"a buffer of {size} bytes was allocated for a file over the cap")

    monkeypatch.setattr(local_mod, "alloc_bytes", no_allocation)
    for size in (1 << 30, 64 << 30):
        with open(root / "snap" / "meta.json", "wb") as f:
            f.truncate(size)
        with pytest.raises(FileTooLargeError) as info:
            store.read("snap/meta.json", max_bytes=64 << 20, on_chunk=lambda v: pytest.fail("read anyway"))
        assert (info.value.size, info.value.max_bytes, info.value.path) == (size, 64 << 20, "snap/meta.json")
        # ranged reads check the size first too: a hostile length allocates nothing
        with pytest.raises(ReadRangeError):
            store.read_range("snap/meta.json", size - 8, 1 << 40)
        assert store.read_range("snap/meta.json", size - 8, 8) == bytes(8)


def test_local_read_without_memory_is_a_storage_error(local, monkeypatch):
    """Without a cap, a file too large for memory still ends in a StorageError naming it (not a raw ENOMEM)."""
    import errno

    import rl_ckpt._storage.local_io as local_mod

    store, _root, _ = local
    put(store, "snap/meta.json", [b"{}"])

    def enomem(size):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(local_mod, "alloc_bytes", enomem)
    with pytest.raises(StorageError, match="cannot read snap/meta.json: no memory for its 2 bytes") as info:
        store.read("snap/meta.json")
    assert info.value.path == "snap/meta.json"


def test_os_errors_map_to_storage_errors_that_say_what_to_do():
    import errno

    from rl_ckpt._storage.local_io import storage_error as _storage_error

    for code in (errno.EACCES, errno.EPERM):
        err = _storage_error(PermissionError(code, os.strerror(code)), "cannot open", "step_000000002/meta.json")
        assert isinstance(err, StoragePermissionError) and isinstance(err, StorageError)
        assert (err.path, err.errno) == ("step_000000002/meta.json", code)
        assert "cannot open step_000000002/meta.json" in str(err) and "chmod" in str(err)
    err = _storage_error(OSError(errno.EROFS, os.strerror(errno.EROFS)), "cannot create", "x")
    assert type(err) is StorageError and "read-only file system" in str(err)
    err = _storage_error(OSError(errno.EIO, os.strerror(errno.EIO)), "cannot read", "x")
    assert type(err) is StorageError and err.errno == errno.EIO
    store = open_storage("memory://rlckpt-perm/run")
    err = store._error(PermissionError("Access Denied"), "cannot read", "step_000000002/meta.json")
    assert (
        isinstance(err, StoragePermissionError) and "credentials" in str(err) and err.path == "step_000000002/meta.json"
    )


_PERMISSION_CHILD = r"""
import json, sys
from rl_ckpt._storage import open_storage

store = open_storage(sys.argv[1])
calls = {
    "read": lambda: store.read("snap/meta.json"),
    "read_capped": lambda: store.read("snap/meta.json", max_bytes=1 << 20),
    "read_range": lambda: store.read_range("snap/meta.json", 0, 1),
    "open_read": lambda: store.open_read("snap/meta.json"),
    "list": lambda: store.list("locked"),
    "exists": lambda: store.exists("locked/f.bin"),
    "size": lambda: store.size("locked/f.bin"),
    "stat": lambda: store.stat("locked/f.bin"),
    "read_in_locked": lambda: store.read("locked/f.bin"),
    "write": lambda: store.write("readonly/new.bin", [b"x"]),
    "write_create_only": lambda: store.write("readonly/new.bin", [b"x"], create_only=True),
    "write_atomic": lambda: store.write_atomic("readonly/new.bin", b"x"),
    "makedirs": lambda: store.makedirs("readonly/sub"),
    "remove": lambda: store.remove("readonly/old.bin"),
    "remove_tree": lambda: store.remove_tree("locked"),
}
out = {}
for name, call in calls.items():
    try:
        call()
        out[name] = ["ok", ""]
    except BaseException as exc:
        out[name] = [type(exc).__name__, str(exc)]
print(json.dumps(out))
"""


def test_local_permission_denied_is_a_storage_error_on_every_operation(tmp_path):
    """Real permission errors (root drops the capabilities that let it read anything): each operation raises
    StoragePermissionError naming the path and what to do, never a raw PermissionError."""
    import json
    import shutil
    import subprocess
    import sys

    import rl_ckpt

    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root and setpriv is missing: root ignores file permissions")
        prefix = [setpriv, "--bounding-set", "-dac_override,-dac_read_search,-fowner"]
    else:
        prefix = []
    root = tmp_path / "run"
    (root / "snap").mkdir(parents=True)
    (root / "snap" / "meta.json").write_bytes(b"{}")
    (root / "locked").mkdir()
    (root / "locked" / "f.bin").write_bytes(b"x")
    (root / "readonly").mkdir()
    (root / "readonly" / "old.bin").write_bytes(b"x")
    os.chmod(root / "snap" / "meta.json", 0)
    os.chmod(root / "locked", 0)
    os.chmod(root / "readonly", 0o555)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(rl_ckpt.__file__))}
    try:
        done = subprocess.run(
            prefix + [sys.executable, "-c", _PERMISSION_CHILD, str(root)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        for p, mode in ((root / "snap" / "meta.json", 0o644), (root / "locked", 0o755), (root / "readonly", 0o755)):
            os.chmod(p, mode)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 15
    for name, (kind, message) in results.items():
        assert kind == "StoragePermissionError", (name, kind, message)
        assert "Permission denied" in message and "chmod" in message, (name, message)
        assert "snap/meta.json" in message or "locked" in message or "readonly/" in message, (name, message)
    # nothing was lost or changed by the refused calls
    assert (root / "snap" / "meta.json").read_bytes() == b"{}" and (root / "locked" / "f.bin").read_bytes() == b"x"
    assert sorted(os.listdir(root / "readonly")) == ["old.bin"]


_RESTORE_CHILD = r"""
import sys
import torch
from rl_ckpt import CheckpointEngine

base, run = sys.argv[1], sys.argv[2]
engine = CheckpointEngine(base_dir=base, run_name=run)
engine.register("policy", torch.nn.Linear(3, 3))
try:
    engine.restore()
    print("restored")
except BaseException as exc:
    print("raised", type(exc).__name__, "|", exc)
"""


def test_local_restore_from_a_run_folder_the_user_may_not_read(tmp_path):
    """The case as reported: restore on a run folder the user may not read ends in a StoragePermissionError
    that names the folder and what to do, not a raw PermissionError."""
    import shutil
    import subprocess
    import sys

    import torch

    import rl_ckpt
    from rl_ckpt import CheckpointEngine

    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root and setpriv is missing: root ignores file permissions")
        prefix = [setpriv, "--bounding-set", "-dac_override,-dac_read_search,-fowner"]
    else:
        prefix = []
    engine = CheckpointEngine(base_dir=str(tmp_path), run_name="run")
    engine.register("policy", torch.nn.Linear(3, 3))
    engine.save(1)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(rl_ckpt.__file__))}
    os.chmod(tmp_path / "run", 0)
    try:
        done = subprocess.run(
            prefix + [sys.executable, "-c", _RESTORE_CHILD, str(tmp_path), "run"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        os.chmod(tmp_path / "run", 0o755)
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("raised StoragePermissionError |"), last
    assert "Permission denied" in last and "chmod" in last and str(tmp_path / "run") in last


def test_local_list_skips_an_entry_removed_while_listing(local, monkeypatch):
    """A file deleted between reading the folder and stat-ing the entry (another engine's retention) is left
    out; the rest of the folder is still listed."""
    import contextlib

    import rl_ckpt._storage.local as local_mod

    store, root, _ = local
    for name in ("a.bin", "b.bin", "c.bin"):
        put(store, f"snap/{name}", [name.encode()])
    real_scandir = os.scandir

    @contextlib.contextmanager
    def racing_scandir(path):
        with real_scandir(path) as it:
            entries = list(it)
        os.unlink(os.path.join(path, "b.bin"))  # gone after the folder was read, before its entry is stat-ed
        yield iter(entries)

    monkeypatch.setattr(local_mod.os, "scandir", racing_scandir)
    assert sorted(_names(store.list("snap"))) == ["a.bin", "c.bin"]


def test_fault_injecting_wrappers_keep_the_interface(local):
    """The test storages pass the new arguments and operations through (and a cut power stops ranged reads)."""
    from rl_ckpt.tools.faults import FaultyStorage, PowerCut, PowerLossStorage

    store, root, _ = local
    put(store, "snap/meta.json", [b"x" * 100])
    faulty = FaultyStorage(store)
    with pytest.raises(FileTooLargeError):
        faulty.read("snap/meta.json", max_bytes=10)
    assert bytes(faulty.read("snap/meta.json", max_bytes=100)) == b"x" * 100
    assert faulty.read_range("snap/meta.json", 98, 2) == b"xx" and faulty.count("open_read") == 1
    assert faulty.abort_incomplete_uploads(0) == []
    power = PowerLossStorage(str(root))
    assert power.read_range("snap/meta.json", 0, 3) == b"xxx"
    with pytest.raises(FileTooLargeError):
        power.read("snap/meta.json", max_bytes=99)
    power.power_cut()
    with pytest.raises(PowerCut):
        power.read_range("snap/meta.json", 0, 3)


def test_local_rename_dir_refuses_existing_target(local):
    store, root, _ = local
    put(store, "staging/a/f", [b"new"])
    put(store, "snap/f", [b"committed"])
    with pytest.raises(CommitConflictError):
        store.rename_dir("staging/a", "snap")
    assert bytes(store.read("snap/f")) == b"committed"
    assert bytes(store.read("staging/a/f")) == b"new"
    store.makedirs("empty_target")
    with pytest.raises(CommitConflictError):  # even an empty target is never replaced
        store.rename_dir("staging/a", "empty_target")
    store.rename_dir("staging/a", "snap2")
    assert bytes(store.read("snap2/f")) == b"new"
    assert not store.exists("staging/a")


@pytest.fixture
def linked(local):
    store, root, tmp = local
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"secret")
    os.symlink(outside, root / "dirlink")
    os.symlink(outside / "secret.txt", root / "filelink")
    put(store, "real/ok.bin", [b"ok"])
    os.symlink(outside, root / "real" / "nested_link")
    return store, root, outside


def _outside_state(outside):
    return sorted((p.name, p.read_bytes()) for p in outside.iterdir())


def test_local_symlinks_refused_for_read_and_write(linked):
    store, root, outside = linked
    before = _outside_state(outside)
    for path in ("filelink", "dirlink/secret.txt", "real/nested_link/secret.txt"):
        with pytest.raises(UnsafePathError):
            store.read(path)
        with pytest.raises(UnsafePathError):
            store.open_read(path)
        with pytest.raises(UnsafePathError):
            store.size(path)
    for path in ("filelink", "dirlink/new.txt", "dirlink/secret.txt", "real/nested_link/new.txt"):
        with pytest.raises(UnsafePathError):
            store.write(path, [b"pwned"])
        with pytest.raises(UnsafePathError):
            store.write(path, [b"pwned"], create_only=True)
        with pytest.raises(UnsafePathError):
            store.write_atomic(path, b"pwned")
    with pytest.raises(UnsafePathError):
        store.list("dirlink")
    with pytest.raises(UnsafePathError):
        store.makedirs("dirlink/sub")
    assert _outside_state(outside) == before


def test_local_list_then_read_never_follows_links(linked):
    store, root, outside = linked
    entries = _names(store.list())
    assert set(entries) == {"dirlink", "filelink", "real"}
    assert not entries["dirlink"].is_dir  # a link is not reported as a folder
    read_ok = []
    for e in store.list():
        if e.is_dir:
            for inner in store.list(e.name):
                try:
                    read_ok.append((f"{e.name}/{inner.name}", bytes(store.read(f"{e.name}/{inner.name}"))))
                except UnsafePathError:
                    pass
            continue
        with pytest.raises(UnsafePathError):
            store.read(e.name)
    assert read_ok == [("real/ok.bin", b"ok")]


def test_local_remove_tree_of_link_removes_only_the_link(linked):
    store, root, outside = linked
    before = _outside_state(outside)
    store.remove_tree("dirlink")
    assert not os.path.lexists(root / "dirlink")
    os.symlink(outside / "secret.txt", root / "filelink2")
    store.remove("filelink2")  # remove() too deletes the link, not its target
    assert not os.path.lexists(root / "filelink2")
    store.remove_tree("filelink")
    assert not os.path.lexists(root / "filelink")
    store.remove_tree("real")  # contains a link to outside: rmtree must not descend into it
    assert not os.path.lexists(root / "real")
    assert _outside_state(outside) == before


# --------------------------------------------------------------------------- S3 only
def test_s3_write_streams_multipart_and_aborts_on_failure(s3_url):
    url, options = s3_url
    part = 5 * 2**20  # S3's minimum part size
    store = open_storage(url, {**options, "default_block_size": part})
    data = os.urandom(2**20) * 12  # 12 MiB: three parts
    size = store.write("big/model.bin", (data[i : i + 2**20] for i in range(0, len(data), 2**20)))
    assert size == len(data) and store.size("big/model.bin") == len(data)
    assert bytes(store.read("big/model.bin")) == data

    def failing():
        yield from (data[i : i + 2**20] for i in range(0, 7 * 2**20, 2**20))  # one part uploaded, then:
        raise RuntimeError("producer died")

    with pytest.raises(RuntimeError, match="producer died"):
        store.write("big/partial.bin", failing())
    assert not store.exists("big/partial.bin")
    bucket = url[len("s3://") :].split("/", 1)[0]
    assert not store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")


def _spy_put_object(monkeypatch, store, before=None, after=None):
    """Wrap the client's put_object calls: ``before(kw)`` may raise, ``after(kw)`` runs once it landed."""
    real = store.fs.call_s3
    calls = []

    def spy(method, *args, **kw):
        if method != "put_object":
            return real(method, *args, **kw)
        calls.append(kw)
        if before:
            before(kw)
        out = real(method, *args, **kw)
        if after:
            after(kw)
        return out

    monkeypatch.setattr(store.fs, "call_s3", spy)
    return calls


def _spy_requests(monkeypatch, store) -> list:
    """Every S3 request the client sends: ``(method, kwargs)``."""
    real = store.fs._call_s3
    sent = []

    async def spy(method, *args, **kw):
        sent.append((method, kw))
        return await real(method, *args, **kw)

    monkeypatch.setattr(store.fs, "_call_s3", spy)
    return sent


def test_s3_read_range_is_one_ranged_get(s3_url, monkeypatch):
    url, options = s3_url
    store = S3Storage(url, {**options, "skip_instance_cache": True})
    store.write("snap/r.bin", [RANGE_DATA])
    sent = _spy_requests(monkeypatch, store)
    assert store.read_range("snap/r.bin", 5, 10) == RANGE_DATA[5:15]
    assert [(m, kw.get("Range")) for m, kw in sent] == [("get_object", "bytes=5-14")]
    sent.clear()
    with pytest.raises(ReadRangeError):
        store.read_range("snap/r.bin", 1020, 100)  # the server sends the 4 bytes there are; a HEAD tells why
    assert [m for m, _ in sent] == ["get_object", "head_object"]
    sent.clear()
    with pytest.raises(ReadRangeError):
        store.read_range("snap/r.bin", 1020, 1 << 40)  # more than a part: the size first, nothing allocated
    assert [m for m, _ in sent] == ["head_object"]


def test_s3_capped_read_asks_for_no_more_than_the_cap(s3_url, monkeypatch):
    """No HEAD before a read: one GET of at most ``max_bytes`` bytes, whose Content-Range tells the size."""
    url, options = s3_url
    store = S3Storage(url, {**options, "skip_instance_cache": True})
    store.write("snap/meta.json", [b"x" * (1 << 20)])
    sent = _spy_requests(monkeypatch, store)
    with pytest.raises(FileTooLargeError):
        store.read("snap/meta.json", max_bytes=1000)
    assert [(m, kw.get("Range")) for m, kw in sent] == [("get_object", "bytes=0-999")]
    sent.clear()
    assert bytes(store.read("snap/meta.json", max_bytes=1 << 20)) == b"x" * (1 << 20)
    assert [(m, kw.get("Range")) for m, kw in sent] == [("get_object", f"bytes=0-{(1 << 20) - 1}")]


def test_s3_create_only_is_a_conditional_put(s3_url, monkeypatch):
    """The conflict comes from S3's 412 on ``If-None-Match: *``, not from a check-then-write in our code."""
    url, options = s3_url
    store = S3Storage(url, {**options, "skip_instance_cache": True})
    calls = _spy_put_object(monkeypatch, store)
    store.write("m/meta.json", [b"one"], create_only=True)
    with pytest.raises(CommitConflictError) as info:
        store.write("m/meta.json", [b"two"], create_only=True)
    assert [c.get("IfNoneMatch") for c in calls] == ["*", "*"]
    assert isinstance(info.value.__cause__, FileExistsError)  # what s3fs makes of the 412
    response = info.value.__cause__.__cause__.response
    assert response["Error"]["Code"] == "PreconditionFailed" and response["Error"]["Condition"] == "If-None-Match"
    assert response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert bytes(store.read("m/meta.json")) == b"one"


def test_s3_create_only_retry_of_own_landed_put_is_success(s3_url, monkeypatch):
    """A PUT that landed but whose response was lost is retried and meets its own object: not a conflict."""
    url, options = s3_url
    store = S3Storage(url, {**options, "skip_instance_cache": True})
    lost = []

    def lose_first_response(kw):
        if not lost:
            lost.append(kw)
            raise OSError("connection reset after the request was sent")

    calls = _spy_put_object(monkeypatch, store, after=lose_first_response)
    store.write("s/meta.json", [b"mine"], create_only=True)  # no error: the object is ours
    assert len(calls) == 1 and lost
    assert bytes(store.read("s/meta.json")) == b"mine"
    with pytest.raises(CommitConflictError):  # a different writer still loses
        open_storage(url, options).write("s/meta.json", [b"mine"], create_only=True)


def test_s3_conditional_write_in_flight_is_retried(s3_url, monkeypatch):
    """409 ConditionalRequestConflict (another conditional PUT of the key in flight) is retried, not a loss."""
    from botocore.exceptions import ClientError

    url, options = s3_url
    store = S3Storage(url, {**options, "skip_instance_cache": True})

    def busy_once(kw):
        if len(calls) == 1:
            err = ClientError(
                {
                    "Error": {"Code": "ConditionalRequestConflict", "Message": "in progress"},
                    "ResponseMetadata": {"HTTPStatusCode": 409},
                },
                "PutObject",
            )
            raise OSError(16, "in progress") from err  # how s3fs translates a 409

    calls = _spy_put_object(monkeypatch, store, before=busy_once)
    store.write("c/meta.json", [b"after retry"], create_only=True)
    assert len(calls) == 2 and all(kw["IfNoneMatch"] == "*" for kw in calls)
    assert bytes(store.read("c/meta.json")) == b"after retry"


def test_s3_create_only_refused_without_if_none_match_support(s3_url, monkeypatch):
    url, options = s3_url
    store = S3Storage(url, {**options, "skip_instance_cache": True})
    store._conditional_put = False  # as with a botocore whose PutObject model lacks IfNoneMatch
    with pytest.raises(StorageError, match="If-None-Match") as info:
        store.write("n/meta.json", [b"x"], create_only=True)
    assert not isinstance(info.value, CommitConflictError)
    assert not store.exists("n/meta.json")


def test_s3_client_defaults(s3_url):
    url, options = s3_url
    store = S3Storage(url, {**options, "skip_instance_cache": True})
    assert store.fs.dircache.use_listings_cache is False  # no listing cache to go stale
    assert store.fs.s3.meta.config.retries["mode"] == "standard"
    assert store.fs.s3.meta.config.s3["addressing_style"] == "path"  # caller's config_kwargs kept
    assert store.fs.s3.meta.config.s3["payload_signing_enabled"] is False  # as over HTTPS: no SHA-256 of each body
    assert store.fs.s3.meta.config.request_checksum_calculation == "when_required"  # verify-after-write re-reads
    assert store.fs.s3.meta.config.read_timeout == 60  # botocore's, not s3fs's 15 s: parts in flight take time
    assert (store.fs.default_block_size, store.fs.max_concurrency) == (8 * 2**20, 16)  # part size, parts in flight
    for bad in ({"max_concurrency": 0}, {"default_block_size": "8MiB"}, {"max_concurrency": True}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            S3Storage(url, {**options, "skip_instance_cache": True, **bad})
    store._check_conditional_put()
    assert store._conditional_put is True  # this botocore can send If-None-Match on PutObject
    mine = S3Storage(
        url,
        {**options, "skip_instance_cache": True, "config_kwargs": {"retries": {"max_attempts": 2, "mode": "legacy"}}},
    )
    assert mine.fs.s3.meta.config.retries["mode"] == "legacy"  # caller's retry config wins


def test_s3_user_enabled_listings_cache_is_not_served_stale(s3_url):
    url, options = s3_url
    a = S3Storage(url, {**options, "use_listings_cache": True, "skip_instance_cache": True})
    b = S3Storage(url, {**options, "skip_instance_cache": True})
    a.write("d/x", [b"1"])
    assert set(_names(a.list("d"))) == {"x"} and a.exists("d/x")
    b.write("d/y", [b"2"])
    b.remove("d/x")
    assert a.exists("d/y") and not a.exists("d/x")
    assert set(_names(a.list("d"))) == {"y"}
    assert a.size("d/y") == 1


def test_s3_manifest_last_commit_race_has_one_winner(s3_url):
    url, options = s3_url
    n = 4
    barrier = threading.Barrier(n)
    results: dict[int, object] = {}

    def saver(i):
        # each saver has its own client, like separate processes
        store = S3Storage(url, {**options, "skip_instance_cache": True})
        strategy = ManifestLastCommit(store)
        try:
            attempt = strategy.begin("step_000100")
            store.write(attempt.data_path("model.safetensors"), [f"weights of saver {i}".encode()])
            manifest = f'{{"saver": {i}, "files": ["{attempt.manifest_path("model.safetensors")}"]}}'.encode()
            barrier.wait(timeout=30)  # everyone has begun and written data: race the commit
            strategy.commit(attempt, manifest)
            results[i] = ("won", manifest, attempt)
        except CommitConflictError as exc:
            results[i] = ("lost", exc)
        except BaseException as exc:  # noqa: BLE001
            results[i] = ("error", exc)

    threads = [threading.Thread(target=saver, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    kinds = sorted(r[0] for r in results.values())
    assert kinds == ["lost"] * (n - 1) + ["won"], results
    ((_, manifest, attempt),) = [r for r in results.values() if r[0] == "won"]
    store = open_storage(url, options)
    assert bytes(store.read(join("step_000100", MANIFEST_NAME))) == manifest
    # the winner's data is where its manifest says
    assert store.exists(join("step_000100", attempt.manifest_path("model.safetensors")))
    # every attempt folder is there (losers' folders are debris for gc), the manifest once
    listed = _names(store.list("step_000100"))
    assert MANIFEST_NAME in listed and sum(1 for e in listed.values() if e.is_dir) == n


def test_per_file_runs_the_files_at_once_and_raises_the_first_failure_in_order():
    """``per_file``: up to ``files_at_once`` jobs run at once (job 0 finishes only once job 1 has started), results
    come back in order, every job has ended when it returns, and the first failure in order is raised."""
    from rl_ckpt._storage import MemoryStorage
    from rl_ckpt._storage.base import per_file

    class Wide(MemoryStorage):
        files_at_once = 2

    store = Wide("memory://per-file")
    started = [threading.Event() for _ in range(3)]
    ended = []

    def job(i: int) -> int:
        started[i].set()
        if i == 0:
            assert started[1].wait(60), "job 1 did not start while job 0 ran"
        ended.append(i)
        return i * 10

    assert per_file(store, [0, 1, 2], job) == [0, 10, 20]

    def failing(i: int) -> int:
        ended.append(i)
        if i in (1, 2):
            raise StorageError(f"file {i}")
        return i

    ended.clear()
    with pytest.raises(StorageError, match="file 1"):
        per_file(store, [0, 1, 2], failing)
    assert sorted(ended) == [0, 1, 2]  # none left running
    ended.clear()
    with pytest.raises(StorageError, match="file 1"):
        per_file(store, [0, 1, 2], failing, at_once=False)
    assert ended == [0, 1]  # one at a time: stops at the first failure
