"""``rl-ckpt export --format hf``: a sharded (FSDP2, 2 gloo ranks) and a plain GPT-2 into Hugging Face folders.

Heavy (spawns ranks): run under ``flock /tmp/heavy.lock``. Every exported
folder is loaded with ``GPT2LMHeadModel.from_pretrained`` and compared
bitwise with the unsharded reference model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open

import sharded_workers as w
from rl_ckpt.cli import main as cli

transformers = pytest.importorskip("transformers")

SHARD_SIZE = "200KB"  # several files for the tiny model below


def gpt2_config():
    return transformers.GPT2Config(
        vocab_size=512, n_positions=32, n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0
    )


def reference_model(config=None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config or gpt2_config())
    return model.eval()


def fsdp_save_job(rank: int, world: int, port: int, run: str) -> None:
    """Shard the reference GPT-2 with FSDP2 on ``world`` gloo ranks and save it (and its Adam) as step 1."""
    from torch.distributed.fsdp import fully_shard

    w.init(rank, world, port)
    model = reference_model()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    engine = w.engine_for(run, rank, world)
    engine.register("policy", model)
    engine.register("optim", optim)
    engine.save(1)
    engine.close()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("export") / "run"
    mp.spawn(fsdp_save_job, args=(2, w.free_port(), str(run)), nprocs=2)
    return run


def check_loads_equal(folder: Path, reference: torch.nn.Module) -> None:
    reference.config.save_pretrained(folder)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    ref = reference.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"{k} differs after export"
    ids = torch.arange(24).reshape(2, 12) % reference.config.vocab_size
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def test_sharded_component_exports_to_hf_folder_that_from_pretrained_loads(sharded_run, tmp_path):
    out = tmp_path / "hf"
    assert (
        cli(
            [
                "export",
                str(sharded_run),
                "step_000000001",
                "policy",
                "--format",
                "hf",
                "-o",
                str(out),
                "--max-shard-size",
                SHARD_SIZE,
            ]
        )
        == 0
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) >= 3 and files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    assert sorted(set(index["weight_map"].values())) == files
    total = 0
    for name in files:
        with safe_open(str(out / name), "pt") as f:
            assert f.metadata()["format"] == "pt"
            sizes = []
            for key in f.keys():
                assert index["weight_map"][key] == name
                t = f.get_tensor(key)
                sizes.append(t.numel() * t.element_size())
        total += sum(sizes)
        # Cut as save_pretrained cuts: no file passes the limit unless it holds a single tensor.
        assert sum(sizes) <= 200_000 or len(sizes) == 1, (name, sizes)
    assert index["metadata"]["total_size"] == total
    check_loads_equal(out, reference_model())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp folder left behind"


def test_sharded_component_exports_to_one_safetensors_file(sharded_run, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "policy.safetensors"
    assert cli(["export", str(sharded_run), "step_000000001", "policy", "-o", str(out)]) == 0
    got = load_file(str(out))
    ref = reference_model().state_dict()
    for k, v in got.items():
        assert torch.equal(v, ref[k]), k
    # The optimizer component exports too: its tensors under their FQNs (state.<param>.exp_avg, ...).
    opt = tmp_path / "optim.safetensors"
    assert cli(["export", str(sharded_run), "step_000000001", "optim", "-o", str(opt)]) == 0
    assert any(k.endswith(".exp_avg") for k in load_file(str(opt)))


def test_strip_prefix_and_refusals(sharded_run, tmp_path):
    out = tmp_path / "hf"
    assert (
        cli(
            [
                "export",
                str(sharded_run),
                "step_000000001",
                "policy",
                "--format",
                "hf",
                "-o",
                str(out),
                "--strip-prefix",
                "transformer.",
            ]
        )
        == 0
    )
    names = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert "wte.weight" in names and not any(n.startswith("transformer.") for n in names)
    # An existing non-empty folder is never written into; a bad size is bad usage.
    assert cli(["export", str(sharded_run), "step_000000001", "policy", "--format", "hf", "-o", str(out)]) == 2
    assert (
        cli(
            [
                "export",
                str(sharded_run),
                "step_000000001",
                "policy",
                "--format",
                "hf",
                "-o",
                str(tmp_path / "x"),
                "--max-shard-size",
                "lots",
            ]
        )
        == 2
    )
    assert not (tmp_path / "x").exists()


def test_corrupted_block_fails_the_export_and_leaves_no_folder(sharded_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(sharded_run, run)
    meta = json.loads((run / "step_000000001" / "meta.json").read_text())
    chunk = next(
        c
        for c in meta["components"]["policy"]["layout"]["tensors"]["transformer.h.1.mlp.c_fc.weight"]["chunks"]
        if c["offsets"][0] > 0
    )
    f = run / "step_000000001" / chunk["file"]
    data = bytearray(f.read_bytes())
    data[chunk["start"] + 3] ^= 0x10
    f.write_bytes(bytes(data))
    out = tmp_path / "hf"
    capsys.readouterr()
    assert (
        cli(
            [
                "export",
                str(run),
                "step_000000001",
                "policy",
                "--format",
                "hf",
                "-o",
                str(out),
                "--max-shard-size",
                SHARD_SIZE,
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "step_000000001/policy" in err and "checksum mismatch" in err and chunk["file"] in err, err
    assert "transformer.h.1.mlp.c_fc.weight" in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    single = tmp_path / "one.safetensors"
    assert cli(["export", str(run), "step_000000001", "policy", "-o", str(single)]) == 1
    assert not single.exists() and not list(tmp_path.glob("one.safetensors.tmp-*"))


def test_plain_component_exports_to_hf_folder(tmp_path):
    from rl_ckpt import CheckpointEngine

    ref = reference_model()
    engine = CheckpointEngine(base_dir=str(tmp_path), run_name="plain", retention=False)
    engine.register("policy", ref)
    engine.save(1)
    engine.close()
    out = tmp_path / "hf"
    assert (
        cli(
            [
                "export",
                str(tmp_path / "plain"),
                "step_000000001",
                "policy",
                "--format",
                "hf",
                "-o",
                str(out),
                "--max-shard-size",
                SHARD_SIZE,
            ]
        )
        == 0
    )
    assert len(list(out.glob("model-*.safetensors"))) >= 3
    check_loads_equal(out, reference_model())


def test_export_peak_memory_figure(tmp_path):
    """Not a goal check: prints the export's RSS growth next to the model size (run with -s to see it)."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to reset the peak RSS")
    config = transformers.GPT2Config(vocab_size=8192, n_positions=128, n_embd=256, n_layer=6, n_head=4)
    run = tmp_path / "big"
    mp.spawn(big_save_job, args=(2, w.free_port(), str(run), config.to_dict()), nprocs=2)
    # A fresh process, so memory freed by earlier work in this one cannot hide the export's own growth.
    code = (
        "import sys; from pathlib import Path\n"
        "from rl_ckpt._export import export_hf\n"
        "from rl_ckpt._run.snapshot_files import read_manifest\n"
        "from rl_ckpt._storage import open_storage\n"
        "import rl_ckpt._sharded.component  # its imports (torch.distributed) are not the export's memory\n"
        "def rss(field):\n"
        "    return next(int(l.split()[1]) * 1024 for l in Path('/proc/self/status').read_text().splitlines()"
        " if l.startswith(field + ':'))\n"
        "storage = open_storage(sys.argv[1], {})\n"
        "manifest = read_manifest(storage, 'step_000000001')\n"
        "base = rss('VmRSS')\n"
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "res = export_hf(storage, manifest, 'policy', sys.argv[2], max_shard_size='20MB')\n"
        "largest = max(t['shape'][0] * (t['shape'][1] if len(t['shape']) > 1 else 1) * 4\n"
        "              for t in manifest.components['policy']['tensors'].values())\n"
        "print(json.dumps({'grown': rss('VmHWM') - base, 'total': res.total_size, 'tensors': res.tensors,\n"
        "                  'files': len(res.files), 'largest': largest, 'read': res.bytes_read}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import json\n" + code, str(run), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        check=True,
    )
    fig = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    print(
        f"\nexport --format hf of {fig['total'] / mib:.1f} MiB ({fig['tensors']} tensors, {fig['files']} files, "
        f"largest tensor {fig['largest'] / mib:.1f} MiB): peak RSS growth {fig['grown'] / mib:.1f} MiB = "
        f"{fig['grown'] / fig['total']:.2f}x the model, {fig['grown'] / fig['largest']:.2f}x the largest tensor"
    )
    assert fig["read"] >= fig["total"]


def big_save_job(rank: int, world: int, port: int, run: str, config: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    w.init(rank, world, port)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = w.engine_for(run, rank, world)
    engine.register("policy", model)
    engine.save(1)
    engine.close()
    torch.distributed.destroy_process_group()
