"""Scenario 7: hand-made malicious snapshots (traversal, symlinks, pickles, bad headers), then the generated ones."""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import shutil
import struct
from typing import Callable

import torch

from rl_ckpt.errors import CheckpointError
from rl_ckpt.tools.fault_suite.common import build, variant_name
from rl_ckpt.tools.fault_suite.context import Suite
from rl_ckpt.tools.fault_suite.hostile import HostileCase, NEWEST, check_hostile, hostile_cases
from rl_ckpt.tools.fault_suite.report import ScenarioResult
from rl_ckpt.tools.fault_suite.tamper import edit_manifest, read_file, replace_file, snap_dir
from rl_ckpt.tools.fault_suite.targets import GcRefused, LocalTarget


def malicious(suite: Suite) -> ScenarioResult:
    """Plant every hand-made malicious input in a committed run, then the generated hostile ones."""
    res = ScenarioResult("malicious", "hostile snapshots: traversal, links, pickles, bad headers, bad Arrow, schema")
    for name, (dedup, fn) in MALICIOUS.items():
        variant = variant_name(dedup, True)
        kw = {"dedup": dedup}
        target = suite.case(f"malicious-{name}", kw, suite.template(variant, kw, steps=(1,)))
        marker = os.path.join(target.parent, "outside", "PWNED")
        expect = fn(target, marker)  # mutates the snapshot
        before = target.outside()
        res.tried += 1
        res.injected[name] += 1
        n = len(res.violations)
        engine, model, buf = build(target.cfg, target.storage())
        try:
            listed = [i.snapshot_id for i in engine.snapshots()] + [u.snapshot_id for u in engine.catalog.unreadable()]
            report = engine.verify()
            if expect == "flagged" and report.ok:
                res.violate(variant, name, "undetected", "verify reports the hostile snapshot as OK")
            if expect == "unlisted" and listed:
                res.violate(variant, name, "unexpected", f"{listed} listed")
            try:
                result = engine.restore()
            except CheckpointError as exc:
                res.note("refused with a CheckpointError")
                if expect == "unlisted":
                    res.violate(variant, name, "restore_failed", f"restore failed on an unlisted snapshot: {exc}")
            else:
                if not result.fresh:
                    res.violate(
                        variant, name, "corrupt_load", f"restore loaded the hostile snapshot {result.snapshot_id}"
                    )
                elif expect != "unlisted":
                    res.violate(variant, name, "unexpected", f"restore started fresh with {listed} listed")
                else:
                    res.note("refused: never listed")
        except Exception as exc:
            res.violate(variant, name, "not_a_checkpoint_error", f"{type(exc).__name__}: {exc}")
        engine.close()
        try:
            target.gc()  # gc must not follow links or delete outside either
        except GcRefused as exc:
            res.note("gc refused to walk through it (exit 1, names the path)")
            if "link" not in str(exc) and "refused" not in str(exc):
                res.violate(variant, name, "gc", f"gc failed without saying why: {exc}")
        except Exception as exc:
            res.violate(variant, name, "not_a_checkpoint_error", f"gc: {type(exc).__name__}: {exc}")
        if os.path.exists(marker):
            res.violate(variant, name, "unpickled", "a pickle payload was executed (marker file exists)")
        if target.outside() != before:
            res.violate(variant, name, "escape", "something outside the run folder changed")
        suite.done(target, len(res.violations) == n)
    suite.progress(f"  malicious: {len(MALICIOUS)} hand-made cases")
    malicious_generated(suite, res)
    return res


def malicious_generated(suite: Suite, res: ScenarioResult) -> None:
    """The generated classes (:func:`hostile_cases`) against a run of steps 1 and 2: each must leave
    restore loading step 1, or step 2 exactly; the CLI exits 0 or 1 with at most one line of error."""
    templates, manifests = {}, {}
    for dedup in (False, True):
        templates[dedup] = suite.template(variant_name(dedup, True), {"dedup": dedup}, steps=(1, 2))
        with open(os.path.join(templates[dedup], NEWEST, "meta.json")) as f:
            manifests[dedup] = json.load(f)
    cases = hostile_cases(manifests, suite.profile.hostile_types_per_path)
    suite.run_jobs(res, [_hostile_job(suite, case, templates[case.dedup]) for case in cases])
    families = collections.Counter(c.family for c in cases)
    suite.progress("  malicious: " + ", ".join(f"{n} {family}" for family, n in families.items()) + " generated")


