"""Ray Train v2 integration: ``CheckpointCallback`` turns worker failures into recovery decisions.

    trainer = TorchTrainer(
        train_fn,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(failure_config=FailureConfig(max_failures=2),
                             callbacks=[CheckpointCallback(run_name="ppo")]),
    )

The callback runs in Ray Train's controller. ``after_report`` forwards the
metrics workers report (so keep-best and the coordinator see them);
``after_exception`` turns the workers' exceptions into a ``FailureInfo`` and
records it with the run's ``CheckpointManager``. When Ray Train restarts the
workers (``FailureConfig(max_failures=...)``), the train function calls
``engine.restore()``: the manager hands every rank the same plan, chosen by
the ``RecoveryCoordinator`` from that failure.

``report(metrics, engine)`` is a drop-in for ``ray.train.report`` that also
attaches a small checkpoint *pointer* (snapshot id + URL, a few hundred
bytes) so Ray's own checkpoint list points at our snapshots without copying
a single shard.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import weakref
from typing import Any, Dict, List, Optional

import ray
from ray.train import UserCallback

from rl_ckpt._recovery.coordinator import FailureInfo
from rl_ckpt.errors import ParticipantFailedError

log = logging.getLogger("rl_ckpt")


def _causes(exc: BaseException):
    """``exc`` and what it wraps: Ray Train's health-check and user-code wrappers, task errors, __cause__."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        for attr in ("health_check_failure", "_base_exc", "cause", "__cause__"):
            inner = getattr(e, attr, None)
            if isinstance(inner, BaseException):
                todo.append(inner)


def dead_processes(worker_exceptions: Dict[int, BaseException]) -> List[dict]:
    """The processes Ray reports dead in these exceptions: ``{"actor_id", "pid"}`` each (either may be None).

    A rank's own death arrives as a health-check failure wrapping ``ActorDiedError``;
    a rollout worker's death arrives inside the exception of the rank that called it.
    Either way the dead process is named by its actor id and pid, which the manager
    maps to the participant that ran there.
    """
    from ray.exceptions import RayActorError

    out: List[dict] = []
    for exc in worker_exceptions.values():
        for e in _causes(exc):
            if isinstance(e, RayActorError):
                entry = {"actor_id": e.actor_id, "pid": dead_pid(e)}
            elif isinstance(e, ParticipantFailedError):
                entry = {"actor_id": getattr(e, "actor_id", None), "pid": getattr(e, "pid", None)}
            else:
                continue
            if entry not in out and (entry["actor_id"] or entry["pid"]):
                out.append(entry)
    return out


def dead_pid(error: BaseException) -> int | None:
    """The pid of the dead actor process a Ray ``RayActorError`` names in its message, if it does."""
    found = re.search(r"\bpid: (\d+)", getattr(error, "error_msg", "") or str(error))
    return int(found.group(1)) if found else None


def _own_death(exc: BaseException) -> bool:
    """True when the exception says this rank's own process died (not a call it made to another actor)."""
    from ray.exceptions import RayActorError

    inner = getattr(exc, "health_check_failure", None)
    return isinstance(exc, RayActorError) or isinstance(inner, RayActorError)


