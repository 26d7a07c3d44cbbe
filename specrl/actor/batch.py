"""Rollouts as tensors for the learner, and the logprobs of their response tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from transformers import PreTrainedModel

from specrl.algorithms.losses import entropy_from_logits
from specrl.types import Rollout


@dataclass
class TrainBatch:
    """Rollouts as tensors: prompts left-padded to width P, responses right-padded to width R.
    `response_mask` is 1 on the tokens trained on: the sampled ones (an episode's observations
    are context only, `Rollout.loss_mask`). The per-token training inputs (old logprobs,
    advantages, ...) are added by the trainer."""

    input_ids: torch.Tensor  # [B, P + R]
    attention_mask: torch.Tensor  # [B, P + R]
    position_ids: torch.Tensor  # [B, P + R]
    response_mask: torch.Tensor  # [B, R]
    prompt_width: int
    old_logprobs: torch.Tensor | None = None  # [B, R] current logprobs before the update
    ref_logprobs: torch.Tensor | None = None  # [B, R] under the KL reference
    advantages: torch.Tensor | None = None  # [B, R]
    is_weights: torch.Tensor | None = None  # [B, R] rollout importance weights
    values: torch.Tensor | None = None  # [B, R] the critic's values before the update (gae)
    returns: torch.Tensor | None = None  # [B, R] the critic's targets (gae)

    @classmethod
    def collate(cls, rollouts: Sequence[Rollout], pad_id: int) -> TrainBatch:
        width_p = max(len(r.prompt.ids) for r in rollouts)
        width_r = max(max(len(r.token_ids) for r in rollouts), 1)
        ids = torch.full((len(rollouts), width_p + width_r), pad_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, r in enumerate(rollouts):
            p = len(r.prompt.ids)
            ids[row, width_p - p : width_p] = torch.tensor(r.prompt.ids)
            ids[row, width_p : width_p + len(r.token_ids)] = torch.tensor(
                r.token_ids, dtype=torch.long
            )
            attention[row, width_p - p : width_p + len(r.token_ids)] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        response_mask = attention[:, width_p:].clone()
        for row, r in enumerate(rollouts):
            if r.loss_mask is not None:
                response_mask[row, : len(r.loss_mask)] = torch.tensor(r.loss_mask)
        return cls(ids, attention, positions, response_mask, width_p)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def pad_responses(self, values: Sequence[Sequence[float]]) -> torch.Tensor:
        """Per-token values of each response → [B, R], zero-padded like the response tokens."""
        out = torch.zeros(self.response_mask.shape)
        for row, v in enumerate(values):
            out[row, : len(v)] = torch.tensor(v)
        return out

    def rows(self, index: torch.Tensor) -> TrainBatch:
        """The rows `index` of every tensor."""
        return TrainBatch(**{f.name: _select(getattr(self, f.name), index) for f in fields(self)})

    def to(self, device: torch.device) -> TrainBatch:
        """Every tensor on `device`."""
        return TrainBatch(**{f.name: _moved(getattr(self, f.name), device) for f in fields(self)})


def _moved(value: torch.Tensor | int | None, device: torch.device) -> torch.Tensor | int | None:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _select(value: torch.Tensor | int | None, index: torch.Tensor) -> torch.Tensor | int | None:
    return value[index] if isinstance(value, torch.Tensor) else value


def response_logprobs(
    model: PreTrainedModel, batch: TrainBatch, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [B, R] of the response tokens under softmax(logits / temperature), and the
    entropy [B, R] of that distribution (top-p / top-k are not applied, as in verl)."""
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
    ).logits[:, batch.prompt_width - 1 : -1]  # [B, R, V]
    logits = logits.float() / (temperature or 1.0)
    targets = batch.input_ids[:, batch.prompt_width :]
    logprobs = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    return logprobs, entropy_from_logits(logits)
