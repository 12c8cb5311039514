"""rl_ckpt: verified, atomic snapshots of the whole RL training state.

Public API (the README shows it in use)::

    from rl_ckpt import CheckpointEngine, CheckpointConfig, Checkpointable, RNGState, CheckpointError
"""

from .catalog import SnapshotInfo
from .components import Checkpointable, RNGState, TrainingProgress
from .config import CheckpointConfig
from .engine import CheckpointEngine, RestoreResult
from .errors import (
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
)
from .reader import VerifyReport

__version__ = "0.1.0"

__all__ = [
    "CheckpointEngine", "CheckpointConfig", "Checkpointable", "RNGState", "TrainingProgress", "SnapshotInfo",
    "RestoreResult", "VerifyReport", "CheckpointError", "CommitConflictError", "ConfigError", "CorruptSnapshotError",
    "NoValidSnapshotError", "RestoreError", "SchemaVersionError", "SerializationError", "StateMismatchError",
    "StorageError", "UnsafePathError", "PostCommitError",
]
