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
import tempfile
from typing import Any, Dict, List, Optional

import ray
from ray.train import UserCallback

from ..coordinator import FailureInfo

log = logging.getLogger("rl_ckpt")


def failure_from_exceptions(worker_exceptions: Dict[int, BaseException], step: int | None = None) -> FailureInfo:
    """Classify worker exceptions (rank -> exception) as one FailureInfo."""
    rank, exc = min(worker_exceptions.items(), key=lambda kv: kv[0])
    texts = [f"{type(e).__name__}: {e}" for e in worker_exceptions.values()]
    blob = " ".join(texts)
    names = " ".join(type(e).__name__ for e in worker_exceptions.values())
    if "OutOfMemory" in names or "OutOfMemoryError" in blob:
        kind = "oom"
    elif any(n in names for n in ("ActorDiedError", "WorkerCrashedError", "ActorUnavailableError", "NodeDiedError")) \
            or "SIGKILL" in blob or "died unexpectedly" in blob or "exited unexpectedly" in blob:
        kind = "process_killed"
    elif "NonFiniteLoss" in names or "nan" in blob.lower().split() or "non-finite" in blob.lower():
        kind = "nan_loss"
    else:
        kind = "exception"
    first_bad = getattr(exc, "first_nonfinite_step", None)
    return FailureInfo(kind=kind, step=getattr(exc, "step", step), message="; ".join(t[:500] for t in texts),
                       participant=f"learner-{rank}", first_nonfinite_step=first_bad)


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
        stored = ray.get(self.manager.record_failure.remote(failure.to_json()), timeout=60)
        self.recorded.append(stored)
        log.warning("rl_ckpt: recorded %s failure of rank(s) %s at step %s", stored["kind"],
                    sorted(worker_exceptions), stored.get("step"))


_last_pointer: Optional[str] = None


def report(metrics: Dict[str, Any], engine=None, snapshot=None) -> None:
    """``ray.train.report`` plus a checkpoint pointer to the newest committed snapshot (no shard is copied)."""
    from ray.train import Checkpoint

    info = snapshot
    if info is None and engine is not None:
        newest = engine.catalog.snapshots()
        info = newest[-1] if newest else None
    global _last_pointer
    if info is None or info.snapshot_id == _last_pointer:  # a pointer only when there is a new snapshot
        ray.train.report(metrics)
        return
    _last_pointer = info.snapshot_id
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "rl_ckpt_pointer.json"), "w") as f:
            json.dump({"snapshot_id": info.snapshot_id, "global_step": info.global_step,
                       "run_url": engine.storage.url if engine is not None else None}, f)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))
