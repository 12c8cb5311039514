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
import importlib.util
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:  # what the names are, for type checkers and IDEs
    from rl_ckpt.components import Checkpointable, RNGState, TrainingProgress
    from rl_ckpt.config import CheckpointConfig
    from rl_ckpt._core.async_save import SaveHandle
    from rl_ckpt._core.engine import CheckpointEngine, RestoreResult
    from rl_ckpt._core.scheduler import CheckpointScheduler
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

# Everything but the errors is imported when first asked for: `import rl_ckpt` imports neither torch nor Ray,
# so a process that only reads manifests and storage (the CheckpointManager actor, a memory store, most CLI
# commands) starts in a fraction of a second instead of paying torch's import (seconds) for names it never uses.
_LAZY = {
    "Checkpointable": "rl_ckpt.components",
    "RNGState": "rl_ckpt.components",
    "TrainingProgress": "rl_ckpt.components",
    "CheckpointConfig": "rl_ckpt.config",
    "SaveHandle": "rl_ckpt._core.async_save",
    "CheckpointEngine": "rl_ckpt._core.engine",
    "RestoreResult": "rl_ckpt._core.engine",
    "CheckpointScheduler": "rl_ckpt._core.scheduler",
    "AuditReport": "rl_ckpt.data",
    "ConsumptionAuditor": "rl_ckpt.data",
    "DataLoaderPosition": "rl_ckpt.data",
    "EpisodeStream": "rl_ckpt.data",
    "InflightRollouts": "rl_ckpt.data",
    "IterablePosition": "rl_ckpt.data",
    "PromptSampler": "rl_ckpt.data",
    "Action": "rl_ckpt._recovery.coordinator",
    "FailureInfo": "rl_ckpt._recovery.coordinator",
    "FailureKind": "rl_ckpt._recovery.coordinator",
    "RecoveryCoordinator": "rl_ckpt._recovery.coordinator",
    "RecoveryPlan": "rl_ckpt._recovery.plan",
    "SnapshotInfo": "rl_ckpt._run.catalog",
    "AnyOf": "rl_ckpt._run.retention",
    "KeepAll": "rl_ckpt._run.retention",
    "KeepBest": "rl_ckpt._run.retention",
    "KeepEveryNSteps": "rl_ckpt._run.retention",
    "KeepLatest": "rl_ckpt._run.retention",
    "RetentionPolicy": "rl_ckpt._run.retention",
    "VerifyReport": "rl_ckpt._run.snapshot_files",
    "load_full_weights": "rl_ckpt._sharded.full_weights",
    # Ray: never imported by `import rl_ckpt`
    "MemoryTier": "rl_ckpt.integrations.memory_tier",
    "CheckpointCallback": "rl_ckpt.integrations.ray_train",
    "report": "rl_ckpt.integrations.ray_train",  # ray.train.report + this rank's newest snapshot
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif importlib.util.find_spec(f"rl_ckpt.{name}") is not None:  # a public module: rl_ckpt.config, ...
        value = importlib.import_module(f"rl_ckpt.{name}")
    else:
        raise AttributeError(f"module 'rl_ckpt' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


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
