"""The ``rl-ckpt`` commands: one ``cmd_<name>(args) -> exit code`` each, and what they share (opening the
run a URL names, the snapshot id argument, sizes and metrics as text). The parser and ``main`` are
``rl_ckpt.cli``."""

from __future__ import annotations

import json
import sys

from rl_ckpt.errors import CheckpointError, UsageError
from rl_ckpt._format.manifest import parse_snapshot_id
from rl_ckpt._run.layout import STAGING, manifest_path

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2  # see rl_ckpt.cli


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _storage(args):
    from rl_ckpt._storage import open_storage

    storage = open_storage(args.url, _storage_options(args))
    _check_is_run(storage, args.url)
    return storage


def _storage_options(args) -> dict:
    """The storage options of ``--config`` and ``--storage-option KEY=VALUE`` (JSON values where they parse)."""
    options = {}
    if args.config:
        from rl_ckpt.config import CheckpointConfig

        options.update(CheckpointConfig.from_yaml(args.config).storage_options)
    for item in args.storage_option or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--storage-option {item!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _check_is_run(storage, url: str) -> None:
    entries = storage.list("")
    if not entries or any(parse_snapshot_id(e.name) or e.name == STAGING for e in entries):
        return
    runs = []
    for e in entries:
        if e.is_dir and any(parse_snapshot_id(x.name) for x in storage.list(e.name)):
            runs.append(e.name)
    if runs:
        raise UsageError(f"{url} holds runs, not snapshots: {', '.join(sorted(runs))}. Pass {url.rstrip('/')}/<run>.")


def _snapshot_arg(storage, args) -> str:
    """The snapshot id given on the command line, if it names a committed snapshot (else UsageError)."""
    sid = args.snapshot_id
    if parse_snapshot_id(sid) is None:
        raise UsageError(
            f"{sid!r} is not a snapshot id (they look like step_000000500 or step_000000500.light); "
            f"`rl-ckpt ls {args.url}` lists them"
        )
    if not storage.exists(manifest_path(sid)):
        raise UsageError(f"no committed snapshot {sid!r} in {args.url}")
    return sid


def _catalog(storage):
    from rl_ckpt._run.catalog import Catalog

    cat = Catalog(storage)
    cat.refresh()
    return cat


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(
        total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr, disable=None, leave=False
    )


def _fmt_metrics(metrics: dict) -> str:
    parts = []
    for k, v in sorted(metrics.items()):
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)


def cmd_ls(args) -> int:
    from rl_ckpt._run.snapshot_files import read_manifest, verify_snapshot
    from rl_ckpt._storage import join

    storage = _storage(args)
    if args.tiers:
        return _ls_tiers(args, storage)
    cat = _catalog(storage)
    rows = []
    bad = 0
    for info in cat.snapshots():
        valid = "yes"
        try:
            manifest = read_manifest(storage, info.snapshot_id)
            if args.deep:
                problems = verify_snapshot(storage, info.snapshot_id).problems
                valid = f"NO: {problems[0].path}: {problems[0].problem}" if problems else "yes"
            for f in [] if args.deep else manifest.files:
                path = join(info.snapshot_id, f.path)
                if not storage.exists(path):
                    valid = f"NO: {f.path} missing"
                    break
                if storage.size(path) != f.size:
                    valid = f"NO: {f.path} size differs"
                    break
        except CheckpointError as exc:
            valid = f"NO: {exc}"
        if info.quarantined:
            valid = f"QUARANTINED: {info.quarantined}"
        bad += valid != "yes"
        rows.append(
            (
                info.snapshot_id,
                str(info.global_step),
                info.kind,
                _human(info.size_bytes),
                _fmt_metrics(info.metrics),
                valid,
            )
        )
    for u in cat.unreadable():
        bad += 1
        rows.append((u.snapshot_id, "?", "?", "?", "", f"NO: {u.reason}"))
    if args.deep:
        from rl_ckpt._run.catalog import foreign_names

        for name in foreign_names(storage):
            bad += 1
            rows.append(
                (
                    ascii(name),
                    "?",
                    "?",
                    "?",
                    "",
                    "FOREIGN: named like a snapshot but not one rl_ckpt writes; ignored by restore and gc",
                )
            )
    if args.json:
        print(json.dumps([dict(zip(("id", "step", "kind", "size", "metrics", "valid"), r)) for r in rows], indent=1))
    elif rows:
        header = ("ID", "STEP", "KIND", "SIZE", "METRICS", "VALID")
        widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(5)]
        for r in [header, *rows]:
            print("  ".join(str(c).ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5])
        if not args.deep:
            print("(VALID: manifest readable, every file present with its size; --deep or `rl-ckpt verify` re-hashes)")
    else:
        print(f"no snapshots in {args.url}")
    if not args.json:
        _print_fenced_off(cat)
    return EXIT_PROBLEM if bad else EXIT_OK


