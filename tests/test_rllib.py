"""RLlib (new API stack) through rl_ckpt: a real PPO on CartPole-v1 with 2 EnvRunners, an EnvRunner and then the
driver SIGKILLed, the run rebuilt and restored from the snapshot the coordinator chose (exactly: the next iteration
is bitwise the killed run's), RLlib's own restore checked the same way, a flipped byte making the restore fall
back; plus the state conversion rules alone.

The drill's drivers start their own local Ray (``ray.init(address="local", num_cpus=2)``) in subprocesses that
are SIGKILLed, so this file does not use the session's cluster and runs beside it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from rl_ckpt import CheckpointEngine
from rl_ckpt.errors import ConfigError, SerializationError
from rl_ckpt.integrations.rllib import (
    NONE_KEY,
    AlgorithmPart,
    checkpoint_callback,
    component_names,
    from_stored,
    learner_value,
    to_storable,
    train_metrics,
)


def test_none_keys_round_trip_and_a_clash_is_refused():
    state = {"MeanStdFilter": {None: {"mean": np.arange(3.0), "n": 7}}, "lst": [{None: 1}]}
    stored = to_storable(state)
    assert list(stored["MeanStdFilter"]) == [NONE_KEY] and stored["lst"] == [{NONE_KEY: 1}]
    back = from_stored(stored)
    assert list(back["MeanStdFilter"]) == [None] and back["lst"] == [{None: 1}]
    with pytest.raises(SerializationError, match="a/b") as err:
        to_storable({"a": {"b": {None: 1, NONE_KEY: 2}}})
    assert err.value.key == "a/b"


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _text(array_bytes: bytes) -> str:
    import base64
    import zlib

    return base64.b64encode(zlib.compress(array_bytes)).decode("ascii")


def _npy(array, allow_pickle=False) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=allow_pickle)
    return buf.getvalue()


def test_arrays_rllib_keeps_as_text_are_stored_as_arrays_and_what_would_unpickle_is_refused(tmp_path):
    """MeanStdFilter's arrays are base64/zlib .npy text in RLlib's state: stored as plain arrays, given back as text
    encoded from them; text NumPy's loader would unpickle is refused at save and at restore, naming the key."""
    from ray.rllib.utils.serialization import _deserialize_ndarray, _serialize_ndarray

    from rl_ckpt.errors import CorruptSnapshotError
    from rl_ckpt.integrations.rllib import NPY_KEY

    mean = np.arange(4, dtype=np.float32)
    state = {"MeanStdFilter": {None: {"running_stats": [{"mean_array": _serialize_ndarray(mean), "n": 3}]}}}
    stored = to_storable(state, component="algorithm")
    leaf = stored["MeanStdFilter"][NONE_KEY]["running_stats"][0]["mean_array"]
    assert list(leaf) == [NPY_KEY] and leaf[NPY_KEY].tobytes() == mean.tobytes()
    back = from_stored(stored)["MeanStdFilter"][None]["running_stats"][0]
    assert _deserialize_ndarray(back["mean_array"]).tobytes() == mean.tobytes() and back["n"] == 3
    # text RLlib's decoder reads leniently (it drops characters outside base64's alphabet): so does the check
    marker = tmp_path / "ran"
    hostile = [
        _text(_npy(np.array([_Payload(str(marker))], dtype=object), allow_pickle=True)),
        _text(__import__("pickle").dumps(_Payload(str(marker)))),
    ]
    hostile.append("!" + hostile[0][:9] + "\n" + hostile[0][9:])
    for text in hostile:
        with pytest.raises(SerializationError, match="unpickle") as err:
            to_storable({"f": {"mean_array": text}}, component="algorithm")
        assert (err.value.component, err.value.key) == ("algorithm", "f/mean_array")
        with pytest.raises(CorruptSnapshotError, match="f/mean_array"):
            from_stored({"f": {"mean_array": text}}, component="algorithm")
        with pytest.raises(CorruptSnapshotError, match="f/mean_array"):
            from_stored({"f": {"mean_array": {NPY_KEY: text}}}, component="algorithm")
    assert not marker.exists()
    with pytest.raises(SerializationError, match=NPY_KEY):
        to_storable({"x": {NPY_KEY: 1}})
    assert to_storable({"name": "mean", "n": "not base64 at all"}) == {"name": "mean", "n": "not base64 at all"}


def test_verify_names_text_that_would_unpickle_and_leaves_rl_ckpt_bytes_alone():
    from rl_ckpt._format.npy_payload import unsafe_strings

    evil = _text(_npy(np.array([{"a": 1}], dtype=object), allow_pickle=True))
    plain = _text(_npy(np.arange(3.0)))
    found = unsafe_strings({"a": [plain, {"$bytes": evil}, evil], "b": _text(__import__("pickle").dumps(1))})
    assert [key for key, _ in found] == ["a/2", "b"]


