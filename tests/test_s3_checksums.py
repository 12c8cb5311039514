"""Verify-after-write on S3 through checksums the server checks: every part and PUT carries the CRC32 of its
body (or its SHA-256), and where the endpoint was seen to refuse a wrong one (a probe PUT), the stored object is not
read back.
Through the latency proxy (``s3_proxy_url``): a save reads nothing back, a part damaged on the way is refused and
sent again, and the same damage with the checksums off is caught by the read-back; an endpoint that stores a
wrong checksum (plain moto, as some S3-compatible stores) gets its objects read back."""

from __future__ import annotations

import pytest

from rl_ckpt.errors import CheckpointError, ConfigError
from rl_ckpt._storage import open_storage
from test_s3_proxy import _cfg, _engine, _model, _same  # ~12 MiB of weights: 3 parts of 5 MiB through the proxy

MIB = 1024 * 1024


def _data(proxy, method: str, step: int) -> list[str]:
    return [p for m, p, _r in proxy.log if m == method and f"step_{step:09d}" in p and ".safetensors" in p]


def _client(options: dict):
    """A boto3 client for the endpoint in ``options``, without retries (botocore retries ``BadDigest``)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=options["endpoint_url"],
        aws_access_key_id=options["key"],
        aws_secret_access_key=options["secret"],
        region_name="us-east-1",
        config=Config(
            s3={"addressing_style": "path"},
            retries={"mode": "standard", "max_attempts": 1},
            request_checksum_calculation="when_required",
        ),
    )


@pytest.mark.parametrize("algo", ["SHA256", "CRC32"])
def test_the_test_server_refuses_a_body_whose_checksum_is_wrong_as_s3_does(s3_url, algo):
    from botocore.exceptions import ClientError

    from rl_ckpt._storage.s3_transfer import b64, raw_checksum

    url, options = s3_url
    bucket, prefix = url[len("s3://") :].split("/", 1)
    client = _client(options)
    wrong = b64(raw_checksum(algo, [memoryview(b"other bytes")]))
    with pytest.raises(ClientError) as info:
        client.put_object(Bucket=bucket, Key=f"{prefix}/c.bin", Body=b"payload", **{f"Checksum{algo}": wrong})
    assert info.value.response["Error"]["Code"] == "BadDigest"
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0  # nothing stored
    right = b64(raw_checksum(algo, [memoryview(b"payload")]))
    client.put_object(Bucket=bucket, Key=f"{prefix}/c.bin", Body=b"payload", **{f"Checksum{algo}": right})
    assert client.get_object(Bucket=bucket, Key=f"{prefix}/c.bin")["Body"].read() == b"payload"


def test_a_save_is_checked_by_the_server_and_not_read_back(s3_proxy_url):
    url, options, proxy = s3_proxy_url
    cfg = _cfg(url, options)
    model = _model(1)
    engine = _engine(cfg, model)
    assert engine.storage.endpoint_checks_checksums()  # the probe: a wrong checksum was refused
    proxy.clear()
    engine.save(1)  # verify-after-write on (the default)
    assert len([p for p in _data(proxy, "PUT", 1) if "partNumber=" in p]) >= 3  # a multipart upload
    assert _data(proxy, "GET", 1) == []  # the server checked every part: nothing read back
    assert not [p for _m, p, _r in proxy.log if "checksum-probe" in p]  # probed once per process, not per save
    fresh = _model(2)
    assert _engine(cfg, fresh).restore().snapshot_id == "step_000000001"  # the restore re-hashes every byte
    assert _same(fresh, model)


def test_a_part_damaged_on_the_way_is_refused_and_sent_again(s3_proxy_url):
    url, options, proxy = s3_proxy_url
    cfg = _cfg(url, options)
    model = _model(3)
    engine = _engine(cfg, model)
    engine.storage.endpoint_checks_checksums()
    damaged = proxy.corrupt(lambda m, p, h: m == "PUT" and "step_000000001" in p and "partNumber=2&" in p + "&")
    engine.save(1)
    assert damaged.hits == 1
    parts2 = [p for p in _data(proxy, "PUT", 1) if "partNumber=2&" in p + "&"]
    assert len(parts2) == 2, parts2  # refused (BadDigest), then sent again from the same memory
    assert _data(proxy, "GET", 1) == []
    fresh = _model(4)
    assert _engine(cfg, fresh).restore().snapshot_id == "step_000000001"
    assert _same(fresh, model)


def test_without_server_checksums_the_same_damage_is_caught_by_the_read_back(s3_proxy_url):
    url, options, proxy = s3_proxy_url
    cfg = _cfg(url, {**options, "server_checksums": False})
    model = _model(5)
    engine = _engine(cfg, model)
    engine.save(1)
    assert _data(proxy, "GET", 1)  # read back
    assert not engine.storage.endpoint_checks_checksums()
    damaged = proxy.corrupt(lambda m, p, h: m == "PUT" and "step_000000002" in p and "partNumber=2&" in p + "&")
    with pytest.raises(CheckpointError, match="verify-after-write"):
        engine.save(2)  # the damaged part was stored; its read-back does not match: nothing committed
    assert damaged.hits == 1
    fresh = _model(6)
    assert _engine(cfg, fresh).restore().snapshot_id == "step_000000001"
    assert _same(fresh, model)


def test_an_endpoint_that_stores_a_wrong_checksum_gets_its_objects_read_back(s3_endpoint):
    """Plain moto stores a body whose checksum is wrong, as some S3-compatible stores do: the probe sees it, deletes
    its object, and every save's objects are read back and re-hashed."""
    from urllib.parse import urlparse

    from rl_ckpt.tools.s3_endpoint import start_moto
    from rl_ckpt.tools.s3_proxy import LatencyProxy

    server, port = start_moto(check_checksums=False)
    proxy = LatencyProxy(("127.0.0.1", port), latency=0, rate=None)
    proxy.start()
    try:
        options = {**s3_endpoint, "endpoint_url": proxy.endpoint_url, "default_block_size": 5 * MIB}
        _client({**options, "endpoint_url": f"http://127.0.0.1:{port}"}).create_bucket(Bucket="plain-moto")
        url = "s3://plain-moto/runs/r1"
        cfg = _cfg(url, options)
        model = _model(7)
        engine = _engine(cfg, model)
        assert urlparse(options["endpoint_url"]).port == proxy.port
        assert not engine.storage.endpoint_checks_checksums()
        engine.save(1)
        assert _data(proxy, "GET", 1)  # verify-after-write read the object back
        keys = [o["Key"] for o in _client(options).list_objects_v2(Bucket="plain-moto").get("Contents", [])]
        assert not [k for k in keys if "checksum-probe" in k], keys  # the probe's object was deleted
        fresh = _model(8)
        assert _engine(cfg, fresh).restore().snapshot_id == "step_000000001"
        assert _same(fresh, model)
    finally:
        proxy.stop()
        server.stop()


