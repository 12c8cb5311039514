"""Hostile component JSON: whatever a forged ``<component>.json`` holds, decoding ends in a CheckpointError
naming the file (so restore falls back to an older snapshot), never in a raw Python error.

The inputs are generated, not hand-listed: nesting-depth sweeps, number sizes per NumPy dtype, and
every JSON type substituted into every tag's value. ``hostile_trees()`` is importable by other tests.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from rl_ckpt import CheckpointEngine, CheckpointError
from rl_ckpt._format.checksum import digest_bytes
from rl_ckpt.errors import CorruptSnapshotError
from rl_ckpt._format.manifest import Manifest
from rl_ckpt._format.state_codec import MAX_DEPTH, decode_state
from helpers import Bag

TAGS = (
    "$tensor",
    "$ndarray",
    "$table",
    "$tuple",
    "$dict",
    "$float",
    "$np",
    "$bytes",
    "$odict",
    "$ddict",
    "$counter",
    "$td",
    "$ntd",
    "$view",
    "$param",
    "$c128",
    "$nd",
    "$size",
    "$device",
    "$dtype",
    "$complex",
    "$int",
    "$bytearray",
    "$unknown",
)
JSON_VALUES: tuple = (
    None,
    True,
    0,
    -1,
    2**70,
    1.5,
    float("inf"),
    "",
    "t",
    "x" * 100,
    [],
    {},
    [1],
    ["t"],
    [[1, 2]],
    [["t", 1]],
    [[[1], 2]],
    [["a"], 1],
    {"a": 1},
    {"items": 5},
    {"items": [[[], 1]]},
    ["t", 0, [2], [1]],
    ["t", 0, [5], [1]],
    ["t", -1, [1], [1]],
    ["t", 0, [2**62], [2**62]],
    ["int8", 10**5],
    ["uint8", -1],
    ["bool", 1],
    ["float32", "1"],
    ["object", 1],
    ["i4,i4", 1],
    ["int64", 2**63],
    ["t", "<c16"],
    ["t", "|O8"],
    ["t", ">f4"],
    {"batch_size": [2], "device": None, "items": [["a", {"$tensor": "t"}]]},
    {"batch_size": [-1], "device": "nope", "items": []},
    {"batch_size": [1], "device": None, "items": [["a", 1]]},
    "cuda:99",
    "meta",
    "nan",
    "-",
)


def nested(depth: int, kind: str) -> Any:
    """``depth`` levels of list, dict or tag nesting around a leaf."""
    node: Any = 1
    for _ in range(depth):
        node = [node] if kind == "list" else {"k": node} if kind == "dict" else {"$tuple": [node]}
    return node


def hostile_trees() -> Iterator[tuple[str, Any]]:
    """(label, JSON tree) pairs a forger could put in a component file."""
    for depth, kind in itertools.product((MAX_DEPTH + 1, 600, 3000), ("list", "dict", "tag")):
        yield f"nested-{kind}-{depth}", nested(depth, kind)
    for dtype in ("bool", "int8", "uint8", "int16", "uint32", "int64", "uint64", "float16", "float32", "complex64"):
        for value in (2**7, 2**8, -(2**15) - 1, 2**64, -(2**63) - 1, 10**400, 1e308, True):
            yield f"np-{dtype}-{value!r:.20}", {"$np": [dtype, value]}
    yield "int-hex-huge", {"$int": "f" * (1 << 21)}
    yield "int-hex-bad", {"$int": "0x10"}
    for tag, value in itertools.product(TAGS, JSON_VALUES):
        yield f"{tag}={json.dumps(value, allow_nan=True)[:40]}", {tag: value}
        yield f"{tag}-in-dict-key", {"$dict": [[{tag: value}, 1]]}


ARRAYS = {"t": torch.arange(4.0), "n": np.arange(3)}


@pytest.mark.parametrize("label,tree", list(hostile_trees()), ids=lambda v: v if isinstance(v, str) else "")
def test_hostile_tree_decodes_or_is_a_clean_error(label, tree):
    try:
        decode_state(tree, ARRAYS, {}, where="step_000000001/bag.json")
    except CheckpointError as exc:
        assert isinstance(exc, CorruptSnapshotError) and "step_000000001/bag.json" in str(exc), label


@pytest.mark.parametrize(
    "tree,why",
    [
        (nested(600, "dict"), "nested more than"),  # was a RecursionError
        ({"$np": ["int8", 100000]}, "out of range"),  # was an OverflowError
        ({"$np": ["float16", 1e308]}, "out of range"),  # was a silent inf
        ({"$dict": [[[1, 2], "v"]]}, "key must be str or int"),  # was a TypeError (unhashable list)
        ({"$int": "12g"}, "hex"),
        ({"$view": ["t", 1, [4], [1]]}, "runs past"),
        ({"$dtype": "_dynamo"}, "unknown torch dtype"),  # never imported by name
    ],
    ids=["deep", "np-overflow", "np-float-overflow", "list-key", "int-not-hex", "view-past-end", "dtype-name"],
)
def test_issue_cases_get_a_specific_reason(tree, why):
    with pytest.raises(CorruptSnapshotError, match=why) as err:
        decode_state({"x": tree}, ARRAYS, {}, where="step_000000001/bag.json")
    assert str(err.value).startswith("step_000000001/bag.json: ")


@pytest.mark.parametrize(
    "label,tree",
    [
        ("deep-600", nested(600, "dict")),
        ("np-int8-overflow", {"$np": ["int8", 100000]}),
        ("list-as-dict-key", {"$dict": [[[1, 2], "v"]]}),
        ("view-past-end", {"$view": ["bag/w", 0, [1000], [1]]}),
        ("td-bad-batch", {"$td": {"batch_size": [7], "device": None, "items": [["w", {"$tensor": "bag/w"}]]}}),
    ],
)
def test_forged_component_json_makes_restore_fall_back(tmp_path, label, tree):
    cfg = {"base_dir": str(tmp_path), "run_name": "run"}
    bag = Bag({"bag": {"w": torch.ones(3)}, "step": 1})
    eng = CheckpointEngine(**cfg)
    eng.register("bag", bag)
    eng.save(1)
    bag.state = {"bag": {"w": torch.ones(3)}, "step": 2}
    eng.save(2)
    forge(tmp_path / "run" / "step_000000002", "bag.json", json.dumps({"bag": tree, "step": 2}).encode())

    out = Bag()
    e2 = CheckpointEngine(**cfg)
    e2.register("bag", out)
    result = e2.restore()
    assert result.snapshot_id == "step_000000001" and out.state["step"] == 1
    assert "step_000000002/bag.json" in result.skipped["step_000000002"]


def forge(snap: Path, rel: str, data: bytes) -> None:
    """Replace a file and fix its checksum and the manifest's own, as someone who can write the storage would."""
    (snap / rel).write_bytes(data)
    manifest = Manifest.from_bytes((snap / "meta.json").read_bytes(), snap.name)
    manifest.files = [
        dataclasses.replace(f, size=len(data), checksum=digest_bytes(f.algo, data)) if f.path == rel else f
        for f in manifest.files
    ]
    (snap / "meta.json").write_bytes(manifest.to_bytes())


