"""Scenario 3: bit flips, truncation and deletion of every kind of file, and a bit-flip sweep over the manifest."""

from __future__ import annotations

import os
from functools import partial
import random

from rl_ckpt.errors import CheckpointError
from rl_ckpt.tools.fault_suite.common import Mixed, VARIANTS, build, observed, variant_name
from rl_ckpt.tools.fault_suite.context import Suite
from rl_ckpt.tools.fault_suite.report import ScenarioResult


SWEEP_OUTCOMES = (
    "caught by verify",
    "caught by restore only",
    "restore refused, no fallback",
    "unnoticed, load unaffected",
    "corrupt load",
)


# -- helpers for the scenarios ---------------------------------------------------------------------


def corruption(suite: Suite) -> ScenarioResult:
    """Flip bits in, truncate and delete every kind of file of a committed snapshot; sweep the manifest."""
    from rl_ckpt._run.dedup import manifest_objects, object_path
    from rl_ckpt._run.snapshot_files import read_manifest
    from rl_ckpt._storage import LocalStorage

    res = ScenarioResult("corruption", "bit flips, truncation, deletion in every kind of file of a snapshot")
    jobs = []
    for dedup, aw in VARIANTS:
        variant = variant_name(dedup, aw)
        kw = {"dedup": dedup, "atomic_write": aw}
        tpl = suite.template(variant, kw)
        store = LocalStorage(tpl)
        m1, m2 = read_manifest(store, "step_000000001"), read_manifest(store, "step_000000002")
        role_kind = {"tensors": "safetensors shard", "json": "JSON", "table": "Arrow table"}
        files = [(f"step_000000002/{f.path}", role_kind.get(f.role, f.role)) for f in m2.files]
        files.append(("step_000000002/meta.json", "manifest"))
        shared = manifest_objects(m1)
        for digest, (algo, _size) in sorted(manifest_objects(m2).items()):
            files.append((object_path(algo, digest), "dedup object (shared)" if digest in shared else "dedup object"))
        corruptions = [f"flip {w}" for w in suite.profile.flips] + [f"truncate {w}" for w in suite.profile.truncations]
        corruptions.append("delete")
        for i, (rel, kind) in enumerate(files):
            for j, how in enumerate(corruptions):
                jobs.append(
                    partial(
                        _corrupt_one,
                        suite,
                        variant=variant,
                        kw=kw,
                        tpl=tpl,
                        rel=rel,
                        kind=kind,
                        how=how,
                        aw=aw,
                        seed=i * 100 + j,
                    )
                )
        suite.progress(f"  corruption {variant}: {len(files)} files x {len(corruptions)}")
    suite.run_jobs(res, jobs)
    kinds = sorted({k.split(": ")[0] for k in res.notes if k.endswith(": injected")})
    for kind in kinds:
        res.notes[f"{kind} detected"] = f"{res.notes.pop(kind + ': detected', 0)}/{res.notes.pop(kind + ': injected')}"
    _manifest_sweep(suite, res)
    return res


def _corrupt_one(
    suite: Suite,
    part: ScenarioResult,
    variant: str,
    kw: dict,
    tpl: str,
    rel: str,
    kind: str,
    how: str,
    aw: bool,
    seed: int,
) -> None:
    target = suite.case(f"corrupt-{variant}-{kind}-{how}", kw, tpl)
    before = target.outside()
    corrupt_file(os.path.join(target.run, *rel.split("/")), how, random.Random(seed))
    part.tried += 1
    part.injected[how.split()[0]] += 1
    label = f"{how} {rel} ({kind})"
    by_design = kind == "manifest" and how == "delete" and not aw
    expect = None if kind == "dedup object (shared)" else 1
    outcome = _judge_corruption(suite, part, variant, label, target, expect, by_design)
    if by_design:
        part.note("manifest deleted on manifest-last: reads as never committed (by design)")
    else:
        part.corruptions_injected += 1
        part.note(f"{kind}: injected")
        if outcome == "detected":
            part.corruptions_detected += 1
            part.note(f"{kind}: detected")
        elif outcome != "corrupt load":
            part.violate(variant, label, "undetected", outcome)
    hit = {"step_000000001", "step_000000002"} if kind == "dedup object (shared)" else {"step_000000002"}
    ok, _ = suite.check(
        part,
        variant,
        label,
        target,
        must_list=set(),
        allowed={1, 2, 3},
        acked_max=None,
        in_flight=None,
        save_after=3,
        outside_before=before,
        damaged=frozenset(hit),
    )
    suite.done(target, ok and outcome == "detected")


def _judge_corruption(
    suite: Suite, res: ScenarioResult, variant: str, label: str, target, expect: int | None, by_design: bool
) -> str:
    """'detected' when verify flags step 2 and restore neither loads it nor gives up needlessly."""
    engine, model, buf = build(target.cfg, target.storage())
    report = engine.verify()
    flagged = "step_000000002" in report.bad_snapshots
    try:
        result = engine.restore()
    except CheckpointError as exc:
        engine.close()
        if expect is None:
            return "detected" if flagged else "restore refused, verify silent"
        return f"restore gave up although step {expect} is intact: {exc}"
    engine.close()
    try:
        step, _ = observed(model, buf)
    except Mixed as exc:
        res.violate(variant, label, "corrupt_load", str(exc))
        return "corrupt load"
    if result.global_step != step:
        res.violate(variant, label, "corrupt_load", f"restore says step {result.global_step}, state is step {step}")
        return "corrupt load"
    if step == 2:
        return "undetected: restore loaded the damaged snapshot" + ("" if flagged else "; verify silent")
    if by_design:
        return "detected"
    if not flagged:
        return "verify silent (restore fell back)"
    if expect is not None and step != expect:
        return f"restore fell back to step {step}, expected {expect}"
    if "step_000000002" not in result.skipped:
        return "restore fell back without saying why"
    return "detected"


