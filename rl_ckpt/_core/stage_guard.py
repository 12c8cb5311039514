"""Background staging for ``save_async``: the caller is blocked to capture the state, not to copy it.

At the call, everything that is not a large live tensor is captured at once
(each component's ``state_dict()`` split into a JSON tree, NumPy arrays copied,
tables), and so are the *references* to the live tensors of the components
the engine can guard. A stager thread then copies those tensors into the
reused staging buffers (allocating them the first time) while training goes
on. Before anything can change one of those tensors the trainer waits, if
staging has not finished, and helps with the copies while it waits:

- an optimizer step pre-hook on every registered optimizer (it changes its
  parameters and its state), and a ``load_state_dict`` pre-hook on it;
- a forward pre-hook on every registered module (and submodule) that owns
  buffers (BatchNorm running stats change in forward): it waits only for the
  buffers, which are copied first; a ``load_state_dict`` pre-hook on the module;
- the engine itself (``save``, ``save_async``, ``restore``, ``wait``, ``close``).

The rule (:func:`background_names`): a component is staged in the background
when every way it changes is guarded:

- a ``torch.optim.Optimizer`` (its tensors in ``param_groups``, e.g. a tensor
  ``lr`` a scheduler sets, are copied at the call);
- an ``nn.Module`` whose parameters all belong to registered optimizers, and
  whose buffers change only in forward or ``load_state_dict``;
- any component registered with ``background=True``: its owner promises to
  change its tensors only after ``handle.wait_staged()`` (or through the guarded paths).

Everything else (a module with a parameter no registered optimizer owns, e.g.
an EMA or target network updated in place; replay buffers; any object whose
``state_dict()`` returns live tensors changed by other means; sharded DTensor
state; a component registered with ``background=False``) is copied at the
call, as before. Gradients are not saved, so ``zero_grad`` needs no guard.

A component whose object says ``checkpoint_detached_state = True`` promises
more: every ``state_dict()`` call returns a tree of its own (new containers,
copied arrays and tensors: nothing anyone changes later). Only its
``state_dict()`` runs at the call; splitting it into tensors/tables/JSON runs
on the writer, before the write (a refusal, e.g. a value of a type the format
cannot hold, then fails that save through its handle instead of at the call).
Such a component may also have ``state_dict_later()``: called instead at the
save's call, it returns a function the writer calls for that tree (e.g. the
state of remote processes, asked for at the call and waited for on the writer).

A hook that fires after staging finished returns at once; hooks are removed at
the next engine call that waits (``save``, ``save_async``, ``wait``, ``restore``;
the optimizer ones cannot be removed while the optimizer iterates over them),
forward hooks as soon as the buffers are copied. After ``close`` at most one
such returning hook per object stays, holding no buffer.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable

import torch

from rl_ckpt._core.staging import StagingArea
from rl_ckpt.errors import ConfigError
from rl_ckpt._format.state_codec import EncodedState, encode_state

# Keys of an optimizer's encoded state copied at the call: a scheduler may change them in place before the step.
SYNC_OPTIMIZER_PREFIX = "param_groups/"


def background_names(registered: Iterable[Any]) -> set[str]:
    """The names of the registered components staged in the background (see the module docstring for the rule).

    ``registered``: every registration (``name``, ``obj``, ``sharded`` and ``background`` attributes), saved or not:
    an optimizer left out of snapshots still guards the parameters it changes.
    """
    regs = list(registered)
    owned: set[int] = set()
    for reg in regs:
        if isinstance(reg.obj, torch.optim.Optimizer):
            owned.update(id(p) for group in reg.obj.param_groups for p in group["params"])
    out = set()
    for reg in regs:
        declared = getattr(reg, "background", None)
        if reg.sharded is not None or declared is False:
            continue
        if declared or isinstance(reg.obj, torch.optim.Optimizer):
            out.add(reg.name)
        elif isinstance(reg.obj, torch.nn.Module) and all(id(p) in owned for p in reg.obj.parameters()):
            out.add(reg.name)
    return out


def detached_state(obj: Any) -> bool:
    """True when ``obj`` says its ``state_dict()`` returns a tree of its own (``checkpoint_detached_state``)."""
    return getattr(obj, "checkpoint_detached_state", False) is True


class Capture:
    """What one ``save_async`` call defers: the guarded components' tensors, module buffers first."""

    def __init__(self, staging: StagingArea, registered: Iterable[Any]) -> None:
        regs = list(registered)
        self.staging = staging
        self.names = background_names(regs)
        self.objects = {r.name: r.obj for r in regs}
        self.first: list = []  # module buffers: a forward pre-hook waits for these only
        self.rest: list = []

    def stage(self, name: str, enc: EncodedState) -> EncodedState:
        """``enc`` staged; a guarded component's tensors deferred (its optimizer ``param_groups`` ones copied now)."""
        staging, obj = self.staging, self.objects[name]
        if name not in self.names:
            return staging.stage(name, enc)
        later: list = []
        out = staging.stage(name, enc, defer=later)
        params = {n for n, _ in obj.named_parameters()} if isinstance(obj, torch.nn.Module) else None
        for key, src in later:
            if isinstance(obj, torch.optim.Optimizer) and key[1].startswith(SYNC_OPTIMIZER_PREFIX):
                out.arrays[key[1]] = staging.stage_tensor(key, src)
            elif params is not None and key[1] not in params:
                self.first.append((key, src))  # a buffer (or a span that may hold one): a forward may change it
            else:
                self.rest.append((key, src))
        return out

    def start(self, states: dict[str, EncodedState], guard: "StageGuard") -> "StageRound":
        """Close the call's part and start the background copy; returns the round (``guard`` arms its hooks)."""
        staging = self.staging
        if torch.cuda.is_available():
            staging.copies.sync()  # the components copied at the call have landed before it returns, as before
            staging.copies.mark({src.device for _k, src in self.first + self.rest if src.is_cuda})
        rnd = StageRound(staging, self.first + self.rest, states, first=len(self.first))
        if rnd.tasks:  # hooks on what can change a deferred tensor: every optimizer, the deferred modules
            guard.start(
                rnd,
                [
                    obj
                    for name, obj in self.objects.items()
                    if name in self.names or isinstance(obj, torch.optim.Optimizer)
                ],
            )
        else:
            rnd.run()  # nothing deferred: end the round here
        return rnd