def test_explicit_rules_names_and_metrics():
    assert learner_value("should_module_be_updated", {"p2", "p1"}) == ["p1", "p2"]
    assert learner_value("should_module_be_updated", None) is None
    assert component_names(["default_policy", "agent.1", "agent/1"]) == {
        "default_policy": "module-default_policy",
        "agent.1": "module-agent_1",
        "agent/1": "module-agent_1-2",
    }
    result = {"env_runners": {"episode_return_mean": np.float64(21.5), "episode_len_mean": float("nan")}}
    assert train_metrics(result) == {"env_runners/episode_return_mean": 21.5}
    with pytest.raises(ConfigError):
        checkpoint_callback(base_dir="/tmp/x", keep_latest=0)


class _FakeAlgo:
    """Only for the codec path: an object whose state RLlib-like parts expose."""

    def __init__(self, state):
        self.state = state


def test_parts_through_the_engine_convert_none_keys_and_refuse_objects(tmp_path):
    algo = _FakeAlgo({"MeanStdFilter": {None: {"mean": np.arange(4.0), "count": np.int64(9)}}})
    part = AlgorithmPart(algo, "other", lambda a: a.state, lambda a, s: setattr(a, "state", s), "connectors")
    with CheckpointEngine(base_dir=str(tmp_path), run_name="r", save_interval_steps=1) as engine:
        engine.register("algorithm", part, kind="other")
        engine.save(1)
        algo.state = {}
        engine.restore()
        restored = algo.state["MeanStdFilter"][None]
        assert restored["mean"].tobytes() == np.arange(4.0).tobytes() and restored["count"] == np.int64(9)
        algo.state = {"env_runner": {"connector": {"fn": object()}}}
        with pytest.raises(SerializationError) as err:
            engine.save(2)
        assert err.value.component == "algorithm" and err.value.key == "env_runner/connector/fn"


@pytest.mark.ray
@pytest.mark.slow
def test_ppo_env_runner_and_driver_killed_restore_and_fallback(tmp_path, capsys):
    from rl_ckpt.cli import main as cli
    from rl_ckpt.demo.rllib_drill import run_driver

    cfg = dict(
        base_dir=str(tmp_path),
        run_name="ppo",
        every=2,
        log=str(tmp_path / "log.jsonl"),
        until=6,
        kill_runner_at=3,
        stop_at=5,
        rllib_save_every=2,
        rllib_path=str(tmp_path / "rllib_ckpt"),
    )
    first = run_driver(cfg, kill_when_ready=True)
    iters = {e["iteration"]: e for e in first if e["event"] == "iter"}
    assert sorted(iters) == [1, 2, 3, 4, 5]
    killed = next(e for e in first if e["event"] == "runner_killed")
    replaced = next(e for e in first if e["event"] == "runner_replaced")
    # RLlib replaced the EnvRunner; the new one got its connector state (MeanStdFilter) from the live driver.
    assert killed["pid"] not in replaced["pids"] and len(replaced["pids"]) == 2
    assert replaced["runner_connectors"] == [replaced["local_connector"]] * 2
    assert iters[5]["runner_connectors"] == [iters[5]["local_connector"]] * 2

    # The driver was SIGKILLed after iteration 5; the rebuilt one restores step 4 (the newest verified snapshot).
    second = run_driver(dict(cfg, until=8, kill_runner_at=None, stop_at=None, rllib_save_every=2, corrupt_newest=True))
    built = second[0]
    assert built["event"] == "built" and built["restored"] == "step_000000004" and built["iteration"] == 4
    assert "newest valid full snapshot" in built["plan"] and "module-default_policy" in built["plan"]
    # Right after the restore the learner (weights, optimizer, sequence number) and the connector states equal,
    # bitwise, what the killed driver held at iteration 4; so does RLlib's own restore_from_path of iteration 4.
    assert built["learner"] == iters[4]["learner"] and built["connectors"] == iters[4]["connectors"]
    assert built["runner_weights"] == [True, True]  # the EnvRunners sample with the restored weights
    # The sampled-steps counter: the saved one on the Algorithm, its EnvRunner and both remote ones.
    assert built["lifetimes"] == iters[4]["lifetimes"] == [4 * 256.0] * 4
    assert not built["warnings"], built["warnings"]  # the EnvRunners' sampling state came back: an exact resume
    after = {e["iteration"]: e for e in second if e["event"] == "iter"}
    assert sorted(after) == [5, 6, 7, 8]
    # Exact: iteration 5 of the resumed run is bitwise the killed run's iteration 5.
    assert after[5]["learner"] == iters[5]["learner"] and after[5]["connectors"] == iters[5]["connectors"]
    theirs = next(e for e in second if e["event"] == "rllib_restored")  # RLlib's restore_from_path of iteration 4
    assert theirs["learner"] == iters[4]["learner"] and theirs["connectors"] == iters[4]["connectors"]

    # A flipped byte in the newest snapshot (8): the plan says why it is skipped, the restore falls back to 6
    # (a rollback of the live Algorithm).
    fb = next(e for e in second if e["event"] == "fallback")
    assert fb["corrupted"] == "step_000000008" and fb["restored"] == "step_000000006"
    assert fb["learner"] == after[6]["learner"]
    assert fb["runner_weights"] == [True, True]  # rolled back from 8: the EnvRunners got iteration 6's weights
    line = next(ln for ln in fb["plan"].splitlines() if "step_000000008" in ln and "step 8" in ln)
    assert "checksum" in line, fb["plan"]
    assert fb["resumed_iteration"] == 7 and fb["resumed"] == after[7]["learner"]  # the rollback resumes exactly

    # The same flipped byte in RLlib's checkpoint of iteration 8: RLlib has no checksum, it raises or loads
    # other numbers than it saved (the figure docs/rllib.md shows); it never falls back.
    theirs = next(e for e in second if e["event"] == "rllib_corrupt")
    assert theirs["outcome"].startswith("raised") or theirs["learner"] != after[8]["learner"], theirs

    run = os.path.join(str(tmp_path), "ppo")
    capsys.readouterr()
    assert cli(["ls", run]) == 0
    assert "step_000000006" in capsys.readouterr().out
    assert cli(["verify", run, "step_000000006"]) == 0
    assert cli(["plan", run]) == 0
    assert "step_000000006" in capsys.readouterr().out
    assert cli(["timeline", run, "-o", str(tmp_path / "t.png")]) == 0
    assert os.path.getsize(tmp_path / "t.png") > 0
    json.dumps(second)  # the log holds plain data