def _manifest_sweep(suite: Suite, res: ScenarioResult) -> None:
    """Flip the lowest bit of manifest bytes (digit -> digit, letter -> letter: the flips that still parse).

    The manifest has no checksum of its own, so this measures what a flip in it does: caught by
    verify, caught by restore only, unnoticed and harmless, or a corrupt load (a violation).
    """
    jobs = []
    for dedup, aw in suite.profile.manifest_sweep_variants:
        variant = variant_name(dedup, aw)
        kw = {"dedup": dedup, "atomic_write": aw}
        tpl = suite.template(variant, kw)
        with open(os.path.join(tpl, "step_000000002", "meta.json"), "rb") as f:
            original = f.read()
        positions = list(range(len(original)))
        if suite.profile.manifest_flips is not None:
            chosen = set(random.Random(11).sample(positions, min(suite.profile.manifest_flips, len(positions))))
            for key in MANIFEST_KEY_FIELDS:  # always: every byte of the values that say what a snapshot is
                chosen.update(json_value_span(original, key))
            positions = sorted(chosen)
        jobs += [
            lambda part, variant=variant, kw=kw, tpl=tpl, original=original, pos=pos: _flip_manifest(
                suite, part, variant, kw, tpl, original, pos
            )
            for pos in positions
        ]
    sweep = ScenarioResult(res.key, res.title)
    suite.run_jobs(sweep, jobs)
    notes = sweep.notes
    sweep.notes = {}
    res.merge(sweep)
    res.notes["manifest bit flips"] = sum(notes.get(f"sweep: {k}", 0) for k in SWEEP_OUTCOMES)
    for key in SWEEP_OUTCOMES:
        res.notes[f"manifest flips {key}"] = notes.get(f"sweep: {key}", 0)
    missed = {k.split(": ", 1)[1]: v for k, v in notes.items() if k.startswith("verify missed: ")}
    if missed:
        res.notes["manifest flips verify missed, by field"] = dict(sorted(missed.items(), key=lambda kv: -kv[1]))
    suite.progress(f"  corruption: manifest sweep, {res.notes['manifest bit flips']} flips")


def _flip_manifest(
    suite: Suite, part: ScenarioResult, variant: str, kw: dict, tpl: str, original: bytes, pos: int
) -> None:
    target = suite.case(f"manifest-flip-{variant}-{pos}", kw, tpl)
    data = bytearray(original)
    data[pos] ^= 0x01
    with open(os.path.join(target.run, "step_000000002", "meta.json"), "wb") as f:
        f.write(data)
    part.tried += 1
    part.injected["manifest bit flip"] += 1
    field = manifest_field(original, pos)
    label = f"manifest bit flip at byte {pos} ({field}: {original[pos : pos + 1]!r} -> {bytes(data[pos : pos + 1])!r})"
    outcome = _judge_corruption(suite, part, variant, label, target, expect=1, by_design=False)
    if outcome == "corrupt load":
        part.note("sweep: corrupt load")
    elif outcome == "detected":
        part.note("sweep: caught by verify")
    elif outcome.startswith("verify silent"):
        part.note("sweep: caught by restore only")
        part.note(f"verify missed: {field}")
    elif outcome.startswith("undetected: restore loaded"):
        part.note("sweep: unnoticed, load unaffected")
        part.note(f"verify missed: {field}")
    elif outcome.startswith("restore gave up"):  # safe (nothing loaded), but no fallback to the intact step
        part.note("sweep: restore refused, no fallback")
        part.note(f"verify missed: {field}")
    else:
        part.violate(variant, label, "undetected", outcome)
    suite.done(target, part.ok)


def corrupt_file(path: str, how: str, rnd: random.Random) -> None:
    if how == "delete":
        os.unlink(path)
        return
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if how.startswith("flip"):
        where = how.split()[1]
        pos = {"first": 0, "middle": len(data) // 2, "last": len(data) - 1}.get(where)
        if pos is None:
            pos = rnd.randrange(len(data))
        data[pos] ^= 0x10
    else:
        where = how.split()[1]
        data = {"tail": data[: max(0, len(data) - 7)], "half": data[: len(data) // 2], "empty": bytearray()}[where]
    with open(path, "wb") as f:
        f.write(data)


MANIFEST_KEY_FIELDS = (
    "global_step",
    "kind",
    "snapshot_id",
    "schema_version",
    "state_schema_version",
    "base_snapshot_id",
)


def json_value_span(manifest: bytes, key: str) -> range:
    """Byte positions of the value of top-level ``key`` in an indent=1 manifest (empty if absent)."""
    marker = b'\n "' + key.encode() + b'": '
    i = manifest.find(marker)
    if i < 0:
        return range(0)
    start = i + len(marker)
    end = manifest.find(b"\n", start)
    end = len(manifest) if end < 0 else end
    if manifest[end - 1 : end] == b",":
        end -= 1
    return range(start, end)


def manifest_field(manifest: bytes, pos: int) -> str:
    """The top-level manifest key whose line holds byte ``pos`` (the manifest is indent=1 JSON)."""
    start = manifest.rfind(b"\n", 0, pos) + 1
    for line_start in _line_starts_backwards(manifest, start):
        line = manifest[
            line_start : manifest.find(b"\n", line_start) if manifest.find(b"\n", line_start) != -1 else None
        ]
        if line.startswith(b' "'):
            return line[2 : line.find(b'"', 2)].decode(errors="replace")
    return "(structure)"


def _line_starts_backwards(data: bytes, start: int):
    pos = start
    while pos >= 0:
        yield pos
        if pos == 0:
            return
        pos = data.rfind(b"\n", 0, pos - 1) + 1
