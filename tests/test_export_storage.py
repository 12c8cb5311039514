"""``rl-ckpt export`` writes through storage: to a local folder, to ``memory://`` and to S3 (the loopback endpoint).

Each target gets the whole export or nothing: a failure in the middle of an
export to an object store takes back the shards already published, and a
target that holds something is refused without touching it.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as load_safetensors

from rl_ckpt import CheckpointEngine, ConfigError
from rl_ckpt.cli import main as cli
from rl_ckpt._export import ComponentSource, export_component, export_hf
from rl_ckpt._run.snapshot_files import read_manifest
from rl_ckpt._storage import open_storage

SHARD = "12KB"  # several shard files for the model below (a layer is ~9.4 KB)


def model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(*[torch.nn.Linear(48, 48) for _ in range(6)])


@pytest.fixture
def run(tmp_path):
    engine = CheckpointEngine(base_dir=str(tmp_path), run_name="r", retention=False)
    engine.register("policy", model())
    engine.save(1)
    engine.close()
    storage = open_storage(str(tmp_path / "r"), {})
    return storage, read_manifest(storage, "step_000000001"), str(tmp_path / "r")


def expected() -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model().state_dict().items()}


def assert_equal(got: dict[str, torch.Tensor]) -> None:
    want = expected()
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def read_hf(target, folder: str) -> dict[str, torch.Tensor]:
    index = json.loads(bytes(target.read(f"{folder}/model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3
    out = {}
    for name in files:
        out.update(load_safetensors(bytes(target.read(f"{folder}/{name}"))))
    assert {k: f for k, f in index["weight_map"].items()} == {
        k: f for f in files for k in load_safetensors(bytes(target.read(f"{folder}/{f}")))
    }
    return out


def test_export_to_s3_file_and_folder(run, s3_url):
    storage, manifest, _ = run
    url, options = s3_url
    export_component(storage, manifest, "policy", f"{url}/out/policy.safetensors", storage_options=options)
    export_hf(storage, manifest, "policy", f"{url}/out/hf", max_shard_size=SHARD, storage_options=options)
    target = open_storage(url, options)
    assert_equal(load_safetensors(bytes(target.read("out/policy.safetensors"))))
    assert_equal(read_hf(target, "out/hf"))
    # The folder now holds files: a second export there is refused and changes nothing.
    before = sorted(e.name for e in target.list("out/hf"))
    with pytest.raises(ConfigError, match="not an empty folder"):
        export_hf(storage, manifest, "policy", f"{url}/out/hf", max_shard_size=SHARD, storage_options=options)
    assert sorted(e.name for e in target.list("out/hf")) == before


def test_failed_export_to_s3_takes_back_published_shards(run, s3_url, monkeypatch):
    storage, manifest, _ = run
    url, options = s3_url
    real = ComponentSource.tensor
    served = []

    def failing(self, key):
        served.append(key)
        if len(served) == 8:  # after several shards were published
            raise OSError(5, "injected read failure")
        return real(self, key)

    monkeypatch.setattr(ComponentSource, "tensor", failing)
    with pytest.raises(Exception, match="injected read failure"):
        export_hf(storage, manifest, "policy", f"{url}/out/hf", max_shard_size=SHARD, storage_options=options)
    assert len(served) == 8
    target = open_storage(url, options)
    assert target.list("out/hf") == []
    with pytest.raises(Exception, match="injected read failure"):
        served.clear()
        export_component(storage, manifest, "policy", f"{url}/out/one.safetensors", storage_options=options)
    assert not target.exists("out/one.safetensors")


def test_export_to_memory_and_local_through_the_cli(run, tmp_path):
    storage, manifest, path = run
    export_component(storage, manifest, "policy", "memory://exports/policy.safetensors")
    assert_equal(load_safetensors(bytes(open_storage("memory://exports", {}).read("policy.safetensors"))))
    (tmp_path / "hf").mkdir()  # an empty folder is a valid target
    assert (
        cli(
            [
                "export",
                path,
                "step_000000001",
                "policy",
                "--format",
                "hf",
                "-o",
                str(tmp_path / "hf"),
                "--max-shard-size",
                SHARD,
            ]
        )
        == 0
    )
    assert_equal(read_hf(open_storage(str(tmp_path), {}), "hf"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left
    # Missing folders on the way to a local target are created.
    assert cli(["export", path, "step_000000001", "policy", "-o", str(tmp_path / "deep" / "er" / "p.safetensors")]) == 0
    assert_equal(load_safetensors((tmp_path / "deep" / "er" / "p.safetensors").read_bytes()))
