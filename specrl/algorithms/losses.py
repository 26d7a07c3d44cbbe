"""Policy losses as pure functions on [B, T] token tensors with a response mask.

A mini-batch (one optimizer step) is usually computed in several micro-batches. Losses are
normalised by the *mini-batch's* totals (`AggScale`: its response tokens and sequences), so each
micro-batch returns its share and the shares add up to the mini-batch's loss, whatever the
micro-batch size (DAPO's token-mean averages over all tokens of the batch, arXiv 2503.14476,
eq. 12; verl normalises the same way)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLType = Literal["k1", "k2", "low_var_kl"]
# As verl: the PPO ratio's log and k3's log r are clamped to ±20 before exp (finite losses and
# grads). k1 and k2 are not clamped (their gradient keeps pulling back the tokens that drifted
# most), nor are GSPO's token log-ratios before their sequence mean (the sequence one is, at 10).
MAX_LOG_RATIO = 20.0
MAX_SEQ_LOG_RATIO = 10.0


@dataclass(frozen=True)
class AggScale:
    """Totals of the batch a loss is averaged over, when it is computed in parts: its response
    tokens and its sequences."""

    tokens: float
    sequences: int

    @classmethod
    def of(cls, mask: torch.Tensor) -> AggScale:
        """The totals of a whole batch, mask [B, T]."""
        return cls(float(mask.sum().clamp(min=1)), mask.shape[0])


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ values where mask is set; `where`, not a product, so a NaN or inf in padding stays out."""
    return torch.where(mask.bool(), values, 0.0).sum()


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, scale: AggScale | None = None
) -> torch.Tensor:
    """Mean over the masked tokens; with `scale`, this part's share of the mean over all of the
    batch's tokens."""
    tokens = AggScale.of(mask).tokens if scale is None else scale.tokens
    return masked_sum(values, mask) / tokens


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggMode,
    horizon: int | None = None,
    scale: AggScale | None = None,
) -> torch.Tensor:
    """Average a [B, T] token loss to a scalar; with `scale`, this micro-batch's share of the
    average over the mini-batch whose totals `scale` holds.

    token-mean: over all response tokens of the batch (DAPO, arXiv 2503.14476);
    seq-mean-token-mean: per sequence, then over sequences (original GRPO);
    seq-mean-token-sum-norm: per-sequence sums divided by a constant horizon (default T, pass
    max_response_length), then mean over sequences (Dr.GRPO, arXiv 2503.20783): no length bias.
    """
    scale = AggScale.of(mask) if scale is None else scale
    if mode == "token-mean":
        return masked_sum(loss_mat, mask) / scale.tokens
    seq_sums = torch.where(mask.bool(), loss_mat, 0.0).sum(-1)  # [B]
    if mode == "seq-mean-token-mean":
        return (seq_sums / mask.sum(-1).clamp(min=1)).sum() / scale.sequences
    return (seq_sums / (horizon or loss_mat.shape[-1])).sum() / scale.sequences


@dataclass(frozen=True)
class ClipConfig:
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: LossAggMode = "token-mean"
    horizon: int | None = None  # seq-mean-token-sum-norm's constant
    loss_mode: str = "vanilla"  # the policy loss, by its name in POLICY_LOSSES


@dataclass(frozen=True)
class PolicyLossOutputs:
    loss: torch.Tensor  # scalar to backpropagate
    pg_clipfrac: torch.Tensor  # fraction of tokens where the upper/lower clip is active
    pg_clipfrac_lower: torch.Tensor  # fraction where the dual clip (negative advantages) is active
    ppo_kl: torch.Tensor  # mean of old - new logprob


