"""Transformers rollout engine: our own decode loop over any local Hugging Face causal LM.

The loop is ours (not `model.generate()`) so that forced prefixes, per-request budgets, seeds and
multi-token verification of draft tokens are under our control (decode.py). This module is the
facade: batching, verification (`logprobs`) and weights. Every capability of the protocol is
implemented: draft decoding, residual sampling, prefix reuse (a `PrefixCache` handle); no sleep
(it shares the trainer's device and usually its model object).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from specrl.engines.accounting import ForwardCounts
from specrl.engines.hf.attention import use_small_query_attention
from specrl.engines.hf.batching import ForwardCost, PassCost, in_batches, width_batches
from specrl.engines.hf.decode import Decoder, left_pad, padded_counts, prefill_counts
from specrl.engines.hf.kv_cache import layers_kv
from specrl.engines.hf.prefix_cache import PrefixCache
from specrl.engines.hf.static_decode import StaticDecode
from specrl.engines.protocol import (
    Capabilities,
    Drafter,
    GenRequest,
    GenResult,
    LogprobRequest,
    TrieLogprobs,
    TrieRequest,
    distinct_requests,
)
from specrl.engines.sampling import RowSampling, sampling_cdf, sampling_logprobs
from specrl.models import planless_attention


class HFEngine:
    """Rollout engine over a transformers model. When it wraps the trainer's own model object the
    weights are shared, so there is nothing to sync after an update."""

    eager_capabilities = Capabilities(
        draft_decoding=True, residual_sampling=True, prefix_reuse=True, trie_verification=True
    )
    logits_budget = 2**26  # most logits one trie pass computes (256 MB in float32)
    # until its verification forwards' costs are fitted (`PassCost`), a verification forward
    # computes at most this much padding; a trie forward's tree attention mask is dense, [W, W]
    # per row, so padding costs it more (verifying recorded tries of the default task: 0.1 took
    # 11% less time than 0.25)
    padding_slack = 0.25
    trie_padding_slack = 0.1

    def __init__(
        self,
        model: PreTrainedModel,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        max_batch_size: int = 512,
        static_decode: bool = False,
        fitted_batching: bool = True,
    ) -> None:
        self.model = model
        use_small_query_attention(model)  # drafts' few columns by matmul on the CPU
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.counts = ForwardCounts()
        # what its verification batches cost (batching.py); without `fitted_batching` they are
        # grouped within the padding slacks alone, whatever the timings
        self.verify_cost = PassCost()
        self.fitted_batching = fitted_batching
        # decoding at static shapes, drafts included, on CUDA as CUDA graphs (static_decode.py)
        self.static = StaticDecode(model, pad_token_id, self.counts) if static_decode else None

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

    @property
    def capabilities(self) -> Capabilities:
        """With static decoding on CUDA, decode forwards are graph replays."""
        graphs = self.static is not None and self.device.type == "cuda"
        return replace(self.eager_capabilities, graph_decoding=graphs)

    def new_prefixes(self) -> PrefixCache:
        return PrefixCache()

    def generate(
        self, requests: Sequence[GenRequest], prefixes: PrefixCache | None = None
    ) -> list[GenResult]:
        return self._decode(requests, Decoder(*self._decoder_args(), prefixes, static=self.static))

    def generate_with_drafts(
        self,
        requests: Sequence[GenRequest],
        drafter: Drafter,
        prefixes: PrefixCache | None = None,
    ) -> list[GenResult]:
        return self._decode(
            requests, Decoder(*self._decoder_args(), prefixes, drafter, self.static)
        )

    def _decoder_args(self) -> tuple:
        return self.forward, self.counts, self.eos_token_ids, self.pad_token_id, self.device

    @torch.inference_mode()
    def _decode(self, requests: Sequence[GenRequest], decoder: Decoder) -> list[GenResult]:
        # Longest contexts first: similar lengths share a batch, so little padding is computed.
        order = sorted(
            range(len(requests)),
            key=lambda i: -len(requests[i].prompt_ids) - len(requests[i].prefix_ids),
        )
        results: list[GenResult | None] = [None] * len(requests)
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start : start + self.max_batch_size]
            batch = decoder.decode([requests[i] for i in chunk], chunk)
            for i, result in zip(chunk, batch, strict=True):
                results[i] = result
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def logprobs(
        self, requests: Sequence[LogprobRequest], prefixes: PrefixCache | None = None
    ) -> list[torch.Tensor]:
        """One forward pass per batch of distinct sequences of similar widths (`width_batches`:
        as many forwards as the engine's verification forwards' fitted costs say pay, of at most
        `max_batch_size` rows). Identical requests (the n slots of a prompt often hold the same
        draft) are computed once. With `prefixes`, the KV of every verified sequence is kept
        there for `generate`."""
        distinct, where = distinct_requests(requests)
        widths = [len(r.context_ids) + len(r.target_ids) for r in distinct]
        kept = [len(r.target_ids) + 1 for r in distinct]
        batches = width_batches(
            widths,
            [(tuple(r.context_ids), tuple(r.target_ids)) for r in distinct],
            self.max_batch_size,
            self.padding_slack,
            kept=kept,
            cost=self._batching_cost(),
        )
        verified = in_batches(
            distinct, batches, lambda b: self._logprob_batch(b, prefixes), self.verify_cost,
            widths, kept,
        )  # fmt: skip
        return [verified[i] for i in where]

    def _batching_cost(self) -> ForwardCost | None:
        return self.verify_cost.fit() if self.fitted_batching else None

    def _logprob_batch(
        self, requests: Sequence[LogprobRequest], prefixes: PrefixCache | None
    ) -> list[torch.Tensor]:
        sequences = [list(r.context_ids) + list(r.target_ids) for r in requests]
        ids, attention = left_pad(sequences, self.pad_token_id, self.device)  # [B, T]
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache() if prefixes is not None else None
        # Targets are right-aligned: the logits at column t predict the token at column t + 1, so
        # only the last n + 1 columns need logits (the prompts' columns only need their KV); the
        # last one predicts the token after the sequence.
        n = max(len(r.target_ids) for r in requests)
        logits = self.forward("verify", ids, attention, positions, cache, keep=n + 1)
        self.counts.record("verify", *prefill_counts(attention), computed=padded_counts(attention))
        sampling = RowSampling.of([r.sampling for r in requests], self.device).repeat(n + 1)
        distributions = sampling_logprobs(logits.reshape(-1, logits.shape[-1]), sampling)
        distributions = distributions.view(len(requests), n + 1, -1)  # [B, n + 1, V]
        if prefixes is not None:
            kv = layers_kv(cache)
            kept = distributions if _nbytes([distributions]) <= _nbytes(kv) else None
            prefixes.add(sequences, kv, attention, kept, [r.sampling for r in requests])
        logprobs = distributions[:, :-1].gather(2, ids[:, -n:, None]).squeeze(2)  # [B, n]
        return [
            row[n - len(r.target_ids) :].cpu() for row, r in zip(logprobs, requests, strict=True)
        ]

    @torch.inference_mode()
    def verify_tries(
        self, requests: Sequence[TrieRequest], prefixes: PrefixCache | None = None
    ) -> list[TrieLogprobs]:
        """Every trie in one forward with a tree attention mask, in batches of tries of similar
        sizes (`width_batches`, as for `logprobs`), of at most `logits_budget` logits. With
        `prefixes`, the KV of every node (and its distribution, when small) is kept there for
        `generate`."""
        vocab = self.model.config.get_text_config().vocab_size
        widths = [len(r.prompt_ids) + len(r.tokens) for r in requests]
        kept = [len(r.tokens) + 1 for r in requests]
        batches = width_batches(
            widths,
            [(tuple(r.prompt_ids), tuple(r.tokens), tuple(r.parents)) for r in requests],
            self.max_batch_size,
            self.trie_padding_slack,
            self.logits_budget // vocab,
            kept,
            self._batching_cost(),
        )
        return in_batches(
            requests, batches, lambda b: self._trie_batch(b, prefixes), self.verify_cost,
            widths, kept,
        )  # fmt: skip

    def _trie_batch(
        self, requests: Sequence[TrieRequest], prefixes: PrefixCache | None
    ) -> list[TrieLogprobs]:
        ids, mask, positions, attention = tree_inputs(
            [(r.prompt_ids, r.parents, r.tokens) for r in requests], self.pad_token_id
        )
        ids, positions, attention = (t.to(self.device) for t in (ids, positions, attention))
        dtype = self.model.dtype
        bias = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, torch.finfo(dtype).min)
        cache = DynamicCache() if prefixes is not None else None
        most = max(len(r.tokens) for r in requests)
        # the last prompt column and every node column: their logits give the distribution
        # after the root and after each node
        bias = bias[:, None].to(self.device)
        logits = self.forward("verify", ids, bias, positions, cache, keep=most + 1)
        pairs = int((mask & attention.bool()[:, :, None].cpu()).sum())
        real = attention.sum(1)
        self.counts.record(
            "verify", len(requests), int(real.sum()), int(real.sum()), pairs,
            computed=padded_counts(attention),
        )  # fmt: skip
        kv = layers_kv(cache) if prefixes is not None else []
        # the prefix cache keeps every node's distribution (decoding's first token after any
        # node) when they take no more memory than the KV; otherwise only the distributions the
        # walks read are computed: after the root and after each node with a child
        keep_all = bool(kv) and logits.numel() * torch.float32.itemsize <= _nbytes(kv)
        reads = [
            range(len(r.tokens) + 1) if keep_all else sorted({0, *r.parents}) for r in requests
        ]
        # trie b's node i has its logits at column most - N_b + i of row b
        starts = [b * (most + 1) + most - len(r.tokens) for b, r in enumerate(requests)]
        columns = [start + i for start, read in zip(starts, reads, strict=True) for i in read]
        device = logits.device
        at = logits.flatten(0, 1).index_select(0, torch.tensor(columns, device=device))
        sizes = [len(read) for read in reads]
        rows = RowSampling.of([r.sampling for r in requests], device)
        # [R, V]: the read nodes' distributions, trie after trie (kept: padded to [B, N + 1, V])
        distributions = sampling_logprobs(at, rows.repeat(torch.tensor(sizes, device=device)))
        out = trie_logprobs(distributions, [(r.parents, r.tokens) for r in requests], reads)
        if prefixes is not None:
            keep = pad_sequence(distributions.split(sizes), batch_first=True) if keep_all else None
            tries = [(r.prompt_ids, r.parents, r.tokens) for r in requests]
            prefixes.add_tries(tries, kv, attention, keep, [r.sampling for r in requests])
        return out

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy new weights in (nothing to copy for tensors that already are the engine's, as when
        it wraps the trainer's model)."""
        params = self.model.state_dict(keep_vars=True)  # tied weights appear under each name
        with torch.no_grad():
            for name, tensor in state.items():
                if name not in params:
                    raise KeyError(f"engine model has no parameter {name!r}")
                if params[name].data_ptr() != tensor.data_ptr():
                    params[name].copy_(tensor)

    def forward(
        self,
        kind: str,
        ids: torch.Tensor,
        attention: torch.Tensor,
        positions: torch.Tensor,
        cache: DynamicCache | None,
        keep: int = 0,
    ) -> torch.Tensor:
        """Logits [B, T, V] of the last `keep` columns (0: all of them), the forward's seconds
        counted under `kind` (on a GPU once its kernels have run: the loop reads the logits
        right after anyway). Attention without per-shape plans: widths change every forward."""
        started = time.perf_counter()
        with planless_attention():
            logits = self.model(
                input_ids=ids,
                attention_mask=attention,
                position_ids=positions,
                past_key_values=cache,
                use_cache=cache is not None,
                logits_to_keep=keep,
            ).logits
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        self.counts.add_seconds(kind, time.perf_counter() - started)
        return logits


