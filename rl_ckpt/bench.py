"""``rl-ckpt bench``: how fast rl_ckpt saves and restores, next to the floor and its peers, in one run.

    rl-ckpt bench URL [--size 1GiB] [--tensors N] [--repeat 3] [--json] [--plot FILE.png]
                      [--variants] [--cache drop|fadvise|none] [--threads 1] [--keep] [--fail-on-miss]
    rl-ckpt bench URL --scaling [--sizes 64M,256M,1G,4G] [--counts 1,10,100,1000,10000] [--repeat 3]
    rl-ckpt bench URL --model gpt2-small [--repeat 3] [--json]

URL is a local folder (a path or ``file://``): the peers (``torch.save``,
``torch.distributed.checkpoint``, ``safetensors``) only write local files, so
``s3://`` and other remote URLs are refused (exit 2). The run writes into a
fresh ``rl-ckpt-bench-*`` folder inside URL and deletes it at the end
(``--keep`` leaves it). Sizes are binary: ``64M`` = ``64MiB`` = 64 * 2**20
bytes. GB/s figures are decimal (1e9 bytes/s).

State: a synthetic policy plus ``torch.optim.Adam`` state after one real
``Adam.step`` (params, exp_avg, exp_avg_sq, step), fp32, ~``--size`` bytes in
total with a realistic tensor mix: 4 large matrices (embedding, unembedding,
heads, ~55% of the parameter bytes), many medium ones (4 h x h matrices per
block, ~45%), many small ones (biases, norms, gates, Adam's scalar ``step``).
``--tensors N`` asks for ~N tensors in the saved state (model + optimizer; 4
per parameter) by choosing the number of blocks; the hidden size then follows
from ``--size``.

Every repeat runs every measurement once, round-robin over the methods (the
starting method rotates per repeat); figures are medians over the repeats.
Before every read the page cache is dropped (``echo 3 >
/proc/sys/vm/drop_caches``, root only); where that is refused, the files just
written are evicted with ``posix_fadvise(POSIX_FADV_DONTNEED)`` after their
fsync instead; the output says which one was used. Every measurement starts
after ``gc.collect()`` and ``os.sync()`` (not timed), so it pays for no dirty
pages, discards or garbage left by the one before. The machine may be shared:
the CPU used by other processes during each measurement is recorded, and torch
runs with 1 intra-op thread by default (``--threads``): on an oversubscribed
machine OpenMP's spin-waiting makes multi-threaded tensor copies erratic (a
64 MiB clone took 0.02-1.0 s with 2 threads, a steady 0.035 s with 1). On a
VM with free page reporting (virtio_balloon), freed memory goes back to the
host within seconds and its next first touch is slow: every method that
allocates fresh buffers pays for it erratically (the output says when it is on).

Measured (``results`` keys):

    raw_write        floor: the same tensor bytes written to one file with large writev() calls, then fsync
    raw_read         floor: that file read back (cold cache) into one preallocated buffer, 64 MiB reads
    clone            floor: ``[t.clone() for t in tensors]`` (memory copy incl. allocation)
    torch_save       ``torch.save({"model":..., "optim":...})`` to a file + fsync
    torch_load       ``torch.load(weights_only=True)`` of it (cold cache)
    st_save          ``safetensors.torch.save_file`` of the flattened tensors + fsync
    st_load          ``safetensors.torch.load_file`` of it (cold cache)
    dcp_save         ``torch.distributed.checkpoint.save`` (single process, FileSystemWriter, fsync on)
    dcp_load         ``dcp.load`` into the live state dict (cold cache)
    dcp_async_block  time the ``dcp.async_save`` call blocks the caller
    dcp_async_total  ``dcp.async_save`` call to its future's result (durable)
    rl_save          ``engine.save`` with defaults (xxh3_128 checksums, verify-after-write, atomic commit, probe)
    rl_restore       ``engine.restore()`` (plan + checksum-verified load + apply + post-load probe; cold cache)
    rl_async_block   time the ``engine.save_async`` call blocks the caller (steady state: buffers reused)
    rl_async_stage   ``handle.stage_seconds`` as the engine reports it
    rl_async_total   ``save_async`` call to ``handle.wait()`` (committed)
    rl_dedup_first   ``engine.save`` with ``dedup=True`` into an empty run
    rl_dedup_second  the next dedup save after a quarter of the state bytes changed
    hash_sha256      hashing every tensor byte in memory, one thread (likewise hash_blake3, hash_xxh3_128)
    rl_save_sha256   (--variants) ``engine.save`` with ``checksum_algo="sha256"`` (likewise rl_save_blake3)
    rl_save_noverify (--variants) ``engine.save`` with ``verify_after_write=False``

JSON (``--json`` prints one object; every figure is in it):

    mode               "compare" (default) or "scaling" (``--scaling``)
    url                the URL given
    workdir            the folder written into
    repeat             repeats per measurement
    host               {"cpus", "torch_threads", "python", "torch", "platform", "fs", "page_reporting"}
    cache              {"method": "drop_caches"|"fadvise"|"none", "note": text}
    load               {"other_cores_mean", "other_cores_max", "loadavg_start", "loadavg_end"}
    state              {"bytes", "tensors", "param_bytes", "mix": {large|medium|small: {count, bytes}}, "shape"}
    results            name -> {"median_s", "gbps", "samples_s", "other_cores"} for each name above
    dedup              {"changed_bytes", "first_bytes_added", "second_bytes_added", "second_fraction"}
    ratios             name -> time ratio (see RATIOS below; < 1 means rl_ckpt is faster)
    goals              list of {"name", "met", "value", "limit", "text"}
    goals_met          how many goals were met
    goals_total        how many goals were evaluated
    scaling            (``--scaling`` only) {"sizes": [...], "catalog": [...]}:
      sizes[]          {"size_request", "state_bytes", "tensors", "results": {raw_write, raw_read, clone,
                        rl_save, rl_restore, rl_async_block}, "save_vs_raw", "restore_vs_raw", "block_vs_clone"}
      catalog[]        {"count", "create_s", "create_per_s", "snapshots_s", "refresh_s", "plan_recovery_s",
                        "plan_recovery_cold_s", "retention_s", "open_s", "per_snapshot_us": {snapshots, refresh,
                        plan_recovery, retention, open}}

RATIOS (time of rl_ckpt / time of the other; GB/s ratios are the inverse):
``save_vs_raw_write``, ``save_vs_torch_save``, ``save_vs_st_save``,
``save_vs_dcp_save``, ``block_vs_save``, ``block_vs_clone``,
``block_vs_dcp_block``, ``restore_vs_raw_read``, ``restore_vs_torch_load``,
``restore_vs_st_load``, ``restore_vs_dcp_load``, ``dedup_second_vs_first``.

``--model gpt2-small`` (or ``gpt2-tiny`` for a quick run) measures a real
model instead: transformers ``GPT2LMHeadModel(GPT2Config())`` (124M
parameters, random init, nothing downloaded) with ``torch.optim.AdamW`` after
one real step. ``mode`` is then "model"; ``results`` holds ``raw_write``,
``raw_read``, ``torch_save``, ``torch_load`` (here ``torch.load`` +
``load_state_dict`` of model and optimizer), ``rl_save`` and ``rl_restore``
(defaults: probe on), ``rl_save_noprobe`` (``post_load_check=False``);
``state`` adds ``model`` and ``parameters``; ``probe_record_bytes`` is the size
of the probe fingerprints in the manifest; the goals are ``rl_save <= 1.0 x
torch_save`` and ``rl_restore <= 1.0 x torch_load``.

Goals (evaluated on the medians of the same run): rl_save throughput >= 0.8 x
raw_write throughput; rl_save faster than torch_save and than st_save;
rl_async_block <= 0.10 x rl_save and <= 1.5 x clone; rl_restore <= 1.3 x
raw_read and <= 0.7 x torch_load.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

GIB = 1 << 30
MIB = 1 << 20
LARGE = 16 << 20  # bytes: a tensor of >= 16 MiB is "large"
SMALL = 64 << 10  # bytes: below 64 KiB is "small"
DROP_CACHES = "/proc/sys/vm/drop_caches"
IO_CHUNK = 64 << 20
IOV_MAX = 1024
DEFAULT_SIZES = "64M,256M,1G,4G"
DEFAULT_COUNTS = "1,10,100,1000,10000"
HASH_ALGOS = ("sha256", "blake3", "xxh3_128")

RESULT_KEYS = (
    "raw_write", "raw_read", "clone", "torch_save", "torch_load", "st_save", "st_load", "dcp_save", "dcp_load",
    "dcp_async_block", "dcp_async_total", "rl_save", "rl_restore", "rl_async_block", "rl_async_stage",
    "rl_async_total", "rl_dedup_first", "rl_dedup_second", *(f"hash_{a}" for a in HASH_ALGOS),
)
VARIANT_KEYS = ("rl_save_sha256", "rl_save_blake3", "rl_save_noverify")
RATIOS = {  # name -> (numerator, denominator): time ratios
    "save_vs_raw_write": ("rl_save", "raw_write"),
    "save_vs_torch_save": ("rl_save", "torch_save"),
    "save_vs_st_save": ("rl_save", "st_save"),
    "save_vs_dcp_save": ("rl_save", "dcp_save"),
    "block_vs_save": ("rl_async_block", "rl_save"),
    "block_vs_clone": ("rl_async_block", "clone"),
    "block_vs_dcp_block": ("rl_async_block", "dcp_async_block"),
    "restore_vs_raw_read": ("rl_restore", "raw_read"),
    "restore_vs_torch_load": ("rl_restore", "torch_load"),
    "restore_vs_st_load": ("rl_restore", "st_load"),
    "restore_vs_dcp_load": ("rl_restore", "dcp_load"),
    "dedup_second_vs_first": ("rl_dedup_second", "rl_dedup_first"),
}


class BenchUsageError(ValueError):
    """A bad argument (the CLI exits 2)."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- sizes and paths
