"""How the transformers engine groups verification sequences into forwards: by its fitted costs."""

import itertools
import random

import numpy as np
import pytest

from specrl.engines import LogprobRequest, SamplingParams, TrieRequest
from specrl.engines.hf import HFEngine
from specrl.engines.hf.batching import ForwardCost, PassCost, width_batches
from tests.conftest import EOS, PAD, make_tiny_model


def groupings(n: int):
    """Every split of n sequences, in order, into consecutive forwards: → lists of (start, end)."""
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0, *(i + 1 for i, cut in enumerate(cuts) if cut), n]
        yield list(itertools.pairwise(bounds))


@pytest.mark.parametrize("trial", range(40))
def test_a_fitted_cost_groups_the_widest_first_order_into_its_cheapest_forwards(trial):
    rng = random.Random(trial)
    n = rng.randint(1, 8)
    widths = [rng.randint(1, 60) for _ in range(n)]
    kept = [rng.randint(1, w) for w in widths]
    keys = [(i,) for i in range(n)]
    cost = ForwardCost(*(rng.choice([0.0, rng.uniform(0, 1)]) for _ in range(4)))
    cost = ForwardCost(cost.fixed, cost.position + 1e-3, cost.pair, cost.logit)
    max_rows, max_positions = rng.randint(1, n), rng.choice([None, rng.randint(60, 200)])
    order = sorted(range(n), key=lambda i: (-widths[i], keys[i]))

    def price(forwards) -> float:
        total = 0.0
        for start, end in forwards:
            rows = order[start:end]
            width, most = widths[rows[0]], max(kept[i] for i in rows)
            positions = len(rows) * width
            if len(rows) > max_rows or (
                len(rows) > 1 and max_positions is not None and positions > max_positions
            ):
                return float("inf")
            total += float(cost.of(np.array(len(rows)), np.array(width), np.array(most)))
        return total

    cheapest = min(price(g) for g in groupings(n))
    batches = width_batches(widths, keys, max_rows, 0.1, max_positions, kept, cost)
    assert sorted(i for b in batches for i in b) == list(range(n))
    assert [i for b in batches for i in b] == order  # consecutive in the widest-first order
    bounds = list(itertools.accumulate(len(b) for b in batches))
    got = price(list(zip([0, *bounds[:-1]], bounds, strict=True)))
    assert got == pytest.approx(cheapest, rel=1e-9)


def test_where_a_forward_costs_more_than_padding_the_sequences_share_one():
    widths, keys = [10, 100, 9, 90, 8, 95, 30], [(i,) for i in range(7)]
    launch_bound = ForwardCost(fixed=1.0, position=1e-6, pair=0.0, logit=0.0)
    assert width_batches(widths, keys, 512, 0.1, cost=launch_bound) == [[1, 5, 3, 6, 0, 2, 4]]
    # ... within the rows and positions a forward may hold
    assert width_batches(widths, keys, 3, 0.1, cost=launch_bound) == [[1, 5, 3], [6], [0, 2, 4]]
    capped = width_batches(widths, keys, 512, 0.1, 250, cost=launch_bound)
    assert len(capped) == 3 and all(len(b) * widths[b[0]] <= 250 for b in capped)
    # where positions cost and forwards do not, each width has its own forward
    compute_bound = ForwardCost(fixed=0.0, position=1.0, pair=0.0, logit=0.0)
    assert width_batches(widths, keys, 512, 0.1, cost=compute_bound) == [
        [i] for i in (1, 5, 3, 6, 0, 2, 4)
    ]
    # equal widths are ordered by their keys, whatever order they come in
    same = [(3, 1), (1, 2), (2, 2), (9, 9, 9, 9)]
    batches = width_batches([len(k) for k in same], same, 512, 0.1, cost=compute_bound)
    shuffled = [same[i] for i in (2, 0, 3, 1)]
    regrouped = width_batches([len(k) for k in shuffled], shuffled, 512, 0.1, cost=compute_bound)
    assert [[shuffled[i] for i in b] for b in regrouped] == [[same[i] for i in b] for b in batches]
    assert batches == [[3], [1, 2, 0]]


