"""The public surface: what users import from ``rl_ckpt`` (and ``actors``) is all there, and ``import rl_ckpt``
does not import Ray (the Ray names load on first use)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import rl_ckpt


def test_import_rl_ckpt_does_not_import_ray():
    code = "import sys, rl_ckpt; assert 'ray' not in sys.modules, sorted(m for m in sys.modules if 'ray' in m)"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "module,heavy",
    [
        # every CLI command and every Ray actor's process imports these: not torch.distributed.checkpoint (DTensor,
        # seconds per process), which only a sharded save or restore needs
        ("rl_ckpt", "torch.distributed.checkpoint"),
        ("rl_ckpt._recovery.plan", "torch.distributed.checkpoint"),
        ("actors", "torch.distributed.checkpoint"),
        # a rollout worker's process: not Ray Train either, which only the learner ranks run
        ("rl_ckpt.demo.ppo_rollout", "torch.distributed.checkpoint"),
        ("rl_ckpt.demo.ppo_rollout", "ray.train"),
    ],
)
def test_a_process_that_does_not_save_shards_does_not_import_their_machinery(module, heavy):
    if module != "rl_ckpt":
        pytest.importorskip("ray")
    code = f"import sys, {module}; assert {heavy!r} not in sys.modules, 'imported by {module}'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_save_and_restore_of_unsharded_state_imports_neither_dcp_nor_ray(tmp_path):
    code = f"""
import sys, torch
from rl_ckpt import CheckpointEngine
engine = CheckpointEngine(base_dir={str(tmp_path)!r}, run_name="r")
model = torch.nn.Linear(4, 4)
engine.register("policy", model)
engine.register("optim", torch.optim.Adam(model.parameters()))
engine.save(1)
assert engine.restore().snapshot_id == "step_000000001"
loaded = [m for m in ("torch.distributed.checkpoint", "ray") if m in sys.modules]  # (torch.optim loads DTensor)
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_sharded_names_load_on_first_use():
    from rl_ckpt import _sharded
    from rl_ckpt._sharded.component import ShardedState
    from rl_ckpt._sharded.layout import is_sharded_section

    assert (_sharded.ShardedState, _sharded.is_sharded_section) == (ShardedState, is_sharded_section)
    with pytest.raises(AttributeError, match="no_such_name"):
        _sharded.no_such_name  # noqa: B018


@pytest.mark.parametrize(
    "name", [n for n in rl_ckpt.__all__ if n not in ("MemoryTier", "CheckpointCallback", "report")]
)
def test_every_public_name_resolves(name):
    assert getattr(rl_ckpt, name) is not None


def test_ray_names_resolve_lazily_and_are_the_integration_classes():
    pytest.importorskip("ray")
    from rl_ckpt.integrations.memory_tier import MemoryTier
    from rl_ckpt.integrations.ray_train import CheckpointCallback, report

    assert (rl_ckpt.MemoryTier, rl_ckpt.CheckpointCallback, rl_ckpt.report) == (MemoryTier, CheckpointCallback, report)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        rl_ckpt.no_such_name  # noqa: B018


def test_the_engine_api_of_the_contract():
    engine = rl_ckpt.CheckpointEngine
    for method in (
        "register",
        "save",
        "save_async",
        "scheduler",
        "snapshots",
        "verify",
        "plan_recovery",
        "restore",
        "close",
    ):
        assert callable(getattr(engine, method)), method
