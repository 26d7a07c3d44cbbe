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

Both compare like with like: p_new comes from the engine's `score` under the same sampling
params that produced p_old.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

AcceptanceRule = Literal["specrl", "exact"]


def accept_mask(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    uniforms: torch.Tensor,
    rule: AcceptanceRule,
    log_lenience: float,
) -> torch.Tensor:
    """Per-token acceptance decisions, before the first-rejection cut. All [B, T] → bool [B, T]."""
    log_u = uniforms.log()
    if rule == "exact":
        return log_u < new_logprobs
    if log_lenience == math.inf:
        return torch.ones_like(new_logprobs, dtype=torch.bool)
    if log_lenience == -math.inf:
        return torch.zeros_like(new_logprobs, dtype=torch.bool)
    return log_u < log_lenience + new_logprobs - old_logprobs


def specrl_behaviour_logprobs(
    logprobs: Sequence[float],
    matched: int,
    draft_logprobs: Sequence[float],
    mismatch_logprob: float | None,
    log_lenience: float,
) -> list[float]:
    """log q(y_t | y_<t) of each token of a response y the `specrl` rule produced from a draft d:
    the probability it was sampled with, given only the tokens before it.

    While y follows d the rule may still be accepting draft tokens or may have cut and be
    sampling afresh from the current policy p (a resampled token can equal the draft's). With
    π_t the probability of still accepting given y_<t (π_0 = 1) and α_t = min(1, ℓ p(d_t) /
    p_old(d_t)): q(d_t) = π_t α_t + (1 − π_t α_t) p(d_t) and π_{t+1} = π_t α_t / q(d_t); at the
    first token that differs from d, q(y_t) = (1 − π_t α_t) p(y_t); after it, q = p.

    `logprobs`: log p(y_t | y_<t); `matched`: how many leading tokens of y equal d's;
    `draft_logprobs`: log p_old of d's tokens; `mismatch_logprob`: log p(d_t | y_<t) at
    t = matched when y differs from d there (None when y or d ends first)."""
    behaviour = []
    log_pi = 0.0
    for t in range(matched):
        log_keep = log_pi + _log_alpha(logprobs[t], draft_logprobs[t], log_lenience)
        keep = math.exp(log_keep)
        log_q = math.log(keep + (1.0 - keep) * math.exp(logprobs[t]))
        behaviour.append(log_q)
        log_pi = log_keep - log_q
    if mismatch_logprob is not None:
        log_keep = log_pi + _log_alpha(mismatch_logprob, draft_logprobs[matched], log_lenience)
        behaviour.append(logprobs[matched] + _log1mexp(log_keep))
    return behaviour + list(logprobs[len(behaviour) :])


def _log1mexp(x: float) -> float:
    """log(1 - e^x) for x <= 0."""
    return math.log(-math.expm1(x)) if x < 0 else -math.inf


def _log_alpha(new: float, old: float, log_lenience: float) -> float:
    if log_lenience == math.inf:
        return 0.0
    if log_lenience == -math.inf:
        return -math.inf
    return min(0.0, log_lenience + new - old)


def cut_indices(accepted: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """First rejected position of each row within its draft length. accepted [B, T] bool,
    lengths [B] → cut [B] (= length when the whole draft is accepted)."""
    positions = torch.arange(accepted.shape[1], device=accepted.device)[None, :]
    rejected = ~accepted & (positions < lengths[:, None])
    return torch.where(rejected.any(1), rejected.int().argmax(1), lengths)