def test_the_fit_recovers_what_the_forwards_cost_once_they_differ_enough():
    truth = ForwardCost(fixed=0.03, position=2e-4, pair=1e-7, logit=5e-5)
    fit, rng = PassCost(), np.random.default_rng(0)
    for _ in range(3):
        fit.observe(4, 50, 10, 0.1)
    assert fit.fit() is None  # fewer than four forwards
    fit.observe(4, 50, 10, 0.1)
    assert fit.fit() is None  # forwards all alike: nothing separates the costs
    for _ in range(40):
        rows, width = int(rng.integers(1, 33)), int(rng.integers(8, 300))
        kept = int(rng.integers(1, width + 1))
        seconds = float(truth.of(rows, width, kept)) * rng.uniform(0.98, 1.02)
        fit.observe(rows, width, kept, seconds)
    got = fit.fit()
    assert got is not None
    assert got.fixed == pytest.approx(truth.fixed, rel=0.2)
    assert got.position == pytest.approx(truth.position, rel=0.2)
    assert got.logit == pytest.approx(truth.logit, rel=0.3)
    # a forward the fit has not seen the like of is priced within a few percent
    assert float(got.of(64, 400, 100)) == pytest.approx(float(truth.of(64, 400, 100)), rel=0.05)


def test_no_cost_is_fitted_below_zero():
    """Forwards whose seconds have no fixed part, timed with noise, over a narrow range of widths
    (a few tries of similar sizes): least squares alone would put the fixed cost below zero and the
    others far above what they are."""
    truth = ForwardCost(fixed=0.0, position=2e-3, pair=4e-6, logit=0.0)
    fit, rng = PassCost(), np.random.default_rng(1)
    for _ in range(12):
        rows, width = int(rng.integers(1, 3)), int(rng.integers(200, 270))
        fit.observe(
            rows, width, width - 40, float(truth.of(rows, width, 0)) * rng.uniform(0.9, 1.1)
        )
    got = fit.fit()
    assert got is not None and min(vars(got).values()) >= 0
    for rows, width in ((1, 120), (4, 260), (2, 400)):
        expected = float(truth.of(rows, width, 0))
        assert float(got.of(rows, width, width - 40)) == pytest.approx(expected, rel=0.3)


def test_the_engine_fits_its_verification_forwards_and_batches_by_the_fit():
    """Trie passes and draft verification are observed by the engine's `PassCost`; once it fits,
    the batches follow it, and what is computed does not depend on how the rows were batched."""
    engine = HFEngine(make_tiny_model(init=0.3), [EOS], PAD)
    sampling = SamplingParams(1.0)
    tries = [
        TrieRequest([2, 3, 4][: 1 + i % 3], [0, 1, 1, 2][: 1 + i % 4], [5, 6, 7, 8][: 1 + i % 4],
                    sampling)
        for i in range(12)
    ]  # fmt: skip
    drafts = [LogprobRequest([2] * (1 + i), [5, 6][: 1 + i % 2], sampling) for i in range(8)]
    observed = []
    engine.verify_cost.observe = lambda *shape: observed.append(shape)
    split = engine.verify_tries(tries), engine.logprobs(drafts)
    slack_forwards = len(observed)
    assert slack_forwards == engine.counts.verify_forwards > 2
    assert all(seconds > 0 for *_, seconds in observed)
    # a fit under which a forward costs more than any padding: one forward each
    engine.verify_cost.fit = lambda: ForwardCost(fixed=1.0, position=1e-9, pair=0.0, logit=0.0)
    before = engine.counts.verify_forwards
    merged = engine.verify_tries(tries), engine.logprobs(drafts)
    assert engine.counts.verify_forwards == before + 2
    for a, b in zip(split[0], merged[0], strict=True):
        for name in ("logprobs", "low", "high"):
            np.testing.assert_allclose(getattr(a, name), getattr(b, name), atol=1e-5)
    for a, b in zip(split[1], merged[1], strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)
    # rollout.verify_batching=slack: the padding slacks alone, whatever the fit says
    engine.fitted_batching = False
    before = engine.counts.verify_forwards
    engine.verify_tries(tries), engine.logprobs(drafts)
    assert engine.counts.verify_forwards - before == slack_forwards