PolicyLossFn = Callable[..., PolicyLossOutputs]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss under `actor.policy_loss.loss_mode` = name. Signature:
    (logprobs, old_logprobs, advantages, mask, cfg: ClipConfig, weights=None, scale=None) →
    PolicyLossOutputs, all tensors [B, T]."""

    def register(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered already")
        POLICY_LOSSES[name] = fn
        return fn

    return register


@register_policy_loss("vanilla")
def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: ClipConfig,
    weights: torch.Tensor | None = None,
    scale: AggScale | None = None,
) -> PolicyLossOutputs:
    """PPO clipped surrogate with asymmetric clip (DAPO clip-higher) and dual clip
    (arXiv 1912.09729): for negative advantages the loss is bounded by -A·clip_ratio_c.
    `weights` (e.g. rollout importance weights) multiply each token's loss; `scale`: the totals
    of the mini-batch this is part of (the loss and the statistics are this part's shares).
    All tensors [B, T]."""
    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * cfg.clip_ratio_c
    dual_loss = torch.minimum(dual_bound, clip_loss)
    token_loss = torch.where(advantages < 0, dual_loss, clip_loss)
    if weights is not None:
        token_loss = token_loss * weights
    dual = (clip_loss > dual_bound) & (advantages < 0)
    return PolicyLossOutputs(
        loss=agg_loss(token_loss, mask, cfg.loss_agg_mode, cfg.horizon, scale),
        pg_clipfrac=masked_mean((clipped > unclipped).float(), mask, scale).detach(),
        pg_clipfrac_lower=masked_mean(dual.float(), mask, scale).detach(),
        ppo_kl=masked_mean(-log_ratio, mask, scale).detach(),
    )


@register_policy_loss("gspo")
def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: ClipConfig,
    weights: torch.Tensor | None = None,
    scale: AggScale | None = None,
) -> PolicyLossOutputs:
    """GSPO (arXiv 2507.18071): one importance ratio per sequence, the geometric mean of its
    token ratios, s_i = exp(mean_t log(π/π_old)), clipped to [1 − low, 1 + high] (the paper's
    ranges are ~1e-4: 3e-4 and 4e-4), and the loss averaged per sequence, then over
    sequences (seq-mean-token-mean, whatever cfg.loss_agg_mode says). In token form, as verl:
    log s_i,t = sg[log s_i] + log π_t − sg[log π_t], whose gradient is that of the paper's
    sequence objective. `weights` multiply each token's loss."""
    log_ratio = logprobs - old_logprobs
    lengths = mask.sum(-1).clamp(min=1)
    seq_log_ratio = torch.where(mask.bool(), log_ratio, 0.0).sum(-1) / lengths  # [B]
    token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach()[:, None]
    ratio = token_log_ratio.clamp(max=MAX_SEQ_LOG_RATIO).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - cfg.clip_ratio_low, 1.0 + cfg.clip_ratio_high)
    token_loss = torch.maximum(unclipped, clipped)
    if weights is not None:
        token_loss = token_loss * weights
    return PolicyLossOutputs(
        loss=agg_loss(token_loss, mask, "seq-mean-token-mean", cfg.horizon, scale),
        pg_clipfrac=masked_mean((clipped > unclipped).float(), mask, scale).detach(),
        pg_clipfrac_lower=torch.zeros(()),
        ppo_kl=masked_mean(-log_ratio, mask, scale).detach(),
    )


@dataclass(frozen=True)
class ValueLossOutputs:
    loss: torch.Tensor  # scalar to backpropagate: ½ · token-mean of the clipped squared error
    vf_clipfrac: torch.Tensor  # fraction of tokens where the clipped error is the larger
    vpred_mean: torch.Tensor


def value_loss(
    vpreds: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
    scale: AggScale | None = None,
) -> ValueLossOutputs:
    """PPO's clipped value loss (as verl): the prediction may move at most `cliprange_value`
    from the value the advantages were computed with; the larger of the clipped and unclipped
    squared errors counts. All tensors [B, T]; `scale` as in the policy losses."""
    clipped = old_values + (vpreds - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_error = (vpreds - returns).square()
    clipped_error = (clipped - returns).square()
    error = torch.maximum(unclipped_error, clipped_error)
    return ValueLossOutputs(
        loss=0.5 * masked_mean(error, mask, scale),
        vf_clipfrac=masked_mean((clipped_error > unclipped_error).float(), mask, scale).detach(),
        vpred_mean=masked_mean(vpreds, mask, scale).detach(),
    )


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLType) -> torch.Tensor:
    """Per-token estimate of KL(π‖π_ref) from samples of π (Schulman, "Approximating KL
    divergence"): k1 = log r⁻¹, k2 = ½ (log r)², low_var_kl = k3 = r - log r - 1 with r = π_ref/π,
    its log r clamped to ±20 and the estimate to [-10, 10], as in verl."""
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    ref_log_ratio = (-log_ratio).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return (ref_log_ratio.exp() - ref_log_ratio - 1).clamp(-10.0, 10.0)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] → entropy [...] of softmax(logits)."""
    logprobs = logits.log_softmax(-1)
    return -(logprobs.exp() * logprobs).sum(-1)
