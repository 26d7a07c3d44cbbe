"""The decode loop of the transformers engine: a batch of requests decoded token by token, or
several tokens per forward with a drafter's drafts (model-free speculative decoding).

Batches are left-padded; every sequence keeps its own position ids, so padding never changes a
result. A sequence that finishes leaves the batch and its rows leave the KV cache: it costs
nothing afterwards. On the CPU the sequences of one context (a prompt's slots) share one row
until they draw different tokens (`DecodeBatch`). A request whose context starts a sequence
verified into the caller's `prefixes` takes that KV and its first token's distribution from there.
Every token is sampled with a counter-based uniform of (request seed, position), so drafts,
batching and cached prefixes change how much is computed, never which tokens come out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import DynamicCache

from specrl.engines.accounting import ForwardCounts, causal_attended
from specrl.engines.hf.batch import DecodeBatch, Emissions, Emitted
from specrl.engines.hf.kv_cache import DecodeCache, layers_kv, merge
from specrl.engines.hf.prefix_cache import Hit, PrefixCache
from specrl.engines.hf.static_decode import StaticDecode
from specrl.engines.protocol import Drafter, GenRequest, GenResult
from specrl.engines.sampling import (
    RowSampling,
    draw,
    residual_logprobs,
    sampling_logprobs,
    seeded_uniform,
)
from specrl.types import FinishReason

# (kind, ids, attention, positions, cache, keep=0) → logits, its seconds counted under kind
Forward = Callable[..., torch.Tensor]


@dataclass
class Decoder:
    """One `generate` call's decoding: the engine's forward and token ids, the caller's prefix
    handle and drafter, the engine's static-shape decoding (any of the three may be None)."""

    forward: Forward
    counts: ForwardCounts
    eos_token_ids: frozenset[int]
    pad_token_id: int
    device: torch.device
    prefixes: PrefixCache | None = None
    drafter: Drafter | None = None
    static: StaticDecode | None = None

    def decode(self, requests: Sequence[GenRequest], indices: list[int]) -> list[GenResult]:
        """Decode `requests` as one batch; `indices` are their numbers for the drafter. With a
        drafter, each forward feeds every sequence's last token followed by up to K draft tokens;
        see `_accepted`."""
        drafter = self.drafter
        results = [GenResult([], [], "length") for _ in requests]
        requests = self._first_tokens(requests, results)
        for i, request in enumerate(requests):  # finished by their first token
            if drafter is not None and request.max_new_tokens == 0 and results[i].token_ids:
                drafter.finished(indices[i], results[i].token_ids)
        live = [i for i, r in enumerate(requests) if r.max_new_tokens > 0]
        if not live:
            return results
        contexts = [list(requests[i].prompt_ids) + list(requests[i].prefix_ids) for i in live]
        most = max(requests[i].max_new_tokens for i in live)
        width = 1 if drafter is None else drafter.max_tokens + 1
        # room for the columns decoding writes (the context's last token, every new token but the
        # last, the last forward's drafts), so that the cache is not copied as it grows; static
        # decoding copies it into its arena at once
        room = 0 if self.static is not None else most + width - 1
        cache, attention = self._prefill(contexts, room)
        forward = self.forward
        if self.static is not None and cache.layers:
            cache, forward = self.static.adopt(cache, attention, most, width), self.static
        # A context's sequences share one row of the eager cache until they part: on the CPU a
        # decode forward costs per row; on a GPU rows are nearly free and each copy is launches.
        share_rows = forward is self.forward and self.device.type == "cpu"
        batch = DecodeBatch.start(requests, live, contexts, cache, attention, share_rows)
        eos = torch.tensor(sorted(self.eos_token_ids), device=self.device)
        before = [len(r.token_ids) for r in results]  # a first token drawn from `prefixes`
        accepted_per_sequence = 0.0  # Σ over forwards of draft tokens accepted per sequence
        emissions, tally = Emissions(), DecodeTally()
        while True:
            started, captured = time.perf_counter(), self.counts.decode_capture_seconds
            drafts = self._drafts(batch, results, indices, forward is not self.forward)
            fed, proposed, cols = batch.feed(drafts, self.pad_token_id)  # per row
            positions = batch.row_positions()[:, None] + cols
            logits = forward("decode", fed, batch.attention, positions, batch.cache)
            tally.add(batch.attention, fed.shape[1])
            fed_rows, fed_tokens = len(fed), fed.numel()
            fed, proposed = batch.per_sequence(fed), batch.per_sequence(proposed)
            sampled, logprobs, intervals = self._sample(
                batch.per_sequence(logits),
                batch.sampling,
                batch.column_uniforms(cols),
                batch.rejected,
            )
            accepted = _accepted(sampled, fed, proposed)  # [B] draft tokens kept
            emitted, stopped = batch.emit(sampled, accepted, cols, eos)
            emissions.add(batch.requests, emitted, logprobs, intervals, proposed, accepted)
            # the tokens now (drafters read them), in one copy to the host; their logprobs and
            # intervals at the end
            out = Emitted.read(sampled, emitted, stopped, stopped | (batch.left <= 0), accepted)
            for request, new in zip(batch.request_ids, out.tokens, strict=True):
                results[request].token_ids.extend(new)
            for request, finished, stop in zip(
                batch.request_ids, out.finished, out.stopped, strict=True
            ):
                if finished:
                    results[request].finish_reason = _reason(stop)
                    if drafter is not None:
                        drafter.finished(indices[request], results[request].token_ids)
            done = all(out.finished)
            if not done:
                batch.advance(accepted, cols, out)
            if drafter is not None:
                # the whole iteration, drafting's host work included; not a CUDA graph's capture,
                # paid once per shape (fitted in, the first reuse steps' captures set the draft
                # width near 0: 55 decode forwards in the next step on an H200 at 268M, not 8-16)
                captures = self.counts.decode_capture_seconds - captured
                seconds = time.perf_counter() - started - captures
                n_proposed = [len(d) for d in drafts]
                span = None if forward is self.forward else self.static.arena.span
                drafter.observe(n_proposed, out.accepted, fed_rows, fed_tokens, seconds, span)
                accepted_per_sequence += sum(out.accepted) / len(out.accepted)
            if done:
                emissions.write(results)
                tally.record(self.counts)
                if drafter is not None:  # the longest-lived sequence was in every forward
                    forwards = max(results[i].forwards for i in live)
                    longest = max(len(results[i].token_ids) - before[i] for i in live)
                    drafter.observe_loop(forwards, longest, accepted_per_sequence)
                return results

    def _first_tokens(
        self, requests: list[GenRequest], results: list[GenResult]
    ) -> list[GenRequest]:
        """Sample the first new token of every request that continues a sequence verified into
        `prefixes` from the distribution verification kept (`PrefixCache.next_token`), with the uniform and the
        residual decoding would use, into `results`: → the requests, those one token further
        (no budget left once it ends the sequence)."""
        found: dict[int, torch.Tensor] = {}  # request → distribution of its first token
        if self.prefixes is None:
            return requests
        for i, r in enumerate(requests):
            if r.max_new_tokens > 0:
                context = [*r.prompt_ids, *r.prefix_ids]
                distribution = self.prefixes.next_token(context, r.sampling)
                if distribution is not None:
                    found[i] = distribution
        if not found:
            return requests
        logprobs = torch.stack(list(found.values()))  # [R, V]
        seeds = torch.tensor([requests[i].seed for i in found], device=self.device)
        positions = torch.tensor(
            [len(requests[i].prompt_ids) + len(requests[i].prefix_ids) for i in found],
            device=self.device,
        )
        rejected = [requests[i].excluded_tokens for i in found]
        tokens, intervals = draw(
            residual_logprobs(logprobs, rejected), seeded_uniform(seeds, positions)
        )
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        requests = list(requests)
        low, high = intervals.T.tolist()
        for i, token, logprob, drawn in zip(
            found, tokens.tolist(), chosen.tolist(), zip(low, high, strict=True), strict=True
        ):
            r = requests[i]
            results[i].token_ids.append(token)
            results[i].logprobs.append(logprob)
            results[i].intervals.append(drawn)
            if token in self.eos_token_ids:
                results[i].finish_reason = "stop"
                requests[i] = replace(r, max_new_tokens=0)
            else:
                requests[i] = replace(
                    r,
                    max_new_tokens=r.max_new_tokens - 1,
                    prefix_ids=[*r.prefix_ids, token],
                    excluded_tokens=(),
                )
        return requests

    def _drafts(
        self, batch: DecodeBatch, results: list[GenResult], indices: list[int], static: bool
    ) -> list[list[int]]:
        """Draft tokens per sequence, cut after an end-of-sequence token and to the width the
        controller chooses (`static`: for the columns the arena's next plain forward attends);
        none for a sequence whose first token is drawn from a residual."""
        drafter = self.drafter
        if drafter is None:
            return [[] for _ in range(len(batch))]
        span = self.static.columns(batch.cache, batch.attention.shape[1] + 1) if static else None
        if not drafter.worthwhile(batch.rows, span):
            drafter.choose([], span)
            return [[] for _ in range(len(batch))]
        drafts, cap = [], drafter.max_tokens  # no forward verifies more than K
        for request, room, reject in zip(
            batch.request_ids, batch.room, batch.rejected, strict=True
        ):
            draft = []
            if not reject and room > 1:
                most = min(room - 1, cap)
                draft = drafter.propose(indices[request], results[request].token_ids, most)
                stop = next((j for j, t in enumerate(draft) if t in self.eos_token_ids), None)
                draft = draft[:most] if stop is None else draft[: stop + 1]
            drafts.append(draft)
        k = drafter.choose([len(d) for d in drafts], span)
        return [d[:k] for d in drafts]

    def _sample(
        self,
        logits: torch.Tensor,
        sampling: RowSampling,
        uniforms: torch.Tensor,
        rejected: list[tuple[int, ...]],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The token at every fed column's next position and its behaviour logprob, both [B, K+1],
        and its drawn interval [B, K+1, 2] (`draw`).
        Column j's token is sampled with the counter-based uniform of its position (`uniforms`
        [B, K+1]), so it is the token decoding without drafts would sample there. The request's
        `excluded_tokens` are removed from the first column's distribution; its logprob stays
        the full one."""
        batch, columns, vocab = logits.shape
        logprobs = sampling_logprobs(logits.reshape(-1, vocab), sampling.repeat(columns))
        logprobs = logprobs.view(batch, columns, vocab)
        draw_from = logprobs
        if any(rejected):
            draw_from = logprobs.clone()
            draw_from[:, 0] = residual_logprobs(logprobs[:, 0], rejected)
        sampled, intervals = draw(draw_from.reshape(-1, vocab), uniforms.reshape(-1))
        sampled = sampled.view(batch, columns)
        chosen = logprobs.gather(2, sampled[..., None]).squeeze(2)
        return sampled, chosen, intervals.view(batch, columns, 2)

    def _prefill(self, contexts: list[list[int]], room: int) -> tuple[DecodeCache, torch.Tensor]:
        """KV cache and attention mask [B, W] for each context minus its last token, with `room`
        columns to spare for decoding (`merge`). Rows whose tokens were verified into `prefixes`
        take the KV of those tokens from there (`_hit_kv`); the rest are computed in one forward
        pass, each distinct context once."""
        heads = [c[:-1] for c in contexts]
        prefixes = self.prefixes
        hits = {}
        if prefixes is not None:
            hits = {i: hit for i, h in enumerate(heads) if (hit := prefixes.find(h))}
        compute = [i for i in range(len(heads)) if i not in hits and heads[i]]
        empty = [i for i in range(len(heads)) if i not in hits and not heads[i]]
        parts: list[tuple[list[int], list[torch.Tensor], torch.Tensor]] = []  # rows, KV, mask
        if compute:
            # a prompt's n slots share its context: each distinct one is computed once
            distinct: dict[tuple[int, ...], int] = {}
            source = [distinct.setdefault(tuple(heads[i]), len(distinct)) for i in compute]
            ids, attention = left_pad(list(map(list, distinct)), self.pad_token_id, self.device)
            cache = DynamicCache()
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            self.forward("prefill", ids, attention, positions, cache, keep=1)
            self.counts.record(
                "prefill", *prefill_counts(attention), computed=padded_counts(attention)
            )
            kv = layers_kv(cache)
            if len(distinct) < len(compute):
                index = torch.tensor(source, device=self.device)
                kv = [t.index_select(0, index) for t in kv]
                attention = attention.index_select(0, index)
            parts.append((compute, kv, attention))
        if empty:  # single-token contexts: nothing to prefill
            parts.append(
                (empty, [], torch.zeros(len(empty), 0, dtype=torch.long, device=self.device))
            )
        for batch, group in _group_by_batch(hits).items():
            kv, _ = prefixes.batches[batch]
            parts.append((group, *_hit_kv(kv, [hits[i] for i in group])))
        if not any(kv for _, kv, _ in parts):  # nothing cached, nothing to prefill
            width = torch.zeros(len(contexts), 0, dtype=torch.long, device=self.device)
            return DecodeCache(), width
        return merge(parts, room)


@dataclass
class DecodeTally:
    """The counts of a decode loop's forwards: what the host knows added as they come, the sums
    over attention masks kept on the device and read once, when the loop ends (on a GPU every
    read waits for the device)."""

    forwards: int = 0
    rows: int = 0
    computed_positions: int = 0
    computed_kv_reads: int = 0
    rows_fed: list[torch.Tensor] = field(default_factory=list)  # a forward's [2, R]: fed, read

    def add(self, attention: torch.Tensor, width: int) -> None:
        """A decode forward: each row's fed token and drafts after the context it attends to
        (`attention` [R, W], the `width` fed columns last, every row fed that many). Two ops a
        forward, three with drafts (on a GPU each is a launch); the sums come in `record`."""
        fed = attention[:, -1] if width == 1 else attention[:, -width:].sum(1)
        self.rows_fed.append(torch.stack([fed, attention.sum(1)]))
        self.forwards += 1
        self.rows += len(attention)
        self.computed_positions += len(attention) * width
        self.computed_kv_reads += attention.numel()

    def record(self, counts: ForwardCounts) -> None:
        fed, reads = torch.cat(self.rows_fed, 1)
        pairs = causal_attended(fed, reads - fed)
        positions, kv_reads, attended = torch.stack([fed.sum(), reads.sum(), pairs.sum()]).tolist()
        counts.record(
            "decode",
            self.rows,
            positions,
            kv_reads,
            attended,
            draft_positions=positions - self.rows,  # a row's fed columns: its token, its drafts
            forwards=self.forwards,
            computed=(self.computed_positions, self.computed_kv_reads),
        )


def _accepted(sampled: torch.Tensor, fed: torch.Tensor, proposed: torch.Tensor) -> torch.Tensor:
    """Draft tokens accepted per row: the longest prefix of the drafts (fed[:, 1:]) equal to the
    tokens sampled at their positions.

    This is the exact rule of a point-mass proposal as a maximal coupling: the sample at a
    draft token's position equals the draft d with probability p(d) (accept), and given that it
    does not, it is distributed as p with d removed and renormalised (the residual), which is
    what the row emits next. Drafts decide how many tokens a forward yields, never which ones."""
    if fed.shape[1] == 1:  # no drafts fed: none accepted, as `proposed` says (zeros)
        return proposed
    cols = torch.arange(fed.shape[1] - 1, device=fed.device)
    match = (sampled[:, :-1] == fed[:, 1:]) & (cols[None] < proposed[:, None])
    return match.int().cumprod(1).sum(1)


def _reason(stopped: bool) -> FinishReason:
    return "stop" if stopped else "length"


def prefill_counts(attention: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, positions, KV reads, query-key pairs) of a forward over left-padded sequences
    with nothing cached (`attention` [B, T], 1 on real tokens), causal."""
    real = attention.sum(1)
    return len(real), int(real.sum()), int(real.sum()), int(causal_attended(real, 0).sum())


