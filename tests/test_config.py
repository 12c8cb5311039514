"""CheckpointConfig: kwargs, dict and YAML; unknown keys and bad values name the key and what is allowed."""

from __future__ import annotations

import pathlib

import pytest

from rl_ckpt import CheckpointConfig, ConfigError
from rl_ckpt.config import FIELDS

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_defaults_and_kwargs():
    cfg = CheckpointConfig(base_dir="s3://bucket/prefix", keep_latest=2)
    assert cfg.keep_latest == 2 and cfg.best_metric == "avg_reward" and cfg.checksum_algo == "xxh3_128"
    assert cfg.run_url == "s3://bucket/prefix/run"
    assert set(cfg.to_dict()) == set(FIELDS)


def test_shipped_yaml_mirrors_the_article():
    cfg = CheckpointConfig.from_yaml(str(ROOT / "configs" / "ppo.yaml"))
    assert (
        cfg.save_interval_steps,
        cfg.save_interval_seconds,
        cfg.keep_latest,
        cfg.keep_best,
        cfg.keep_interval_steps,
    ) == (500, 1800.0, 5, 3, 2000)
    assert cfg.atomic_write and cfg.verify_after_write and cfg.save_replay_buffer


def test_dict_with_checkpoint_section_or_flat():
    assert CheckpointConfig.from_dict({"checkpoint": {"keep_best": 1}}).keep_best == 1
    assert CheckpointConfig.from_dict({"keep_best": 1}).keep_best == 1


@pytest.mark.parametrize(
    "key,value,allowed",
    [
        ("keep_latest", 0, ">= 1"),
        ("keep_latest", "5", ">= 1"),
        ("keep_best", -1, ">= 0"),
        ("checksum_algo", "md5", "xxh3_128, blake3, sha256"),
        ("best_mode", "up", "max, min"),
        ("atomic_write", "yes", "true or false"),
        ("save_interval_seconds", -1, ">= 0"),
        ("run_name", "../escape", "no '/'"),
        ("storage_options", [1], "mapping"),
        ("best_metric", "", "name"),
    ],
)
def test_bad_values_name_key_and_allowed(key, value, allowed):
    with pytest.raises(ConfigError) as err:
        CheckpointConfig(**{key: value})
    assert err.value.key == key and key in str(err.value) and allowed in str(err.value)


def test_unknown_key_lists_allowed_keys(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("checkpoint:\n  keep_lates: 3\n")
    with pytest.raises(ConfigError) as err:
        CheckpointConfig.from_yaml(str(p))
    assert "keep_lates" in str(err.value) and "keep_latest" in str(err.value)


def test_multi_objective_best():
    cfg = CheckpointConfig(best_metric=["success_rate", "violations"], best_mode=["max", "min"])
    assert cfg.best_metric == ["success_rate", "violations"]
    with pytest.raises(ConfigError, match="one mode per metric"):
        CheckpointConfig(best_metric=["a", "b"], best_mode=["max"])


def test_yaml_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        CheckpointConfig.from_yaml(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("checkpoint: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        CheckpointConfig.from_yaml(str(bad))


def test_storage_options_never_reach_the_manifest(tmp_path):
    from rl_ckpt import CheckpointEngine
    import torch

    e = CheckpointEngine(base_dir=str(tmp_path), storage_options={})
    e.register("m", torch.nn.Linear(2, 2))
    e.save(1)
    cfg = CheckpointConfig(base_dir="s3://b/p", storage_options={"secret": "hunter2", "key": "AKIA"})
    assert "hunter2" not in repr(cfg) and "hunter2" not in str(cfg.public_dict())
