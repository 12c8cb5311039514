"""Shared pieces of the benchmark: sizes, the machine (CPU meter, page cache), fsync and the samples."""

from __future__ import annotations

import gc
import math
import os
import shutil
import statistics
import sys
import time
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
    "raw_write",
    "raw_read",
    "memcpy",
    "clone",
    "torch_save",
    "torch_load",
    "torch_load_apply",
    "st_save",
    "st_load",
    "dcp_save",
    "dcp_load",
    "dcp_async_block",
    "dcp_async_total",
    "rl_save",
    "rl_restore",
    "rl_async_block",
    "rl_async_stage",
    "rl_async_total",
    "rl_dedup_first",
    "rl_dedup_second",
    *(f"hash_{a}" for a in HASH_ALGOS),
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
    "restore_vs_torch_load_apply": ("rl_restore", "torch_load_apply"),
    "restore_vs_memcpy": ("rl_restore", "memcpy"),
    "restore_vs_st_load": ("rl_restore", "st_load"),
    "restore_vs_dcp_load": ("rl_restore", "dcp_load"),
    "dedup_second_vs_first": ("rl_dedup_second", "rl_dedup_first"),
}

PAIRED = {  # name -> (numerator, denominator): the median over repeats of the ratio within each repeat
    "restore_vs_raw_read": ("rl_restore", "raw_read"),
    "restore_vs_torch_load": ("rl_restore", "torch_load"),
    "restore_vs_torch_load_apply": ("rl_restore", "torch_load_apply"),
    "torch_load_vs_raw_read": ("torch_load", "raw_read"),
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


def print_json(out: dict, path: str | None) -> None:
    """A bench's figures as JSON on stdout, and into ``path`` too when given."""
    import json

    text = json.dumps(out, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)


def local_path(url: str) -> str:
    """The local folder of ``url``; BenchUsageError for remote URLs."""
    if url.startswith("file://"):
        return url[len("file://") :] or "/"
    if "://" in url:
        scheme = url.split("://", 1)[0]
        raise BenchUsageError(
            f"bench measures local folders only (a path or file://), got {scheme}://: torch.save, "
            "torch.distributed.checkpoint and safetensors write local files, so the peer comparison "
            "cannot run there. Benchmark a local folder (or a mount of the store)."
        )
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


class CpuWork:
    """CPU seconds the whole machine spent (every process: user, system, interrupts) between ``start`` and
    ``stop``, and the seconds the hypervisor took from it (``steal``: another tenant's load), from /proc/stat.
    On a machine whose cores are all busy, wall time follows the work; the work does not follow the scheduling.
    None where /proc/stat is missing."""

    def __init__(self) -> None:
        self._tck = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._at: tuple[float, float] | None = None

    def _read(self) -> tuple[float, float] | None:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        return (v[0] + v[1] + v[2] + v[5] + v[6]) / self._tck, v[7] / self._tck

    def start(self) -> None:
        self._at = self._read()

    def stop(self) -> tuple[float | None, float | None]:
        """(work, steal) in CPU seconds since ``start``."""
        now = self._read()
        if now is None or self._at is None:
            return None, None
        return now[0] - self._at[0], now[1] - self._at[1]


class ProcessWork:
    """CPU seconds (user + system) each kind of process of this machine spent between ``start`` and ``stop``, from
    ``/proc/<pid>/stat``: ``kind_of(pid, cmdline)`` names a process's kind (None: not counted). A process that
    exits before ``stop`` is not counted; one started meanwhile counts from zero. Empty where /proc is missing."""

    def __init__(self, kind_of: Callable[[int, str], str | None]) -> None:
        self.kind_of = kind_of
        self._tck = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._at: dict[int, tuple[str, float]] = {}

    def _read(self) -> dict[int, tuple[str, float]]:
        out: dict[int, tuple[str, float]] = {}
        try:
            pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
        except OSError:
            return out
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # (the command in parentheses may hold spaces)
            except (OSError, IndexError):
                continue  # gone meanwhile, or not readable
            kind = self.kind_of(pid, cmdline)
            if kind is not None:
                out[pid] = (kind, (int(fields[11]) + int(fields[12])) / self._tck)
        return out

    def start(self) -> None:
        self._at = self._read()

    def stop(self) -> dict[str, float]:
        """Kind -> CPU seconds since ``start``."""
        by_kind: dict[str, float] = {}
        for pid, (kind, cpu) in self._read().items():
            before = self._at.get(pid)
            used = cpu - (before[1] if before is not None and before[0] == kind else 0.0)
            by_kind[kind] = by_kind.get(kind, 0.0) + max(used, 0.0)
        return by_kind


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
                self.note = (
                    f"echo 3 > {DROP_CACHES} refused ({exc.strerror or exc}); instead the files were evicted "
                    "with posix_fadvise(POSIX_FADV_DONTNEED) after their fsync"
                )
        if mode == "fadvise":
            if hasattr(os, "posix_fadvise"):
                self.method = "fadvise"
                if self.note.startswith("page cache NOT"):
                    self.note = (
                        "files evicted with posix_fadvise(POSIX_FADV_DONTNEED) after their fsync before every "
                        "read (--cache fadvise)"
                    )
            else:  # pragma: no cover - non-Linux
                self.note = "no drop_caches and no posix_fadvise here: reads may be served from memory"

    def drop(self, *paths: str) -> None:
        if self.method == "drop_caches":
            os.sync()
            with open(DROP_CACHES, "w") as f:
                f.write("3\n")
        elif self.method == "fadvise":
            for path in paths:
                files = (
                    [path] if os.path.isfile(path) else [os.path.join(r, n) for r, _d, fs in os.walk(path) for n in fs]
                )
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
        return {
            "median_s": med,
            "gbps": (nbytes_ / med / 1e9) if med else None,
            "samples_s": list(self.times.get(name, [])),
            "other_cores": list(self.other.get(name, [])),
        }

    def load_summary(self) -> dict:
        vals = [o for xs in self.other.values() for o in xs if o is not None]
        return {
            "other_cores_mean": statistics.fmean(vals) if vals else None,
            "other_cores_max": max(vals) if vals else None,
        }
