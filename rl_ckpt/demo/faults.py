"""Faults the demos inject into their own processes (where, when, once), and the event log they report to.

A fault is a small dict: ``{"id", "target", "step", "moment", "marker"}``: ``target`` names a participant
(``rollout-1``, ``learner-0``) or a piece of the run (``manager``, ``memory_store``, ``chunk``), ``step`` the
learner step it belongs to, ``moment`` where in that step (e.g. the env step of a rollout at which it strikes),
``marker`` a file created when it fires: a fault fires once per run, so a participant replaying that step (or a
restarted attempt running it again) goes on. :func:`fires` is the one check every injection point makes.
"""

from __future__ import annotations

import json
import os
import signal
import time


def fires(faults: list[dict] | None, target: str, step: int, moment: object = None) -> dict | None:
    """The fault of ``target`` at ``step`` (and ``moment``, when the fault names one) that has not fired yet; it is
    marked fired before it is returned (the marker is created exclusively: one process fires it, once)."""
    for fault in faults or ():
        if fault["target"] != target or fault["step"] != step:
            continue
        if fault.get("moment") is not None and moment is not None and fault["moment"] != moment:
            continue
        try:
            fd = os.open(fault["marker"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        os.close(fd)
        return fault
    return None


def fired(fault: dict) -> bool:
    """Whether ``fault`` has fired (its marker exists)."""
    return os.path.exists(fault["marker"])


def kill_self() -> None:
    """SIGKILL this process: no cleanup, no goodbye, as a lost node or an OOM kill."""
    os.kill(os.getpid(), signal.SIGKILL)


def log_event(path: str, msg: dict) -> None:
    """Append one JSON line (with a wall-clock time) to a run's event log: a single write, so processes logging
    at once (learner ranks, rollout workers) never interleave."""
    line = (json.dumps({**msg, "t": time.time()}) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