# -- every earlier format still loads ------------------------------------------------------------------


def test_snapshot_written_by_format_1_still_decodes(tmp_path):
    """tests/data/format_v1 was written by the codec before tags for OrderedDict, TensorDict etc. existed."""
    shutil.copytree(Path(__file__).parent / "data" / "format_v1", tmp_path / "run")

    class Bag:
        state = None

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            self.state = state

    bag, policy = Bag(), torch.nn.Linear(3, 2)
    eng = CheckpointEngine(base_dir=str(tmp_path), run_name="run", post_load_check=False)
    eng.register("bag", bag)
    eng.register("policy", policy)
    assert eng.restore().snapshot_id == "step_000000001"
    torch.manual_seed(0)
    assert torch.equal(policy.weight, torch.nn.Linear(3, 2).weight)
    s = bag.state
    assert torch.equal(s["t"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert s["nd"].dtype == np.int16 and np.array_equal(s["nd"], np.arange(4))
    # Format 1 stored these as plain JSON, so they come back as it always did.
    assert s["od"] == {"b": 1, "a": 2} and s["f64"] == 0.5 and s["size"] == (2, 3) and s["big"] == 2**100
    assert s["tuple"] == (1, (2, "x")) and s["intkeys"] == {3: "a", 1: "b"} and s["dollar"] == {"$tensor": "not a tag"}
    assert (
        s["bytes"] == b"\x00\xff" and type(s["f32"]) is np.float32 and np.isnan(s["nan"]) and s["ninf"] == float("-inf")
    )
    assert (
        s["none"] is None and s["flag"] is True and s["s"] == "text" and s["table"].column("x").to_pylist() == [1, 2, 3]
    )
