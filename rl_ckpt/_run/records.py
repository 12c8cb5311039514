"""A folder of small JSON records (decisions, failures, retention notes, aliases): add, list, read.

Records are written once and never changed, so adding one is a create-only
write: two writers can never replace each other's record, and a retried call
(Ray retries actor calls) that finds its own record already there is done.
Reading parses every file as untrusted input (``format/untrusted.py``): a
record that is not valid JSON, not an object, or rejected by the caller's
parser is skipped with a warning, so one planted or damaged file never stops
a restore, a plan or a picture.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Callable, TypeVar

from rl_ckpt.errors import CheckpointError, CommitConflictError
from rl_ckpt._format.untrusted import read_json
from rl_ckpt._storage import Storage, join

log = logging.getLogger("rl_ckpt")
T = TypeVar("T")
SUFFIX = ".json"
MAX_SAME_NAME = 100  # records of one stem before add() gives up (the stems carry microsecond times)
# What a parser raises on a record of the wrong shape: a planted file, never a crash.
BAD_RECORD = (CheckpointError, ValueError, KeyError, TypeError, AttributeError, IndexError)


class RecordStore:
    """The records in ``folder`` of ``storage``, oldest name first."""

    def __init__(self, storage: Storage, folder: str, what: str = "record") -> None:
        self.storage = storage
        self.folder = folder
        self.what = what  # how log lines name a record: "decision record", "failure record"...

    def path(self, name: str) -> str:
        """The storage path of the record file ``name``."""
        return join(self.folder, name)

    def add(self, stem: str, body: dict) -> str:
        """Write ``body`` as ``<stem>.json`` (create-only); returns the path written.

        The same body already there (a retried call) is not written again; a
        different record under that name gets ``<stem>-2.json`` and so on.
        """
        data = json.dumps(body, allow_nan=False).encode()
        self.storage.makedirs(self.folder)
        for n in range(1, MAX_SAME_NAME + 1):
            path = self.path(f"{stem}{SUFFIX}" if n == 1 else f"{stem}-{n}{SUFFIX}")
            try:
                self.storage.write_atomic(path, data, create_only=True)
                return path
            except CommitConflictError:
                if self._holds(path, body):
                    return path
        raise CheckpointError(
            f"{self.folder}/: {MAX_SAME_NAME} records named {stem}* already exist; "
            "not writing another (remove old records by hand)",
            path=self.path(stem + SUFFIX),
        )

    def add_once(self, stem: str, body: dict, *, ending: str = "") -> str:
        """:meth:`add`, unless a record holding ``body`` is already there (a retried call whose name, chosen
        by the recorder's clock, differs): then that record's path. Only names ending in ``ending`` (plus an
        ``-<n>`` of :meth:`add`) are compared."""
        same = re.compile(re.escape(ending) + r"(-\d+)?" + re.escape(SUFFIX) + "$")
        for name in reversed(self.names()):  # newest first: a retry follows its first call closely
            if same.search(name) and self._holds(self.path(name), body):
                return self.path(name)
        return self.add(stem, body)

    def _holds(self, path: str, body: dict) -> bool:
        try:
            return read_json(self.storage, path) == json.loads(json.dumps(body, allow_nan=False))
        except CheckpointError:
            return False

    def names(self) -> list[str]:
        """File names of the records, sorted (dated stems sort by time)."""
        return sorted(e.name for e in self.storage.list(self.folder) if e.name.endswith(SUFFIX))

    def read(self, name: str) -> Any:
        """One record parsed as untrusted JSON; CheckpointError naming the file if it cannot be."""
        return read_json(self.storage, self.path(name))

    def load(self, parse: Callable[[dict], T] | None = None) -> list[T]:
        """Every readable record, oldest first: each a dict, or what ``parse`` makes of it.

        A record that cannot be read, is not a JSON object, or that ``parse``
        rejects (raising) is skipped with a warning naming its file.
        """
        out = []
        for name in self.names():
            try:
                record = self.read(name)
                if not isinstance(record, dict):
                    raise TypeError(f"a JSON {type(record).__name__}, not an object")
                out.append(parse(record) if parse is not None else record)
            except BAD_RECORD as exc:
                log.warning("ignoring unreadable %s %s: %s", self.what, self.path(name), exc)
        return out
