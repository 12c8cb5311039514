"""Generated hostile inputs for the malicious scenario: classes of input, swept, not hand-listed."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import struct
from typing import Any, Callable

from rl_ckpt.errors import CheckpointError
from rl_ckpt.tools.fault_suite.common import Mixed, build, observed, variant_name
from rl_ckpt.tools.fault_suite.report import ScenarioResult
from rl_ckpt.tools.fault_suite.tamper import edit_manifest, forge_json, read_file, replace_file, reseal, snap_dir
from rl_ckpt.tools.fault_suite.targets import LocalTarget, CLI_LOCK


NEWEST = "step_000000002"
HOSTILE_DEPTHS = (8, 62, 66, 900, 1000, 100000)  # nesting around the manifest's limit (64) and Python's (~1000)
HOSTILE_DIGITS = (18, 19, 20, 300, 4300, 4301, 5000)  # around int64 and Python's int-parsing limit (4300)
# one value of every JSON type, plus integers out of the ranges the core accepts
HOSTILE_TYPES: tuple = (None, True, 7, -1, 2**64, 1.5, "x", [], {}, [["x", 1]])
# names a careless parser reads as step 2 or 3; only the canonical ``step_000000002`` is a snapshot
FOREIGN_NAMES = (
    "step_0000000002",
    "step_\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0663",
    "step_\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff13",
    "step_000000003\n",
    "step_000000003.b0",
    "step_000000003.b01",
    " step_000000003",
    "step_000000003.light ",
    "STEP_000000003",
    "step_00000003",
    "step_000000003.b1.light.light",
)
RECORD_FOLDERS = ("decisions", "quarantine", "failures", "history/retired", "best")


@dataclasses.dataclass
class HostileCase:
    """One generated hostile input, applied to the newest snapshot of a run holding steps 1 and 2."""

    family: str
    name: str
    dedup: bool
    mutate: Callable[[LocalTarget], None]
    must_refuse: bool = False  # restore must fall back to step 1 (else: step 1, or step 2 loaded exactly)
    foreign: str | None = None  # a folder that must never be listed, restored or removed by gc


def json_paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a parsed JSON document (object keys and list indexes), containers and leaves."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        out.append(prefix + (key,))
        out += json_paths(child, prefix + (key,))
    return out


def _set_path(doc: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _show_path(path: tuple) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _in_manifest(path: tuple, raw_text: str):
    def mutate(target: LocalTarget) -> None:
        edit_manifest(target, lambda m: _set_path(m, path, "@RAW@"), NEWEST, raw={"@RAW@": raw_text})

    return mutate


def _in_model_json(raw_text: str):
    def mutate(target: LocalTarget) -> None:
        tree = read_file(target, "model.json", NEWEST).decode()
        assert '"s2"' in tree, "the suite model's tag is no longer in model.json"
        replace_file(target, "model.json", tree.replace('"s2"', raw_text, 1).encode(), sid=NEWEST)

    return mutate


def _in_safetensors_header(where: str, raw_text: str):
    def mutate(target: LocalTarget) -> None:
        good = read_file(target, "model.safetensors", NEWEST)
        (n,) = struct.unpack("<Q", good[:8])
        header = json.loads(good[8 : 8 + n])
        if where == "__metadata__":
            header["__metadata__"] = {"x": "@RAW@"}
        elif where == "empty tensor":  # a tensor of no bytes at the end: only its shape can be wrong
            end = max(e["data_offsets"][1] for k, e in header.items() if k != "__metadata__")
            header["extra"] = {"dtype": "F32", "shape": "@RAW@", "data_offsets": [end, end]}
        else:
            key, field, index = where.split(":")
            header[key][field][int(index)] = "@RAW@"
        blob = forge_json(header, {"@RAW@": raw_text}).encode()
        blob += b" " * (-(len(blob) + 8) % 8)
        replace_file(target, "model.safetensors", struct.pack("<Q", len(blob)) + blob + good[8 + n :], sid=NEWEST)

    return mutate


def _plant_record(folder: str, raw_text: str):
    def mutate(target: LocalTarget) -> None:
        os.makedirs(os.path.join(target.run, folder), exist_ok=True)
        name = (
            f"{NEWEST}.json"
            if folder in ("quarantine", "history/retired")
            else "avg_reward.json"
            if folder == "best"
            else "2026-01-01T000000.000000p0000-restore.json"
        )
        with open(os.path.join(target.run, folder, name), "w") as f:
            f.write(raw_text)

    return mutate


def _plant_foreign(name: str):
    def mutate(target: LocalTarget) -> None:
        # a copy of step 2 whose manifest (checksum recomputed) claims the name's step: a newer snapshot
        # to anyone who reads the name carelessly
        dst = os.path.join(target.run, name)
        shutil.copytree(snap_dir(target, NEWEST), dst)
        path = os.path.join(dst, "meta.json")
        with open(path) as f:
            meta = json.load(f)
        meta.pop("manifest_checksum", None)
        meta.update(snapshot_id="step_000000003", global_step=3)
        with open(path, "w") as f:
            f.write(reseal(json.dumps(meta)))

    return mutate


def _cli_run(argv: list[str]) -> tuple[int, str, str]:
    """``rl-ckpt ARGV`` in this process: (exit status, stdout, stderr); one at a time (stdout is process-wide)."""
    from rl_ckpt.cli import main as cli

    out, err = io.StringIO(), io.StringIO()
    with CLI_LOCK, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli(argv)
    return rc, out.getvalue(), err.getvalue()


def check_hostile(res: ScenarioResult, target: LocalTarget, case: HostileCase) -> None:
    """Restore falls back to step 1 (or loads step 2 exactly), the CLI answers with an exit status and at
    most one line of error, gc leaves foreign folders alone."""
    from rl_ckpt._format.manifest import parse_snapshot_id
    from rl_ckpt._run.snapshot_files import read_manifest

    variant, label = variant_name(case.dedup, True), f"{case.family}: {case.name}"
    # The CLI first: a restore that falls back retires the refused newer snapshot (history/retired/).
    manifest_refused = True
    try:
        read_manifest(target.storage(), NEWEST)
        manifest_refused = False
    except CheckpointError:
        pass
    except Exception as exc:
        res.violate(variant, label, "not_a_checkpoint_error", f"read_manifest: {type(exc).__name__}: {exc}")
    export = os.path.join(target.parent, "export.safetensors")
    for argv in (
        ["ls", target.run],
        ["ls", target.run, "--deep"],
        ["verify", target.run],
        ["plan", target.run],
        ["inspect", target.run, NEWEST],
        ["export", target.run, NEWEST, "model", "-o", export],
    ):
        command = " ".join(argv[:1] + argv[2:3])
        try:
            rc, out, err = _cli_run(argv)
        except Exception as exc:
            res.violate(variant, label, "not_a_checkpoint_error", f"rl-ckpt {command}: {type(exc).__name__}: {exc}")
            continue
        errors = [line for line in err.splitlines() if line.startswith("rl-ckpt ")]  # log records aside
        if rc not in (0, 1) or "Traceback" in err or len(errors) > 1:
            res.violate(
                variant, label, "cli", f"rl-ckpt {command} exited {rc} with {len(errors)} error lines: {err[-300:]}"
            )
        elif manifest_refused and argv[0] in ("ls", "verify", "inspect", "export") and rc != 1:
            res.violate(variant, label, "cli", f"rl-ckpt {command} exited {rc} though {NEWEST}'s manifest is refused")
        elif case.foreign is not None and argv[1:] == [target.run, "--deep"] and (rc != 1 or "FOREIGN" not in out):
            res.violate(variant, label, "cli", f"rl-ckpt ls --deep does not show the foreign folder (exit {rc})")
    engine, model, buf = build(target.cfg, target.storage())
    try:
        listed = [i.snapshot_id for i in engine.snapshots()]
        if case.foreign is not None and listed != ["step_000000001", NEWEST]:
            res.violate(variant, label, "unexpected", f"listed {listed}")
        result = engine.restore()
        step = observed(model, buf)[0]
        parsed = parse_snapshot_id(result.snapshot_id or "")
        if result.snapshot_id not in ("step_000000001", NEWEST) or parsed is None or parsed[0] != step:
            res.violate(variant, label, "corrupt_load", f"restored {result.snapshot_id!r} holding step {step}")
        elif result.snapshot_id == NEWEST and case.must_refuse:
            res.violate(variant, label, "not_refused", "restore loaded a snapshot it had to refuse")
        else:
            res.note("refused: restore fell back to step 1" if step == 1 else "harmless: step 2 loaded exactly")
    except Mixed as exc:
        res.violate(variant, label, "corrupt_load", str(exc))
    except CheckpointError as exc:
        res.violate(variant, label, "no_fallback", f"restore did not fall back to step 1: {exc}")
    except Exception as exc:
        res.violate(variant, label, "not_a_checkpoint_error", f"restore: {type(exc).__name__}: {exc}")
    finally:
        engine.close()
    try:
        target.gc()
    except Exception as exc:
        res.violate(variant, label, "not_a_checkpoint_error", f"gc: {type(exc).__name__}: {exc}")
    if case.foreign is not None and not os.path.isdir(os.path.join(target.run, case.foreign)):
        res.violate(variant, label, "gc", "gc removed a foreign folder as if it were a snapshot's debris")


def hostile_cases(manifests: dict[bool, dict], types_per_path: int | None) -> list[HostileCase]:
    """Every generated case. ``manifests``: the newest manifest of the dedup off/on templates, whose every
    field gets values of the wrong JSON type (``types_per_path`` of them in rotation; None: all)."""
    cases = []
    for dedup, meta in manifests.items():
        meta = {k: v for k, v in meta.items() if k != "manifest_checksum"}
        for i, path in enumerate(json_paths(meta)):
            original = meta
            for key in path:
                original = original[key]
            wrong = [
                v for v in HOSTILE_TYPES if type(v) is not type(original) or (type(v) is int and not 0 <= v < 2**63)
            ]
            if types_per_path is not None:
                wrong = [wrong[(i + j) % len(wrong)] for j in range(min(types_per_path, len(wrong)))]
            for value in wrong:
                cases.append(
                    HostileCase(
                        "wrong JSON type",
                        f"{_show_path(path)} = {json.dumps(value)}",
                        dedup,
                        _in_manifest(path, json.dumps(value)),
                    )
                )
    free = {
        "manifest tags.x": ("tags", "x"),
        "manifest config.x": ("config", "x"),
        "manifest extra.x": ("extra", "x"),
        "manifest components.model.x (a key the core does not know)": ("components", "model", "x"),
    }
    core = {
        "manifest global_step": ("global_step",),
        "manifest files[0].size": ("files", 0, "size"),
        "manifest tensor shape": ("components", "model", "tensors", "weight", "shape", 0),
    }
    for depth in HOSTILE_DEPTHS:
        text = _nested(depth)
        for label, path in free.items():
            cases.append(
                HostileCase(
                    "nesting depth", f"{label} nested {depth}", False, _in_manifest(path, text), must_refuse=depth > 64
                )
            )
        cases.append(
            HostileCase(
                "nesting depth",
                f"model.json value nested {depth}",
                False,
                _in_model_json(text),
                must_refuse=depth >= 1000,
            )
        )
        cases.append(
            HostileCase(
                "nesting depth",
                f"safetensors __metadata__ nested {depth}",
                False,
                _in_safetensors_header("__metadata__", text),
                must_refuse=depth >= 1000,
            )
        )
        for folder in RECORD_FOLDERS:
            cases.append(
                HostileCase("nesting depth", f"{folder}/ record nested {depth}", False, _plant_record(folder, text))
            )
    for digits in HOSTILE_DIGITS:
        text = "9" * digits
        for label, path in {**free, **core}.items():
            cases.append(
                HostileCase(
                    "number size",
                    f"{label} of {digits} digits",
                    False,
                    _in_manifest(path, text),
                    must_refuse=label in core or digits > 4300,
                )
            )
        cases.append(
            HostileCase(
                "number size",
                f"model.json value of {digits} digits",
                False,
                _in_model_json(text),
                must_refuse=digits > 4300,
            )
        )
        for where in ("__metadata__", "weight:shape:0", "weight:data_offsets:1"):
            cases.append(
                HostileCase(
                    "number size",
                    f"safetensors {where} of {digits} digits",
                    False,
                    _in_safetensors_header(where, text),
                    must_refuse=where != "__metadata__" or digits > 4300,
                )
            )
        for folder in RECORD_FOLDERS:
            cases.append(
                HostileCase(
                    "number size",
                    f"{folder}/ record of {digits} digits",
                    False,
                    _plant_record(folder, f'{{"snapshot_id": "{NEWEST}", "step": {text}, "global_step": {text}}}'),
                )
            )
    for shape in ([0, 2**64], [0, 2**62, 2**62], [0] + [2**40] * 3, [0] * 65):
        cases.append(
            HostileCase(
                "number size",
                f"safetensors empty tensor of shape {shape[:5]}",
                False,
                _in_safetensors_header("empty tensor", json.dumps(shape)),
                must_refuse=True,
            )
        )
    for folder in RECORD_FOLDERS:
        for value in HOSTILE_TYPES + ({"snapshot_id": [1], "global_step": "x", "kind": 5, "metric": []},):
            cases.append(
                HostileCase(
                    "wrong JSON type",
                    f"{folder}/ record = {json.dumps(value)}",
                    False,
                    _plant_record(folder, json.dumps(value)),
                )
            )
    for name in FOREIGN_NAMES:
        cases.append(HostileCase("non-canonical name", f"folder {name!r}", False, _plant_foreign(name), foreign=name))
    return cases


# -- entry points ------------------------------------------------------------------------------------
