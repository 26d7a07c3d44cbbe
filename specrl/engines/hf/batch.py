"""The sequences a decode loop is decoding (decode.py), kept and compacted together: per
sequence the request it decodes, the token it feeds next and that token's position, its budget,
the uniforms of its coming positions, its sampling and what its first draw excludes; for the
batch the KV cache and its attention mask, one row per distinct context. A sequence that
finishes leaves all of them at once.

Sequences with the same context share a row (`share`) where the cache can copy rows (the eager
cache): a prompt's n slots start from one context, and a peaked policy's slots go on drawing
the same tokens for a while (on the built-in task 71% of a step's response tokens repeat a
sibling's context). A shared row is fed and computed once; each of its sequences draws from its
logits with its own uniforms, and where they draw different tokens, or accept different drafts,
the row is copied and they part (`_regroup`). Logits of equal contexts are equal, so sharing
changes how much is computed, never which tokens come out."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specrl.engines.hf.kv_cache import DecodeCache
from specrl.engines.protocol import GenRequest, GenResult
from specrl.engines.sampling import RowSampling, uniform_table


@dataclass
class DecodeBatch:
    requests: torch.Tensor  # [B] the request each sequence decodes
    request_ids: list[int]  # `requests` on the host
    tokens: list[int]  # [B] fed next (the last token of the sequence so far)
    positions: torch.Tensor  # [B] the fed token's position
    left: torch.Tensor  # [B] new tokens the sequence may still emit
    room: list[int]  # `left` on the host
    done: torch.Tensor  # [B] new tokens emitted so far
    uniforms: torch.Tensor  # [B, most new tokens] the uniform of each coming position
    sampling: RowSampling
    rejected: list[tuple[int, ...]]  # tokens the sequence's next draw excludes (first draw only)
    cache: DecodeCache  # one row per distinct context
    attention: torch.Tensor  # [R, W] which cached columns (then fed ones) each row attends to
    share: list[int] | None = None  # [B] each sequence's row; None: sequence i is row i
    shared: torch.Tensor | None = None  # `share` on the device
    lead: list[int] | None = None  # [R] a sequence of each row
    leads: torch.Tensor | None = None  # `lead` on the device

    @classmethod
    def start(
        cls,
        requests: Sequence[GenRequest],
        live: list[int],
        contexts: list[list[int]],
        cache: DecodeCache,
        attention: torch.Tensor,
        share_rows: bool,
    ) -> DecodeBatch:
        """The sequences of requests `live` after their prefill: the KV of every context but
        its last token in `cache` (a row each), that token fed first. `share_rows`: equal
        contexts share a row."""
        device = attention.device
        positions = torch.tensor([len(c) - 1 for c in contexts], device=device)
        left = torch.tensor([requests[i].max_new_tokens for i in live], device=device)
        # the uniform behind each new token, a hash of (seed, position)
        seeds = torch.tensor([requests[i].seed for i in live], device=device)
        batch = cls(
            requests=torch.tensor(live, device=device),
            request_ids=list(live),
            tokens=[c[-1] for c in contexts],
            positions=positions,
            left=left,
            room=[requests[i].max_new_tokens for i in live],
            done=torch.zeros_like(left),
            uniforms=uniform_table(seeds, positions + 1, int(left.max())),
            sampling=RowSampling.of([requests[i].sampling for i in live], device),
            rejected=[requests[i].excluded_tokens for i in live],
            cache=cache,
            attention=cache.drop_padding(attention),
        )
        if share_rows:
            batch.share = list(range(len(live)))
            batch._regroup([tuple(c) for c in contexts])
        return batch

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def rows(self) -> int:
        """Rows of the cache: distinct contexts."""
        return len(self.attention)

    def per_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor of the rows [R, ...] as one of the sequences [B, ...]."""
        return t if self.shared is None else t.index_select(0, self.shared)

    def row_positions(self) -> torch.Tensor:
        """[R] the position of each row's fed token."""
        return self.positions if self.leads is None else self.positions[self.leads]

    def feed(
        self, drafts: list[list[int]], pad: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the next forward feeds: every row's token followed by its drafts (`drafts` per
        sequence: a row's sequences part where theirs differ), padded to the widest, and the
        attention mask extended over those columns: → fed ids [R, K+1], the drafts per row [R],
        the column numbers [K+1]."""
        device = self.attention.device
        tokens = self.tokens
        if self.share is not None:
            keys = [(r, t, *d) for r, t, d in zip(self.share, tokens, drafts, strict=True)]
            self._regroup(keys)
            tokens, drafts = [tokens[i] for i in self.lead], [drafts[i] for i in self.lead]
        width = max(map(len, drafts))
        if not self.cache.holds(self.attention.shape[1], width + 1):
            self.attention = self.cache.compact(self.attention)
        fed = torch.tensor(tokens, device=device)[:, None]
        if width:
            padding = [pad] * width
            rows = [[t, *d, *padding[len(d) :]] for t, d in zip(tokens, drafts, strict=True)]
            fed = torch.tensor(rows, device=device)
        proposed = torch.tensor(list(map(len, drafts)), device=device)
        cols = torch.arange(width + 1, device=device)
        fed_columns = (cols[None] <= proposed[:, None]).long()
        self.attention = torch.cat([self.attention, fed_columns], dim=1)
        return fed, proposed, cols

    def column_uniforms(self, cols: torch.Tensor) -> torch.Tensor:
        """The uniform of every fed column's next position [B, K+1]; columns past a sequence's
        own drafts are never emitted: clamped, they read any uniform."""
        at = (self.done[:, None] + cols).clamp(max=self.uniforms.shape[1] - 1)
        return self.uniforms.gather(1, at)

    def emit(
        self, sampled: torch.Tensor, accepted: torch.Tensor, cols: torch.Tensor, eos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence emits its accepted drafts and the token after them, up to its budget and
        its first end-of-sequence token: → tokens emitted [B], whether it stopped [B]."""
        emitted = (accepted + 1).minimum(self.left)  # drafts never exceed left - 1; a guard
        is_eos = torch.isin(sampled, eos) & (cols[None] < emitted[:, None])
        stopped = is_eos.any(1)
        emitted = torch.where(stopped, is_eos.int().argmax(1) + 1, emitted)
        self.left, self.done = self.left - emitted, self.done + emitted
        return emitted, stopped

    def advance(self, accepted: torch.Tensor, cols: torch.Tensor, emitted: Emitted) -> None:
        """To the next forward: the cache keeps each sequence's fed token and accepted drafts
        (`accepted` [B]; sequences of a row that accepted different drafts part), the sequence
        feeds the token sampled after them, finished sequences leave (and rows no sequence
        reads). `emitted`, the forward's outcome on the host, decides which without a sync."""
        width = len(cols) - 1
        self.tokens = emitted.next_tokens
        self.room = [r - n for r, n in zip(self.room, emitted.counts, strict=True)]
        self.positions = self.positions + accepted + 1
        kept = [i for i, gone in enumerate(emitted.finished) if not gone]
        left = len(kept) < len(self)
        device = self.attention.device
        if self.share is None:
            if width:  # the rejected drafts' columns are masked out
                self.attention[:, -(width + 1) :] = (cols[None] <= accepted[:, None]).long()
            if left:
                keep, moved = _staying(emitted.finished)
                index = torch.tensor(keep, device=device)
                self.cache.keep_rows(index, torch.tensor(moved, dtype=torch.long, device=device))
                self._keep_sequences(keep, index)
                self.attention = self.cache.drop_padding(self.attention[index])
        else:
            accepted_ids = emitted.accepted
            if left:
                index = torch.tensor(kept, device=device)
                self._keep_sequences(kept, index)
                self.share = [self.share[i] for i in kept]
                accepted_ids = [accepted_ids[i] for i in kept]
                accepted = accepted[index]
            if width:
                self._regroup(list(zip(self.share, accepted_ids, strict=True)))
                mask = cols[None] <= accepted[self.leads][:, None]
                self.attention[:, -(width + 1) :] = mask.long()
            elif left:
                self._regroup(self.share)
            if left:
                self.attention = self.cache.drop_padding(self.attention)
        self.rejected = [()] * len(self)
        if width and _sparse(self.attention):
            self.attention = self.cache.compact(self.attention)

    def _keep_sequences(self, keep: list[int], index: torch.Tensor) -> None:
        """The sequences `keep` (`index` on the device), in that order."""
        self.requests, self.positions, self.left, self.done = (
            t[index] for t in (self.requests, self.positions, self.left, self.done)
        )
        self.request_ids, self.tokens, self.room = (
            [values[i] for i in keep] for values in (self.request_ids, self.tokens, self.room)
        )
        self.uniforms, self.sampling = self.uniforms[index], self.sampling.select(index)
        self.lead = None  # the sequences are numbered anew: `_regroup` finds each row's lead

    def _regroup(self, keys: list[Hashable]) -> None:
        """Sequences with equal keys (one per sequence, [B]) share a row: the first of them's
        row now (equal contexts: a key that tells rows apart keeps them apart). A row of several
        groups is copied for all but one; a row no sequence reads leaves. The rows that stay keep
        their places where they can (`DecodeCache.keep_rows` then moves only the others). Keys
        that lead with the sequence's row and part no row change nothing, unless sequences left
        since the last call (`lead` is None then): most forwards return at once."""
        if self.lead is not None and len(set(keys)) == self.rows:
            return
        group: dict[Hashable, int] = {}
        parent: list[int] = []  # the row each group reads now
        share = []
        for key, row in zip(keys, self.share, strict=True):
            g = group.setdefault(key, len(parent))
            if g == len(parent):
                parent.append(row)
            share.append(g)
        count = len(parent)
        place, claimed = [-1] * count, set()
        for g, row in enumerate(parent):  # a row's first group keeps the row's place
            if row < count and row not in claimed:
                place[g] = row
                claimed.add(row)
        free = iter(sorted(set(range(count)) - claimed))
        place = [p if p >= 0 else next(free) for p in place]
        keep, lead = [0] * count, [0] * count
        for g, p in enumerate(place):
            keep[p] = parent[g]
        for b in reversed(range(len(share))):
            lead[place[share[b]]] = b
        device = self.attention.device
        self.share = [place[g] for g in share]
        self.shared = torch.tensor(self.share, device=device)
        self.lead, self.leads = lead, torch.tensor(lead, device=device)
        if keep != list(range(self.rows)):
            moved = [i for i, row in enumerate(keep) if row != i]
            index = torch.tensor(keep, device=device)
            self.cache.keep_rows(index, torch.tensor(moved, dtype=torch.long, device=device))
            self.attention = self.attention[index]


def _sparse(attention: torch.Tensor) -> bool:
    """Whether the KV cache is more than twice as wide as the longest row needs (attention
    [B, W]): rejected drafts, or other branches of a trie, masked out."""
    return attention.shape[1] > 2 * int(attention.sum(1).max()) + 32


def _staying(finished: list[bool]) -> tuple[list[int], list[int]]:
    """The batch rows that stay, as the new row order, and the places whose row moves: row i
    stays in place, and the slot of a finished row among the first B' is taken by a staying row
    from past B', so only those rows' KV has to move (`DecodeCache.keep_rows`)."""
    staying = [i for i, gone in enumerate(finished) if not gone]
    keep = list(range(len(staying)))
    moved = [i for i in keep if finished[i]]
    for place, row in zip(moved, (i for i in staying if i >= len(staying)), strict=True):
        keep[place] = row
    return keep, moved


@dataclass
class Emitted:
    """What a decode forward emitted, on the host: per sequence the tokens emitted, whether it
    stopped at an end-of-sequence token, whether it finished (stopped, or its budget spent), its
    draft tokens accepted and the token it feeds next (sampled after its accepted drafts)."""

    tokens: list[list[int]]
    stopped: list[bool]
    finished: list[bool]
    accepted: list[int]
    next_tokens: list[int]

    @classmethod
    def read(
        cls,
        sampled: torch.Tensor,
        emitted: torch.Tensor,
        stopped: torch.Tensor,
        finished: torch.Tensor,
        accepted: torch.Tensor,
    ) -> Emitted:
        """From the forward's tensors (`sampled` [B, K+1], the rest [B]), in one copy to the
        host: on a GPU each copy waits for the device."""
        values = torch.cat([torch.stack([emitted, stopped, finished, accepted], 1), sampled], 1)
        rows = values.tolist()
        return cls(
            tokens=[row[4 : 4 + row[0]] for row in rows],
            stopped=[bool(row[1]) for row in rows],
            finished=[bool(row[2]) for row in rows],
            accepted=[row[3] for row in rows],
            next_tokens=[row[4 + row[3]] for row in rows],
        )

    @property
    def counts(self) -> list[int]:
        return list(map(len, self.tokens))


class Emissions:
    """What every forward of a decode loop emitted, kept as the forwards left it (on the device)
    and written into the results once, when the loop ends: per forward the sequences' requests
    [B], tokens emitted [B], the logprobs [B, K+1] and drawn intervals [B, K+1, 2] of the tokens
    at the fed columns, the drafts proposed and accepted [B]. Writing each forward's values
    into per-request lists as they come costs the host a Python step per sequence and forward;
    here they go in with one copy to the host per kind (a vanilla call of the built-in task's
    256 sequences: the engine's host work 26-32% less in two of three A/B pairs,
    benchmarks/cpu-hf-decode-host-emissions)."""

    def __init__(self) -> None:
        self.forwards: list[tuple[torch.Tensor, ...]] = []

    def add(
        self,
        requests: torch.Tensor,
        emitted: torch.Tensor,
        logprobs: torch.Tensor,
        intervals: torch.Tensor,
        proposed: torch.Tensor,
        accepted: torch.Tensor,
    ) -> None:
        self.forwards.append((requests, emitted, logprobs, intervals, proposed, accepted))

    def write(self, results: Sequence[GenResult]) -> None:
        """Append to each request's `GenResult` its emitted tokens' logprobs and intervals in the
        order emitted, and add its forwards and draft tokens proposed and accepted (after the
        loop's last forward)."""
        width = max(f[2].shape[1] for f in self.forwards)
        requests, emitted, proposed, accepted = (
            torch.cat([f[k] for f in self.forwards]) for k in (0, 1, 4, 5)
        )
        logprobs = torch.cat([F.pad(f[2], (0, width - f[2].shape[1])) for f in self.forwards])
        intervals = torch.cat(
            [F.pad(f[3], (0, 0, 0, width - f[3].shape[1])) for f in self.forwards]
        )
        emits = torch.arange(width, device=requests.device)[None] < emitted[:, None]
        owner = requests[:, None].expand(-1, width)[emits]  # emission order: forward, column
        order = torch.argsort(owner, stable=True)
        counts = torch.bincount(owner, minlength=len(results)).tolist()
        values = logprobs[emits][order].tolist()
        low, high = intervals[emits][order].T.tolist()  # nested lists build slowly: 2 rows
        drawn = list(zip(low, high, strict=True))
        per_request = torch.zeros(3, len(results), dtype=torch.long, device=requests.device)
        per_request.index_add_(
            1, requests, torch.stack([torch.ones_like(requests), proposed, accepted])
        )
        start = 0
        for result, n, (forwards, drafts, kept) in zip(
            results, counts, per_request.T.tolist(), strict=True
        ):
            result.logprobs.extend(values[start : start + n])
            result.intervals.extend(drawn[start : start + n])
            start += n
            result.forwards += forwards
            result.draft_tokens += drafts
            result.accepted_tokens += kept
