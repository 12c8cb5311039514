"""The ``policy_versions`` section of the durable manager's ``/healthz``: the run's versions and the faults
rollout workers reported (a chunk that failed its checksum, the version they fell back to).

The figures come from the run's version stores (``versions_status``), looked up on a thread: a health request
never waits for them longer than ``WAIT_SECONDS`` (it gets the last figures then). None: the run has no
version stores (it never published a version).
"""

from __future__ import annotations

import threading
import time

WAIT_SECONDS = 1.0
FRESH_SECONDS = 2.0

_SECTIONS: dict[str, tuple[float, dict | None]] = {}
_RUNNING: dict[str, threading.Thread] = {}
_LOCK = threading.Lock()


def lookup(run_name: str) -> dict | None:
    """The section now, waiting for the stores' answers (None: the run has no version stores)."""
    import ray

    from actors._memory.store import STORE_PREFIX
    from actors._versions.held import VERSIONS_BASE, versions_status, versions_storage

    prefix = f"{STORE_PREFIX}:{VERSIONS_BASE.split('://', 1)[1]}/{run_name}:"
    stores = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    return versions_status(versions_storage(run_name, namespace=stores[0]["namespace"])) if stores else None


def _look(run_name: str) -> None:
    try:
        section = lookup(run_name)
    except Exception as exc:  # a health request never fails because of the version stores
        section = {"status": "unreachable", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    with _LOCK:
        _SECTIONS[run_name] = (time.monotonic(), section)
        _RUNNING.pop(run_name, None)


def versions_section(run_name: str) -> dict | None:
    """The run's ``policy_versions`` health section (see the module docstring)."""
    import ray

    if not ray.is_initialized():
        return None
    with _LOCK:
        at, section = _SECTIONS.get(run_name, (0.0, None))
        if at and time.monotonic() - at < FRESH_SECONDS:
            return section
        thread = _RUNNING.get(run_name)
        if thread is None:
            thread = _RUNNING[run_name] = threading.Thread(
                target=_look, args=(run_name,), daemon=True, name="rl_ckpt-versions-health"
            )
            thread.start()
    thread.join(WAIT_SECONDS)
    with _LOCK:
        return _SECTIONS.get(run_name, (0.0, section))[1]


def health_sections(run_name: str) -> tuple[dict | None, dict | None]:
    """The ``memory_tier`` and ``policy_versions`` sections of the run's ``/healthz`` (each a bounded wait)."""
    from actors._memory.health import memory_tier_section

    return memory_tier_section(run_name), versions_section(run_name)
