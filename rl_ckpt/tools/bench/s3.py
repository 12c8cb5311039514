"""``rl-ckpt bench s3``: rl_ckpt on S3 through real latency, next to boto3's s3transfer and one stream, in one run.

    rl-ckpt bench s3 [--size 1GiB] [--latency-ms 30] [--mbps 40] [--repeat 2] [--ranks 4]
                     [--server-checksums crc32|sha256] [--json]

Starts moto's S3 server (``python -m rl_ckpt.tools.s3_endpoint``, behaving as S3 does: keep-alive, ranged
GETs served from the stored bytes) and, in front of it, the latency proxy (``python -m
rl_ckpt.tools.s3_proxy``: ``--latency-ms`` per request, ``--mbps`` MB/s per connection and direction), each
a process of its own, on 127.0.0.1 only. Then, round-robin over ``--repeat`` rounds (medians reported):

    rl_save          ``engine.save`` of a model + Adam state of ``--size`` (defaults: verify-after-write on, through
                     the CRC32 of every part, which this server checks as S3 does: nothing is read back)
    rl_save_readback ``engine.save`` with ``server_checksums=False``: verify-after-write reads every object back
    rl_restore       ``engine.restore()`` of it into the live objects (plan, verified load, probe)
    rl_save_noverify ``engine.save`` with ``verify_after_write=False`` (what the object read-back costs)
    s3t_upload       boto3 ``TransferManager.upload_file`` (default ``TransferConfig``: 8 MiB parts, 10
                     threads) of a local file holding the same tensor bytes
    s3t_download     ``TransferManager.download_file`` of that object to a local file
    one_upload       ``upload_file`` with one connection (``use_threads=False``)
    one_download     ``download_file`` with one connection

Both clients skip the SHA-256 of every request body that botocore adds over plain HTTP only
(``payload_signing_enabled=False``, what both do over HTTPS); everything else is their default. Peak RSS
over the state is the process's high-water mark (reset before each measurement through
``/proc/self/clear_refs``) minus its RSS before it. ``--ranks N`` then runs N processes at once, each
saving and restoring its own 1/N of the state (an engine and run of its own), against N processes each
running s3transfer on the same bytes: the aggregate throughputs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

from rl_ckpt.tools.bench.common import MIB, loadavg, parse_size
from rl_ckpt.tools.s3_endpoint import LOOPBACK, client_options

KEYS = (
    "rl_save",
    "rl_restore",
    "rl_save_readback",
    "rl_save_noverify",
    "s3t_upload",
    "s3t_download",
    "one_upload",
    "one_download",
)


def _serve(args: list[str]) -> tuple[subprocess.Popen, int]:
    """Start ``python -m <module> ...`` and read the port from its ``listening 127.0.0.1:PORT`` line."""
    proc = subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("listening "):
        proc.kill()
        raise RuntimeError(f"{args[0]} did not start: {line!r}")
    return proc, int(line.rsplit(":", 1)[1])


class Endpoint:
    """moto + the latency proxy, each in a process of its own."""

    def __init__(self, latency_ms: float, mbps: float) -> None:
        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        os.environ["NO_PROXY"] = os.environ["no_proxy"] = LOOPBACK
        self.moto, moto_port = _serve(["rl_ckpt.tools.s3_endpoint", "--in-memory"])
        self.procs = [self.moto]
        port = moto_port
        if latency_ms or mbps:
            proxy, port = _serve(
                ["rl_ckpt.tools.s3_proxy", f"--upstream={LOOPBACK}:{moto_port}", f"--latency-ms={latency_ms}"]
                + [f"--mbps={mbps}"]
            )
            self.procs.append(proxy)
        self.options = client_options(f"http://{LOOPBACK}:{port}")

    def boto3(self):
        import boto3
        from botocore.config import Config

        o = self.options
        return boto3.client(
            "s3",
            endpoint_url=o["endpoint_url"],
            aws_access_key_id=o["key"],
            aws_secret_access_key=o["secret"],
            region_name=o["client_kwargs"]["region_name"],
            config=Config(s3={"addressing_style": "path", "payload_signing_enabled": False}),
        )

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def rss() -> tuple[int, int]:
    """(current RSS, high-water mark) of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out["VmRSS"], out["VmHWM"]