def stage_background(pipeline: Any, kind: str) -> "StageRound":
    """``save_async``'s call: capture every component ``pipeline`` saves; copy the guarded ones on a stager."""
    capture = Capture(pipeline.staging, pipeline.registry)
    try:
        staged = pipeline.stage(kind, copy=True, capture=capture)
    except BaseException:
        pipeline.staging.finish()  # end the round: nothing was deferred to a stager yet
        raise
    return capture.start(staged, pipeline.guard)


def after_staging(
    rnd: "StageRound", persist: Callable[[dict], Any], failed: Callable[[BaseException], None]
) -> Callable[[], Any]:
    """The writer's job: wait for ``rnd``'s copies, then ``persist`` them; a round that failed to stage never
    reaches the commit (``failed`` tells the other participants, and its error goes to the handle)."""

    def job() -> Any:
        try:
            staged = rnd.result()
        except BaseException as exc:
            failed(exc)
            raise
        return persist(staged)

    return job


def check_background(name: str, background: Any) -> bool | None:
    """``register(background=...)``: None, True or False."""
    if background is not None and not isinstance(background, bool):
        raise ConfigError(f"component {name!r}: background must be True, False or None, got {background!r}", key=name)
    return background


class StageRound:
    """One save's background copy, task by task: the stager thread and any waiting trainer claim tasks in order.

    ``tasks`` are ``((component, key), tensor)`` pairs, module buffers first
    (the ``first`` of them: what a forward pre-hook waits for). ``states`` are
    the staged states with None where a task's buffer goes. The stager calls
    ``run``; the writer calls ``result`` (the staged states once every copy
    landed, or the error that stopped staging: a half-staged round is never
    persisted).
    """

    def __init__(self, staging: StagingArea, tasks: list, states: dict[str, EncodedState], first: int = 0) -> None:
        self.staging = staging
        self.tasks = tasks
        self.states = states
        self.first = first
        self.hook_wait_seconds = 0.0  # time trainer threads waited in hooks (helping included)
        self.copy_seconds: float | None = None  # from the round's start to every copy landed
        self._started = time.perf_counter()
        self.error: BaseException | None = None
        self._buffers: list[torch.Tensor | None] = [None] * len(tasks)
        self._cond = threading.Condition()
        self._next = 0  # next task to claim
        self._busy = 0  # claimed, not finished
        self._done = [False] * len(tasks)
        self._prefix = 0  # tasks[:_prefix] are all done
        self._finished = threading.Event()

    # -- workers -------------------------------------------------------------
    def run(self) -> None:
        """The stager thread: copy every task not claimed by a helper, then end the round."""
        try:
            self._work(len(self.tasks))
            with self._cond:
                self._cond.wait_for(lambda: self._busy == 0)
        finally:
            self._end()

    def _work(self, upto: int) -> None:
        while True:
            with self._cond:
                if self.error is not None or self._next >= upto:
                    return
                i = self._next
                self._next += 1
                self._busy += 1
            try:
                key, src = self.tasks[i]
                buf = self.staging.reserve(key, src)
                self.staging.copies.copy(buf, src)
                self._buffers[i] = buf
            except BaseException as exc:  # an allocation or copy failed: the round fails, nothing is persisted
                with self._cond:
                    self.error = self.error or exc
                    self._busy -= 1
                    self._cond.notify_all()
                return
            with self._cond:
                self._busy -= 1
                self._done[i] = True
                while self._prefix < len(self._done) and self._done[self._prefix]:
                    self._prefix += 1
                self._cond.notify_all()

    def _end(self) -> None:
        try:
            self.staging.finish()  # device-to-host copies land; buffers of keys not staged this round are freed
            if self.error is None:
                for i, ((name, key), _src) in enumerate(self.tasks):
                    self.states[name].arrays[key] = self._buffers[i]
        except BaseException as exc:
            self.error = self.error or exc
        finally:
            self._buffers, self.staging = [], None  # a dead hook left on a model keeps no buffer alive
            self.copy_seconds = time.perf_counter() - self._started
            self._finished.set()
            with self._cond:
                self._cond.notify_all()

    # -- waiting -----------------------------------------------------------------
    @property
    def staged(self) -> bool:
        """True once every copy has landed (or staging failed)."""
        return self._finished.is_set()

    def copied(self, upto: int) -> bool:
        """True when ``tasks[:upto]`` are copied (issued, for a GPU tensor) or staging failed."""
        return self._finished.is_set() or self.error is not None or self._prefix >= upto

    def before_change(self, upto: int | None = None) -> None:
        """A trainer is about to change state: help copy ``tasks[:upto]`` (all by default), then wait for them.

        For GPU tensors the trainer's current streams are ordered after the
        copies (the host does not wait for them to land). The time spent here
        is added to ``hook_wait_seconds``. A failed round does not block training."""
        upto = len(self.tasks) if upto is None else upto
        if self.copied(upto):
            return
        started = time.perf_counter()
        self._work(upto)
        with self._cond:
            self._cond.wait_for(lambda: self.copied(upto))
        if torch.cuda.is_available() and not self._finished.is_set():
            self.staging.copies.order_current_after()
        self.hook_wait_seconds += time.perf_counter() - started

    def result(self) -> dict[str, EncodedState]:
        """The staged states once every copy has landed, detached states encoded here (on the writer's thread);
        raises the error that stopped staging, or the refusal of a detached state's encoding."""
        self._finished.wait()
        if self.error is not None:
            raise self.error
        states, self.states = self.states, {}  # for the writer alone (see ``_end``)
        for name, state in states.items():
            if type(state) is Detached:
                states[name] = encode_state(name, state.tree())  # (the key keeps its place: the components' order)
        return states