def test_saving_every_iteration_resumes_bitwise_as_the_run_without_checkpoints(tmp_path):
    """With a save at every iteration, the call that takes a save's EnvRunner state also arms them for the next
    save, and the answers are collected by the save's writer: a run restored from iteration 3 trains iterations 4
    and 5 bitwise as a run that never checkpointed."""
    from rl_ckpt.demo.rllib_drill import run_driver

    reference = run_driver(dict(base_dir=str(tmp_path), log=str(tmp_path / "reference.jsonl"), until=5))
    cfg = dict(base_dir=str(tmp_path), run_name="ppo", every=1, log=str(tmp_path / "log.jsonl"))
    first = run_driver(dict(cfg, until=3))
    resumed = run_driver(dict(cfg, until=5))
    ref = {e["iteration"]: e for e in reference if e["event"] == "iter"}
    saved = {e["iteration"]: e for e in first if e["event"] == "iter"}
    after = {e["iteration"]: e for e in resumed if e["event"] == "iter"}
    for i in (1, 2, 3):  # the checkpointed run is the reference run (connectors: the samples it merged)
        assert saved[i]["connectors"] == ref[i]["connectors"], (i, saved[i]["runner_connectors"])
        assert saved[i]["learner"] == ref[i]["learner"], _learners_differ(i, saved, ref)
    built = resumed[0]
    assert built["event"] == "built" and built["restored"] == "step_000000003", built
    assert not built["warnings"], built["warnings"]  # the EnvRunners' sampling state came back: exact
    assert (built["learner"], built["connectors"]) == (saved[3]["learner"], saved[3]["connectors"])  # restored
    assert built["learner_detail"] == saved[3]["learner_detail"]  # and the KL coefficients and random streams
    assert sorted(after) == [4, 5]
    for i in (4, 5):  # what the EnvRunners sampled (merged into the connectors), then what the learner made of it
        assert after[i]["connectors"] == ref[i]["connectors"], (i, after[i]["runner_connectors"])
        assert after[i]["learner"] == ref[i]["learner"], _learners_differ(i, after, ref)


def _learners_differ(i: int, run: dict, reference: dict) -> str:
    """Which parts of the learner differ at iteration ``i``, and what the iteration before left for it."""
    lines = [f"iteration {i}: the learner differs from the reference run's"]
    for at in (i - 1, i):
        if at in run and at in reference:
            mine, theirs = run[at]["learner_detail"], reference[at]["learner_detail"]
            diff = {k: (mine.get(k), theirs.get(k)) for k in sorted({*mine, *theirs}) if mine.get(k) != theirs.get(k)}
            lines.append(f"  after iteration {at}: " + (f"differs in {diff}" if diff else "the same"))
    return "\n".join(lines)