def tree_inputs(
    tries: Sequence[tuple[Sequence[int], Sequence[int], Sequence[int]]], pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of (prompt ids, parents, tokens) tries as one forward's inputs, each row the
    prompt then the nodes, right-aligned: → ids [B, W], which columns each column attends to
    [B, W, W] (causal over the prompt; a node: the prompt, its ancestors and itself; padding:
    itself), positions [B, W] (a node's: prompt length + depth − 1, as when decoding its path)
    and the real columns [B, W]."""
    width = max(len(p) + len(t) for p, _, t in tries)
    batch = len(tries)
    ids = np.full((batch, width), pad, dtype=np.int64)
    prompt = np.zeros((batch, width), dtype=bool)  # the prompt's columns
    node = np.zeros((batch, width), dtype=bool)  # the nodes' columns
    # a node's parent's column (flat over the batch); the column itself for the rest
    up = np.arange(batch * width).reshape(batch, width)
    for b, (prompt_ids, parents, tokens) in enumerate(tries):
        n, p = len(tokens), len(prompt_ids)
        start = width - n - p  # first prompt column
        ids[b, start:] = [*prompt_ids, *tokens]
        prompt[b, start : start + p] = True
        node[b, start + p :] = True
        parent = np.asarray(parents, dtype=np.int64)
        up[b, start + p :] = np.where(
            parent > 0, b * width + start + p - 1 + parent, up[b, start + p :]
        )
    mask = np.tri(width, dtype=bool)[None] & prompt[:, None, :] & (prompt | node)[:, :, None]
    mask[:, np.arange(width), np.arange(width)] = True
    rows, up = mask.reshape(batch * width, width), up.reshape(-1)
    while True:  # pointer doubling: after k rounds a column sees 2^k - 1 ancestors up
        rows |= rows[up]
        higher = up[up]
        if (higher == up).all():
            break
        up = higher
    depth = (mask & node[:, None, :]).sum(2)  # a node's ancestors and itself
    positions = np.where(prompt, prompt.cumsum(1) - 1, 0)
    positions += np.where(node, prompt.sum(1, keepdims=True) - 1 + depth, 0)
    real = torch.from_numpy(prompt | node).long()
    return torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(positions), real


def trie_logprobs(
    distributions: torch.Tensor,
    tries: Sequence[tuple[Sequence[int], Sequence[int]]],
    reads: Sequence[Sequence[int]],
) -> list[TrieLogprobs]:
    """The sampler's view of a batch of (parents, tokens) tries (the arithmetic of
    `sample_from_logprobs`) from the distributions after the nodes each trie's walks read, trie
    after trie [R, V] (`reads[b]`: ascending, the root and every parent among them, or all nodes).
    Each CDF is computed where the distributions are; the intervals leave it in one copy. A node
    without a child has no interval to walk into: its total is NaN where it was not read."""
    nodes = [len(tokens) + 1 for _, tokens in tries]
    parent_rows = []  # per trie, per node (root first): the row of its parent's distribution
    for (parents, _), read in zip(tries, reads, strict=True):
        row = np.zeros(len(parents) + 1, dtype=np.int64)
        row[read] = np.arange(len(read))
        parent_rows.append(row[[0, *parents]])
    device = distributions.device
    parent = torch.from_numpy(np.concatenate(parent_rows)).to(device)
    token = torch.tensor([t for _, tokens in tries for t in (0, *tokens)], device=device)
    parts = []
    for rows, up, at in zip(
        distributions.split([len(read) for read in reads]),
        parent.split(nodes),
        token.split(nodes),
        strict=True,
    ):
        cdf = sampling_cdf(rows)  # one trie's at a time: [len(read), V] in float64
        low = torch.where(at > 0, cdf[up, (at - 1).clamp(min=0)], 0.0)
        parts += [rows[up, at].double(), low, cdf[up, at], cdf[:, -1]]
    values = torch.cat(parts).cpu().numpy()
    out, start = [], 0
    for n, read in zip(nodes, reads, strict=True):
        logprobs, low, high = (values[start + k * n : start + (k + 1) * n] for k in range(3))
        start += 3 * n
        total = np.full(n, np.nan)
        total[read] = values[start : start + len(read)]
        start += len(read)
        out.append(TrieLogprobs(logprobs.astype(np.float32), low, high, total))
    return out


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
