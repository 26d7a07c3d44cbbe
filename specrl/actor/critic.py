"""The value model of PPO with GAE (`algorithm.adv_estimator: gae`): values of each response
token's state, and its clipped value-loss update.

The critic is a Hugging Face token-classification model with one output and no dropout in its
head (verl's choices): `critic.model.path`, or by default the policy's initial weights with a
fresh scalar head. The
value of response token t is read where the policy reads the logits that predict it: at the
position before it. Its weights and optimizer state are part of every checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForTokenClassification, PreTrainedModel

from specrl.actor.batch import TrainBatch
from specrl.actor.data_parallel import (
    SINGLE,
    Rank,
    full_model_state,
    full_optimizer_state,
    load_model_state,
    load_optimizer_state,
    micro_batches,
    wrap,
)
from specrl.actor.update import (
    MiniBatching,
    UpdateShares,
    adamw_with_warmup,
    forward_mode,
    mini_batch_update,
)
from specrl.algorithms.losses import AggScale, value_loss
from specrl.config import ActorConfig, Config, CriticConfig
from specrl.errors import first_line
from specrl.lora import peft_model, trained_weights, with_adapters
from specrl.models import DTYPES, ModelLoadError


@dataclass
class CriticStats:
    vf_loss: float
    vf_clipfrac: float
    vpred_mean: float
    grad_norm: float
    lr: float

    def metrics(self) -> dict[str, float]:
        return {f"critic/{k}": v for k, v in vars(self).items()}

    @classmethod
    def of(cls, ranks: list[UpdateShares]) -> CriticStats:
        """The update's statistics from every rank's shares (one rank: its own)."""
        return cls(**UpdateShares.mean(ranks), lr=ranks[0].lr)


def token_values(model: PreTrainedModel, batch: TrainBatch) -> torch.Tensor:
    """Values [B, R] of the states before each response token."""
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
    ).logits  # [B, P + R, 1]
    return out[:, batch.prompt_width - 1 : -1, 0].float()


def load_critic_model(path: str | Path, dtype: str) -> PreTrainedModel:
    try:
        config = AutoConfig.from_pretrained(path, num_labels=1)
        config.classifier_dropout = 0.0  # the head's default drops 10%: noisy values
        return AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=DTYPES[dtype]
        )
    except Exception as err:  # transformers raises its own for every kind of bad directory
        raise ModelLoadError(
            f"critic.model.path {str(path)!r} could not be loaded as a value model "
            f"({type(err).__name__}: {first_line(err)}); point it at a local Hugging Face model "
            "directory of an architecture with a token-classification head, or leave it unset"
        ) from None


def load_critic(
    cfg: Config, initial_dir: Path, rank: Rank = SINGLE, device: torch.device | str = "cpu"
) -> Critic:
    """The run's critic as learner `rank` runs it on `device`: `critic.model.path`, or the
    policy's initial weights with a fresh head; with `critic.lora.rank` > 0, adapters on its body
    and the head trained fully (a resumed run then loads the checkpoint's critic over it)."""
    path = cfg.critic.model.path or initial_dir
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.trainer.seed)  # a fresh head: the same on every rank, for any K
        model = load_critic_model(path, cfg.model.dtype)
    if cfg.critic.lora.rank:
        model = with_adapters(model, cfg.critic.lora, cfg.trainer.seed, "TOKEN_CLS", "critic.lora")
    return Critic(model.to(device), cfg.critic, cfg.actor, rank)


class Critic:
    """The value model, its optimizer and schedule, as `rank` of the learner group runs them
    (with the actor's strategy: `actor.num_workers`, `actor.strategy`, checkpointing, autocast;
    data_parallel.py)."""

    def __init__(
        self, model: PreTrainedModel, cfg: CriticConfig, parallel: ActorConfig, rank: Rank = SINGLE
    ) -> None:
        self.rank = rank
        self.model = wrap(model, parallel, rank, train=True).eval()
        self.cfg = cfg
        self.autocast = parallel.autocast
        self.optimizer, self.scheduler = adamw_with_warmup(self.model, cfg.optim)

    @torch.no_grad()
    def values(self, batch: TrainBatch, parts: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Values [b, R] (zero outside the responses), in micro-batches, without gradients, of
        this rank's part of `batch` (`parts`: every rank's rows; None: all of it, one rank)."""
        parts = [torch.arange(len(batch))] if parts is None else parts
        device = next(self.model.parameters()).device
        out = []
        for rows, weight in micro_batches(parts, self.rank, self.cfg.ppo_micro_batch_size):
            part = batch.rows(rows).to(device)
            with forward_mode(device, self.autocast):
                values = token_values(self.model, part) * part.response_mask
            if weight:
                out.append(values.float().cpu())
        return torch.cat(out) if out else torch.zeros(0, batch.response_mask.shape[1])

    def update_shares(self, batch: TrainBatch, group_size: int, seed: int) -> UpdateShares:
        """`critic.ppo_epochs` passes of mini-batches (`ppo_mini_batch_size` prompts of
        `group_size` rollouts) over `batch`, whose `values` and `returns` are filled in: this
        rank's token-balanced part of each (all of it with one rank)."""
        return mini_batch_update(
            self.model,
            self.optimizer,
            self.scheduler,
            batch,
            MiniBatching.of(self.cfg),
            self._loss,
            group_size,
            torch.Generator().manual_seed(seed),
            self.rank,
        )

    def update(self, batch: TrainBatch, group_size: int, seed: int) -> CriticStats:
        return CriticStats.of([self.update_shares(batch, group_size, seed)])

    def _loss(self, part: TrainBatch, scale: AggScale):
        """The clipped value loss of a micro-batch."""
        with forward_mode(part.input_ids.device, self.autocast):
            vpreds = token_values(self.model, part)
        out = value_loss(
            vpreds, part.values, part.returns, part.response_mask, self.cfg.cliprange_value, scale
        )
        return out.loss, {
            "vf_loss": out.loss,
            "vf_clipfrac": out.vf_clipfrac,
            "vpred_mean": out.vpred_mean,
        }

    def state_dict(self) -> dict[str, Any]:
        """Weights (with LoRA: adapters and head) and optimizer in full, keyed by parameter
        names, and the schedule: the same for any number of ranks (every rank calls; with K > 1
        only rank 0 gets them)."""
        world = self.rank.world
        return {
            "model": trained_weights(self.model, full_model_state(self.model, world)),
            "optimizer": full_optimizer_state(self.model, self.optimizer, world),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_model_state(self.model, state["model"], strict=peft_model(self.model) is None)
        load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
