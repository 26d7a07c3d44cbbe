"""Transformers rollout engine: our own decode loop over any local Hugging Face causal LM.

The loop is ours (not `model.generate()`) so that forced prefixes, per-request budgets, seeds and
multi-token verification of draft tokens (speculative decoding) are under our control. Batches
are left-padded; every sequence keeps its own position ids, so padding never changes a result. A
sequence that finishes leaves the batch and its rows leave the KV cache: it costs nothing
afterwards. Decoding that continues a sequence just scored (a speculative rollout after its cut)
takes the KV of its context, and the distribution of its first new token, from the scoring pass.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from specrl.engines.base import (
    FinishReason,
    GenRequest,
    GenResult,
    SamplingParams,
    ScoreRequest,
    distinct_requests,
)
from specrl.engines.sampling import (
    RowSampling,
    sample_from_logprobs,
    sampling_logprobs,
    seeded_uniform,
)
from specrl.engines.speculation import Drafting


class HFEngine:
    """Rollout engine over a transformers model. When it wraps the trainer's own model object the
    weights are shared, so there is nothing to sync after an update."""

    drafts = True

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
        self._prefix_cache = PrefixCache()

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

    @torch.inference_mode()
    def generate(
        self, requests: Sequence[GenRequest], drafting: Drafting | None = None
    ) -> list[GenResult]:
        # Longest contexts first: similar lengths share a batch, so little padding is computed.
        order = sorted(
            range(len(requests)),
            key=lambda i: -len(requests[i].prompt_ids) - len(requests[i].prefix_ids),
        )
        results: list[GenResult | None] = [None] * len(requests)
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start : start + self.max_batch_size]
            for i, result in zip(
                chunk, self._generate_batch(requests, chunk, drafting), strict=True
            ):
                results[i] = result
        return results  # type: ignore[return-value]

    def _generate_batch(
        self, all_requests: Sequence[GenRequest], indices: list[int], drafting: Drafting | None
    ) -> list[GenResult]:
        """Decode requests `indices` of `all_requests` as one batch. With `drafting`, each forward
        feeds every sequence's last token followed by up to K draft tokens; see `_accepted`."""
        requests = [all_requests[i] for i in indices]
        results = [GenResult([], [], "length") for _ in requests]
        requests = self._first_tokens(requests, results)
        for i, request in enumerate(requests):  # finished by their first token
            if drafting is not None and request.max_new_tokens == 0 and results[i].token_ids:
                drafting.source.finished(indices[i], results[i].token_ids)
        live = [i for i, r in enumerate(requests) if r.max_new_tokens > 0]
        if not live:
            return results
        contexts = [list(requests[i].prompt_ids) + list(requests[i].prefix_ids) for i in live]
        # KV of every context but its last token; that token is the first one fed below.
        cache, attention = self._prefill(contexts)  # attention [B, W]
        attention = _drop_padding(cache, attention)
        tokens = torch.tensor([c[-1] for c in contexts], device=self.device)  # [B] fed next
        positions = torch.tensor([len(c) - 1 for c in contexts], device=self.device)  # theirs
        rows = torch.tensor(live, device=self.device)  # request index of each batch row
        left = torch.tensor([requests[i].max_new_tokens for i in live], device=self.device)
        # The uniform behind each new token, a hash of (seed, position): [B, most new tokens]
        seeds = torch.tensor([requests[i].seed for i in live], device=self.device)
        uniforms = _uniform_table(seeds, positions + 1, int(left.max()))
        done = torch.zeros_like(left)  # new tokens so far
        eos = torch.tensor(sorted(self.eos_token_ids), device=self.device)
        sampling = RowSampling.of([requests[i].sampling for i in live], self.device)
        rejected = [requests[i].reject_token for i in live]  # applies to each first new token
        while True:
            started = time.perf_counter()
            drafts = self._drafts(drafting, rows, results, indices, left, rejected)
            width = max(map(len, drafts))
            fed = tokens.new_full((len(rows), width + 1), self.pad_token_id)  # [B, K+1]
            fed[:, 0] = tokens
            for b, draft in enumerate(drafts if width else ()):
                if draft:
                    fed[b, 1 : len(draft) + 1] = torch.tensor(draft)
            proposed = torch.tensor(list(map(len, drafts)), device=self.device)  # [B]
            cols = torch.arange(width + 1, device=self.device)
            attention = torch.cat([attention, (cols[None] <= proposed[:, None]).long()], dim=1)
            logits = self._forward(fed, attention, positions[:, None] + cols, cache)  # [B, K+1, V]
            # columns past a row's own drafts are never emitted; clamped, they read any uniform
            at = (done[:, None] + cols).clamp(max=uniforms.shape[1] - 1)
            column_uniforms = uniforms.gather(1, at)  # [B, K+1]
            sampled, logprobs = self._sample(logits, sampling, column_uniforms, rejected)
            accepted = _accepted(sampled, fed, proposed)  # [B] draft tokens kept
            emitted = (accepted + 1).minimum(left)  # drafts never exceed left - 1; a guard
            is_eos = torch.isin(sampled, eos) & (cols[None] < emitted[:, None])
            stopped = is_eos.any(1)
            emitted = torch.where(stopped, is_eos.int().argmax(1) + 1, emitted)
            left, done = left - emitted, done + emitted
            for row, n, k, a, new, lps in zip(
                rows.tolist(),
                emitted.tolist(),
                proposed.tolist(),
                accepted.tolist(),
                sampled.tolist(),
                logprobs.tolist(),
                strict=True,
            ):
                result = results[row]
                result.token_ids.extend(new[:n])
                result.logprobs.extend(lps[:n])
                result.forwards += 1
                result.draft_tokens += k
                result.accepted_tokens += a
            finished = stopped | (left <= 0)
            for row, was_stopped in zip(
                rows[finished].tolist(), stopped[finished].tolist(), strict=True
            ):
                results[row].finish_reason = _reason(was_stopped)
                if drafting is not None:
                    drafting.source.finished(indices[row], results[row].token_ids)
            if drafting is not None:
                drafting.width.observe_drafts(proposed.tolist(), accepted.tolist())
                drafting.width.observe_forward(fed.numel(), time.perf_counter() - started)
            if bool(finished.all()):
                return results
            if width:  # the cache keeps the fed token and accepted drafts; mask out the rest
                attention[:, -(width + 1) :] = (cols[None] <= accepted[:, None]).long()
            tokens = sampled.gather(1, accepted[:, None]).squeeze(1)
            positions = positions + accepted + 1
            if bool(finished.any()):
                keep = _staying(finished)
                cache.keep_rows(keep)
                rows, tokens, positions, left, done, uniforms, attention = (
                    t[keep] for t in (rows, tokens, positions, left, done, uniforms, attention)
                )
                sampling = sampling.select(keep)
                attention = _drop_padding(cache, attention)
            rejected = [None] * len(rows)
            if width and attention.shape[1] > 2 * int(attention.sum(1).max()) + 32:
                attention = cache.compact(attention)

    def _first_tokens(
        self, requests: list[GenRequest], results: list[GenResult]
    ) -> list[GenRequest]:
        """Sample the first new token of every request that continues a sequence just scored
        from the distribution scoring kept (`PrefixCache.next_token`), with the uniform and the
        residual decoding would use, into `results`: → the requests, those one token further
        (no budget left once it ends the sequence)."""
        found: dict[int, torch.Tensor] = {}  # request → distribution of its first token
        for i, r in enumerate(requests):
            if r.max_new_tokens > 0:
                context = [*r.prompt_ids, *r.prefix_ids]
                distribution = self._prefix_cache.next_token(context, r.sampling)
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
        rejected = [requests[i].reject_token for i in found]
        tokens = sample_from_logprobs(
            _residual(logprobs, rejected), seeded_uniform(seeds, positions)
        )
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        requests = list(requests)
        for i, token, logprob in zip(found, tokens.tolist(), chosen.tolist(), strict=True):
            r = requests[i]
            results[i].token_ids.append(token)
            results[i].logprobs.append(logprob)
            if token in self.eos_token_ids:
                results[i].finish_reason = "stop"
                requests[i] = replace(r, max_new_tokens=0)
            else:
                requests[i] = replace(
                    r,
                    max_new_tokens=r.max_new_tokens - 1,
                    prefix_ids=[*r.prefix_ids, token],
                    reject_token=None,
                )
        return requests

    def _drafts(
        self,
        drafting: Drafting | None,
        rows: torch.Tensor,
        results: list[GenResult],
        indices: list[int],
        left: torch.Tensor,
        rejected: list[int | None],
    ) -> list[list[int]]:
        """Draft tokens per batch row, cut after an end-of-sequence token and to the width the
        controller chooses; none for a row whose first token is drawn from a residual."""
        if drafting is None:
            return [[] for _ in range(len(rows))]
        if not drafting.width.worthwhile(len(rows)):
            drafting.width.choose([])
            return [[] for _ in range(len(rows))]
        drafts, cap = [], drafting.width.max_tokens  # no forward verifies more than K
        for row, room, reject in zip(rows.tolist(), left.tolist(), rejected, strict=True):
            draft = []
            if reject is None and room > 1:
                most = min(room - 1, cap)
                draft = drafting.source.propose(indices[row], results[row].token_ids, most)
                stop = next((j for j, t in enumerate(draft) if t in self.eos_token_ids), None)
                draft = draft[:most] if stop is None else draft[: stop + 1]
            drafts.append(draft)
        k = drafting.width.choose([len(d) for d in drafts])
        return [d[:k] for d in drafts]

    def _sample(
        self,
        logits: torch.Tensor,
        sampling: RowSampling,
        uniforms: torch.Tensor,
        rejected: list[int | None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The token at every fed column's next position and its behaviour logprob, both [B, K+1].
        Column j's token is sampled with the counter-based uniform of its position (`uniforms`
        [B, K+1]), so it is the token decoding without drafts would sample there. A rejected
        token (`reject_token` of the request) is removed from the first column's distribution;
        its logprob stays the full one."""
        batch, columns, vocab = logits.shape
        logprobs = sampling_logprobs(logits.reshape(-1, vocab), sampling.repeat(columns))
        logprobs = logprobs.view(batch, columns, vocab)
        draw_from = logprobs
        if any(r is not None for r in rejected):
            draw_from = logprobs.clone()
            draw_from[:, 0] = _residual(logprobs[:, 0], rejected)
        sampled = sample_from_logprobs(draw_from.reshape(-1, vocab), uniforms.reshape(-1))
        sampled = sampled.view(batch, columns)
        return sampled, logprobs.gather(2, sampled[..., None]).squeeze(2)

    def _prefill(self, contexts: list[list[int]]) -> tuple[DynamicCache, torch.Tensor]:
        """KV cache and attention mask [B, W] for each context minus its last token. Rows whose
        tokens were just scored take their KV from the prefix cache (the rejected draft tokens
        after them stay in the cache, masked out); the rest are computed in one forward pass."""
        heads = [c[:-1] for c in contexts]
        hits = {i: hit for i, h in enumerate(heads) if (hit := self._prefix_cache.find(h))}
        compute = [i for i in range(len(heads)) if i not in hits and heads[i]]
        empty = [i for i in range(len(heads)) if i not in hits and not heads[i]]
        parts: list[tuple[list[int], list[torch.Tensor], torch.Tensor]] = []  # rows, KV, mask
        if compute:
            ids, attention = _left_pad([heads[i] for i in compute], self.pad_token_id, self.device)
            cache = DynamicCache()
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            self._forward(ids, attention, positions, cache, keep=1)
            parts.append((compute, _layers_kv(cache), attention))
        if empty:  # single-token contexts: nothing to prefill
            parts.append(
                (empty, [], torch.zeros(len(empty), 0, dtype=torch.long, device=self.device))
            )
        for batch, group in _group_by_batch(hits).items():
            kv, valid = self._prefix_cache.batches[batch]
            rows = torch.tensor([hits[i][1] for i in group], device=self.device)
            attention = torch.zeros(
                len(group), valid.shape[1], dtype=torch.long, device=self.device
            )
            for j, i in enumerate(group):  # keep only the head of each cached row
                start = int(valid[hits[i][1]].argmax())  # its first real (non-pad) column
                attention[j, start : start + len(heads[i])] = 1
            parts.append((group, [t.index_select(0, rows) for t in kv], attention))
        if not any(kv for _, kv, _ in parts):  # nothing cached, nothing to prefill
            width = torch.zeros(len(contexts), 0, dtype=torch.long, device=self.device)
            return DecodeCache(), width
        return _merge(parts)

    @torch.inference_mode()
    def score(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        """One forward pass per batch of up to `max_batch_size` distinct sequences. Identical
        requests (the n slots of a prompt often hold the same draft) are computed once."""
        distinct, where = distinct_requests(requests)
        self._prefix_cache = PrefixCache()
        scored: list[torch.Tensor] = []
        for start in range(0, len(distinct), self.max_batch_size):
            scored.extend(self._score_batch(distinct[start : start + self.max_batch_size]))
        return [scored[i] for i in where]

    def _score_batch(self, requests: Sequence[ScoreRequest]) -> list[torch.Tensor]:
        sequences = [list(r.context_ids) + list(r.target_ids) for r in requests]
        ids, attention = _left_pad(sequences, self.pad_token_id, self.device)  # [B, T]
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        # Targets are right-aligned: the logits at column t predict the token at column t + 1, so
        # only the last n + 1 columns need logits (the prompts' columns only need their KV); the
        # last one predicts the token after the sequence.
        n = max(len(r.target_ids) for r in requests)
        logits = self._forward(ids, attention, positions, cache, keep=n + 1)  # [B, n + 1, V]
        sampling = RowSampling.of([r.sampling for r in requests], self.device).repeat(n + 1)
        distributions = sampling_logprobs(logits.reshape(-1, logits.shape[-1]), sampling)
        distributions = distributions.view(len(requests), n + 1, -1)  # [B, n + 1, V]
        kv = _layers_kv(cache)
        kept = distributions if _nbytes([distributions]) <= _nbytes(kv) else None
        self._prefix_cache.add(sequences, kv, attention, kept, [r.sampling for r in requests])
        logprobs = distributions[:, :-1].gather(2, ids[:, -n:, None]).squeeze(2)  # [B, n]
        return [
            row[n - len(r.target_ids) :].cpu() for row, r in zip(logprobs, requests, strict=True)
        ]

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy new weights in (nothing to copy for tensors that already are the engine's, as when
        it wraps the trainer's model) and drop the prefix cache, which the old weights made."""
        self._prefix_cache = PrefixCache()
        params = self.model.state_dict(keep_vars=True)  # tied weights appear under each name
        with torch.no_grad():
            for name, tensor in state.items():
                if name not in params:
                    raise KeyError(f"engine model has no parameter {name!r}")
                if params[name].data_ptr() != tensor.data_ptr():
                    params[name].copy_(tensor)

    def _forward(
        self,
        ids: torch.Tensor,
        attention: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache | None,
        keep: int = 0,
    ) -> torch.Tensor:
        """Logits [B, T, V] of the last `keep` columns (0: all of them)."""
        return self.model(
            input_ids=ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=cache is not None,
            logits_to_keep=keep,
        ).logits


def _accepted(sampled: torch.Tensor, fed: torch.Tensor, proposed: torch.Tensor) -> torch.Tensor:
    """Draft tokens accepted per row: the longest prefix of the drafts (fed[:, 1:]) equal to the
    tokens sampled at their positions.

    This is the exact rule of a point-mass proposal as a maximal coupling: the sample at a
    draft token's position equals the draft d with probability p(d) (accept), and given that it
    does not, it is distributed as p with d removed and renormalised (the residual), which is
    what the row emits next. Drafts decide how many tokens a forward yields, never which ones."""
    cols = torch.arange(fed.shape[1] - 1, device=fed.device)
    match = (sampled[:, :-1] == fed[:, 1:]) & (cols[None] < proposed[:, None])
    return match.int().cumprod(1).sum(1)


def _drop_padding(cache: DecodeCache, attention: torch.Tensor) -> torch.Tensor:
    """Drop the leading KV columns no row attends to (attention [B, W]), as when the rows with
    the longest contexts have left: → the attention mask of the columns kept."""
    padding = int(attention.argmax(1).min()) if attention.numel() else 0
    if padding:
        cache.drop_front(padding)
    return attention[:, padding:]


def _staying(finished: torch.Tensor) -> torch.Tensor:
    """The batch rows that stay, as the new row order: row i stays in place, and the slot of a
    finished row among the first B' is taken by a staying row from past B', so only those rows'
    KV has to move (`DecodeCache.keep_rows`)."""
    staying = (~finished).nonzero().squeeze(1)
    keep = torch.arange(len(staying), device=finished.device)
    keep[finished[: len(staying)]] = staying[staying >= len(staying)]
    return keep


def _residual(logprobs: torch.Tensor, rejected: Sequence[int | None]) -> torch.Tensor:
    """logprobs [B, V] with each row's rejected token removed and the rest renormalised."""
    rows = [row for row, token in enumerate(rejected) if token is not None]
    if not rows:
        return logprobs
    residual = logprobs.clone()
    residual[rows, [rejected[row] for row in rows]] = float("-inf")
    residual[rows] = residual[rows].log_softmax(-1)
    return residual


def _uniform_table(seeds: torch.Tensor, first: torch.Tensor, width: int) -> torch.Tensor:
    """seeded_uniform of every row's next `width` positions, from `first` [B] on: [B, width]."""
    positions = first[:, None] + torch.arange(width, device=first.device)
    return seeded_uniform(seeds[:, None].expand_as(positions), positions)


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


class PrefixCache:
    """KV of the sequences the last `score` call computed, so decoding that continues a scored
    sequence (prompt + draft[:k]) does not compute its prefix again, and the sampling
    distributions of their last n + 1 positions, so that its first new token needs no forward
    either (kept when they take no more memory than the KV: small vocabularies). Valid until the
    next `score` or `load_weights`."""

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


class DecodeCache(DynamicCache):
    """The KV cache of a decode loop: a DynamicCache whose layers grow in place."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_class_to_replicate = _GrowingLayer

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Keep batch rows `keep` [B'] (from `_staying`: row i, or a row past B' in its place)."""
        for layer in self.layers:
            layer.keep_rows(keep)

    def drop_front(self, columns: int) -> None:
        """Drop the first `columns` KV columns, which no row attends to."""
        for layer in self.layers:
            layer.drop_front(columns)

    def compact(self, attention: torch.Tensor) -> torch.Tensor:
        """Drop KV columns no row attends to (rejected drafts; `attention` [B, W]): every row's
        attended columns move to the right end in order, the cache narrows to the longest row.
        → the new attention mask [B, W']."""
        width = int(attention.sum(1).max())
        columns = attention.sort(dim=1, stable=True).indices[:, attention.shape[1] - width :]
        for layer in self.layers:
            layer.keep_columns(columns)
        return attention.gather(1, columns)


class _GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers with columns to spare: a decode
    step writes its columns in place, where DynamicLayer concatenates and so copies the whole
    cache every step. Rows leave by moving the last rows into their place (`keep_rows`), leading
    columns by moving the view's start (`drop_front`); keys and values narrowed by `keep_columns`
    move into a new buffer at the next update."""

    spare_columns = 32
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    views: tuple[torch.Tensor, torch.Tensor] | None = None  # what keys and values were set to
    start = 0  # buffer column of the first key

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor, length: int) -> _GrowingLayer:
        """A layer over buffers [B, H, T, D] whose first `length` columns hold the KV."""
        layer = cls()
        layer.lazy_initialization(keys, values)
        layer.buffers = (keys, values)
        layer._view(length)
        return layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        if not self._viewed(self.start + length + key_states.shape[-2]):
            self.buffers = (
                _grown(self.keys, key_states, self.spare_columns),
                _grown(self.values, value_states, self.spare_columns),
            )
            self.start = 0
        begin = self.start + length
        end = begin + key_states.shape[-2]
        keys, values = self.buffers
        keys[:, :, begin:end] = key_states
        values[:, :, begin:end] = value_states
        self._view(end)
        return self.keys, self.values

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Keep batch rows `keep` [B'], where keep[i] is i or a row past B': those rows move into
        the buffers' first B' rows, which then are the buffers."""
        length = self.get_seq_length()
        if not self._viewed(self.start + length):
            self.keys, self.values = self.keys[keep], self.values[keep]
            return
        moved = (keep != torch.arange(len(keep), device=keep.device)).nonzero().squeeze(1)
        for buffer in self.buffers:
            buffer[moved] = buffer[keep[moved]]
        self.buffers = tuple(b[: len(keep)] for b in self.buffers)
        self._view(self.start + length)

    def drop_front(self, columns: int) -> None:
        """Drop the first `columns` KV columns (of every row)."""
        end = self.start + self.get_seq_length()
        viewed = self._viewed(end)
        self.keys, self.values = self.keys[:, :, columns:], self.values[:, :, columns:]
        if viewed:
            self.start += columns
            self._view(end)

    def keep_columns(self, columns: torch.Tensor) -> None:
        """Keep, of row b, KV columns `columns[b]` in order (columns [B, W'])."""
        index = columns[:, None, :, None].expand(-1, self.keys.shape[1], -1, self.keys.shape[3])
        self.keys, self.values = self.keys.gather(2, index), self.values.gather(2, index)
        self.buffers = self.views = None  # the old buffers are not needed any more

    def _view(self, end: int) -> None:
        """Keys and values: the buffers' columns from `start` to `end`."""
        self.keys, self.values = (b[:, :, self.start : end] for b in self.buffers)
        self.views = (self.keys, self.values)

    def _viewed(self, end: int) -> bool:
        """Whether keys and values are still the views `_view` set, with room up to `end`."""
        return (
            self.views is not None
            and self.keys is self.views[0]
            and self.values is self.views[1]
            and end <= self.buffers[0].shape[2]
        )


def _grown(cached: torch.Tensor, new: torch.Tensor, spare: int) -> torch.Tensor:
    """A buffer [B, H, T + T' + spare, D] holding `cached` [B, H, T, D] in its first T columns,
    with room for `new` [B, H, T', D] and `spare` columns after it."""
    batch, heads, length, dim = new.shape
    start = cached.shape[2] if cached.dim() == 4 else 0
    buffer = new.new_empty(batch, heads, start + length + spare, dim)
    if start:
        buffer[:, :, :start] = cached
    return buffer


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _layers_kv(cache: DynamicCache) -> list[torch.Tensor]:
    """[K_0, V_0, K_1, V_1, ...], each [B, heads, T, head_dim]."""
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def _group_by_batch(hits: dict[int, tuple[int, int]]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, (batch, _) in hits.items():
        groups.setdefault(batch, []).append(i)
    return groups


def _merge(
    parts: list[tuple[list[int], list[torch.Tensor], torch.Tensor]],
) -> tuple[DecodeCache, torch.Tensor]:
    """One left-padded cache from row groups of different widths, rows in their original order:
    each group's KV is written once, straight into the decode cache's buffers."""
    width = max(mask.shape[1] for _, _, mask in parts)
    batch = sum(len(rows) for rows, _, _ in parts)
    ref = next(kv for _, kv, _ in parts if kv)
    masks = ref[0].new_zeros(batch, width, dtype=torch.long)
    buffers = [  # zeros: the padding columns are masked, but a masked NaN would still poison
        t.new_zeros(batch, t.shape[1], width + _GrowingLayer.spare_columns, t.shape[3]) for t in ref
    ]
    for rows, kv, mask in parts:
        index = torch.tensor(rows, device=masks.device)
        start = width - mask.shape[1]
        masks[index, start:] = mask
        for buffer, t in zip(buffers, kv, strict=False):  # no KV: rows with nothing to prefill
            buffer[index, :, start:width] = t
    cache = DecodeCache()
    for layer in range(len(buffers) // 2):
        cache.layers.append(_GrowingLayer.of(buffers[2 * layer], buffers[2 * layer + 1], width))
    return cache, masks
