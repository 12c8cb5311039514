"""Editing a committed snapshot in place, as an attacker would: forged JSON, resealed checksums."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from rl_ckpt._format.checksum import digest_bytes
from rl_ckpt.tools.fault_suite.targets import LocalTarget


def snap_dir(target: LocalTarget, sid: str = "step_000000001") -> str:
    """The folder of snapshot ``sid`` in the case's run."""
    return os.path.join(target.run, sid)


def forge_json(doc: Any, raw: dict[str, str] | None = None) -> str:
    """JSON text of ``doc``, with each string value ``"<key>"`` of ``raw`` replaced by raw text: what Python's
    json cannot write itself (5000-digit numbers, nesting 100 000 deep)."""
    text = json.dumps(doc)
    for key, value in (raw or {}).items():
        text = text.replace(json.dumps(key), value)
    return text


def reseal(text: str) -> str:
    """Manifest text with its ``manifest_checksum`` recomputed, as anyone who can write the storage can.
    When Python cannot parse it (too deep, too many digits) no checksum can be computed: a dummy is put
    in, and the parser must refuse the file before it looks at the checksum."""
    from rl_ckpt._format.manifest import manifest_checksum

    try:
        doc = json.loads(text)
        doc.pop("manifest_checksum", None)
        checksum = manifest_checksum(doc)
    except (ValueError, RecursionError, TypeError, AttributeError):
        checksum = "xxh3_128:" + "0" * 32
    body = text.rstrip()
    if not body.endswith("}"):
        return body
    body = body[:-1].rstrip()
    return (
        body
        + ("" if body.endswith("{") else ", ")
        + json.dumps("manifest_checksum")
        + ": "
        + json.dumps(checksum)
        + "}"
    )


def edit_manifest(
    target: LocalTarget, mutate: Callable[[dict], None], sid: str = "step_000000001", raw: dict[str, str] | None = None
) -> None:
    """Rewrite a snapshot's manifest through ``mutate`` (``raw``: see :func:`forge_json`) and reseal it."""
    path = os.path.join(snap_dir(target, sid), "meta.json")
    with open(path) as f:
        meta = json.load(f)
    meta.pop("manifest_checksum", None)
    mutate(meta)
    with open(path, "w") as f:
        f.write(reseal(forge_json(meta, raw)))


def replace_file(
    target: LocalTarget, name: str, data: bytes, fix_checksum: bool = True, sid: str = "step_000000001"
) -> None:
    """Put ``data`` in place of a snapshot file and (as an attacker would) make the manifest agree."""
    with open(os.path.join(snap_dir(target, sid), name), "wb") as f:
        f.write(data)
    if fix_checksum:

        def fix(meta: dict) -> None:
            for f in meta["files"]:
                if f["path"] == name:
                    f["size"], f["checksum"] = len(data), digest_bytes(f["algo"], data)

        edit_manifest(target, fix, sid)


def read_file(target: LocalTarget, name: str, sid: str = "step_000000001") -> bytes:
    """The bytes of file ``name`` of snapshot ``sid``."""
    with open(os.path.join(snap_dir(target, sid), name), "rb") as f:
        return f.read()
