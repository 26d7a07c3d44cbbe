import math

import pytest
import torch
from scipy.stats import chisquare

from specrl.config import SpecConfig, TreeConfig
from specrl.engines import GREEDY, Capabilities, LogprobRequest, SamplingParams
from specrl.engines.hf import HFEngine
from specrl.errors import UserError
from specrl.rollouts import sample_rollouts
from specrl.speculative.reuse.budget import DraftBudget
from specrl.speculative.stage import SpeculativeStage
from specrl.types import Example, Prompt, Rollout
from tests.conftest import EOS, PAD, make_tiny_model
from tests.speculative.distributions import distribution_pvalue, target_and_drafter
from tests.speculative.prices import DraftPrices

PROMPTS = [Prompt(ids, Example(str(ids), "", "test")) for ids in [(3, 4, 5), (6, 7), (2, 8, 9, 10)]]
SAMPLING = SamplingParams(1.0)
R = 10
NO_TREE = TreeConfig(enabled=False)  # SPEC-RL prefix reuse alone; tree drafts: test_tree.py


def stage(engine, **spec):
    """Per-slot drafts verified whole: the budget, which decides from timings, is tested on its
    own (below)."""
    spec = {"verify_budget": False, **spec}
    return SpeculativeStage(
        engine, SAMPLING, R, SpecConfig(enabled=True, reuse="slot", tree=NO_TREE, **spec)
    )


def tokens(rollouts):
    return [r.token_ids for r in rollouts]


def test_first_time_prompts_fall_back_to_vanilla(engine):
    spec, stats = stage(engine)(PROMPTS, 2, ("s", 1), 1)
    assert tokens(spec) == tokens(sample_rollouts(engine, PROMPTS, 2, SAMPLING, R, ("s", 1), 1))
    assert stats.drafts == 0 and stats.reused_tokens == 0
    assert stats.store_entries == 6 and stats.decoded_tokens == stats.response_tokens


def test_minus_infinite_lenience_reuses_nothing_and_equals_vanilla(engine):
    rollout = stage(engine, acceptance="specrl", log_lenience=-math.inf)
    first, _ = rollout(PROMPTS, 2, ("s", 1), 1)
    second, stats = rollout(PROMPTS, 2, ("s", 2), 2)
    # rollouts the lenient rule drafted say so: behaviour logprobs (here the current ones: ℓ = 0
    # reuses nothing); without a draft they are the policy's samples
    assert all(r.behaviour_logprobs is None for r in first)
    for r in second:
        assert r.behaviour_logprobs == pytest.approx(r.current_logprobs, abs=1e-9)
    assert tokens(second) == tokens(sample_rollouts(engine, PROMPTS, 2, SAMPLING, R, ("s", 2), 2))
    assert stats.drafts == len(second) and stats.reused_tokens == 0


def test_infinite_lenience_reuses_every_draft_whole(engine):
    rollout = stage(engine, acceptance="specrl", log_lenience=math.inf)
    first, _ = rollout(PROMPTS, 2, ("s", 1), 1)
    second, stats = rollout(PROMPTS, 2, ("s", 2), 2)
    assert tokens(second) == tokens(first)
    assert stats.fully_reused == len(second) and stats.decoded_tokens == 0
    assert stats.reused_tokens == stats.response_tokens > 0
    # reused tokens carry the current policy's logprobs (from verification)
    scored = engine.logprobs([LogprobRequest(r.prompt.ids, r.token_ids, SAMPLING) for r in second])
    for r, s in zip(second, scored, strict=True):
        assert torch.allclose(torch.tensor(r.current_logprobs), s, atol=1e-5)


def test_drafts_are_found_by_prompt_id_whatever_the_batch(engine):
    rollout = stage(engine, acceptance="specrl", log_lenience=math.inf)
    rollout(PROMPTS, 2, ("s", 1), 1)
    shuffled = [PROMPTS[2], PROMPTS[0]]  # different order and composition
    again, stats = rollout(shuffled, 2, ("s", 2), 2)
    assert stats.drafts == len(again) == 4
    for r in again:
        assert r.token_ids == rollout.store.get(r.prompt.prompt_id, r.slot).token_ids.tolist()


