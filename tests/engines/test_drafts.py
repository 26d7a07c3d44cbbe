"""Speculative decoding in the transformers engine: drafts change how many tokens a forward
yields, never which tokens."""

import random

import numpy as np
import pytest
import torch

from specrl.engines import GREEDY, GenRequest, SamplingParams
from specrl.engines.hf import HFEngine
from specrl.engines.hf.kv_cache import DecodeCache
from specrl.speculative.draft_width import DraftWidth
from specrl.speculative.drafting import Drafting
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
        GenRequest(
            PROMPTS[2], 9, sampling, seed=4, prefix_ids=full[:3], excluded_tokens=(full[3],)
        ),
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


def measured(width, per_sequence, per_draft, batches=(1, 4, 16, 64, 256, 512), drafting=0.0):
    """Forwards without drafts, then with one and with two drafts per sequence, costing 1 ms +
    per_sequence per sequence + per_draft per draft position + `drafting` once drafts are
    verified."""
    for k in (0, 1, 2):
        for b in batches:
            cost = 1e-3 + per_sequence * b + per_draft * b * k + drafting * (k > 0)
            width.observe_forward(b, b * (k + 1), cost)


def test_draft_width_speculates_in_the_tail_not_in_a_large_batch():
    width = DraftWidth(8)
    assert width.choose([8, 8]) == 0  # no cost data yet: decode plainly while measuring
    measured(width, 4e-5, 4e-5)  # a draft position costs what a sequence does (transformers)
    assert width.cost() == pytest.approx((1e-3, 4e-5, 4e-5, 0.0))
    width.observe_drafts([8] * 100, [2] * 100)  # α ≈ 2/3
    assert width.choose([8] * 256) == 0  # compute-bound: extra tokens cost more than they yield
    assert width.choose([8]) >= 4  # overhead-bound tail: speculate
    for _ in range(5):  # nothing accepted lately
        width.observe_drafts([8] * 1000, [0] * 1000)
    assert width.accept_rate < 0.05
    assert width.choose([8]) == 0
    assert sum(width.reset_choices().values()) == 4 and not width.choices


def test_draft_width_speculates_in_a_large_batch_when_drafts_cost_less_than_sequences():
    """vLLM on a CPU: most of a step is per request (scheduling, sampling), a draft position
    costs a fraction of that. A model fitted to tokens alone booked the per-request cost to
    every token and never drafted in a full batch."""
    width = DraftWidth(8)
    measured(width, 4e-5, 4e-6)
    width.observe_drafts([8] * 100, [5] * 100)
    assert width.choose([8] * 256) >= 4


def test_draft_width_measures_drafts_before_trusting_their_cost():
    """Until forwards with drafts were seen, every forward with proposals verifies one draft per
    sequence (its cost and the acceptance get measured); once their evidence has decayed, it
    does so again."""
    width = DraftWidth(8)
    for b in (1, 4, 16, 64, 256, 512):
        width.observe_forward(b, b, 1e-3 + 4e-5 * b)
    assert width.cost()[2] is None
    assert width.worthwhile(256) and width.choose([8] * 256) == 1
    assert width.choose([0] * 256) == 0  # nothing proposed: nothing to measure
    width.observe_forward(256, 512, 1e-3 + 8e-5 * 256)  # the draft cost a sequence's worth
    width.observe_drafts([1] * 256, [0] * 256)
    assert width.cost() == pytest.approx((1e-3, 4e-5, 4e-5, 0.0))  # cf: not told from cd yet
    assert width.choose([8] * 256) == 0
    for _ in range(40):
        width.observe_forward(256, 256, 1e-3 + 4e-5 * 256)
    assert width.choose([8] * 256) == 1


def test_ragged_draft_width_charges_only_the_drafts_proposed():
    """A few sequences still on their stored draft in a full batch: on an engine that pads, K
    drafts cost K positions for every sequence; on vLLM only the proposed ones."""
    lengths = [8] * 16 + [0] * 240
    choices = {}
    for ragged in (False, True):
        width = DraftWidth(8, ragged=ragged)
        measured(width, 4e-5, 1e-5)
        width.observe_drafts([8] * 100, [7] * 100)
        choices[ragged] = width.choose(lengths)
    assert choices == {False: 0, True: 8}


def test_draft_width_state_round_trips_and_an_old_checkpoint_restarts_the_cost_fit():
    width = DraftWidth(8)
    measured(width, 4e-5, 4e-6)
    width.observe_drafts([8] * 10, [3] * 10)
    again = DraftWidth(8)
    again.load_state_dict(width.state_dict())
    assert again.cost() == width.cost() and again.accept_rate == width.accept_rate
    old = {"fit": [1.0] * 5, "trials": 20.0, "accepted": 10.0}
    again.load_state_dict(old)
    assert again.cost() is None and again.accept_rate == pytest.approx(11 / 22)
    without_cf = {**width.state_dict(), "cost_sums": np.zeros((3, 4))}
    again.load_state_dict(without_cf)
    assert again.cost() is None


