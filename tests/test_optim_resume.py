"""Every torch.optim optimizer and LR scheduler resumes bitwise through a real save and restore.

For each case: K steps, ``engine.save``, restore into fresh objects (built from another seed, so
nothing is left over by chance), then one more step on both; the parameters, the optimizer's and
the scheduler's state dicts and the learning rates must be bitwise equal to the run that never
stopped (floats compared by their bits, tensors by their bytes, and the types too: int vs float vs
0-d tensor, list vs tuple). The restored objects' state dicts must also equal the saved ones
before that step. The case list must cover every optimizer and scheduler class torch.optim exports.

The first case that failed before the fix was LBFGS: its state tensors came back as views into the
file's read buffer at odd addresses, and BLAS ``dot`` sums in another order there (see
``rl_ckpt._core.reader.load_component``).
"""

from __future__ import annotations

import inspect
import struct

import pytest
import torch
from torch.optim import lr_scheduler as lrs

from rl_ckpt import CheckpointEngine

K = 3  # steps before the save


def mlp() -> torch.nn.Module:
    # 58 parameters: enough that a flattened gradient spans several SIMD/BLAS blocks (LBFGS's dot).
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def matrices() -> torch.nn.Module:  # Muon takes 2-d parameters only
    return torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 2, bias=False))