def parse_size(text: str) -> int:
    """``64M``, ``256MiB``, ``1G``, ``1.5GiB``, ``4096`` -> bytes (binary units)."""
    s = str(text).strip().upper().replace(" ", "")
    if s.endswith("IB"):
        s = s[:-2]
    elif s.endswith("B"):
        s = s[:-1]
    mult = 1
    if s and s[-1] in "KMGT":
        mult = 1 << (10 * ("KMGT".index(s[-1]) + 1))
        s = s[:-1]
    try:
        value = float(s)
    except ValueError:
        raise BenchUsageError(f"bad size {text!r}: expected e.g. 64M, 256MiB, 1G, 1.5GiB") from None
    if not value > 0 or not math.isfinite(value):
        raise BenchUsageError(f"bad size {text!r}: must be > 0")
    return int(value * mult)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}".replace(".00 ", " ")
        n /= 1024
    return f"{n} B"


def local_path(url: str) -> str:
    """The local folder of ``url``; BenchUsageError for remote URLs."""
    if url.startswith("file://"):
        return url[len("file://"):] or "/"
    if "://" in url:
        scheme = url.split("://", 1)[0]
        raise BenchUsageError(
            f"bench measures local folders only (a path or file://), got {scheme}://: torch.save, "
            "torch.distributed.checkpoint and safetensors write local files, so the peer comparison "
            "cannot run there. Benchmark a local folder (or a mount of the store).")
    return url


def fs_info(path: str) -> dict:
    """Filesystem type and device of the mount holding ``path`` (Linux; best effort)."""
    best, info = "", {"fstype": "?", "source": "?", "mount": "?"}
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mnt = left.split()[4]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    fstype, source = right.split()[:2]
                    best, info = mnt, {"fstype": fstype, "source": source, "mount": mnt}
    except (OSError, IndexError, ValueError):
        pass
    return info


