import math
from itertools import product

import pytest
import torch
from scipy.stats import chisquare

from specrl.config import SpecConfig, TreeConfig
from specrl.engines import SamplingParams, ScoreRequest
from specrl.engines.hf import HFEngine
from specrl.spec.rollout import RolloutStage, generate_rollouts
from specrl.spec.store import RolloutStore
from specrl.types import Example, Prompt
from tests.conftest import EOS, PAD, make_tiny_model

PROMPTS = [Prompt(ids, Example(str(ids), "", "test")) for ids in [(3, 4, 5), (6, 7), (2, 8, 9, 10)]]
SAMPLING = SamplingParams(1.0)
R = 10
NO_TREE = TreeConfig(enabled=False)  # SPEC-RL prefix reuse alone; tree drafts: test_tree.py


def stage(engine, store=None, **spec):
    return RolloutStage(
        engine,
        SAMPLING,
        R,
        SpecConfig(enabled=True, tree=NO_TREE, **spec),
        RolloutStore() if store is None else store,
    )


def tokens(rollouts):
    return [r.token_ids for r in rollouts]


def test_first_time_prompts_fall_back_to_vanilla(engine):
    metrics = {}
    spec = stage(engine)(PROMPTS, 2, ("s", 1), 1, metrics)
    assert tokens(spec) == tokens(generate_rollouts(engine, PROMPTS, 2, SAMPLING, R, ("s", 1), 1))
    assert metrics["spec/draft_ratio"] == 0 and metrics["spec/reused_token_ratio"] == 0
    assert metrics["spec/store_entries"] == 6


def test_minus_infinite_lenience_reuses_nothing_and_equals_vanilla(engine):
    rollout = stage(engine, log_lenience=-math.inf)
    rollout(PROMPTS, 2, ("s", 1), 1, {})
    metrics = {}
    second = rollout(PROMPTS, 2, ("s", 2), 2, metrics)
    assert tokens(second) == tokens(generate_rollouts(engine, PROMPTS, 2, SAMPLING, R, ("s", 2), 2))
    assert metrics["spec/draft_ratio"] == 1 and metrics["spec/reused_tokens"] == 0


def test_infinite_lenience_reuses_every_draft_whole(engine):
    rollout = stage(engine, log_lenience=math.inf)
    first = rollout(PROMPTS, 2, ("s", 1), 1, {})
    metrics = {}
    second = rollout(PROMPTS, 2, ("s", 2), 2, metrics)
    assert tokens(second) == tokens(first)
    assert metrics["spec/full_reuse_ratio"] == 1 and metrics["spec/decoded_tokens"] == 0
    assert metrics["spec/reused_token_ratio"] == 1
    # reused tokens carry the current policy's logprobs (from verification)
    scored = engine.score([ScoreRequest(r.prompt.ids, r.token_ids, SAMPLING) for r in second])
    for r, s in zip(second, scored, strict=True):
        assert torch.allclose(torch.tensor(r.logprobs), s, atol=1e-5)


def test_drafts_are_found_by_prompt_id_whatever_the_batch(engine):
    store = RolloutStore()
    stage(engine, store, log_lenience=math.inf)(PROMPTS, 2, ("s", 1), 1, {})
    shuffled = [PROMPTS[2], PROMPTS[0]]  # different order and composition
    metrics = {}
    again = stage(engine, store, log_lenience=math.inf)(shuffled, 2, ("s", 2), 2, metrics)
    assert metrics["spec/draft_ratio"] == 1
    for r in again:
        assert r.token_ids == store.get(r.prompt.prompt_id, r.slot).token_ids.tolist()


def test_store_state_restores_drafts(engine):
    store = RolloutStore()
    first = stage(engine, store, log_lenience=math.inf)(PROMPTS, 2, ("s", 1), 1, {})
    restored = RolloutStore()
    restored.load_state_dict(store.state_dict())
    assert tokens(
        stage(engine, restored, log_lenience=math.inf)(PROMPTS, 2, ("s", 2), 2, {})
    ) == tokens(first)


@pytest.mark.parametrize("acceptance", ["specrl", "exact"])
def test_chunked_verification_matches_full_and_verifies_less(acceptance):
    policy = make_tiny_model(seed=0)
    engine = HFEngine(policy, [EOS], PAD)
    full, chunked = RolloutStore(), RolloutStore()
    stage(engine, full, acceptance=acceptance)(PROMPTS, 4, ("s", 1), 1, {})
    chunked.load_state_dict(full.state_dict())
    engine.model = make_tiny_model(seed=1)  # a changed policy rejects some draft tokens
    m_full, m_chunked = {}, {}
    a = stage(engine, full, acceptance=acceptance)(PROMPTS, 4, ("s", 2), 2, m_full)
    b = stage(engine, chunked, acceptance=acceptance, verify_mode="chunked", verify_chunk_size=2)(
        PROMPTS, 4, ("s", 2), 2, m_chunked
    )
    assert tokens(a) == tokens(b)
    assert m_chunked["spec/verified_tokens"] < m_full["spec/verified_tokens"]


