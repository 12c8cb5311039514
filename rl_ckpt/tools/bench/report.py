"""The benchmark's output: the tables and the plot."""

from __future__ import annotations

from rl_ckpt.tools.bench.common import GIB, human


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
    ("load", "torch_load_apply", "torch.load + load_state_dict"),
    ("load", "st_load", "safetensors load_file"),
    ("load", "dcp_load", "DCP load (in place)"),
    ("load", "rl_restore", "rl_ckpt restore (checksums)"),
    ("block", "clone", "memory copy: clone (floor)"),
    ("block", "memcpy", "memory copy into existing tensors"),
    ("block", "dcp_async_block", "DCP async_save (blocking)"),
    ("block", "rl_async_block", "rl_ckpt save_async (blocking)"),
    ("block", "rl_async_stage", "  + optimizer step at once (hook)"),
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


def fmt_num(x: float | None, fmt: str = "{:.3f}") -> str:
    """``x`` formatted with ``fmt``, or "-" when it was not measured."""
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
        f"noise: other processes used {fmt_num(out['load']['other_cores_mean'], '{:.2f}')} cores on average "
        f"(max {fmt_num(out['load']['other_cores_max'], '{:.2f}')}) during the measurements; load average "
        f"{fmt_num(out['load']['loadavg_start'], '{:.2f}')} -> {fmt_num(out['load']['loadavg_end'], '{:.2f}')}",
    ]
    if out["host"].get("page_reporting"):
        lines.append(
            "note: this VM reports freed memory to its host (virtio_balloon free page reporting): "
            "the first touch of fresh memory (new buffers, page cache) is slow and erratic; "
            "reused buffers are not"
        )
    lines += [
        "",
        "time ratios: x floor / x torch / x safetensors / x DCP = this row's seconds / theirs (same op; < 1 is faster)",
    ]
    head = (
        f"{'op':<6} {'method':<32} {'seconds':>8} {'GB/s':>7} "
        f"{'x floor':>8} {'x torch':>8} {'x safet.':>8} {'x DCP':>7}"
    )
    lines += [head, "-" * len(head)]
    for op, key, label in LABELS:
        r = res.get(key)
        if not r or r["median_s"] is None:
            continue
        s = r["median_s"]
        cells = []
        for ref in (FLOOR.get(op), PEERS["torch"].get(op), PEERS["safetensors"].get(op), PEERS["DCP"].get(op)):
            other = res.get(ref, {}).get("median_s") if ref else None
            cells.append(fmt_num(s / other, "{:.2f}") if other and ref != key else "-")
        spread = ""
        if len(r["samples_s"]) > 1:
            spread = f"  [{min(r['samples_s']):.3f}..{max(r['samples_s']):.3f}]"
        lines.append(
            f"{op:<6} {label:<32} {s:>8.3f} {fmt_num(r['gbps'], '{:.2f}'):>7} {cells[0]:>8} {cells[1]:>8} "
            f"{cells[2]:>8} {cells[3]:>7}{spread}"
        )
    lines += restore_lines(out)
    if (out.get("fresh") or {}).get("error"):
        lines += ["", f"first restore in a new process (--fresh): not measured: {out['fresh']['error']}"]
    elif out.get("fresh"):
        from rl_ckpt.tools.bench.fresh import format_fresh

        lines += format_fresh(out["fresh"])
    dd = out["dedup"]
    lines += [
        "",
        f"dedup: changed {human(dd['changed_bytes'])} ({dd['changed_bytes'] / st['bytes']:.0%} of the state); "
        f"1st save added {human(dd['first_bytes_added'])}, 2nd save added {human(dd['second_bytes_added'])} "
        f"({fmt_num(dd['second_fraction'], '{:.0%}')} of the state) in {fmt_num(res['rl_dedup_second']['median_s'])} s "
        f"(x{fmt_num(out['ratios']['dedup_second_vs_first'], '{:.2f}')} the 1st save's time)",
        f"first save_async (allocates staging buffers, not in the medians): {out['first_async_block_s']:.3f} s blocked",
        "",
        "goals (medians of this run):",
    ]
    for g in out["goals"]:
        status = "n/a   " if g["met"] is None else ("MET   " if g["met"] else "MISSED")
        lines.append(f"  {status} {g['text']}: {fmt_num(g['value'], '{:.3f}')} (limit {g['limit']})")
    lines.append(f"{out['goals_met']}/{out['goals_total']} goals met")
    return "\n".join(lines)


def restore_lines(out: dict) -> list[str]:
    """The restore next to each floor, paired by repeat, and where its time went."""
    res, paired, parts = out["results"], out.get("paired") or {}, out.get("restore_breakdown") or {}
    rl = res["rl_restore"]["median_s"]
    lines = ["", "restore (cold cache) next to its floors; paired = median over repeats of the ratio in each repeat:"]
    for key, label, pair in (
        ("raw_read", "a raw read of the same bytes", "restore_vs_raw_read"),
        ("memcpy", "one memcpy of the state (into existing tensors)", None),
        ("torch_load", "torch.load", "restore_vs_torch_load"),
        ("torch_load_apply", "torch.load + load_state_dict (objects built, not timed)", "restore_vs_torch_load_apply"),
    ):
        other = res.get(key, {}).get("median_s")
        if not other or not rl:
            continue
        both = f"; paired {paired[pair]:.2f}x" if pair and paired.get(pair) is not None else ""
        lines.append(f"  {rl / other:>5.2f}x {label} ({other:.3f} s){both}")
    if parts:
        order = ("plan", "read", "hash", "decode", "copy", "probe")
        shown = ", ".join(f"{k} {parts[k]:.3f}" for k in order if k in parts)
        lines.append(f"  breakdown of rl_ckpt's restore (medians, s): {shown}; total {parts.get('total', rl):.3f}")
    return lines


