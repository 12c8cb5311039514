"""Content-addressed dedup: unchanged tensor data is stored once, and still verifies, restores and exports."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from rl_ckpt import CheckpointEngine
from rl_ckpt.cli import main as cli

MiB = 1024 * 1024


class Model(torch.nn.Module):
    def __init__(self, n: int = 16, mib: int = 1) -> None:
        super().__init__()
        self.layers = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(mib * MiB // 4)) for _ in range(n)])


def du(path) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


@pytest.mark.parametrize("layout", ["whole-tensors", "rows-of-a-big-tensor"])
def test_quarter_changed_costs_about_the_changed_bytes(tmp_path, layout):
    torch.manual_seed(0)
    if layout == "whole-tensors":
        model = Model(n=16)
    else:  # one 32 MiB tensor; a quarter of its 8 MiB chunks change
        model = Model(n=1, mib=32)
    e = CheckpointEngine(base_dir=str(tmp_path), dedup=True, retention=False)
    e.register("policy", model)
    e.save(1)
    first = du(tmp_path)
    with torch.no_grad():
        if layout == "whole-tensors":
            changed = 0
            for p in list(model.layers)[:4]:
                p.add_(1.0)
                changed += p.numel() * 4
        else:
            flat = model.layers[0]
            flat[: flat.numel() // 4].add_(1.0)
            changed = flat.numel()
    e.save(2)
    added = du(tmp_path) - first
    assert added <= 1.05 * changed + MiB, (added, changed)
    assert e.verify().ok


def test_frozen_reference_model_costs_nothing_after_the_first_snapshot(tmp_path):
    torch.manual_seed(1)
    ref, policy = Model(n=8), torch.nn.Linear(64, 64)
    e = CheckpointEngine(base_dir=str(tmp_path), dedup=True, retention=False)
    e.register("reference", ref)
    e.register("policy", policy)
    e.save(1)
    before = du(tmp_path)
    for step in range(2, 6):
        with torch.no_grad():
            policy.weight.add_(0.1)
        e.save(step)
    assert du(tmp_path) - before < 4 * (64 * 64 * 4 + 64 * 1024)  # only the policy and the JSON files


def test_dedup_restore_export_and_corruption(tmp_path):
    torch.manual_seed(2)
    model = Model(n=4)
    e = CheckpointEngine(base_dir=str(tmp_path), dedup=True, retention=False)
    e.register("policy", model)
    e.save(1)
    saved1 = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.layers[0].add_(1.0)
    e.save(2)
    saved2 = {k: v.clone() for k, v in model.state_dict().items()}

    fresh = Model(n=4)
    e2 = CheckpointEngine(base_dir=str(tmp_path), dedup=True)
    e2.register("policy", fresh)
    assert e2.restore().snapshot_id == "step_000000002"
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved2.items())

    out = tmp_path / "export.safetensors"
    assert cli(["export", str(tmp_path / "run"), "step_000000002", "policy", "-o", str(out)]) == 0
    assert all(torch.equal(load_file(str(out))[k], v) for k, v in saved2.items())

    # Corrupt the one object only snapshot 2 has: it is refused, snapshot 1 is restored exactly.
    manifest2 = e2.catalog.get("step_000000002").manifest
    manifest1 = e2.catalog.get("step_000000001").manifest
    from rl_ckpt._run.dedup import manifest_objects, object_path

    only2 = set(manifest_objects(manifest2)) - set(manifest_objects(manifest1))
    digest = next(iter(only2))
    path = tmp_path / "run" / object_path(e2.config.checksum_algo, digest)
    data = bytearray(path.read_bytes())
    data[7] ^= 0x40
    path.write_bytes(bytes(data))
    report = CheckpointEngine(base_dir=str(tmp_path)).verify()
    assert report.bad_snapshots == ["step_000000002"]
    assert cli(["verify", str(tmp_path / "run")]) == 1
    fresh = Model(n=4)
    e3 = CheckpointEngine(base_dir=str(tmp_path))
    e3.register("policy", fresh)
    assert e3.restore().snapshot_id == "step_000000001"
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in saved1.items())


def test_gc_sweeps_only_unreferenced_objects_and_refuses_when_unsure(tmp_path):
    torch.manual_seed(3)
    model = Model(n=2)
    e = CheckpointEngine(base_dir=str(tmp_path), dedup=True, keep_latest=1, keep_best=0)
    e.register("policy", model)
    e.save(1)
    with torch.no_grad():
        model.layers[0].add_(1.0)
    e.save(2)  # retention drops step 1 and sweeps the object only it referenced
    objects = tmp_path / "run" / "objects"
    live = {p.name for p in objects.rglob("*") if p.is_file()}
    assert len(live) == 2
    orphan = objects / e.config.checksum_algo / "ff" / ("ff" * 32)
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"orphan")
    (tmp_path / "run" / "step_000000002" / "meta.json").write_text("{broken")  # now references are unknown
    assert cli(["gc", str(tmp_path / "run"), "--grace", "0"]) == 0
    assert orphan.exists() and {p.name for p in objects.rglob("*") if p.is_file()} >= live


def test_small_tensors_stay_in_the_snapshot_file_and_everything_restores_exactly(tmp_path):
    """Tensors under 64 KiB (norms, biases, step counters) go to the snapshot's safetensors file, the rest to
    objects/: one object per small tensor would cost a file and an fsync each for nothing to deduplicate."""
    import json

    from rl_ckpt.errors import NoValidSnapshotError
    from rl_ckpt.config import FIELDS

    SMALL_TENSOR_BYTES = FIELDS["dedup_min_tensor_bytes"][0]

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    e = CheckpointEngine(base_dir=str(tmp_path), dedup=True, retention=False)
    e.register("policy", model)
    e.register("optimizer", opt)
    e.save(1)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    manifest = e.catalog.get("step_000000001").manifest
    sec = manifest.components["policy"]
    for key, t in model.state_dict().items():
        assert (key in sec.get("objects", {})) == (t.numel() * t.element_size() >= SMALL_TENSOR_BYTES), key
    objects = [f for _r, _d, fs in os.walk(tmp_path / "run" / "objects") for f in fs]
    assert len(objects) == 1 + 2  # the 1 MiB weight; Adam's two 1 MiB moments of it
    fresh = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 8))
    fresh_opt = torch.optim.Adam(fresh.parameters())
    e2 = CheckpointEngine(base_dir=str(tmp_path), dedup=True, retention=False)
    e2.register("policy", fresh)
    e2.register("optimizer", fresh_opt)
    e2.restore()
    assert all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items())
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])

    # A manifest naming one tensor in both places is refused (never silently one of the two).
    meta_path = tmp_path / "run" / "step_000000001" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta.pop("manifest_checksum")
    from rl_ckpt._format.checksum import digest_bytes
    from rl_ckpt._run.dedup import object_path
    from rl_ckpt._format.safetensors_io import byte_view

    small_key = next(k for k in saved if k not in sec["objects"])
    data = bytes(byte_view(saved[small_key]))
    digest = digest_bytes(sec["objects_algo"], data)
    e.storage.makedirs(object_path(sec["objects_algo"], digest).rsplit("/", 1)[0])
    e.storage.write_atomic(object_path(sec["objects_algo"], digest), data)  # a valid object of that tensor
    meta["components"]["policy"]["objects"][small_key] = [[digest, len(data)]]
    from rl_ckpt._format.manifest import manifest_checksum

    meta["manifest_checksum"] = manifest_checksum(meta)  # forged consistently: only the contradiction is left
    meta_path.write_text(json.dumps(meta))
    e3 = CheckpointEngine(base_dir=str(tmp_path), dedup=True, retention=False)
    e3.register(
        "policy", torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 8))
    )
    report = e3.verify()
    assert report.ok  # every file and object still matches its checksum...
    with pytest.raises(NoValidSnapshotError, match="both in"):  # ...but the manifest contradicts itself
        e3.restore()


def test_an_object_path_parses_back_to_its_algorithm_and_digest_and_nothing_else_does():
    from rl_ckpt._run.dedup import object_path, parse_object_path

    digest = "ab" + "0" * 30
    assert parse_object_path(object_path("xxh3_128", digest)) == ("xxh3_128", digest)
    for other in (
        "objects/xxh3_128/not-a-digest",  # no prefix folder
        f"objects/xxh3_128/cd/{digest}",  # a prefix that is not the digest's
        f"step_000000001/objects/xxh3_128/ab/{digest}",
        "objects/xxh3_128/ab/",
        f"objs/xxh3_128/ab/{digest}",
    ):
        assert parse_object_path(other) is None, other
