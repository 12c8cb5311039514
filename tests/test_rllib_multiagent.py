"""RLlib multi-agent through rl_ckpt on the session's Ray cluster: one ``module-<policy id>`` component per
policy (ids a file name cannot hold renamed), trainable policy ids given as a set stored by the explicit rule,
and a second Algorithm built from the same config restored to the same learner state, bitwise, with the saved
sampled-steps counter; the restore says why its (multi-agent) EnvRunner does not resume exactly."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.ray]


def _config():
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole

    return (
        PPOConfig()
        .environment(MultiAgentCartPole, env_config={"num_agents": 2})
        .env_runners(num_env_runners=0)
        .multi_agent(
            policies={"p0", "policy.1"},
            policy_mapping_fn=lambda agent_id, *args, **kwargs: "p0" if agent_id == 0 else "policy.1",
            policies_to_train={"p0", "policy.1"},
        )
        .training(train_batch_size_per_learner=128, minibatch_size=64, num_epochs=1)
        .debugging(seed=3, log_level="ERROR")
    )


def test_multi_agent_one_module_per_policy_restored_bitwise(ray_cluster, tmp_path):
    from rl_ckpt import CheckpointEngine
    from rl_ckpt.demo.rllib_drill import digest, learner_state
    from rl_ckpt.integrations.rllib import register_algorithm, restore_algorithm, to_storable

    algo = _config().build_algo()
    try:
        algo.train()
        with CheckpointEngine(base_dir=str(tmp_path), run_name="ma", save_interval_steps=1) as engine:
            parts = register_algorithm(engine, algo)
            assert {"module-p0", "module-policy_1", "optimizer", "learner", "algorithm", "progress"} <= set(parts)
            # The parts read the live tensors without RLlib's copy: the same values and types as get_state, bitwise.
            live = algo.learner_group.get_state(components=["learner/rl_module", "learner/optimizer"])["learner"]
            for mid, name in (("p0", "module-p0"), ("policy.1", "module-policy_1")):
                assert digest(parts[name].state_dict()) == digest(to_storable(live["rl_module"][mid]))
            assert digest(parts["optimizer"].state_dict()) == digest(to_storable(live["optimizer"]))
            stored = parts["learner"].state_dict()["should_module_be_updated"]
            assert stored == ["p0", "policy.1"]  # a set in RLlib: the explicit rule, sorted list
            engine.save(algo.training_iteration)
            saved = digest(learner_state(algo))
            lifetime = algo.metrics.peek(("env_runners", "num_env_steps_sampled_lifetime"))
            per_module = {m: digest(w) for m, w in learner_state(algo)["rl_module"].items()}
    finally:
        algo.stop()
    fresh = _config().build_algo()
    try:
        assert digest(learner_state(fresh)) != saved
        with CheckpointEngine(base_dir=str(tmp_path), run_name="ma") as engine:
            register_algorithm(engine, fresh)
            lines: list[str] = []
            result = restore_algorithm(fresh, engine, out=lines.append)
        assert result.snapshot_id == "step_000000001" and fresh.training_iteration == 1
        assert any("module-policy_1" in ln for ln in lines)
        # RLlib syncs its EnvRunner's sampled-steps counter from the Algorithm's: restored first, it is the saved one.
        assert lifetime == 128 and fresh.env_runner.num_env_steps_sampled_lifetime == lifetime
        # The multi-agent EnvRunner's episodes are not captured: the restore says so (it resets its environments).
        assert any("EnvRunners not exact" in ln and "MultiAgentEnvRunner" in ln for ln in lines), lines
        assert {m: digest(w) for m, w in learner_state(fresh)["rl_module"].items()} == per_module
        assert digest(learner_state(fresh)) == saved
        # The driver's EnvRunner got the restored weights (push_weights), each policy bitwise.
        sent = fresh.learner_group.get_state(components="learner/rl_module", inference_only=True)["learner"]
        held = fresh.env_runner.get_state(components="rl_module")["rl_module"]
        assert {m: digest(w) for m, w in held.items()} == {m: digest(w) for m, w in sent["rl_module"].items()}
    finally:
        fresh.stop()