@pytest.mark.parametrize("tree", [False, True])
def test_exported_prompts_give_a_fresh_stage_the_same_next_rollouts(tree):
    """A prompt's state (drafts of every slot, token tree) moved to a fresh stage, as between
    workers that own shards of prompts: that stage's next rollouts of the prompt are the ones
    the original stage would have produced, and nothing of the other prompts comes along."""
    engine = HFEngine(make_tiny_model(seed=0, init=0.5), [EOS], PAD)
    tree_cfg = TreeConfig(enabled=tree, adaptive=False)
    # the budget measures its own machine and is not moved: drafts verified whole here
    spec = SpecConfig(enabled=True, reuse="slot", tree=tree_cfg, verify_budget=False)
    kept = SpeculativeStage(engine, SAMPLING, R, spec)
    kept(PROMPTS, 4, ("s", 1), 1)
    moved = SpeculativeStage(engine, SAMPLING, R, spec)
    moved.import_(kept.export([PROMPTS[1].prompt_id]))
    assert len(moved.store) == 4 and (not tree or len(moved.tree) == 1)
    expected, stats = kept([PROMPTS[1]], 4, ("s", 2), 2)
    got, moved_stats = moved([PROMPTS[1]], 4, ("s", 2), 2)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert 0 < moved_stats.reused_tokens == stats.reused_tokens < moved_stats.response_tokens
    if tree:
        assert moved_stats.drafted_tokens == stats.drafted_tokens > 0


def test_stage_state_restores_drafts(engine):
    rollout = stage(engine, acceptance="specrl", log_lenience=math.inf)
    first, _ = rollout(PROMPTS, 2, ("s", 1), 1)
    restored = stage(engine, acceptance="specrl", log_lenience=math.inf)
    restored.load_state_dict(rollout.state_dict())
    assert tokens(restored(PROMPTS, 2, ("s", 2), 2)[0]) == tokens(first)


@pytest.mark.parametrize("acceptance", ["specrl", "exact"])
def test_chunked_verification_matches_full_and_verifies_less(acceptance):
    policy = make_tiny_model(seed=0)
    engine = HFEngine(policy, [EOS], PAD)
    full = stage(engine, acceptance=acceptance)
    full(PROMPTS, 4, ("s", 1), 1)
    chunked = stage(engine, acceptance=acceptance, verify_mode="chunked", verify_chunk_size=2)
    chunked.load_state_dict(full.state_dict())
    engine.model = make_tiny_model(seed=1)  # a changed policy rejects some draft tokens
    a, s_full = full(PROMPTS, 4, ("s", 2), 2)
    b, s_chunked = chunked(PROMPTS, 4, ("s", 2), 2)
    assert tokens(a) == tokens(b)
    assert 0 < s_chunked.reused_tokens == s_full.reused_tokens
    assert s_chunked.verified_tokens < s_full.verified_tokens


@pytest.mark.parametrize(("acceptance", "exact"), [("exact", True), ("specrl", False)])
def test_exact_rule_matches_the_target_distribution_with_adversarial_drafts(acceptance, exact):
    """20k slots: drafts are sampled from another policy; speculative rollouts under the exact rule
    must be distributed as the current policy's own samples (chi-square, p > 1e-3). The lenient
    specrl rule is not exact, and the same test must detect it (the test has power)."""
    vocab, max_len, n = 5, 3, 20_000
    prompt = Prompt((2, 3), Example("p", "", "test"))
    target, drafter = target_and_drafter(vocab, n)
    spec = SpeculativeStage(
        target,
        SAMPLING,
        max_len,
        SpecConfig(
            enabled=True, acceptance=acceptance, reuse="slot", log_lenience=2.0, tree=NO_TREE
        ),
    )
    for r in sample_rollouts(drafter, [prompt], n, SAMPLING, max_len, ("draft",), 0):
        spec.store.put(r)
    rollouts, stats = spec([prompt], n, ("spec",), 1)
    assert 0 < stats.reused_tokens < stats.response_tokens  # drafts partly kept

    # the exact rule's rollouts are the policy's samples: no behaviour logprobs of their own
    assert all((r.behaviour_logprobs is None) == exact for r in rollouts)
    pvalue = distribution_pvalue(target, prompt, rollouts, vocab, max_len)
    if exact:
        assert pvalue > 1e-3
    else:
        assert pvalue < 1e-6


