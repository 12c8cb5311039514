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

from rl_ckpt.config import CHECKSUM_ALGOS
from rl_ckpt.errors import CorruptSnapshotError, SchemaVersionError
from rl_ckpt._storage.base import check_relpath
from rl_ckpt._format.dtypes import ITEMSIZE, check_shape
from rl_ckpt._format.untrusted import parse_json

SCHEMA_VERSION = 1
MANIFEST_NAME = "meta.json"
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
KINDS = ("full", "light")
_ID = re.compile(r"step_([0-9]{9,19})(?:\.b([1-9][0-9]{0,17}))?(\.light)?", re.ASCII)
INT64_MAX = 2**63 - 1  # steps, sizes and tensor dimensions beyond this are forged: nothing real is that large


def snapshot_id(step: int, kind: str = "full", branch: int = 0) -> str:
    """``step_000000500``, ``step_000000500.light``; ``.bN`` marks a later branch."""
    sid = f"step_{step:09d}"
    if branch:
        sid += f".b{branch}"
    return sid + (".light" if kind == "light" else "")


def parse_snapshot_id(name: str) -> tuple[int, int, str] | None:
    """``(step, branch, kind)`` of a snapshot folder name, or None if it is not one.

    Only the canonical names :func:`snapshot_id` produces are snapshots: ASCII digits, exactly the zero
    padding it writes, no ``.b0``, nothing after the name (not even a newline). Otherwise six folders
    (``step_000000020``, ``step_0000000020``, Arabic-Indic digits, ...) would all read as step 20.
    """
    m = _ID.fullmatch(name) if isinstance(name, str) else None
    if not m:
        return None
    step, branch, kind = int(m.group(1)), int(m.group(2) or 0), "light" if m.group(3) else "full"
    if step > INT64_MAX or snapshot_id(step, kind, branch) != name:
        return None
    return step, branch, kind


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
    def from_json(cls, d: Any, where: str, field: str = "files[]") -> "FileEntry":
        if not isinstance(d, dict):
            raise _wrong(where, field, "an object", d)
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in d]
        if missing:
            raise _corrupt(where, f"{field} lacks {missing[0]!r}")
        check_relpath(d["path"])  # UnsafePathError (a non-empty string, no escape) before anything is opened
        for name in ("checksum", "algo", "component", "role"):
            _need_str(where, f"{field}.{name}", d[name], empty=False)
        if d["algo"] not in CHECKSUM_ALGOS:
            raise _wrong(where, f"{field}.algo", f"one of {CHECKSUM_ALGOS}", d["algo"])
        _need_int(where, f"{field}.size", d["size"])
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


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
        objects = sum(
            size
            for sec in self.components.values()
            if isinstance(sec, dict)
            for chunks in (sec.get("objects") or {}).values()
            for _d, size in chunks
        )
        objects += sum(
            layout_object_bytes(sec.get("layout")) for sec in self.components.values() if isinstance(sec, dict)
        )
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
        d["manifest_checksum"] = manifest_checksum(d)
        return json.dumps(d, indent=1, sort_keys=True, allow_nan=False).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "Manifest":
        """Parse and check a manifest; CorruptSnapshotError (or SchemaVersionError, UnsafePathError) naming
        ``where`` for anything malformed, so recovery skips it and falls back to an older snapshot."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise _corrupt(where, f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
        d = parse_json(
            data,
            f"{where}/{MANIFEST_NAME}",
            error=CorruptSnapshotError,
            snapshot_id=where,
            problems=["manifest is not valid JSON"],
        )
        if not isinstance(d, dict):
            raise _corrupt(where, "manifest is not a JSON object")
        if "manifest_checksum" not in d:
            # Mandatory: without it a flipped bit (or a hand edit that dropped it) would go unnoticed.
            raise _corrupt(
                where,
                "manifest has no manifest_checksum (every rl_ckpt manifest carries one); "
                "it was edited or damaged, refusing it",
            )
        recorded = d.pop("manifest_checksum")
        try:
            ok = isinstance(recorded, str) and recorded == manifest_checksum(d)
        except (TypeError, ValueError, RecursionError):
            ok = False
        if not ok:
            raise _corrupt(where, "manifest checksum mismatch: meta.json changed after it was written")
        return cls.from_json(d, where)

    @classmethod
    def from_json(cls, d: Any, where: str) -> "Manifest":
        """A Manifest from parsed JSON, every field checked for type and range before it is used."""
        if not isinstance(d, dict):
            raise _corrupt(where, "manifest is not a JSON object")
        version = d.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool) or abs(version) > INT64_MAX:
            raise _corrupt(where, "manifest has no integer schema_version")
        if version != SCHEMA_VERSION:
            newer = "newer" if version > SCHEMA_VERSION else "older"
            raise SchemaVersionError(
                f"{where}: written with on-disk schema_version {version} ({newer}); this rl_ckpt reads "
                f"version {SCHEMA_VERSION}. Use the rl_ckpt release that wrote it; refusing to load.",
                snapshot_id=where,
                found=version,
                supported=SCHEMA_VERSION,
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            # Within one schema version the top-level keys are fixed (new facts go under "extra"): an unknown
            # key is a corrupted one, e.g. a flipped bit in "manifest_checksum" that would skip the self-check.
            raise _corrupt(where, f"manifest has unknown top-level key(s) {unknown}; it is corrupt")
        for name in ("snapshot_id", "global_step", "kind"):
            if name not in d:
                raise _corrupt(where, f"manifest lacks {name!r}")
        _check_fields(d, where)
        kwargs = {k: d[k] for k in known if k in d}
        kwargs["files"] = [FileEntry.from_json(f, where, f"files[{i}]") for i, f in enumerate(d.get("files", []))]
        m = cls(**kwargs)
        paths = [f.path for f in m.files]
        if len(set(paths)) != len(paths):
            raise _corrupt(where, "a file is listed twice")
        return m


def _check_fields(d: dict, where: str) -> None:
    """Type and range of every field the core reads. Component sections may hold keys this module does not
    know (another component kind's own entries): those are left to that kind's decoder, depth-limited."""
    _need_str(where, "snapshot_id", d["snapshot_id"])
    parsed = parse_snapshot_id(d["snapshot_id"])
    if parsed is None:
        raise _corrupt(where, f"snapshot_id {_show(d['snapshot_id'])} is not a snapshot name")
    _need_int(where, "global_step", d["global_step"])
    if d["kind"] not in KINDS:
        raise _wrong(where, "kind", f"one of {KINDS}", d["kind"])
    for name in ("created_at", "config_digest"):
        if name in d:
            _need_str(where, name, d[name])
    if "state_schema_version" in d:
        _need_int(where, "state_schema_version", d["state_schema_version"])
    base = d.get("base_snapshot_id")
    if d["kind"] == "light" or base is not None:
        _need_str(where, "base_snapshot_id", base)
        if d["kind"] != "light" or (parse_snapshot_id(base) or (0, 0, ""))[2] != "full":
            raise _wrong(where, "base_snapshot_id", "a full snapshot's id on a light snapshot only", base)
    for name in ("config", "tags", "writer", "extra", "metrics", "components"):
        if name in d:
            _need_object(where, name, d[name])
    for key, value in d.get("metrics", {}).items():
        if not (
            value is None
            or isinstance(value, (str, bool, float))
            or (isinstance(value, int) and abs(value) <= INT64_MAX)
        ):
            raise _wrong(where, f"metrics.{key}", "a number, string, boolean or null", value)
    if "attempt" in d.get("writer", {}):
        _need_str(where, "writer.attempt", d["writer"]["attempt"])
    if "probes" in d.get("extra", {}):
        for name, probe in _need_object(where, "extra.probes", d["extra"]["probes"]).items():
            _need_object(where, f"extra.probes.{name}", probe)  # what is inside is the probe's to check
    if not isinstance(d.get("files", []), list):
        raise _wrong(where, "files", "a list", d["files"])
    for name, section in d.get("components", {}).items():
        _check_section(where, f"components.{name}", section)
    from rl_ckpt._format.untrusted import MAX_DEPTH, depth

    if depth(d) > MAX_DEPTH:
        raise _corrupt(where, f"manifest is nested more than {MAX_DEPTH} levels deep; rl_ckpt never writes that")


def layout_object_bytes(layout: Any) -> int:
    """The bytes of the dedup objects a sharded layout's chunks name (0 for anything malformed: untrusted JSON)."""
    tensors = layout.get("tensors") if isinstance(layout, dict) else None
    total = 0
    for t in tensors.values() if isinstance(tensors, dict) else ():
        chunks = t.get("chunks") if isinstance(t, dict) else None
        for c in chunks if isinstance(chunks, list) else ():
            refs = c.get("objects") if isinstance(c, dict) else None
            total += sum(
                r[1]
                for r in (refs if isinstance(refs, list) else ())
                if isinstance(r, list) and len(r) == 2 and type(r[1]) is int and r[1] >= 0
            )
    return total


def _check_section(where: str, field: str, section: Any) -> None:
    """The keys of a component section the core reads: kind, tensors, tables, objects, objects_algo."""
    _need_object(where, field, section)
    if "kind" in section:
        _need_str(where, f"{field}.kind", section["kind"])
    for key, meta in _need_object(where, f"{field}.tensors", section.get("tensors", {})).items():
        _need_object(where, f"{field}.tensors.{key}", meta)
        if not isinstance(meta.get("dtype"), str) or meta["dtype"] not in ITEMSIZE:
            raise _wrong(where, f"{field}.tensors.{key}.dtype", "a safetensors dtype code", meta.get("dtype"))
        problem = check_shape(meta.get("shape"))
        if problem:
            raise _corrupt(where, f"{field}.tensors.{key}.shape: {problem}")
    for key, rel in _need_object(where, f"{field}.tables", section.get("tables", {})).items():
        _need_str(where, f"{field}.tables.{key}", rel, empty=False)
    objects = section.get("objects")
    if objects is not None:
        for key, chunks in _need_object(where, f"{field}.objects", objects).items():
            if key not in section.get("tensors", {}):
                raise _corrupt(where, f"{field}.objects.{key}: no tensors entry gives its dtype and shape")
            if not isinstance(chunks, list):
                raise _wrong(where, f"{field}.objects.{key}", "a list of [digest, size] pairs", chunks)
            for chunk in chunks:
                if not (isinstance(chunk, list) and len(chunk) == 2):
                    raise _wrong(where, f"{field}.objects.{key}[]", "a [digest, size] pair", chunk)
                _need_str(where, f"{field}.objects.{key}[].digest", chunk[0], empty=False)
                _need_int(where, f"{field}.objects.{key}[].size", chunk[1])
        if section.get("objects_algo") not in CHECKSUM_ALGOS:
            raise _wrong(where, f"{field}.objects_algo", f"one of {CHECKSUM_ALGOS}", section.get("objects_algo"))


def _show(value: Any) -> str:
    """A short description of a hostile value for an error message (never its whole text)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        if abs(value) > INT64_MAX:  # str() of a 5000-digit int raises: describe it by its size
            return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
        return str(value)
    if isinstance(value, str):
        return repr(value[:40] + ("..." if len(value) > 40 else ""))
    return {dict: "an object", list: "a list", float: "a number"}.get(type(value), type(value).__name__)


def _wrong(where: str, field: str, want: str, got: Any) -> CorruptSnapshotError:
    return _corrupt(where, f"manifest field {field} must be {want}, found {_show(got)}")


def _need_str(where: str, field: str, value: Any, *, empty: bool = True) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise _wrong(where, field, "a string" if empty else "a non-empty string", value)
    return value


def _need_int(where: str, field: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= INT64_MAX:
        raise _wrong(where, field, f"an integer from 0 to {INT64_MAX}", value)
    return value


def _need_object(where: str, field: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise _wrong(where, field, "an object", value)
    return value


def manifest_checksum(d: dict) -> str:
    """The ``manifest_checksum`` of manifest JSON ``d`` (without that key): a check against damage, not a
    signature (anyone who can write the storage can recompute it; tests and the fault suite do, to forge)."""
    from rl_ckpt._format.checksum import digest_bytes

    canon = json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return "xxh3_128:" + digest_bytes("xxh3_128", canon)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


def _corrupt(where: str, reason: str) -> CorruptSnapshotError:
    return CorruptSnapshotError(f"{where}: {reason}", snapshot_id=where, problems=[reason])