class Detached:
    """A detached component's state as of the save's call, waiting for ``StageRound.result``: ``tree()`` returns
    what its ``state_dict()`` returned, or calls the function its ``state_dict_later()`` returned."""

    __slots__ = ("tree",)

    def __init__(self, tree: Callable[[], Any]) -> None:
        self.tree = tree


class StageGuard:
    """Arms the hooks of one pipeline's registered modules and optimizers for the round in flight."""

    def __init__(self) -> None:
        self.round: StageRound | None = None
        self._handles: list = []
        self._forward: list = []

    def start(self, rnd: StageRound, objects: Iterable[Any]) -> None:
        """Arm the hooks on ``objects`` (every registered object) and start copying ``rnd`` on a stager thread."""
        self.disarm()
        self.round = rnd
        seen: set[int] = set()
        for obj in objects:
            if isinstance(obj, torch.optim.Optimizer):
                self._handles.append(obj.register_step_pre_hook(self._before_step))
                self._handles.append(obj.register_load_state_dict_pre_hook(self._before_optimizer_load))
            elif isinstance(obj, torch.nn.Module):
                self._handles.append(obj.register_load_state_dict_pre_hook(self._before_module_load))
                for module in obj.modules():
                    if id(module) not in seen and next(module.buffers(recurse=False), None) is not None:
                        seen.add(id(module))
                        self._forward.append(module.register_forward_pre_hook(self._before_forward))
        threading.Thread(target=rnd.run, name="rl_ckpt-stager", daemon=True).start()

    @property
    def armed(self) -> bool:
        """True while hooks are registered (from a save's call until the engine call after its staging)."""
        return bool(self._handles or self._forward)

    def wait(self) -> None:
        """Block until the round in flight is staged (an engine call or a user about to change state)."""
        if self.round is not None:
            self.round.before_change()

    def disarm(self) -> None:
        """Remove every hook once the round is staged (call from the training thread, outside its hooks)."""
        if self.round is not None and not self.round.staged:
            return
        self._remove(self._forward)
        self._remove(self._handles)
        self.round = None

    @staticmethod
    def _remove(handles: list) -> None:
        for handle in handles:
            handle.remove()
        handles.clear()

    # -- hooks -------------------------------------------------------------------
    def _before_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self.wait()

    def _before_optimizer_load(self, _optimizer: Any, _state: Any) -> None:
        self.wait()

    def _before_module_load(self, *_args: Any) -> None:
        self.wait()

    def _before_forward(self, _module: Any, _args: Any) -> None:
        rnd = self.round
        if rnd is not None:
            rnd.before_change(rnd.first)
        self._remove(self._forward)  # forward hooks are called from a snapshot of the hooks: safe to remove


__all__ = [
    "SYNC_OPTIMIZER_PREFIX",
    "Capture",
    "StageGuard",
    "StageRound",
    "after_staging",
    "background_names",
    "check_background",
    "Detached",
    "detached_state",
    "stage_background",
]
