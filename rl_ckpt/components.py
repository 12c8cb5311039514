"""What can be registered: the ``Checkpointable`` protocol and the built-in components.

Torch modules, optimizers and LR schedulers satisfy ``Checkpointable`` as
they are. ``RNGState`` and ``TrainingProgress`` carry the rest of a training
run's state; a replay buffer or env wrapper only needs the two methods.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from rl_ckpt.errors import CheckpointError, ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,99}$")
KINDS = ("module", "optimizer", "scheduler", "rng", "buffer", "progress", "other")


@runtime_checkable
class Checkpointable(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)``.

    ``state_dict`` may return tensors, NumPy arrays and scalars, pyarrow tables,
    TensorDicts and plain data (str, int, float, complex, bool, None, bytes,
    list, tuple, dict/OrderedDict/defaultdict/Counter, torch.Size/device/dtype); each
    comes back with its exact type, anything else is refused at save (the
    table in docs/usage.md has the details).
    """

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> Any: ...


def check_component_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name == "meta":
        raise ConfigError(
            f"component name {name!r} is not allowed: use letters, digits, '_' and '-' (it becomes a file name; "
            "'meta' is reserved)",
            key="name",
        )
    return name


def classify(name: str, obj: Any) -> str:
    """The kind of a component, which decides the config switches that apply to it."""
    explicit = getattr(obj, "checkpoint_kind", None)
    if explicit in KINDS:
        return explicit
    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return "scheduler"
    if isinstance(obj, RNGState):
        return "rng"
    if isinstance(obj, TrainingProgress):
        return "progress"
    if "buffer" in name.lower():
        return "buffer"
    return "other"


class RNGState:
    """Every random stream of the process: Python ``random``, NumPy's legacy global
    state, torch CPU (and CUDA when initialised), plus NumPy ``Generator`` and
    ``torch.Generator`` objects handed in by name.

    Example::

        rng = np.random.default_rng(0)
        engine.register("rng", RNGState(numpy_generators={"explore": rng}))
    """

    checkpoint_kind = "rng"

    def __init__(
        self,
        numpy_generators: dict[str, np.random.Generator] | None = None,
        torch_generators: dict[str, torch.Generator] | None = None,
    ) -> None:
        self.numpy_generators = dict(numpy_generators or {})
        self.torch_generators = dict(torch_generators or {})

    def state_dict(self) -> dict:
        version, internal, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state = {
            "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
            "numpy": {
                "kind": kind,
                "keys": keys.copy(),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "torch_cpu": torch.get_rng_state(),
            "numpy_generators": {n: g.bit_generator.state for n, g in self.numpy_generators.items()},
            "torch_generators": {n: g.get_state() for n, g in self.torch_generators.items()},
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["torch_cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state: dict) -> None:
        py = state["python"]
        random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
        npst = state["numpy"]
        np.random.set_state(
            (
                npst["kind"],
                np.asarray(npst["keys"], dtype=np.uint32),
                npst["pos"],
                npst["has_gauss"],
                npst["cached_gaussian"],
            )
        )
        torch.set_rng_state(_byte_tensor(state["torch_cpu"]))
        if state.get("torch_cuda") and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([_byte_tensor(t) for t in state["torch_cuda"]])
        for name, gen in self.numpy_generators.items():
            saved = state.get("numpy_generators", {}).get(name)
            if saved is None:
                raise CheckpointError(f"RNGState: numpy generator {name!r} is not in the snapshot", key=name)
            gen.bit_generator.state = saved
        for name, gen in self.torch_generators.items():
            saved = state.get("torch_generators", {}).get(name)
            if saved is None:
                raise CheckpointError(f"RNGState: torch generator {name!r} is not in the snapshot", key=name)
            gen.set_state(_byte_tensor(saved))

    def derive_state(self, seed: bytes) -> None:
        """Seed every stream from ``seed``, each with a seed of its own (sha256 of ``seed`` and the stream's
        name). For a rank that did not exist when the snapshot was saved (config ``new_rank_state``)."""

        def sub(stream: str, nbytes: int = 8) -> int:
            return int.from_bytes(hashlib.sha256(seed + b"\0" + stream.encode()).digest()[:nbytes], "little")

        random.seed(sub("python", 32))
        np.random.seed([(sub("numpy", 16) >> (32 * i)) & 0xFFFFFFFF for i in range(4)])
        torch.manual_seed(sub("torch_cpu") >> 1)  # (also seeds CUDA; reseeded on its own below)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(sub("torch_cuda") >> 1)
        for name, gen in self.numpy_generators.items():
            fresh = type(gen.bit_generator)(np.random.SeedSequence(sub(f"numpy_generators/{name}", 16)))
            gen.bit_generator.state = fresh.state
        for name, gen in self.torch_generators.items():
            gen.manual_seed(sub(f"torch_generators/{name}") >> 1)


def _byte_tensor(t) -> torch.Tensor:
    t = torch.as_tensor(t)
    return t.to(torch.uint8).clone() if t.dtype != torch.uint8 else t.clone()


class TrainingProgress:
    """Where training is: global step, epoch, samples seen, and any extra plain values."""

    checkpoint_kind = "progress"

    def __init__(self, global_step: int = 0, epoch: int = 0, samples_seen: int = 0, **extra: Any) -> None:
        self.global_step = global_step
        self.epoch = epoch
        self.samples_seen = samples_seen
        self.extra = dict(extra)

    def state_dict(self) -> dict:
        return {
            "global_step": self.global_step,
            "epoch": self.epoch,
            "samples_seen": self.samples_seen,
            "extra": dict(self.extra),
        }

    def load_state_dict(self, state: dict) -> None:
        self.global_step = int(state["global_step"])
        self.epoch = int(state["epoch"])
        self.samples_seen = int(state["samples_seen"])
        self.extra = dict(state.get("extra", {}))
