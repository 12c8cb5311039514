"""``InflightRollouts``: a rollout worker's partial rollouts as checkpoint state.

A rollout in flight is a prompt (id and epoch), the tokens generated so far
(with their log-probs) and the generator that draws its next tokens. Saved in
the same commit as the learners' snapshot, it is resumed after a restore
where it stopped: the same next tokens, none generated twice, none dropped.

Log-probs are kept in the float dtype they were given (a Python float is a
float64; a torch or numpy scalar keeps its own: float64, float32, float16,
bfloat16, float8), so they come back bit for bit; a rollout given several
dtypes is stored in one that holds each of them exactly (float32 for the
16- and 8-bit ones, float64 otherwise). A log-prob that no stored dtype can
hold exactly (a complex, an int beyond 2**53, a ``longdouble``, a tensor of
several values) is refused where it is given.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np
import torch

from rl_ckpt.data._checks import state_int
from rl_ckpt.errors import DataPositionError

# The float dtypes a log-prob is kept in (each one the state codec stores as itself).
LOGP_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
_NUMPY_FLOATS = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16}


def _logp_value(key: str, logp) -> tuple[float, torch.dtype]:
    """``logp`` as a Python float (exact: every kept dtype fits in a float64) and the dtype to keep it in."""
    dtype = None
    if isinstance(logp, torch.Tensor):
        if logp.numel() == 1 and logp.dtype in LOGP_DTYPES:
            dtype = logp.dtype
    elif isinstance(logp, (np.ndarray, np.generic)):
        if np.size(logp) == 1:
            dtype = _NUMPY_FLOATS.get(np.asarray(logp).dtype.name)
    elif isinstance(logp, float):
        dtype = torch.float64
    elif isinstance(logp, numbers.Integral) and not isinstance(logp, bool) and abs(int(logp)) <= 2**53:
        dtype = torch.float64  # an int log-prob (0) is exact in a float64
    if dtype is None:
        kind = type(logp).__name__
        if hasattr(logp, "dtype"):
            kind += f" of dtype {logp.dtype} and shape {tuple(np.shape(logp))}"
        raise TypeError(
            f"InflightRollouts: the log-prob given for rollout {key!r} is a {kind}, which no stored dtype keeps "
            f"exactly; give a float or a one-value float tensor ({', '.join(str(d) for d in LOGP_DTYPES)})"
        )
    return float(logp.item() if hasattr(logp, "item") else logp), dtype


def _widest(a: torch.dtype | None, b: torch.dtype) -> torch.dtype:
    """A dtype that holds every value of ``a`` and of ``b`` exactly."""
    if a is None or a == b:
        return b
    return torch.float64 if torch.float64 in (a, b) else torch.float32  # float32 holds f16, bf16 and float8 exactly


@dataclasses.dataclass
class Rollout:
    """One partial rollout: ``prompt`` (id), ``epoch``, ``tokens`` and ``logps`` so far, its ``generator``.

    ``logp_dtype``: the float dtype the log-probs are saved in (the one they were given in; None before the first).
    """

    prompt: int
    epoch: int
    tokens: list[int]
    logps: list[float]
    generator: torch.Generator
    resumed: bool = False  # restored from a snapshot rather than begun in this process
    restored_tokens: int = 0  # how many of ``tokens`` came from the snapshot
    logp_dtype: torch.dtype | None = None

    @property
    def key(self) -> str:
        return f"{self.epoch}:{self.prompt}"


class InflightRollouts:
    """The partial rollouts a worker holds: begin, extend, finish; saved and resumed whole.

    ``resumed_total`` counts the rollouts this object got back from a snapshot
    (saved too, so it adds up across restores); ``tokens_after_resume`` the
    tokens generated for them after a restore: only what was missing.

    Example::

        inflight = InflightRollouts()
        engine.register("inflight", inflight)            # engine of a rollout participant
        r = inflight.begin(prompt_id, epoch, seed)
        r.tokens.append(sample(r.generator)); ...
        done = inflight.finish(r.key)                     # handed to the learner
    """

    checkpoint_kind = "other"  # not a replay buffer: saved whatever save_replay_buffer says, per participant
    data_position = True  # never in a light snapshot: it travels with the weights
    name = "InflightRollouts"

    def __init__(self) -> None:
        self.rollouts: dict[str, Rollout] = {}
        self.resumed_total = 0
        self.tokens_after_resume = 0

    def begin(self, prompt: int, epoch: int, seed: int) -> Rollout:
        r = Rollout(int(prompt), int(epoch), [], [], torch.Generator().manual_seed(int(seed)))
        if r.key in self.rollouts:
            raise DataPositionError(
                f"{self.name}: prompt {prompt} of epoch {epoch} is already in flight here",
                component=self.name,
                field="prompt",
                saved=r.key,
                given=r.key,
            )
        self.rollouts[r.key] = r
        return r

    def extend(self, key: str, token: int, logp: float) -> None:
        r = self.rollouts[key]
        value, dtype = _logp_value(key, logp)
        r.tokens.append(int(token))
        r.logps.append(value)
        r.logp_dtype = _widest(r.logp_dtype, dtype)
        if r.resumed:
            self.tokens_after_resume += 1

    def finish(self, key: str) -> Rollout:
        return self.rollouts.pop(key)

    def __len__(self) -> int:
        return len(self.rollouts)

    def state_dict(self) -> dict:
        rollouts = {
            k: {
                "prompt": r.prompt,
                "epoch": r.epoch,
                "tokens": torch.tensor(r.tokens, dtype=torch.int64),
                "logps": _saved_logps(k, r),
                "generator": r.generator.get_state(),
                "resumed": r.resumed,
            }
            for k, r in self.rollouts.items()
        }
        return {"rollouts": rollouts, "resumed_total": self.resumed_total}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("rollouts")
        if not isinstance(saved, dict):
            raise DataPositionError(
                f"{self.name}: the saved state has no rollouts",
                component=self.name,
                field="rollouts",
                saved=None,
                given=None,
            )
        rollouts = {}
        for key, s in saved.items():
            gen = torch.Generator()
            gen.set_state(torch.as_tensor(s["generator"]).to(torch.uint8))
            logps = torch.as_tensor(s["logps"])
            if logps.dtype not in LOGP_DTYPES or logps.dim() != 1:
                raise DataPositionError(
                    f"{self.name}: saved rollout {key!r} has log-probs of dtype {logps.dtype} and shape "
                    f"{tuple(logps.shape)}, not a float vector; restore a snapshot this worker saved",
                    component=self.name,
                    field="logps",
                    saved=str(logps.dtype),
                    given=None,
                )
            r = Rollout(
                int(s["prompt"]),
                int(s["epoch"]),
                [int(t) for t in torch.as_tensor(s["tokens"]).tolist()],
                [float(v) for v in logps.tolist()],
                gen,
                resumed=True,
                logp_dtype=logps.dtype if len(logps) else None,
            )
            r.restored_tokens = len(r.tokens)
            if r.key != key:
                raise DataPositionError(
                    f"{self.name}: saved rollout {key!r} names prompt {r.key!r}",
                    component=self.name,
                    field="key",
                    saved=key,
                    given=r.key,
                )
            rollouts[key] = r
        self.resumed_total = state_int(self.name, state, "resumed_total") + len(rollouts)
        self.rollouts = rollouts


def _saved_logps(key: str, r: Rollout) -> torch.Tensor:
    """The rollout's log-probs in their dtype; refused if a value does not survive it (set in ``logps`` by hand)."""
    values = torch.tensor([float(v) for v in r.logps], dtype=torch.float64)
    stored = values.to(r.logp_dtype or torch.float64)
    back = stored.to(torch.float64)
    if not bool(((back == values) | (back.isnan() & values.isnan())).all()):
        i = int(((back != values) & ~(back.isnan() & values.isnan())).nonzero()[0])
        raise DataPositionError(
            f"InflightRollouts: rollout {key!r}'s log-prob {i} ({r.logps[i]!r}) does not fit its dtype "
            f"{stored.dtype} exactly; add log-probs with extend(), which keeps the dtype each was given in",
            component="InflightRollouts",
            field="logps",
            saved=str(stored.dtype),
            given=r.logps[i],
        )
    return stored
