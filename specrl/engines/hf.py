"""Transformers rollout engine: our own decode loop over any local Hugging Face causal LM.

The loop is ours (not `model.generate()`) so that forced prefixes, per-request budgets, seeds and,
later, multi-token verification are under our control. Batches are left-padded; every sequence
keeps its own position ids, so padding never changes a result. A sequence that finishes leaves
the batch and its rows leave the KV cache: it costs nothing afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from specrl.engines.base import FinishReason, GenRequest, GenResult, ScoreRequest
from specrl.engines.sampling import sample_from_logprobs, sampling_logprobs, seeded_uniform


class HFEngine:
    """Rollout engine over a transformers model. When it wraps the trainer's own model object the
    weights are shared, so there is nothing to sync after an update."""

    def __init__(
        self,
        model: PreTrainedModel,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        max_batch_size: int = 512,
    ) -> None:
        self.model = model
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.forward_passes = 0  # model calls made by generate/score, for cost accounting

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, **kwargs
    ) -> HFEngine:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        eos = model.generation_config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        pad = model.generation_config.pad_token_id
        return cls(model, eos_ids, eos_ids[0] if pad is None else pad, **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        # Longest contexts first: similar lengths share a batch, so little padding is computed.
        order = sorted(
            range(len(requests)),
            key=lambda i: -len(requests[i].prompt_ids) - len(requests[i].prefix_ids),
        )
        results: list[GenResult | None] = [None] * len(requests)
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start : start + self.max_batch_size]
            for i, result in zip(
                chunk, self._generate_batch([requests[i] for i in chunk]), strict=True
            ):
                results[i] = result
        return results  # type: ignore[return-value]

    def _generate_batch(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        results = [GenResult([], [], "length") for _ in requests]
        live = [i for i, r in enumerate(requests) if r.max_new_tokens > 0]
        if not live:
            return results
        contexts = [list(requests[i].prompt_ids) + list(requests[i].prefix_ids) for i in live]
        ids, attention = _left_pad(contexts, self.pad_token_id, self.device)  # [B, T]
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self._forward(ids, attention, positions, cache, last_only=True)[:, -1]  # [B, V]
        rows = torch.tensor(live, device=self.device)  # request index of each batch row
        next_pos = attention.sum(-1)  # [B] position of the token being sampled
        seeds = torch.tensor([requests[i].seed for i in live], device=self.device)
        budgets = torch.tensor([requests[i].max_new_tokens for i in live], device=self.device)
        eos = torch.tensor(sorted(self.eos_token_ids), device=self.device)
        params = [requests[i].sampling for i in live]
        produced = 0
        rejected = [requests[i].reject_token for i in live]
        while True:
            logprobs = sampling_logprobs(logits, params)  # [B, V]
            draw_from = _residual(logprobs, rejected) if produced == 0 else logprobs
            tokens = sample_from_logprobs(draw_from, seeded_uniform(seeds, next_pos))  # [B]
            token_logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
            produced += 1
            for row, token, lp in zip(
                rows.tolist(), tokens.tolist(), token_logprobs.tolist(), strict=True
            ):
                results[row].token_ids.append(token)
                results[row].logprobs.append(lp)
            stopped = torch.isin(tokens, eos)
            finished = stopped | (budgets <= produced)
            for row, was_stopped in zip(
                rows[finished].tolist(), stopped[finished].tolist(), strict=True
            ):
                results[row].finish_reason = _reason(was_stopped)
            if bool(finished.all()):
                return results
            if bool(finished.any()):
                keep = (~finished).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                rows, tokens, next_pos, seeds, budgets, attention = (
                    t[keep] for t in (rows, tokens, next_pos, seeds, budgets, attention)
                )
                params = [params[i] for i in keep.tolist()]
            attention = torch.cat([attention, attention.new_ones(len(rows), 1)], dim=1)
            logits = self._forward(
                tokens[:, None], attention, next_pos[:, None], cache, last_only=True
            )[:, -1]
            next_pos = next_pos + 1

    @torch.no_grad()
    def score(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        """One forward pass per batch of up to `max_batch_size` distinct sequences. Identical
        requests (the n slots of a prompt often hold the same draft) are computed once."""
        index: dict[tuple, int] = {}
        distinct: list[ScoreRequest] = []
        for r in requests:
            key = (tuple(r.context_ids), tuple(r.target_ids), r.sampling)
            if key not in index:
                index[key] = len(distinct)
                distinct.append(r)
        scored: list[torch.Tensor] = []
        for start in range(0, len(distinct), self.max_batch_size):
            scored.extend(self._score_batch(distinct[start : start + self.max_batch_size]))
        return [
            scored[index[(tuple(r.context_ids), tuple(r.target_ids), r.sampling)]] for r in requests
        ]

    def _score_batch(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        sequences = [list(r.context_ids) + list(r.target_ids) for r in requests]
        ids, attention = _left_pad(sequences, self.pad_token_id, self.device)  # [B, T]
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = self._forward(ids, attention, positions, cache=None)  # [B, T, V]
        # Targets are right-aligned: the logits at column t predict the token at column t + 1.
        n = max(len(r.target_ids) for r in requests)
        predicting = logits[:, -n - 1 : -1]  # [B, n, V]
        params = [r.sampling for r in requests for _ in range(n)]
        logprobs = sampling_logprobs(predicting.reshape(-1, logits.shape[-1]), params)
        logprobs = logprobs.gather(1, ids[:, -n:].reshape(-1, 1)).view(len(requests), n)  # [B, n]
        return [
            row[n - len(r.target_ids) :].cpu() for row, r in zip(logprobs, requests, strict=True)
        ]

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in state.items():
                if name not in params:
                    raise KeyError(f"engine model has no parameter {name!r}")
                if params[name] is not tensor:
                    params[name].copy_(tensor)

    def _forward(
        self,
        ids: torch.Tensor,
        attention: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache | None,
        last_only: bool = False,
    ) -> torch.Tensor:
        self.forward_passes += 1
        return self.model(
            input_ids=ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=cache is not None,
            logits_to_keep=1 if last_only else 0,
        ).logits


def _residual(logprobs: torch.Tensor, rejected: Sequence[int | None]) -> torch.Tensor:
    """logprobs [B, V] with each row's rejected token removed and the rest renormalised."""
    rows = [row for row, token in enumerate(rejected) if token is not None]
    if not rows:
        return logprobs
    residual = logprobs.clone()
    residual[rows, [rejected[row] for row in rows]] = float("-inf")
    residual[rows] = residual[rows].log_softmax(-1)
    return residual


def _reason(stopped: bool) -> FinishReason:
    return "stop" if stopped else "length"


def _left_pad(
    sequences: Sequence[Sequence[int]], pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """→ ids [B, T] and attention mask [B, T], real tokens right-aligned."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq) :] = torch.tensor(seq)
            attention[row, width - len(seq) :] = 1
    return ids.to(device), attention.to(device)
