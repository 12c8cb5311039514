"""``rl-ckpt bench --sharded``: FSDP2 save and resharding restore, rl_ckpt next to DCP's own save/load.

For every world size N in ``--ranks``, N gloo processes (CPU) save the same
FSDP2 model + Adam state with rl_ckpt and with ``dcp.save``; then for every M
in ``--ranks``, M fresh processes restore each snapshot (DCP reshards too).
Printed per case: wall time (slowest rank, between barriers), the ratio to
DCP, tensor bytes read per rank against the rank's share, and the growth of
each rank's peak RSS during the restore against its local shard + 2 chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(size_bytes: int, seed: int) -> torch.nn.Module:
    """About ``size_bytes`` of model + Adam state (a third of it parameters) in square layers."""
    torch.manual_seed(seed)
    width = 512
    layers = max(1, size_bytes // 3 // (width * width * 4))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _setup(rank: int, world: int, port: int, size: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model = _model(size, seed)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 512)).sum().backward()
    optim.step()
    return model, optim


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    out = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out.item())


def _gather(value: dict) -> list[dict]:
    data = [None] * dist.get_world_size()
    dist.all_gather_object(data, value)
    return data


def _local_bytes(model, optim) -> int:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    msd, osd = get_state_dict(model, optim)
    ts = list(msd.values()) + [v for st in osd["state"].values() for v in st.values()]
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in ts)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def save_job(rank: int, world: int, port: int, size: int, work: str, out: str, repeat: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from rl_ckpt import CheckpointEngine

    model, optim = _setup(rank, world, port, size, 0)
    engine = CheckpointEngine(base_dir=work, run_name=f"rl_{world}", retention=False, rank=rank, world_size=world)
    engine.register("policy", model)
    engine.register("optim", optim)
    t_rl = _median([_timed(lambda s=s: engine.save(s)) for s in range(1, repeat + 1)])

    def dcp_save(i: int) -> None:
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(f"{work}/dcp_{world}_{i}"))

    t_dcp = _median([_timed(lambda i=i: dcp_save(i)) for i in range(1, repeat + 1)])
    share = _gather({"share": _local_bytes(model, optim)})
    if rank == 0:
        Path(out).write_text(
            json.dumps(
                {"ranks": world, "rl_ckpt_s": t_rl, "dcp_s": t_dcp, "state_bytes": sum(s["share"] for s in share)}
            )
        )
    engine.close()
    dist.destroy_process_group()


def restore_job(rank: int, world: int, port: int, size: int, work: str, saved: int, out: str, repeat: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from rl_ckpt import CheckpointEngine

    model, optim = _setup(rank, world, port, size, 1)
    engine = CheckpointEngine(base_dir=work, run_name=f"rl_{saved}", retention=False, rank=rank, world_size=world)
    engine.register("policy", model)
    engine.register("optim", optim)
    st = engine.storage
    counted = {"range": 0}
    read_range = st.read_range

    def counting(path, start, length):
        data = read_range(path, start, length)
        counted["range"] += len(data)
        return data

    st.read_range = counting
    share = _local_bytes(model, optim)
    engine.restore(snapshot_id="step_000000001")  # warm-up: imports and first-touch costs out of the timing below
    counted["range"] = 0
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t_rl = _timed(lambda: engine.restore(snapshot_id="step_000000001"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    read = counted["range"]
    t_rl = _median([t_rl] + [_timed(lambda: engine.restore(snapshot_id="step_000000001")) for _ in range(repeat - 1)])
    meta = json.loads((Path(work) / f"rl_{saved}" / "step_000000001" / "meta.json").read_text())
    chunk = max(
        math_prod(c["sizes"]) * 4
        for sec in meta["components"].values()
        for t in sec["layout"]["tensors"].values()
        for c in t["chunks"]
    )

    def dcp_load() -> None:
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        dcp.load(state, storage_reader=dcp.FileSystemReader(f"{work}/dcp_{saved}_1"))
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])

    dcp_load()  # warm-up, as above
    t_dcp = _median([_timed(dcp_load) for _ in range(repeat)])
    ranks = _gather({"read": read, "share": share, "peak_rss_growth": max(0, peak), "chunk": chunk})
    if rank == 0:
        Path(out).write_text(
            json.dumps({"saved_on": saved, "restored_on": world, "rl_ckpt_s": t_rl, "dcp_s": t_dcp, "per_rank": ranks})
        )
    engine.close()
    dist.destroy_process_group()


def math_prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def run(workdir: str, ranks: list[int], size: int, repeat: int = 3) -> dict:
    """Every save on N ranks and restore on M ranks for N, M in ``ranks``; returns the figures."""
    import torch.multiprocessing as mp

    work = tempfile.mkdtemp(prefix="sharded-bench-", dir=workdir)
    saves, restores = [], []
    try:
        for n in ranks:
            out = f"{work}/save_{n}.json"
            mp.spawn(save_job, args=(n, _port(), size, work, out, repeat), nprocs=n)
            saves.append(json.loads(Path(out).read_text()))
        for n in ranks:
            for m in ranks:
                out = f"{work}/restore_{n}_{m}.json"
                mp.spawn(restore_job, args=(m, _port(), size, work, n, out, repeat), nprocs=m)
                restores.append(json.loads(Path(out).read_text()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"mode": "sharded", "size_bytes": size, "saves": saves, "restores": restores}


def format_report(out: dict) -> str:
    mib = 1024 * 1024
    lines = [
        f"sharded bench: FSDP2 + Adam, {out['saves'][0]['state_bytes'] / mib:.1f} MiB of state, CPU/gloo, "
        "medians; rl_ckpt saves hash, fsync, verify after write and commit",
        "save              rl_ckpt     DCP    ratio (goal <= 1.0)",
    ]
    for s in out["saves"]:
        lines.append(
            f"  on {s['ranks']} ranks       {s['rl_ckpt_s']:7.3f}s {s['dcp_s']:7.3f}s  "
            f"{s['rl_ckpt_s'] / s['dcp_s']:.2f}x"
        )
    lines.append(
        "restore N -> M     rl_ckpt     DCP    ratio   max read/share (goal <= 1.25)   max peak RSS growth / "
        "(shard + 2 chunks) (goal <= 1.0)"
    )
    for r in out["restores"]:
        read = max(p["read"] / p["share"] for p in r["per_rank"])
        mem = max(p["peak_rss_growth"] / (p["share"] + 2 * p["chunk"]) for p in r["per_rank"])
        lines.append(
            f"  {r['saved_on']} -> {r['restored_on']}           {r['rl_ckpt_s']:7.3f}s {r['dcp_s']:7.3f}s  "
            f"{r['rl_ckpt_s'] / r['dcp_s']:.2f}x   {read:.3f}                           {mem:.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl_ckpt.tools.bench.sharded", description=__doc__.splitlines()[0])
    p.add_argument("url", help="local folder to write into")
    p.add_argument("--ranks", default="2,4", help="world sizes, e.g. 2,4 (default)")
    p.add_argument("--size", default="64MiB", help="model + Adam state size (default 64MiB)")
    p.add_argument("--repeat", type=int, default=3, help="repeats per measurement; medians are reported (default 3)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    return main_args(args)


def main_args(args) -> int:
    """Run for parsed ``args`` (``url``, ``ranks``, ``size``, ``json``); prints the figures."""
    from rl_ckpt.tools.bench.common import local_path, parse_size

    os.makedirs(local_path(args.url), exist_ok=True)
    out = run(
        local_path(args.url),
        [int(x) for x in str(args.ranks).split(",") if x],
        parse_size(args.size),
        max(1, int(getattr(args, "repeat", 3))),
    )
    print(json.dumps(out, indent=1) if args.json else format_report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
