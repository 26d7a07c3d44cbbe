"""Data shapes shared across stages: examples, tokenized prompts, rollouts."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from specrl.engines.base import FinishReason


@dataclass(frozen=True)
class Example:
    """One dataset row: the prompt (text or chat messages) and what the reward needs."""

    prompt: str | list[dict[str, str]]
    ground_truth: str
    data_source: str
    extra_info: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    example: Example

    @cached_property
    def prompt_id(self) -> str:
        """Stable key: a hash of the token ids (not the dataset position, not the step)."""
        return hashlib.blake2b(",".join(map(str, self.ids)).encode(), digest_size=8).hexdigest()


@dataclass
class Rollout:
    """One sampled response for one slot of a prompt."""

    prompt: Prompt
    slot: int
    token_ids: list[int]
    logprobs: list[float]  # the current policy's logprob of each token, as the engine computed it
    finish_reason: FinishReason
    policy_version: int
    text: str = ""
    score: float = 0.0
    # The probability each token was sampled with where that is not `logprobs` (speculative
    # rollouts under the lenient specrl rule, see spec/verify.py); None: `logprobs`.
    behaviour_logprobs: list[float] | None = None
