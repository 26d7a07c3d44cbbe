"""Tries verified on vLLM as root-to-leaf paths (`tries_as_paths`), against a stand-in for
vLLM's prompt-logprobs requests that keeps a block prefix cache as vLLM does: a request that
reads it is computed from the first block it has not cached, with no logprobs before that
(vllm 0.32 leaves them unwritten; tests/engines/test_vllm.py runs the real engine). Needs no
vllm."""

import math

import numpy as np
import torch

from specrl.engines import LogprobRequest, SamplingParams, TrieRequest
from specrl.engines.vllm.outputs import tries_as_paths

BLOCK = 8


class PrefixCachedLogprobs:
    """Prompt logprobs of requests, a deterministic function of each token's context; blocks of
    `BLOCK` tokens of every computed sequence are cached once a call ends (requests of one call
    are scheduled together and cannot read each other's blocks)."""

    def __init__(self) -> None:
        self.cached: set[tuple[int, ...]] = set()
        self.computed = 0  # positions computed

    def __call__(self, requests: list[LogprobRequest], read_cache: bool) -> list[torch.Tensor]:
        out, written = [], set()
        for r in requests:
            seq = (*r.context_ids, *r.target_ids)
            hit = 0
            while read_cache and hit + BLOCK < len(seq) and seq[: hit + BLOCK] in self.cached:
                hit += BLOCK
            self.computed += len(seq) - hit
            first = len(r.context_ids)
            out.append(
                torch.tensor(
                    [
                        math.nan if first + j < hit + 1 else _logprob(seq[: first + j], token)
                        for j, token in enumerate(r.target_ids)
                    ]
                )
            )
            written |= {seq[:end] for end in range(BLOCK, len(seq) + 1, BLOCK)}
        self.cached |= written
        return out


def _logprob(context: tuple[int, ...], token: int) -> float:
    return -1.0 - (hash((context, token)) % 1000) / 1000


def trie(prompt: list[int]) -> TrieRequest:
    """Four paths: two share their first three nodes, one leaves at the first node (just after
    the prompt, which is one block long: a request reading the cache cannot compute it), one at
    the second."""
    parents = [0, 1, 2, 3, 3, 0, 6, 1, 8]
    tokens = [3, 4, 5, 6, 7, 8, 9, 4, 2]
    return TrieRequest(prompt, parents, tokens, SamplingParams(1.0))


def test_waves_compute_shared_prefixes_once_and_every_node_gets_its_logprob():
    requests = [trie([2] * BLOCK), trie([5, 6] * BLOCK), trie([7, 8, 9])]  # the last: no block
    whole, waved = PrefixCachedLogprobs(), PrefixCachedLogprobs()
    expected = tries_as_paths(requests, whole)  # every path computed whole
    got = tries_as_paths(requests, waved, cache_block=BLOCK)
    for a, b in zip(expected, got, strict=True):
        assert not np.isnan(b.logprobs).any()
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        np.testing.assert_array_equal(a.low, b.low)
        np.testing.assert_array_equal(a.high, b.high)
    # whole: every path's prompt and nodes (4 paths of 4, 4, 2 and 3 nodes); in waves, of the
    # tries with 8- and 16-token prompts: the first path whole, the other three after the
    # prompt's blocks, and again whole the path that leaves at the first node (its first node
    # is where a cached block ends)
    assert whole.computed == 4 * (8 + 16 + 3) + 3 * (4 + 4 + 2 + 3)
    assert waved.computed == (8 + 4) + 9 + (8 + 2) + (16 + 4) + 9 + (16 + 2) + 4 * 3 + 13


def test_a_short_prompts_trie_goes_in_waves_where_its_paths_share_a_block():
    """A prompt shorter than a block, and three responses that share six tokens before they part:
    prompt and shared tokens fill a block, which the second and third paths read from the cache."""
    parents = [0, 1, 2, 3, 4, 5, 6, 7, 6, 9, 6, 11]
    tokens = [3, 4, 5, 6, 7, 8, 2, 3, 4, 5, 6, 7]
    request = TrieRequest([7, 8, 9, 10, 11], parents, tokens, SamplingParams(1.0))
    whole, waved = PrefixCachedLogprobs(), PrefixCachedLogprobs()
    expected = tries_as_paths([request], whole)[0]
    got = tries_as_paths([request], waved, cache_block=BLOCK)[0]
    assert not np.isnan(got.logprobs).any()
    np.testing.assert_array_equal(expected.logprobs, got.logprobs)
    assert whole.computed == 3 * (5 + 8)
    assert waved.computed == (5 + 8) + 2 * (
        5 + 8 - BLOCK
    )  # the paths after the first: past the block


def test_the_first_wave_takes_the_path_the_others_share_most_with():
    """Waves start from the heaviest path: at each node, into the child with the most leaves
    under it (here the second child of the root, under which two of the three leaves lie)."""
    from specrl.engines.vllm.outputs import heaviest_path, trie_paths

    parents = [0, 0, 2, 3, 3]
    paths = trie_paths(parents)
    assert paths == [[1], [2, 3, 4], [2, 3, 5]]
    assert heaviest_path(parents, paths) == 1
