"""The rows a decode loop is decoding (decode.py), kept and compacted together: per row the
request it decodes, the token it feeds next and that token's position, its budget, the uniforms
of its coming positions, its sampling and what its first draw excludes; for the batch the KV
cache and its attention mask. A row that finishes leaves all of them at once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specrl.engines.hf.kv_cache import DecodeCache
from specrl.engines.protocol import GenRequest
from specrl.engines.sampling import RowSampling, uniform_table


@dataclass
class DecodeBatch:
    rows: torch.Tensor  # [B] the request each row decodes
    tokens: torch.Tensor  # [B] fed next (the last token of the row's sequence so far)
    positions: torch.Tensor  # [B] the fed token's position
    left: torch.Tensor  # [B] new tokens the row may still emit
    done: torch.Tensor  # [B] new tokens emitted so far
    uniforms: torch.Tensor  # [B, most new tokens] the uniform of each coming position
    sampling: RowSampling
    rejected: list[tuple[int, ...]]  # tokens the row's next draw excludes (first draw only)
    cache: DecodeCache
    attention: torch.Tensor  # [B, W] which cached columns (then fed ones) each row attends to

    @classmethod
    def start(
        cls,
        requests: Sequence[GenRequest],
        live: list[int],
        contexts: list[list[int]],
        cache: DecodeCache,
        attention: torch.Tensor,
    ) -> DecodeBatch:
        """The rows of requests `live` after their prefill: the KV of every context but its
        last token in `cache`, that token fed first."""
        device = attention.device
        positions = torch.tensor([len(c) - 1 for c in contexts], device=device)
        left = torch.tensor([requests[i].max_new_tokens for i in live], device=device)
        # the uniform behind each new token, a hash of (seed, position)
        seeds = torch.tensor([requests[i].seed for i in live], device=device)
        return cls(
            rows=torch.tensor(live, device=device),
            tokens=torch.tensor([c[-1] for c in contexts], device=device),
            positions=positions,
            left=left,
            done=torch.zeros_like(left),
            uniforms=uniform_table(seeds, positions + 1, int(left.max())),
            sampling=RowSampling.of([requests[i].sampling for i in live], device),
            rejected=[requests[i].excluded_tokens for i in live],
            cache=cache,
            attention=cache.drop_padding(attention),
        )

    def __len__(self) -> int:
        return len(self.rows)

    def feed(
        self, drafts: list[list[int]], pad: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the next forward feeds: every row's token followed by its drafts, padded to the
        widest, and the attention mask extended over those columns: → fed ids [B, K+1], the
        drafts per row [B], the column numbers [K+1]."""
        device = self.tokens.device
        width = max(map(len, drafts))
        if not self.cache.holds(self.attention.shape[1], width + 1):
            self.attention = self.cache.compact(self.attention)
        fed = self.tokens[:, None]
        if width:
            padding = [pad] * width
            tokens = self.tokens.tolist()
            rows = [[t, *d, *padding[len(d) :]] for t, d in zip(tokens, drafts, strict=True)]
            fed = torch.tensor(rows, device=device)
        proposed = torch.tensor(list(map(len, drafts)), device=device)
        cols = torch.arange(width + 1, device=device)
        fed_columns = (cols[None] <= proposed[:, None]).long()
        self.attention = torch.cat([self.attention, fed_columns], dim=1)
        return fed, proposed, cols

    def column_uniforms(self, cols: torch.Tensor) -> torch.Tensor:
        """The uniform of every fed column's next position [B, K+1]; columns past a row's own
        drafts are never emitted: clamped, they read any uniform."""
        at = (self.done[:, None] + cols).clamp(max=self.uniforms.shape[1] - 1)
        return self.uniforms.gather(1, at)

    def emit(
        self, sampled: torch.Tensor, accepted: torch.Tensor, cols: torch.Tensor, eos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row emits its accepted drafts and the token after them, up to its budget and its
        first end-of-sequence token: → tokens emitted [B], whether the row stopped [B]."""
        emitted = (accepted + 1).minimum(self.left)  # drafts never exceed left - 1; a guard
        is_eos = torch.isin(sampled, eos) & (cols[None] < emitted[:, None])
        stopped = is_eos.any(1)
        emitted = torch.where(stopped, is_eos.int().argmax(1) + 1, emitted)
        self.left, self.done = self.left - emitted, self.done + emitted
        return emitted, stopped

    def advance(
        self,
        sampled: torch.Tensor,
        accepted: torch.Tensor,
        cols: torch.Tensor,
        finished: torch.Tensor,
    ) -> None:
        """To the next forward: the cache keeps each row's fed token and accepted drafts, the
        row feeds the token sampled after them, finished rows leave."""
        width = len(cols) - 1
        if width:  # the rejected drafts' columns are masked out
            self.attention[:, -(width + 1) :] = (cols[None] <= accepted[:, None]).long()
        self.tokens = sampled.gather(1, accepted[:, None]).squeeze(1)
        self.positions = self.positions + accepted + 1
        if bool(finished.any()):
            keep = _staying(finished)
            self.cache.keep_rows(keep)
            self.rows, self.tokens, self.positions, self.left, self.done = (
                t[keep] for t in (self.rows, self.tokens, self.positions, self.left, self.done)
            )
            self.uniforms, self.sampling = self.uniforms[keep], self.sampling.select(keep)
            self.attention = self.cache.drop_padding(self.attention[keep])
        self.rejected = [()] * len(self.rows)
        if width and _sparse(self.attention):
            self.attention = self.cache.compact(self.attention)


def _sparse(attention: torch.Tensor) -> bool:
    """Whether the KV cache is more than twice as wide as the longest row needs (attention
    [B, W]): rejected drafts, or other branches of a trie, masked out."""
    return attention.shape[1] > 2 * int(attention.sum(1).max()) + 32


def _staying(finished: torch.Tensor) -> torch.Tensor:
    """The batch rows that stay, as the new row order: row i stays in place, and the slot of a
    finished row among the first B' is taken by a staying row from past B', so only those rows'
    KV has to move (`DecodeCache.keep_rows`)."""
    staying = (~finished).nonzero().squeeze(1)
    keep = torch.arange(len(staying), device=finished.device)
    keep[finished[: len(staying)]] = staying[staying >= len(staying)]
    return keep
