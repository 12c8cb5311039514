"""The synthetic state the benchmark saves: a policy plus Adam state with a realistic tensor mix."""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

from rl_ckpt.tools.bench.common import GIB, LARGE, SMALL

if TYPE_CHECKING:
    import torch
    from torch import nn


_CLASSES: tuple | None = None


def model_classes() -> tuple[type, type]:
    """(Block, SyntheticPolicy), defined on first use so that importing this module stays light (the CLI imports it)."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    import torch
    from torch import nn

    class Block(nn.Module):
        """A transformer-ish block: 4 medium h x h matrices and many small vectors (15 parameters)."""

        def __init__(self, h: int) -> None:
            super().__init__()
            self.q = nn.Linear(h, h)
            self.k = nn.Linear(h, h)
            self.v = nn.Linear(h, h)
            self.o = nn.Linear(h, h)
            self.norm1 = nn.LayerNorm(h)
            self.norm2 = nn.LayerNorm(h)
            self.gate = nn.Linear(h, 16)
            self.scale = nn.Parameter(torch.ones(max(1, h // 8)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.norm1(x)
            y = self.o(torch.tanh(self.q(y)) * self.v(y) + self.k(y))
            return self.norm2(x + y)

    class SyntheticPolicy(nn.Module):
        """A policy with a realistic parameter mix; its forward is cheap (the post-load probe runs it)."""

        def __init__(self, h: int, layers: int, rows: int) -> None:
            super().__init__()
            self.embed = nn.Embedding(rows, h)
            self.unembed = nn.Linear(h, rows, bias=False)
            self.policy_head = nn.Linear(h, rows)
            self.value_trunk = nn.Linear(h, rows)
            self.blocks = nn.ModuleList(Block(h) for _ in range(layers))
            self.final_norm = nn.LayerNorm(h)
            self.value_out = nn.Linear(h, 1)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.embed(idx)
            for block in self.blocks:
                x = block(x)
            return self.value_out(self.final_norm(x))

    _CLASSES = (Block, SyntheticPolicy)
    return _CLASSES


def _block_params(h: int) -> int:
    return 4 * (h * h + h) + 4 * h + (16 * h + 16) + max(1, h // 8)


def plan_shape(size_bytes: int, tensors: int | None = None) -> dict:
    """Hidden size, blocks and large-matrix rows for ~size_bytes of params + Adam state (fp32)."""
    n_params = max(4096, size_bytes // 12)  # params 4 B + exp_avg 4 B + exp_avg_sq 4 B
    if tensors:
        layers = max(1, round((tensors / 4 - 10) / 15))
        h = max(16, int(math.sqrt(0.45 * n_params / (4 * layers))) // 8 * 8)
    else:
        h = max(64, 64 * round(16 * math.sqrt(size_bytes / GIB)))  # 1024 at 1 GiB
        layers = max(2, round(0.45 * n_params / _block_params(h)))
    rest = n_params - layers * _block_params(h) - (2 * h + h + 1)
    rows = max(16, (rest - 2 * h) // (4 * h + 2))
    return {"hidden": h, "blocks": layers, "large_rows": rows}


def build_state(size_bytes: int, tensors: int | None = None, seed: int = 0) -> tuple[nn.Module, torch.optim.Adam, dict]:
    """A model + Adam after one real step, ~size_bytes in total."""
    import torch

    shape = plan_shape(size_bytes, tensors)
    _block, policy_cls = model_classes()
    torch.manual_seed(seed)
    with torch.no_grad():
        model = policy_cls(shape["hidden"], shape["blocks"], shape["large_rows"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p).mul_(1e-3)
    opt.step()  # populates exp_avg, exp_avg_sq, step
    opt.zero_grad(set_to_none=True)
    return model, opt, shape


def state_dict_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def flat_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every saved tensor under a flat name (the live tensors, no copies)."""
    import torch

    out = {f"model.{k}": t for k, t in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, t in st.items():
            if isinstance(t, torch.Tensor):
                out[f"optim.{pid}.{k}"] = t
    return out


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def size_mix(tensors) -> dict:
    mix = {"large": [0, 0], "medium": [0, 0], "small": [0, 0]}
    for t in tensors:
        b = t.numel() * t.element_size()
        key = "large" if b >= LARGE else ("small" if b < SMALL else "medium")
        mix[key][0] += 1
        mix[key][1] += b
    return {k: {"count": c, "bytes": b} for k, (c, b) in mix.items()}


def byte_views(tensors) -> list[memoryview]:
    import torch

    out = []
    for t in tensors:
        if t.numel():
            out.append(memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B"))
    return out


def mutate_quarter(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> int:
    """Change ~25% of the state bytes (whole tensors, in place); returns the bytes changed."""
    import torch

    tensors = [t for t in flat_tensors(model, opt).values() if t.is_floating_point() and t.dim() > 0]
    total = nbytes(flat_tensors(model, opt).values())
    rng = random.Random(seed)
    rng.shuffle(tensors)
    changed = 0
    with torch.no_grad():
        for t in tensors:
            if changed >= total / 4:
                break
            b = t.numel() * t.element_size()
            if changed + b > total / 4 * 1.15 and changed > 0:
                continue  # keep close to a quarter
            t.add_(1e-3)
            changed += b
    return changed