def padded_counts(attention: torch.Tensor) -> tuple[int, int]:
    """(positions, KV reads) a forward over left-padded sequences with nothing cached
    computes, padding included (`attention` [B, T])."""
    return attention.numel(), attention.numel()


def left_pad(
    sequences: Sequence[Sequence[int]], pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """→ ids [B, T] and attention mask [B, T], real tokens right-aligned (built on the host
    with numpy: no op per sequence)."""
    width = max(len(s) for s in sequences)
    ids = np.full((len(sequences), width), pad, dtype=np.int64)
    attention = np.zeros((len(sequences), width), dtype=np.int64)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq) :] = seq
            attention[row, width - len(seq) :] = 1
    return torch.from_numpy(ids).to(device), torch.from_numpy(attention).to(device)


def _hit_kv(kv: list[torch.Tensor], hits: list[Hit]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The cached KV of each hit's columns and no other (a trie row holds every branch, a verified
    sequence its draft past the head), left-padded to the longest: per layer [G, heads, L, dim],
    and the mask [G, L]. Padding reads the row's first column, masked out."""
    columns = [hit.columns for hit in hits]
    index = pad_sequence(columns, batch_first=True, padding_side="left")  # [G, L]
    lengths = torch.tensor([len(c) for c in columns], device=index.device)
    mask = torch.arange(index.shape[1], device=index.device) >= index.shape[1] - lengths[:, None]
    rows = torch.tensor([hit.row for hit in hits], device=index.device)[:, None, None]
    # A layer's KV [B, heads, W, dim] as rows of `dim`: the rows of (hit, head, column) in one
    # index_select come out as the decode cache lays them out (an indexed gather over rows and
    # columns would put the heads last and need a transposing copy).
    flat: dict[tuple[int, int], torch.Tensor] = {}  # (heads, W) → the rows to select
    gathered = []
    for t in kv:
        _, heads, width, dim = t.shape
        if (heads, width) not in flat:
            head = torch.arange(heads, device=index.device)[None, :, None]
            flat[heads, width] = ((rows * heads + head) * width + index[:, None, :]).reshape(-1)
        selected = t.reshape(-1, dim).index_select(0, flat[heads, width])
        gathered.append(selected.view(len(hits), heads, -1, dim))
    return gathered, mask.long()


def _group_by_batch(hits: dict[int, Hit]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, hit in hits.items():
        groups.setdefault(hit.batch, []).append(i)
    return groups
