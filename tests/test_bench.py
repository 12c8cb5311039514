"""``rl-ckpt bench`` on a tiny state: it runs, every documented JSON key is there. No timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rl_ckpt.tools import bench

pytestmark = pytest.mark.slow  # the benchmarks run end to end on small sizes

TOP_KEYS = (
    "mode",
    "url",
    "workdir",
    "repeat",
    "host",
    "cache",
    "load",
    "state",
    "results",
    "dedup",
    "ratios",
    "goals",
    "goals_met",
    "goals_total",
)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rl_ckpt.cli", "bench", *args], capture_output=True, text=True, timeout=300
    )


def test_docstring_documents_every_key():
    doc = bench.__doc__
    for key in (
        *TOP_KEYS,
        *bench.RESULT_KEYS,
        *bench.VARIANT_KEYS,
        *bench.RATIOS,
        "scaling",
        "sizes[]",
        "catalog[]",
        "other_cores_mean",
        "second_bytes_added",
        "per_snapshot_us",
        "plan_recovery_cold_s",
        "create_per_s",
    ):
        if key.startswith("hash_") and key != "hash_sha256":
            assert key.split("_", 1)[1] in doc, key
            continue
        assert key in doc, f"{key} is not documented in rl_ckpt/tools/bench/__init__.py's docstring"


def test_bench_json_table_and_plot(tmp_path):
    png = tmp_path / "bench.png"
    proc = run_cli(
        str(tmp_path / "b"), "--size", "8MiB", "--repeat", "1", "--json", "--cache", "fadvise", "--plot", str(png)
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in TOP_KEYS:
        assert key in out, key
    assert out["mode"] == "compare" and out["repeat"] == 1
    assert out["cache"]["method"] == "fadvise"
    for key in ("cpus", "torch_threads", "python", "torch", "platform", "fs", "page_reporting"):
        assert key in out["host"]
    for key in ("other_cores_mean", "other_cores_max", "loadavg_start", "loadavg_end"):
        assert key in out["load"]
    st = out["state"]
    assert 7 * 2**20 < st["bytes"] < 9 * 2**20 and st["tensors"] > 50
    assert set(st["mix"]) == {"large", "medium", "small"} and {"hidden", "blocks"} <= set(st["shape"])
    for key in bench.RESULT_KEYS:
        r = out["results"][key]
        assert set(r) >= {"median_s", "gbps", "samples_s", "other_cores"}, key
        assert r["median_s"] is not None and r["median_s"] >= 0 and len(r["samples_s"]) == 1, key
    for key in bench.RATIOS:
        assert out["ratios"][key] is not None and out["ratios"][key] > 0, key
    dd = out["dedup"]
    assert set(dd) == {"changed_bytes", "first_bytes_added", "second_bytes_added", "second_fraction"}
    assert 0 < dd["second_bytes_added"] < dd["first_bytes_added"]  # dedup wrote only what changed (and metadata)
    assert len(out["goals"]) == out["goals_total"] == 7
    for g in out["goals"]:
        assert set(g) == {"name", "met", "value", "limit", "text"} and isinstance(g["met"], bool)
    assert 0 <= out["goals_met"] <= 7
    assert png.exists() and png.stat().st_size > 1000
    assert not any((tmp_path / "b").iterdir()), "the bench must delete what it wrote"

    # The table, from the same function the CLI uses.
    text = bench.format_compare(out)
    assert (
        "rl_ckpt save (defaults: xxh3_128+verify)" in text and "torch.load(weights_only)" in text and "DCP save" in text
    )
    assert "goals (medians of this run)" in text and ("MET" in text or "MISSED" in text)


def test_scaling_json(tmp_path, capsys):
    code = bench.main(
        [
            str(tmp_path),
            "--scaling",
            "--sizes",
            "2M,4M",
            "--counts",
            "1,3",
            "--repeat",
            "1",
            "--json",
            "--cache",
            "none",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "scaling"
    sizes, catalog = out["scaling"]["sizes"], out["scaling"]["catalog"]
    assert [r["size_request"] for r in sizes] == [2 << 20, 4 << 20]
    for row in sizes:
        assert set(row["results"]) == {"raw_write", "raw_read", "clone", "rl_save", "rl_restore", "rl_async_block"}
        for key in ("save_vs_raw", "restore_vs_raw", "block_vs_clone", "state_bytes", "tensors"):
            assert row[key] is not None
    assert [r["count"] for r in catalog] == [1, 3]
    for row in catalog:
        for key in (
            "create_s",
            "create_per_s",
            "snapshots_s",
            "refresh_s",
            "plan_recovery_s",
            "plan_recovery_cold_s",
            "retention_s",
            "open_s",
        ):
            assert row[key] is not None and row[key] >= 0, key
        assert set(row["per_snapshot_us"]) == {"snapshots", "refresh", "plan_recovery", "retention", "open"}
    assert "catalog operations" in bench.format_scaling(out)


def test_remote_url_refused():
    proc = run_cli("s3://bucket/prefix", "--size", "1MiB", "--repeat", "1")
    assert proc.returncode == 2
    assert "local folders only" in proc.stderr and "s3://" in proc.stderr


def test_cache_drop_falls_back_to_fadvise(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.common, "DROP_CACHES", str(tmp_path / "no" / "such" / "drop_caches"))
    cache = bench.CacheDropper("drop")
    assert cache.method == "fadvise" and "refused" in cache.note and "POSIX_FADV_DONTNEED" in cache.note
    f = tmp_path / "x.bin"
    f.write_bytes(b"x" * 4096)
    cache.drop(str(tmp_path))  # evicts every file under the folder without error
    assert bench.CacheDropper("none").method == "none"


@pytest.mark.parametrize(
    "text,expected",
    [("64M", 64 << 20), ("256MiB", 256 << 20), ("1G", 1 << 30), ("1.5GiB", 3 << 29), ("4096", 4096), ("8MB", 8 << 20)],
)
def test_parse_size(text, expected):
    assert bench.parse_size(text) == expected


def test_bad_size_and_tensor_count():
    with pytest.raises(bench.BenchUsageError):
        bench.parse_size("lots")
    model, opt, shape = bench.build_state(4 << 20, tensors=200)
    n = len(bench.flat_tensors(model, opt))
    assert 150 <= n <= 250 and shape["blocks"] >= 1


def test_async_benchmark_script_runs_and_reports_every_goal(tmp_path):
    """benchmarks/async_save.py (the training-while-saving figures in docs/performance.md) still runs end to end."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "async_save.py"
    out = subprocess.run(
        [
            sys.executable,
            str(script),
            "--size-gib",
            "0.02",
            "--repeat",
            "1",
            "--json",
            "--dir",
            str(tmp_path),
            "--writer-nice",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout)
    assert res["config"]["writer_nice"] == 3 and res["config"]["cleaned_up"]
    assert {g for g in res["goals"]} == {"steady_block", "first_vs_steady", "step_slowdown"}
    for key in ("sync_save_s", "async_block_s", "async_call_s", "copy_s", "async_total_s", "clone_s"):
        assert res["median"][key] > 0, key
    assert res["median"]["hook_wait_s"] >= 0 and set(res["ratios"]) == {"async_block_vs_sync", "async_block_vs_clone"}
    for r in res["rounds"]:  # blocked = the call + what the next optimizer step waited in its pre-hook
        assert r["async_block_s"] == r["async_call_s"] + r["hook_wait_s"]
    assert res["staging"]["reused"] is True
    import os

    assert os.listdir(tmp_path) == []  # its work folder is gone


def test_bench_model_mode_on_a_tiny_gpt2(tmp_path):
    """``--model``: a real transformers GPT-2 + AdamW; every documented key is there (no timing assertions)."""
    proc = run_cli(str(tmp_path / "b"), "--model", "gpt2-tiny", "--repeat", "1", "--json", "--cache", "fadvise")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["mode"] == "model" and out["state"]["model"] == "gpt2-tiny" and out["state"]["parameters"] > 10**6
    for key in bench.MODEL_KEYS:
        assert out["results"][key]["median_s"] > 0, key
    assert {g["name"] for g in out["goals"]} == {"save_vs_torch_save", "restore_vs_torch_load"}
    assert out["goals_total"] == 2 and all(isinstance(g["met"], bool) for g in out["goals"])
    assert 0 < out["probe_record_bytes"] < 16 * 1024  # a fingerprint of 402k logits, not the logits
    table = run_cli(str(tmp_path / "b"), "--model", "gpt2-tiny", "--repeat", "1", "--cache", "fadvise")
    assert table.returncode == 0 and "torch.load + load_state_dict" in table.stdout and "goals met" in table.stdout


def test_docstring_documents_the_model_mode():
    for key in (*bench.MODEL_KEYS, "probe_record_bytes", "parameters", "gpt2-small"):
        assert key in bench.__doc__, key


def test_sharded_bench_runs_on_gloo_ranks_and_reports_reads(tmp_path):
    """`rl-ckpt bench --sharded`: real FSDP2 ranks, DCP alongside, bytes read per rank counted by the storage."""
    out = run_cli(str(tmp_path), "--sharded", "--ranks", "2", "--size", "4MiB", "--repeat", "1", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["mode"] == "sharded" and [s["ranks"] for s in data["saves"]] == [2]
    assert all(s["rl_ckpt_s"] > 0 and s["dcp_s"] > 0 for s in data["saves"])
    (restore,) = data["restores"]
    assert (restore["saved_on"], restore["restored_on"]) == (2, 2)
    for rank in restore["per_rank"]:
        assert 0 < rank["read"] <= 1.25 * rank["share"]
