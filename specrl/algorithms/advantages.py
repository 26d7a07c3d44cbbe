"""Outcome advantage estimators over groups of rollouts of the same prompt.

Scores arrive as [G, n]: G prompts (groups), n slots each. Every token of a response gets its
response's advantage (outcome supervision), so these return one value per response.
"""

from __future__ import annotations

from typing import Literal

import torch

AdvEstimator = Literal["grpo", "rloo"]


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


def compute_advantages(
    scores: torch.Tensor, estimator: AdvEstimator, norm_adv_by_std_in_grpo: bool = True
) -> torch.Tensor:
    if estimator == "grpo":
        return grpo_advantages(scores, norm_by_std=norm_adv_by_std_in_grpo)
    return rloo_advantages(scores)
