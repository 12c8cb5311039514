"""Capture: what a save takes from the registered components at its call, and the staging warm-up.

:class:`StateCapture` is the *stage* half of the save pipeline
(``core/save_pipeline.py`` persists and commits): each saved component's
``state_dict()`` split into tensors/tables/JSON (through the component's
encode plan for a background save: ``core/encode_plans.py``), the post-load
probe's reference outputs, and :meth:`StateCapture.prepare`, which allocates
and faults in the staging buffers ahead of the first ``save_async`` so that
its background copy finds them ready.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from rl_ckpt.config import CheckpointConfig
from rl_ckpt._core.encode_plans import EncodePlans
from rl_ckpt._core.registry import ComponentRegistry, Registered
from rl_ckpt._core.stage_guard import Detached, detached_state
from rl_ckpt._core.staging import StagingArea
from rl_ckpt.errors import CheckpointError, SerializationError
from rl_ckpt._format.state_codec import EncodedState, encode_state
from rl_ckpt._recovery.probe import run_probe


class StateCapture:
    """Takes the registered state of one engine at a save's call.

    ``staging``: the reused buffers of background saves; ``plans``: the
    components' encode plans (used for background saves, whose capture is what
    the trainer waits for).
    """

    def __init__(self, config: CheckpointConfig, registry: ComponentRegistry) -> None:
        self.config = config
        self.registry = registry
        self.staging = StagingArea()
        self.plans = EncodePlans()
        self._after_first_step: list = []  # optimizer step post-hooks of ``prepare`` (removed at the next stage)
        self._prepared_after_step = False

    def probes(self, kind: str) -> dict:
        """Reference outputs of the post-load probe, taken from the state being saved."""
        if not self.config.post_load_check or kind != "full":
            return {}
        out = {}
        for reg in self.registry.saved(kind):
            if reg.sharded is not None:
                continue  # a probe forward of a sharded module is a collective; its chunks carry checksums
            result = run_probe(reg.obj, fn=reg.probe, shape=self.config.probe_shapes.get(reg.name))
            if result is not None:
                out[self.registry.key(reg.name)] = result
        return out

    def stage(self, kind: str = "full", *, copy: bool = False, capture: Any = None) -> dict[str, EncodedState]:
        """Every saved component's state, split into tensors/tables/JSON.

        ``copy``: into the staging buffers (a background save), which then hold only what this round
        staged; ``capture``: a ``core/stage_guard.Capture`` that defers the guarded tensors to a stager and
        a detached state's encoding to the writer (``Detached`` in the result until then)."""
        self._drop_spent_hooks()
        staged, area = {}, capture or self.staging
        try:
            saved = self.registry.saved(kind)
            for reg in saved:
                if reg.sharded is not None:
                    from rl_ckpt._sharded import stage_sharded  # (lazy: see registry.SHARDED_IMPORT)

                    staged[reg.name] = stage_sharded(
                        reg.sharded,
                        self.registry.rank,
                        copy=copy,
                        name=reg.name,
                        staging=self.staging if copy else None,
                    )
                elif capture is not None and detached_state(reg.obj):
                    staged[reg.name] = detached_state_of(reg)  # encoded by the writer (core/stage_guard.py)
                elif copy:
                    staged[reg.name] = area.stage(reg.name, self.plans.encode(reg.name, state_of(reg)))
                else:
                    staged[reg.name] = encode_state(reg.name, state_of(reg))
            if copy and kind == "full":
                self.plans.forget({reg.name for reg in saved})
        finally:
            if copy and capture is None:  # device-to-host copies land; buffers of keys not staged this round are freed
                self.staging.finish()
        if not staged and not (self.registry.topology.empty_part_ok and len(self.registry)):
            # A participant whose state is all replicated (written by rank 0) contributes an empty part.
            raise CheckpointError(
                f"nothing to save in a {kind} snapshot: register components first"
                + (" (or list them in light_components)" if kind == "light" else ""),
                kind=kind,
            )
        return staged

    def prepare(self, kind: str = "full") -> int:
        """Allocate and fault in the staging buffers a background save of ``kind`` will copy into, on a thread.

        Captures the state's layout now (on the caller's thread, like a save's
        call: it also builds the encode plans), then returns; the buffers are
        filled in the background and a save that comes first simply allocates
        what is not ready yet. An optimizer with no state yet (Adam before its
        first step) is prepared again right after its next ``step()``.
        Returns the bytes being prepared: the memory a background save holds
        anyway, from now on instead of from its first call."""
        specs = []
        for reg in self.registry.saved(kind):
            if reg.sharded is not None or detached_state(reg.obj):
                continue  # sharded state stages through its own planner; a detached one is never staged
            obj = reg.obj
            if isinstance(obj, torch.optim.Optimizer) and not obj.state and not self._prepared_after_step:
                self._after_first_step.append(obj.register_step_post_hook(self._prepare_after_step))
            for key, value in self.plans.encode(reg.name, state_of(reg)).arrays.items():
                if isinstance(value, torch.Tensor):
                    specs.append(((reg.name, key), tuple(value.shape), value.dtype, value.is_cuda))
        return self.staging.warm(specs)

    def _prepare_after_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if not self._prepared_after_step:  # one shot (removed later: not while the optimizer iterates its hooks)
            self._prepared_after_step = True
            self.prepare()

    def _drop_spent_hooks(self) -> None:
        for handle in self._after_first_step:
            handle.remove()
        self._after_first_step = []


def state_of(reg: Registered) -> Any:
    """``reg.obj.state_dict()``; an exception it raises becomes a SerializationError naming the component."""
    return _named(reg.name, "state_dict()", reg.obj.state_dict)


def detached_state_of(reg: Registered) -> Detached:
    """A detached component's state as of now: what its ``state_dict_later()`` returned, a function the writer
    calls for the tree (the component has asked for it by now), or else ``state_dict()``'s tree."""
    later = getattr(reg.obj, "state_dict_later", None)
    if not callable(later):
        tree = state_of(reg)
        return Detached(lambda: tree)
    fn = _named(reg.name, "state_dict_later()", later)
    return Detached(partial(_named, reg.name, "the function state_dict_later() returned", fn))


def _named(name: str, what: str, fn: Any) -> Any:
    """``fn()``; an exception it raises becomes a SerializationError naming the component ``name``."""
    try:
        return fn()
    except CheckpointError:
        raise
    except Exception as exc:  # the user's own code: name the component, keep the cause chained
        raise SerializationError(
            f"component {name!r}: {what} raised {type(exc).__name__}: {exc}; nothing was saved",
            component=name,
            key="",
        ) from exc


__all__ = ["StateCapture", "detached_state_of", "state_of"]
