"""Failure and decision records are named by the recorder, never by a field of the request."""

from __future__ import annotations

import os

import pytest

from rl_ckpt.errors import CheckpointError
from rl_ckpt._recovery.coordinator import Action, Decision, FailureInfo
from rl_ckpt._recovery.history import load_decisions, load_failures, record_decision, record_failure
from rl_ckpt._run.layout import timed_record_stem
from rl_ckpt._storage import open_storage

HOSTILE = [
    "/abs/escape",
    "../../outside",
    "..",
    "a/b",
    "x\x00y",
    "C:\\windows\\x",
    "2026-01-01T00:00:00+00:00/../../x",
    " ",
    "",
    "é" * 300,
    "t" * 5000,
]


def files_under(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _s, fs in os.walk(root) for f in fs)


@pytest.mark.parametrize("time", HOSTILE)
def test_a_failure_time_never_names_a_file(tmp_path, time):
    run = tmp_path / "run"
    storage = open_storage(str(run))
    failure = FailureInfo("exception", 3, "boom", participant="../learner-0", time=time)
    path = record_failure(storage, failure)
    files = files_under(tmp_path)
    assert files == [f"run/{path}"] and path.startswith("failures/") and path.count("/") == 1, files
    assert path.endswith("-exception.json")
    assert load_failures(storage) == [failure.to_json()]  # the field is kept as data
    assert record_failure(storage, failure) == path and files_under(tmp_path) == files  # a retry: nothing new


@pytest.mark.parametrize("time", HOSTILE[:4])
def test_a_decision_time_never_names_a_file(tmp_path, time):
    storage = open_storage(str(tmp_path / "run"))
    decision = Decision(Action.restore_latest, "step_000000002", 2, "newest", FailureInfo("exception", 3), time=time)
    path = record_decision(storage, decision)
    assert path.startswith("decisions/") and path.count("/") == 1 and path.endswith("-restore_latest.json")
    assert files_under(tmp_path) == [f"run/{path}"]
    assert [d.to_json() for d in load_decisions(storage)] == [decision.to_json()]


def test_two_failures_get_two_records_and_names_sort_by_recording(tmp_path):
    storage = open_storage(str(tmp_path / "run"))
    first = record_failure(storage, FailureInfo("exception", 3, time="/abs/escape"))
    second = record_failure(storage, FailureInfo("exception", 4, time="/abs/escape"))
    assert first < second and [f["step"] for f in load_failures(storage)] == [3, 4]


@pytest.mark.parametrize(
    "time,what",
    [("/abs/escape", "exception"), ("2026-01-01T00:00:00+00:00", "../x"), ("2026-01-01T00:00:00+00:00", "a/b")],
)
def test_record_stems_refuse_anything_but_a_time_and_a_word(time, what):
    with pytest.raises(CheckpointError, match="not a record name"):
        timed_record_stem(time, what)
