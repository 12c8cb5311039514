"""``rl-ckpt bench``: how fast rl_ckpt saves and restores, next to the floor and its peers, in one run.

    rl-ckpt bench URL [--size 1GiB] [--tensors N] [--repeat 3] [--json] [--plot FILE.png]
                      [--variants] [--fresh] [--cache drop|fadvise|none] [--threads 1] [--keep] [--fail-on-miss]
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
    memcpy           floor: one memcpy of every tensor into tensors allocated (and touched) before the run
    clone            floor: ``[t.clone() for t in tensors]`` (memory copy incl. allocation)
    torch_save       ``torch.save({"model":..., "optim":...})`` to a file + fsync
    torch_load       ``torch.load(weights_only=True)`` of it (cold cache)
    torch_load_apply ``torch.load`` of it + ``load_state_dict`` of model and optimizer (built before: not timed)
    st_save          ``safetensors.torch.save_file`` of the flattened tensors + fsync
    st_load          ``safetensors.torch.load_file`` of it (cold cache)
    dcp_save         ``torch.distributed.checkpoint.save`` (single process, FileSystemWriter, fsync on)
    dcp_load         ``dcp.load`` into the live state dict (cold cache)
    dcp_async_block  time the ``dcp.async_save`` call blocks the caller
    dcp_async_total  ``dcp.async_save`` call to its future's result (durable)
    rl_save          ``engine.save`` with defaults (xxh3_128 checksums, verify-after-write, atomic commit, probe)
    rl_restore       ``engine.restore()`` (plan + checksum-verified load + apply + post-load probe; cold cache); the
                     raw read, memcpy, torch.load and torch.load + load_state_dict are measured in the same group of
                     each repeat (their order rotates), so each restore is paired with its floors
    rl_async_block   time the ``engine.save_async`` call blocks the caller (steady state: buffers reused)
    rl_async_stage   ``handle.stage_seconds``: the call plus the wait of an optimizer step made at once (its
                     pre-hook waits for the whole background copy: the worst case; a step after a forward and
                     backward waits less, see benchmarks/async_save.py)
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
    paired             name -> the median over repeats of the ratio within each repeat (PAIRED below)
    restore_breakdown  the medians of ``RestoreResult.timings`` over the rl_restore runs: plan, read, hash, decode,
                       copy, probe, total (seconds)
    fresh              (``--fresh`` only) the first restore in a new process, per tier ("memory", "durable"):
                       {"restore_s", "engine_s", "memcpy_s", "clone_s", "vs_memcpy", "vs_clone", "breakdown"},
                       "memory_vs_durable", "bytes", "runs"; "memory_allocated" too: the memory tier into an
                       optimizer whose state exists first (see ``rl_ckpt.tools.bench.fresh``)
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
``restore_vs_torch_load_apply``, ``restore_vs_memcpy``, ``restore_vs_st_load``, ``restore_vs_dcp_load``,
``dedup_second_vs_first``. PAIRED (the same, per repeat): ``restore_vs_raw_read``, ``restore_vs_torch_load``,
``restore_vs_torch_load_apply``, ``torch_load_vs_raw_read``.

``--fresh`` adds the first restore in a new process (a Ray actor, what a restarted rank does) from the memory
tier and from local disk (cold), each next to one memcpy of the state and a copy into fresh memory measured in
that same process (``rl_ckpt.tools.bench.fresh``; a local Ray cluster is started when none is connected).

``--model gpt2-small`` (or ``gpt2-tiny`` for a quick run) measures a real
model instead: transformers ``GPT2LMHeadModel(GPT2Config())`` (124M
parameters, random init, nothing downloaded) with ``torch.optim.AdamW`` after
one real step. ``mode`` is then "model"; ``results`` holds ``raw_write``,
``raw_read``, ``torch_save``, ``torch_load`` (here ``torch.load`` +
``load_state_dict`` of model and optimizer), ``rl_save`` and ``rl_restore``
(defaults: probe on), ``rl_save_noprobe`` (``post_load_check=False``);
``state`` adds ``model`` and ``parameters``; ``probe_record_bytes`` is the size
of the probe fingerprints in the manifest; ``paired`` and ``restore_breakdown`` as
above; the goals are ``rl_save <= 1.0 x torch_save`` and ``rl_restore <= 1.0 x
torch_load`` (paired by repeat).

Goals (evaluated on the medians of the same run): rl_save throughput >= 0.8 x
raw_write throughput; rl_save faster than torch_save and than st_save;
rl_async_block <= 0.10 x rl_save and <= 1.5 x clone; rl_restore <= 1.05 x
raw_read and <= 0.8 x torch_load (paired by repeat).

Modules: ``state`` (the synthetic state), ``baselines`` (the floor and the peers), ``compare``, ``model``, ``fresh``
and ``scaling`` (the runs), ``report`` (tables and plot), ``runner`` (the command), ``common`` (the rest).
"""

from __future__ import annotations

from rl_ckpt.tools.bench.baselines import hash_all, raw_read, raw_write
from rl_ckpt.tools.bench.common import (
    DEFAULT_COUNTS,
    DEFAULT_SIZES,
    GIB,
    HASH_ALGOS,
    LARGE,
    MIB,
    RATIOS,
    RESULT_KEYS,
    SMALL,
    VARIANT_KEYS,
    BenchUsageError,
    CacheDropper,
    CpuMeter,
    Samples,
    fs_info,
    human,
    local_path,
    parse_size,
)
from rl_ckpt.tools.bench.compare import evaluate_goals, run_compare
from rl_ckpt.tools.bench.model import MODEL_KEYS, MODELS, build_model, format_model, run_model
from rl_ckpt.tools.bench.report import format_compare, format_scaling, plot
from rl_ckpt.tools.bench.runner import add_arguments, main, main_args, run
from rl_ckpt.tools.bench.scaling import run_scaling
from rl_ckpt.tools.bench.state import build_state, flat_tensors, nbytes, plan_shape, size_mix, state_dict_of

__all__ = [
    "DEFAULT_COUNTS",
    "DEFAULT_SIZES",
    "GIB",
    "HASH_ALGOS",
    "LARGE",
    "MIB",
    "MODELS",
    "MODEL_KEYS",
    "RATIOS",
    "RESULT_KEYS",
    "SMALL",
    "VARIANT_KEYS",
    "BenchUsageError",
    "CacheDropper",
    "CpuMeter",
    "Samples",
    "add_arguments",
    "build_model",
    "build_state",
    "evaluate_goals",
    "flat_tensors",
    "format_compare",
    "format_model",
    "format_scaling",
    "fs_info",
    "hash_all",
    "human",
    "local_path",
    "main",
    "main_args",
    "nbytes",
    "parse_size",
    "plan_shape",
    "plot",
    "raw_read",
    "raw_write",
    "run",
    "run_compare",
    "run_model",
    "run_scaling",
    "size_mix",
    "state_dict_of",
]
