"""The run folder's layout (rl_ckpt/_run/layout.py) and the JSON record store (rl_ckpt/_run/records.py)."""

from __future__ import annotations

import json
import logging

import pytest

from rl_ckpt.errors import CheckpointError
from rl_ckpt._run import layout
from rl_ckpt._commit import ManifestLastCommit, StagedRenameCommit
from rl_ckpt._run.records import RecordStore
from rl_ckpt._storage import open_storage


@pytest.fixture
def storage(tmp_path):
    s = open_storage(str(tmp_path / "run"))
    yield s
    s.close()


@pytest.mark.parametrize(
    "name, expected",
    [
        ("step_000000005.host-1-2-ab", ("step_000000005", "host-1-2-ab")),
        ("step_000000005.light.host-1-2-ab", ("step_000000005.light", "host-1-2-ab")),
        ("step_000000005.b2.light.x", ("step_000000005.b2.light", "x")),
        ("step_000000005", None),
        ("step_5.x", None),
        ("step_000000005.", None),
        ("other.x", None),
    ],
)
def test_staged_names_parse_back(name, expected):
    assert layout.parse_staged_name(name) == expected


def test_uncommitted_attempts_are_found_where_the_strategies_put_them(storage):
    staged = StagedRenameCommit(storage).begin("step_000000001.light")
    in_place = ManifestLastCommit(storage).begin("step_000000002.b1")
    assert staged == layout.staged_attempt("step_000000001.light", staged.attempt_id)
    assert in_place == layout.in_place_attempt("step_000000002.b1", in_place.attempt_id)
    assert sorted(layout.uncommitted_attempts(storage), key=lambda a: a.snapshot_id) == [staged, in_place]
    StagedRenameCommit(storage).commit(staged, b"{}")
    ManifestLastCommit(storage).commit(in_place, b"{}")
    assert layout.uncommitted_attempts(storage) == []  # committed: no longer attempts
    assert layout.committed_data_prefix(staged) == "step_000000001.light"
    assert layout.committed_data_prefix(in_place) == in_place.data_prefix
    assert storage.exists(layout.manifest_path("step_000000002.b1"))


def test_snapshot_folders_skip_reserved_and_foreign_names(storage):
    for name in ("step_000000001", "step_0000000001", ".staging", ".trash", "objects", "best"):
        storage.makedirs(name)
    storage.write_atomic("step_000000003", b"a file, not a folder")
    assert [e.name for e in layout.snapshot_folders(storage)] == ["step_000000001"]


def test_record_paths():
    assert layout.best_alias_path("eval/reward") == "best/eval_reward.json"
    assert layout.best_alias_path("..") == "best/metric.json"
    assert layout.quarantine_path("step_000000001") == "quarantine/step_000000001.json"
    assert layout.retired_path("step_000000001") == "history/retired/step_000000001.json"
    assert layout.timed_record_stem("2026-01-01T00:00:00.000001+00:00", "oom") == "2026-01-01T000000.000001p0000-oom"


def test_records_are_create_only_and_retries_are_idempotent(storage):
    store = RecordStore(storage, layout.FAILURES)
    first = store.add("t-oom", {"kind": "oom", "step": 1})
    assert store.add("t-oom", {"kind": "oom", "step": 1}) == first  # a retried call: nothing new
    second = store.add("t-oom", {"kind": "oom", "step": 2})  # another record of the same name is kept too
    assert (first, second) == ("failures/t-oom.json", "failures/t-oom-2.json")
    assert store.names() == ["t-oom-2.json", "t-oom.json"]
    assert sorted(r["step"] for r in store.load()) == [1, 2]
    with pytest.raises(ValueError):
        store.add("nan", {"x": float("nan")})  # never written as non-standard JSON


def test_bad_records_are_skipped_with_a_warning(storage, caplog):
    store = RecordStore(storage, layout.DECISIONS, "decision record")
    store.add("a", {"n": 1})
    storage.makedirs(layout.DECISIONS)
    for name, body in (
        ("b.json", b"[1, 2]"),
        ("c.json", b"[" * 100000),
        ("d.json", b'{"n": "x"}'),
        ("e.txt", b'{"n": 5}'),
    ):
        storage.write_atomic(f"{layout.DECISIONS}/{name}", body)

    def parse(record: dict) -> int:
        if type(record["n"]) is not int:
            raise TypeError("n is not an int")
        return record["n"]

    with caplog.at_level(logging.WARNING, logger="rl_ckpt"):
        assert store.load(parse) == [1]
    warned = " ".join(r.getMessage() for r in caplog.records)
    for name in ("b.json", "c.json", "d.json"):
        assert f"decision record decisions/{name}" in warned
    assert "e.txt" not in warned
    with pytest.raises(CheckpointError, match="c.json"):
        store.read("c.json")
    assert json.loads(bytes(storage.read(f"{layout.DECISIONS}/a.json"))) == {"n": 1}