def _hostile_job(suite: Suite, case: HostileCase, template: str) -> Callable[[ScenarioResult], None]:
    def job(res: ScenarioResult) -> None:
        target = suite.case(f"hostile-{case.family}", {"dedup": case.dedup}, template)
        case.mutate(target)
        res.tried += 1
        res.injected[case.family] += 1
        n = len(res.violations)
        check_hostile(res, target, case)
        suite.done(target, len(res.violations) == n)

    job.__name__ = f"{case.family}: {case.name}"
    return job


class Payload:
    """Unpickling this creates a marker file: proof that something unpickled our data."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _secret(target: LocalTarget) -> str:
    return os.path.join(target.parent, "outside", "secret.txt")


def _mal_path(path_of: Callable[[LocalTarget], str]):
    def fn(target: LocalTarget, marker: str) -> str:
        edit_manifest(target, lambda m: m["files"][0].update(path=path_of(target)))
        return "flagged"

    return fn


def _mal_symlink_shard(target: LocalTarget, marker: str) -> str:
    shard = os.path.join(snap_dir(target), "model.safetensors")
    copy = os.path.join(target.parent, "outside", "model.safetensors")
    shutil.copy2(shard, copy)  # identical bytes: only the link itself is wrong
    os.unlink(shard)
    os.symlink(copy, shard)
    return "flagged"


def _mal_symlink_manifest(target: LocalTarget, marker: str) -> str:
    meta = os.path.join(snap_dir(target), "meta.json")
    copy = os.path.join(target.parent, "outside", "meta.json")
    shutil.copy2(meta, copy)
    os.unlink(meta)
    os.symlink(copy, meta)
    return "flagged"


def _mal_symlink_snapshot(target: LocalTarget, marker: str) -> str:
    moved = os.path.join(target.parent, "outside", "moved-snapshot")
    os.rename(snap_dir(target), moved)
    os.symlink(moved, snap_dir(target))
    return "flagged"  # a linked snapshot folder is reported (ls, verify, plan) and never used


def _mal_symlink_object(target: LocalTarget, marker: str) -> str:
    objects = os.path.join(target.run, "objects")
    objects = os.path.join(objects, sorted(os.listdir(objects))[0])  # objects/<algo>
    prefix = sorted(os.listdir(objects))[0]
    copy = os.path.join(target.parent, "outside", "objects-" + prefix)
    shutil.copytree(os.path.join(objects, prefix), copy)
    shutil.rmtree(os.path.join(objects, prefix))
    os.symlink(copy, os.path.join(objects, prefix))
    return "flagged"


def _mal_pickle_shard(target: LocalTarget, marker: str) -> str:
    replace_file(target, "model.safetensors", pickle.dumps({"weight": Payload(marker)}))
    return "refused"


def _mal_torch_save_shard(target: LocalTarget, marker: str) -> str:
    buf = io.BytesIO()
    torch.save({"weight": Payload(marker)}, buf)  # a zip-pickle, what torch.load would execute
    replace_file(target, "model.safetensors", buf.getvalue())
    return "refused"


def _mal_pickle_json(target: LocalTarget, marker: str) -> str:
    replace_file(target, "model.json", pickle.dumps(Payload(marker)))
    return "refused"


def _mal_safetensors_header(kind: str):
    def fn(target: LocalTarget, marker: str) -> str:
        good = read_file(target, "model.safetensors")
        (n,) = struct.unpack("<Q", good[:8])
        header = json.loads(good[8 : 8 + n])
        if kind == "huge":
            data = struct.pack("<Q", 2**40) + good[8:]
        elif kind == "past-end":
            data = struct.pack("<Q", len(good) + 10) + good[8:]
        else:
            key = next(k for k in header if k != "__metadata__")
            header[key]["data_offsets"] = [0, 10**12]
            blob = json.dumps(header).encode()
            data = struct.pack("<Q", len(blob)) + blob + good[8 + n :]
        replace_file(target, "model.safetensors", data)
        return "refused"

    return fn


def _mal_arrow(where: str):
    def fn(target: LocalTarget, marker: str) -> str:
        name = "replay_buffer.t0.arrow"
        data = bytearray(read_file(target, name))
        (footer,) = struct.unpack("<i", data[-10:-6])
        if where == "footer-length":
            data[-10:-6] = struct.pack("<i", 10**8)  # the footer "starts" before the file does
        elif where == "footer":
            start = len(data) - 10 - footer
            data[start + 4 : start + 36] = b"\xff" * 32
        else:  # the first record batch's metadata
            first = data.find(b"\xff\xff\xff\xff", 16)
            data[first + 8 : first + 40] = b"\x7f" * 32
        replace_file(target, name, bytes(data))
        return "refused"

    return fn


def _mal_schema(version: int):
    def fn(target: LocalTarget, marker: str) -> str:
        edit_manifest(target, lambda m: m.update(schema_version=version))
        return "flagged"

    return fn


def _mal_state_schema(target: LocalTarget, marker: str) -> str:
    edit_manifest(target, lambda m: m.update(state_schema_version=7))
    return "refused"  # intact bytes (verify may pass), but restore must refuse the layout


def _mal_objects_algo(algo: str):
    def fn(target: LocalTarget, marker: str) -> str:
        def mutate(m: dict) -> None:
            m["components"]["model"]["objects_algo"] = algo

        edit_manifest(target, mutate)
        return "flagged"

    return fn


def _mal_object_digest(target: LocalTarget, marker: str) -> str:
    def mutate(m: dict) -> None:
        chunks = m["components"]["model"]["objects"]["weight"]
        chunks[0][0] = "../../../outside/secret.txt"

    edit_manifest(target, mutate)
    return "flagged"


def _mal_nested_json(target: LocalTarget, marker: str) -> str:
    replace_file(target, "model.json", b"[" * 200000 + b"]" * 200000)
    return "refused"


def _mal_missing_tensor(target: LocalTarget, marker: str) -> str:
    tree = json.loads(read_file(target, "model.json"))
    tree_text = json.dumps(tree).replace('"weight"', '"no_such_tensor"', 1)
    replace_file(target, "model.json", tree_text.encode())
    return "refused"


def _mal_listed_twice(target: LocalTarget, marker: str) -> str:
    edit_manifest(target, lambda m: m["files"].append(dict(m["files"][0])))
    return "flagged"


def _mal_renamed_copy(target: LocalTarget, marker: str) -> str:
    os.rename(snap_dir(target), snap_dir(target, "step_000000005"))
    return "flagged"


def _mal_manifest_not_json(target: LocalTarget, marker: str) -> str:
    with open(os.path.join(snap_dir(target), "meta.json"), "wb") as f:
        f.write(pickle.dumps(Payload(marker)))
    return "flagged"


# name -> (dedup, mutate(target, marker) -> expectation): "flagged" (listed; verify flags it; restore refuses),
# "refused" (listed; restore refuses; verify may pass: the attacker made the checksums agree, so only
# decoding can tell), "unlisted" (never listed, never read)
MALICIOUS: dict[str, tuple[bool, Callable[[LocalTarget, str], str]]] = {
    "path traversal ../../outside/secret.txt": (False, _mal_path(lambda t: "../../outside/secret.txt")),
    "path traversal a/../../x": (False, _mal_path(lambda t: "a/../../x")),
    "absolute path to a file outside": (False, _mal_path(_secret)),
    "absolute path /etc/passwd": (False, _mal_path(lambda t: "/etc/passwd")),
    "empty path part a//b": (False, _mal_path(lambda t: "a//b")),
    "symlinked shard (identical bytes)": (False, _mal_symlink_shard),
    "symlinked manifest": (False, _mal_symlink_manifest),
    "symlinked snapshot folder": (False, _mal_symlink_snapshot),
    "symlinked dedup object folder": (True, _mal_symlink_object),
    "pickle payload as shard (checksum fixed)": (False, _mal_pickle_shard),
    "torch.save zip-pickle as shard (checksum fixed)": (False, _mal_torch_save_shard),
    "pickle payload as JSON structure file": (False, _mal_pickle_json),
    "pickle payload as manifest": (False, _mal_manifest_not_json),
    "safetensors header length 2^40": (False, _mal_safetensors_header("huge")),
    "safetensors header past end of file": (False, _mal_safetensors_header("past-end")),
    "safetensors offsets beyond the data": (False, _mal_safetensors_header("offsets")),
    "Arrow footer length past the file (checksum fixed)": (False, _mal_arrow("footer-length")),
    "Arrow footer garbage (checksum fixed)": (False, _mal_arrow("footer")),
    "Arrow record batch metadata garbage (checksum fixed)": (False, _mal_arrow("batch")),
    "manifest schema_version 99": (False, _mal_schema(99)),
    "manifest schema_version 0": (False, _mal_schema(0)),
    "state schema_version mismatch": (False, _mal_state_schema),
    "dedup objects_algo with traversal": (True, _mal_objects_algo("../../../outside")),
    "dedup unknown objects_algo": (True, _mal_objects_algo("md5")),
    "dedup object digest with traversal": (True, _mal_object_digest),
    "JSON nested 200000 deep": (False, _mal_nested_json),
    "JSON references a missing tensor": (False, _mal_missing_tensor),
    "manifest lists a file twice": (False, _mal_listed_twice),
    "snapshot copied under another step's name": (False, _mal_renamed_copy),
}


# -- generated hostile inputs: classes of input, swept, not hand-listed ----------------------------