def reset_peak() -> int:
    """Reset the RSS high-water mark; returns the RSS now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return rss()[0]


def timed(fn) -> tuple[float, int]:
    """(seconds, peak RSS growth in bytes) of ``fn()``."""
    import gc

    gc.collect()
    base = reset_peak()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return dt, max(0, rss()[1] - base)


def _state(size: int, seed: int = 0):
    from rl_ckpt.tools.bench.state import build_state, flat_tensors, nbytes

    model, opt, _shape = build_state(size, seed=seed)
    tensors = flat_tensors(model, opt)
    return model, opt, tensors, nbytes(tensors.values())


def _write_file(tensors, path: str) -> None:
    from rl_ckpt.tools.bench.state import byte_views

    with open(path, "wb") as f:
        for view in byte_views(tensors.values()):
            f.write(view)


def measure(ep: Endpoint, size: int, repeat: int, log=print) -> dict:
    """The single-process measurements, round-robin; returns ``{"bytes", "results": name -> {...}}``."""
    from boto3.s3.transfer import TransferConfig

    from rl_ckpt import CheckpointEngine

    model, opt, tensors, total = _state(size)
    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    client = ep.boto3()
    client.create_bucket(Bucket=bucket)
    workdir = tempfile.mkdtemp(prefix="rl-ckpt-bench-s3-")
    src, dst = os.path.join(workdir, "state.bin"), os.path.join(workdir, "got.bin")
    _write_file(tensors, src)
    cfg = {"base_dir": f"s3://{bucket}/rl", "run_name": "run", "storage_options": ep.options, "retention": False}
    engine = CheckpointEngine(**cfg)
    engine.register("model", model)
    engine.register("optim", opt)
    quick = CheckpointEngine(**{**cfg, "run_name": "noverify"}, verify_after_write=False)
    quick.register("model", model)
    quick.register("optim", opt)
    reread_options = {**ep.options, "server_checksums": False}
    reread = CheckpointEngine(**{**cfg, "run_name": "readback", "storage_options": reread_options})
    reread.register("model", model)
    reread.register("optim", opt)
    steps = iter(range(1, 10**6))
    saved = {"step": None}

    def rl_save() -> None:
        saved["step"] = next(steps)
        engine.save(saved["step"])

    def rl_save_noverify() -> None:
        saved["quick"] = next(steps)
        quick.save(saved["quick"])

    def rl_save_readback() -> None:
        saved["reread"] = next(steps)
        reread.save(saved["reread"])

    def rl_restore() -> None:
        other = CheckpointEngine(**cfg)
        other.register("model", model)
        other.register("optim", opt)
        assert other.restore().global_step == saved["step"]

    def transfer(threads: bool, up: bool):
        def run() -> None:
            config = TransferConfig() if threads else TransferConfig(use_threads=False)
            if up:
                client.upload_file(src, bucket, "s3t/state.bin", Config=config)
            else:
                client.download_file(bucket, "s3t/state.bin", dst, Config=config)

        return run

    methods = {
        "rl_save": rl_save,
        "rl_restore": rl_restore,
        "rl_save_noverify": rl_save_noverify,
        "rl_save_readback": rl_save_readback,
        "s3t_upload": transfer(True, True),
        "s3t_download": transfer(True, False),
        "one_upload": transfer(False, True),
        "one_download": transfer(False, False),
    }
    samples: dict[str, list[tuple[float, int]]] = {k: [] for k in methods}
    ups = ["rl_save", "s3t_upload", "one_upload"]
    downs = {"rl_save": "rl_restore", "s3t_upload": "s3t_download", "one_upload": "one_download"}
    for r in range(repeat):
        order = ups[r % 3 :] + ups[: r % 3]  # the uploads, then the downloads, side by side; rotated per round
        for name in [*order, *(downs[u] for u in order), "rl_save_readback", "rl_save_noverify"]:
            samples[name].append(timed(methods[name]))
            log(f"  round {r + 1}: {name:<16} {samples[name][-1][0]:7.2f} s  (load {loadavg()})")
        engine.storage.remove_tree(f"step_{saved['step']:09d}")  # the server holds objects in memory (not timed)
        quick.storage.remove_tree(f"step_{saved['quick']:09d}")
        reread.storage.remove_tree(f"step_{saved['reread']:09d}")
    algo = {"sha256": "SHA-256", "crc32": "CRC32"}[str(ep.options.get("server_checksums", "crc32"))]
    verified_by = (
        f"the server's check of each part's {algo}" if engine.storage.endpoint_checks_checksums() else "read-back"
    )
    engine.close()
    quick.close()
    reread.close()
    for path in (src, dst):
        if os.path.exists(path):
            os.remove(path)
    os.rmdir(workdir)
    return {
        "bytes": total,
        "verified_by": verified_by,
        "results": {k: _summary(v, total) for k, v in samples.items()},
    }


def _summary(samples: list[tuple[float, int]], total: int) -> dict:
    med = statistics.median(s for s, _ in samples)
    return {
        "median_s": med,
        "mbps": total / med / 1e6,
        "samples_s": [s for s, _ in samples],
        "peak_rss_over_mib": max(p for _, p in samples) / MIB,
    }


def _rank(options: dict, size: int, rank: int, barrier, out, what: str) -> None:
    """One of N processes: build 1/N of the state, then (at the barrier) save+restore it or s3transfer it."""
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    import torch

    torch.set_num_threads(1)
    model, opt, tensors, total = _state(size, seed=rank)
    bucket = options.pop("bucket")
    result = {}
    if what == "rl":
        from rl_ckpt import CheckpointEngine

        cfg = {"base_dir": f"s3://{bucket}/ranks", "run_name": f"r{rank}", "storage_options": options}
        engine = CheckpointEngine(retention=False, **cfg)
        engine.register("model", model)
        engine.register("optim", opt)
        barrier.wait()
        t0 = time.perf_counter()
        engine.save(1)
        result["save"] = (t0, time.perf_counter())
        barrier.wait()
        t0 = time.perf_counter()
        other = CheckpointEngine(retention=False, **cfg)
        other.register("model", model)
        other.register("optim", opt)
        other.restore()
        result["restore"] = (t0, time.perf_counter())
    else:
        import boto3
        from botocore.config import Config

        client = boto3.client(
            "s3",
            endpoint_url=options["endpoint_url"],
            aws_access_key_id=options["key"],
            aws_secret_access_key=options["secret"],
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path", "payload_signing_enabled": False}),
        )
        workdir = tempfile.mkdtemp(prefix="rl-ckpt-bench-s3-")
        src = os.path.join(workdir, "state.bin")
        _write_file(tensors, src)
        barrier.wait()
        t0 = time.perf_counter()
        client.upload_file(src, bucket, f"s3t/r{rank}.bin")
        result["save"] = (t0, time.perf_counter())
        barrier.wait()
        t0 = time.perf_counter()
        client.download_file(bucket, f"s3t/r{rank}.bin", src + ".got")
        result["restore"] = (t0, time.perf_counter())
        for path in (src, src + ".got"):
            os.remove(path)
        os.rmdir(workdir)
    out.put((rank, total, result))


def ranks(ep: Endpoint, size: int, n: int) -> dict:
    """N processes at once, rl_ckpt then s3transfer: aggregate MB/s of the saves and of the restores."""
    ctx = mp.get_context("spawn")
    bucket = f"ranks-{uuid.uuid4().hex[:12]}"
    ep.boto3().create_bucket(Bucket=bucket)
    out = {}
    for what in ("rl", "s3t"):
        barrier, results = ctx.Barrier(n), ctx.Queue()
        procs = [
            ctx.Process(target=_rank, args=({**ep.options, "bucket": bucket}, size // n, r, barrier, results, what))
            for r in range(n)
        ]
        for p in procs:
            p.start()
        got = [results.get(timeout=3600) for _ in procs]
        for p in procs:
            p.join()
        total = sum(t for _r, t, _res in got)
        for phase in ("save", "restore"):
            start = min(res[phase][0] for _r, _t, res in got)
            end = max(res[phase][1] for _r, _t, res in got)
            out[f"{what}_{phase}"] = {"seconds": end - start, "mbps": total / (end - start) / 1e6}
    out["bytes"] = size
    return out


def report(out: dict) -> str:
    r = out["results"]
    total = out["bytes"]

    def row(label: str, ours: str, theirs: str, one: str) -> str:
        a, b, c = r[ours]["median_s"], r[theirs]["median_s"], r[one]["median_s"]
        return (
            f"| {label} | {a:.2f} s ({total / a / 1e6:.0f} MB/s) | {b:.2f} s | {c:.2f} s | "
            f"**{b / a:.2f}x** | **{c / a:.2f}x** | +{r[ours]['peak_rss_over_mib']:.0f} / "
            f"+{r[theirs]['peak_rss_over_mib']:.0f} MiB |"
        )

    lines = [
        f"S3 through the proxy: {out['latency_ms']:g} ms per request, {out['mbps']:g} MB/s per connection; "
        f"{total / MIB:.0f} MiB of tensors; {out['repeat']} round(s), medians; load average {out['load']}",
        "",
        "| | rl_ckpt | s3transfer | one connection | vs s3transfer (goal >= 1.0x) | vs one stream (goal >= 4x) "
        "| peak RSS over the state, rl_ckpt / s3transfer |",
        "|---|---|---|---|---|---|---|",
        row(f"save (verify on: {out.get('verified_by', '?')})", "rl_save", "s3t_upload", "one_upload"),
        row("save (verify on: read-back)", "rl_save_readback", "s3t_upload", "one_upload"),
        row("save (verify off)", "rl_save_noverify", "s3t_upload", "one_upload"),
        row("restore", "rl_restore", "s3t_download", "one_download"),
    ]
    if out.get("ranks"):
        k = out["ranks"]
        n = out["n_ranks"]
        for phase in ("save", "restore"):
            ours, theirs = k[f"rl_{phase}"]["mbps"], k[f"s3t_{phase}"]["mbps"]
            lines.append(
                f"\n{n} ranks at once, {phase}: rl_ckpt {ours:.0f} MB/s, {n} s3transfer clients {theirs:.0f} MB/s: "
                f"**{ours / theirs:.2f}x** (goal >= 0.8x)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rl-ckpt bench s3", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1GiB", help="state size (default 1GiB)")
    p.add_argument("--latency-ms", type=float, default=30.0, help="added per request by the proxy (default 30)")
    p.add_argument("--mbps", type=float, default=40.0, help="proxy cap per connection, MB/s (default 40)")
    p.add_argument("--repeat", type=int, default=2, help="rounds (default 2)")
    p.add_argument("--ranks", type=int, default=0, help="also N processes at once (e.g. 4; default: off)")
    p.add_argument(
        "--server-checksums",
        choices=("crc32", "sha256"),
        default="crc32",
        help="the checksum each part carries for the server to check (storage option server_checksums; default crc32)",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    size = parse_size(args.size)
    ep = Endpoint(args.latency_ms, args.mbps)
    ep.options["server_checksums"] = args.server_checksums
    log = (lambda msg: print(msg, file=sys.stderr)) if args.json else print
    try:
        out = measure(ep, size, args.repeat, log)
        out.update(latency_ms=args.latency_ms, mbps=args.mbps, repeat=args.repeat, load=loadavg())
        if args.ranks:
            out["ranks"], out["n_ranks"] = ranks(ep, size, args.ranks), args.ranks
        out["load"] = open("/proc/loadavg").read().split()[:3]
    finally:
        ep.close()
    print(json.dumps(out, indent=2) if args.json else report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
