"""rl_ckpt: verified, atomic snapshots of the whole RL training state.

Public API (the README shows it in use)::

    from rl_ckpt import CheckpointEngine, CheckpointConfig, Checkpointable, RNGState, CheckpointError
"""

from rl_ckpt.run.catalog import SnapshotInfo
from rl_ckpt.components import Checkpointable, RNGState, TrainingProgress
from rl_ckpt.config import CheckpointConfig
from rl_ckpt.core.engine import CheckpointEngine, RestoreResult
from rl_ckpt.errors import (
    CheckpointError,
    CommitConflictError,
    ConfigError,
    CorruptSnapshotError,
    NoValidSnapshotError,
    PostCommitError,
    RestoreError,
    SchemaVersionError,
    SerializationError,
    StateMismatchError,
    StorageError,
    UnsafePathError,
    VersionNotFoundError,
)
from rl_ckpt.run.snapshot_files import VerifyReport

__version__ = "0.1.0"

__all__ = [
    "CheckpointEngine", "CheckpointConfig", "Checkpointable", "RNGState", "TrainingProgress", "SnapshotInfo",
    "RestoreResult", "VerifyReport", "CheckpointError", "CommitConflictError", "ConfigError", "CorruptSnapshotError",
    "NoValidSnapshotError", "RestoreError", "SchemaVersionError", "SerializationError", "StateMismatchError",
    "StorageError", "UnsafePathError", "PostCommitError", "VersionNotFoundError",
]
