"""Advantage estimators, chosen by name from one registry (`algorithm.adv_estimator`).

Every estimator has one signature: `AdvantageInputs` → (advantages, returns), both [B, T] over
the response tokens (zero outside `response_mask`). Rollouts arrive prompt-major: B = G·n, the
n slots of a prompt contiguous, with one outcome score per response ([G, n]). Outcome
estimators (GRPO, RLOO) give every token of a response its response's advantage; REINFORCE++
discounts and whitens over the batch's tokens; GAE uses the critic's values. Register a new one
with `@register_adv_est`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specrl.algorithms.losses import masked_mean


@dataclass(frozen=True)
class AdvantageInputs:
    scores: torch.Tensor  # [G, n] one outcome score per response, n slots per prompt
    response_mask: torch.Tensor  # [B, T], B = G·n, prompt-major
    gamma: float = 1.0  # discount over response tokens (REINFORCE++, GAE)
    norm_by_std: bool = True  # GRPO: divide by the group's std (false: Dr.GRPO)
    values: torch.Tensor | None = None  # [B, T] the critic's value of each token's state (GAE)
    lam: float = 1.0  # GAE's λ

    def outcome_tokens(self, per_response: torch.Tensor) -> torch.Tensor:
        """[G, n] → [B, T]: each response's value on each of its tokens."""
        return per_response.reshape(-1, 1) * self.response_mask

    def last_token_rewards(self) -> torch.Tensor:
        """[B, T] with each response's score on its last token (the reward of a sequence)."""
        mask = self.response_mask
        last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask.bool()
        return torch.where(last, self.scores.reshape(-1, 1), 0.0)


AdvantageFn = Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: dict[str, AdvantageFn] = {}


def register_adv_est(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    def register(fn: AdvantageFn) -> AdvantageFn:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered already")
        ADV_ESTIMATORS[name] = fn
        return fn

    return register


def compute_advantages(name: str, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, T] by the estimator registered as `name`."""
    return ADV_ESTIMATORS[name](inputs)


def grpo_advantages(
    scores: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (arXiv 2402.03300): score minus the group mean, divided by the group std when
    `norm_by_std`; without it this is Dr.GRPO (arXiv 2503.20783), which drops the std to avoid
    favouring groups with low variance. scores [G, n] → advantages [G, n]."""
    centered = scores - scores.mean(-1, keepdim=True)
    if not norm_by_std:
        return centered
    # torch.std is unbiased, as in verl; a single-slot group has no spread, so its advantage is 0
    std = scores.std(-1, keepdim=True) if scores.shape[-1] > 1 else torch.zeros_like(scores)
    return centered / (std + eps)


def rloo_advantages(scores: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (arXiv 2402.14740): score minus the mean of the other n - 1 scores
    of its group. scores [G, n] → advantages [G, n]; needs n ≥ 2."""
    n = scores.shape[-1]
    if n < 2:
        raise ValueError("rloo needs rollout.n >= 2")
    others_mean = (scores.sum(-1, keepdim=True) - scores) / (n - 1)
    return scores - others_mean


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x − mean) / std over the masked entries (unbiased variance, as verl), zero elsewhere."""
    mean = masked_mean(values, mask)
    count = mask.sum()
    var = masked_mean((values - mean).square(), mask) * count / (count - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + γ G_{t+1} over each response's tokens, [B, T] → [B, T]: the sum runs over
    the masked tokens only (an episode's observations are skipped, not a new start), and is 0
    outside the mask."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t].bool(), rewards[:, t] + gamma * running, running)
        returns[:, t] = running * mask[:, t]
    return returns


@register_adv_est("grpo")
def _grpo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = inputs.outcome_tokens(grpo_advantages(inputs.scores, inputs.norm_by_std))
    return advantages, advantages


@register_adv_est("rloo")
def _rloo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = inputs.outcome_tokens(rloo_advantages(inputs.scores))
    return advantages, advantages


@register_adv_est("reinforce_plus_plus")
def reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv 2501.03262): the discounted return of each token (the score is the
    reward of the last token), whitened over all response tokens of the batch: a global
    baseline and scale instead of a per-prompt group's."""
    mask = inputs.response_mask
    returns = discounted_returns(inputs.last_token_rewards(), mask, inputs.gamma)
    return masked_whiten(returns, mask), returns


@register_adv_est("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (arXiv 2501.03262 v3): each score minus its group's mean (no
    std), on every token of the response, then whitened over the batch's tokens."""
    mask = inputs.response_mask
    centered = inputs.scores - inputs.scores.mean(-1, keepdim=True)
    returns = inputs.outcome_tokens(centered)
    return masked_whiten(returns, mask), returns


@register_adv_est("gae")
def gae(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (arXiv 1506.02438) over each response, the score being
    the reward of its last token: δ_t = r_t + γ V_{t+1} − V_t (0 after the last token),
    A_t = δ_t + γλ A_{t+1}. Returns A + V are the critic's targets; the advantages are whitened
    over the batch's tokens (as verl)."""
    if inputs.values is None:
        raise ValueError("gae needs the critic's values (AdvantageInputs.values)")
    mask = inputs.response_mask.bool()
    rewards, values = inputs.last_token_rewards(), inputs.values
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])  # A_{t+1}
    next_value = torch.zeros_like(values[:, 0])  # V_{t+1}
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + inputs.gamma * next_value - values[:, t]
        running = torch.where(mask[:, t], delta + inputs.gamma * inputs.lam * running, running)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        advantages[:, t] = running
    returns = (advantages + values) * mask
    return masked_whiten(advantages, mask), returns
