"""The PPO update of the policy, and the `Actor` that holds what it changes.

`ppo_update` is `mini_batch_update` (the actor's and the critic's loop: `ppo_epochs` passes over
a step's rollouts, each split into mini-batches, one optimizer step each, and those into
micro-batches, gradient accumulation) with `actor_loss`, the actor's loss of a micro-batch.
Every micro-batch's loss is its share of its mini-batch's loss (`AggScale`), so the update does
not depend on `ppo_micro_batch_size`, nor on how many learner ranks share each mini-batch
(data_parallel.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from specrl.actor.batch import TrainBatch, response_logprobs
from specrl.actor.data_parallel import (
    SINGLE,
    Rank,
    balanced_split,
    full_model_state,
    full_norm,
    full_optimizer_state,
    gradient_sync,
    load_optimizer_state,
    micro_batches,
    wrap,
)
from specrl.algorithms.losses import POLICY_LOSSES, AggScale, ClipConfig, agg_loss, kl_penalty
from specrl.config import ActorConfig, CriticConfig, OptimConfig
from specrl.lora import peft_model, trained_weights
from specrl.models import planless_attention


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

    @classmethod
    def of(cls, ranks: list[UpdateShares]) -> ActorStats:
        """The update's statistics from every rank's shares (one rank: its own)."""
        mean = UpdateShares.mean(ranks)
        return cls(
            pg_loss=mean["pg_loss"],
            pg_clipfrac=mean["pg_clipfrac"],
            pg_clipfrac_lower=mean["pg_clipfrac_lower"],
            ppo_kl=mean["ppo_kl"],
            entropy=mean["entropy"],
            grad_norm=mean["grad_norm"],
            lr=ranks[0].lr,
            skipped_updates=ranks[0].skipped,
            kl_loss=mean.get("kl_loss"),
        )


@dataclass
class UpdateShares:
    """One rank's part of an update: per mini-batch, its shares of the loss terms (over the
    ranks they add up to the mini-batch's values) and the global gradient norm; the
    mini-batches skipped (the same on every rank) and the learning rate after the update."""

    mini_batches: list[dict[str, float]]
    skipped: int
    lr: float

    @staticmethod
    def mean(ranks: list[UpdateShares]) -> dict[str, float]:
        """Per mini-batch, the ranks' shares added up (the gradient norm is rank 0's: the same
        on every rank), then averaged over the mini-batches."""
        per_mini = [
            {k: m[0][k] if k == "grad_norm" else sum(r[k] for r in m) for k in m[0]}
            for m in zip(*(r.mini_batches for r in ranks), strict=True)
        ]
        return {k: float(np.mean([m[k] for m in per_mini])) for k in per_mini[0]}


@dataclass
class MiniBatchSums:
    """A rank's shares of one mini-batch's loss terms, summed over its micro-batches."""

    values: dict[str, float] = field(default_factory=dict)

    def add(self, key: str, value: torch.Tensor, weight: float = 1.0) -> None:
        self.values[key] = self.values.get(key, 0.0) + weight * value.item()


@dataclass(frozen=True)
class MiniBatching:
    """How an update walks a step's rollouts: `epochs` passes, each shuffled and split into
    mini-batches of `mini_batch` prompts (one optimizer step each, its gradient norm clipped to
    `grad_clip`), those into micro-batches of `micro_batch` sequences (gradient accumulation)."""

    epochs: int
    mini_batch: int
    micro_batch: int
    grad_clip: float

    @classmethod
    def of(cls, cfg: ActorConfig | CriticConfig) -> MiniBatching:
        """The actor's or the critic's: `ppo_epochs`, `ppo_mini_batch_size`,
        `ppo_micro_batch_size`, `grad_clip`."""
        return cls(cfg.ppo_epochs, cfg.ppo_mini_batch_size, cfg.ppo_micro_batch_size, cfg.grad_clip)


# a micro-batch (on the model's device) and its mini-batch's totals → its loss share and the
# terms to log
LossFn = Callable[[TrainBatch, AggScale], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def mini_batch_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: TrainBatch,
    plan: MiniBatching,
    loss_fn: LossFn,
    group_size: int,
    generator: torch.Generator,
    rank: Rank = SINGLE,
) -> UpdateShares:
    """The update loop the actor and the critic share: `plan`'s passes over `batch` (prompts of
    `group_size` rollouts each), `generator` shuffling the rollouts every pass (the same on every
    rank), `rank` computing its token-balanced part of each mini-batch, gradients reduced across
    ranks in each mini-batch's last backward. A mini-batch whose gradient is not finite is not
    applied (the weights are kept, the skip counted)."""
    mini = plan.mini_batch * group_size
    tokens = batch.attention_mask.sum(-1)
    device = next(model.parameters()).device
    per_mini: list[dict[str, float]] = []
    skipped = 0
    model.train()
    for _ in range(plan.epochs):
        order = torch.randperm(len(batch), generator=generator)
        for start in range(0, len(batch), mini):
            rows = order[start : start + mini]
            scale = AggScale.of(batch.response_mask[rows])
            micros = micro_batches(balanced_split(rows, tokens, rank.world), rank, plan.micro_batch)
            optimizer.zero_grad(set_to_none=True)
            sums = MiniBatchSums()
            for i, (micro, weight) in enumerate(micros):
                loss, terms = loss_fn(batch.rows(micro).to(device), scale)
                with gradient_sync(model, enabled=i == len(micros) - 1):
                    (loss * (weight * rank.world)).backward()  # ranks' gradients are averaged
                for key, value in terms.items():
                    sums.add(key, value, weight)
            clipped = torch.nn.utils.clip_grad_norm_(model.parameters(), plan.grad_clip)
            grad_norm = full_norm(clipped)
            sums.add("grad_norm", grad_norm)
            if torch.isfinite(grad_norm):
                optimizer.step()
                scheduler.step()  # the schedule counts applied updates
            else:  # a NaN / inf loss or gradient: keep the weights, report the skip
                skipped += 1
            per_mini.append(sums.values)
    model.eval()
    return UpdateShares(per_mini, skipped, scheduler.get_last_lr()[0])


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
    rank: Rank = SINGLE,
) -> UpdateShares:
    """The actor's update of `model` on `batch` (old logprobs, advantages and, where used,
    reference logprobs and importance weights filled in): `actor_loss` over the actor's
    mini-batching (`actor.ppo_epochs`, `ppo_mini_batch_size` prompts of `group_size` rollouts,
    `ppo_micro_batch_size`, `grad_clip`)."""
    loss_fn = actor_loss(model, cfg, clip, temperature)
    return mini_batch_update(
        model, optimizer, scheduler, batch, MiniBatching.of(cfg), loss_fn, group_size, generator,
        rank,
    )  # fmt: skip


def actor_loss(
    model: torch.nn.Module, cfg: ActorConfig, clip: ClipConfig, temperature: float
) -> LossFn:
    """The actor's loss of a micro-batch (old logprobs, advantages and, where used, reference
    logprobs and importance weights filled in): the policy loss, the entropy bonus, the KL
    loss."""

    def loss_fn(part: TrainBatch, scale: AggScale):
        with forward_mode(part.input_ids.device, cfg.autocast):
            logprobs, entropy = response_logprobs(model, part, temperature)  # [b, R] each
        mask = part.response_mask
        out = POLICY_LOSSES[clip.loss_mode](
            logprobs, part.old_logprobs, part.advantages, mask, clip, part.is_weights, scale
        )
        entropy_term = agg_loss(entropy, mask, cfg.loss_agg_mode, clip.horizon, scale)
        loss = out.loss - cfg.entropy_coeff * entropy_term
        terms = {
            "pg_loss": out.loss,
            "pg_clipfrac": out.pg_clipfrac,
            "pg_clipfrac_lower": out.pg_clipfrac_lower,
            "ppo_kl": out.ppo_kl,
            "entropy": entropy_term,
        }
        if part.ref_logprobs is not None:
            kl = kl_penalty(logprobs, part.ref_logprobs, cfg.kl_loss_type)
            terms["kl_loss"] = agg_loss(kl, mask, cfg.loss_agg_mode, clip.horizon, scale)
            loss = loss + cfg.kl_loss_coef * terms["kl_loss"]
        return loss, terms

    return loss_fn


@contextlib.contextmanager
def forward_mode(device: torch.device, autocast: str) -> Iterator[None]:
    """How the actor's and critic's forwards run: attention without per-shape plans (batches
    change shape every micro-batch: `planless_attention`), and with `actor.autocast` bfloat16,
    bfloat16 autocast (losses stay float32)."""
    with planless_attention():
        if autocast == "none":
            yield
        else:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                yield


def adamw_with_warmup(
    model: torch.nn.Module, cfg: OptimConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the model's trainable parameters (with LoRA: the adapters) and its schedule:
    linear warmup, then constant."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trained, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
    )
    warmup = cfg.lr_warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1))
    )
    return optimizer, scheduler


class Actor:
    """The policy being trained, its optimizer and learning-rate schedule, and the frozen KL
    reference (None without a KL loss, or with LoRA: the policy with its adapters disabled), as
    `rank` of the learner group runs them (data_parallel: wrapped for DDP or FSDP2 with K > 1
    ranks; the models themselves with one)."""

    def __init__(
        self,
        policy: PreTrainedModel,
        cfg: ActorConfig,
        clip: ClipConfig,
        temperature: float,
        reference: PreTrainedModel | None = None,
        rank: Rank = SINGLE,
    ) -> None:
        self.rank = rank
        self.policy = wrap(policy, cfg, rank, train=True)
        self.reference = None if reference is None else wrap(reference, cfg, rank, train=False)
        self.cfg = cfg
        self.clip = clip
        self.temperature = temperature
        self.optimizer, self.scheduler = adamw_with_warmup(self.policy, cfg.optim)

    @torch.no_grad()
    def logprobs(
        self,
        batch: TrainBatch,
        reference: bool = False,
        parts: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Response logprobs [b, R] under the policy (or the reference), without gradients, of
        this rank's part of `batch` (`parts`: every rank's rows; None: all of it, one rank)."""
        model = self.reference if reference and self.reference is not None else self.policy
        base_only = reference and self.reference is None  # LoRA: the base model is the reference
        parts = [torch.arange(len(batch))] if parts is None else parts
        device = next(model.parameters()).device
        out = []
        for rows, weight in micro_batches(parts, self.rank, self.cfg.ppo_micro_batch_size):
            adapters = (
                peft_model(model).disable_adapter() if base_only else contextlib.nullcontext()
            )
            with forward_mode(device, self.cfg.autocast), adapters:
                logprobs = response_logprobs(model, batch.rows(rows).to(device), self.temperature)
            if weight:
                out.append(logprobs[0].float().cpu())
        return torch.cat(out) if out else torch.zeros(0, batch.response_mask.shape[1])

    def update_shares(self, batch: TrainBatch, group_size: int, seed: int) -> UpdateShares:
        """This rank's part of the update (all of it with one rank)."""
        return ppo_update(
            self.policy,
            self.optimizer,
            self.scheduler,
            batch,
            self.cfg,
            self.clip,
            self.temperature,
            group_size,
            torch.Generator().manual_seed(seed),
            self.rank,
        )

    def update(self, batch: TrainBatch, group_size: int, seed: int) -> ActorStats:
        return ActorStats.of([self.update_shares(batch, group_size, seed)])

    def shutdown(self) -> None:
        """Nothing to stop: the actor lives in this process (as `LearnerGroup.shutdown` stops
        the learner ranks)."""

    def weights(self) -> dict[str, torch.Tensor]:
        """What the update changed: the policy's full state dict, or with LoRA its adapters
        (every rank calls; with K > 1 only rank 0 gets them)."""
        return trained_weights(self.policy, full_model_state(self.policy, self.rank.world))

    def state_dict(self) -> dict[str, Any]:
        """The optimizer keyed by parameter names and the schedule: the same for any number of
        ranks (every rank calls; with K > 1 only rank 0 gets the optimizer)."""
        return {
            "optimizer": full_optimizer_state(self.policy, self.optimizer, self.rank.world),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_optimizer_state(self.policy, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
