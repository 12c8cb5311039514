"""The chaos drill (``rl-ckpt demo --chaos``): many faults in one run, each recovered by the smallest rung of the
recovery ladder that stays exact, then one verdict.

Faults come from a seeded plan (:func:`plan_faults`) over the run's steps, mostly rollout workers:

- ``rollout``: a rollout worker SIGKILLed in the middle of its collect (an env step as the moment) or inside its
  save (its part of a snapshot never written): recovered alone (*scoped*);
- ``chunk``: a byte flipped in a rollout worker's file of its newest memory snapshot, that worker SIGKILLed the
  step after: its rejoin meets the damaged copy, skips it and takes an older one (*scoped, fallback*);
- ``learner``: a learner rank SIGKILLed: Ray Train restarts the group, every participant restores one snapshot,
  memory tier first (*group restart*);
- ``manager``: the run's ``CheckpointManager`` killed (Ray restarts it; it resumes pending commits from storage);
- ``memory_store``: the node's memory store of the run killed (its memory snapshots are gone; the next ones build
  a new store, and a restore meanwhile comes from durable storage).

The run's event log says when each fault struck and how it was recovered; :func:`chaos_table` turns that into one
row per fault (the rung taken, learner steps undone, rollout work redone, seconds from the fault to the next
training step) and :func:`chaos_report` adds the verdict: final weights bitwise equal to an uninterrupted run's,
every auditor 0 skipped / 0 duplicated.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable

from rl_ckpt.demo.faults import fires, log_event

KINDS = ("rollout", "chunk", "learner", "manager", "memory_store")
WEIGHTS = {"rollout": 10, "chunk": 2, "learner": 3, "manager": 2, "memory_store": 2}


def plan_faults(
    *,
    seed: int,
    steps: int,
    count: int,
    learners: int,
    workers: int,
    env_steps: int = 0,
    moments: list | None = None,
    memory_interval: int = 2,
    save_moment: bool = True,
    chunk_kill: bool = True,
    kinds: tuple = KINDS,
    unit: str = "env step",
    first: int = 3,
) -> list[dict]:
    """``count`` faults at distinct, seeded random steps in ``[first, steps - 2]``, each of ``kinds`` at least once
    when ``count`` allows, the rest drawn by ``WEIGHTS`` (mostly rollout workers). A rollout worker strikes at one of
    ``moments`` (default: an env step below ``env_steps``), or in its save at a memory snapshot's step
    (``save_moment``). With ``chunk_kill`` a ``chunk`` fault takes two steps: the damage, then the kill of the worker
    whose file was damaged (without: the damage alone, met by whoever reads it next). ``unit`` names a numbered
    moment in the table (``env step``, ``token``)."""
    rng = random.Random(seed)
    moments = list(moments) if moments is not None else list(range(env_steps))
    weights = {k: w for k, w in WEIGHTS.items() if k in kinds}
    kinds = list(kinds[: min(count, len(kinds))])
    while len(kinds) < count:
        kinds.append(rng.choices(list(weights), weights=list(weights.values()))[0])
    rng.shuffle(kinds)
    free = list(range(first, steps - 1))
    if len(free) < 2 * count:
        raise ValueError(f"{count} faults do not fit in {steps} steps (at least {2 * count + first + 1} needed)")
    faults: list[dict] = []
    for kind in kinds:
        step = rng.choice([s for s in free if s + 1 in free or kind != "chunk"])
        free = [s for s in free if abs(s - step) > 1]  # one fault per step, and a step between them
        worker = f"rollout-{rng.randrange(workers)}"
        if kind == "rollout":
            at_save = save_moment and step % memory_interval == 0 and rng.random() < 0.3
            moment = "save" if at_save else rng.choice(moments)
            at = f"{unit} {moment}" if isinstance(moment, int) else moment
            faults.append({"kind": kind, "target": worker, "step": step, "moment": moment, "at": at})
        elif kind == "chunk":
            faults.append({"kind": kind, "target": "chunk", "step": step, "victim": worker})
            if chunk_kill:
                kill = {"kind": "rollout", "target": worker, "step": step + 1, "moment": moments[0], "at": "start"}
                faults.append({**kill, "after_chunk": True})
        elif kind == "learner":
            faults.append({"kind": kind, "target": f"learner-{rng.randrange(learners)}", "step": step})
        else:
            faults.append({"kind": kind, "target": kind, "step": step})
    faults.sort(key=lambda f: (f["step"], f["kind"] == "rollout"))
    return [{"id": i, **f} for i, f in enumerate(faults)]


def strike(
    faults: list[dict] | None,
    log: str,
    step: int,
    *,
    manager: Any = None,
    memory: Any = None,
    damage: Callable[[dict], str | None] | None = None,
) -> None:
    """The faults that are not a participant's own death, due after ``step`` (learner rank 0 calls this once the
    step's snapshots are handed out): ``manager`` killed (Ray restarts it), the stores of ``memory`` (a run's
    ``raymem://`` storage) killed, ``damage(fault)`` (a byte flipped somewhere a recovery or a pull will read)."""
    import ray

    fault = fires(faults, "manager", step)
    if fault is not None and manager is not None:
        log_event(log, {"event": "fault", "step": step, "target": "manager", "fault": fault})
        ray.kill(manager, no_restart=False)  # Ray restarts it; it finds the run again on storage
    fault = fires(faults, "memory_store", step)
    if fault is not None and memory is not None:
        stores = memory.stores()
        log_event(
            log, {"event": "fault", "step": step, "target": "memory_store", "fault": fault, "stores": len(stores)}
        )
        for handle in stores.values():
            ray.kill(handle, no_restart=True)  # a store is never restarted: its memory snapshots are gone
    fault = fires(faults, "chunk", step)
    if fault is not None and damage is not None:
        log_event(log, {"event": "fault", "step": step, "target": "chunk", "fault": fault, "damaged": damage(fault)})


