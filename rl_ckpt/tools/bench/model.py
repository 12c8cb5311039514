"""``--model``: a real transformers model (random init) instead of the synthetic state."""

from __future__ import annotations

import json
import os
import statistics
import time

from rl_ckpt.tools.bench.baselines import time_raw_floor, torch_save
from rl_ckpt.tools.bench.common import CacheDropper, Samples, human, log, rmtree
from rl_ckpt.tools.bench.compare import bench_engine, clear_run, paired_ratio
from rl_ckpt.tools.bench.report import fmt_num
from rl_ckpt.tools.bench.state import byte_views, flat_tensors, nbytes, size_mix, state_dict_of


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
    state = {
        "bytes": total,
        "tensors": len(tensors),
        "param_bytes": nbytes(model.state_dict().values()),
        "mix": size_mix(tensors),
        "model": args.model,
        "parameters": params,
    }
    log(
        f"bench: {params / 1e6:.0f}M parameters, state {human(total)} in {len(tensors)} tensors; "
        f"{args.repeat} repeat(s)"
    )
    sm = Samples()
    step = iter(range(1, 10**9))
    engines = {}
    for key, kw in (("rl", {}), ("rl_noprobe", {"post_load_check": False})):
        e = bench_engine(workdir, key, **kw)
        e.register("model", model)
        e.register("optimizer", opt)
        engines[key] = e
    d = lambda *p: os.path.join(workdir, *p)  # noqa: E731
    probe_bytes: list[int] = []
    breakdown: dict[str, list[float]] = {}

    def g_floor(r: int) -> None:
        path = d(f"raw-{r}.bin")
        time_raw_floor(sm, cache, path, views)

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
        for phase, seconds in res.timings.items():
            breakdown.setdefault(phase, []).append(seconds)
        clear_run(e)

    def g_noprobe(r: int) -> None:
        e = engines["rl_noprobe"]
        sm.timed("rl_save_noprobe", lambda: e.save(next(step)))
        clear_run(e)

    groups = [g_floor, g_torch, g_rl, g_noprobe]
    started = time.perf_counter()
    for r in range(args.repeat):
        for g in groups[r % len(groups) :] + groups[: r % len(groups)]:
            log(f"bench: repeat {r + 1}/{args.repeat}: {g.__name__[2:]} ...")
            g(r)
    for e in engines.values():
        e.close()
    m = sm.median
    ratios = {
        "save_vs_torch_save": m("rl_save") / m("torch_save"),
        "restore_vs_torch_load": m("rl_restore") / m("torch_load"),
        "save_vs_raw_write": m("rl_save") / m("raw_write"),
        "restore_vs_raw_read": m("rl_restore") / m("raw_read"),
        "noprobe_vs_torch_save": m("rl_save_noprobe") / m("torch_save"),
    }
    paired = {
        "restore_vs_torch_load": paired_ratio(sm, "rl_restore", "torch_load"),
        "restore_vs_raw_read": paired_ratio(sm, "rl_restore", "raw_read"),
    }
    goals = [
        {
            "name": "save_vs_torch_save",
            "value": ratios["save_vs_torch_save"],
            "limit": 1.0,
            "text": "rl save (probe on) <= 1.0 x torch.save+fsync",
        },
        {
            "name": "restore_vs_torch_load",
            "value": paired["restore_vs_torch_load"],
            "limit": 1.0,
            "text": "rl restore (probe on) <= 1.0 x torch.load + load_state_dict (paired by repeat)",
        },
    ]
    for g in goals:
        g["met"] = g["value"] <= g["limit"]
    return {
        "state": state,
        "results": {k: sm.result(k, total) for k in MODEL_KEYS},
        "ratios": ratios,
        "paired": paired,
        "restore_breakdown": {k: statistics.median(v) for k, v in breakdown.items()},
        "goals": goals,
        "probe_record_bytes": max(probe_bytes) if probe_bytes else None,
        "load": sm.load_summary(),
        "elapsed_s": time.perf_counter() - started,
    }


def format_model(out: dict) -> str:
    res, st = out["results"], out["state"]
    lines = [
        f"rl-ckpt bench --model {st['model']} {out['url']}: {st['parameters'] / 1e6:.0f}M parameters + AdamW, "
        f"{human(st['bytes'])} in {st['tensors']} tensors; medians of {out['repeat']} interleaved repeat(s)",
        f"cache: {out['cache']['note']}",
        f"noise: other processes used {fmt_num(out['load']['other_cores_mean'], '{:.2f}')} cores on average "
        f"(max {fmt_num(out['load']['other_cores_max'], '{:.2f}')})",
        "",
        f"{'method':<44} {'seconds':>8} {'GB/s':>7}",
    ]
    labels = {
        "raw_write": "floor: raw write + fsync",
        "raw_read": "floor: raw read (cold)",
        "torch_save": "torch.save + fsync",
        "torch_load": "torch.load + load_state_dict (cold)",
        "rl_save": "rl_ckpt save (probe on)",
        "rl_restore": "rl_ckpt restore (plan, verify, load, probe; cold)",
        "rl_save_noprobe": "rl_ckpt save (post_load_check off)",
    }
    for key in MODEL_KEYS:
        r = res[key]
        spread = f"  [{min(r['samples_s']):.3f}..{max(r['samples_s']):.3f}]" if len(r["samples_s"]) > 1 else ""
        lines.append(f"{labels[key]:<44} {fmt_num(r['median_s']):>8} {fmt_num(r['gbps'], '{:.2f}'):>7}{spread}")
    parts = out.get("restore_breakdown") or {}
    order = ("plan", "read", "hash", "decode", "copy", "probe", "total")
    lines += [
        "",
        "restore paired with its floors (median over repeats of the ratio in each): "
        + ", ".join(f"{k.replace('_', ' ')} {v:.2f}x" for k, v in (out.get("paired") or {}).items() if v is not None),
        "breakdown of rl_ckpt's restore (medians, s): " + ", ".join(f"{k} {parts[k]:.3f}" for k in order if k in parts),
        f"probe record in the manifest: {out['probe_record_bytes']} bytes",
        "",
        "goals (medians of this run):",
    ]
    for g in out["goals"]:
        lines.append(f"  {'MET   ' if g['met'] else 'MISSED'} {g['text']}: {g['value']:.3f} (limit {g['limit']})")
    lines.append(f"{out['goals_met']}/{out['goals_total']} goals met")
    return "\n".join(lines)
