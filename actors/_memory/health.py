"""The memory tier as the durable manager's ``/healthz`` and ``/metrics`` show it.

``memory_tier_section(run)`` looks up the run's ``MemoryTierService``
(the named actor ``rl_ckpt-memtier:<run>``) and turns its
``status()`` into a small JSON section:

- ``None``: the run has no memory tier service;
- ``{"reachable": false, "status": "unreachable", "error": ...}``: it exists but
  did not answer within ``ANSWER_SECONDS`` (dead, restarting, or stuck);
- otherwise the figures (``reachable``, ``status`` "ok" or "degraded",
  ``degraded_reason``, ``snapshots``, ``newest_snapshot``, ``newest_step``,
  ``bytes_per_node``, ``bytes_total``, ``replicas``, ``newest_replicated``,
  ``replication_lag_s``, ``flush_lag_s``, ``not_flushed``, ``newest_durable``,
  ``figures_age_s``, ``errors``).

The look-up runs on a thread of its own and the caller waits at most
``WAIT_SECONDS`` for it: a service that does not answer never holds a health
request longer than that (the last section is returned, marked unreachable).
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("rl_ckpt")

SERVICE_PREFIX = "rl_ckpt-memtier"
WAIT_SECONDS = 1.0  # how long a health request waits for a fresh section
ANSWER_SECONDS = 5.0  # how long the look-up waits for the service's answer
FRESH_SECONDS = 0.5  # a section younger than this is served as it is


def service_name(run_name: str) -> str:
    """The named actor of a run's ``MemoryTierService``."""
    return f"{SERVICE_PREFIX}:{run_name}"


def summarize(status: dict, now: float | None = None) -> dict:
    """The health section from a ``MemoryTierService.status()`` body."""
    tiers = [t for t in status.get("tiers", []) if "memory" in t.get("tiers", [])]
    newest = tiers[-1] if tiers else None
    durable = [t for t in status.get("tiers", []) if "durable" in t.get("tiers", [])]
    replicas = int(status.get("replicas", 0) or 0)
    per_node = {str(k): int(v) for k, v in status.get("bytes_per_node", {}).items()}
    lag = float(status.get("replication_lag_s", 0.0))
    reason = None
    if newest is not None and replicas > 0 and not newest.get("replicated"):
        reason = (
            f"newest memory snapshot {newest['snapshot_id']} is not yet held on {1 + replicas} nodes "
            f"(on {len(newest.get('memory_nodes', []))}; replication lag {lag:.1f} s): losing its node now "
            "falls back to an older snapshot"
        )
    updated = status.get("updated_at")
    return {
        "reachable": True,
        "status": "degraded" if reason else "ok",
        "degraded_reason": reason,
        "snapshots": len(tiers),
        "newest_snapshot": newest["snapshot_id"] if newest else None,
        "newest_step": newest["global_step"] if newest else None,
        "bytes_per_node": per_node,
        "bytes_total": sum(per_node.values()),
        "replicas": replicas,
        "newest_replicated": bool(newest and newest.get("replicated")),
        "replication_lag_s": lag,
        "flush_lag_s": float(status.get("flush_lag_s", 0.0)),
        "not_flushed": list(status.get("not_flushed", [])),
        "newest_durable": durable[-1]["snapshot_id"] if durable else None,
        "figures_age_s": (
            round(max(0.0, (now or time.time()) - updated), 3) if isinstance(updated, (int, float)) else None
        ),
        "errors": list(status.get("errors", []))[-3:],
    }


def unreachable(error: str) -> dict:
    """The section of a service that exists but gave no answer."""
    return {"reachable": False, "status": "unreachable", "degraded_reason": error, "error": error}


def find_service(run_name: str, namespace: str | None):
    """The run's service handle, or None; ``namespace`` None: in whichever Ray namespace holds one (a named
    actor's namespace is where its name lives, not the job's, so an actor cannot just ask for its own)."""
    import ray

    if namespace is None:
        found = sorted(
            a["namespace"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"] == service_name(run_name)
        )
        if not found:
            return None
        namespace = "rl_ckpt" if "rl_ckpt" in found else found[0]
    try:
        return ray.get_actor(service_name(run_name), namespace=namespace)
    except ValueError:
        return None  # no memory tier for this run


def fetch(run_name: str, namespace: str | None, timeout: float = ANSWER_SECONDS) -> dict | None:
    """Ask the run's service now (blocking up to ``timeout``); None when the run has none."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    handle = find_service(run_name, namespace)
    if handle is None:
        return None
    try:
        return summarize(ray.get(handle.status.remote(), timeout=timeout))
    except GetTimeoutError:
        return unreachable(f"the memory tier service {service_name(run_name)} gave no answer within {timeout:.0f} s")
    except RayError as exc:
        return unreachable(
            f"the memory tier service {service_name(run_name)} failed: {type(exc).__name__}: {str(exc)[:300]}"
        )


class MemoryTierWatch:
    """The latest memory section of one run, refreshed on a thread, never waited on past ``wait`` seconds."""

    def __init__(self, run_name: str, namespace: str | None, wait: float = WAIT_SECONDS) -> None:
        self.run_name, self.namespace, self.wait = run_name, namespace, wait
        self._lock = threading.Lock()
        self._section: dict | None = None
        self._at = 0.0  # monotonic time of the last finished look-up (0: none yet)
        self._running: threading.Thread | None = None

    def _refresh(self) -> None:
        try:
            section = fetch(self.run_name, self.namespace)
        except Exception as exc:  # a health request must never fail because of the memory tier
            section = unreachable(f"looking up the memory tier service failed: {type(exc).__name__}: {exc}")
        with self._lock:
            self._section, self._at, self._running = section, time.monotonic(), None

    def section(self) -> dict | None:
        """The section (None: no memory tier), at most ``wait`` seconds late."""
        with self._lock:
            if self._at and time.monotonic() - self._at < FRESH_SECONDS:
                return self._section
            thread = self._running
            if thread is None:
                thread = self._running = threading.Thread(target=self._refresh, name="rl_ckpt-memhealth", daemon=True)
                thread.start()
        first = not self._at  # nothing known yet: wait for the whole look-up (itself bounded)
        thread.join(ANSWER_SECONDS + 1.0 if first else self.wait)
        with self._lock:
            if not thread.is_alive():
                return self._section
            stale = self._section
        if stale is None:
            return unreachable(f"the memory tier service look-up for {self.run_name} gave no answer") if first else None
        return unreachable(
            f"the memory tier service {service_name(self.run_name)} gave no answer within "
            f"{self.wait:.1f} s (last figures: {stale.get('snapshots')} snapshots, newest "
            f"{stale.get('newest_snapshot')})"
        )


_WATCHES: dict[tuple[str, str | None], MemoryTierWatch] = {}
_WATCHES_LOCK = threading.Lock()


def memory_tier_section(run_name: str, namespace: str | None = None) -> dict | None:
    """The ``memory_tier`` section of ``/healthz`` for ``run_name`` (see the module docstring).

    ``namespace``: where the service's name lives (default: any namespace; ``rl_ckpt`` first)."""
    import ray

    if not ray.is_initialized():
        return None  # a manager built outside Ray (unit tests): no service to ask
    with _WATCHES_LOCK:
        watch = _WATCHES.get((run_name, namespace))
        if watch is None:
            watch = _WATCHES[(run_name, namespace)] = MemoryTierWatch(run_name, namespace)
    return watch.section()
