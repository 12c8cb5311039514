"""Unit logic of the sharded layout: JSON checks and the merge of per-rank parts (no processes)."""

from __future__ import annotations

import copy

import pytest

from rl_ckpt.errors import CorruptSnapshotError, UnsafePathError
from rl_ckpt._sharded.layout import Layout, merge_components


def part(rank: int, rows: int = 4) -> dict:
    chunk = {
        "offsets": [rank * rows, 0],
        "sizes": [rows, 3],
        "file": f"p.rank{rank}.safetensors",
        "start": 64,
        "block_rows": 2,
        "checksums": "a" * 32 + "b" * 32,
    }
    layout = {
        "version": 1,
        "algo": "xxh3_128",
        "saved_by": {"world_size": 2},
        "values": {"lr": {"v": 0.1}} if rank == 0 else {},
        "tensors": {"w": {"dtype": "F32", "shape": [2 * rows, 3], "chunks": [chunk]}},
    }
    return {
        "p": {"tensors": {"w": {"dtype": "F32", "shape": [8, 3]}}, "tables": {}, "layout": layout, "kind": "module"}
    }


def test_merge_unions_chunks_of_the_same_component_and_keeps_other_sections():
    components: dict = {"learner-0/rng": {"tensors": {}}}
    merge_components(components, part(0))
    merge_components(components, part(1))
    merge_components(components, part(1))  # a replica reported twice is kept once
    layout = Layout.from_json(components["p"]["layout"], "s/p")
    assert [c.offsets for c in layout.tensors["w"].chunks] == [(0, 0), (4, 0)]
    assert layout.values == {"lr": {"v": 0.1}}
    assert "learner-0/rng" in components and components["p"]["kind"] == "module"


def test_merge_refuses_ranks_that_disagree_on_a_tensor():
    a, b = part(0), part(1)
    b["p"]["layout"]["tensors"]["w"]["dtype"] = "F16"
    components = merge_components({}, a)
    with pytest.raises(CorruptSnapshotError, match="disagree on tensor 'w'"):
        merge_components(components, b)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda c: c.update(sizes=[9, 3]), "runs past shape"),
        (lambda c: c.update(checksums="a" * 32), "block checksums"),
        (lambda c: c.update(checksums="a" * 33), "malformed"),
        (lambda c: c.update(start=-1), "malformed"),
        (lambda c: c.update(extra=1), "exactly"),
        (lambda c: c.update(offsets=[0]), "do not match shape"),
    ],
)
def test_layout_json_is_checked(mutate, message):
    bad = copy.deepcopy(part(0))["p"]["layout"]
    mutate(bad["tensors"]["w"]["chunks"][0])
    with pytest.raises(CorruptSnapshotError, match=message):
        Layout.from_json(bad, "step_000000001/p")


def test_layout_refuses_paths_outside_the_snapshot():
    bad = part(0)["p"]["layout"]
    bad["tensors"]["w"]["chunks"][0]["file"] = "../../etc/passwd"
    with pytest.raises(UnsafePathError):
        Layout.from_json(bad, "step_000000001/p")


def test_a_missing_rank_part_is_caught():
    only_rank_0 = Layout.from_json(part(0)["p"]["layout"], "s/p")
    with pytest.raises(CorruptSnapshotError, match="cover 12 of 24 elements"):
        only_rank_0.check_complete("step_000000001/p")
    both = Layout.from_json(merge_components(merge_components({}, part(0)), part(1))["p"]["layout"], "s/p")
    both.check_complete("step_000000001/p")
    both.tensors["w"].chunks.append(both.tensors["w"].chunks[0])
    with pytest.raises(CorruptSnapshotError, match="overlap"):
        both.check_complete("step_000000001/p")
