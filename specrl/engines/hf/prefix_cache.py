"""Prefix KV kept from scoring passes, for decoding that continues a scored sequence."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specrl.engines.protocol import SamplingParams


class PrefixCache:
    """The transformers engine's `Prefixes` handle: KV of the sequences `logprobs` scored into it,
    so decoding that continues a scored sequence (prompt + draft[:k]) does not compute its prefix
    again, and the sampling distributions of their last n + 1 positions, so that its first new
    token needs no forward either (kept when they take no more memory than the KV: small
    vocabularies). Valid for the weights it was scored with."""

    def __init__(self) -> None:
        self.batches: list[tuple[list[torch.Tensor], torch.Tensor]] = []  # per-layer KV, mask
        self.distributions: list[tuple[torch.Tensor, Sequence[SamplingParams]] | None] = []
        self._rows: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {}  # by first token

    def add(
        self,
        sequences: list[list[int]],
        kv: list[torch.Tensor],
        attention: torch.Tensor,
        distributions: torch.Tensor | None = None,
        sampling: Sequence[SamplingParams] = (),
    ) -> None:
        """`distributions` [B, n + 1, V]: column j is the sampling distribution (logprobs) of
        the token at column W - n + j of the right-aligned sequences (width W), j = n the one
        after them; `sampling`: each row's params."""
        batch = len(self.batches)
        self.batches.append((kv, attention))
        self.distributions.append(None if distributions is None else (distributions, sampling))
        for row, seq in enumerate(sequences):
            self._rows.setdefault(seq[0], []).append((batch, row, tuple(seq)))

    def next_token(self, context: list[int], sampling: SamplingParams) -> torch.Tensor | None:
        """The sampling distribution [V] of the token after `context`, if a scored sequence
        starts with it and its distribution there was kept."""
        hit = self._lookup(context)
        if hit is None or self.distributions[hit[0]] is None:
            return None
        batch, row, seq = hit
        distributions, params = self.distributions[batch]
        column = distributions.shape[1] - 1 - len(seq) + len(context)
        if column < 0 or params[row] != sampling:
            return None
        return distributions[row, column]

    def find(self, head: list[int]) -> tuple[int, int] | None:
        """(batch, row) of a cached sequence that starts with `head`, if any."""
        hit = self._lookup(head)
        return None if hit is None else hit[:2]

    def _lookup(self, head: list[int]) -> tuple[int, int, tuple[int, ...]] | None:
        if not head:
            return None
        for batch, row, seq in self._rows.get(head[0], ()):
            if len(seq) >= len(head) and list(seq[: len(head)]) == head:
                return batch, row, seq
        return None