def test_the_draft_budget_verifies_the_prefix_whose_expected_saving_pays():
    """Token j of a draft is reused with probability ≈ α^j (α: the rule's accept rate, fitted
    from the cuts); it is verified while α^j · c_token > c_node."""
    budget = DraftBudget()
    assert budget.limit([10, 10]) is None  # nothing measured: every token
    budget.observe_verify(1.0, 100)  # c_node = 0.01 s
    budget.observe_decode(1.0, 10)  # c_token = 0.1 s (no fit of decode rows: the average)
    assert budget.accept_rate == 0.9  # no cut seen: the prior, one token decided, 0.9 accepted
    assert budget.limit([40, 40]) == 21  # 0.9^21 · 0.1 > 0.01 ≥ 0.9^22 · 0.1
    budget.observe_cuts(9, 3)  # α = (9 + 0.9) / (9 + 3 + 1)
    alpha = 9.9 / 13
    limit = budget.limit([40, 40])
    assert alpha**limit * 0.1 > 0.01 >= alpha ** (limit + 1) * 0.1 and limit == 8
    budget.observe_cuts(0, 100)  # α = 8.1 / 110.6 after decay: not even the first token pays
    assert budget.limit([40]) == 0
    for _ in range(60):  # nothing verified for a while: the evidence decays, α returns to 0.9
        budget.observe_cuts(0, 0)
    assert budget.accept_rate == pytest.approx(0.9, abs=1e-3) and budget.limit([40]) == 21
    assert DraftBudget(enabled=False).limit([40]) is None


@pytest.mark.parametrize("node_cost", [0.5, 2.0], ids=["first-token", "nothing-pays"])
def test_drafts_cut_by_the_budget_keep_the_exact_rule_distributed_as_the_policy(node_cost):
    """The adversarial drafts above, verified only as far as the budget pays (one token of
    three; or none: then no verification forward runs and every slot decodes from its prompt):
    the rollouts are still the policy's samples (chi-square, p > 1e-3)."""
    vocab, max_len, n = 5, 3, 20_000
    prompt = Prompt((2, 3), Example("p", "", "test"))
    target, drafter = target_and_drafter(vocab, n)
    spec = SpeculativeStage(
        target, SAMPLING, max_len, SpecConfig(enabled=True, acceptance="exact", reuse="slot", tree=NO_TREE)
    )  # fmt: skip
    spec.reuse.budget = DraftPrices(node_cost=node_cost, token_cost=1.0)
    spec.reuse.budget.observe_cuts(1, 1)  # α = 1.9 / 3: 0.63 > 0.5 > 0.4 pays for one token
    for r in sample_rollouts(drafter, [prompt], n, SAMPLING, max_len, ("draft",), 0):
        spec.store.put(r)
    before = target.counts.verify_forwards
    rollouts, stats = spec([prompt], n, ("spec",), 1)
    if node_cost < 1:
        assert stats.draft_verify_limit == 1 and stats.verified_tokens == n
        assert 0 < stats.reused_tokens <= n
    else:
        assert stats.draft_verify_limit == 0 and stats.drafts_skipped == n
        assert stats.verified_tokens == stats.reused_tokens == 0
        assert target.counts.verify_forwards == before
    assert distribution_pvalue(target, prompt, rollouts, vocab, max_len) > 1e-3


