"""Post-load verification: a deterministic probe forward pass, recorded at save, re-run after load.

At save time every registered ``nn.Module`` (or a component with a probe
function) is run on a fixed-seed input, with every RNG it may draw from
seeded; a bounded fingerprint of the output (:func:`fingerprint`, a few KiB)
goes into the manifest. After a load the probe runs again and its fingerprint
must match within the ``allclose`` tolerances. A snapshot
whose weights load cleanly but compute something else (a tampered weight with
a "fixed" checksum, a shard from the wrong rank) is refused and recovery falls
back.

The probe never disturbs training: it runs under ``torch.no_grad()`` in eval
mode (training flags restored), on its own ``torch.Generator``, inside
``torch.random.fork_rng()`` with NumPy's and Python's global RNGs saved and
restored around it, so no global RNG stream moves.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

log = logging.getLogger("rl_ckpt")

PROBE_SEED = 20240220
SKETCH = 128  # count-sketch buckets over all outputs
SAMPLES = 16  # elements recorded as they are
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
    """Run the probe; returns the :func:`fingerprint` of its outputs, or None if ``obj`` is not probeable.

    Every random stream the forward pass may draw from (torch CPU and CUDA,
    NumPy's global RNG, Python's ``random``) is seeded with ``PROBE_SEED`` for
    the call and restored afterwards: a policy that samples (e.g. a
    stable-baselines3 ``ActorCriticPolicy``) gives the same output in any
    process, and the caller's streams do not move.
    """
    if fn is None and not isinstance(obj, torch.nn.Module):
        return None
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda), _seeded_host_rngs(), torch.no_grad():
        torch.random.default_generator.manual_seed(PROBE_SEED)
        for device in cuda:
            torch.cuda.default_generators[device].manual_seed(PROBE_SEED)
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
        tensors = _tensors(out)
        return fingerprint(tensors) if tensors else None


@contextlib.contextmanager
def _seeded_host_rngs() -> Iterator[None]:
    """NumPy's and Python's global RNGs seeded with PROBE_SEED inside, exactly as before outside."""
    np_state, py_state = np.random.get_state(), random.getstate()
    np.random.seed(PROBE_SEED % 2**32)
    random.seed(PROBE_SEED)
    try:
        yield
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)


def _as_float64(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.to("cpu", torch.float64).reshape(-1)


def fingerprint(tensors: Sequence[torch.Tensor]) -> dict:
    """A bounded summary of probe outputs: a few KiB however large they are (GPT-2's logits are 10 MiB as text).

    Per output: shape, dtype, sum and sum of absolute values. Over all outputs
    together: a count sketch (each element, times a fixed-seed random sign, is
    added to one of ``SKETCH`` buckets; with each bucket's sum of absolute
    values, which bounds how far it may move within tolerance) and
    ``SAMPLES`` elements at fixed-seed positions. A changed weight moves the
    outputs it feeds, hence their buckets; an unchanged one moves nothing.
    """
    flat = [_as_float64(t) for t in tensors]
    allv = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)
    n = allv.numel()
    gen = torch.Generator().manual_seed(PROBE_SEED)
    signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int8).to(torch.float64).mul_(2).sub_(1)
    buckets = min(SKETCH, max(n, 1))
    pad = (-n) % buckets
    padded = torch.nn.functional.pad(allv, (0, pad))
    sketch = torch.nn.functional.pad(allv * signs, (0, pad)).reshape(-1, buckets).sum(0)
    sketch_abs = padded.abs().reshape(-1, buckets).sum(0)
    picks = torch.randint(0, n, (min(SAMPLES, n),), generator=gen) if n else torch.zeros(0, dtype=torch.long)
    return {
        "format": "fingerprint-1",
        "shapes": [list(t.shape) for t in tensors],
        "dtypes": [str(t.dtype).replace("torch.", "") for t in tensors],
        "sums": [_num(f.sum()) for f in flat],
        "abs_sums": [_num(f.abs().sum()) for f in flat],
        "sketch": [_num(v) for v in sketch],
        "sketch_abs": [_num(v) for v in sketch_abs],
        "samples": [_num(v) for v in allv[picks]],
    }


def _num(v: torch.Tensor) -> float | str:
    """A float for JSON; non-finite values as 'nan'/'inf'/'-inf' (the manifest is strict JSON)."""
    x = float(v)
    return x if math.isfinite(x) else repr(x)


def _floats(values: Sequence[float | str]) -> torch.Tensor:
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def _close(got: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> bool:
    same_special = (got == ref) | (torch.isnan(got) & torch.isnan(ref))
    return bool(((got - ref).abs() <= tol).logical_or(same_special).all())


def _legacy(reference: dict) -> dict:
    """A fingerprint of a probe recorded in full by an older version (``outputs`` + ``shapes``)."""
    tensors = [
        torch.tensor([float(v) for v in out], dtype=torch.float64).reshape(shape)
        for out, shape in zip(reference["outputs"], reference["shapes"])
    ]
    fp = fingerprint(tensors)
    fp.pop("dtypes")
    return fp


def compare(reference: dict, got: dict | None, *, rtol: float, atol: float) -> str | None:
    """None when the outputs match within ``allclose(rtol, atol)`` as far as the fingerprints tell; else what differs.

    Every bound is what element-wise ``allclose`` implies for a sum: ``atol``
    per element plus ``rtol`` times the recorded sum of absolute values.
    """
    if got is None:
        return "the probe could not run on the loaded state"
    if "outputs" in reference:
        reference = _legacy(reference)
    if "outputs" in got:
        got = _legacy(got)
    if reference.get("shapes") != got.get("shapes"):
        return f"probe output shapes {got.get('shapes')} != recorded {reference.get('shapes')}"
    if "dtypes" in reference and "dtypes" in got and reference["dtypes"] != got["dtypes"]:
        return f"probe output dtypes {got['dtypes']} != recorded {reference['dtypes']}"
    sizes = torch.tensor([math.prod(s) for s in reference["shapes"]], dtype=torch.float64)
    ref_abs = _floats(reference["abs_sums"])
    per_output = atol * sizes + rtol * ref_abs
    for what in ("sums", "abs_sums"):
        g, r = _floats(got[what]), _floats(reference[what])
        if not _close(g, r, per_output):
            i = int(((g - r).abs() - per_output).argmax())
            return (
                f"probe output {i} differs from the one recorded at save ({what[:-1].replace('_', ' ')} "
                f"{float(g[i]):.6g} != {float(r[i]):.6g}, rtol={rtol}, atol={atol})"
            )
    total = int(sizes.sum())
    buckets = len(reference["sketch"])
    per_bucket = torch.full((buckets,), math.ceil(total / buckets) if buckets else 0, dtype=torch.float64)
    g, r = _floats(got["sketch"]), _floats(reference["sketch"])
    if g.shape != r.shape or not _close(g, r, atol * per_bucket + rtol * _floats(reference["sketch_abs"])):
        return f"probe outputs differ from the ones recorded at save (sketch of all outputs; rtol={rtol}, atol={atol})"
    g, r = _floats(got["samples"]), _floats(reference["samples"])
    if g.shape != r.shape or not _close(g, r, atol + rtol * r.abs()):
        worst = float((g - r).abs().nan_to_num(0.0).max()) if g.shape == r.shape and g.numel() else float("nan")
        return (
            f"probe outputs differ from the ones recorded at save (sampled elements, max abs diff {worst:.3g}, "
            f"rtol={rtol}, atol={atol})"
        )
    return None
