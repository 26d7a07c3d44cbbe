"""vLLM's outputs read as specrl's logprobs: of sampled and verified tokens from vLLM's flat
logprobs, whole processed distributions as rows, and a trie's logprobs (`TrieLogprobs`) from the
prompt logprobs of its root-to-leaf paths. Plain functions over vLLM's output objects; nothing here
imports vllm."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from specrl.engines.protocol import LogprobRequest, SamplingParams, TrieLogprobs, TrieRequest
from specrl.engines.sampling import RowSampling, sampling_logprobs

if TYPE_CHECKING:
    from vllm.logprobs import FlatLogprobs


def untransformed(sampling: SamplingParams) -> bool:
    """Whether vLLM's raw prompt logprobs are already the sampling distribution's."""
    return sampling.temperature == 1.0 and sampling.top_p == 1.0 and sampling.top_k == 0


def trie_paths(parents: Sequence[int]) -> list[list[int]]:
    """The root-to-leaf paths of a trie (node i, 1..N, under `parents[i - 1]`), as node lists."""
    nodes = len(parents)
    inner = set(parents)
    paths = []
    for leaf in (v for v in range(1, nodes + 1) if v not in inner):
        path = [leaf]
        while parents[path[-1] - 1] != 0:
            path.append(parents[path[-1] - 1])
        paths.append(path[::-1])
    return paths


def sibling_intervals(logprobs: np.ndarray, parents: Sequence[int]) -> TrieLogprobs:
    """Uncoupled trie logprobs: under each node its children's intervals lie end to end from 0, child
    c's as long as p(c), and every total is 1."""
    probs = np.exp(logprobs)
    low, high = np.zeros(len(probs)), np.zeros(len(probs))
    filled = np.zeros(len(probs))  # the mass laid out under each node so far
    for child, parent in enumerate(parents, start=1):
        low[child] = filled[parent]
        high[child] = filled[parent] = low[child] + probs[child]
    return TrieLogprobs(logprobs, low, high, np.ones(len(probs)), coupled=False)


def verified_logprobs(
    requests: Sequence[LogprobRequest], outputs: Sequence, vocab_size: int
) -> list[torch.Tensor]:
    """Each request's target logprobs from vLLM's outputs for context + targets: read directly
    where vLLM's raw prompt logprobs are the sampling distribution's (`untransformed`: vLLM
    was asked for the targets' only), else from the whole rows put through the request's
    temperature / top-k / top-p. A request that read the prefix cache has no logprobs where the
    cache spared the logits (vLLM leaves the first `num_cached_tokens` positions unwritten):
    those targets are NaN."""
    verified = []
    for r, out in zip(requests, outputs, strict=True):
        n = len(r.target_ids)
        first = len(out.prompt_token_ids) - n
        spared = min(n, max(0, (out.num_cached_tokens or 0) + 1 - first))  # targets with none
        targets = list(r.target_ids)[spared:]
        if not targets:
            computed = torch.zeros(0)
        elif untransformed(r.sampling):
            computed = torch.tensor(target_logprobs(out.prompt_logprobs, first + spared, targets))
        else:
            raw = logprob_rows(out.prompt_logprobs, first + spared, len(targets), vocab_size)
            rows = RowSampling.of([r.sampling], raw.device).repeat(len(targets))
            logprobs = sampling_logprobs(raw, rows)
            computed = logprobs.gather(1, torch.tensor(targets)[:, None]).squeeze(1)
        verified.append(torch.cat([torch.full((spared,), float("nan")), computed]))
    return verified


