"""RLlib restores through rl_ckpt, on the session's Ray cluster: PPO on CartPole-v1 with one remote EnvRunner and a
``MeanStdFilter``, snapshots after iterations 1 and 2, then two more iterations: the uninterrupted run.

- A fresh Algorithm restored from iteration 2 reads the saved sampled-steps counter right after the restore (on
  the Algorithm, its own EnvRunner and the remote one) and trains iterations 3 and 4 bitwise as the uninterrupted
  run did: the EnvRunner's environment, episodes and random streams, and PPO's KL coefficient, came back.
- A forged snapshot: ``MeanStdFilter``'s stored array replaced, as anyone who can write the storage can (checksums
  resealed), by text RLlib would hand to ``np.load(allow_pickle=True)`` whose unpickling creates a marker file.
  ``rl-ckpt verify`` refuses it naming the component and the key, the restore refuses it naming the key and
  falls back to iteration 1, and the marker never appears.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import shutil
import types
import zlib

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.ray]

LIFETIME = ("env_runners", "num_env_steps_sampled_lifetime")


class Payload:
    """Unpickling this creates a marker file: proof that something unpickled checkpoint data."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _config():
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.connectors.env_to_module.mean_std_filter import MeanStdFilter

    from rl_ckpt.demo.rllib_drill import waits_for_every_answer

    return waits_for_every_answer(
        PPOConfig()
        .environment("CartPole-v1")
        .env_runners(
            num_env_runners=1,
            num_envs_per_env_runner=1,
            env_to_module_connector=lambda env, spaces, device: MeanStdFilter(),
        )
        .training(train_batch_size_per_learner=128, minibatch_size=64, num_epochs=1)
        .debugging(seed=7, log_level="ERROR")
    )


def _lifetimes(algo) -> list:
    remote = algo.env_runner_group.foreach_env_runner(
        lambda r: r.num_env_steps_sampled_lifetime, local_env_runner=False
    )
    return [algo.metrics.peek(LIFETIME), algo.env_runner.num_env_steps_sampled_lifetime, *remote]


@pytest.fixture(scope="module")
def run(ray_cluster, tmp_path_factory):
    from rl_ckpt import CheckpointEngine
    from rl_ckpt.demo.rllib_drill import digest, learner_state
    from rl_ckpt.integrations.rllib import register_algorithm

    base = tmp_path_factory.mktemp("rllib_restore")
    algo = _config().build_algo()
    try:
        with CheckpointEngine(base_dir=str(base), run_name="ppo") as engine:
            register_algorithm(engine, algo)
            for iteration in (1, 2):
                algo.train()
                engine.save(iteration)
        saved_lifetime = algo.metrics.peek(LIFETIME)
        reference = {}
        for _ in range(2):
            result = algo.train()
            reference[algo.training_iteration] = (
                digest(learner_state(algo)),
                result["env_runners"]["episode_return_mean"],
            )
    finally:
        algo.stop()
    fresh = _config().build_algo()
    yield types.SimpleNamespace(base=base, lifetime=saved_lifetime, reference=reference, fresh=fresh)
    fresh.stop()


def _module_weights(algo) -> dict:
    learner = algo.learner_group._learner  # num_learners=0: the learner of this process
    return {k: v.clone() for k, v in learner.module["default_policy"].state_dict().items()}


def _stored(base, sid: str, component: str) -> dict:
    from rl_ckpt._core.reader import load_component
    from rl_ckpt._run.snapshot_files import read_manifest
    from rl_ckpt._storage import open_storage

    storage = open_storage(str(base / "ppo"))
    return load_component(storage, read_manifest(storage, sid), component)


def _stored_module(base, sid: str) -> dict:
    return _stored(base, sid, "module-default_policy")


def test_restore_is_exact_and_keeps_the_sampled_steps_counter(run, monkeypatch):
    from rl_ckpt import CheckpointEngine
    from rl_ckpt.demo.rllib_drill import digest, learner_state, local_connector, runner_connectors
    from rl_ckpt.integrations.rllib import register_algorithm, restore_algorithm

    algo = run.fresh
    lines: list[str] = []
    module_states = []
    set_state = algo.learner_group.set_state

    def recording(state, *args, **kwargs):
        module_states.append((state.get("learner") or {}).get("rl_module"))
        return set_state(state, *args, **kwargs)

    monkeypatch.setattr(algo.learner_group, "set_state", recording)
    with CheckpointEngine(base_dir=str(run.base), run_name="ppo") as engine:
        register_algorithm(engine, algo)
        result = restore_algorithm(algo, engine, out=lines.append)
    monkeypatch.undo()
    assert result.snapshot_id == "step_000000002" and algo.training_iteration == 2
    # The weights were read straight into the learner's module: RLlib's set_state had none left to copy.
    assert not [s for s in module_states if s], module_states
    stored = _stored_module(run.base, "step_000000002")
    got = _module_weights(algo)
    assert got.keys() == stored.keys() and all(torch.equal(got[k], torch.as_tensor(stored[k])) for k in got)
    assert run.lifetime == 256  # two iterations of 128 steps
    # RLlib syncs the EnvRunners from the Algorithm's counter: restored first, it is the saved one everywhere.
    assert _lifetimes(algo) == [run.lifetime] * 3
    # The remote EnvRunner holds the driver's restored connector state (MeanStdFilter), sent with the weights.
    assert runner_connectors(algo) == [local_connector(algo)]
    assert any("exact resume" in line for line in lines), lines
    for _ in range(2):
        result = algo.train()
        got = (digest(learner_state(algo)), result["env_runners"]["episode_return_mean"])
        assert got == run.reference[algo.training_iteration], algo.training_iteration


