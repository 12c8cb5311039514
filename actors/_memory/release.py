"""Which runs hold memory on the cluster, and releasing a run's memory when it is over.

A run's memory tier is detached actors that outlive its trainers on purpose (a restart reads them): one
``MemoryStore`` per node for its memory snapshots (``raymem://mem/<run>``) and one per node for its policy
versions (``raymem://versions/<run>``), the memory manager and the ``MemoryTierService``. They hold hundreds of MB
per node until the cluster stops unless the run's end releases them: :func:`release_run` (``rl-ckpt memory drop``).

Releasing never loses a committed snapshot silently: first the service copies the newest memory snapshot that
durable storage lacks (``flush_now``), and a run whose memory holds snapshots durable storage lacks and that no
service can copy is refused unless forced; so is a run whose participants are still training (its durable
manager lists them as registered and not lost).
"""

from __future__ import annotations

import logging
from typing import Any

from rl_ckpt.errors import CheckpointError
from rl_ckpt._format.manifest import MANIFEST_NAME, parse_snapshot_id

from .directory import need_ray
from .store import STORE_PREFIX

log = logging.getLogger("rl_ckpt")

KINDS = {"mem": "memory snapshots", "versions": "policy versions"}
SERVICE_PREFIX = "rl_ckpt-memtier:"
MANAGER_NAMESPACE = "rl_ckpt-mem"  # the memory manager's (actors.memory_tier.memory_manager)


def _named(namespace: str) -> list[tuple[str, str]]:
    """(name, namespace) of every named actor of the cluster (alive ones)."""
    ray = need_ray()
    return [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)]