def failure_from_exceptions(worker_exceptions: Dict[int, BaseException], step: int | None = None) -> FailureInfo:
    """Classify worker exceptions (rank -> exception) as one FailureInfo.

    A ``ParticipantFailedError`` raised by a rank says it all (participant, step, kind).
    Otherwise the participant named is the rank whose own process died when there is
    one (the others only saw their collective fail), else the lowest rank that raised;
    the manager narrows it further to a dead actor it knows (see ``dead_processes``).
    """
    for r, e in sorted(worker_exceptions.items()):
        told = next((c for c in _causes(e) if isinstance(c, ParticipantFailedError)), None)
        if told is not None:  # the rank said which participant failed and at which step
            return FailureInfo(
                kind=getattr(told, "kind", "exception"),
                step=getattr(told, "step", step),
                message=str(told)[:2000],
                participant=getattr(told, "participant", f"learner-{r}"),
            )
    died = sorted(r for r, e in worker_exceptions.items() if _own_death(e))
    rank = died[0] if died else min(worker_exceptions)
    exc = worker_exceptions[rank]
    ordered = [worker_exceptions[rank]] + [e for r, e in sorted(worker_exceptions.items()) if r != rank]
    texts = [f"{type(e).__name__}: {e}" for e in ordered]
    blob = " ".join(texts)
    names = " ".join(type(c).__name__ for e in ordered for c in _causes(e))
    if "OutOfMemory" in names or "OutOfMemoryError" in blob:
        kind = "oom"
    elif (
        any(n in names for n in ("ActorDiedError", "WorkerCrashedError", "ActorUnavailableError", "NodeDiedError"))
        or "SIGKILL" in blob
        or "died unexpectedly" in blob
        or "exited unexpectedly" in blob
    ):
        kind = "process_killed"
    elif "NonFiniteLoss" in names or "nan" in blob.lower().split() or "non-finite" in blob.lower():
        kind = "nan_loss"
    else:
        kind = "exception"
    first_bad = getattr(exc, "first_nonfinite_step", None)
    return FailureInfo(
        kind=kind,
        step=getattr(exc, "step", step),
        message="; ".join(t[:500] for t in texts),
        participant=f"learner-{rank}",
        first_nonfinite_step=first_bad,
    )


class CheckpointCallback(UserCallback):
    """Ray Train v2 callback connecting a run's failures and metrics to its CheckpointManager."""

    def __init__(self, run_name: str, namespace: str = "rl_ckpt") -> None:
        self.run_name = run_name
        self.namespace = namespace
        self._manager = None
        self.recorded: List[dict] = []

    @property
    def manager(self):
        if self._manager is None:
            self._manager = ray.get_actor(f"rl_ckpt:{self.run_name}", namespace=self.namespace)
        return self._manager

    def after_report(self, run_context: Any, metrics: List[Dict[str, Any]], checkpoint: Optional[Any]) -> None:
        if not metrics:
            return
        head = {k: v for k, v in metrics[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        step = head.get("step", head.get("global_step"))
        clean = {k: (v if math.isfinite(v) else repr(float(v))) for k, v in head.items()}
        self.manager.record_metrics.remote(clean, step=int(step) if step is not None else None)

    def after_exception(self, run_context: Any, worker_exceptions: Dict[int, Exception]) -> None:
        failure = failure_from_exceptions(worker_exceptions)
        dead = dead_processes(worker_exceptions)
        stored = ray.get(self.manager.record_failure.remote(failure.to_json(), dead), timeout=60)
        self.recorded.append(stored)
        log.warning(
            "rl_ckpt: recorded %s failure of %s at step %s (ranks that raised: %s)",
            stored["kind"],
            stored.get("participant"),
            stored.get("step"),
            sorted(worker_exceptions),
        )


# The snapshot each engine last pointed Ray at; per engine, so two runs in one process never hide each other's.
_last_pointer: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def report(metrics: Dict[str, Any], engine=None, snapshot=None) -> None:
    """``ray.train.report`` plus a checkpoint pointer to the newest committed snapshot (no shard is copied).

    A pointer is attached only when the snapshot is new for this engine (each
    engine remembers the last one it pointed at).
    """
    from ray.train import Checkpoint

    info = snapshot
    if info is None and engine is not None:
        newest = engine.catalog.snapshots()
        info = newest[-1] if newest else None
    if info is None or (engine is not None and _last_pointer.get(engine) == info.snapshot_id):
        ray.train.report(metrics)
        return
    if engine is not None:
        _last_pointer[engine] = info.snapshot_id
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "rl_ckpt_pointer.json"), "w") as f:
            json.dump(
                {
                    "snapshot_id": info.snapshot_id,
                    "global_step": info.global_step,
                    "run_url": engine.storage.url if engine is not None else None,
                },
                f,
            )
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))
