"""``DataLoaderPosition``: a torchdata ``StatefulDataLoader``'s position as checkpoint state, without pickle.

A ``StatefulDataLoader`` state is nested dicts of ints, bools, None, strings
and the sampler generator's state (a uint8 tensor), plus whatever the
dataset's and the sampler's own ``state_dict`` return: all of it goes through
the state codec (tensors to safetensors, the rest to tagged JSON). Bytes have
one explicit rule: they are kept as opaque bytes (base64 in JSON), and bytes
that start like a pickle stream are refused at save, since loading them back
would mean unpickling checkpoint data.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_ckpt.data._checks import require_same
from rl_ckpt.errors import DataPositionError

_PICKLE_PROTOCOL = 0x80  # every pickle of protocol >= 2 starts with this opcode


def refuse_pickles(component: str, value: Any, path: str = "") -> None:
    """Walk a state; raise ``DataPositionError`` at the first bytes value that is a pickle stream."""
    if isinstance(value, (bytes, bytearray)):
        if len(value) >= 2 and value[0] == _PICKLE_PROTOCOL and value[1] <= 5:
            raise DataPositionError(
                f"{component}: the state at {path or '<root>'} holds pickled bytes; rl_ckpt never unpickles "
                "checkpoint data. Make that dataset's/sampler's state_dict return plain values (ints, str, "
                "tensors, dicts) instead of a pickle.",
                component=component,
                field=path,
                saved="pickle",
                given=None,
            )
    elif isinstance(value, dict):
        for k, v in value.items():
            refuse_pickles(component, v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            refuse_pickles(component, v, f"{path}[{i}]")


def saved_sampler_states(loader_state: dict) -> list[dict]:
    """The sampler states in a torchdata loader state: at its top with 0 workers, in its main snapshot with workers;
    the sampler's own (``batch_size=None``) and the one the batch sampler's iterator saved. A layout this does not
    know yields nothing: the loader still checks them when it applies the state, at its next ``iter``."""
    snapshot = loader_state.get("_snapshot")
    main = snapshot.get("_main_snapshot") if isinstance(snapshot, dict) else loader_state
    if not isinstance(main, dict):
        return []
    found = [main.get("_index_sampler_state")]
    batches = main.get("_sampler_iter_state")
    if isinstance(batches, dict):
        found.append(batches.get("sampler_state"))
    return [s for s in found if isinstance(s, dict)]


def _generator_seed(loader) -> int | None:
    gen = getattr(loader, "generator", None)
    return int(gen.initial_seed()) if isinstance(gen, torch.Generator) else None


class DataLoaderPosition:
    """Wraps a ``torchdata.stateful_dataloader.StatefulDataLoader`` as a checkpoint component.

    Saved with the loader's state: the dataset length (when it has one), the
    batch size and the seed of the loader's generator (when given one), each
    checked at restore, so a snapshot restored onto other data fails with both
    values named rather than restarting at an arbitrary place. A sampler with a
    ``check_state`` (``PromptSampler``) checks its saved state at restore too,
    rather than when the loader applies it at its next ``iter``.

    Example::

        loader = StatefulDataLoader(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
        engine.register("data", DataLoaderPosition(loader), replicated=False)
    """

    checkpoint_kind = "other"  # per rank by default (each rank its own loader); replicated=True to share one
    data_position = True  # never in a light snapshot: it travels with the weights
    name = "DataLoaderPosition"

    def __init__(self, loader) -> None:
        if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))):
            raise TypeError(f"DataLoaderPosition needs a torchdata StatefulDataLoader, got {type(loader).__name__}")
        self.loader = loader

    def _identity(self) -> dict:
        dataset = self.loader.dataset
        try:
            length = len(dataset)
        except TypeError:  # an iterable dataset without a length
            length = None
        return {
            "dataset_len": length,
            "batch_size": self.loader.batch_size,
            "generator_seed": _generator_seed(self.loader),
        }

    def state_dict(self) -> dict:
        state = self.loader.state_dict()
        refuse_pickles(self.name, state)
        out = {**self._identity(), "loader": state}
        gen = getattr(self.loader, "generator", None)
        if isinstance(gen, torch.Generator):  # the next epochs' shuffles draw from it (torchdata does not save it)
            out["generator"] = gen.get_state()
        return out

    def load_state_dict(self, state: dict) -> None:
        hint = "Restore with the same dataset, batch size and generator seed, or start a new run for new data."
        for key, given in self._identity().items():
            require_same(self.name, key, state.get(key), given, hint)
        if not isinstance(state.get("loader"), dict):
            raise DataPositionError(
                f"{self.name}: the saved state has no loader state",
                component=self.name,
                field="loader",
                saved=None,
                given=None,
            )
        check = getattr(self.loader.sampler, "check_state", None)  # a PromptSampler: checked now, not at the next iter
        if callable(check):
            for saved in saved_sampler_states(state["loader"]):
                check(saved)
        gen = getattr(self.loader, "generator", None)
        if isinstance(gen, torch.Generator) and state.get("generator") is not None:
            gen.set_state(torch.as_tensor(state["generator"]).to(torch.uint8))
        self.loader.load_state_dict(state["loader"])