def _stores(namespace: str) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, run) -> {node id: store handle}: the memory stores of every run in ``namespace``."""
    ray = need_ray()
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for name, ns in _named(namespace):
        if ns != namespace or not name.startswith(STORE_PREFIX + ":"):
            continue
        _prefix, key, node = name.split(":", 2)
        kind, _, run = key.partition("/")
        if kind in KINDS and run:
            try:
                found.setdefault((kind, run), {})[node] = ray.get_actor(name, namespace=ns)
            except ValueError:  # gone since the listing
                continue
    return found


def memory_runs(namespace: str = "rl_ckpt", timeout: float = 60.0) -> list[dict]:
    """Every run holding memory on the cluster: its name, what it holds (memory snapshots, policy versions),
    the nodes, the bytes each holds, its committed snapshots, and whether its service and memory manager run."""
    ray = need_ray()
    named = set(_named(namespace))
    runs: dict[str, dict] = {}
    for (kind, run), handles in sorted(_stores(namespace).items()):
        entry = runs.setdefault(run, {"run": run, "holds": {}, "bytes": 0})
        infos = {}
        for node, handle in handles.items():
            try:
                infos[node] = ray.get(handle.info.remote(), timeout=timeout)
            except Exception as exc:  # a store dying now holds nothing any more
                log.warning("memory store of %s on node %s did not answer: %s", run, node[:12], exc)
        held = {node: int(i.get("bytes_held", 0)) for node, i in infos.items()}
        snapshots = sorted({s for i in infos.values() for s in i.get("snapshots", [])}, key=_order)
        entry["holds"][kind] = {"nodes": sorted(handles), "bytes_per_node": held, "snapshots": snapshots}
        entry["bytes"] += sum(held.values())
    for run, entry in runs.items():
        entry["service"] = (f"{SERVICE_PREFIX}{run}", namespace) in named
        entry["memory_manager"] = (f"rl_ckpt:{run}", MANAGER_NAMESPACE) in named
    return [runs[r] for r in sorted(runs)]


def _order(sid: str):
    return parse_snapshot_id(sid) or (0, 0, sid)


def _training(run: str, namespace: str, timeout: float) -> list[str]:
    """Participants of ``run`` its durable manager sees training now (registered, not lost, with a step)."""
    ray = need_ray()
    try:
        manager = ray.get_actor(f"rl_ckpt:{run}", namespace=namespace)
    except ValueError:
        return []
    try:
        participants = ray.get(manager.health.remote(), timeout=timeout).get("participants", {})
    except Exception as exc:  # a manager that does not answer cannot vouch that nobody trains
        raise CheckpointError(
            f"run {run!r}: its manager did not answer ({type(exc).__name__}: {exc}); is the run still training? "
            "Pass force=True (rl-ckpt memory drop --force) to release its memory anyway",
            run=run,
        ) from exc
    return sorted(n for n, p in participants.items() if not p.get("lost") and p.get("step") is not None)


def release_run(
    run_name: str, *, namespace: str = "rl_ckpt", flush: bool = True, force: bool = False, timeout: float = 600.0
) -> dict:
    """Free everything run ``run_name`` holds in the cluster's memory: its memory-snapshot stores and policy
    version stores on every node, its ``MemoryTierService`` and its memory manager. Durable storage is untouched.

    Args:
        flush: first have the service copy the newest memory snapshot durable storage lacks (and wait for it).
        force: release even while participants train, or when memory holds snapshots durable storage lacks and no
            service can copy them (they are lost).

    Returns: what was released: ``{"run", "flushed", "stores": {kind: {node: bytes}}, "actors": [...],
    "lost": [...]}`` (``lost``: memory snapshots released without a durable copy, with ``force``).

    Raises: CheckpointError naming the run and what to do: participants still training, or snapshots that would be
    lost (without ``force``), or a flush that failed.
    """
    ray = need_ray()
    if not force:
        training = _training(run_name, namespace, min(timeout, 60.0))
        if training:
            raise CheckpointError(
                f"run {run_name!r} is still training ({', '.join(training)} registered with its manager and "
                "beating): release its memory when the run is over, or pass force=True (--force)",
                run=run_name,
                participants=training,
            )
    report: dict = {"run": run_name, "flushed": None, "stores": {}, "actors": [], "lost": []}
    try:
        service = ray.get_actor(f"{SERVICE_PREFIX}{run_name}", namespace=namespace)
    except ValueError:
        service = None
    if service is not None:
        if flush:
            try:
                report["flushed"] = ray.get(service.flush_now.remote(), timeout=timeout)
                status = ray.get(service.tick.remote(), timeout=timeout)
            except Exception as exc:
                raise CheckpointError(
                    f"run {run_name!r}: the copy of its newest memory snapshot to durable storage failed "
                    f"({type(exc).__name__}: {exc}); nothing was released. Retry, or pass flush=False (--no-flush)",
                    run=run_name,
                ) from exc
            report["lost"] = list(status.get("not_flushed") or [])
        else:
            report["lost"] = list(ray.get(service.tick.remote(), timeout=timeout).get("not_flushed") or [])
    else:
        report["lost"], silent = _committed_in_memory(run_name, namespace, timeout)
        if silent and not force:  # what they hold is unknown: it may be the only copy of a snapshot
            raise CheckpointError(
                f"run {run_name!r}: the memory store(s) on node(s) {', '.join(silent)} did not say which snapshots "
                "they hold and no MemoryTierService runs to copy them; nothing was released. Retry, or pass "
                "force=True (--force)",
                run=run_name,
                nodes=sorted(silent),
            )
        report["lost"] += [f"(whatever the store on node {node} held: it did not answer)" for node in silent]
    if report["lost"] and not force:
        raise CheckpointError(
            f"run {run_name!r}: memory holds {len(report['lost'])} snapshot(s) durable storage lacks "
            f"({', '.join(report['lost'][-3:])}) and "
            + ("they were not copied" if service is not None else "no MemoryTierService runs to copy them")
            + "; nothing was released. Start the run's service (or flush) first, or pass force=True (--force)",
            run=run_name,
            snapshots=report["lost"],
        )
    if service is not None:
        try:
            ray.get(service.stop.remote(), timeout=60)
        except Exception as exc:  # it is killed next anyway
            log.warning("memory tier service of %s did not stop cleanly: %s", run_name, exc)
        ray.kill(service, no_restart=True)
        report["actors"].append(f"{SERVICE_PREFIX}{run_name}")
    try:
        ray.kill(ray.get_actor(f"rl_ckpt:{run_name}", namespace=MANAGER_NAMESPACE), no_restart=True)
        report["actors"].append(f"rl_ckpt:{run_name} (memory manager)")
    except ValueError:
        pass
    for (kind, run), handles in _stores(namespace).items():
        if run != run_name:
            continue
        freed = {}
        for node, handle in handles.items():
            try:
                freed[node] = int(ray.get(handle.info.remote(), timeout=60).get("bytes_held", 0))
            except Exception as exc:  # killed next anyway: only its figure is unknown
                log.warning("memory store of %s on node %s: no size (%s); released anyway", run_name, node, exc)
                freed[node] = 0
            ray.kill(handle, no_restart=True)
        report["stores"][kind] = freed
    log.info("released the memory of run %s: %s", run_name, report)
    return report


def _committed_in_memory(run: str, namespace: str, timeout: float) -> tuple[list[str], list[str]]:
    """Committed memory snapshots of ``run`` (its ``mem`` stores) when no service can say which durable lacks:
    all of them count as not copied. Also the nodes whose store did not answer (what they hold is unknown)."""
    ray = need_ray()
    out, silent = set(), []
    for (kind, r), handles in _stores(namespace).items():
        if kind != "mem" or r != run:
            continue
        for node, handle in handles.items():
            try:
                files = ray.get(handle.inventory.remote(""), timeout=timeout)
            except Exception as exc:
                log.warning("memory store of %s on node %s did not list what it holds: %s", run, node, exc)
                silent.append(node)
                continue
            out.update(p.split("/", 1)[0] for p in files if p.endswith("/" + MANIFEST_NAME))
    return sorted(out, key=_order), silent
