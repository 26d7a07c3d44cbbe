"""Rollout correction (verl's name): truncated importance weights of the trainer's policy over
the distribution each token was actually sampled from: the engine's (when it differs from the
trainer's numerics) or the lenient specrl rule's own probabilities (speculative/acceptance.py)."""

from __future__ import annotations

import math
from typing import Literal

import torch

from specrl.config import RolloutCorrectionConfig


def rollout_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: Literal["token", "sequence"],
    threshold: float,
) -> torch.Tensor:
    """Truncated importance weights for the mismatch between the rollout engine's logprobs and
    the trainer's (as verl's rollout correction): per token min(π_old/π_rollout, threshold), or
    per sequence min(Π_t π_old/π_rollout, threshold) on every token. [B, T] → [B, T], no grad."""
    mask = mask.bool()
    log_ratio = torch.where(mask, (old_logprobs - rollout_logprobs).detach(), 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(old_logprobs)
    return torch.where(mask, log_ratio.clamp(max=math.log(threshold)).exp(), 0.0)


def correction_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cfg: RolloutCorrectionConfig,
    off_policy: bool,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The weights [B, T] in effect for this batch (None: unweighted) and their mean per token;
    `off_policy`: its rollouts carry behaviour logprobs of their own."""
    level = cfg.level(off_policy)
    if level is None:
        return None, {}
    weights = rollout_is_weights(
        old_logprobs, behaviour_logprobs, mask, level, cfg.rollout_is_threshold
    )
    mean = float(weights.sum() / mask.sum().clamp(min=1))
    return weights, {"rollout_corr/rollout_is_mean": mean}
