"""S3 through a latency proxy (30 ms per request, 40 MB/s per connection, ``s3_proxy_url``), as a remote object store
behaves: bitwise round trips made of parallel parts and ranges, a range cut mid-body fetched again, a range that
keeps failing making the restore fall back, and a save SIGKILLed mid-upload leaving nothing that verifies and
nothing ``rl-ckpt gc`` does not clean."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal

import pytest
import torch

from rl_ckpt import CheckpointEngine
from rl_ckpt.cli import main as cli

MIB = 1024 * 1024


def _cfg(url: str, options: dict, **extra) -> dict:
    base, _, run = url.rpartition("/")
    return {"base_dir": base, "run_name": run, "storage_options": options, **extra}


def _opts(options: dict) -> list[str]:
    out = []
    for k, v in options.items():
        out += ["--storage-option", f"{k}={json.dumps(v)}"]
    return out


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 512))  # ~12 MiB of weights


def _engine(cfg: dict, model: torch.nn.Module) -> CheckpointEngine:
    engine = CheckpointEngine(**cfg)
    engine.register("policy", model)
    return engine


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _data_gets(proxy, step: int) -> list[str]:
    """The Range headers of the GETs of step ``step``'s tensor file, in the order the proxy saw them."""
    return [r for m, p, r in proxy.log if m == "GET" and f"step_{step:09d}" in p and p.endswith(".safetensors")]


def test_round_trip_through_the_proxy_is_bitwise_in_parallel_parts_and_ranges(s3_proxy_url):
    url, options, proxy = s3_proxy_url
    cfg = _cfg(url, options)
    model = _model(1)
    _engine(cfg, model).save(1)  # verify-after-write on: the stored object is read back and re-hashed
    puts = [p for m, p, _r in proxy.log if m == "PUT" and "partNumber=" in p and ".safetensors?" in p]
    assert len(puts) >= 3, puts  # one multipart upload of several parts
    proxy.clear()
    fresh = _model(2)
    assert _engine(cfg, fresh).restore().snapshot_id == "step_000000001"
    assert _same(fresh, model)
    ranges = _data_gets(proxy, 1)
    assert len(ranges) >= 3 and all(r.startswith("bytes=") for r in ranges), ranges  # ranged pieces only
    heads = [p for m, p, _r in proxy.log if m == "HEAD" and p.endswith(".safetensors")]
    assert len(heads) <= 1, heads  # the read asks for no size first (the plan may stat the file once)


def test_a_range_cut_mid_body_is_fetched_again(s3_proxy_url):
    url, options, proxy = s3_proxy_url
    cfg = _cfg(url, options)
    model = _model(3)
    _engine(cfg, model).save(1)
    proxy.clear()

    def second_piece(method: str, path: str, headers: dict) -> bool:
        rng = headers.get("range", "")
        return method == "GET" and path.endswith(".safetensors") and rng.startswith("bytes=") and rng != "bytes=0-"

    fault = proxy.fail(second_piece, after_bytes=64 * 1024, times=1)
    fresh = _model(4)
    result = _engine(cfg, fresh).restore()
    assert fault.hits == 1 and result.snapshot_id == "step_000000001" and not result.skipped
    assert _same(fresh, model)
    ranges = _data_gets(proxy, 1)
    assert len(set(ranges)) >= 3  # the file came in parallel pieces
    assert len(ranges) == len(set(ranges)) + 1  # the cut one was asked for once more, nothing else twice


def test_a_range_that_keeps_failing_makes_the_restore_fall_back(s3_proxy_url):
    url, options, proxy = s3_proxy_url
    cfg = _cfg(url, options)
    old, new = _model(5), _model(6)
    _engine(cfg, old).save(1)
    _engine(cfg, new).save(2)
    proxy.clear()

    def newest_data(method: str, path: str, headers: dict) -> bool:
        return method == "GET" and "step_000000002" in path and path.endswith(".safetensors") and "range" in headers

    proxy.fail(newest_data, after_bytes=64 * 1024, times=None)
    fresh = _model(7)
    result = _engine(cfg, fresh).restore()
    assert result.snapshot_id == "step_000000001"
    assert "step_000000002" in result.skipped
    assert _same(fresh, old)


def _save_two(cfg: dict, conn) -> None:
    """Child: commit step 1, then save step 2 (whose upload the parent holds at a part and SIGKILLs us)."""
    torch.set_num_threads(1)
    engine = CheckpointEngine(**cfg)
    engine.register("policy", _model(8))
    engine.save(1)
    conn.send_bytes(b"1")
    engine.save(2)
    conn.send_bytes(b"2")  # pragma: no cover - the parent kills us before this


