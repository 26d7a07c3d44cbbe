"""Policy losses as pure functions on [B, T] token tensors with a response mask."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLType = Literal["k1", "k2", "low_var_kl"]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def agg_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: LossAggMode, horizon: int | None = None
) -> torch.Tensor:
    """Average a [B, T] token loss to a scalar.

    token-mean: over all response tokens of the batch (DAPO, arXiv 2503.14476);
    seq-mean-token-mean: per sequence, then over sequences (original GRPO);
    seq-mean-token-sum-norm: per-sequence sums divided by a constant horizon (default T, pass
    max_response_length), then mean over sequences (Dr.GRPO, arXiv 2503.20783): no length bias.
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    seq_sums = (loss_mat * mask).sum(-1)  # [B]
    if mode == "seq-mean-token-mean":
        return (seq_sums / mask.sum(-1).clamp(min=1)).mean()
    return (seq_sums / (horizon or loss_mat.shape[-1])).mean()


@dataclass(frozen=True)
class ClipConfig:
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: LossAggMode = "token-mean"
    horizon: int | None = None  # seq-mean-token-sum-norm's constant


@dataclass(frozen=True)
class PolicyLossOutputs:
    loss: torch.Tensor  # scalar to backpropagate
    pg_clipfrac: torch.Tensor  # fraction of tokens where the upper/lower clip is active
    pg_clipfrac_lower: torch.Tensor  # fraction where the dual clip (negative advantages) is active
    ppo_kl: torch.Tensor  # mean of old - new logprob


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: ClipConfig,
    weights: torch.Tensor | None = None,
) -> PolicyLossOutputs:
    """PPO clipped surrogate with asymmetric clip (DAPO clip-higher) and dual clip
    (arXiv 1912.09729): for negative advantages the loss is bounded by -A·clip_ratio_c.
    `weights` (e.g. rollout importance weights) multiply each token's loss. All tensors [B, T]."""
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * cfg.clip_ratio_c
    dual_loss = torch.minimum(dual_bound, clip_loss)
    token_loss = torch.where(advantages < 0, dual_loss, clip_loss)
    if weights is not None:
        token_loss = token_loss * weights
    mask_f = mask.to(logprobs.dtype)
    return PolicyLossOutputs(
        loss=agg_loss(token_loss, mask_f, cfg.loss_agg_mode, cfg.horizon),
        pg_clipfrac=masked_mean((clipped > unclipped).to(mask_f.dtype), mask_f).detach(),
        pg_clipfrac_lower=masked_mean(
            ((clip_loss > dual_bound) & (advantages < 0)).to(mask_f.dtype), mask_f
        ).detach(),
        ppo_kl=masked_mean(-log_ratio, mask_f).detach(),
    )


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
    log_ratio = (old_logprobs - rollout_logprobs).detach() * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(old_logprobs)
    return log_ratio.clamp(max=math.log(threshold)).exp() * mask


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLType) -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from samples of π (Schulman, "Approximating KL
    divergence"): k1 = log r⁻¹, k2 = ½ (log r)², low_var_kl = k3 = r - log r - 1 with r = π_ref/π,
    clamped to [-10, 10] as in verl."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    ref_log_ratio = -log_ratio
    return (ref_log_ratio.exp() - ref_log_ratio - 1).clamp(-10.0, 10.0)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] → entropy [...] of softmax(logits)."""
    logprobs = logits.log_softmax(-1)
    return -(logprobs.exp() * logprobs).sum(-1)