def tree_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def rmtree(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


# ----------------------------------------------------------------------------- the state
_CLASSES: tuple | None = None


def model_classes() -> tuple[type, type]:
    """(Block, SyntheticPolicy), defined on first use so that importing this module stays light (the CLI imports it)."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    import torch
    from torch import nn

    class Block(nn.Module):
        """A transformer-ish block: 4 medium h x h matrices and many small vectors (15 parameters)."""

        def __init__(self, h: int) -> None:
            super().__init__()
            self.q = nn.Linear(h, h)
            self.k = nn.Linear(h, h)
            self.v = nn.Linear(h, h)
            self.o = nn.Linear(h, h)
            self.norm1 = nn.LayerNorm(h)
            self.norm2 = nn.LayerNorm(h)
            self.gate = nn.Linear(h, 16)
            self.scale = nn.Parameter(torch.ones(max(1, h // 8)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.norm1(x)
            y = self.o(torch.tanh(self.q(y)) * self.v(y) + self.k(y))
            return self.norm2(x + y)

    class SyntheticPolicy(nn.Module):
        """A policy with a realistic parameter mix; its forward is cheap (the post-load probe runs it)."""

        def __init__(self, h: int, layers: int, rows: int) -> None:
            super().__init__()
            self.embed = nn.Embedding(rows, h)
            self.unembed = nn.Linear(h, rows, bias=False)
            self.policy_head = nn.Linear(h, rows)
            self.value_trunk = nn.Linear(h, rows)
            self.blocks = nn.ModuleList(Block(h) for _ in range(layers))
            self.final_norm = nn.LayerNorm(h)
            self.value_out = nn.Linear(h, 1)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.embed(idx)
            for block in self.blocks:
                x = block(x)
            return self.value_out(self.final_norm(x))

    _CLASSES = (Block, SyntheticPolicy)
    return _CLASSES


def _block_params(h: int) -> int:
    return 4 * (h * h + h) + 4 * h + (16 * h + 16) + max(1, h // 8)


def plan_shape(size_bytes: int, tensors: int | None = None) -> dict:
    """Hidden size, blocks and large-matrix rows for ~size_bytes of params + Adam state (fp32)."""
    n_params = max(4096, size_bytes // 12)  # params 4 B + exp_avg 4 B + exp_avg_sq 4 B
    if tensors:
        layers = max(1, round((tensors / 4 - 10) / 15))
        h = max(16, int(math.sqrt(0.45 * n_params / (4 * layers))) // 8 * 8)
    else:
        h = max(64, 64 * round(16 * math.sqrt(size_bytes / GIB)))  # 1024 at 1 GiB
        layers = max(2, round(0.45 * n_params / _block_params(h)))
    rest = n_params - layers * _block_params(h) - (2 * h + h + 1)
    rows = max(16, (rest - 2 * h) // (4 * h + 2))
    return {"hidden": h, "blocks": layers, "large_rows": rows}


def build_state(size_bytes: int, tensors: int | None = None, seed: int = 0) -> tuple[SyntheticPolicy, torch.optim.Adam, dict]:
    """A model + Adam after one real step, ~size_bytes in total."""
    import torch

    shape = plan_shape(size_bytes, tensors)
    _block, policy_cls = model_classes()
    torch.manual_seed(seed)
    with torch.no_grad():
        model = policy_cls(shape["hidden"], shape["blocks"], shape["large_rows"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p).mul_(1e-3)
    opt.step()  # populates exp_avg, exp_avg_sq, step
    opt.zero_grad(set_to_none=True)
    return model, opt, shape


def state_dict_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def flat_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every saved tensor under a flat name (the live tensors, no copies)."""
    import torch

    out = {f"model.{k}": t for k, t in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, t in st.items():
            if isinstance(t, torch.Tensor):
                out[f"optim.{pid}.{k}"] = t
    return out


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def size_mix(tensors) -> dict:
    mix = {"large": [0, 0], "medium": [0, 0], "small": [0, 0]}
    for t in tensors:
        b = t.numel() * t.element_size()
        key = "large" if b >= LARGE else ("small" if b < SMALL else "medium")
        mix[key][0] += 1
        mix[key][1] += b
    return {k: {"count": c, "bytes": b} for k, (c, b) in mix.items()}


def byte_views(tensors) -> list[memoryview]:
    import torch

    out = []
    for t in tensors:
        if t.numel():
            out.append(memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B"))
    return out


# ----------------------------------------------------------------------------- machine
class CpuMeter:
    """Cores used by everything but this process while a measurement runs (noise indicator)."""

    def __init__(self) -> None:
        self._tck = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.start()

    def _busy(self) -> float | None:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / self._tck  # user nice system irq softirq steal

    def start(self) -> None:
        t = os.times()
        self._t, self._b, self._own = time.perf_counter(), self._busy(), t[0] + t[1] + t[2] + t[3]

    def other_cores(self) -> float | None:
        b, wall = self._busy(), time.perf_counter() - self._t
        if b is None or self._b is None or wall <= 0.05:  # too short for jiffy resolution
            return None
        t = os.times()
        return max(0.0, (b - self._b) - (t[0] + t[1] + t[2] + t[3] - self._own)) / wall


def free_page_reporting() -> bool:
    """True when the guest hands freed memory back to its hypervisor (virtio_balloon free page reporting)."""
    try:
        with open("/sys/module/page_reporting/parameters/reported_kib", encoding="ascii") as f:
            return int(f.read().strip() or 0) > 0
    except (OSError, ValueError):
        return False


def loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


class CacheDropper:
    """Makes the next read cold: drop_caches where allowed, else fadvise(DONTNEED) on the files."""

    def __init__(self, mode: str = "drop") -> None:
        self.method = "none"
        self.note = "page cache NOT dropped (--cache none): reads may be served from memory"
        if mode == "drop":
            try:
                os.sync()
                with open(DROP_CACHES, "w") as f:
                    f.write("3\n")
                self.method = "drop_caches"
                self.note = f"page cache dropped before every read (sync; echo 3 > {DROP_CACHES}): it worked"
            except OSError as exc:
                mode = "fadvise"
                self.note = (f"echo 3 > {DROP_CACHES} refused ({exc.strerror or exc}); instead the files were evicted "
                             "with posix_fadvise(POSIX_FADV_DONTNEED) after their fsync")
        if mode == "fadvise":
            if hasattr(os, "posix_fadvise"):
                self.method = "fadvise"
                if self.note.startswith("page cache NOT"):
                    self.note = ("files evicted with posix_fadvise(POSIX_FADV_DONTNEED) after their fsync before every "
                                 "read (--cache fadvise)")
            else:  # pragma: no cover - non-Linux
                self.note = "no drop_caches and no posix_fadvise here: reads may be served from memory"

    def drop(self, *paths: str) -> None:
        if self.method == "drop_caches":
            os.sync()
            with open(DROP_CACHES, "w") as f:
                f.write("3\n")
        elif self.method == "fadvise":
            for path in paths:
                files = [path] if os.path.isfile(path) else [os.path.join(r, n) for r, _d, fs in os.walk(path) for n in fs]
                for name in files:
                    try:
                        fd = os.open(name, os.O_RDONLY)
                    except OSError:
                        continue
                    try:
                        os.fdatasync(fd)  # already durable; DONTNEED skips dirty pages
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


# ----------------------------------------------------------------------------- floor
def raw_write(path: str, views: list[memoryview]) -> int:
    """One file, writev() calls of up to 64 MiB (small tensors coalesced without copying), fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    total = 0
    try:
        batch: list[memoryview] = []
        size = 0

        def flush() -> None:
            nonlocal total
            pending = [v for v in batch if v.nbytes]
            while pending:
                n = os.writev(fd, pending)
                total += n
                while pending and n >= pending[0].nbytes:
                    n -= pending[0].nbytes
                    pending.pop(0)
                if pending and n:
                    pending[0] = pending[0][n:]
            batch.clear()

        for view in views:
            for start in range(0, view.nbytes, IO_CHUNK):
                part = view[start:start + IO_CHUNK]
                if size + part.nbytes > IO_CHUNK or len(batch) >= IOV_MAX:
                    flush()
                    size = 0
                batch.append(part)
                size += part.nbytes
        flush()
        os.fsync(fd)
    finally:
        os.close(fd)
    parent = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(parent)
    finally:
        os.close(parent)
    return total


def raw_read(path: str) -> torch.Tensor:
    """The whole file into one preallocated buffer, 64 MiB readinto() calls."""
    import torch

    size = os.path.getsize(path)
    buf = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buf.numpy()).cast("B") if size else memoryview(b"")
    got = 0
    with open(path, "rb", buffering=0) as f:
        while got < size:
            n = f.readinto(view[got:got + IO_CHUNK])
            if not n:
                break
            got += n
    if got != size:
        raise OSError(f"short read of {path}: {got} of {size}")
    return buf


def hash_all(views: list[memoryview], algo: str) -> str:
    from .checksum import new_hasher

    h = new_hasher(algo)
    for v in views:
        for start in range(0, v.nbytes, 16 << 20):
            h.update(v[start:start + (16 << 20)])
    return h.hexdigest()


# ----------------------------------------------------------------------------- peers
def _quiet_dcp() -> None:
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def torch_save(path: str, state: dict) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def st_save(path: str, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, path)
    fsync_path(path)


def dcp_save(path: str, state: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    dcp.save(state, storage_writer=FileSystemWriter(path))


def dcp_async_save(path: str, state: dict):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    return dcp.async_save(state, storage_writer=FileSystemWriter(path))


def dcp_load(path: str, state: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    dcp.load(state, storage_reader=FileSystemReader(path))


# ----------------------------------------------------------------------------- measuring
def quiesce() -> None:
    """Before a measurement (not timed): no garbage, no dirty pages or pending discards from the last one."""
    gc.collect()
    os.sync()


class Samples:
    """Every sample of every measurement, with the CPU other processes used meanwhile."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.other: dict[str, list[float | None]] = {}

    def add(self, name: str, seconds: float, other: float | None) -> None:
        self.times.setdefault(name, []).append(seconds)
        self.other.setdefault(name, []).append(other)

    def timed(self, name: str, fn: Callable[[], Any]) -> Any:
        quiesce()
        meter = CpuMeter()
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        self.add(name, dt, meter.other_cores())
        return out

    def median(self, name: str) -> float | None:
        xs = self.times.get(name)
        return statistics.median(xs) if xs else None

    def result(self, name: str, nbytes_: int) -> dict:
        med = self.median(name)
        return {"median_s": med, "gbps": (nbytes_ / med / 1e9) if med else None,
                "samples_s": list(self.times.get(name, [])), "other_cores": list(self.other.get(name, []))}

    def load_summary(self) -> dict:
        vals = [o for xs in self.other.values() for o in xs if o is not None]
        return {"other_cores_mean": statistics.fmean(vals) if vals else None,
                "other_cores_max": max(vals) if vals else None}


def _engine(workdir: str, run: str, **kw):
    from .engine import CheckpointEngine

    return CheckpointEngine(base_dir=workdir, run_name=run, retention=False, **kw)


def _clear_run(engine) -> None:
    """Delete every snapshot of a bench engine's run (outside the timings)."""
    root = engine.storage.root
    for name in os.listdir(root):
        rmtree(os.path.join(root, name))
    engine.catalog.refresh()


def mutate_quarter(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> int:
    """Change ~25% of the state bytes (whole tensors, in place); returns the bytes changed."""
    import torch

    tensors = [t for t in flat_tensors(model, opt).values() if t.is_floating_point() and t.dim() > 0]
    total = nbytes(flat_tensors(model, opt).values())
    rng = random.Random(seed)
    rng.shuffle(tensors)
    changed = 0
    with torch.no_grad():
        for t in tensors:
            if changed >= total / 4:
                break
            b = t.numel() * t.element_size()
            if changed + b > total / 4 * 1.15 and changed > 0:
                continue  # keep close to a quarter
            t.add_(1e-3)
            changed += b
    return changed


# ----------------------------------------------------------------------------- the comparison
def run_compare(args, workdir: str, cache: CacheDropper) -> dict:
    import torch

    _quiet_dcp()
    size = parse_size(args.size)
    log(f"bench: building a {human(size)} model + Adam state ...")
    model, opt, shape = build_state(size, args.tensors)
    flat = flat_tensors(model, opt)
    tensors = list(flat.values())
    total = nbytes(tensors)
    views = byte_views(tensors)
    state = {"bytes": total, "tensors": len(tensors), "param_bytes": nbytes(model.state_dict().values()),
             "mix": size_mix(tensors), "shape": shape, "size_request": size}
    log(f"bench: state {human(total)} in {len(tensors)} tensors; {args.repeat} repeat(s); cache: {cache.method}")

    sm = Samples()
    step = iter(range(1, 10**9))
    rl = _engine(workdir, "rl")
    rl.register("policy", model)
    rl.register("optimizer", opt)
    rl_async = _engine(workdir, "rl_async")
    rl_async.register("policy", model)
    rl_async.register("optimizer", opt)
    variants = {}
    if args.variants:
        for key, kw in (("rl_save_sha256", {"checksum_algo": "sha256"}),
                        ("rl_save_blake3", {"checksum_algo": "blake3"}),
                        ("rl_save_noverify", {"verify_after_write": False})):
            e = _engine(workdir, key, **kw)
            e.register("policy", model)
            e.register("optimizer", opt)
            variants[key] = e
    # The first save_async allocates the staging buffers (once per engine); later ones reuse them.
    log("bench: warm-up save_async (allocates staging buffers; not counted) ...")
    h = rl_async.save_async(next(step))
    first_block = h.stage_seconds
    h.wait()
    _clear_run(rl_async)
    dedup_info = {"changed_bytes": [], "first_bytes_added": [], "second_bytes_added": []}
    d = lambda *p: os.path.join(workdir, *p)  # noqa: E731

    def g_floor(r: int) -> None:
        path = d(f"raw-{r}.bin")
        sm.timed("raw_write", lambda: raw_write(path, views))
        cache.drop(path)
        buf = sm.timed("raw_read", lambda: raw_read(path))
        del buf
        rmtree(path)
        clones = sm.timed("clone", lambda: [t.clone() for t in tensors])
        del clones

    def g_torch(r: int) -> None:
        path = d(f"torch-{r}.pt")
        sm.timed("torch_save", lambda: torch_save(path, state_dict_of(model, opt)))
        cache.drop(path)
        # The torch.load peer the issue asks for: it reads back the file torch.save wrote a moment ago in this
        # run (weights_only: tensors and containers only). No rl_ckpt checkpoint is ever passed to torch.load.
        loaded = sm.timed("torch_load", lambda: torch.load(path, weights_only=True))
        del loaded
        rmtree(path)

    def g_st(r: int) -> None:
        from safetensors.torch import load_file

        path = d(f"st-{r}.safetensors")
        sm.timed("st_save", lambda: st_save(path, flat))
        cache.drop(path)
        loaded = sm.timed("st_load", lambda: load_file(path))
        del loaded
        rmtree(path)

    def g_dcp(r: int) -> None:
        path = d(f"dcp-{r}")
        sm.timed("dcp_save", lambda: dcp_save(path, state_dict_of(model, opt)))
        cache.drop(path)
        sm.timed("dcp_load", lambda: dcp_load(path, state_dict_of(model, opt)))
        rmtree(path)
        path = d(f"dcp-async-{r}")
        quiesce()
        meter = CpuMeter()
        t0 = time.perf_counter()
        fut = dcp_async_save(path, state_dict_of(model, opt))
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        other = meter.other_cores()
        sm.add("dcp_async_block", t1 - t0, other)
        sm.add("dcp_async_total", t2 - t0, other)
        rmtree(path)

    def g_rl(r: int) -> None:
        info = sm.timed("rl_save", lambda: rl.save(next(step)))
        cache.drop(rl.storage.root)
        res = sm.timed("rl_restore", lambda: rl.restore())
        if res.snapshot_id != info.snapshot_id:
            raise RuntimeError(f"restore chose {res.snapshot_id}, expected {info.snapshot_id}")
        _clear_run(rl)

    def g_rl_async(r: int) -> None:
        quiesce()
        meter = CpuMeter()
        t0 = time.perf_counter()
        handle = rl_async.save_async(next(step))
        t1 = time.perf_counter()
        handle.wait()
        t2 = time.perf_counter()
        other = meter.other_cores()
        sm.add("rl_async_block", t1 - t0, other)
        sm.add("rl_async_stage", handle.stage_seconds, other)
        sm.add("rl_async_total", t2 - t0, other)
        _clear_run(rl_async)

    def g_dedup(r: int) -> None:
        run = f"dedup-{r}"
        e = _engine(workdir, run, dedup=True)
        e.register("policy", model)
        e.register("optimizer", opt)
        root = d(run)
        sm.timed("rl_dedup_first", lambda: e.save(next(step)))
        after_first = tree_bytes(root)
        changed = mutate_quarter(model, opt, seed=r)
        sm.timed("rl_dedup_second", lambda: e.save(next(step)))
        dedup_info["changed_bytes"].append(changed)
        dedup_info["first_bytes_added"].append(after_first)
        dedup_info["second_bytes_added"].append(tree_bytes(root) - after_first)
        e.close()
        rmtree(root)

    def g_hash(r: int) -> None:
        for algo in HASH_ALGOS:
            sm.timed(f"hash_{algo}", lambda algo=algo: hash_all(views, algo))

    def g_variants(r: int) -> None:
        for key, e in variants.items():
            sm.timed(key, lambda e=e: e.save(next(step)))
            _clear_run(e)

    groups = [g_floor, g_torch, g_st, g_dcp, g_rl, g_rl_async, g_dedup, g_hash]
    if variants:
        groups.insert(5, g_variants)
    started = time.perf_counter()
    for r in range(args.repeat):
        order = groups[r % len(groups):] + groups[: r % len(groups)]
        for g in order:
            log(f"bench: repeat {r + 1}/{args.repeat}: {g.__name__[2:]} ...")
            g(r)
    for e in (rl, rl_async, *variants.values()):
        e.close()

    results = {k: sm.result(k, total) for k in (*RESULT_KEYS, *variants)}
    ratios = {}
    for name, (num, den) in RATIOS.items():
        a, b = sm.median(num), sm.median(den)
        ratios[name] = a / b if a is not None and b else None
    dedup = {
        "changed_bytes": int(statistics.median(dedup_info["changed_bytes"])),
        "first_bytes_added": int(statistics.median(dedup_info["first_bytes_added"])),
        "second_bytes_added": int(statistics.median(dedup_info["second_bytes_added"])),
    }
    dedup["second_fraction"] = dedup["second_bytes_added"] / total if total else None
    return {"state": state, "results": results, "ratios": ratios, "dedup": dedup, "goals": evaluate_goals(sm),
            "load": sm.load_summary(), "first_async_block_s": first_block,
            "elapsed_s": time.perf_counter() - started}


def evaluate_goals(sm: Samples) -> list[dict]:
    m = sm.median
    goals = []

    def goal(name: str, value: float | None, limit: float | None, text: str, lower_is_better: bool = True) -> None:
        met = None if value is None or limit is None else (value <= limit if lower_is_better else value >= limit)
        goals.append({"name": name, "met": met, "value": value, "limit": limit, "text": text})

    def ratio(a: str, b: str) -> float | None:
        return m(a) / m(b) if m(a) is not None and m(b) else None

    # throughput ratio = raw_write time / rl_save time
    thr = (m("raw_write") / m("rl_save")) if m("raw_write") and m("rl_save") else None
    goal("save_vs_raw_write", thr, 0.8, "rl save throughput >= 0.8 x raw write throughput", lower_is_better=False)
    goal("save_faster_than_torch_save", ratio("rl_save", "torch_save"), 1.0, "rl save time < torch.save+fsync time")
    goal("save_faster_than_st_save", ratio("rl_save", "st_save"), 1.0, "rl save time < safetensors.save_file+fsync time")
    goal("block_vs_save", ratio("rl_async_block", "rl_save"), 0.10, "save_async blocking <= 0.10 x sync save")
    goal("block_vs_clone", ratio("rl_async_block", "clone"), 1.5, "save_async blocking <= 1.5 x memory copy (clone)")
    goal("restore_vs_raw_read", ratio("rl_restore", "raw_read"), 1.3, "restore <= 1.3 x raw read time")
    goal("restore_vs_torch_load", ratio("rl_restore", "torch_load"), 0.7, "restore <= 0.7 x torch.load time")
    for g in goals:  # strict "faster than": equal is not faster
        if g["name"].startswith("save_faster") and g["value"] is not None:
            g["met"] = g["value"] < 1.0
    return goals


# ----------------------------------------------------------------------------- a real model (--model)
MODELS = {  # name -> transformers GPT2Config overrides (random init, nothing downloaded)
    "gpt2-small": {},  # GPT2Config() defaults: 124M parameters, tied lm_head
    "gpt2-tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 64},  # a seconds-long smoke run
}
MODEL_KEYS = ("raw_write", "raw_read", "torch_save", "torch_load", "rl_save", "rl_restore", "rl_save_noprobe")


def build_model(name: str):
    """A GPT-2 shaped ``GPT2LMHeadModel`` and ``AdamW`` after one real step (so exp_avg/exp_avg_sq exist)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**MODELS[name]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def run_model(args, workdir: str, cache: CacheDropper) -> dict:
    """``--model``: save and restore of a real model + AdamW against torch.save+fsync and torch.load+load_state_dict."""
    import torch

    log(f"bench: building {args.model} (random init) + AdamW ...")
    model, opt = build_model(args.model)
    flat = flat_tensors(model, opt)
    tensors = list(flat.values())
    views = byte_views(tensors)
    total = nbytes(tensors)
    params = sum(p.numel() for p in model.parameters())
    state = {"bytes": total, "tensors": len(tensors), "param_bytes": nbytes(model.state_dict().values()),
             "mix": size_mix(tensors), "model": args.model, "parameters": params}
    log(f"bench: {params / 1e6:.0f}M parameters, state {human(total)} in {len(tensors)} tensors; "
        f"{args.repeat} repeat(s)")
    sm = Samples()
    step = iter(range(1, 10**9))
    engines = {}
    for key, kw in (("rl", {}), ("rl_noprobe", {"post_load_check": False})):
        e = _engine(workdir, key, **kw)
        e.register("model", model)
        e.register("optimizer", opt)
        engines[key] = e
    d = lambda *p: os.path.join(workdir, *p)  # noqa: E731
    probe_bytes: list[int] = []

    def g_floor(r: int) -> None:
        path = d(f"raw-{r}.bin")
        sm.timed("raw_write", lambda: raw_write(path, views))
        cache.drop(path)
        buf = sm.timed("raw_read", lambda: raw_read(path))
        del buf
        rmtree(path)

    def g_torch(r: int) -> None:
        path = d(f"torch-{r}.pt")
        sm.timed("torch_save", lambda: torch_save(path, state_dict_of(model, opt)))
        cache.drop(path)

        def load() -> None:
            # The peer's own file from a moment ago (weights_only); no rl_ckpt checkpoint is ever torch.load-ed.
            loaded = torch.load(path, weights_only=True)
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optim"])

        sm.timed("torch_load", load)
        rmtree(path)

    def g_rl(r: int) -> None:
        e = engines["rl"]
        info = sm.timed("rl_save", lambda: e.save(next(step)))
        probe_bytes.append(len(json.dumps((info.manifest.extra or {}).get("probes", {}))))
        cache.drop(e.storage.root)
        res = sm.timed("rl_restore", lambda: e.restore())
        if res.snapshot_id != info.snapshot_id:
            raise RuntimeError(f"restore chose {res.snapshot_id}, expected {info.snapshot_id}: {res.skipped}")
        _clear_run(e)

    def g_noprobe(r: int) -> None:
        e = engines["rl_noprobe"]
        sm.timed("rl_save_noprobe", lambda: e.save(next(step)))
        _clear_run(e)

    groups = [g_floor, g_torch, g_rl, g_noprobe]
    started = time.perf_counter()
    for r in range(args.repeat):
        for g in groups[r % len(groups):] + groups[: r % len(groups)]:
            log(f"bench: repeat {r + 1}/{args.repeat}: {g.__name__[2:]} ...")
            g(r)
    for e in engines.values():
        e.close()
    m = sm.median
    ratios = {"save_vs_torch_save": m("rl_save") / m("torch_save"),
              "restore_vs_torch_load": m("rl_restore") / m("torch_load"),
              "save_vs_raw_write": m("rl_save") / m("raw_write"),
              "restore_vs_raw_read": m("rl_restore") / m("raw_read"),
              "noprobe_vs_torch_save": m("rl_save_noprobe") / m("torch_save")}
    goals = [
        {"name": "save_vs_torch_save", "value": ratios["save_vs_torch_save"], "limit": 1.0,
         "text": "rl save (probe on) <= 1.0 x torch.save+fsync"},
        {"name": "restore_vs_torch_load", "value": ratios["restore_vs_torch_load"], "limit": 1.0,
         "text": "rl restore (probe on) <= 1.0 x torch.load + load_state_dict"},
    ]
    for g in goals:
        g["met"] = g["value"] <= g["limit"]
    return {"state": state, "results": {k: sm.result(k, total) for k in MODEL_KEYS}, "ratios": ratios, "goals": goals,
            "probe_record_bytes": max(probe_bytes) if probe_bytes else None, "load": sm.load_summary(),
            "elapsed_s": time.perf_counter() - started}


def format_model(out: dict) -> str:
    res, st = out["results"], out["state"]
    lines = [
        f"rl-ckpt bench --model {st['model']} {out['url']}: {st['parameters'] / 1e6:.0f}M parameters + AdamW, "
        f"{human(st['bytes'])} in {st['tensors']} tensors; medians of {out['repeat']} interleaved repeat(s)",
        f"cache: {out['cache']['note']}",
        f"noise: other processes used {_f(out['load']['other_cores_mean'], '{:.2f}')} cores on average "
        f"(max {_f(out['load']['other_cores_max'], '{:.2f}')})",
        "",
        f"{'method':<44} {'seconds':>8} {'GB/s':>7}",
    ]
    labels = {"raw_write": "floor: raw write + fsync", "raw_read": "floor: raw read (cold)",
              "torch_save": "torch.save + fsync", "torch_load": "torch.load + load_state_dict (cold)",
              "rl_save": "rl_ckpt save (probe on)", "rl_restore": "rl_ckpt restore (plan, verify, load, probe; cold)",
              "rl_save_noprobe": "rl_ckpt save (post_load_check off)"}
    for key in MODEL_KEYS:
        r = res[key]
        spread = f"  [{min(r['samples_s']):.3f}..{max(r['samples_s']):.3f}]" if len(r["samples_s"]) > 1 else ""
        lines.append(f"{labels[key]:<44} {_f(r['median_s']):>8} {_f(r['gbps'], '{:.2f}'):>7}{spread}")
    lines += ["", f"probe record in the manifest: {out['probe_record_bytes']} bytes", "",
              "goals (medians of this run):"]
    for g in out["goals"]:
        lines.append(f"  {'MET   ' if g['met'] else 'MISSED'} {g['text']}: {g['value']:.3f} (limit {g['limit']})")
    lines.append(f"{out['goals_met']}/{out['goals_total']} goals met")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- scaling
def run_scaling(args, workdir: str, cache: CacheDropper) -> dict:
    sizes = [s for s in (args.sizes or DEFAULT_SIZES).split(",") if s.strip()]
    counts = sorted({int(c) for c in (args.counts or DEFAULT_COUNTS).split(",") if c.strip()})
    if not counts or counts[0] < 1:
        raise BenchUsageError("--counts: positive integers, e.g. 1,10,100")
    size_rows = [scale_size(args, workdir, cache, s) for s in sizes]
    catalog_rows = scale_catalog(args, workdir, cache, counts)
    return {"sizes": size_rows, "catalog": catalog_rows}


def scale_size(args, workdir: str, cache: CacheDropper, size_text: str) -> dict:
    size = parse_size(size_text)
    log(f"scaling: {human(size)} state ...")
    model, opt, shape = build_state(size, args.tensors)
    tensors = list(flat_tensors(model, opt).values())
    total = nbytes(tensors)
    views = byte_views(tensors)
    sm = Samples()
    step = iter(range(1, 10**9))
    run = f"scale-{size}"
    rl = _engine(workdir, run)
    rl.register("policy", model)
    rl.register("optimizer", opt)
    h = rl.save_async(next(step))  # warm-up: allocates the staging buffers
    h.wait()
    _clear_run(rl)
    path = os.path.join(workdir, f"raw-{size}.bin")

    def floor() -> None:
        sm.timed("raw_write", lambda: raw_write(path, views))
        cache.drop(path)
        buf = sm.timed("raw_read", lambda: raw_read(path))
        del buf
        rmtree(path)
        clones = sm.timed("clone", lambda: [t.clone() for t in tensors])
        del clones

    def ours() -> None:
        sm.timed("rl_save", lambda: rl.save(next(step)))
        cache.drop(rl.storage.root)
        sm.timed("rl_restore", lambda: rl.restore())
        _clear_run(rl)
        quiesce()
        t0 = time.perf_counter()
        handle = rl.save_async(next(step))
        sm.add("rl_async_block", time.perf_counter() - t0, None)
        handle.wait()
        _clear_run(rl)

    for r in range(args.repeat):
        for g in ((floor, ours) if r % 2 == 0 else (ours, floor)):
            g()
    rl.close()
    rmtree(os.path.join(workdir, run))
    res = {k: sm.result(k, total) for k in ("raw_write", "raw_read", "clone", "rl_save", "rl_restore", "rl_async_block")}
    m = sm.median
    row = {"size_request": size, "state_bytes": total, "tensors": len(tensors), "shape": shape, "results": res,
           "save_vs_raw": m("rl_save") / m("raw_write"), "restore_vs_raw": m("rl_restore") / m("raw_read"),
           "block_vs_clone": m("rl_async_block") / m("clone")}
    del model, opt, tensors, views, rl
    gc.collect()
    return row


def scale_catalog(args, workdir: str, cache: CacheDropper, counts: list[int]) -> list[dict]:
    import torch

    from .retention import plan_retention

    e = _engine(workdir, "catalog", verify_after_write=False)
    e.register("policy", torch.nn.Linear(4, 4))
    rng = random.Random(0)
    made = 0
    rows = []
    for count in counts:
        log(f"scaling: creating snapshots {made + 1}..{count} (tiny state, verify_after_write=False) ...")
        t0 = time.perf_counter()
        first = made
        while made < count:
            made += 1
            e.save(made, metrics={"avg_reward": rng.random()})
        create_s = time.perf_counter() - t0
        sm = Samples()
        policy = e.retention or _default_policy(e)
        for _ in range(args.repeat):
            sm.timed("snapshots", e.snapshots)
            sm.timed("refresh", e.catalog.refresh)
            plan = sm.timed("plan_recovery", lambda: e.plan_recovery(deep=False))
            snaps = e.snapshots()
            sm.timed("retention", lambda: plan_retention(snaps, policy))
        if plan.target is None or len(e.snapshots()) != count:
            raise RuntimeError(f"catalog scaling: expected {count} snapshots, plan target {plan.target}")
        for _ in range(args.repeat):  # a restarted process: its first listing parses every manifest
            fresh = _engine(workdir, "catalog", verify_after_write=False)
            sm.timed("open", fresh.snapshots)
            fresh.close()
        cache.drop(e.storage.root)
        fresh = _engine(workdir, "catalog", verify_after_write=False)
        sm.timed("plan_recovery_cold", lambda: fresh.plan_recovery(deep=False))
        fresh.close()
        m = sm.median
        rows.append({
            "count": count, "create_s": create_s, "created": count - first,
            "create_per_s": (count - first) / create_s if create_s else None,
            "snapshots_s": m("snapshots"), "refresh_s": m("refresh"), "plan_recovery_s": m("plan_recovery"),
            "plan_recovery_cold_s": m("plan_recovery_cold"), "retention_s": m("retention"), "open_s": m("open"),
            "per_snapshot_us": {k: m(k) / count * 1e6
                                for k in ("snapshots", "refresh", "plan_recovery", "retention", "open")},
        })
    e.close()
    rmtree(os.path.join(workdir, "catalog"))
    return rows


def _default_policy(engine):
    from .retention import policy_from_config

    return policy_from_config(engine.config)


# ----------------------------------------------------------------------------- output
LABELS = [  # (op, key, label, floor key, peer keys by column)
    ("save", "raw_write", "raw write+fsync (floor)"),
    ("save", "torch_save", "torch.save+fsync"),
    ("save", "st_save", "safetensors save_file+fsync"),
    ("save", "dcp_save", "DCP save"),
    ("save", "rl_save", "rl_ckpt save (defaults: xxh3_128+verify)"),
    ("save", "rl_save_sha256", "rl_ckpt save sha256+verify"),
    ("save", "rl_save_blake3", "rl_ckpt save blake3+verify"),
    ("save", "rl_save_noverify", "rl_ckpt save xxh3_128, no verify"),
    ("load", "raw_read", "raw read (floor)"),
    ("load", "torch_load", "torch.load(weights_only)"),
    ("load", "st_load", "safetensors load_file"),
    ("load", "dcp_load", "DCP load (in place)"),
    ("load", "rl_restore", "rl_ckpt restore (checksums)"),
    ("block", "clone", "memory copy: clone (floor)"),
    ("block", "dcp_async_block", "DCP async_save (blocking)"),
    ("block", "rl_async_block", "rl_ckpt save_async (blocking)"),
    ("block", "rl_async_stage", "  handle.stage_seconds"),
    ("total", "dcp_async_total", "DCP async_save to durable"),
    ("total", "rl_async_total", "rl_ckpt save_async to commit"),
    ("dedup", "rl_dedup_first", "rl_ckpt dedup 1st save"),
    ("dedup", "rl_dedup_second", "rl_ckpt dedup 2nd (25% chg)"),
    ("hash", "hash_sha256", "sha256 in memory (1 thread)"),
    ("hash", "hash_blake3", "blake3 in memory (1 thread)"),
    ("hash", "hash_xxh3_128", "xxh3_128 in memory"),
]
FLOOR = {"save": "raw_write", "load": "raw_read", "block": "clone", "total": "raw_write", "dedup": "raw_write"}
PEERS = {  # column -> op -> key
    "torch": {"save": "torch_save", "load": "torch_load"},
    "safetensors": {"save": "st_save", "load": "st_load"},
    "DCP": {"save": "dcp_save", "load": "dcp_load", "block": "dcp_async_block", "total": "dcp_async_total"},
}


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def format_compare(out: dict) -> str:
    res, st = out["results"], out["state"]
    mix = st["mix"]
    lines = [
        f"rl-ckpt bench {out['url']}: {human(st['bytes'])} model+Adam state in {st['tensors']} tensors "
        f"(large {mix['large']['count']} = {human(mix['large']['bytes'])}, medium {mix['medium']['count']} = "
        f"{human(mix['medium']['bytes'])}, small {mix['small']['count']} = {human(mix['small']['bytes'])}); "
        f"hidden {st['shape']['hidden']}, {st['shape']['blocks']} blocks",
        f"medians of {out['repeat']} interleaved repeat(s); filesystem {out['host']['fs']['fstype']} on "
        f"{out['host']['fs']['source']}; {out['host']['cpus']} CPUs, torch threads {out['host']['torch_threads']}",
        f"cache: {out['cache']['note']}",
        f"noise: other processes used {_f(out['load']['other_cores_mean'], '{:.2f}')} cores on average "
        f"(max {_f(out['load']['other_cores_max'], '{:.2f}')}) during the measurements; load average "
        f"{_f(out['load']['loadavg_start'], '{:.2f}')} -> {_f(out['load']['loadavg_end'], '{:.2f}')}",
    ]
    if out["host"].get("page_reporting"):
        lines.append("note: this VM reports freed memory to its host (virtio_balloon free page reporting): the first touch "
                     "of fresh memory (new buffers, page cache) is slow and erratic; reused buffers are not")
    lines += [
        "",
        "time ratios: x floor / x torch / x safetensors / x DCP = this row's seconds / theirs (same op; < 1 is faster)",
    ]
    head = f"{'op':<6} {'method':<32} {'seconds':>8} {'GB/s':>7} {'x floor':>8} {'x torch':>8} {'x safet.':>8} {'x DCP':>7}"
    lines += [head, "-" * len(head)]
    for op, key, label in LABELS:
        r = res.get(key)
        if not r or r["median_s"] is None:
            continue
        s = r["median_s"]
        cells = []
        for ref in (FLOOR.get(op), PEERS["torch"].get(op), PEERS["safetensors"].get(op), PEERS["DCP"].get(op)):
            other = res.get(ref, {}).get("median_s") if ref else None
            cells.append(_f(s / other, "{:.2f}") if other and ref != key else "-")
        spread = ""
        if len(r["samples_s"]) > 1:
            spread = f"  [{min(r['samples_s']):.3f}..{max(r['samples_s']):.3f}]"
        lines.append(f"{op:<6} {label:<32} {s:>8.3f} {_f(r['gbps'], '{:.2f}'):>7} {cells[0]:>8} {cells[1]:>8} "
                     f"{cells[2]:>8} {cells[3]:>7}{spread}")
    dd = out["dedup"]
    lines += [
        "",
        f"dedup: changed {human(dd['changed_bytes'])} ({dd['changed_bytes'] / st['bytes']:.0%} of the state); "
        f"1st save added {human(dd['first_bytes_added'])}, 2nd save added {human(dd['second_bytes_added'])} "
        f"({_f(dd['second_fraction'], '{:.0%}')} of the state) in {_f(res['rl_dedup_second']['median_s'])} s "
        f"(x{_f(out['ratios']['dedup_second_vs_first'], '{:.2f}')} the 1st save's time)",
        f"first save_async (allocates staging buffers, not in the medians): {out['first_async_block_s']:.3f} s blocked",
        "",
        "goals (medians of this run):",
    ]
    for g in out["goals"]:
        status = "n/a   " if g["met"] is None else ("MET   " if g["met"] else "MISSED")
        lines.append(f"  {status} {g['text']}: {_f(g['value'], '{:.3f}')} (limit {g['limit']})")
    lines.append(f"{out['goals_met']}/{out['goals_total']} goals met")
    return "\n".join(lines)


def format_scaling(out: dict) -> str:
    sc = out["scaling"]
    lines = [f"rl-ckpt bench --scaling {out['url']}: medians of {out['repeat']} repeat(s); cache: {out['cache']['note']}",
             "", "state size (GB/s; ratios are time ratios):"]
    head = (f"{'size':>10} {'tensors':>7} {'rawW GB/s':>9} {'save GB/s':>9} {'save/raw':>8} {'rawR GB/s':>9} "
            f"{'rest GB/s':>9} {'rest/raw':>8} {'clone s':>8} {'block s':>8} {'blk/clone':>9} {'save s/GiB':>10}")
    lines += [head, "-" * len(head)]
    for row in sc["sizes"]:
        r = row["results"]
        per_gib = r["rl_save"]["median_s"] / (row["state_bytes"] / GIB)
        lines.append(f"{human(row['state_bytes']):>10} {row['tensors']:>7} {_f(r['raw_write']['gbps'], '{:.2f}'):>9} "
                     f"{_f(r['rl_save']['gbps'], '{:.2f}'):>9} {row['save_vs_raw']:>8.2f} "
                     f"{_f(r['raw_read']['gbps'], '{:.2f}'):>9} {_f(r['rl_restore']['gbps'], '{:.2f}'):>9} "
                     f"{row['restore_vs_raw']:>8.2f} {r['clone']['median_s']:>8.3f} {r['rl_async_block']['median_s']:>8.3f} "
                     f"{row['block_vs_clone']:>9.2f} {per_gib:>10.2f}")
    lines += ["", "catalog operations over N tiny snapshots (seconds; per-snapshot cost in microseconds):"]
    head = (f"{'N':>6} {'create/s':>8} {'snapshots()':>11} {'us/snap':>8} {'refresh':>8} {'us/snap':>8} "
            f"{'plan(deep=F)':>12} {'us/snap':>8} {'retention':>9} {'us/snap':>8} {'open':>8} {'us/snap':>8} "
            f"{'cold plan':>9}")
    lines += [head, "-" * len(head)]
    for row in sc["catalog"]:
        p = row["per_snapshot_us"]
        lines.append(f"{row['count']:>6} {_f(row['create_per_s'], '{:.0f}'):>8} {row['snapshots_s']:>11.5f} "
                     f"{p['snapshots']:>8.2f} {row['refresh_s']:>8.4f} {p['refresh']:>8.1f} {row['plan_recovery_s']:>12.4f} "
                     f"{p['plan_recovery']:>8.1f} {row['retention_s']:>9.5f} {p['retention']:>8.2f} "
                     f"{row['open_s']:>8.4f} {p['open']:>8.1f} {_f(row['plan_recovery_cold_s'], '{:.4f}'):>9}")
    lines += ["create/s: saves per second while growing to N (engine.save, tiny state, verify_after_write=False, fsync on)",
              "snapshots(): the in-memory catalog; refresh: re-list storage, stat each manifest, parse only new or",
              "changed ones; plan(deep=F): plan_recovery (a refresh + checks of the chosen snapshot); retention: one",
              "policy pass; open: a new engine's first listing (parses every manifest: what a restarted process pays",
              "once); cold plan: a new engine's plan_recovery after the page cache was dropped"]
    return "\n".join(lines)


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if out["mode"] == "scaling":
        sc = out["scaling"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5))
        xs = [row["state_bytes"] / GIB for row in sc["sizes"]]
        for key, label in (("raw_write", "raw write+fsync"), ("rl_save", "rl_ckpt save"), ("raw_read", "raw read"),
                           ("rl_restore", "rl_ckpt restore")):
            a1.plot(xs, [row["results"][key]["gbps"] for row in sc["sizes"]], marker="o", label=label)
        a1.set_xscale("log", base=2)
        a1.set_xlabel("state size (GiB)")
        a1.set_ylabel("GB/s")
        a1.set_title("throughput vs state size")
        a1.legend()
        ns = [row["count"] for row in sc["catalog"]]
        for key, label in (("snapshots", "snapshots() (in memory)"), ("refresh", "catalog refresh"),
                           ("plan_recovery", "plan_recovery(deep=False)"), ("retention", "plan_retention")):
            a2.plot(ns, [row["per_snapshot_us"][key] for row in sc["catalog"]], marker="o", label=label)
        a2.set_xscale("log")
        a2.set_yscale("log")
        a2.set_xlabel("snapshots in the run")
        a2.set_ylabel("microseconds per snapshot")
        a2.set_title("catalog cost per snapshot")
        a2.legend()
    else:
        res = out["results"]
        ops = [("save (durable)", {"floor": "raw_write", "torch": "torch_save", "safetensors": "st_save",
                                   "DCP": "dcp_save", "rl_ckpt": "rl_save"}),
               ("load (cold cache)", {"floor": "raw_read", "torch": "torch_load", "safetensors": "st_load",
                                      "DCP": "dcp_load", "rl_ckpt": "rl_restore"}),
               ("async: caller blocked", {"floor": "clone", "DCP": "dcp_async_block", "rl_ckpt": "rl_async_block"})]
        methods = ["floor", "torch", "safetensors", "DCP", "rl_ckpt"]
        fig, ax = plt.subplots(figsize=(11, 5.5))
        width = 0.16
        for i, meth in enumerate(methods):
            xs, ys = [], []
            for j, (_op, keys) in enumerate(ops):
                key = keys.get(meth)
                if key and res.get(key) and res[key]["median_s"] is not None:
                    xs.append(j + (i - 2) * width)
                    ys.append(res[key]["median_s"])
            bars = ax.bar(xs, ys, width, label=meth)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.set_xticks(range(len(ops)), [op for op, _ in ops])
        ax.set_ylabel("seconds (median)")
        st = out["state"]
        ax.set_title(f"{human(st['bytes'])} model+Adam state, {st['tensors']} tensors; medians of {out['repeat']}; "
                     f"cache: {out['cache']['method']}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- entry point
def run(args) -> dict:
    import torch

    base = local_path(args.url)
    os.makedirs(base, exist_ok=True)
    if args.repeat < 1:
        raise BenchUsageError("--repeat must be >= 1")
    if args.tensors is not None and args.tensors < 4:
        raise BenchUsageError("--tensors must be >= 4")
    if args.threads < 0:
        raise BenchUsageError("--threads must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    workdir = tempfile.mkdtemp(prefix="rl-ckpt-bench-", dir=base)
    cache = CacheDropper(args.cache)
    out: dict = {
        "mode": "scaling" if args.scaling else "compare", "url": args.url, "workdir": workdir, "repeat": args.repeat,
        "host": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                 "python": platform.python_version(), "torch": torch.__version__,
                 "platform": platform.platform(), "fs": fs_info(workdir), "page_reporting": free_page_reporting()},
        "cache": {"method": cache.method, "note": cache.note},
    }
    la0 = loadavg()
    try:
        if args.scaling:
            out["scaling"] = run_scaling(args, workdir, cache)
            out["load"] = {"other_cores_mean": None, "other_cores_max": None}
        elif args.model:
            out["mode"] = "model"
            out.update(run_model(args, workdir, cache))
            out["goals_met"] = sum(1 for g in out["goals"] if g["met"])
            out["goals_total"] = len(out["goals"])
        else:
            out.update(run_compare(args, workdir, cache))
            out["goals_met"] = sum(1 for g in out["goals"] if g["met"])
            out["goals_total"] = sum(1 for g in out["goals"] if g["met"] is not None)
            out["ratios"] = out.pop("ratios")
    finally:
        if not args.keep:
            rmtree(workdir)
    out["load"].update({"loadavg_start": la0, "loadavg_end": loadavg()})
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="local folder to write into (a path or file://)")
    p.add_argument("--size", default="1GiB", help="state size (model + Adam), e.g. 64MiB, 1GiB (default 1GiB)")
    p.add_argument("--tensors", type=int, default=None, metavar="N",
                   help="about N tensors in the saved state (default: from the size)")
    p.add_argument("--repeat", type=int, default=3, help="repeats per measurement; medians are reported (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.add_argument("--plot", metavar="FILE.png", help="draw grouped bars (matplotlib, Agg)")
    p.add_argument("--variants", action="store_true",
                   help="also time engine.save with xxh3_128 and/or verify_after_write=False")
    p.add_argument("--cache", choices=["drop", "fadvise", "none"], default="drop",
                   help="how reads are made cold: drop_caches (falls back to fadvise), fadvise, none")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch intra-op threads while measuring (default 1: on a shared machine OpenMP spin-waits make "
                        "multi-threaded copies erratic; 0 keeps torch's default)")
    p.add_argument("--scaling", action="store_true",
                   help="instead: how cost grows with state size (--sizes) and snapshot count (--counts)")
    p.add_argument("--sizes", default=None, help=f"with --scaling: state sizes (default {DEFAULT_SIZES})")
    p.add_argument("--counts", default=None, help=f"with --scaling: snapshot counts (default {DEFAULT_COUNTS})")
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="instead: a real transformers GPT-2 shaped model + AdamW (random init, no download) vs "
                        "torch.save+fsync and torch.load+load_state_dict; gpt2-small = GPT2Config() defaults (124M)")
    p.add_argument("--keep", action="store_true", help="keep the files written")
    p.add_argument("--fail-on-miss", action="store_true", help="exit 1 when a goal is missed")
    p.add_argument("--sharded", action="store_true",
                   help="instead: FSDP2 save and resharding restore on --ranks gloo processes, next to DCP's save/load")
    p.add_argument("--ranks", default="2,4", help="with --sharded: world sizes to save and restore on (default 2,4)")


def main_args(args) -> int:
    """Run the bench for parsed ``args``; prints the table (or JSON); returns the exit code."""
    if getattr(args, "sharded", False):
        from .sharded.bench import main_args as sharded_main

        return sharded_main(args)
    try:
        out = run(args)
    except BenchUsageError as exc:
        print(f"rl-ckpt bench: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        plot(out, args.plot)
        log(f"bench: wrote {args.plot}")
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        print({"scaling": format_scaling, "model": format_model}.get(out["mode"], format_compare)(out))
    if args.fail_on_miss and out["mode"] in ("compare", "model") and out["goals_met"] < out["goals_total"]:
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rl-ckpt bench", description=__doc__.split("\n")[0])
    add_arguments(p)
    return main_args(p.parse_args(argv))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
