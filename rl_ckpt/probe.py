"""Post-load verification: a deterministic probe forward pass, recorded at save, re-run after load.

At save time every registered ``nn.Module`` (or a component with a probe
function) is run on a fixed-seed input; the output goes into the manifest.
After a load the probe runs again and must match (``allclose``). A snapshot
whose weights load cleanly but compute something else (a tampered weight with
a "fixed" checksum, a shard from the wrong rank) is refused and recovery falls
back.

The probe never disturbs training: it runs under ``torch.no_grad()`` in eval
mode (training flags restored), on its own ``torch.Generator``, inside
``torch.random.fork_rng()`` so no global RNG stream moves.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger("rl_ckpt")

PROBE_SEED = 20240220
ProbeFn = Callable[[Any], Any]


def infer_input(module: torch.nn.Module, shape: Sequence[int] | None = None) -> torch.Tensor | None:
    """A fixed-seed input for ``module``: from ``shape``, or from its first layer."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    param = next(module.parameters(), None)
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    if shape is not None:
        return torch.randn(list(shape), generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear):
            return torch.randn(2, layer.in_features, generator=gen).to(dtype=dtype, device=device)
        if isinstance(layer, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)):
            dims = {torch.nn.Conv1d: 1, torch.nn.Conv2d: 2, torch.nn.Conv3d: 3}[type(layer)]
            return torch.randn(1, layer.in_channels, *([16] * dims), generator=gen).to(dtype=dtype, device=device)
        if isinstance(layer, torch.nn.Embedding):
            return torch.randint(0, layer.num_embeddings, (2, 4), generator=gen, device=device)
    return None


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _tensors(v)]
    for attr in ("logits", "probs", "loc", "scale"):  # torch.distributions
        if isinstance(getattr(out, attr, None), torch.Tensor):
            return [getattr(out, attr)]
    return []


def run_probe(obj: Any, *, fn: ProbeFn | None = None, shape: Sequence[int] | None = None) -> dict | None:
    """Run the probe; returns ``{"outputs": [[floats], ...], "shapes": [...]}`` or None if not probeable."""
    if fn is None and not isinstance(obj, torch.nn.Module):
        return None
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        training = obj.training if isinstance(obj, torch.nn.Module) else None
        try:
            if isinstance(obj, torch.nn.Module):
                obj.eval()
            if fn is not None:
                out = fn(obj)
            else:
                x = infer_input(obj, shape)
                if x is None:
                    log.debug("no probe input could be inferred for %s; set probe_shapes", type(obj).__name__)
                    return None
                out = obj(x)
        except (NotImplementedError, TypeError, RuntimeError, ValueError) as exc:
            if fn is not None:
                raise  # a user probe that fails is a bug worth seeing
            log.debug("probe skipped for %s: %s", type(obj).__name__, exc)
            return None
        finally:
            if training is not None:
                obj.train(training)
    tensors = [t.detach().to("cpu", torch.float64) for t in _tensors(out)]
    if not tensors:
        return None
    return {"outputs": [t.reshape(-1).tolist() for t in tensors], "shapes": [list(t.shape) for t in tensors]}


def compare(reference: dict, got: dict | None, *, rtol: float, atol: float) -> str | None:
    """None when the outputs match; else what differs."""
    if got is None:
        return "the probe could not run on the loaded state"
    if reference.get("shapes") != got.get("shapes"):
        return f"probe output shapes {got.get('shapes')} != recorded {reference.get('shapes')}"
    for i, (ref, out) in enumerate(zip(reference["outputs"], got["outputs"])):
        a, b = torch.tensor(ref, dtype=torch.float64), torch.tensor(out, dtype=torch.float64)
        if not torch.allclose(b, a, rtol=rtol, atol=atol, equal_nan=True):
            worst = float((a - b).abs().max())
            return f"probe output {i} differs from the one recorded at save (max abs diff {worst:.3g}, rtol={rtol}, atol={atol})"
    return None