def test_specrl_behaviour_logprobs_are_what_responses_are_sampled_with():
    """20k slots share one draft, the current policy's most frequent full-length response, stored
    as if an earlier policy had been sure of it: ℓ·p_new/p_old < 1, so drafts are cut often and
    the token sampled afresh at a cut is often the draft's own. Under the lenient specrl rule the
    empirical frequency of each complete response must match exp(sum of its behaviour logprobs)
    (chi-square, p > 1e-3), and must not match the current policy's own probability of it
    (p < 1e-6): the rule is off-policy, and the behaviour logprobs say by how much."""
    vocab, max_len, n = 5, 4, 20_000
    prompt = Prompt((2, 3), Example("p", "", "test"))
    target, _ = target_and_drafter(vocab, n)
    samples = sample_rollouts(target, [prompt], 512, SAMPLING, max_len, ("draft",), 0)
    whole = [tuple(r.token_ids) for r in samples if len(r.token_ids) == max_len]
    draft = max(set(whole), key=whole.count)
    # ℓ = 1 and p_old = 1: α = p_new, never 1, so no acceptance probability saturates
    full = SpecConfig(enabled=True, acceptance="specrl", log_lenience=0.0, tree=NO_TREE)
    stage_full = SpeculativeStage(target, SAMPLING, max_len, full)
    for slot in range(n):
        stage_full.store.put(Rollout(prompt, slot, list(draft), [0.0] * max_len, "length", 0))
    # chunked verification (one token per pass) scores where responses leave the draft later
    chunked = full.model_copy(update={"verify_mode": "chunked", "verify_chunk_size": 1})
    stage_chunked = SpeculativeStage(target, SAMPLING, max_len, chunked)
    stage_chunked.load_state_dict(stage_full.state_dict())
    rollouts, stats = stage_full([prompt], n, ("spec",), 1)
    again, _ = stage_chunked([prompt], n, ("spec",), 1)
    assert tokens(again) == tokens(rollouts)
    for x, y in zip(rollouts, again, strict=True):
        assert x.behaviour_logprobs == pytest.approx(y.behaviour_logprobs, abs=1e-5)
    assert stats.reused_tokens > 0 and stats.ratios()["spec/behaviour_logprob_gap"] > 0
    behaviour, current, counts = {}, {}, {}
    for r in rollouts:
        seq = tuple(r.token_ids)
        counts[seq] = counts.get(seq, 0) + 1
        behaviour.setdefault(seq, math.exp(sum(r.behaviour_logprobs)))
        current.setdefault(seq, math.exp(sum(r.current_logprobs)))
        assert math.exp(sum(r.behaviour_logprobs)) == pytest.approx(behaviour[seq], rel=1e-4)

    def pvalue(probs):
        common = [seq for seq, p in probs.items() if p * n >= 5]
        observed = [counts[s] for s in common] + [n - sum(counts[s] for s in common)]
        expected = [probs[s] * n for s in common] + [n - sum(probs[s] * n for s in common)]
        return chisquare(observed, expected, sum_check=False).pvalue

    assert pvalue(behaviour) > 1e-3
    assert pvalue(current) < 1e-6


def test_a_rule_the_engine_cannot_serve_is_refused_at_construction(engine):
    """The stage checks the engine's declared capabilities once, before any rollout."""

    class PlainEngine:  # an engine that declares no optional capability
        capabilities = Capabilities()
        eos_token_ids = engine.eos_token_ids
        generate = engine.generate
        logprobs = engine.logprobs
        counts = engine.counts

    with pytest.raises(UserError, match=r"rollout\.spec\.acceptance=exact needs an engine"):
        SpeculativeStage(PlainEngine(), SAMPLING, R, SpecConfig(tree=NO_TREE))
    with pytest.raises(UserError, match=r"rollout\.spec\.tree\.enabled=true needs an engine"):
        SpeculativeStage(
            PlainEngine(), SAMPLING, R, SpecConfig(enabled=False, tree=TreeConfig(enabled=True))
        )

    class ResidualEngine(PlainEngine):  # the exact rule's residual, but no draft decoding
        capabilities = Capabilities(residual_sampling=True)

    with pytest.raises(UserError, match=r"rollout\.spec\.verify_mode=decoding needs an engine"):
        SpeculativeStage(ResidualEngine(), SAMPLING, R, SpecConfig(verify_mode="decoding"))
    lenient, stats = SpeculativeStage(PlainEngine(), SAMPLING, R, SpecConfig(acceptance="specrl"))(
        PROMPTS, 2, ("s", 1), 1
    )
    assert not stats.decode_drafts  # no tree, no prefix handle
    assert stats.rollouts == len(lenient) == 6