def damage_newest(storage: Any, participant: str) -> str | None:
    """Flip one byte of ``participant``'s largest file in the newest memory snapshot holding it (the store's copy,
    same size: only its checksum can tell); returns the path damaged (None: no snapshot holds it)."""
    import ray

    from rl_ckpt._run.catalog import Catalog
    from rl_ckpt._run.snapshot_files import read_manifest
    from rl_ckpt._storage import join

    catalog = Catalog(storage)
    catalog.refresh()
    for info in reversed(catalog.snapshots("full")):
        manifest = read_manifest(storage, info.snapshot_id)
        mine = [e for e in manifest.files if f"{participant}/" in f"/{e.path}"]
        if not mine:
            continue
        entry = max(mine, key=lambda e: e.size)
        path = join(info.snapshot_id, entry.path)
        data = bytearray(storage.read(path))
        data[len(data) // 2] ^= 0xFF
        for handle in storage.stores().values():
            if path in ray.get(handle.inventory.remote(info.snapshot_id)):
                ray.get(handle.put.remote(path, bytes(data)))
        return path
    return None


def damage_version(run_name: str) -> str | None:
    """Flip one byte of the largest chunk of run ``run_name``'s newest policy version, in every store holding it
    (same size: only its checksum can tell); returns the path damaged (None: no version yet)."""
    import ray

    from actors.policy_versions import published, versions_storage
    from rl_ckpt._run.snapshot_files import read_manifest
    from rl_ckpt._sharded.weight_pull import component_pieces

    storage = versions_storage(run_name)
    versions = published(storage)
    if not versions:
        return None
    sid = versions[max(versions)]
    paths = [p for p in component_pieces(read_manifest(storage, sid), "policy").paths() if p.startswith("objects/")]
    if not paths:
        return None
    path = max(paths, key=lambda p: storage.stat(p).size)
    data = bytearray(storage.read(path))
    data[len(data) // 2] ^= 0xFF
    for handle in storage.stores().values():
        if path in ray.get(handle.inventory.remote("objects")):
            ray.get(handle.put.remote(path, bytes(data)))
    return path


def _after(log: list[dict], t: float, event: str) -> list[dict]:
    return [m for m in log if m["event"] == event and m["t"] > t]


def chaos_table(log: list[dict], faults: list[dict]) -> list[dict]:
    """One row per fault that struck: its kind, step, target, the recovery rung taken, learner steps undone, rollout
    work redone (collects replayed or re-run) and seconds from the fault to the next training step."""
    rows = []
    struck = {m["fault"]["id"]: m for m in log if m["event"] in ("kill", "fault") and "fault" in m}
    attempts = [m for m in log if m["event"] == "attempt"]
    for fault in faults:
        hit = struck.get(fault["id"])
        if hit is None:
            rows.append({**_row(fault), "recovery": "did not strike", "undone": 0, "redone": 0, "seconds": math.nan})
            continue
        t = hit["t"]
        # The next training step done after the fault: the step it struck in (a participant killed mid-step), else
        # the one after (a fault between steps).
        first = hit["step"] if hit["event"] == "kill" and fault["kind"] == "rollout" else hit["step"] + 1
        nxt = [m for m in _after(log, t, "step") if m["step"] >= first]
        seconds = (nxt[0]["t"] - t) if nxt else math.nan
        recovery, undone, redone = "absorbed: training went on", 0, 0
        restart = next((a for a in attempts if a["t"] > t), None)
        scoped = next((r for r in _after(log, t, "scoped_recovery") if r["participant"] == fault["target"]), None)
        if fault["kind"] == "learner" or (
            restart is not None and (scoped is None or restart["t"] < scoped["t"]) and fault["kind"] == "rollout"
        ):
            if restart is not None:
                recovery = "group restart" + (" + fallback" if restart.get("skipped") else "")
                undone = max(0, hit["step"] - restart["step"])
                redone = undone
                after = [m for m in _after(log, restart["t"], "step")]
                seconds = (after[0]["t"] - t) if after else math.nan
        elif fault["kind"] == "rollout" and scoped is not None:
            recovery = f"scoped ({scoped['replacement']})" + (" + fallback" if scoped.get("skipped") else "")
            redone = len(scoped["replayed_steps"]) + 1
        elif fault["kind"] == "chunk":
            recovery = f"damaged {hit.get('damaged') or 'nothing (no memory snapshot yet)'}"
        elif fault["kind"] == "memory_store":
            recovery = "absorbed: memory snapshots rebuilt, restores from durable meanwhile"
        elif fault["kind"] == "manager":
            recovery = "absorbed: manager restarted, pending commits resumed"
        rows.append({**_row(fault), "recovery": recovery, "undone": undone, "redone": redone, "seconds": seconds})
    return rows


def _row(fault: dict) -> dict:
    moment = fault.get("at", fault.get("moment"))
    return {
        "id": fault["id"],
        "kind": fault["kind"],
        "step": fault["step"],
        "target": fault["target"],
        "moment": "" if moment is None else str(moment),
    }


def chaos_report(ref_digest: str, log: list[dict], faults: list[dict]) -> tuple[str, bool]:
    """The table of a run's event ``log``, then the verdict: bitwise equal to the uninterrupted run (``ref_digest``),
    every auditor 0/0, every fault struck."""
    rows = chaos_table(log, faults)
    lines = [
        f"  {'#':>2}  {'step':>4}  {'fault':<13} {'target':<10} {'moment':<12} {'recovery':<44} "
        f"{'undone':>6} {'redone':>6} {'to next step':>12}"
    ]
    for r in rows:
        lines.append(
            f"  {r['id']:>2}  {r['step']:>4}  {r['kind']:<13} {r['target']:<10} {r['moment']:<12} "
            f"{r['recovery'][:44]:<44} {r['undone']:>6} {r['redone']:>6} {r['seconds']:>10.2f} s"
        )
    audits = [m for m in log if m["event"] == "audit"]
    done = next((m for m in reversed(log) if m["event"] == "done"), None)
    exact = done is not None and done["digest"] == ref_digest
    audit_ok = bool(audits) and all(a["skipped"] == 0 and a["duplicated"] == 0 for a in audits)
    audit_ok = audit_ok and all(a["replayed"]["skipped"] == a["replayed"]["duplicated"] == 0 for a in audits)
    struck = all(r["recovery"] != "did not strike" for r in rows)
    scoped = sum(r["recovery"].startswith("scoped") for r in rows)
    groups = sum(r["recovery"].startswith("group") for r in rows)
    lines += [
        "",
        f"  faults: {len(rows)} ({scoped} recovered scoped, {groups} by a group restart, "
        f"{len(rows) - scoped - groups} absorbed); learner steps undone in all: {sum(r['undone'] for r in rows)}",
        f"  final weights bitwise equal to the uninterrupted run: {'YES' if exact else 'NO'}",
        "  auditor: "
        + (
            "; ".join(f"rank {a.get('rank', 0)}: {a['skipped']} skipped / {a['duplicated']} duplicated" for a in audits)
            or "none reported"
        ),
        f"  verdict: {'EXACT' if exact and audit_ok and struck else 'NOT EXACT'}",
    ]
    return "\n".join(lines), exact and audit_ok and struck
