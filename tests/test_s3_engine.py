"""The whole engine on a real S3 endpoint (moto on 127.0.0.1): every feature works without rename."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import PPOState, assert_same_state
from rl_ckpt import CheckpointEngine, CommitConflictError, StorageError
from rl_ckpt.cli import main as cli
from rl_ckpt._commit import ManifestLastCommit


def _cfg(s3_url, **extra):
    url, options = s3_url
    base, _, run = url.rpartition("/")
    return {"base_dir": base, "run_name": run, "storage_options": options, **extra}


def _opts(options) -> list[str]:
    out = []
    for k, v in options.items():
        out += ["--storage-option", f"{k}={json.dumps(v)}"]
    return out


def test_round_trip_verify_cli_on_s3(s3_url):
    cfg = _cfg(s3_url)
    s = PPOState(seed=8)
    e = s.register(CheckpointEngine(**cfg))
    assert isinstance(e.commit, ManifestLastCommit)
    s.train(2)
    e.save(2, metrics={"avg_reward": 3.0})
    s.train(1)
    e.save_async(3, metrics={"avg_reward": 4.0}).wait(timeout=60)
    fresh = PPOState(seed=1)
    assert fresh.register(CheckpointEngine(**cfg)).restore().snapshot_id == "step_000000003"
    assert_same_state(fresh, s)
    url, options = s3_url
    assert cli(["verify", url, *_opts(options)]) == 0
    assert cli(["ls", url, "--deep", *_opts(options)]) == 0
    with pytest.raises(CommitConflictError):
        e.save(3)


def test_dedup_retention_and_corruption_on_s3(s3_url):
    import s3fs

    cfg = _cfg(s3_url, dedup=True, keep_latest=2, keep_best=0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 128))
    e = CheckpointEngine(**cfg)
    e.register("policy", model)
    saved = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            model[1].weight.add_(1.0)  # the first weight is unchanged: stored once
            model[1].bias.add_(1.0)
        e.save(step)
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    assert [i.global_step for i in CheckpointEngine(**cfg).snapshots()] == [2, 3]
    url, options = s3_url
    fs = s3fs.S3FileSystem(**options)
    objects = [p for p in fs.find(url + "/objects")]
    assert len(objects) == 3  # the first weight + the second weight of steps 2 and 3 (step 1's was swept)
    m3 = CheckpointEngine(**cfg).catalog.get("step_000000003").manifest
    assert set(m3.components["policy"]["objects"]) == {"0.weight", "1.weight"}  # biases: the snapshot's own file
    assert [f.role for f in m3.files_of("policy")].count("tensors") == 1
    w3 = m3.components["policy"]["objects"]["1.weight"][0][0]
    victim = next(p for p in objects if p.endswith(w3))
    fs.pipe_file(victim, b"corrupted")
    report = CheckpointEngine(**cfg).verify()
    assert report.bad_snapshots == ["step_000000003"]
    restored = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 128))
    e2 = CheckpointEngine(**cfg)
    e2.register("policy", restored)
    assert e2.restore().snapshot_id == "step_000000002"
    assert all(torch.equal(v, saved[2][k]) for k, v in restored.state_dict().items())


def test_large_shard_parallel_multipart_and_abort(s3_url, monkeypatch):
    import s3fs

    url, options = s3_url
    part = 5 * 1024 * 1024  # S3's minimum part size
    cfg = _cfg((url, {**options, "default_block_size": part}), verify_after_write=True)
    big = torch.nn.Linear(2048, 2048)  # 16 MiB of weights: several parts in flight
    e = CheckpointEngine(**cfg)
    e.register("policy", big)
    e.save(1)
    fresh = torch.nn.Linear(2048, 2048)
    e2 = CheckpointEngine(**cfg)
    e2.register("policy", fresh)
    e2.restore()
    assert torch.equal(fresh.weight, big.weight)

    calls = {"n": 0}
    real = e.storage.fs._call_s3

    async def flaky(method, *args, **kwargs):
        if method == "upload_part":
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError("connection reset by peer (injected)")
        return await real(method, *args, **kwargs)

    monkeypatch.setattr(e.storage.fs, "_call_s3", flaky)
    with pytest.raises(StorageError, match="injected"):
        e.save(2)
    monkeypatch.setattr(e.storage.fs, "_call_s3", real)
    url, options = s3_url
    bucket = url.split("/")[2]
    client = s3fs.S3FileSystem(**options)
    uploads = client.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert uploads == []  # aborted, nothing half-published
    assert [i.global_step for i in CheckpointEngine(**cfg).snapshots()] == [1]


def test_gc_on_s3_removes_orphans_and_stale_uploads(s3_url):
    import s3fs

    cfg = _cfg(s3_url)
    e = CheckpointEngine(**cfg)
    e.register("policy", torch.nn.Linear(4, 4))
    e.save(1)
    url, options = s3_url
    fs = s3fs.S3FileSystem(**options)
    fs.pipe_file(f"{url}/step_000000002/attempt-x/policy.safetensors", b"partial")  # a save that never committed
    bucket, key = url.split("/", 3)[2], url.split("/", 3)[3] + "/step_000000003/big.safetensors"
    fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)  # a crashed multipart upload
    assert cli(["gc", url, "--grace", "0", *_opts(options)]) == 0
    fs.invalidate_cache()
    assert not fs.exists(f"{url}/step_000000002/attempt-x/policy.safetensors")
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", []) == []
    assert [i.global_step for i in CheckpointEngine(**cfg).snapshots()] == [1]