def format_scaling(out: dict) -> str:
    sc = out["scaling"]
    lines = [
        f"rl-ckpt bench --scaling {out['url']}: medians of {out['repeat']} repeat(s); cache: {out['cache']['note']}",
        "",
        "state size (GB/s; ratios are time ratios):",
    ]
    head = (
        f"{'size':>10} {'tensors':>7} {'rawW GB/s':>9} {'save GB/s':>9} {'save/raw':>8} {'rawR GB/s':>9} "
        f"{'rest GB/s':>9} {'rest/raw':>8} {'clone s':>8} {'block s':>8} {'blk/clone':>9} {'save s/GiB':>10}"
    )
    lines += [head, "-" * len(head)]
    for row in sc["sizes"]:
        r = row["results"]
        per_gib = r["rl_save"]["median_s"] / (row["state_bytes"] / GIB)
        lines.append(
            f"{human(row['state_bytes']):>10} {row['tensors']:>7} "
            f"{fmt_num(r['raw_write']['gbps'], '{:.2f}'):>9} "
            f"{fmt_num(r['rl_save']['gbps'], '{:.2f}'):>9} {row['save_vs_raw']:>8.2f} "
            f"{fmt_num(r['raw_read']['gbps'], '{:.2f}'):>9} {fmt_num(r['rl_restore']['gbps'], '{:.2f}'):>9} "
            f"{row['restore_vs_raw']:>8.2f} {r['clone']['median_s']:>8.3f} "
            f"{r['rl_async_block']['median_s']:>8.3f} "
            f"{row['block_vs_clone']:>9.2f} {per_gib:>10.2f}"
        )
    lines += ["", "catalog operations over N tiny snapshots (seconds; per-snapshot cost in microseconds):"]
    head = (
        f"{'N':>6} {'create/s':>8} {'snapshots()':>11} {'us/snap':>8} {'refresh':>8} {'us/snap':>8} "
        f"{'plan(deep=F)':>12} {'us/snap':>8} {'retention':>9} {'us/snap':>8} {'open':>8} {'us/snap':>8} "
        f"{'cold plan':>9}"
    )
    lines += [head, "-" * len(head)]
    for row in sc["catalog"]:
        p = row["per_snapshot_us"]
        lines.append(
            f"{row['count']:>6} {fmt_num(row['create_per_s'], '{:.0f}'):>8} {row['snapshots_s']:>11.5f} "
            f"{p['snapshots']:>8.2f} {row['refresh_s']:>8.4f} {p['refresh']:>8.1f} "
            f"{row['plan_recovery_s']:>12.4f} "
            f"{p['plan_recovery']:>8.1f} {row['retention_s']:>9.5f} {p['retention']:>8.2f} "
            f"{row['open_s']:>8.4f} {p['open']:>8.1f} {fmt_num(row['plan_recovery_cold_s'], '{:.4f}'):>9}"
        )
    lines += [
        "create/s: saves per second while growing to N (engine.save, tiny state, verify_after_write=False, fsync on)",
        "snapshots(): the in-memory catalog; refresh: re-list storage, stat each manifest, parse only new or",
        "changed ones; plan(deep=F): plan_recovery (a refresh + checks of the chosen snapshot); retention: one",
        "policy pass; open: a new engine's first listing (parses every manifest: what a restarted process pays",
        "once); cold plan: a new engine's plan_recovery after the page cache was dropped",
    ]
    return "\n".join(lines)


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if out["mode"] == "scaling":
        sc = out["scaling"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5))
        xs = [row["state_bytes"] / GIB for row in sc["sizes"]]
        for key, label in (
            ("raw_write", "raw write+fsync"),
            ("rl_save", "rl_ckpt save"),
            ("raw_read", "raw read"),
            ("rl_restore", "rl_ckpt restore"),
        ):
            a1.plot(xs, [row["results"][key]["gbps"] for row in sc["sizes"]], marker="o", label=label)
        a1.set_xscale("log", base=2)
        a1.set_xlabel("state size (GiB)")
        a1.set_ylabel("GB/s")
        a1.set_title("throughput vs state size")
        a1.legend()
        ns = [row["count"] for row in sc["catalog"]]
        for key, label in (
            ("snapshots", "snapshots() (in memory)"),
            ("refresh", "catalog refresh"),
            ("plan_recovery", "plan_recovery(deep=False)"),
            ("retention", "plan_retention"),
        ):
            a2.plot(ns, [row["per_snapshot_us"][key] for row in sc["catalog"]], marker="o", label=label)
        a2.set_xscale("log")
        a2.set_yscale("log")
        a2.set_xlabel("snapshots in the run")
        a2.set_ylabel("microseconds per snapshot")
        a2.set_title("catalog cost per snapshot")
        a2.legend()
    else:
        res = out["results"]
        ops = [
            (
                "save (durable)",
                {
                    "floor": "raw_write",
                    "torch": "torch_save",
                    "safetensors": "st_save",
                    "DCP": "dcp_save",
                    "rl_ckpt": "rl_save",
                },
            ),
            (
                "load (cold cache)",
                {
                    "floor": "raw_read",
                    "torch": "torch_load",
                    "safetensors": "st_load",
                    "DCP": "dcp_load",
                    "rl_ckpt": "rl_restore",
                },
            ),
            ("async: caller blocked", {"floor": "clone", "DCP": "dcp_async_block", "rl_ckpt": "rl_async_block"}),
        ]
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
        ax.set_title(
            f"{human(st['bytes'])} model+Adam state, {st['tensors']} tensors; medians of {out['repeat']}; "
            f"cache: {out['cache']['method']}"
        )
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
