"""The PPO update of the policy, and the `Actor` that holds what it changes.

`ppo_update` runs `actor.ppo_epochs` passes over a step's rollouts; each pass splits them into
mini-batches (one optimizer step each) and those into micro-batches (gradient accumulation).
Every micro-batch's loss is its share of its mini-batch's loss (`AggScale`), so the update does
not depend on `ppo_micro_batch_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from specrl.actor.batch import TrainBatch, batched_logprobs, response_logprobs
from specrl.algorithms.losses import POLICY_LOSSES, AggScale, ClipConfig, agg_loss, kl_penalty
from specrl.config import ActorConfig, OptimConfig


@dataclass
class ActorStats:
    """One update, as verl logs it: the per-mini-batch values averaged over mini-batches."""

    pg_loss: float
    pg_clipfrac: float
    pg_clipfrac_lower: float
    ppo_kl: float
    entropy: float
    grad_norm: float
    lr: float
    skipped_updates: int  # mini-batches whose gradient was not finite (weights kept)
    kl_loss: float | None = None

    def metrics(self) -> dict[str, float]:
        return {f"actor/{k}": v for k, v in vars(self).items() if v is not None}


@dataclass
class _MiniBatchSums:
    values: dict[str, float] = field(default_factory=dict)

    def add(self, key: str, value: torch.Tensor) -> None:
        self.values[key] = self.values.get(key, 0.0) + value.item()


def ppo_update(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: TrainBatch,
    cfg: ActorConfig,
    clip: ClipConfig,
    temperature: float,
    group_size: int,
    generator: torch.Generator,
) -> ActorStats:
    """Update `model` on `batch` (old logprobs, advantages and, where used, reference logprobs
    and importance weights filled in). A mini-batch is `ppo_mini_batch_size` prompts of
    `group_size` rollouts each; `generator` shuffles the rollouts every pass."""
    mini = cfg.ppo_mini_batch_size * group_size
    per_mini: list[dict[str, float]] = []
    skipped = 0
    model.train()
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(len(batch), generator=generator)
        for start in range(0, len(batch), mini):
            rows = order[start : start + mini]
            sums = _mini_batch(model, optimizer, batch, rows, cfg, clip, temperature)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            sums.add("grad_norm", grad_norm)
            if torch.isfinite(grad_norm):
                optimizer.step()
                scheduler.step()  # the schedule counts applied updates
            else:  # a NaN / inf loss or gradient: keep the weights, report the skip
                skipped += 1
            per_mini.append(sums.values)
    model.eval()
    mean = {k: float(np.mean([m[k] for m in per_mini])) for k in per_mini[0]}
    return ActorStats(
        pg_loss=mean["pg_loss"],
        pg_clipfrac=mean["pg_clipfrac"],
        pg_clipfrac_lower=mean["pg_clipfrac_lower"],
        ppo_kl=mean["ppo_kl"],
        entropy=mean["entropy"],
        grad_norm=mean["grad_norm"],
        lr=scheduler.get_last_lr()[0],
        skipped_updates=skipped,
        kl_loss=mean.get("kl_loss"),
    )


def _mini_batch(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    rows: torch.Tensor,
    cfg: ActorConfig,
    clip: ClipConfig,
    temperature: float,
) -> _MiniBatchSums:
    """Accumulate the gradient of one mini-batch over its micro-batches: → the mini-batch's loss
    terms (each the sum of its micro-batches' shares)."""
    optimizer.zero_grad(set_to_none=True)
    scale = AggScale.of(batch.response_mask[rows])
    sums = _MiniBatchSums()
    for micro in rows.split(cfg.ppo_micro_batch_size):
        part = batch.rows(micro)
        logprobs, entropy = response_logprobs(model, part, temperature)  # [b, R] each
        mask = part.response_mask
        out = POLICY_LOSSES[clip.loss_mode](
            logprobs, part.old_logprobs, part.advantages, mask, clip, part.is_weights, scale
        )
        entropy_term = agg_loss(entropy, mask, cfg.loss_agg_mode, clip.horizon, scale)
        loss = out.loss - cfg.entropy_coeff * entropy_term
        if part.ref_logprobs is not None:
            kl = kl_penalty(logprobs, part.ref_logprobs, cfg.kl_loss_type)
            kl_term = agg_loss(kl, mask, cfg.loss_agg_mode, clip.horizon, scale)
            loss = loss + cfg.kl_loss_coef * kl_term
            sums.add("kl_loss", kl_term)
        loss.backward()
        sums.add("pg_loss", out.loss)
        sums.add("pg_clipfrac", out.pg_clipfrac)
        sums.add("pg_clipfrac_lower", out.pg_clipfrac_lower)
        sums.add("ppo_kl", out.ppo_kl)
        sums.add("entropy", entropy_term)
    return sums


def adamw_with_warmup(
    model: torch.nn.Module, cfg: OptimConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the model's parameters and its schedule: linear warmup, then constant."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
    )
    warmup = cfg.lr_warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1))
    )
    return optimizer, scheduler


class Actor:
    """The policy being trained, its optimizer and learning-rate schedule, and the frozen KL
    reference (None without a KL loss)."""

    def __init__(
        self,
        policy: PreTrainedModel,
        cfg: ActorConfig,
        clip: ClipConfig,
        temperature: float,
        reference: PreTrainedModel | None = None,
    ) -> None:
        self.policy = policy
        self.reference = reference
        self.cfg = cfg
        self.clip = clip
        self.temperature = temperature
        self.optimizer, self.scheduler = adamw_with_warmup(policy, cfg.optim)

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """Response logprobs [B, R] under the policy (or the reference), without gradients."""
        model = self.reference if reference else self.policy
        return batched_logprobs(model, batch, self.cfg.ppo_micro_batch_size, self.temperature)

    def update(self, batch: TrainBatch, group_size: int, seed: int) -> ActorStats:
        generator = torch.Generator().manual_seed(seed)
        return ppo_update(
            self.policy,
            self.optimizer,
            self.scheduler,
            batch,
            self.cfg,
            self.clip,
            self.temperature,
            group_size,
            generator,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
