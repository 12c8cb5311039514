"""The snapshot manifest (``meta.json``): plain dataclasses <-> JSON, strictly checked.

The manifest is written last and *is* the commit marker: a snapshot exists for
readers only through it. It lists every file with size and checksum, so a
reader trusts nothing that the manifest does not vouch for.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import re
from typing import Any

from .errors import CorruptSnapshotError, SchemaVersionError
from .storage.base import check_relpath

SCHEMA_VERSION = 1
MANIFEST_NAME = "meta.json"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
KINDS = ("full", "light")
_ID = re.compile(r"^step_(\d{9,})(?:\.b(\d+))?(\.light)?$")


def snapshot_id(step: int, kind: str = "full", branch: int = 0) -> str:
    """``step_000000500``, ``step_000000500.light``; ``.bN`` marks a later branch."""
    sid = f"step_{step:09d}"
    if branch:
        sid += f".b{branch}"
    return sid + (".light" if kind == "light" else "")


def parse_snapshot_id(name: str) -> tuple[int, int, str] | None:
    """``(step, branch, kind)`` of a snapshot folder name, or None if it is not one."""
    m = _ID.match(name)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2) or 0), "light" if m.group(3) else "full"


@dataclasses.dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the snapshot folder
    size: int
    checksum: str
    algo: str
    component: str
    role: str  # "tensors" | "json" | "table"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Any, where: str) -> "FileEntry":
        if not isinstance(d, dict):
            raise _corrupt(where, "a files entry is not an object")
        try:
            entry = cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})
        except KeyError as exc:
            raise _corrupt(where, f"a files entry lacks {exc.args[0]!r}") from None
        if not isinstance(entry.size, int) or entry.size < 0 or not isinstance(entry.checksum, str):
            raise _corrupt(where, f"bad size/checksum for {entry.path!r}")
        check_relpath(entry.path)  # UnsafePathError before anything is opened
        return entry


@dataclasses.dataclass
class Manifest:
    snapshot_id: str
    global_step: int
    kind: str = "full"
    created_at: str = ""
    base_snapshot_id: str | None = None
    config_digest: str = ""
    config: dict = dataclasses.field(default_factory=dict)
    state_schema_version: int = 1
    metrics: dict = dataclasses.field(default_factory=dict)
    tags: dict = dataclasses.field(default_factory=dict)
    files: list[FileEntry] = dataclasses.field(default_factory=list)
    components: dict = dataclasses.field(default_factory=dict)  # name -> {"tensors": {key: {dtype, shape}}, ...}
    writer: dict = dataclasses.field(default_factory=dict)
    extra: dict = dataclasses.field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    @property
    def size_bytes(self) -> int:
        """Logical size: every file plus the dedup objects its tensors reference."""
        objects = sum(size for sec in self.components.values() if isinstance(sec, dict)
                      for chunks in (sec.get("objects") or {}).values() for _d, size in chunks)
        return sum(f.size for f in self.files) + objects

    def files_of(self, component: str) -> list[FileEntry]:
        return [f for f in self.files if f.component == component]

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["files"] = [f.to_json() for f in self.files]
        return d

    def to_bytes(self) -> bytes:
        """JSON with ``manifest_checksum``: a checksum of its own canonical form, so a flipped bit
        anywhere in the manifest (a key, a step, a size) is caught, not silently misread."""
        d = self.to_json()
        d["manifest_checksum"] = _self_checksum(d)
        return json.dumps(d, indent=1, sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "Manifest":
        if len(data) > MAX_MANIFEST_BYTES:
            raise _corrupt(where, f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
        try:
            d = json.loads(bytes(data))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise _corrupt(where, f"manifest is not valid JSON ({exc})") from None
        if isinstance(d, dict) and "manifest_checksum" in d:
            recorded = d.pop("manifest_checksum")
            try:
                ok = recorded == _self_checksum(d)
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise _corrupt(where, "manifest checksum mismatch: meta.json changed after it was written")
        return cls.from_json(d, where)

    @classmethod
    def from_json(cls, d: Any, where: str) -> "Manifest":
        if not isinstance(d, dict):
            raise _corrupt(where, "manifest is not a JSON object")
        version = d.get("schema_version")
        if not isinstance(version, int):
            raise _corrupt(where, "manifest has no integer schema_version")
        if version != SCHEMA_VERSION:
            newer = "newer" if version > SCHEMA_VERSION else "older"
            raise SchemaVersionError(
                f"{where}: written with on-disk schema_version {version} ({newer}); this rl_ckpt reads "
                f"version {SCHEMA_VERSION}. Use the rl_ckpt release that wrote it; refusing to load.",
                snapshot_id=where, found=version, supported=SCHEMA_VERSION,
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            # Within one schema version the top-level keys are fixed (new facts go under "extra"): an unknown
            # key is a corrupted one, e.g. a flipped bit in "manifest_checksum" that would skip the self-check.
            raise _corrupt(where, f"manifest has unknown top-level key(s) {unknown}; it is corrupt")
        try:
            kwargs = {k: d[k] for k in known if k in d}
            kwargs["files"] = [FileEntry.from_json(f, where) for f in d.get("files", [])]
            m = cls(**kwargs)
        except TypeError as exc:
            raise _corrupt(where, f"manifest fields malformed ({exc})") from None
        if not isinstance(m.global_step, int) or m.global_step < 0:
            raise _corrupt(where, "global_step must be a non-negative integer")
        if m.kind not in KINDS:
            raise _corrupt(where, f"kind must be one of {KINDS}")
        if not isinstance(m.components, dict) or not isinstance(m.metrics, dict):
            raise _corrupt(where, "components/metrics must be objects")
        paths = [f.path for f in m.files]
        if len(set(paths)) != len(paths):
            raise _corrupt(where, "a file is listed twice")
        return m


def _self_checksum(d: dict) -> str:
    from .checksum import digest_bytes

    canon = json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return "xxh3_128:" + digest_bytes("xxh3_128", canon)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


def _corrupt(where: str, reason: str) -> CorruptSnapshotError:
    return CorruptSnapshotError(f"{where}: {reason}", snapshot_id=where, problems=[reason])