class SparseEmbedding(torch.nn.Module):
    """Sparse gradients (SparseAdam; Adagrad takes them too)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(12, 2, sparse=True)

    def forward(self, x):
        return self.emb((x.abs() * 3).long().clamp(max=11)[:, :2]).sum(1)


optim = torch.optim
OPTIMIZERS = {
    "SGD-momentum": (mlp, lambda p: optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3)),
    "SGD-nesterov": (mlp, lambda p: optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True)),
    "SGD-foreach": (mlp, lambda p: optim.SGD(p, lr=0.05, momentum=0.9, foreach=True)),
    "SGD-fused": (mlp, lambda p: optim.SGD(p, lr=0.05, momentum=0.9, fused=True)),
    "Adam": (mlp, lambda p: optim.Adam(p, lr=0.01, foreach=False)),
    "Adam-amsgrad": (mlp, lambda p: optim.Adam(p, lr=0.01, amsgrad=True, weight_decay=1e-2)),
    "Adam-foreach": (mlp, lambda p: optim.Adam(p, lr=0.01, foreach=True)),
    "Adam-fused": (mlp, lambda p: optim.Adam(p, lr=0.01, fused=True, amsgrad=True)),
    "AdamW": (mlp, lambda p: optim.AdamW(p, lr=0.01, weight_decay=0.1)),
    "AdamW-amsgrad-fused": (mlp, lambda p: optim.AdamW(p, lr=0.01, amsgrad=True, fused=True)),
    "RMSprop-centered": (mlp, lambda p: optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True)),
    "RMSprop-foreach": (mlp, lambda p: optim.RMSprop(p, lr=0.01, foreach=True)),
    "Rprop": (mlp, lambda p: optim.Rprop(p, lr=0.01)),
    "Adagrad": (mlp, lambda p: optim.Adagrad(p, lr=0.1, lr_decay=0.01)),
    "Adagrad-fused": (mlp, lambda p: optim.Adagrad(p, lr=0.1, fused=True)),
    "Adagrad-sparse": (SparseEmbedding, lambda p: optim.Adagrad(p, lr=0.1)),
    "Adadelta": (mlp, lambda p: optim.Adadelta(p, lr=1.0)),
    "Adamax": (mlp, lambda p: optim.Adamax(p, lr=0.01)),
    "NAdam": (mlp, lambda p: optim.NAdam(p, lr=0.01, decoupled_weight_decay=True, weight_decay=1e-2)),
    "RAdam": (mlp, lambda p: optim.RAdam(p, lr=0.01, decoupled_weight_decay=True, weight_decay=1e-2)),
    "ASGD": (mlp, lambda p: optim.ASGD(p, lr=0.01, t0=1)),  # t0=1: averaging is under way at the save
    "LBFGS": (mlp, lambda p: optim.LBFGS(p, history_size=5, max_iter=4)),
    "LBFGS-strong-wolfe": (mlp, lambda p: optim.LBFGS(p, history_size=3, max_iter=3, line_search_fn="strong_wolfe")),
    "SparseAdam": (SparseEmbedding, lambda p: optim.SparseAdam(p, lr=0.01)),
    "Adafactor": (mlp, lambda p: optim.Adafactor(p, lr=0.01)),
    "Muon": (matrices, lambda p: optim.Muon(p, lr=0.01)),
}
# Not runnable on a CPU-only build: ``capturable=True`` (Adam, AdamW, RMSprop, Adadelta, Adamax, NAdam, RAdam,
# ASGD, Rprop) asserts CUDA/XLA parameters. The state they keep is the same kind (0-d tensor steps on the device).


class Warmup:
    """A callable object: LambdaLR saves its ``__dict__`` (a plain function or lambda is not saved)."""

    def __init__(self, steps: int) -> None:
        self.steps, self.calls = steps, 0

    def __call__(self, epoch: int) -> float:
        self.calls += 1
        return min(1.0, (epoch + 1) / self.steps)


SCHEDULERS = {
    "StepLR": lambda o: lrs.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: lrs.MultiStepLR(o, milestones=[1, 3], gamma=0.3),
    "ConstantLR": lambda o: lrs.ConstantLR(o, factor=0.3, total_iters=3),
    "LinearLR": lambda o: lrs.LinearLR(o, start_factor=0.1, total_iters=5),
    "ExponentialLR": lambda o: lrs.ExponentialLR(o, gamma=0.9),
    "PolynomialLR": lambda o: lrs.PolynomialLR(o, total_iters=6, power=2.0),
    "CosineAnnealingLR": lambda o: lrs.CosineAnnealingLR(o, T_max=5, eta_min=1e-4),
    "CosineAnnealingWarmRestarts": lambda o: lrs.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2),
    "CyclicLR": lambda o: lrs.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2, mode="exp_range", gamma=0.9),
    "OneCycleLR": lambda o: lrs.OneCycleLR(o, max_lr=0.1, total_steps=10),
    "ReduceLROnPlateau": lambda o: lrs.ReduceLROnPlateau(o, patience=0, factor=0.5, threshold=10.0),
    "SequentialLR": lambda o: lrs.SequentialLR(
        o, [lrs.LinearLR(o, start_factor=0.5, total_iters=2), lrs.ExponentialLR(o, gamma=0.8)], milestones=[2]
    ),
    "ChainedScheduler": lambda o: lrs.ChainedScheduler(
        [lrs.ConstantLR(o, factor=0.5, total_iters=2), lrs.ExponentialLR(o, gamma=0.9)]
    ),
    # A lambda is code, not state: the fresh object's own lambda is used (the same code resumes exactly).
    "LambdaLR-lambda": lambda o: lrs.LambdaLR(o, lambda e: 0.9**e),
    "LambdaLR-callable": lambda o: lrs.LambdaLR(o, Warmup(4)),
    "MultiplicativeLR": lambda o: lrs.MultiplicativeLR(o, lambda e: 0.95),
}


def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


class Run:
    """A model, its optimizer and maybe a scheduler, stepping on fixed data."""

    def __init__(self, opt_case: str, sched_case: str | None, seed: int) -> None:
        make_model, make_opt = OPTIMIZERS[opt_case]
        torch.manual_seed(seed)
        self.model = make_model()
        self.opt = make_opt(self.model.parameters())
        self.sched = SCHEDULERS[sched_case](self.opt) if sched_case else None
        self.i = 0

    def loss(self) -> torch.Tensor:
        x, y = data(self.i)
        return ((self.model(x) - y) ** 2).mean()

    def step(self) -> None:
        def closure():
            self.opt.zero_grad()
            loss = self.loss()
            loss.backward()
            return loss

        loss = self.opt.step(closure) if isinstance(self.opt, torch.optim.LBFGS) else None
        if loss is None:
            loss = closure()
            self.opt.step()
        if isinstance(self.sched, lrs.ReduceLROnPlateau):
            self.sched.step(float(loss.detach()))
        elif self.sched is not None:
            self.sched.step()
        self.i += 1

    def components(self) -> dict:
        out = {"model": self.model, "optimizer": self.opt}
        if self.sched is not None:
            out["scheduler"] = self.sched
        return out

    def states(self) -> dict:
        out = {
            "params": [p.detach() for p in self.model.parameters()],
            "optimizer": self.opt.state_dict(),
            "lrs": [g["lr"] for g in self.opt.param_groups],
        }
        if self.sched is not None:
            out["scheduler"] = self.sched.state_dict()
        return out


def differences(a, b, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` are not the same bits (types included)."""
    if type(a) is not type(b):
        return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or a.layout != b.layout:
            return [f"{where}: {a.dtype}{list(a.shape)} {a.layout} vs {b.dtype}{list(b.shape)} {b.layout}"]
        if a.is_sparse:
            a, b = a.coalesce(), b.coalesce()
            return differences(a.indices(), b.indices(), where + ".indices") + differences(
                a.values(), b.values(), where + ".values"
            )
        same = (
            a.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            == b.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        )
        return [] if same else [f"{where}: tensor bytes differ"]
    if isinstance(a, float):
        return [] if struct.pack("<d", a) == struct.pack("<d", b) else [f"{where}: {a!r} vs {b!r}"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(a)} vs {list(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if callable(a):
        return []  # a lambda of LambdaLR/MultiplicativeLR: code, not state
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def misaligned(state, where: str = "/optimizer/state") -> list[str]:
    """Tensors at addresses torch's allocator would not give (64-byte aligned, as torch.load's are): a tensor at
    an odd address of a read buffer computes differently (BLAS splits its work by alignment)."""
    if isinstance(state, dict):
        return [d for k, v in state.items() for d in misaligned(v, f"{where}/{k}")]
    if isinstance(state, (list, tuple)):
        return [d for i, v in enumerate(state) for d in misaligned(v, f"{where}[{i}]")]
    if not isinstance(state, torch.Tensor) or state.is_sparse or state.numel() == 0 or state.data_ptr() % 64 == 0:
        return []
    return [f"{where}: at an address that is not 64-byte aligned ({state.data_ptr() % 64} past)"]


def resume_differences(tmp_path, opt_case: str, sched_case: str | None) -> list[str]:
    original = Run(opt_case, sched_case, seed=0)
    for _ in range(K):
        original.step()
    config = {"base_dir": str(tmp_path), "run_name": "optim"}
    with CheckpointEngine(config) as engine:
        for name, obj in original.components().items():
            engine.register(name, obj)
        engine.save(K)
    saved = original.states()
    resumed = Run(opt_case, sched_case, seed=1)
    with CheckpointEngine(config) as engine:
        for name, obj in resumed.components().items():
            engine.register(name, obj)
        assert engine.restore().global_step == K
    resumed.i = K
    problems = [f"after restore {d}" for d in differences(saved, resumed.states())]
    problems += [f"after restore {d}" for d in misaligned(resumed.opt.state_dict()["state"])]
    # The saved dict shares tensors with the live optimizer: compare before either steps on.
    original.step()
    resumed.step()
    return problems + [f"after one more step {d}" for d in differences(original.states(), resumed.states())]


@pytest.mark.parametrize("opt_case", sorted(OPTIMIZERS))
def test_optimizer_resumes_bitwise(tmp_path, opt_case):
    problems = resume_differences(tmp_path, opt_case, None)
    assert not problems, f"{opt_case} does not resume bitwise:\n  " + "\n  ".join(problems[:20])


@pytest.mark.parametrize("sched_case", sorted(SCHEDULERS))
def test_scheduler_resumes_bitwise(tmp_path, sched_case):
    problems = resume_differences(tmp_path, "SGD-momentum", sched_case)
    assert not problems, f"{sched_case} does not resume bitwise:\n  " + "\n  ".join(problems[:20])


def test_lbfgs_with_a_scheduler_resumes_bitwise(tmp_path):
    problems = resume_differences(tmp_path, "LBFGS", "StepLR")
    assert not problems, "\n  ".join(problems[:20])


def test_the_cases_cover_every_class_torch_optim_exports():
    optimizers = {
        n
        for n, c in vars(torch.optim).items()
        if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
    }
    covered = {type(Run(case, None, 0).opt).__name__ for case in OPTIMIZERS}
    assert optimizers <= covered, f"optimizers without a resume case: {sorted(optimizers - covered)}"
    abstract = {lrs.LRScheduler, getattr(lrs, "_LRScheduler", lrs.LRScheduler)}
    schedulers = {
        n
        for n, c in vars(lrs).items()
        if inspect.isclass(c) and c not in abstract and issubclass(c, (lrs.LRScheduler, lrs.ReduceLROnPlateau))
    }
    covered = {type(Run("SGD-momentum", case, 0).sched).__name__ for case in SCHEDULERS}
    assert schedulers <= covered, f"schedulers without a resume case: {sorted(schedulers - covered)}"
