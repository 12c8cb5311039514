"""Real RL libraries' state through a real engine: torchrl replay buffers and TensorDicts, a transformers
GPT-2 with tied embeddings, stable-baselines3 PPO (policy, optimizer, rollout buffer) on CartPole.
Each is saved, restored into fresh objects built differently, and must behave exactly as before."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import torch

from rl_ckpt import CheckpointEngine
from helpers import Bag


def engine(tmp_path, **kw) -> CheckpointEngine:
    return CheckpointEngine(base_dir=str(tmp_path), run_name="run", **kw)


# -- torchrl / tensordict ----------------------------------------------------------------------------------


def make_buffer(without_replacement: bool):
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.data.replay_buffers import RandomSampler, SamplerWithoutReplacement

    # (PrioritizedSampler needs torchrl's C++ segment trees, which this wheel lacks.)
    sampler = SamplerWithoutReplacement() if without_replacement else RandomSampler()
    return ReplayBuffer(storage=LazyTensorStorage(100), sampler=sampler, batch_size=8)


def transitions(n: int, seed: int):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "obs": torch.randn(n, 4, generator=g),
            "action": torch.randint(0, 2, (n,), generator=g),
            "next": TensorDict(
                {
                    "obs": torch.randn(n, 4, generator=g),
                    "reward": torch.randn(n, 1, generator=g),
                    "done": torch.zeros(n, 1, dtype=torch.bool),
                },
                batch_size=[n],
            ),
        },
        batch_size=[n],
    )


@pytest.mark.parametrize("without_replacement", [False, True], ids=["random", "without-replacement"])
def test_torchrl_replay_buffer_samples_the_same_batch_after_restore(tmp_path, without_replacement):
    rb = make_buffer(without_replacement)
    rb.extend(transitions(30, seed=0))
    torch.manual_seed(1)
    rb.sample()  # a sampler without replacement now holds a half-used permutation
    eng = engine(tmp_path)
    eng.register("replay_buffer", rb)
    eng.save(1)

    # empty, lazily-initialised storage: everything must come from the snapshot
    fresh = make_buffer(without_replacement)
    e2 = engine(tmp_path)
    e2.register("replay_buffer", fresh)
    e2.restore()
    assert len(fresh) == len(rb) == 30
    assert fresh.storage._storage.batch_size == torch.Size([100])
    assert fresh._writer.state_dict() == rb._writer.state_dict()
    if without_replacement:
        assert torch.equal(fresh._sampler._sample_list, rb._sampler._sample_list)
    for seed in (7, 8):
        torch.manual_seed(seed)
        want = rb.sample()
        torch.manual_seed(seed)
        got = fresh.sample()
        assert (got == want).all(), f"seed {seed}: a different batch after restore"
    # Writing continues at the same cursor.
    rb.extend(transitions(5, seed=3))
    fresh.extend(transitions(5, seed=3))
    assert len(fresh) == len(rb) == 35 and (fresh[:35] == rb[:35]).all()


def test_registered_tensordict_and_tensordict_inside_a_state_dict(tmp_path):
    from tensordict import TensorDict

    td = transitions(6, seed=0)
    td["info"] = TensorDict({"step": torch.arange(6)}, batch_size=[6])

    class Holder:
        def __init__(self, inner):
            self.inner = inner

        def state_dict(self):
            return {"batch": self.inner, "note": "x"}

        def load_state_dict(self, state):
            self.inner = state["batch"]

    eng = engine(tmp_path)
    eng.register("td", td)
    eng.register("holder", Holder(td.clone()))
    eng.save(1)

    fresh_td = transitions(6, seed=5).zero_()
    fresh_td["info"] = TensorDict({"step": torch.zeros(6, dtype=torch.int64)}, batch_size=[6])
    holder = Holder(None)
    e2 = engine(tmp_path)
    e2.register("td", fresh_td)
    e2.register("holder", holder)
    e2.restore()
    assert (fresh_td == td).all() and fresh_td.batch_size == td.batch_size
    got = holder.inner
    assert type(got) is TensorDict and got.batch_size == torch.Size([6]) and got.device == td.device
    assert type(got["next"]) is TensorDict and got["next"].batch_size == torch.Size([6])
    assert (got == td).all()


def test_tensordict_device_names_and_non_tensor_data_are_kept(tmp_path):
    from tensordict import TensorDict

    td = TensorDict({"a": torch.ones(3, 2)}, batch_size=[3, 2], device="cpu", names=["env", "agent"])
    td.set_non_tensor("label", "train")
    state = {"td": td}
    got = save_and_load(tmp_path, state)["td"]
    assert got.device == torch.device("cpu") and got.names == ["env", "agent"] and got.batch_size == torch.Size([3, 2])
    assert got.get_non_tensor("label") == "train" and torch.equal(got["a"], td["a"])


# -- transformers GPT-2: tied weights --------------------------------------------------------------------


def tiny_gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=4096, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(cfg).eval()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    return model


def test_gpt2_tied_weights_written_once_and_still_tied_after_restore(tmp_path):
    model = tiny_gpt2(seed=0)
    wte_bytes = model.transformer.wte.weight.numel() * 4
    state = model.state_dict()
    assert "lm_head.weight" in state and "transformer.wte.weight" in state  # both names reach the engine
    all_bytes = sum({t.data_ptr(): t.numel() * t.element_size() for t in state.values()}.values())
    eng = engine(tmp_path, post_load_check=False)
    eng.register("policy", model)
    info = eng.save(1)
    st_file = os.path.join(tmp_path, "run", info.snapshot_id, "policy.safetensors")
    size = os.path.getsize(st_file)
    assert size < all_bytes + 64 * 1024, f"{size} bytes: the tied embedding ({wte_bytes} bytes) was written twice"

    fresh = tiny_gpt2(seed=1)
    e2 = engine(tmp_path, post_load_check=False)
    e2.register("policy", fresh)
    e2.restore()
    assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr()
    ids = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)


@pytest.mark.parametrize("how", ["save", "save_async", "dedup"])
def test_names_sharing_storage_in_a_plain_dict_share_it_again(tmp_path, how):
    buf = torch.arange(20.0)
    w = torch.randn(4, 3)
    state = {"w": w, "w_again": w, "w_t": w.t(), "head": buf[:8], "tail": buf[6:20:2], "own": buf[3:5].clone()}
    got = save_and_load(
        tmp_path,
        state,
        use_async=how == "save_async",
        **({"dedup": True, "dedup_min_tensor_bytes": 16} if how == "dedup" else {}),
    )
    for k in state:
        assert torch.equal(got[k], state[k]), k
    assert got["w"].data_ptr() == got["w_again"].data_ptr() == got["w_t"].data_ptr()
    assert got["w_t"].stride() == (1, 3)
    assert got["head"].untyped_storage().data_ptr() == got["tail"].untyped_storage().data_ptr()
    assert got["own"].untyped_storage().data_ptr() != got["head"].untyped_storage().data_ptr()
    got["head"][6] = -1.0
    assert got["tail"][0] == -1.0  # views of one storage again, as they were when saved


def save_and_load(tmp_path, state: dict, use_async: bool = False, **cfg) -> dict:
    sub = tmp_path / f"bag{len(os.listdir(tmp_path))}"
    eng = CheckpointEngine(base_dir=str(sub), run_name="run", **cfg)
    eng.register("bag", Bag(state))
    eng.save_async(1).wait() if use_async else eng.save(1)
    eng.close()
    out = Bag()
    e2 = CheckpointEngine(base_dir=str(sub), run_name="run", **cfg)
    e2.register("bag", out)
    e2.restore()
    return out.state


# -- stable-baselines3 PPO on CartPole ------------------------------------------------------------------


class SB3RolloutBuffer:
    """The rollout buffer's arrays and cursor (SB3 gives it no state_dict of its own)."""

    FIELDS = ("observations", "actions", "rewards", "returns", "episode_starts", "values", "log_probs", "advantages")

    def __init__(self, buffer):
        self.buffer = buffer

    def state_dict(self) -> dict:
        b = self.buffer
        return {
            **{f: getattr(b, f) for f in self.FIELDS},
            "pos": b.pos,
            "full": b.full,
            "generator_ready": b.generator_ready,
        }

    def load_state_dict(self, state: dict) -> None:
        for f in self.FIELDS:
            setattr(self.buffer, f, state[f].copy())
        self.buffer.pos, self.buffer.full, self.buffer.generator_ready = (
            state["pos"],
            state["full"],
            state["generator_ready"],
        )


