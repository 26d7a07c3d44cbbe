"""Acceptance rules, one class each: which draft tokens are kept (vectorised over the batch), what
the token at a cut is drawn from, and what the rollouts' tokens were sampled with.

Given each draft token's current logprob `new` (from one verification pass) and its stored
behaviour logprob `old`, a rule accepts tokens left to right; the cut index k is the first
rejected position (k = draft length when all are accepted).

- `specrl`, `LenientRule` (SPEC-RL, arXiv 2509.23232): accept with probability
  min(1, ℓ · p_new / p_old), ℓ = exp(log_lenience). log_lenience = -inf reuses nothing, +inf reuses every draft whole. The
  token at k is then sampled afresh from the current policy — knowingly not distribution-exact;
  `behaviour` gives the probabilities the rule actually sampled with (the rollouts it drafted
  carry them, and the trainer weighs by them). It needs each draft token's new probability from
  a verification pass before decoding, so it cannot be verified inside decoding nor walk tries.
- `exact`, `ExactRule`: the draft is a point-mass proposal q = δ_d, so the speculative-sampling
  acceptance min(1, p/q) is p_new(d). On rejection the token at k is drawn from p_new with d removed and
  renormalised (the residual (p - q)+ normalised). Then P(token = d) = p(d) and
  P(token = y ≠ d) = (1 - p(d)) · p(y) / (1 - p(d)) = p(y): every rollout is distributed exactly
  as the current policy would sample it, whatever the drafts were, and carries no behaviour
  logprobs of its own. It needs an engine that samples from residuals.

Both compare like with like: p_new comes from the engine's `logprobs` under the same sampling
params that produced p_old.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from specrl.engines.sampling import seeded_uniform
from specrl.speculative.slots import common_prefix

# the current logprob of each (context, token) pair: what verification did not compute
LogprobOf = Callable[[list[tuple[list[int], int]]], list[float]]

if TYPE_CHECKING:
    from specrl.config import SpecConfig
    from specrl.speculative.slots import Slot
    from specrl.speculative.stats import RolloutStats
    from specrl.types import Rollout


class AcceptanceRule(ABC):
    """A rule over point-mass drafts. `exact`: its rollouts are distributed as the current
    policy's samples (no behaviour logprobs of their own)."""

    exact: ClassVar[bool]

    @abstractmethod
    def log_acceptance(
        self, new_logprobs: torch.Tensor, old_logprobs: torch.Tensor
    ) -> torch.Tensor:
        """log α: the log-probability of accepting each draft token once the ones before it
        were. All [B, T] (or [T])."""

    @abstractmethod
    def residual(self, rejected: int) -> tuple[int, ...]:
        """The tokens the token at a cut may not be, given the rejected draft token there."""

    @abstractmethod
    def behaviour(
        self,
        slots: Sequence[Slot],
        rollouts: list[Rollout],
        logprob_of: LogprobOf,
        stats: RolloutStats,
    ) -> list[Rollout]:
        """The rollouts of these slots with the logprobs their tokens were sampled with, where
        those are not the current policy's (`Rollout.behaviour_logprobs`); `logprob_of` gives
        the current logprob of (context, token) pairs verification did not compute."""

    def accept_mask(
        self, new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, uniforms: torch.Tensor
    ) -> torch.Tensor:
        """Per-token acceptance decisions, before the first-rejection cut. All [B, T] → bool
        [B, T]."""
        return uniforms.log() < self.log_acceptance(new_logprobs, old_logprobs)

    def cuts(self, new: list[list[float]], old: list[np.ndarray], seeds: list[int]) -> list[int]:
        """The cut index of each draft from its verified prefix's current logprobs `new`, its
        stored ones `old` and its verification seed (ragged → padded [B, T])."""
        lengths = torch.tensor([len(x) for x in new])
        width = int(lengths.max())
        new_t = torch.zeros(len(new), width, dtype=torch.float64)
        old_t = torch.zeros(len(new), width, dtype=torch.float64)
        for row, (x, y) in enumerate(zip(new, old, strict=True)):
            new_t[row, : len(x)] = torch.tensor(x, dtype=torch.float64)
            old_t[row, : len(x)] = torch.from_numpy(y[: len(x)]).double()
        uniforms = seeded_uniform(torch.tensor(seeds)[:, None], torch.arange(width)[None, :])
        return cut_indices(self.accept_mask(new_t, old_t, uniforms), lengths).tolist()


class ExactRule(AcceptanceRule):
    exact = True

    def log_acceptance(
        self, new_logprobs: torch.Tensor, old_logprobs: torch.Tensor
    ) -> torch.Tensor:
        return new_logprobs

    def residual(self, rejected: int) -> tuple[int, ...]:
        return (rejected,)

    def behaviour(
        self,
        slots: Sequence[Slot],
        rollouts: list[Rollout],
        logprob_of: LogprobOf,
        stats: RolloutStats,
    ) -> list[Rollout]:
        return rollouts  # the current policy's samples: no behaviour logprobs of their own