def test_drift_metrics_say_how_old_drafts_are_and_how_far_the_policy_moved(engine):
    rollout = stage(engine)
    rollout(PROMPTS, 2, ("s", 1), 3)
    _, same = rollout(PROMPTS, 2, ("s", 2), 7)  # four steps later, the same weights
    assert same.ratios()["spec/draft_age_steps"] == 4
    assert same.ratios()["spec/draft_logprob_drift"] < 1e-5
    engine.model = make_tiny_model(seed=1)  # the policy moved
    _, moved = rollout(PROMPTS, 2, ("s", 3), 8)
    assert moved.ratios()["spec/draft_age_steps"] == 1
    assert moved.ratios()["spec/draft_logprob_drift"] > 0.1


@pytest.mark.parametrize("tree", [False, True], ids=["stored", "stored+tree"])
def test_drafts_verified_inside_decoding_keep_the_target_distribution(tree):
    """verify_mode=decoding: each slot's stored draft (another policy's sample) is the engine's
    first draft tokens, verified in decoding forwards, then token trees (of more of those
    samples) propose. 20k slots distributed as the current policy's own samples."""
    vocab, max_len, n = 5, 3, 20_000
    prompt = Prompt((2, 3), Example("p", "", "test"))
    target, drafter = target_and_drafter(vocab, n)
    cfg = SpecConfig(
        enabled=True,
        acceptance="exact",
        verify_mode="decoding",
        tree=TreeConfig(enabled=tree, adaptive=False),
    )
    spec = SpeculativeStage(target, SAMPLING, max_len, cfg)
    for r in sample_rollouts(drafter, [prompt], n, SAMPLING, max_len, ("draft",), 0):
        spec.store.put(r)
    if tree:
        spec.tree.begin(prompt.prompt_id)
        for r in sample_rollouts(drafter, [prompt], 64, SAMPLING, max_len, ("tree",), 0):
            spec.tree.insert(prompt.prompt_id, r.token_ids)
    rollouts, stats = spec([prompt], n, ("spec",), 1)
    assert 0 < stats.reused_tokens < stats.response_tokens
    assert 0 < stats.accepted_draft_tokens < stats.drafted_tokens
    assert stats.verified_tokens == 0  # no verification pass
    assert distribution_pvalue(target, prompt, rollouts, vocab, max_len) > 1e-3


def test_greedy_drafts_verified_inside_decoding_are_kept_whole(engine):
    """Greedy, same policy: every stored draft is the response again, kept whole by decoding
    forwards that accept several draft tokens each; rollouts equal plain greedy decoding."""
    no_tree = TreeConfig(enabled=False, adaptive=False)  # every stored draft token proposed
    cfg = SpecConfig(enabled=True, acceptance="exact", verify_mode="decoding", tree=no_tree)
    spec = SpeculativeStage(engine, GREEDY, R, cfg)
    spec(PROMPTS, 2, ("s", 1), 1)
    rollouts, stats = spec(PROMPTS, 2, ("s", 2), 2)
    assert tokens(rollouts) == tokens(sample_rollouts(engine, PROMPTS, 2, GREEDY, R, ("v",), 2))
    assert stats.reused_tokens == stats.response_tokens
    assert stats.fully_reused == stats.rollouts and stats.decoded_tokens == 0
    assert stats.draft_forwards < stats.response_tokens  # several tokens per forward
