"""Exact response distributions of tiny policies, for the chi-square tests of the acceptance
rules (test_stage.py) and of tree drafts (test_tree.py)."""

from itertools import product

import pytest
from scipy.stats import chisquare

from specrl.engines import LogprobRequest, SamplingParams
from specrl.engines.hf import HFEngine
from tests.conftest import EOS, PAD, make_tiny_model

SAMPLING = SamplingParams(1.0)


def response_probabilities(engine, prompt, vocab, max_len, sampling=SAMPLING):
    """Exact probability of every complete response (ends at EOS or at max_len tokens) under
    `sampling`; responses the sampling cannot produce are left out."""
    responses = [
        seq
        for length in range(1, max_len + 1)
        for seq in product(range(vocab), repeat=length)
        if EOS not in seq[:-1] and (seq[-1] == EOS or length == max_len)
    ]
    scores = engine.logprobs([LogprobRequest(prompt, list(seq), sampling) for seq in responses])
    probs = {seq: float(s.double().sum().exp()) for seq, s in zip(responses, scores, strict=True)}
    return {seq: p for seq, p in probs.items() if p > 0}


def distribution_pvalue(engine, prompt, rollouts, vocab, max_len):
    """Chi-square p-value of the complete responses in `rollouts` against `engine`'s exact
    response distribution; rare responses share one bin so every expected count is ≥ 5."""
    probs = response_probabilities(engine, prompt.ids, vocab, max_len)
    return sample_pvalue(probs, [tuple(r.token_ids) for r in rollouts])


def sample_pvalue(probs, samples):
    """Chi-square p-value of `samples` against the exact probabilities `probs` (outcome →
    probability, summing to 1); rare outcomes share one bin so every expected count is ≥ 5."""
    n = len(samples)
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-4)
    counts = dict.fromkeys(probs, 0)
    for sample in samples:
        counts[sample] += 1
    common = [seq for seq, p in probs.items() if p * n >= 5]
    observed = [counts[s] for s in common]
    expected = [probs[s] * n for s in common]
    if len(common) < len(probs):  # the rare outcomes' bin
        observed.append(n - sum(observed))
        expected.append(n - sum(expected))
    return chisquare(observed, expected, sum_check=False).pvalue


def target_and_drafter(vocab, batch):
    """The current policy and another one whose samples serve as adversarial drafts."""
    return tuple(
        HFEngine(make_tiny_model(seed=s, vocab_size=vocab, init=0.5), [EOS], PAD, batch)
        for s in (5, 9)
    )