def _object_npy(marker: str) -> str:
    buf = io.BytesIO()
    np.save(buf, np.array([Payload(marker)], dtype=object), allow_pickle=True)
    return base64.b64encode(zlib.compress(buf.getvalue())).decode("ascii")


def _pickle_stream(marker: str) -> str:
    return base64.b64encode(zlib.compress(pickle.dumps(Payload(marker)))).decode("ascii")


def _find(tree, name: str, path: str = ""):
    """(parent, key, key path) of the first dict entry called ``name``."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k == name:
                return tree, k, f"{path}/{k}".lstrip("/")
            found = _find(v, name, f"{path}/{k}")
            if found:
                return found
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            found = _find(v, name, f"{path}/{i}")
            if found:
                return found
    return None


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(lambda m: _object_npy(m), id="object-array-npy"),
        pytest.param(lambda m: _pickle_stream(m), id="pickle-stream"),
        pytest.param(lambda m: {"rl_ckpt:npy": _object_npy(m)}, id="array-mark-holding-text"),
    ],
)
def test_forged_filter_state_is_refused_and_never_unpickled(run, tmp_path, capsys, forge):
    from rl_ckpt import CheckpointEngine
    from rl_ckpt._format.checksum import digest_bytes
    from rl_ckpt.cli import main as cli
    from rl_ckpt.integrations.rllib import register_algorithm, restore_algorithm
    from rl_ckpt.tools.fault_suite import reseal

    shutil.copytree(run.base / "ppo", tmp_path / "ppo")
    snap = tmp_path / "ppo" / "step_000000002"
    marker = tmp_path / "payload_ran"
    tree = json.loads((snap / "algorithm.json").read_text())
    parent, name, key = _find(tree, "mean_array")
    assert "MeanStdFilter" in key
    parent[name] = forge(str(marker))
    data = json.dumps(tree).encode()
    (snap / "algorithm.json").write_bytes(data)
    meta = json.loads((snap / "meta.json").read_text())
    meta.pop("manifest_checksum")
    entry = next(f for f in meta["files"] if f["path"] == "algorithm.json")
    entry["size"], entry["checksum"] = len(data), digest_bytes(entry["algo"], data)
    (snap / "meta.json").write_text(reseal(json.dumps(meta)))  # as anyone who can write the storage can

    capsys.readouterr()
    assert cli(["verify", str(tmp_path / "ppo")]) == 1
    out = capsys.readouterr().out
    assert "step_000000002" in out and "component 'algorithm'" in out and key in out, out
    assert not marker.exists()

    lines: list[str] = []
    with CheckpointEngine(base_dir=str(tmp_path), run_name="ppo") as engine:
        register_algorithm(engine, run.fresh)
        result = restore_algorithm(run.fresh, engine, out=lines.append)
    assert not marker.exists(), "the payload ran"
    assert result.snapshot_id == "step_000000001"
    why = result.skipped["step_000000002"]
    assert key in why and "component 'algorithm'" in why, why


def _moments(algo) -> dict:
    """(optimizer, parameter index, key) -> the learner's live optimizer state tensor (Adam's moments)."""
    learner = algo.learner_group._learner
    out = {}
    for name, optim in learner._named_optimizers.items():
        for index, per_param in optim.state_dict()["state"].items():
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    out[(name, index, key)] = value
    return out


def _stored_moments(base, sid: str) -> dict:
    state = _stored(base, sid, "optimizer")
    out = {}
    for name, entry in state.items():
        for index, per_param in entry["state"]["state"].items():
            for key, value in per_param.items():
                if isinstance(value, np.ndarray) and value.ndim > 0:
                    out[(name, index, key)] = torch.from_numpy(value)
    return out


@pytest.mark.parametrize("damaged", ["module-default_policy", "optimizer"])
def test_a_damaged_file_read_into_the_learner_falls_back_and_leaves_the_older_state(run, tmp_path, damaged):
    """The weights and the optimizer's moments are read straight into the learner's own tensors (the moments
    then stay in the very memory they had) and hashed as they land: a flipped byte in the newest snapshot's file
    is found after its bytes are in place, and the fallback's restore writes the older snapshot's state over them,
    bitwise."""
    from rl_ckpt import CheckpointEngine
    from rl_ckpt.integrations.rllib import register_algorithm, restore_algorithm

    algo = run.fresh
    if not _moments(algo):
        algo.train()  # an optimizer that has stepped: moments to read into
    before = {k: v.data_ptr() for k, v in _moments(algo).items()}
    assert before
    shutil.copytree(run.base / "ppo", tmp_path / "ppo")
    path = tmp_path / "ppo" / "step_000000002" / f"{damaged}.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) - 5] ^= 0xFF  # in the last tensor's bytes
    path.write_bytes(bytes(data))
    with CheckpointEngine(base_dir=str(tmp_path), run_name="ppo") as engine:
        register_algorithm(engine, algo)
        result = restore_algorithm(algo, engine, out=None)
    assert result.snapshot_id == "step_000000001"
    assert "checksum" in result.skipped["step_000000002"], result.skipped
    stored = _stored_module(run.base, "step_000000001")
    got = _module_weights(algo)
    assert got.keys() == stored.keys() and all(torch.equal(got[k], torch.as_tensor(stored[k])) for k in got)
    newer = _stored_module(run.base, "step_000000002")
    assert not all(torch.equal(got[k], torch.as_tensor(newer[k])) for k in got)  # not a vacuous comparison
    moments, stored_moments = _moments(algo), _stored_moments(run.base, "step_000000001")
    assert moments.keys() == stored_moments.keys()
    assert all(torch.equal(moments[k], stored_moments[k]) for k in moments)
    assert {k: v.data_ptr() for k, v in moments.items()} == before  # read into the optimizer's own memory
