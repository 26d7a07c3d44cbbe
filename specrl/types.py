"""Data shapes shared across stages: examples, tokenized prompts, rollouts. Imports nothing from
specrl, so every module can use it."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

# stop / length: how a response (or an episode's last turn) ended; max_turns / env_error: how an
# episode ended (episodes/)
FinishReason = Literal["stop", "length", "max_turns", "env_error"]


@dataclass(frozen=True)
class Example:
    """One dataset row: the prompt (text or chat messages) and what the reward needs; `columns`
    holds every column of the row but the prompt (TRL reward functions receive them all)."""

    prompt: str | list[dict[str, str]]
    ground_truth: str
    data_source: str
    extra_info: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    columns: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


def token_digest(ids: Sequence[int]) -> str:
    """A stable hash of token ids."""
    return hashlib.blake2b(",".join(map(str, ids)).encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Prompt:
    """Token ids to roll out from. `prompt_id`: what its drafts and history trie are kept under,
    a hash of the ids unless given. A turn of an episode is given `<episode's prompt id>/turn<t>`:
    its context holds the earlier turns, which change every epoch, so its ids cannot identify it."""

    ids: tuple[int, ...]
    example: Example
    prompt_id: str = ""  # "": a hash of the ids

    def __post_init__(self) -> None:
        if not self.prompt_id:
            object.__setattr__(self, "prompt_id", token_digest(self.ids))


@dataclass(frozen=True)
class Rollout:
    """One sampled response for one slot of a prompt, as the rollout stage hands it on (frozen:
    rewards and decoded text live beside it, in the trainer's `ScoredRollouts`).

    `current_logprobs`: log-probability of each token under the policy of `policy_version`
    (through the sampling transform), from decoding or from verifying a draft.
    `behaviour_logprobs`: log-probability of each token under the distribution it was actually
    sampled from, where that is not the current policy (the lenient specrl rule, see
    speculative/acceptance.py); None when the tokens were sampled from the current policy.
    `loss_mask`: 1 for each sampled token, 0 for each token an environment wrote (an episode's
    observations, whose logprobs are 0.0 placeholders); None when every token was sampled.
    `reward`: an episode's environment rewards, summed (its score); None for single responses,
    which the reward function scores. `acc`: the accuracy its environment last stated, if any (None after an
    environment error).
    """

    prompt: Prompt
    slot: int
    token_ids: list[int]
    current_logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    behaviour_logprobs: list[float] | None = None
    loss_mask: list[int] | None = None
    reward: float | None = None
    acc: float | None = None
