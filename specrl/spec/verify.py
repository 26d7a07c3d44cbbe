"""Acceptance rules: which draft tokens are kept, vectorised over the batch.

Given each draft token's current logprob `new` (from one verification pass) and its stored
behaviour logprob `old`, a rule accepts tokens left to right; the cut index k is the first
rejected position (k = draft length when all are accepted).

- `specrl` (SPEC-RL, arXiv 2509.23232): accept with probability min(1, ℓ · p_new / p_old),
  ℓ = exp(log_lenience). log_lenience = -inf reuses nothing, +inf reuses every draft whole. The
  token at k is then sampled afresh from the current policy — knowingly not distribution-exact.
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


def cut_indices(accepted: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """First rejected position of each row within its draft length. accepted [B, T] bool,
    lengths [B] → cut [B] (= length when the whole draft is accepted)."""
    positions = torch.arange(accepted.shape[1], device=accepted.device)[None, :]
    rejected = ~accepted & (positions < lengths[:, None])
    return torch.where(rejected.any(1), rejected.int().argmax(1), lengths)
