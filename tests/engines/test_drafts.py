"""Speculative decoding in the transformers engine: drafts change how many tokens a forward
yields, never which tokens."""

import random

import pytest
import torch

from specrl.engines import GREEDY, GenRequest, SamplingParams
from specrl.engines.hf import HFEngine
from specrl.engines.hf.kv_cache import DecodeCache
from specrl.speculative.drafting import Drafting, DraftWidth
from tests.conftest import EOS, PAD, make_tiny_model

PROMPTS = [[3, 4, 5], [6, 7], [2, 3, 4, 5, 6, 7], [8], [9, 10, 11]]


class ScriptedDrafts:
    """Proposes the continuation of a reference response while the sequence follows it, random
    tokens otherwise (rejected most of the time)."""

    def __init__(self, references, vocab, seed=0):
        self.references = references
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.finished_with = {}

    def propose(self, request, new_tokens, max_tokens):
        ref = self.references[request]
        if list(ref[: len(new_tokens)]) == list(new_tokens) and len(ref) > len(new_tokens):
            return list(ref[len(new_tokens) : len(new_tokens) + max_tokens])
        return [self.rng.randrange(self.vocab) for _ in range(max_tokens)]

    def finished(self, request, new_tokens):
        self.finished_with[request] = list(new_tokens)


def drafting(references, k=4, vocab=12):
    return Drafting(ScriptedDrafts(references, vocab), DraftWidth(k, adaptive=False))


def test_greedy_with_drafts_equals_greedy_without(engine):
    requests = [GenRequest(p, 16, GREEDY) for p in PROMPTS]
    plain = engine.generate(requests)
    # own outputs for some requests (accepted), another model's for the rest (mostly rejected)
    other = HFEngine(make_tiny_model(seed=3), [EOS], PAD).generate(requests)
    references = [r.token_ids for r in plain[:3]] + [r.token_ids for r in other[3:]]
    source = drafting(references)
    drafted = engine.generate_with_drafts(requests, source)
    for a, b in zip(plain, drafted, strict=True):
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    for r in drafted[:3]:  # drafts of its own output are all accepted
        assert r.accepted_tokens == r.draft_tokens > 0
        assert r.forwards < len(r.token_ids)
    assert sum(r.draft_tokens - r.accepted_tokens for r in drafted) > 0  # some were rejected
    assert source.source.finished_with == {i: r.token_ids for i, r in enumerate(drafted)}


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(1.0), SamplingParams(0.8, top_p=0.7), SamplingParams(1.2, top_k=3)],
    ids=["plain", "top_p", "top_k"],
)
def test_sampled_tokens_do_not_change_with_drafts(sampling):
    engine = HFEngine(make_tiny_model(seed=0, init=1.0), [EOS], PAD)
    requests = [GenRequest(p, 20, sampling, seed=100 + i) for i, p in enumerate(PROMPTS * 4)]
    plain = engine.generate(requests)
    # drafts: the same policy's samples under other seeds, so some tokens agree and some do not
    other = engine.generate([GenRequest(r.prompt_ids, 20, sampling, seed=7) for r in requests])
    drafted = engine.generate_with_drafts(requests, drafting([r.token_ids for r in other], k=6))
    for a, b in zip(plain, drafted, strict=True):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    accepted = sum(r.accepted_tokens for r in drafted)
    assert 0 < accepted < sum(r.draft_tokens for r in drafted)


def test_first_token_residual_and_forced_prefix_with_drafts(engine):
    sampling = SamplingParams(1.0)
    full = engine.generate([GenRequest(PROMPTS[2], 12, sampling, seed=4)])[0].token_ids
    requests = [
        GenRequest(PROMPTS[2], 9, sampling, seed=4, prefix_ids=full[:3], excluded_token=full[3]),
        GenRequest(PROMPTS[0], 9, sampling, seed=5, prefix_ids=full[:2]),
    ]
    plain = engine.generate(requests)
    drafted = engine.generate_with_drafts(requests, drafting([full[3:], full[2:]]))
    assert [r.token_ids for r in plain] == [r.token_ids for r in drafted]
    assert drafted[0].token_ids[0] != full[3]


def test_rejected_draft_columns_are_dropped_from_the_cache(engine, monkeypatch):
    """Junk drafts of 8 tokens per forward: most columns are rejected, the cache is compacted
    several times, and the output is still that of decoding without drafts."""
    calls = []
    compact = DecodeCache.compact
    monkeypatch.setattr(DecodeCache, "compact", lambda *a: calls.append(1) or compact(*a))
    requests = [GenRequest(p, 60, SamplingParams(1.0), seed=i) for i, p in enumerate(PROMPTS)]
    plain = engine.generate(requests)
    drafted = engine.generate_with_drafts(requests, drafting([[]] * len(PROMPTS), k=8))
    assert [r.token_ids for r in plain] == [r.token_ids for r in drafted]
    assert len(calls) >= 2


def test_draft_width_speculates_in_the_tail_not_in_a_large_batch():
    width = DraftWidth(8)
    assert width.choose([8, 8]) == 0  # no cost data yet: decode plainly while measuring
    for tokens in (1, 4, 16, 64, 256, 512):  # a forward costs 1 ms + 40 µs per token
        width.observe_forward(tokens, 1e-3 + 4e-5 * tokens)
    c0, c1 = width.cost()
    assert c0 == pytest.approx(1e-3) and c1 == pytest.approx(4e-5)
    width.observe_drafts([8] * 100, [2] * 100)  # α ≈ 2/3
    assert width.choose([8] * 256) == 0  # compute-bound: extra tokens cost more than they yield
    assert width.choose([8]) >= 4  # overhead-bound tail: speculate
    for _ in range(5):  # nothing accepted lately
        width.observe_drafts([8] * 1000, [0] * 1000)
    assert width.acceptance < 0.05
    assert width.choose([8]) == 0
    assert sum(width.reset_choices().values()) == 4 and not width.choices