def response_probabilities(engine, prompt, vocab, max_len):
    """Exact probability of every complete response (ends at EOS or at max_len tokens)."""
    responses = [
        seq
        for length in range(1, max_len + 1)
        for seq in product(range(vocab), repeat=length)
        if EOS not in seq[:-1] and (seq[-1] == EOS or length == max_len)
    ]
    scores = engine.score([ScoreRequest(prompt, list(seq), SAMPLING) for seq in responses])
    return {seq: float(s.double().sum().exp()) for seq, s in zip(responses, scores, strict=True)}


def distribution_pvalue(engine, prompt, rollouts, vocab, max_len):
    """Chi-square p-value of the complete responses in `rollouts` against `engine`'s exact
    response distribution; rare responses share one bin so every expected count is ≥ 5."""
    n = len(rollouts)
    probs = response_probabilities(engine, prompt.ids, vocab, max_len)
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-4)
    counts = dict.fromkeys(probs, 0)
    for r in rollouts:
        counts[tuple(r.token_ids)] += 1
    common = [seq for seq, p in probs.items() if p * n >= 5]
    observed = [counts[s] for s in common] + [n - sum(counts[s] for s in common)]
    expected = [probs[s] * n for s in common] + [n - sum(probs[s] * n for s in common)]
    return chisquare(observed, expected, sum_check=False).pvalue


def target_and_drafter(vocab, batch):
    """The current policy and another one whose samples serve as adversarial drafts."""
    return tuple(
        HFEngine(make_tiny_model(seed=s, vocab_size=vocab, init=0.5), [EOS], PAD, batch)
        for s in (5, 9)
    )


@pytest.mark.parametrize(("acceptance", "exact"), [("exact", True), ("specrl", False)])
def test_exact_rule_matches_the_target_distribution_with_adversarial_drafts(acceptance, exact):
    """20k slots: drafts are sampled from another policy; speculative rollouts under the exact rule
    must be distributed as the current policy's own samples (chi-square, p > 1e-3). The lenient
    specrl rule is not exact, and the same test must detect it (the test has power)."""
    vocab, max_len, n = 5, 3, 20_000
    prompt = Prompt((2, 3), Example("p", "", "test"))
    target, drafter = target_and_drafter(vocab, n)
    store = RolloutStore()
    for r in generate_rollouts(drafter, [prompt], n, SAMPLING, max_len, ("draft",), 0):
        store.put(prompt.prompt_id, r.slot, r.token_ids, r.logprobs, r.finish_reason, 0)
    spec = RolloutStage(
        target,
        SAMPLING,
        max_len,
        SpecConfig(enabled=True, acceptance=acceptance, log_lenience=2.0, tree=NO_TREE),
        store,
    )
    metrics = {}
    rollouts = spec([prompt], n, ("spec",), 1, metrics)
    assert (
        0 < metrics["spec/reused_tokens"] < sum(len(r.token_ids) for r in rollouts)
    )  # drafts partly kept

    pvalue = distribution_pvalue(target, prompt, rollouts, vocab, max_len)
    if exact:
        assert pvalue > 1e-3
    else:
        assert pvalue < 1e-6


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
    samples = generate_rollouts(target, [prompt], 512, SAMPLING, max_len, ("draft",), 0)
    whole = [tuple(r.token_ids) for r in samples if len(r.token_ids) == max_len]
    draft = max(set(whole), key=whole.count)
    store = RolloutStore()
    sure = [0.0] * max_len
    for slot in range(n):
        store.put(prompt.prompt_id, slot, list(draft), sure, "length", 0)
    chunked_store = RolloutStore()
    chunked_store.load_state_dict(store.state_dict())
    metrics = {}
    # ℓ = 1 and p_old = 1: α = p_new, never 1, so no acceptance probability saturates
    full = SpecConfig(enabled=True, log_lenience=0.0, tree=NO_TREE)
    rollouts = RolloutStage(target, SAMPLING, max_len, full, store)(
        [prompt], n, ("spec",), 1, metrics
    )
    # chunked verification (one token per pass) scores where responses leave the draft later
    chunked = full.model_copy(update={"verify_mode": "chunked", "verify_chunk_size": 1})
    again = RolloutStage(target, SAMPLING, max_len, chunked, chunked_store)(
        [prompt], n, ("spec",), 1, {}
    )
    assert tokens(again) == tokens(rollouts)
    for x, y in zip(rollouts, again, strict=True):
        assert x.behaviour_logprobs == pytest.approx(y.behaviour_logprobs, abs=1e-5)
    assert metrics["spec/reused_tokens"] > 0 and metrics["spec/behaviour_logprob_gap"] > 0
    behaviour, current, counts = {}, {}, {}
    for r in rollouts:
        seq = tuple(r.token_ids)
        counts[seq] = counts.get(seq, 0) + 1
        behaviour.setdefault(seq, math.exp(sum(r.behaviour_logprobs)))
        current.setdefault(seq, math.exp(sum(r.logprobs)))
        assert math.exp(sum(r.behaviour_logprobs)) == pytest.approx(behaviour[seq], rel=1e-4)

    def pvalue(probs):
        common = [seq for seq, p in probs.items() if p * n >= 5]
        observed = [counts[s] for s in common] + [n - sum(counts[s] for s in common)]
        expected = [probs[s] * n for s in common] + [n - sum(probs[s] * n for s in common)]
        return chisquare(observed, expected, sum_check=False).pvalue

    assert pvalue(behaviour) > 1e-3
    assert pvalue(current) < 1e-6