def _ls_tiers(args, storage) -> int:
    """``ls --tiers``: durable snapshots from storage, memory ones from the run's memory stores on the Ray
    cluster (when one is reachable), in one table."""
    from rl_ckpt._run.tiers import tier_view

    run_name = args.url.rstrip("/").rsplit("/", 1)[-1]
    memory = inventory = None
    try:
        import ray

        if not ray.is_initialized():
            ray.init(address="auto", logging_level="ERROR")
        from rl_ckpt.integrations.memory_tier import MEMORY_BASE
        from rl_ckpt._run.catalog import Catalog
        from rl_ckpt._storage import open_storage

        mem = open_storage(f"{MEMORY_BASE}/{run_name}", {"replicas": args.replicas})
        memory, inventory = Catalog(mem), mem.inventory()
    except (ImportError, ConnectionError, RuntimeError, CheckpointError) as exc:
        print(f"(memory tier not shown: no Ray cluster reachable: {exc})")
    from rl_ckpt._run.catalog import Catalog

    view = tier_view(memory, inventory, Catalog(storage), args.replicas)
    rows = [
        (
            s.snapshot_id,
            str(s.global_step),
            s.kind,
            ",".join(s.tiers) or "-",
            ("replicated" if s.replicated else f"{s.copies} cop{'y' if s.copies == 1 else 'ies'}")
            if s.memory_nodes
            else "",
            ("missing " + ", ".join(s.missing[:2])) if s.missing else "",
        )
        for s in view
    ]
    if args.json:
        print(json.dumps([s.to_json() for s in view], indent=1))
    elif rows:
        header = ("ID", "STEP", "KIND", "TIERS", "MEMORY COPIES", "")
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(5)]
        for r in [header, *rows]:
            print("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5])
    else:
        print(f"no snapshots in {args.url} or its memory tier")
    return EXIT_OK


def cmd_verify(args) -> int:
    from rl_ckpt._run.snapshot_files import read_manifest
    from rl_ckpt._run.verify import verify_run

    storage = _storage(args)
    cat = _catalog(storage)
    ids = [_snapshot_arg(storage, args)] if args.snapshot_id else None
    total = 0
    for sid in ids if ids is not None else [i.snapshot_id for i in cat.snapshots()]:
        try:
            total += read_manifest(storage, sid).size_bytes
        except CheckpointError:
            pass
    with _progress(total, "verify") as bar:
        report = verify_run(cat, ids, progress=bar.update)
    print(report)
    if ids is None:
        _print_fenced_off(cat)
    return EXIT_OK if report.ok else EXIT_PROBLEM


def _print_fenced_off(cat) -> None:
    """Snapshots taken out of the run (retired, quarantined and moved), with when and why: notes, not failures."""
    from rl_ckpt._run.verify import fenced_off

    notes = fenced_off(cat)
    if notes:
        print("taken out of the run (notes, not failures):")
        for note in notes:
            print(f"  {note}")


def cmd_inspect(args) -> int:
    from rl_ckpt._run.snapshot_files import read_manifest

    storage = _storage(args)
    m = read_manifest(storage, _snapshot_arg(storage, args))
    if args.json:
        print(json.dumps(m.to_json(), indent=1, sort_keys=True))
        return EXIT_OK
    print(f"snapshot      {m.snapshot_id}")
    print(f"step          {m.global_step}")
    print(f"kind          {m.kind}" + (f" (base {m.base_snapshot_id})" if m.base_snapshot_id else ""))
    print(f"created_at    {m.created_at}")
    print(f"schema        on-disk v{m.schema_version}, state v{m.state_schema_version}")
    print(f"config_digest {m.config_digest}")
    print(f"size          {_human(m.size_bytes)} in {len(m.files)} files")
    print(f"metrics       {_fmt_metrics(m.metrics) or '-'}")
    if m.tags:
        print(f"tags          {json.dumps(m.tags, sort_keys=True)}")
    for name, section in sorted(m.components.items()):
        tensors = section.get("tensors", {})
        nbytes = sum(f.size for f in m.files_of(name))
        print(f"\ncomponent {name} ({section.get('kind', '?')}): {len(tensors)} tensors, {_human(nbytes)}")
        for key, t in list(tensors.items())[: args.max_tensors]:
            print(f"  {key:<48} {t['dtype']:<5} {t['shape']}")
        if len(tensors) > args.max_tensors:
            print(f"  ... {len(tensors) - args.max_tensors} more (--max-tensors)")
        for f in m.files_of(name):
            print(f"  file {f.path} {_human(f.size)} {f.algo}:{f.checksum[:16]}")
    return EXIT_OK


def cmd_plan(args) -> int:
    from rl_ckpt.config import CheckpointConfig
    from rl_ckpt._recovery.coordinator import FailureInfo
    from rl_ckpt._recovery.history import load_decisions
    from rl_ckpt._recovery.plan import build_plan, coordinator_config, probe_check

    storage = _storage(args)
    base, _, run = args.url.rstrip("/").rpartition("/")
    where = {"base_dir": base or ".", "run_name": run}  # the URL names the run, whatever the config says
    catalog = _catalog(storage)
    if args.config:
        config = CheckpointConfig.from_yaml(args.config).replace(**where)
    else:
        # No job config: plan as the job that wrote the run would, with the newest snapshot's state schema
        # version (the default, 1, would refuse every snapshot of a run saved with schema_version 3).
        usable = catalog.snapshots("full", usable=True)
        config = CheckpointConfig(
            **where,
            **(
                {"schema_version": usable[-1].manifest.state_schema_version}
                if usable and usable[-1].manifest is not None
                else {}
            ),
        )
    failure = None
    if args.failure:
        failure = FailureInfo(kind=args.failure, step=args.step, message="given on the command line")
    # No components: the plan loads what the target snapshot holds, and has no job config to compare.
    plan = build_plan(
        catalog,
        storage,
        schema_version=config.schema_version,
        components=None,
        coordinator=coordinator_config(config),
        history=load_decisions(storage),
        failure=failure,
        deep=not args.quick,
        probes=probe_check(config),
    )
    print(plan)
    return EXIT_OK if plan.action != "give_up" else EXIT_PROBLEM


def cmd_scrub(args) -> int:
    from rl_ckpt._run.patrol import scrub

    storage = _storage(args)
    rate = args.rate_mib * 2**20 if args.rate_mib else None
    report = scrub(storage, bytes_per_second=rate, min_free_bytes=int(args.min_free_gib * 2**30))
    print(report)
    return EXIT_OK if report.ok else EXIT_PROBLEM


def cmd_timeline(args) -> int:
    from rl_ckpt._timeline import load, plot

    storage = _storage(args)
    data = load(storage, metric=args.metric)
    if not data["snapshots"]:
        raise UsageError(f"no snapshots in {args.url} to draw")
    step_log = None
    if args.log:
        with open(args.log) as f:
            step_log = [json.loads(line) for line in f if line.strip()]
        step_log = [r for r in step_log if r.get("event", "step") == "step"]
    plot(data, args.output, step_log=step_log, title=f"rl_ckpt timeline: {args.url}")
    print(f"wrote {args.output}: {len(data['snapshots'])} snapshots, {len(data['failures'])} failure(s)")
    return EXIT_OK


def cmd_gc(args) -> int:
    from rl_ckpt._run.gc import find_debris, find_unreferenced_objects, remove_debris

    storage = _storage(args)
    debris = find_debris(storage, grace_seconds=args.grace)
    objects, refusal = find_unreferenced_objects(storage, grace_seconds=args.grace)
    if refusal:
        print(f"objects: {refusal}", file=sys.stderr)
    debris += objects
    if not args.dry_run:
        for key in storage.abort_incomplete_uploads(args.grace):
            print(f"aborted incomplete multipart upload {key}")
    for d in debris:
        print(f"{'would remove' if args.dry_run else 'removing'} {d.path}{'/' if d.is_dir else ''}  ({d.reason})")
    if not args.dry_run:
        remove_debris(storage, debris)
    print(f"{len(debris)} debris entr{'y' if len(debris) == 1 else 'ies'} {'found' if args.dry_run else 'removed'}")
    return EXIT_OK


def cmd_export(args) -> int:
    from rl_ckpt._export import export_component, export_hf
    from rl_ckpt._run.snapshot_files import read_manifest

    storage = _storage(args)
    manifest = read_manifest(storage, _snapshot_arg(storage, args))
    if args.component not in manifest.components:
        raise UsageError(
            f"{args.snapshot_id} has no component {args.component!r}; it has: {', '.join(sorted(manifest.components))}"
        )
    if args.format == "hf":
        out = export_hf(
            storage,
            manifest,
            args.component,
            args.output,
            max_shard_size=args.max_shard_size,
            strip_prefix=args.strip_prefix,
            storage_options=_storage_options(args),
        )
        print(
            f"wrote {out.path}: {out.tensors} tensors ({_human(out.total_size)}) in {len(out.files)} file"
            f"{'s' if len(out.files) != 1 else ''} + model.safetensors.index.json from "
            f"{args.snapshot_id}/{args.component}"
        )
        return EXIT_OK
    meta = export_component(
        storage,
        manifest,
        args.component,
        args.output,
        strip_prefix=args.strip_prefix,
        storage_options=_storage_options(args),
    )
    print(f"wrote {args.output}: {len(meta)} tensors from {args.snapshot_id}/{args.component}")
    return EXIT_OK


def cmd_bench(args) -> int:
    from rl_ckpt.tools.bench import main_args

    return main_args(args)
