"""rl_ckpt: verified, atomic snapshots of the whole RL training state.

The public surface is this package and ``actors`` (the Ray actors)::

    from rl_ckpt import CheckpointEngine, CheckpointConfig, Checkpointable, RNGState, CheckpointError
    from rl_ckpt import MemoryTier, CheckpointCallback      # Ray; imported on first use
    from actors import CheckpointManager

Also public: ``rl_ckpt.config``, ``rl_ckpt.errors``, ``rl_ckpt.components``, ``rl_ckpt.data`` and the
integrations (``rl_ckpt.integrations.ray_train``, ``.rllib``, ``.samples``, ``.memory_tier``). A module whose
name, or whose package's, starts with an underscore (``rl_ckpt._core.engine``, ``actors._memory.store``) is
internal: it may change between versions.
"""

from __future__ import annotations

import importlib
from typing import Any

from rl_ckpt.components import Checkpointable, RNGState, TrainingProgress
from rl_ckpt.config import CheckpointConfig
from rl_ckpt._core.async_save import SaveHandle
from rl_ckpt._core.engine import CheckpointEngine, RestoreResult
from rl_ckpt._core.scheduler import CheckpointScheduler
from rl_ckpt.errors import (
    CheckpointError,
    CommitConflictError,
    ConfigError,
    CorruptSnapshotError,
    DataPositionError,
    FileTooLargeError,
    ManagerUnavailableError,
    MemoryBudgetError,
    NoValidSnapshotError,
    ParticipantFailedError,
    PostCommitError,
    ReadRangeError,
    RestoreError,
    SchemaVersionError,
    SerializationError,
    SnapshotAbortedError,
    SnapshotSkippedError,
    StateMismatchError,
    StorageArgumentError,
    StorageError,
    StoragePermissionError,
    UnknownParticipantError,
    UnsafePathError,
    UsageError,
    VersionNotFoundError,
)
from rl_ckpt.data import (
    AuditReport,
    ConsumptionAuditor,
    DataLoaderPosition,
    EpisodeStream,
    InflightRollouts,
    IterablePosition,
    PromptSampler,
)
from rl_ckpt._recovery.coordinator import Action, FailureInfo, FailureKind, RecoveryCoordinator
from rl_ckpt._recovery.plan import RecoveryPlan
from rl_ckpt._run.catalog import SnapshotInfo
from rl_ckpt._run.retention import AnyOf, KeepAll, KeepBest, KeepEveryNSteps, KeepLatest, RetentionPolicy
from rl_ckpt._run.snapshot_files import VerifyReport
from rl_ckpt._sharded.full_weights import load_full_weights

__version__ = "0.1.0"

# Names that need Ray: imported when first asked for, so `import rl_ckpt` never imports Ray.
_RAY_NAMES = {
    "MemoryTier": "rl_ckpt.integrations.memory_tier",
    "CheckpointCallback": "rl_ckpt.integrations.ray_train",
    "report": "rl_ckpt.integrations.ray_train",  # ray.train.report + this rank's newest snapshot
}


def __getattr__(name: str) -> Any:
    if name in _RAY_NAMES:
        value = getattr(importlib.import_module(_RAY_NAMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rl_ckpt' has no attribute {name!r}")


__all__ = [
    # the engine and what it returns
    "CheckpointEngine",
    "CheckpointConfig",
    "CheckpointScheduler",
    "SaveHandle",
    "SnapshotInfo",
    "RestoreResult",
    "VerifyReport",
    "RecoveryPlan",
    # components
    "Checkpointable",
    "RNGState",
    "TrainingProgress",
    "load_full_weights",
    # the data position and in-flight rollouts (exactly-once data)
    "PromptSampler",
    "DataLoaderPosition",
    "IterablePosition",
    "EpisodeStream",
    "InflightRollouts",
    "ConsumptionAuditor",
    "AuditReport",
    # policies and recovery
    "RetentionPolicy",
    "KeepLatest",
    "KeepBest",
    "KeepEveryNSteps",
    "KeepAll",
    "AnyOf",
    "RecoveryCoordinator",
    "FailureInfo",
    "FailureKind",
    "Action",
    # Ray (lazy)
    "MemoryTier",
    "CheckpointCallback",
    "report",
    # errors
    "CheckpointError",
    "CommitConflictError",
    "ConfigError",
    "CorruptSnapshotError",
    "DataPositionError",
    "FileTooLargeError",
    "ManagerUnavailableError",
    "MemoryBudgetError",
    "NoValidSnapshotError",
    "ParticipantFailedError",
    "PostCommitError",
    "ReadRangeError",
    "RestoreError",
    "SchemaVersionError",
    "SerializationError",
    "SnapshotAbortedError",
    "SnapshotSkippedError",
    "StateMismatchError",
    "StorageArgumentError",
    "StorageError",
    "StoragePermissionError",
    "UnknownParticipantError",
    "UnsafePathError",
    "UsageError",
    "VersionNotFoundError",
]