def tries_as_paths(
    requests: Sequence[TrieRequest],
    verify: Callable[[list[LogprobRequest], bool], list[torch.Tensor]],
    cache_block: int = 0,
) -> list[TrieLogprobs]:
    """Each trie verified as its root-to-leaf paths, one prompt-logprobs request each (`verify`
    verifies a list of them in one call, reading the prefix cache or not; NaN where the cache
    spared a logprob), every node's logprob after its parent read off a path through it;
    uncoupled intervals (`sibling_intervals`).

    A trie where some path shares a block of the prefix cache (`cache_block` tokens: its prompt
    and the nodes it shares) with the trie's heaviest path (`heaviest_path`) is verified in
    waves, so that what its paths share is computed once: the heaviest path whole, then its
    other paths reading the cache (vLLM computes each from the first block it has not cached;
    the first wave gave the logprobs of what it skips), then, whole, a path through each node
    still without a logprob (one that leaves the heaviest path just after a block boundary).
    The other tries go in the first wave whole, as one call: nothing of theirs is cacheable."""
    paths = [trie_paths(r.parents) for r in requests]
    first = [heaviest_path(r.parents, trie) for r, trie in zip(requests, paths, strict=True)]
    found = [np.full(len(r.tokens) + 1, np.nan) for r in requests]
    for node_logprobs in found:
        node_logprobs[0] = 0.0  # the root: no token

    def wave(chosen: list[tuple[int, list[int]]], read_cache: bool) -> None:
        asked = [
            LogprobRequest(requests[t].prompt_ids, [requests[t].tokens[v - 1] for v in path],
                           requests[t].sampling)
            for t, path in chosen
        ]  # fmt: skip
        for (t, path), logprobs in zip(chosen, verify(asked, read_cache), strict=True):
            for v, logprob in zip(path, logprobs.double().numpy(), strict=True):
                if np.isnan(found[t][v]):
                    found[t][v] = logprob

    def shares_a_block(t: int) -> bool:
        on_first = set(paths[t][first[t]])
        prompt = len(requests[t].prompt_ids)
        return any(
            prompt + len(on_first.intersection(path)) >= cache_block
            for i, path in enumerate(paths[t])
            if i != first[t]
        )

    in_waves = {t for t in range(len(requests)) if cache_block and shares_a_block(t)}
    wave([(t, trie[first[t]]) for t, trie in enumerate(paths) if t in in_waves] + [
        (t, path) for t, trie in enumerate(paths) if t not in in_waves for path in trie
    ], read_cache=False)  # fmt: skip
    wave(
        [(t, path) for t in sorted(in_waves) for i, path in enumerate(paths[t]) if i != first[t]],
        read_cache=True,
    )
    missing = []
    for t in sorted(in_waves):
        uncovered = {v for path in paths[t] for v in path if np.isnan(found[t][v])}
        for path in paths[t]:
            if uncovered & set(path):
                missing.append((t, path))
                uncovered -= set(path)
    wave(missing, read_cache=False)
    return [
        sibling_intervals(node_logprobs, r.parents)
        for node_logprobs, r in zip(found, requests, strict=True)
    ]


def heaviest_path(parents: Sequence[int], paths: list[list[int]]) -> int:
    """Which of a trie's `paths` runs from the root through the child with the most leaves
    under it at every node: the path the others share most with."""
    leaves = np.zeros(len(parents) + 1, dtype=np.int64)
    for path in paths:
        leaves[path] += 1
    return max(range(len(paths)), key=lambda i: leaves[paths[i]].tolist())


def sampled_logprobs(token_ids: Sequence[int], logprobs: FlatLogprobs | None) -> list[float]:
    if logprobs is None:
        return [0.0] * len(token_ids)
    return target_logprobs(logprobs, 0, token_ids)


def target_logprobs(flat: FlatLogprobs, first: int, token_ids: Sequence[int]) -> list[float]:
    """The logprobs of `token_ids` at positions `first`, `first + 1`, ... of vLLM's flat
    logprobs, where each position lists its own token first."""
    starts = flat.start_indices[first : first + len(token_ids)]
    if [flat.token_ids[s] for s in starts] != list(token_ids):
        raise RuntimeError("vLLM's logprobs do not start with each position's token")
    return [flat.logprobs[s] for s in starts]


def logprob_rows(flat: FlatLogprobs, first: int, n: int, vocab_size: int) -> torch.Tensor:
    """Positions `first` .. `first + n - 1` of vLLM's flat logprobs (every token: `logprobs` or
    `prompt_logprobs` -1) as an [n, vocab] tensor; -inf where vLLM listed nothing."""
    starts = torch.tensor(flat.start_indices[first : first + n])
    ends = torch.tensor(flat.end_indices[first : first + n])
    lo, hi = int(starts[0]), int(ends[-1])
    rows = torch.repeat_interleave(torch.arange(n), ends - starts)
    out = torch.full((n, vocab_size), float("-inf"))
    out[rows, torch.tensor(flat.token_ids[lo:hi])] = torch.tensor(flat.logprobs[lo:hi])
    return out