def test_save_killed_mid_upload_leaves_nothing_that_verifies_and_gc_cleans_it(s3_proxy_url):
    import s3fs

    url, options, proxy = s3_proxy_url
    cfg = _cfg(url, options)

    def second_part_of_step_2(method: str, path: str, headers: dict) -> bool:
        return method == "PUT" and "step_000000002" in path and "partNumber=2" in path

    held = proxy.hold(second_part_of_step_2)
    ctx = mp.get_context("forkserver")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_save_two, args=(cfg, send), daemon=True)
    child.start()
    send.close()
    try:
        assert recv.poll(120) and recv.recv_bytes() == b"1"
        assert held.reached.wait(120), "the save of step 2 never reached its second part"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        held.release()
    assert child.exitcode == -signal.SIGKILL
    fs = s3fs.S3FileSystem(**{**options, "skip_instance_cache": True})
    bucket, prefix = url[len("s3://") :].split("/", 1)
    uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])
    assert [u["Key"].rsplit("/", 1)[-1] for u in uploads] == ["policy.safetensors"]  # left by the killed save
    assert "step_000000002" in uploads[0]["Key"]
    restored = _model(9)
    assert _engine(cfg, restored).restore().snapshot_id == "step_000000001"  # step 2 never committed
    assert _same(restored, _model(8))
    assert [i.global_step for i in CheckpointEngine(**cfg).snapshots()] == [1]
    assert cli(["verify", url, *_opts(options)]) == 0  # every committed snapshot verifies; step 2 is none

    assert cli(["gc", url, "--grace", "0", *_opts(options)]) == 0
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/").get("Uploads", []) == []
    fs.invalidate_cache()
    assert not [k for k in fs.find(url) if "step_000000002" in k]  # the attempt's debris is gone too
    assert [i.global_step for i in CheckpointEngine(**cfg).snapshots()] == [1]


@pytest.mark.parametrize("size", [0, 5 * MIB, 11 * MIB + 7])
def test_storage_round_trips_at_part_boundaries_through_the_proxy(s3_proxy_url, size):
    from rl_ckpt._format.checksum import new_hasher
    from rl_ckpt._storage import open_storage

    url, options, proxy = s3_proxy_url
    store = open_storage(url, options)
    data = os.urandom(size)
    chunks = [data[i : i + 3 * MIB] for i in range(0, size, 3 * MIB)] or [b""]  # chunks cross part boundaries
    assert store.write("snap/x.bin", chunks) == size
    hashed = new_hasher("xxh3_128")
    got = store.read("snap/x.bin", on_chunk=hashed.update, max_bytes=size)
    assert bytes(got) == data
    expect = new_hasher("xxh3_128")
    expect.update(data)
    assert hashed.hexdigest() == expect.hexdigest()  # on_chunk saw every byte, in order
    with store.open_read("snap/x.bin") as f:
        assert f.read() == data
    if size > 10:
        assert bytes(store.read_range("snap/x.bin", size // 3, size // 2)) == data[size // 3 : size // 3 + size // 2]


def test_components_travel_at_once_and_round_trip_bitwise(s3_proxy_url):
    """A policy and its optimizer: S3 writes and reads a snapshot's component files at once
    (``files_at_once``); both come back bitwise, each file in ranged pieces, and a file whose ranges keep
    failing still makes the whole restore fall back with the objects left as the older snapshot had them."""
    url, options, proxy = s3_proxy_url
    cfg = _cfg(url, options)
    model = _model(10)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.ones(2, 1024)).sum().backward()
    optim.step()

    def engine_of(m, o) -> CheckpointEngine:
        e = CheckpointEngine(**cfg)
        e.register("policy", m)
        e.register("optim", o)
        return e

    engine_of(model, optim).save(1)
    first = {k: v.clone() for k, v in optim.state_dict()["state"][0].items()}
    optim.step()
    engine_of(model, optim).save(2)
    proxy.clear()
    fresh = _model(11)
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    assert engine_of(fresh, fresh_optim).restore().snapshot_id == "step_000000002"
    assert _same(fresh, model)
    for a, b in zip(fresh_optim.state_dict()["state"].values(), optim.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in b)
    gets = [p for m, p, _r in proxy.log if m == "GET" and "step_000000002" in p and p.endswith(".safetensors")]
    assert {p.rsplit("/", 1)[-1] for p in gets} == {"policy.safetensors", "optim.safetensors"}

    proxy.clear()

    def newest_optim(method: str, path: str, headers: dict) -> bool:
        newest = "step_000000002/" in path and path.endswith("/optim.safetensors")
        return method == "GET" and newest and "range" in headers

    fault = proxy.fail(newest_optim, after_bytes=64 * 1024, times=None)
    again = _model(12)
    again_optim = torch.optim.Adam(again.parameters(), lr=1e-3)
    result = engine_of(again, again_optim).restore()
    assert result.snapshot_id == "step_000000001" and "step_000000002" in result.skipped
    assert fault.hits >= 3  # the piece was asked for again before the file was refused
    assert all(torch.equal(again_optim.state_dict()["state"][0][k], v) for k, v in first.items())