def sb3_ppo(seed: int):
    from stable_baselines3 import PPO

    return PPO("MlpPolicy", "CartPole-v1", n_steps=64, batch_size=32, n_epochs=2, seed=seed, device="cpu", verbose=0)


def test_sb3_ppo_policy_optimizer_and_rollout_buffer_round_trip(tmp_path):
    model = sb3_ppo(seed=0)
    model.learn(total_timesteps=128)
    eng = engine(tmp_path)
    eng.register("policy", model.policy, probe=lambda p: p.predict_values(torch.ones(1, 4)))
    eng.register("optimizer", model.policy.optimizer)
    eng.register("rollout_buffer", SB3RolloutBuffer(model.rollout_buffer))
    eng.save(128)

    fresh = sb3_ppo(seed=1)
    e2 = engine(tmp_path)
    e2.register("policy", fresh.policy, probe=lambda p: p.predict_values(torch.ones(1, 4)))
    e2.register("optimizer", fresh.policy.optimizer)
    e2.register("rollout_buffer", SB3RolloutBuffer(fresh.rollout_buffer))
    e2.restore()
    fresh.set_logger(model.logger)
    fresh._current_progress_remaining = model._current_progress_remaining
    for (k, a), (k2, b) in zip(model.policy.state_dict().items(), fresh.policy.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    sa, sb = model.policy.optimizer.state_dict(), fresh.policy.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, st in sa["state"].items():
        for key, v in st.items():
            assert torch.equal(v, sb["state"][i][key]), (i, key)
    for f in SB3RolloutBuffer.FIELDS:
        a, b = getattr(model.rollout_buffer, f), getattr(fresh.rollout_buffer, f)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f
    assert (fresh.rollout_buffer.pos, fresh.rollout_buffer.full) == (
        model.rollout_buffer.pos,
        model.rollout_buffer.full,
    )
    # One more round of PPO updates over the restored rollout gives the same parameters.
    for m in (model, fresh):
        torch.manual_seed(0)
        np.random.seed(0)
        m.train()
    for (k, a), (_, b) in zip(model.policy.state_dict().items(), fresh.policy.state_dict().items()):
        assert torch.equal(a, b), k


# -- other third-party state dicts: OrderedDict metadata and module versions ------------------------------


def test_module_state_dict_keeps_ordered_dict_and_its_metadata(tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    state = {"net": net.state_dict()}
    got = save_and_load(tmp_path, state)["net"]
    assert type(got) is collections.OrderedDict and list(got) == list(state["net"])
    assert got._metadata == state["net"]._metadata and got._metadata["1"]["version"] == 2


# -- every optimizer and LR scheduler in torch ----------------------------------------------------------


def optimizers(params) -> dict:
    opt = torch.optim
    return {
        "SGD": opt.SGD(params(), lr=0.1, momentum=0.9, nesterov=True),
        "Adam": opt.Adam(params(), amsgrad=True),
        "AdamW": opt.AdamW(params()),
        "Adamax": opt.Adamax(params()),
        "Adadelta": opt.Adadelta(params()),
        "Adagrad": opt.Adagrad(params()),
        "ASGD": opt.ASGD(params()),
        "NAdam": opt.NAdam(params()),
        "RAdam": opt.RAdam(params()),
        "RMSprop": opt.RMSprop(params(), centered=True, momentum=0.5),
        "Rprop": opt.Rprop(params()),
        "LBFGS": opt.LBFGS(params(), history_size=3),
        "Adafactor": opt.Adafactor(params()),
    }  # (SparseAdam needs sparse gradients; its state is Adam's)


def schedulers(make_opt) -> dict:
    s = torch.optim.lr_scheduler
    out = {
        "StepLR": lambda o: s.StepLR(o, 2),
        "MultiStepLR": lambda o: s.MultiStepLR(o, [1, 3]),
        "ConstantLR": lambda o: s.ConstantLR(o),
        "LinearLR": lambda o: s.LinearLR(o),
        "ExponentialLR": lambda o: s.ExponentialLR(o, 0.9),
        "PolynomialLR": lambda o: s.PolynomialLR(o),
        "CosineAnnealingLR": lambda o: s.CosineAnnealingLR(o, 5),
        "CosineAnnealingWarmRestarts": lambda o: s.CosineAnnealingWarmRestarts(o, 2),
        "CyclicLR": lambda o: s.CyclicLR(o, 0.01, 0.1, step_size_up=2),
        "OneCycleLR": lambda o: s.OneCycleLR(o, 0.1, total_steps=20),
        "ReduceLROnPlateau": lambda o: s.ReduceLROnPlateau(o, patience=0),
        "LambdaLR": lambda o: s.LambdaLR(o, lambda e: 0.9**e),
        "MultiplicativeLR": lambda o: s.MultiplicativeLR(o, lambda e: 0.95),
        "SequentialLR": lambda o: s.SequentialLR(o, [s.ConstantLR(o, total_iters=2), s.ExponentialLR(o, 0.9)], [2]),
        "ChainedScheduler": lambda o: s.ChainedScheduler([s.ConstantLR(o, total_iters=2), s.ExponentialLR(o, 0.9)]),
    }
    return {name: (lambda f=f: f(make_opt())) for name, f in out.items()}


def test_every_torch_optimizer_and_scheduler_state_comes_back_equal(tmp_path):
    def run(seed: int):
        torch.manual_seed(seed)
        net = torch.nn.Linear(3, 2)
        opts = optimizers(lambda: [torch.nn.Parameter(p.detach().clone()) for p in net.parameters()])
        scheds = {
            k: f()
            for k, f in schedulers(
                lambda: torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.05, momentum=0.9)
            ).items()
        }
        return opts, scheds

    opts, scheds = run(0)
    x = torch.randn(4, 3)
    for opt in opts.values():
        for _ in range(3):

            def closure(opt=opt):
                opt.zero_grad()
                loss = sum(
                    (x @ p.reshape(-1, 3).T if p.dim() == 2 else p).square().sum()
                    for g in opt.param_groups
                    for p in g["params"]
                )
                loss.backward()
                return loss

            opt.step(closure)
    for sched in scheds.values():
        for _ in range(3):
            sched.optimizer.step() if hasattr(sched, "optimizer") else None
            sched.step(1.0) if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau) else sched.step()
    eng = engine(tmp_path, post_load_check=False)
    for name, obj in {**opts, **scheds}.items():
        eng.register(name, obj, kind="other")
    eng.save(1)

    opts2, scheds2 = run(1)
    e2 = engine(tmp_path, post_load_check=False)
    for name, obj in {**opts2, **scheds2}.items():
        e2.register(name, obj, kind="other")
    e2.restore()
    for name in opts:
        assert_same(opts[name].state_dict(), opts2[name].state_dict(), name)
    for name in scheds:
        assert_same(scheds[name].state_dict(), scheds2[name].state_dict(), name)


def assert_same(a, b, where: str) -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, where
    else:
        assert a == b, where
