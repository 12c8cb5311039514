"""One save decision per step and per snapshot for every participant of a managed run, by the manager's
clock, kept on storage so a restarted manager answers the same (actors/decisions.py).

The first tests drive the decision logic with a fake clock on a real local folder; the Ray tests run two
ranks through a real manager, one of them with a clock that runs slow, and kill the manager between two
ranks' questions."""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest

from actors.decisions import FOLDER, SaveDecisions
from rl_ckpt.storage.local import LocalStorage


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _decisions(root, clock, wall=None):
    return SaveDecisions(LocalStorage(str(root)), clock=clock, wall=wall or (lambda: 1_000_000.0 + clock.now))


def _never_started(sid: str) -> bool:
    return False


def test_first_asker_decides_each_step_for_everyone_by_the_managers_clock(tmp_path):
    clock = Clock()
    d = _decisions(tmp_path, clock)
    ask = lambda step, who, busy=False, kind=None: d.step(step, who, kind, busy, 10.0, _never_started)  # noqa: E731
    assert ask(1, "learner-0") == {"kind": None, "save": False}  # the interval starts at the first question
    clock.now += 9.0
    assert ask(2, "learner-0") == {"kind": None, "save": False}
    clock.now += 2.0  # the interval has elapsed by the time the slow rank asks about step 2: still not due
    assert ask(2, "learner-1") == {"kind": None, "save": False}
    assert ask(3, "learner-1") == {"kind": "full", "save": True}
    assert ask(3, "learner-0") == {"kind": "full", "save": True}
    # The interval counts from the save decided; a step-count kind is taken as given.
    assert ask(4, "learner-0", kind="light") == {"kind": "light", "save": True}
    clock.now += 10.0
    assert ask(5, "learner-0", busy=True, kind="light") == {"kind": "full", "save": False}  # due, busy: skipped
    assert ask(5, "learner-1") == {"kind": "full", "save": False}
    assert ask(6, "learner-1") == {"kind": "full", "save": True}  # still due at the next step
    assert d.get("step_000000005") == ("skip", "learner-0") and d.get("step_000000006") == ("save", "learner-1")


def test_a_restarted_manager_answers_what_was_answered_before(tmp_path):
    clock = Clock()
    d = _decisions(tmp_path, clock)
    for step in range(1, 6):  # one step a second: the horizon runs ahead of the answered steps
        assert d.step(step, "learner-0", None, False, 32.0, _never_started)["save"] is False
        clock.now += 1.0
    assert d.decide("step_000000004.light", "skip", "learner-0") == ("skip", "learner-0")

    clock.now += 100.0  # restarted long after: every interval has elapsed
    again = _decisions(tmp_path, clock)
    # Steps some rank was told were not due stay not due; the recorded skip stays a skip.
    for step in range(1, 6):
        answer = again.step(step, "learner-1", "light" if step == 4 else None, False, 32.0, _never_started)
        assert answer == ({"kind": "light", "save": False} if step == 4 else {"kind": None, "save": False})
    assert again.decide("step_000000004.light", "save", "learner-1") == ("skip", "learner-0")
    # A later step is decided by the new process's clock.
    later = [again.step(s, "learner-1", None, False, 32.0, _never_started) for s in range(6, 10)]
    assert {"kind": "full", "save": True} in later


def test_the_interval_goes_on_from_the_last_full_save_across_a_restart(tmp_path):
    clock = Clock()
    d = _decisions(tmp_path, clock)
    assert d.step(1, "learner-0", "full", False, 10.0, _never_started) == {"kind": "full", "save": True}
    clock.now += 6.0
    again = _decisions(tmp_path, clock)
    assert again.step(2, "learner-0", None, False, 10.0, _never_started)["save"] is False
    clock.now += 5.0  # 11 s after the save, though only 5 s after the restart
    assert again.step(3, "learner-0", None, False, 10.0, _never_started) == {"kind": "full", "save": True}


def test_first_decision_wins_on_storage_and_planted_records_are_ignored(tmp_path):
    clock = Clock()
    storage = LocalStorage(str(tmp_path))
    storage.makedirs(FOLDER)
    for name, body in (("step_000000003.json", b"[" * 5000), ("step_000000002.json", b'{"decision": 5}'),
                       ("horizon-x.json", b"{}"), ("notes.txt", b"hello")):
        with open(os.path.join(tmp_path, FOLDER, name), "wb") as f:
            f.write(body)
    d = _decisions(tmp_path, clock)  # never raises because of what the folder holds
    assert d.get("step_000000003") is None
    assert d.decide("step_000000003", "save", "learner-0") == ("save", "learner-0")
    # Two manager processes racing (the old one still finishing a call): create-only, the first wins.
    other = _decisions(tmp_path, clock)
    assert other.decide("step_000000007", "skip", "learner-1") == ("skip", "learner-1")
    assert d.decide("step_000000007", "save", "learner-0") == ("skip", "learner-1")
    body = json.loads((tmp_path / FOLDER / "step_000000007.json").read_bytes())
    assert body["decision"] == "skip" and body["by"] == "learner-1" and body["step"] == 7


def test_records_older_than_the_newest_commit_are_removed_and_a_plan_removes_all(tmp_path):
    clock = Clock()
    d = _decisions(tmp_path, clock)
    for step in range(1, 40):
        d.step(step, "learner-0", "full" if step % 10 == 0 else None, False, 1000.0, _never_started)
        clock.now += 1.0
    d.forget_before(30)
    left = sorted(os.listdir(tmp_path / FOLDER))
    assert "step_000000030.json" in left and not any(n.startswith("step_00000001") for n in left)
    assert len([n for n in left if n.startswith("horizon-")]) == 1
    assert d.step(35, "learner-1", None, False, 1000.0, _never_started) == {"kind": None, "save": False}
    d.clear()  # training goes on from an older snapshot: its steps are decided anew
    assert os.listdir(tmp_path / FOLDER) == []
    assert d.step(20, "learner-0", "full", False, 1000.0, _never_started) == {"kind": "full", "save": True}
