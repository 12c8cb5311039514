"""One error tree for the whole project, rooted at :class:`CheckpointError`.

Every error carries the facts a person needs (which key, file, step, snapshot)
as attributes and says what to do in its message. Errors survive pickling
across Ray actors: ``__reduce__`` rebuilds them from the message and fields.
"""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """Root of every error rl_ckpt raises."""

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = dict(fields)
        for key, value in fields.items():
            setattr(self, key, value)

    def __reduce__(self):  # keep fields when crossing a Ray actor boundary
        return (_rebuild, (type(self), self.message, self.fields))

    def __str__(self) -> str:
        return self.message

    def reworded(self, message: str, **fields: Any) -> "CheckpointError":
        """The same class of error with a new message and these fields added (the facts kept)."""
        return _rebuild(type(self), message, {**self.fields, **fields})


def _rebuild(cls: type, message: str, fields: dict) -> CheckpointError:
    err = cls.__new__(cls)
    CheckpointError.__init__(err, message, **fields)
    return err


class ConfigError(CheckpointError, ValueError):
    """A config key is unknown or has a bad value (``key``, ``allowed``)."""


class SerializationError(CheckpointError, TypeError):
    """A state value fits neither tensors, tables nor JSON (``component``, ``key``)."""


class StorageError(CheckpointError, OSError):
    """An I/O operation on the checkpoint storage failed (``path``)."""


class CommitConflictError(StorageError):
    """Another writer already committed this snapshot (``snapshot_id``)."""


class UnsafePathError(CheckpointError):
    """A manifest names a path outside its snapshot, absolute, or a link (``path``)."""


class CorruptSnapshotError(CheckpointError):
    """A snapshot's files do not match its manifest (``snapshot_id``, ``problems``)."""


class SchemaVersionError(CheckpointError):
    """A snapshot was written with a schema this version cannot read (``snapshot_id``)."""


class StateMismatchError(CheckpointError):
    """Saved state does not fit the registered objects (``component``, ``mismatches``)."""


class NoValidSnapshotError(CheckpointError):
    """No snapshot could be restored (``reasons``: snapshot id -> why it was skipped)."""


class RestoreError(CheckpointError):
    """Loading a verified snapshot into the registered objects failed (``snapshot_id``)."""


class StoragePermissionError(StorageError):
    """The storage refused access to a path (``path``, ``errno``): permissions, ownership or credentials."""


class FileTooLargeError(StorageError):
    """A file is larger than the caller's cap, found before anything was read (``path``, ``size``, ``max_bytes``)."""


class ReadRangeError(StorageError):
    """A ranged read asked for bytes past the end of a file (``path``, ``start``, ``length``, ``size``)."""


class StorageArgumentError(CheckpointError, ValueError):
    """A storage call got an argument it cannot honour, e.g. a negative offset (``name``, ``value``)."""


class PostCommitError(CheckpointError):
    """Housekeeping after a commit failed (best alias, retention): the snapshot itself is committed.

    Never raised by a save; carried on the returned ``SnapshotInfo.warnings`` and handed
    to the scheduler's ``on_error`` (``snapshot_id``, ``problems``)."""


class SnapshotAbortedError(CheckpointError):
    """The manager aborted a sharded snapshot for every participant (``snapshot_id``, ``participant``, ``reason``)."""


class SnapshotSkippedError(SnapshotAbortedError):
    """The participants of a snapshot decided to skip it (a participant's previous save was still running)."""


class ManagerUnavailableError(CheckpointError):
    """The run's ``CheckpointManager`` actor is dead or does not answer (``manager``)."""


class UnknownParticipantError(CheckpointError):
    """A begin/report/abort call named a participant the manager has no registration for (``participant``)."""


class ParticipantFailedError(CheckpointError):
    """Raise it from the train function when a participant this rank drives (e.g. a rollout worker
    actor) failed: ``participant`` is its name, ``step`` the last step it completed, ``kind`` a
    FailureInfo kind, optionally ``actor_id``/``pid`` of the dead process. The callback records
    exactly that, whatever restarted since."""


class UsageError(CheckpointError):
    """Bad command-line usage (exit 2)."""


class MemoryBudgetError(StorageError):
    """A memory store cannot hold a file within its budget (``path``, ``size``, ``budget``, ``node``)."""


def post_commit_text(exc: BaseException) -> str:
    """An error's text as seen after the commit point: a storage hint that nothing was committed is untrue here."""
    return str(exc).replace("; nothing was committed by this save", "")


class DataPositionError(StateMismatchError, ValueError):
    """A saved data position does not fit the data given at restore, or cannot be saved exactly
    (``component``, ``field``, ``saved``, ``given``)."""


class VersionNotFoundError(CheckpointError):
    """A policy version that is not (or no longer) published was asked for (``version``, ``newest``,
    ``available``)."""
