"""Acceptance rules: which draft tokens are kept, vectorised over the batch.

Given each draft token's current logprob `new` (from one verification pass) and its stored
behaviour logprob `old`, a rule accepts tokens left to right; the cut index k is the first
rejected position (k = draft length when all are accepted).

- `specrl` (SPEC-RL, arXiv 2509.23232): accept with probability min(1, ℓ · p_new / p_old),
  ℓ = exp(log_lenience). log_lenience = -inf reuses nothing, +inf reuses every draft whole. The
  token at k is then sampled afresh from the current policy — knowingly not distribution-exact;
  `specrl_behaviour_logprobs` gives the probabilities the rule actually samples with.
- `exact`: the draft is a point-mass proposal q = δ_d, so the speculative-sampling acceptance
  min(1, p/q) is p_new(d). On rejection the token at k is drawn from p_new with d removed and
  renormalised (the residual (p - q)+ normalised). Then P(token = d) = p(d) and
  P(token = y ≠ d) = (1 - p(d)) · p(y) / (1 - p(d)) = p(y): every rollout is distributed exactly
  as the current policy would sample it, whatever the drafts were.

Both compare like with like: p_new comes from the engine's `logprobs` under the same sampling
params that produced p_old.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

AcceptanceRule = Literal["specrl", "exact"]


def log_acceptance(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rule: AcceptanceRule,
    log_lenience: float,
) -> torch.Tensor:
    """log α: the log-probability of accepting each draft token once the ones before it were.
    All [B, T] (or [T])."""
    if rule == "exact":
        return new_logprobs
    if log_lenience == math.inf:
        return torch.zeros_like(new_logprobs)
    if log_lenience == -math.inf:
        return torch.full_like(new_logprobs, -math.inf)
    return (log_lenience + new_logprobs - old_logprobs).clamp(max=0.0)


def accept_mask(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    uniforms: torch.Tensor,
    rule: AcceptanceRule,
    log_lenience: float,
) -> torch.Tensor:
    """Per-token acceptance decisions, before the first-rejection cut. All [B, T] → bool [B, T]."""
    return uniforms.log() < log_acceptance(new_logprobs, old_logprobs, rule, log_lenience)


def specrl_behaviour_logprobs(
    logprobs: Sequence[float], matched: int, log_alpha: Sequence[float]
) -> list[float]:
    """log q(y_t | y_<t) of each token of a response y the `specrl` rule produced from a draft d:
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
