"""The value model of PPO with GAE (`algorithm.adv_estimator: gae`): values of each response
token's state, and its clipped value-loss update.

The critic is a Hugging Face token-classification model with one output (verl's choice):
`critic.model.path`, or by default the policy's initial weights with a fresh scalar head. The
value of response token t is read where the policy reads the logits that predict it: at the
position before it. Its weights and optimizer state are part of every checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForTokenClassification, PreTrainedModel

from specrl.actor.batch import TrainBatch
from specrl.actor.policy import DTYPES, ModelLoadError
from specrl.actor.update import adamw_with_warmup
from specrl.algorithms.losses import AggScale, masked_mean, value_loss
from specrl.config import Config, CriticConfig


@dataclass
class CriticStats:
    vf_loss: float
    vf_clipfrac: float
    vpred_mean: float
    grad_norm: float
    lr: float

    def metrics(self) -> dict[str, float]:
        return {f"critic/{k}": v for k, v in vars(self).items()}


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
        return AutoModelForTokenClassification.from_pretrained(
            path, num_labels=1, dtype=DTYPES[dtype]
        )
    except Exception as err:  # transformers raises its own for every kind of bad directory
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ModelLoadError(
            f"critic.model.path {str(path)!r} could not be loaded as a value model "
            f"({type(err).__name__}: {first_line}); point it at a local Hugging Face model "
            "directory of an architecture with a token-classification head, or leave it unset"
        ) from None


def load_critic(cfg: Config, initial_dir: Path) -> Critic:
    """The run's critic: `critic.model.path`, or the policy's initial weights with a fresh head
    (a resumed run then loads the checkpoint's critic over it)."""
    path = cfg.critic.model.path or initial_dir
    return Critic(load_critic_model(path, cfg.model.dtype), cfg.critic)


class Critic:
    def __init__(self, model: PreTrainedModel, cfg: CriticConfig) -> None:
        self.model = model.eval()
        self.cfg = cfg
        self.optimizer, self.scheduler = adamw_with_warmup(model, cfg.optim)

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """Values [B, R] (zero outside the responses), in micro-batches, without gradients."""
        size = self.cfg.ppo_micro_batch_size
        parts = [
            token_values(self.model, batch.rows(torch.arange(i, min(i + size, len(batch)))))
            for i in range(0, len(batch), size)
        ]
        return torch.cat(parts) * batch.response_mask

    def update(self, batch: TrainBatch, group_size: int, seed: int) -> CriticStats:
        """`critic.ppo_epochs` passes of mini-batches (`ppo_mini_batch_size` prompts of
        `group_size` rollouts) over `batch`, whose `values` and `returns` are filled in."""
        generator = torch.Generator().manual_seed(seed)
        mini = self.cfg.ppo_mini_batch_size * group_size
        per_mini: list[dict[str, float]] = []
        self.model.train()
        for _ in range(self.cfg.ppo_epochs):
            order = torch.randperm(len(batch), generator=generator)
            for start in range(0, len(batch), mini):
                per_mini.append(self._mini_batch(batch, order[start : start + mini]))
        self.model.eval()
        mean = {k: float(np.mean([m[k] for m in per_mini])) for k in per_mini[0]}
        return CriticStats(**mean, lr=self.scheduler.get_last_lr()[0])

    def _mini_batch(self, batch: TrainBatch, rows: torch.Tensor) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        scale = AggScale.of(batch.response_mask[rows])
        sums = {"vf_loss": 0.0, "vf_clipfrac": 0.0, "vpred_mean": 0.0}
        for micro in rows.split(self.cfg.ppo_micro_batch_size):
            part = batch.rows(micro)
            vpreds = token_values(self.model, part)
            out = value_loss(
                vpreds, part.values, part.returns, part.response_mask, self.cfg.cliprange_value,
                scale,
            )  # fmt: skip
            out.loss.backward()
            sums["vf_loss"] += out.loss.item()
            sums["vf_clipfrac"] += out.vf_clipfrac.item()
            sums["vpred_mean"] += out.vpred_mean.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        if torch.isfinite(grad_norm):  # as the actor: a non-finite gradient is not applied
            self.optimizer.step()
            self.scheduler.step()
        return {**sums, "grad_norm": grad_norm.item()}

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def value_metrics(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """verl's critic data metrics: mean value and return over the response tokens, and the
    fraction of the returns' variance the values explain."""
    valid = mask.bool()
    residual = (returns - values)[valid]
    return {
        "critic/values/mean": masked_mean(values, mask).item(),
        "critic/returns/mean": masked_mean(returns, mask).item(),
        "critic/vf_explained_var": (1 - residual.var() / (returns[valid].var() + 1e-5)).item(),
    }