def test_draft_width_charges_the_host_work_of_verifying_drafts():
    """A small model's forwards are host-bound: draft positions cost next to nothing, but a
    forward that proposes, feeds and accepts drafts costs 0.4 ms more (fitted as cf). At the
    accept rate such a policy's trees have early in RL, drafts do not pay even in the tail;
    at a high one they do."""
    width = DraftWidth(8)
    measured(width, 2e-5, 1e-6, batches=(1, 2, 4, 8), drafting=4e-4)
    assert width.cost() == pytest.approx((1e-3, 2e-5, 1e-6, 4e-4))
    width.observe_drafts([8] * 100, [0] * 92 + [1] * 8)  # α ≈ 0.08
    assert not width.worthwhile(2) and width.choose([8, 8]) == 0
    width.observe_drafts([8] * 100, [8] * 100)  # α ≈ 0.9
    assert width.worthwhile(2) and width.choose([8, 8]) >= 4


def test_forwards_without_drafts_leave_the_accept_rate_where_it_was():
    """α is the rate of the last draft tokens decided: a stretch of forwards that verify none
    (K = 0 chosen) does not pull it back towards the prior 1/2, which would verify drafts again
    and again on a policy whose drafts are rarely accepted."""
    width = DraftWidth(8)
    measured(width, 2e-5, 1e-6, batches=(1, 2, 4, 8), drafting=4e-4)
    width.observe_drafts([8] * 100, [0] * 95 + [1] * 5)
    before = width.accept_rate
    for _ in range(50):
        width.observe_drafts([0] * 8, [0] * 8)
        width.observe_forward(8, 8, 1e-3 + 8 * 2e-5)
    assert width.accept_rate == before < 0.1


def test_draft_width_weighs_a_forward_by_the_forwards_accepted_drafts_removed():
    """Tokens per second takes a token accepted among B sequences to remove 1/B of a forward.
    Where the loop's longest sequences ran as long with drafts as without (SmolLM2 early in RL:
    several slots to the response limit), none was removed: a full batch stops drafting, a lone
    sequence, whose every accepted token is a forward less, still drafts. Loops whose drafts
    removed what was assumed bring the full batch's drafts back."""
    width = DraftWidth(8)
    measured(width, 2e-5, 2e-5)
    width.observe_drafts([8] * 100, [1] * 100)  # α ≈ 1/2
    assert width.forward_share == 1.0 and width.choose([8] * 8) >= 1
    for _ in range(5):
        width.observe_loop(48, 48, 10.0)  # ten tokens a sequence accepted, no forward removed
    width.observe_loop(40, 48, 0.0)  # nothing accepted: no evidence either way
    assert width.forward_share == pytest.approx(1 / (1 + 10 * sum(0.8**i for i in range(5))))
    assert width.choose([8] * 8) == 0 and width.choose([8]) >= 1
    again = DraftWidth(8)
    again.load_state_dict(width.state_dict())
    assert again.forward_share == width.forward_share
    for _ in range(20):
        width.observe_loop(38, 48, 10.0)
    assert width.forward_share > 0.95 and width.choose([8] * 8) >= 1


def test_the_decode_loop_reports_the_forwards_its_drafts_removed(engine):
    requests = [GenRequest(p, 16, GREEDY) for p in PROMPTS]
    plain = engine.generate(requests)
    loops = []
    source = drafting([r.token_ids for r in plain])
    source.width.observe_loop = lambda *loop: loops.append(loop)
    drafted = engine.generate_with_drafts(requests, source)
    [(forwards, longest, accepted_per_sequence)] = loops
    assert longest == max(len(r.token_ids) for r in drafted)
    assert forwards == max(r.forwards for r in drafted) < longest
    assert 0 < accepted_per_sequence <= sum(r.accepted_tokens for r in drafted)


def test_draft_width_fits_each_span_of_attended_columns_apart():
    """Static decoding: a forward's cost steps with the columns it attends, and a reuse step's
    forwards (with drafts) attend longer contexts than the plain ones before it. Pooled, that
    step reads as the drafts' cost; fitted per span, each span's forwards price its own K, the
    pooled fit standing in for a span not seen yet (and for the budgets: `cost()`)."""
    spans, pooled = DraftWidth(8), DraftWidth(8)
    for width, wide, narrow in ((spans, 512, 64), (pooled, None, None)):
        for _ in range(3):  # plain forwards over short contexts
            for b in (1, 4, 16, 64):
                width.observe_forward(b, b, 1e-3 + 2e-5 * b, narrow)
        for b in (1, 4, 16, 64):  # a reuse step's, over long ones
            for k in (0, 1, 2):
                width.observe_forward(b, b * (k + 1), 3e-3 + 6e-5 * b + 1e-6 * b * k, wide)
        width.observe_drafts([8] * 100, [2] * 100)  # α ≈ 2/3
    assert spans.cost(512) == pytest.approx((3e-3, 6e-5, 1e-6, 0.0), abs=1e-9)
    assert spans.cost(64) == pytest.approx((1e-3, 2e-5, None, None), abs=1e-9)
    assert spans.cost() == pooled.cost() and spans.cost(128) == pooled.cost()
    assert pooled.cost()[3] > 1e-3  # the long contexts' cost, taken for verifying drafts
    assert spans.choose([8] * 16, 512) == 8 > pooled.choose([8] * 16)
    again = DraftWidth(8)
    again.load_state_dict(spans.state_dict())
    assert again.cost(512) == spans.cost(512) and again.cost() == spans.cost()