@dataclass(frozen=True)
class LenientRule(AcceptanceRule):
    log_lenience: float
    exact: ClassVar[bool] = False

    def log_acceptance(
        self, new_logprobs: torch.Tensor, old_logprobs: torch.Tensor
    ) -> torch.Tensor:
        if self.log_lenience == math.inf:
            return torch.zeros_like(new_logprobs)
        if self.log_lenience == -math.inf:
            return torch.full_like(new_logprobs, -math.inf)
        return (self.log_lenience + new_logprobs - old_logprobs).clamp(max=0.0)

    def residual(self, rejected: int) -> tuple[int, ...]:
        return ()  # the token at a cut is sampled afresh from the current policy

    def behaviour(
        self,
        slots: Sequence[Slot],
        rollouts: list[Rollout],
        logprob_of: LogprobOf,
        stats: RolloutStats,
    ) -> list[Rollout]:
        """The rollouts with the behaviour logprobs of every drafted one (`behaviour_logprobs`;
        an undrafted one was sampled from the current policy). The current logprob of the draft
        token where a response first leaves its draft is known from verification, except past
        the chunks chunked verification computed: `logprob_of` gives those, in one batch."""
        drafted = [i for i, s in enumerate(slots) if s.reused is not None and s.draft is not None]
        matched = {
            i: common_prefix(rollouts[i].token_ids, slots[i].draft.token_ids) for i in drafted
        }
        leaves = [
            i for i in drafted if matched[i] < min(len(rollouts[i].token_ids), len(slots[i].draft))
        ]
        mismatch = {
            i: slots[i].reused.checked[matched[i]]
            for i in leaves
            if matched[i] < len(slots[i].reused.checked)
        }
        unverified = [i for i in leaves if i not in mismatch]
        extra = logprob_of(
            [
                (
                    [*slots[i].prompt.ids, *rollouts[i].token_ids[: matched[i]]],
                    int(slots[i].draft.token_ids[matched[i]]),
                )
                for i in unverified
            ]
        )
        mismatch.update(zip(unverified, extra, strict=True))
        # α of the draft tokens each response follows, then of the one where it leaves its draft,
        # for all rollouts at once (flat)
        new = [
            [*rollouts[i].current_logprobs[: matched[i]], *([mismatch[i]] if i in mismatch else [])]
            for i in drafted
        ]
        old = [slots[i].draft.current_logprobs[: len(x)] for i, x in zip(drafted, new, strict=True)]
        log_alpha = self.log_acceptance(
            torch.tensor([p for x in new for p in x], dtype=torch.float64),
            torch.from_numpy(np.concatenate(old or [np.zeros(0)])).double(),
        ).tolist()
        out, start = list(rollouts), 0
        for i, x in zip(drafted, new, strict=True):
            r = rollouts[i]
            behaviour = behaviour_logprobs(
                r.current_logprobs, matched[i], log_alpha[start : start + len(x)]
            )
            start += len(x)
            stats.behaviour_gap_sum += sum(
                abs(q - p) for q, p in zip(behaviour, r.current_logprobs, strict=True)
            )
            stats.behaviour_gap_tokens += len(behaviour)
            out[i] = dataclasses.replace(r, behaviour_logprobs=behaviour)
        return out


def acceptance_rule(cfg: SpecConfig) -> AcceptanceRule:
    """The rule `rollout.spec.acceptance` names."""
    return ExactRule() if cfg.acceptance == "exact" else LenientRule(cfg.log_lenience)


def behaviour_logprobs(
    logprobs: Sequence[float], matched: int, log_alpha: Sequence[float]
) -> list[float]:
    """log q(y_t | y_<t) of each token of a response y the lenient rule produced from a draft d:
    the probability it was sampled with, given only the tokens before it.

    While y follows d the rule may still be accepting draft tokens or may have cut and be
    sampling afresh from the current policy p (a resampled token can equal the draft's). With
    π_t the probability of still accepting given y_<t (π_0 = 1) and α_t the rule's acceptance
    probability of d_t: q(d_t) = π_t α_t + (1 − π_t α_t) p(d_t) and π_{t+1} = π_t α_t / q(d_t);
    at the first token that differs from d, q(y_t) = (1 − π_t α_t) p(y_t); after it, q = p.

    `logprobs`: log p(y_t | y_<t); `matched`: how many leading tokens of y equal d's; `log_alpha`:
    log α_t for those tokens, and for the draft token where y leaves d when it does (so
    `matched + 1` values then)."""
    behaviour = []
    log_pi = 0.0
    for t in range(matched):
        log_keep = log_pi + log_alpha[t]
        keep = math.exp(log_keep)
        log_q = math.log(keep + (1.0 - keep) * math.exp(logprobs[t]))
        behaviour.append(log_q)
        log_pi = log_keep - log_q
    if len(log_alpha) > matched:
        behaviour.append(logprobs[matched] + _log1mexp(log_pi + log_alpha[matched]))
    return behaviour + list(logprobs[len(behaviour) :])


def _log1mexp(x: float) -> float:
    """log(1 - e^x) for x <= 0."""
    return math.log(-math.expm1(x)) if x < 0 else -math.inf


def cut_indices(accepted: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """First rejected position of each row within its draft length. accepted [B, T] bool,
    lengths [B] → cut [B] (= length when the whole draft is accepted)."""
    positions = torch.arange(accepted.shape[1], device=accepted.device)[None, :]
    rejected = ~accepted & (positions < lengths[:, None])
    return torch.where(rejected.any(1), rejected.int().argmax(1), lengths)