@pytest.mark.parametrize("value", ["md5", 1, "yes"])
def test_server_checksums_option_is_checked(s3_url, value):
    url, options = s3_url
    with pytest.raises(ConfigError, match="server_checksums"):
        open_storage(url, {**options, "server_checksums": value})


def test_sha256_server_checksums_round_trip(s3_proxy_url):
    url, options, proxy = s3_proxy_url
    store = open_storage(url, {**options, "server_checksums": "sha256"})
    data = bytes(range(256)) * (11 * MIB // 256)
    assert store.write("snap/x.bin", [data]) == len(data)
    assert store.write_attested("snap/x.bin", len(data))
    assert not store.write_attested("snap/x.bin", len(data))  # asked once per write
    assert bytes(store.read("snap/x.bin")) == data


def test_attested_writes_are_answered_once_and_bounded(s3_url, monkeypatch):
    from rl_ckpt._storage import s3_checksums

    url, options = s3_url
    store = open_storage(url, options)
    monkeypatch.setattr(s3_checksums, "_ATTESTED_KEPT", 3)
    for i in range(5):
        store.attest(f"f{i}", i + 10)
    assert not store.write_attested("f0", 10) and not store.write_attested("f1", 11)  # the oldest forgotten
    assert not store.write_attested("f2", 99)  # another size: not the write that was checked
    assert store.write_attested("f3", 13) and not store.write_attested("f3", 13)  # once
    assert store.write_attested("f4", 14)
