"""Ranks that did not exist at save (``new_rank_state``): the rule, its plan line, and a 2 -> 3 FSDP2
restore in real gloo processes under each of derive, empty and error (2 -> 4 on Ray Train:
``test_new_ranks_ray_train.py``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import new_rank_workers as nw
import sharded_workers as w
from rl_ckpt import RNGState
from rl_ckpt._format.manifest import FileEntry, Manifest
from rl_ckpt._recovery.new_ranks import derive_seed, new_rank_gaps, plan_lines

STORED = [
    "shared/optim",
    "policy",
    "learner-0/rng",
    "learner-1/rng",
    "learner-0/replay_buffer",
    "learner-1/replay_buffer",
    "rollout-0/rng",
]
GROUP = [f"learner-{r}" for r in range(4)]
PER_RANK = {"rng": True, "replay_buffer": False}


def test_the_rule_names_the_new_ranks_and_what_they_get():
    assert plan_lines(dict.fromkeys(STORED), GROUP, PER_RANK, "derive") == [
        "learner-2, learner-3: no saved rng; derived from the saved streams of learner-0, learner-1 and the rank's "
        "name (new_rank_state='derive')",
        "learner-2, learner-3: no saved replay_buffer; starts as constructed (it has no derive_state())",
    ]
    assert plan_lines(dict.fromkeys(STORED), GROUP, PER_RANK, "empty")[0] == (
        "learner-2, learner-3: no saved rng; starts as constructed (new_rank_state='empty')"
    )
    assert (
        "the restore refuses (new_rank_state='error')" in plan_lines(dict.fromkeys(STORED), GROUP, PER_RANK, "error")[0]
    )
    # Same or fewer ranks: nothing is new. A component no rank saved is a missing one, not a new rank's.
    assert plan_lines(dict.fromkeys(STORED), GROUP[:2], PER_RANK, "derive") == []
    assert plan_lines(dict.fromkeys(STORED), GROUP[:1], PER_RANK, "derive") == []
    assert new_rank_gaps(STORED, GROUP, {"env": False}, "derive") == []
    # Other roles' keys do not count (rollout-0/rng says nothing about learners); ranks sort as numbers.
    gaps = new_rank_gaps(
        ["learner-10/rng", "learner-9/rng"], [f"learner-{r}" for r in range(12)], {"rng": True}, "derive"
    )
    assert gaps[0].saved_by == ("learner-9", "learner-10") and gaps[0].new[:2] == ("learner-0", "learner-1")


def manifest(checksums: dict[str, str]) -> Manifest:
    files = [
        FileEntry(f"{key.replace('/', '.')}.json", 10, digest, "xxh3_128", key, "json")
        for key, digest in checksums.items()
    ]
    return Manifest(
        snapshot_id="step_000000002",
        global_step=2,
        kind="full",
        created_at="2026-01-01T00:00:00Z",
        files=files,
        components={k: {} for k in checksums},
    )


def test_derived_seeds_follow_the_saved_streams_and_the_rank():
    gap = new_rank_gaps(STORED, GROUP, PER_RANK, "derive")[0]
    m = manifest({"learner-0/rng": "aa", "learner-1/rng": "bb"})
    seed = derive_seed(m, gap, "learner-2")
    assert seed == derive_seed(manifest({"learner-0/rng": "aa", "learner-1/rng": "bb"}), gap, "learner-2")
    assert seed != derive_seed(m, gap, "learner-3")
    assert seed != derive_seed(manifest({"learner-0/rng": "aa", "learner-1/rng": "bc"}), gap, "learner-2")


def test_rng_state_derives_every_stream_deterministically():
    def fingerprint(seed: bytes) -> list:
        explore, gen = np.random.default_rng(0), torch.Generator().manual_seed(0)
        RNGState(numpy_generators={"explore": explore}, torch_generators={"g": gen}).derive_state(seed)
        import random

        return [
            random.random(),
            np.random.rand(),
            torch.rand(1).item(),
            explore.random(),
            torch.rand(1, generator=gen).item(),
        ]

    a, b, c = fingerprint(b"x" * 32), fingerprint(b"x" * 32), fingerprint(b"y" * 32)
    assert a == b and all(x != y for x, y in zip(a, c))
    assert len(set(a)) == 5  # every stream seeded on its own


@pytest.fixture(scope="module")
def restored(tmp_path_factory):
    out = tmp_path_factory.mktemp("new_ranks")
    run = out / "run"
    mp.spawn(nw.two_then_three, args=(w.free_port(), w.free_port(), str(run), str(out)), nprocs=3)
    return [json.loads((out / f"restored_{r}.json").read_text()) for r in range(3)]


def test_two_rank_snapshot_restores_on_three_under_each_rule(restored):
    # (The ranks assert the state itself: old ranks bitwise, new ranks derived, distinct, repeatable, empty.)
    line = (
        "  new ranks: learner-2: no saved rng; derived from the saved streams of learner-0, learner-1 "
        "and the rank's name (new_rank_state='derive')"
    )
    for report in restored:
        assert line in report["derive_plan"].splitlines(), report["derive_plan"]
        assert "no saved replay_buffer; starts as constructed" in report["derive_plan"]
        assert "no saved rng; starts as constructed (new_rank_state='empty')" in report["empty_plan"]
        assert "the restore refuses (new_rank_state='error')" in report["error_plan"]
    for rank in (2,):
        kind, msg = restored[rank]["error"]
        assert kind == "StateMismatchError" and f"learner-{rank} has no saved rng, replay_buffer" in msg, msg
        assert "learner-0, learner-1 only" in msg and "new_rank_state" in msg
    for rank in (0, 1):  # the ranks that could load refuse with the others, naming them
        kind, msg = restored[rank]["error"]
        assert kind == "RestoreError" and "rank 2: " in msg and "learner-2 has no saved rng" in msg, msg
