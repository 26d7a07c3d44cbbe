"""The sampling distribution, its residual and a counter-based sampler, shared by `generate` and
`logprobs`.

`sampling_logprobs` turns raw logits into the log-probabilities of the distribution tokens are
actually drawn from (temperature, then top-k, then top-p, each renormalised), so behaviour
logprobs from `generate` and logprobs from `logprobs` are the same computation.

Randomness is counter-based: the uniform for a token is a hash of (request seed, position in the
sequence). A request's sample therefore does not depend on which other requests share its batch
or on how many sequences left the batch before it, and re-decoding from a cut reproduces nothing
it should not (the caller chooses fresh seeds per step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from specrl.engines.protocol import SamplingParams

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class RowSampling:
    """The SamplingParams of each row of a batch as tensors [B], built once per batch rather
    than once per decode step."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    truncates: bool  # some row keeps only its top-k or top-p tokens
    greedy: bool  # some row is greedy
    tempered: bool  # some row's temperature is neither 1 nor 0 (greedy): logits are divided
    most_kept: int  # every row keeps at most this many tokens (its top-k); 0: some row may not

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device | str) -> RowSampling:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_k=torch.tensor([p.top_k for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            truncates=any(p.top_k > 0 or p.top_p < 1 for p in params),
            greedy=any(p.greedy for p in params),
            tempered=any(p.temperature not in (0.0, 1.0) for p in params),
            most_kept=max(p.top_k for p in params) if all(p.top_k > 0 for p in params) else 0,
        )

    def select(self, index: torch.Tensor) -> RowSampling:
        """The rows `index` (a batch after some sequences left it)."""
        tensors = (t[index] for t in (self.temperature, self.top_k, self.top_p))
        return RowSampling(*tensors, self.truncates, self.greedy, self.tempered, self.most_kept)

    def repeat(self, times: int | torch.Tensor) -> RowSampling:
        """Each row `times` times in a row (one per fed column of a decode forward), or row i
        times[i] times (`times` [B])."""
        if isinstance(times, int) and times == 1:
            return self
        tensors = (t.repeat_interleave(times) for t in (self.temperature, self.top_k, self.top_p))
        return RowSampling(*tensors, self.truncates, self.greedy, self.tempered, self.most_kept)


def sampling_logprobs(logits: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """logits [B, V] and the sampling params of each row → logprobs [B, V] (-inf outside the
    support)."""
    logits = logits.float()
    scaled = logits  # x / 1 is x: at temperatures 1 (and 0) nothing to divide, [B, V] a forward
    if rows.tempered:
        temperature = torch.where(rows.temperature == 0, 1.0, rows.temperature)
        scaled = logits / temperature[:, None]
    if rows.truncates:
        scaled = _truncate(scaled, rows.top_k, rows.top_p, rows.most_kept)
    logprobs = scaled.log_softmax(-1)  # [B, V]
    if rows.greedy:
        point_mass = torch.full_like(logprobs, float("-inf"))
        point_mass.scatter_(1, logits.argmax(-1, keepdim=True), 0.0)
        logprobs = torch.where((rows.temperature == 0)[:, None], point_mass, logprobs)
    return logprobs


def _truncate(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, most_kept: int
) -> torch.Tensor:
    """Mask tokens outside each row's top-k, then outside the top-p mass of what is left.

    On a CPU, when every row keeps at most `most_kept` tokens, only that many of the largest
    logits are ranked (`topk`, not a sort of the vocabulary: sorting 128 rows of 49k logits
    takes over half as long as a 135M model's decode forward there); the mass is computed over
    the same full row either way, so the mask is the same. Where a kept and a dropped token tie,
    which of them a ranking puts first decides the mask: then the vocabulary is sorted, as it
    always is on a GPU (where the check would wait for the device)."""
    if 0 < most_kept < scaled.shape[-1] and scaled.device.type == "cpu":
        values, order = scaled.topk(most_kept + 1, -1)  # [B, k + 1], the largest first
        ranked = torch.full_like(scaled, float("-inf"))  # [B, V], as sorted and masked
        ranked[:, :most_kept] = values[:, :most_kept]
        drop = _drop(ranked, top_k, top_p)
        kept = (~drop[:, : most_kept + 1]).sum(-1, keepdim=True)  # [B, 1]: the first dropped
        if not bool((values.gather(1, kept) == values.gather(1, kept - 1)).any()):
            mask = torch.ones_like(drop).scatter(1, order[:, :most_kept], drop[:, :most_kept])
            return scaled.masked_fill(mask, float("-inf"))
    ranked, order = scaled.sort(-1, descending=True)  # [B, V]
    drop = _drop(ranked, top_k, top_p)
    mask = torch.zeros_like(drop).scatter(1, order, drop)
    return scaled.masked_fill(mask, float("-inf"))


def _drop(ranked: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which ranks of logits sorted largest first [B, V] fall outside each row's top-k, then
    outside the top-p mass of what is left."""
    rank = torch.arange(ranked.shape[-1], device=ranked.device)[None, :]
    drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
    probs = ranked.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # keep a token while the mass above it is < top_p
    drop = drop | (mass_before >= top_p[:, None])
    drop[:, 0] = False
    return drop


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A uniform in (0, 1) per row, a deterministic hash of (seed, position). seeds, positions [B]
    int64 → [B] float64. Two rounds of a 32-bit integer finaliser keep every product below 2^63."""
    x = (seeds & _MASK32) ^ ((seeds >> 32) * 0x27D4EB2F & _MASK32)
    x = _mix32((x * 0x9E3779B1 & _MASK32) ^ (positions & _MASK32))
    x = _mix32(x ^ 0x5BD1E995)
    return (x.double() + 0.5) / 2.0**32


def uniform_table(seeds: torch.Tensor, first: torch.Tensor, width: int) -> torch.Tensor:
    """seeded_uniform of every row's next `width` positions, from `first` [B] on: [B, width]
    float64, what decoding draws a request's coming tokens with."""
    positions = first[:, None] + torch.arange(width, device=first.device)
    return seeded_uniform(seeds[:, None].expand_as(positions), positions)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def sampling_cdf(logprobs: torch.Tensor) -> torch.Tensor:
    """The float64 CDF the sampler draws from, one row per distribution: logprobs [B, V] →
    [B, V] (its last column the row's total mass, 1 up to rounding). One float64 copy, then in
    place: over a large vocabulary, allocating [B, V] float64 tensors is a cost of its own."""
    return logprobs.to(torch.float64, copy=True).exp_().cumsum_(-1)


def sample_from_logprobs(logprobs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: logprobs [B, V], uniform [B] → token ids [B]."""
    return draw(logprobs, uniform).tokens


class Draw(NamedTuple):
    """Tokens drawn by inverse-CDF sampling, and where each draw fell."""

    tokens: torch.Tensor  # [B] token ids
    # [B, 2] float64: the drawn interval (a, b] of each token, the uniforms that draw it (its
    # row's CDF scaled to a total mass of 1)
    intervals: torch.Tensor


def draw(logprobs: torch.Tensor, uniform: torch.Tensor) -> Draw:
    """Inverse-CDF sampling: logprobs [B, V], uniform [B] → the tokens and their drawn intervals.
    A token t is drawn where cdf[t - 1] < u · total ≤ cdf[t]: the same uniform draws the same
    token while the policy moves less than u's distance to the interval's ends."""
    cdf = sampling_cdf(logprobs)  # [B, V]
    total = cdf[:, -1:]  # [B, 1]
    tokens = torch.searchsorted(cdf, uniform[:, None] * total)  # [B, 1]
    tokens.clamp_(max=logprobs.shape[-1] - 1)
    ends = cdf.gather(1, torch.cat([tokens - 1, tokens], 1).clamp_(min=0))  # [B, 2]
    ends[:, 0].masked_fill_(tokens[:, 0] == 0, 0.0)  # the first token's interval starts at 0
    return Draw(tokens.squeeze(1), ends.div_(total))


def residual_logprobs(logprobs: torch.Tensor, excluded: Sequence[Sequence[int]]) -> torch.Tensor:
    """logprobs [B, V] with each row's excluded tokens removed and the rest renormalised: the
    exact acceptance rule's residual after a rejected draft token (or after the children of the
    node a slot left its trie at)."""
    rows = [row for row, tokens in enumerate(excluded) if tokens]
    if not rows:
        return logprobs
    residual = logprobs.clone()
    for row in rows:
        residual[row, list(excluded[row])] = float("-inf")
    residual[rows] = residual[rows].log_softmax(-1)
    return residual
