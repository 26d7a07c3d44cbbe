"""The rollout engine protocol and the request/result shapes every engine speaks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from specrl.engines.speculation import Drafting

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """The distribution tokens are drawn from: softmax(logits / temperature), then top-k, then
    top-p, each renormalised. `temperature == 0` is greedy (a point mass on the argmax)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class GenRequest:
    """Decode after `prompt_ids + prefix_ids` (the forced prefix is context, not output).

    `reject_token`: the first new token is drawn from the sampling distribution with this token
    removed and renormalised (the residual of the exact acceptance rule after a rejected draft
    token). Its reported logprob is under the full distribution: that is its marginal
    probability under exact speculative sampling.
    """

    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    prefix_ids: Sequence[int] = ()
    reject_token: int | None = None


@dataclass
class GenResult:
    token_ids: list[int]
    logprobs: list[float]  # behaviour logprob of each new token
    finish_reason: FinishReason
    forwards: int = 0  # decode forwards this request took part in
    draft_tokens: int = 0  # draft tokens verified for it (speculative decoding)
    accepted_tokens: int = 0  # of which accepted


@dataclass(frozen=True)
class ScoreRequest:
    """Logprob of each target token given `context_ids` and the targets before it."""

    context_ids: Sequence[int]
    target_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


def distinct_requests(requests: Sequence[ScoreRequest]) -> tuple[list[ScoreRequest], list[int]]:
    """Identical score requests (the n slots of a prompt often hold the same draft), computed
    once: → (the distinct requests, the index into them of every request)."""
    index: dict[tuple, int] = {}
    distinct: list[ScoreRequest] = []
    where = []
    for r in requests:
        key = (tuple(r.context_ids), tuple(r.target_ids), r.sampling)
        if key not in index:
            index[key] = len(distinct)
            distinct.append(r)
        where.append(index[key])
    return distinct, where


class RolloutEngine(Protocol):
    eos_token_ids: frozenset[int]
    drafts: bool  # whether `generate` decodes with the token-tree drafts it is given

    def generate(
        self, requests: Sequence[GenRequest], drafting: Drafting | None = None
    ) -> list[GenResult]: ...

    def score(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]: ...

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None: ...
