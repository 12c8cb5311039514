"""GRPO on a toy task with a tiny GPT-2 policy: the math, free of Ray and of any process group.

Task: the prompt is ``<bos> d <sep>`` for a digit ``d``; the policy writes
``gen_len`` tokens and earns the fraction of them equal to ``d`` (a random
policy scores about 1/12). Each prompt is sampled ``group_size`` times; an
answer's advantage is its reward minus its group's mean, over the group's
standard deviation (GRPO: no value network). The update maximises the
clipped importance ratio of the new policy against the one that sampled.

The prompts are rows of a small Hugging Face dataset (``prompt_dataset``);
the learners draw each step's ids with a ``PromptSampler`` (a new order each
epoch). Sampling draws its noise from a generator seeded by (seed, step, prompt),
so which rollout actor samples which prompt changes nothing: a run's data
do not depend on how many learners or actors there are.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch

DIGITS = 10
BOS, SEP = DIGITS, DIGITS + 1
VOCAB = DIGITS + 2
PROMPT_LEN = 3


@dataclasses.dataclass
class GRPOConfig:
    """Everything that shapes a run's math (the checkpoint config lives elsewhere)."""

    seed: int = 0
    prompts_per_step: int = 16  # the global batch: divisible by every learner count used
    dataset_size: int = 40  # prompts in the dataset, drawn in a new order each epoch (a PromptSampler)
    group_size: int = 8
    gen_len: int = 3
    lr: float = 5e-3
    clip: float = 0.2
    epochs: int = 2  # updates per batch: the second one is off-policy, so the clip matters
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def make_policy(cfg: GRPOConfig) -> torch.nn.Module:
    """A GPT-2 built from a tiny config, randomly initialised from ``cfg.seed`` (nothing is downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(cfg.seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=PROMPT_LEN + cfg.gen_len,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=BOS,
        eos_token_id=SEP,
        tie_word_embeddings=False,
    )
    return GPT2LMHeadModel(config)


@functools.lru_cache(maxsize=4)
def prompt_dataset(seed: int, size: int):
    """The prompt dataset: a Hugging Face ``datasets.Dataset`` of ``size`` rows (``id``, ``digit``), built here
    from ``seed`` (nothing is downloaded); the same on every process."""
    try:
        from datasets import Dataset
    except ImportError as exc:
        raise ImportError(
            "the GRPO demo reads its prompts from a Hugging Face dataset: pip install 'rl-ckpt[data]'"
        ) from exc
    g = torch.Generator().manual_seed(seed * 1_000_003 + 7)
    digits = torch.randint(0, DIGITS, (size,), generator=g).tolist()
    return Dataset.from_dict({"id": list(range(size)), "digit": digits})


def prompt_digits(cfg: GRPOConfig, ids: list[int]) -> torch.Tensor:
    """The digits of prompts ``ids`` of the dataset."""
    return torch.tensor(prompt_dataset(cfg.seed, cfg.dataset_size)[list(ids)]["digit"], dtype=torch.long)


def _noise(cfg: GRPOConfig, step: int, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 4096 + index)
    return torch.rand(cfg.group_size, cfg.gen_len, generator=g, dtype=torch.float64)


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    cfg: GRPOConfig,
    step: int,
    indices: list[int],
    on_token: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """``group_size`` answers to each prompt ``indices`` (dataset ids) at ``step``: sequences, log-probs, rewards.
    ``on_token(t)`` is called before answer token ``t`` is generated (a fault injection point: mid-generation)."""
    digits = prompt_digits(cfg, indices)
    n = len(indices) * cfg.group_size
    seqs = torch.empty(n, PROMPT_LEN + cfg.gen_len, dtype=torch.long)
    seqs[:, 0], seqs[:, 1], seqs[:, 2] = BOS, digits.repeat_interleave(cfg.group_size), SEP
    noise = torch.cat([_noise(cfg, step, i) for i in indices])
    logps = torch.empty(n, cfg.gen_len)
    for t in range(cfg.gen_len):
        if on_token is not None:
            on_token(t)
        pos = PROMPT_LEN + t
        logits = model(seqs[:, :pos]).logits[:, -1].double()
        probs = torch.softmax(logits, -1)
        # Inverse-CDF sampling with pre-drawn noise: the answer depends on the prompt's noise only.
        tok = torch.searchsorted(probs.cumsum(-1), noise[:, t : t + 1].contiguous()).clamp(max=VOCAB - 1).squeeze(1)
        seqs[:, pos] = tok
        logps[:, t] = torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1).float()
    answers = seqs[:, PROMPT_LEN:]
    rewards = (answers == seqs[:, 1:2]).float().mean(1)
    return {"seqs": seqs, "logps": logps, "rewards": rewards}


def advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Group-relative advantages: (r - group mean) / (group std + 1e-4)."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def token_logps(model: torch.nn.Module, seqs: torch.Tensor, gen_len: int) -> torch.Tensor:
    """Log-probs under ``model`` of the answer tokens of ``seqs`` (one forward pass)."""
    logits = model(seqs[:, :-1]).logits[:, PROMPT_LEN - 1 :]
    return torch.log_softmax(logits.float(), -1).gather(2, seqs[:, PROMPT_LEN:, None]).squeeze(2)


def grpo_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], cfg: GRPOConfig) -> torch.Tensor:
    """The clipped-ratio GRPO objective on ``batch`` (negated, averaged over answer tokens)."""
    adv = advantages(batch["rewards"], cfg.group_size)[:, None]
    ratio = torch.exp(token_logps(model, batch["seqs"], cfg.gen_len) - batch["logps"])
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * adv)
    return -surrogate.mean()


def update(
    model: torch.nn.Module, optim: torch.optim.Optimizer, batch: dict[str, torch.Tensor], cfg: GRPOConfig
) -> float:
    """``cfg.epochs`` optimizer steps on one batch; returns the last loss."""
    loss = torch.zeros(())
    for _ in range(cfg.epochs):
        optim.zero_grad()
        loss = grpo_loss(model, batch, cfg)
        loss.backward()
        optim.step()
    return float(loss.detach())


class Progress:
    """Steps done and the mean reward of every step (kept in the snapshot, written once)."""

    checkpoint_kind = "progress"

    def __init__(self) -> None:
        self.global_step = 0
        self.rewards: list[float] = []

    def record(self, step: int, reward: float) -> None:
        self.global_step = step
        self.rewards.append(float(reward))

    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "rewards": list(self.rewards)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_step = int(state["global_step"])
        self.rewards = [float(x) for x in state["rewards"]]
