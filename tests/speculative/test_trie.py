"""History tries (`rollout.spec.reuse=trie`): one pass scores a prompt's trie of earlier
responses as scoring each path would, decoding continues from a node's KV, and trie rollouts
are vanilla's samples: token for token with the same weights and seeds (the walk draws each
token with decoding's uniform), and distributed as the policy's samples whatever the history."""

import math

import numpy as np
import pytest
import torch

from specrl.config import ConfigError, SpecConfig, load_config
from specrl.engines import GREEDY, GenRequest, LogprobRequest, SamplingParams, TrieRequest
from specrl.engines.accounting import ForwardCounts
from specrl.engines.hf import HFEngine
from specrl.rollouts import sample_rollouts
from specrl.speculative.draft_width import DraftWidth
from specrl.speculative.reuse.budget import TrieBudget
from specrl.speculative.reuse.trie import reachable
from specrl.speculative.reuse.walkers import DRIFT_BUCKETS, drift_bucket, expected_walkers
from specrl.speculative.stage import SpeculativeStage
from specrl.speculative.tree import PromptTree
from specrl.types import Example, Prompt
from tests.conftest import (
    CHAT_EOS,
    EOS,
    PAD,
    chat_like_prompts,
    make_chat_like_model,
    make_tiny_model,
    recorded_passes,
)
from tests.speculative.distributions import SAMPLING, distribution_pvalue, target_and_drafter
from tests.speculative.exactness import compare_trie_with_vanilla
from tests.speculative.prices import TriePrices

SAMPLINGS = {
    "t1": SamplingParams(1.0),
    "top_p0.8": SamplingParams(1.0, top_p=0.8),
    "top_k4": SamplingParams(0.9, top_k=4),
    "greedy": GREEDY,
}
# what the exactness runs sample with: temperature 1 alone, with top-p and top-k, greedy
RUN_SAMPLINGS = {
    "t1": SamplingParams(1.0),
    "t1_top_p0.9_top_k8": SamplingParams(1.0, top_p=0.9, top_k=8),
    "greedy": GREEDY,
}
RESPONSES = [[3, 4, 5, EOS], [3, 4, 6, 7], [3, 8], [9, 9, 9, 9, 9], [3, 4, 5, 2, EOS]]


def trie_of(responses) -> PromptTree:
    tree = PromptTree()
    for response in responses:
        tree.insert(response)
    return tree


def same(a, b, atol=1e-5) -> bool:
    """Equal logprobs, -inf (outside top-k / top-p) included."""
    return bool(np.isclose(np.asarray(a), np.asarray(b), rtol=0.0, atol=atol).all())


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_a_trie_pass_scores_every_node_as_scoring_its_path_does(sampling):
    engine = HFEngine(make_tiny_model(init=0.3), [EOS], PAD)
    tree = trie_of(RESPONSES)
    prompts = [[2, 5, 7], [6]]  # two rows of different widths in one pass
    requests = [TrieRequest(p, tree.parent[1:], tree.token[1:], sampling) for p in prompts]
    for prompt, scores in zip(prompts, engine.verify_tries(requests), strict=True):
        for response in RESPONSES:
            [expected] = engine.logprobs([LogprobRequest(prompt, response, sampling)])
            node, got = 0, []
            for token in response:
                node = tree.children[node][token]
                got.append(scores.logprobs[node])
            assert same(got, expected), (got, expected)
        # the sampler's intervals: each node's width is its probability, inside its parent's mass
        width = scores.high[1:] - scores.low[1:]
        assert np.allclose(width, np.exp(scores.logprobs[1:]), atol=1e-6)
        assert (scores.high[1:] <= scores.total[np.asarray(tree.parent[1:])] + 1e-9).all()


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_a_trie_pass_computes_only_the_distributions_walks_read_bit_for_bit(sampling):
    """Without a prefix cache that keeps them, a pass computes the distributions after the root
    and after the nodes with a child only: the same intervals, to the bit, as from all of them;
    a leaf's total is NaN (no walk reads it)."""
    engine = HFEngine(make_tiny_model(init=0.3), [EOS], PAD)
    tree = trie_of(RESPONSES)
    requests = [TrieRequest(p, tree.parent[1:], tree.token[1:], sampling) for p in ([2, 5], [6])]
    prefixes = engine.new_prefixes()
    every = engine.verify_tries(requests, prefixes)
    assert prefixes.distributions[0] is not None  # a vocabulary of 12: all of them kept
    parents = set(tree.parent[1:])
    leaves = [v for v in range(tree.nodes + 1) if v not in parents]
    for read, full in zip(engine.verify_tries(requests), every, strict=True):
        for name in ("logprobs", "low", "high"):
            np.testing.assert_array_equal(getattr(read, name), getattr(full, name))
        assert np.isnan(read.total[leaves]).all() and not np.isnan(full.total).any()
        np.testing.assert_array_equal(np.delete(read.total, leaves), np.delete(full.total, leaves))


@pytest.mark.parametrize("vocab", [12, 4096], ids=["distributions-kept", "large-vocabulary"])
def test_decoding_that_leaves_a_trie_continues_from_the_nodes_kv(vocab):
    """A slot that leaves its trie at a node, or at the root, decodes on from the KV the pass
    computed: no prefill forward. With a large vocabulary the pass keeps no distributions, and
    a slot that left at the root feeds the prompt's last token after the rest's KV."""
    model = make_tiny_model(init=0.3, vocab_size=vocab)
    engine = HFEngine(model, [EOS], PAD)
    tree = trie_of(RESPONSES)
    prompt, sampling = [2, 5, 7], SamplingParams(1.0)
    prefixes = engine.new_prefixes()
    engine.verify_tries([TrieRequest(prompt, tree.parent[1:], tree.token[1:], sampling)], prefixes)
    assert (prefixes.distributions[0] is None) == (vocab > 12)
    for path in ([3, 4], [9, 9, 9], []):
        assert prefixes.find([*prompt, *path][:-1]) is not None
        requests = [GenRequest(prompt, 6, sampling, seed, path) for seed in range(8)]
        passes, hook = recorded_passes(model)
        cached = engine.generate(requests, prefixes)
        hook.remove()
        assert all(width == 1 for _, width in passes)  # decode forwards only: no prefill
        fresh = engine.generate(requests)
        assert [r.token_ids for r in cached] == [r.token_ids for r in fresh]
        for a, b in zip(cached, fresh, strict=True):
            assert same(a.logprobs, b.logprobs)


def trie_stage(engine, sampling, max_len, **spec) -> SpeculativeStage:
    cfg = SpecConfig(enabled=True, acceptance="exact", reuse="trie", **spec)
    return SpeculativeStage(engine, sampling, max_len, cfg)


@pytest.mark.parametrize("sampling", RUN_SAMPLINGS.values(), ids=RUN_SAMPLINGS.keys())
def test_trie_rollouts_are_vanilla_rollouts_token_for_token(toy_run, sampling):
    """The built-in policy's weights after each of four training steps, the same in both arms;
    the trie arm's histories are its own earlier rounds. ≥ 20k tokens per sampling setting."""
    prompts, weights, model, eos = toy_run
    engine = HFEngine(model, eos, PAD)
    stage = trie_stage(engine, sampling, 72)
    tokens = agree = reused = 0
    for step, state in enumerate(weights, start=1):
        engine.load_weights(state)
        key = (1, step, 0)
        trie, stats = stage(prompts, 8, key, step)
        vanilla = sample_rollouts(engine, prompts, 8, sampling, 72, key, step)
        for a, b in zip(trie, vanilla, strict=True):
            tokens += max(len(a.token_ids), len(b.token_ids))
            agree += sum(x == y for x, y in zip(a.token_ids, b.token_ids, strict=False))
            if a.token_ids == b.token_ids:
                assert same(a.current_logprobs, b.current_logprobs, atol=1e-4)
                assert a.finish_reason == b.finish_reason
        reused += stats.reused_tokens
        if step > 1:
            assert stats.trie_nodes > 0 and stats.reused_tokens > 0
    assert tokens >= 20_000, tokens
    assert agree >= (1.0 if sampling.greedy else 0.999) * tokens, (agree, tokens)
    assert reused >= 0.3 * tokens  # the trie is used: 3 of 4 rounds have a history


def test_without_tree_drafts_the_budget_still_prices_a_token_by_the_decode_forwards(toy_run):
    """The budgets price a reused token by the decode forwards' fitted costs (c0, a row), which
    drafting's controller fits. Without tree drafts nothing drafts, so the stage times decoding
    with a drafter that proposes nothing (`TimedDecoding`): the same tokens, the forwards fitted."""
    prompts, weights, model, eos = toy_run
    engine = HFEngine(model, eos, PAD)
    engine.load_weights(weights[0])
    sampling = SamplingParams(temperature=1.0)
    stage = trie_stage(engine, sampling, 72, tree={"enabled": False})
    rollouts, _ = stage(prompts, 8, (1, 1, 0), 1)
    fit = stage.draft_width.cost()  # its values are wall clocks: only that it exists is tested
    assert fit is not None and fit[2] is None  # forwards timed and fitted, no draft verified
    vanilla = sample_rollouts(engine, prompts, 8, sampling, 72, (1, 1, 0), 1)
    assert [r.token_ids for r in rollouts] == [r.token_ids for r in vanilla]
    unbudgeted = trie_stage(engine, sampling, 72, tree={"enabled": False}, verify_budget=False)
    unbudgeted(prompts, 8, (1, 1, 0), 1)
    assert unbudgeted.draft_width.cost() is None  # nothing prices a token there: not timed


def test_the_budget_verifies_the_nodes_enough_walkers_are_expected_to_reach():
    """E[walkers reaching v] = W · ρ^depth · count[v] / count[root]; v is verified when that
    times the token's cost exceeds the node's. A subtree: every parent of a verified node is."""
    tree = trie_of(RESPONSES)  # 5 responses: [3] 4 times, [3, 4] 3 times, [3, 4, 5] twice
    path = [tree.children[0][3]]
    path += [tree.children[path[-1]][4], tree.children[tree.children[path[-1]][4]][5]]
    assert TrieBudget().select(tree, 4).nodes == list(range(1, tree.nodes + 1))  # costs unknown
    budget = TrieBudget()
    budget.observe_verify(1.0, 1)
    budget.observe_decode(1.0, 1)
    assert budget.drift == 0.9  # before any walk: the prior, one predicted move 0.9 taken
    selection = budget.select(tree, 4)
    assert selection.nodes == path  # 4 · 0.9^d · count / 5 > 1: the nodes two or more share
    assert selection.expected_tokens == pytest.approx(4 * (4 * 0.9 + 3 * 0.81 + 2 * 0.729) / 5)
    # one move taken of four predicted along branches more than one response took (the path's
    # kind of move, 5): ρ = (1 + 0.9) / (4 + 1) there, and over all moves
    budget.observe_walks(walked({5: (1.0, 4.0)}))
    assert budget.drift == pytest.approx(0.38) and budget.drifts[5] == pytest.approx(0.38)
    assert budget.select(tree, 4).nodes == path[:1]  # 4 · 0.38 · 4/5 > 1 > 4 · 0.38² · 3/5
    for _ in range(60):  # no history walked for a while: the evidence decays, ρ returns to 0.9
        budget.observe_walks(walked({}))
    assert budget.drift == pytest.approx(0.9, abs=1e-3) and budget.select(tree, 4).nodes == path
    assert TrieBudget(enabled=False).select(tree, 1).nodes == list(range(1, tree.nodes + 1))


def test_a_walk_is_predicted_from_its_own_uniforms_where_the_trie_knows_the_drawn_intervals():
    """Two branches as likely as each other by their counts: [3, 4] drawn where u ∈ (0, 0.6],
    [7, 8] where u ∈ (0.6, 1] (then each the only way on, u ∈ (0, 1]). A walker's uniform at a
    move picks its branch: with σ small each walker reaches its own branch's nodes and nothing
    of the other's, where the counts alone expect 0.9 walkers on each branch of two walkers (2 ·
    ρ 0.9 · 2/4). A uniform at an interval's end is half on either side; a node deeper than the
    walkers' uniforms is never reached."""
    tree = PromptTree()
    tree.insert([3, 4], times=2, intervals=[(0.0, 0.6), (0.0, 1.0)])
    tree.insert([7, 8], times=2, intervals=[(0.6, 1.0), (0.0, 1.0)])
    three, seven = tree.children[0][3], tree.children[0][7]
    four, eight = tree.children[three][4], tree.children[seven][8]
    budget = TrieBudget()
    assert budget.shift == 0.05  # the prior, before any pass
    budget.observe_shifts(np.zeros((500, 2)), np.full((500, 2), 0.01))  # ends moved by 0.01
    assert budget.shift == pytest.approx((10 + 0.05) / 1001)
    both_three = np.array([[0.3, 0.5], [0.45, 0.2]])
    reach = reach_of(budget, tree, both_three)
    assert reach[[three, four]] == pytest.approx([2.0, 2.0], abs=1e-5)
    assert reach[[seven, eight]] == pytest.approx([0.0, 0.0], abs=1e-5)
    counted = reach_of(budget, tree, None)
    assert counted[[three, four, seven, eight]] == pytest.approx([0.9, 0.81, 0.9, 0.81])
    split = reach_of(budget, tree, np.array([[0.3, 0.5], [0.6, 0.5]]))
    assert split[[three, seven]] == pytest.approx([1.5, 0.5], abs=1e-5)  # 0.6: an end
    shallow = reach_of(budget, tree, both_three[:, :1])
    assert shallow[[three, four]] == pytest.approx([2.0, 0.0], abs=1e-5)
    prices = TriePrices(node_cost=1.0, token_cost=1.0)  # a node pays where > 1 walker reaches
    prices.observe_shifts(np.zeros((500, 2)), np.full((500, 2), 0.01))
    assert prices.select(tree, 2, both_three).nodes == [three, four]
    assert prices.select(tree, 2).nodes == []  # the counts alone: 0.9 walkers at most


def test_a_policy_sharpened_on_its_history_is_predicted_to_walk_it_further():
    """History drew [3] where u ∈ (0, 0.3] (then [4], the only way on); RL has since made it
    likelier, and in hindsight the responses went on to it wherever u ≤ 0.8 (elsewhere to a new
    token, 9). The held intervals predict 0.3 of those walkers; call after call δ moves until the
    widened intervals predict as many walkers as reached the nodes (logit 0.8 − logit 0.3 ≈ 2.23).
    A policy that moved away from its history (the walks reach less) takes δ below 0."""
    tree = PromptTree()
    tree.insert([3, 4], intervals=[(0.0, 0.3), (0.0, 1.0)])
    three = tree.children[0][3]
    walkers = 1000
    uniforms = np.stack([(np.arange(walkers) + 0.5) / walkers, np.full(walkers, 0.5)], 1)
    responses = [[3, 4] if u <= 0.8 else [9] for u in uniforms[:, 0]]
    realised = sum(reachable(tree, tree.snapshot(), responses, np.zeros((2, DRIFT_BUCKETS))))
    assert realised == 2 * 800
    budget = TrieBudget()
    budget.observe_shifts(np.zeros((500, 2)), np.full((500, 2), 0.001))  # σ ≈ 5.5e-4

    def reach() -> np.ndarray:
        return expected_walkers(
            [tree], [walkers], [uniforms], budget.drifts, budget.shift, budget.sharpening
        )[0]

    assert budget.sharpening == 0.0 and reach()[three] == pytest.approx(0.3 * walkers, rel=0.01)
    assert budget.select(tree, walkers, uniforms).reach == pytest.approx(reach().sum())
    for _ in range(20):
        budget.observe_reach(reach().sum(), realised)
    assert budget.sharpening == pytest.approx(2.23, abs=0.05)
    assert reach()[three] == pytest.approx(0.8 * walkers, rel=0.02)
    budget.observe_reach(realised, realised)  # as predicted: δ stays
    assert budget.sharpening == pytest.approx(2.23, abs=0.05)
    away = TrieBudget()
    away.observe_reach(600.0, 300.0)
    assert away.sharpening == pytest.approx(math.log(301 / 601)) and away.sharpening < 0


def test_with_the_policy_fixed_the_predicted_walks_verify_what_the_walks_reach(toy_run):
    """The built-in policy, its weights fixed, four rounds: each token is drawn in the interval
    its walk or decoding saw (`draw`), the trie keeps it, and a trie pass finds the same
    interval for the same move (the ends' shift σ falls to float rounding). From then on the
    budget predicts every walk: it verifies the nodes the walks reach and no other, and what they
    reuse is all a walk of the whole trie would (prices: a node pays where a walker reaches it)."""
    prompts, weights, model, eos = toy_run
    engine = HFEngine(model, eos, PAD)
    engine.load_weights(weights[0])
    stage = trie_stage(engine, RUN_SAMPLINGS["t1"], 72)
    stage.reuse.budget = TriePrices(node_cost=1.0, token_cost=1.5)
    verified: list[set[tuple[int, ...]]] = []  # each round's verified nodes, as token paths
    verify_tries = engine.verify_tries

    def recording(requests, prefixes=None):
        paths = set()
        for r in requests:
            at = [()]
            for parent, token in zip(r.parents, r.tokens, strict=True):
                at.append((*at[parent], token))
            paths |= set(at[1:])
        verified.append(paths)
        return verify_tries(requests, prefixes)

    engine.verify_tries = recording
    for step in range(1, 5):
        rollouts, stats = stage(prompts, 8, (1, step, 0), step)
        if step < 3:  # no history, then a σ still at its prior
            continue
        assert stage.reuse.budget.shift < 1e-4
        assert stats.reused_tokens == stats.trie_reachable_tokens > 0
        paths, reached = verified[-1], set()
        for r in rollouts:  # a walk reuses the longest verified path its response starts with
            tokens = tuple(r.token_ids)
            depth = 0
            while depth < len(tokens) and tokens[: depth + 1] in paths:
                depth += 1
            reached |= {tokens[:k] for k in range(1, depth + 1)}
        assert reached == paths, (len(reached), len(paths))


def reach_of(budget: TrieBudget, tree: PromptTree, uniforms: np.ndarray | None) -> np.ndarray:
    """E[walkers reaching each node] of `tree` walked by two walkers, at the budget's ρ and σ."""
    return expected_walkers([tree], [2], [uniforms], budget.drifts, budget.shift)[0]


def walked(moves: dict[int, tuple[float, float]]) -> np.ndarray:
    """[moves taken, moves predicted] by kind of move, as `reachable` adds them up."""
    out = np.zeros((2, DRIFT_BUCKETS))
    for kind, (taken, predicted) in moves.items():
        out[:, kind] = taken, predicted
    return out


def test_each_kind_of_move_has_its_own_drift():
    """A branch one earlier response took is walked less often than its share says (of the
    branches a few samples show, the rare ones were lucky to be seen): its drift, fitted apart,
    prunes such branches and the chains below them, and leaves the branches more responses took
    as they were."""
    tree = trie_of(RESPONSES)  # [9, 9, 9, 9, 9]: 1 of 5 responses, then its only way on
    nines = [tree.children[0][9]]
    while tree.children[nines[-1]]:
        nines.append(tree.children[nines[-1]][9])
    path = [tree.children[0][3]]  # [3], [3, 4], [3, 4, 5]: 4 of 5, 3 of 4, 2 of 3
    path += [tree.children[path[-1]][4], tree.children[tree.children[path[-1]][4]][5]]
    assert drift_bucket(5, 1) == 4 and drift_bucket(1, 1) == 0 and drift_bucket(5, 4) == 5
    assert drift_bucket(3, 3) == 2 and drift_bucket(7, 7) == 3 and drift_bucket(4, 2) == 5
    budget = TrieBudget()
    budget.observe_verify(1.0, 1)
    budget.observe_decode(1.0, 1)
    before = budget.select(tree, 10).nodes  # 10 · 0.9 · 1/5 · 0.9^k > 1 down the nines
    assert set(nines) | set(path) | {tree.children[path[0]][8]} <= set(before)
    budget.observe_walks(walked({4: (0.0, 9.0)}))  # such branches: nine predicted, none taken
    assert budget.drifts[4] == pytest.approx(0.09) and budget.drifts[5] == 0.9
    assert budget.select(tree, 10).nodes == path  # 10 · 0.9 · 4/5 · 0.09 · 1/4 < 1: not [3, 8]


def test_before_its_first_pass_the_budget_prices_a_node_as_a_prefilled_position():
    budget = TrieBudget()
    counts = ForwardCounts()
    budget.observe_prefill(counts)
    assert budget.node_cost is None  # no prefill yet
    counts.record("prefill", rows=2, positions=40, kv_reads=40, attended=400)
    counts.add_seconds("prefill", 2.0)
    budget.observe_prefill(counts)
    assert budget.node_cost == pytest.approx(0.05)
    counts.record("prefill", rows=1, positions=10, kv_reads=10, attended=100)
    counts.add_seconds("prefill", 1.5)
    budget.observe_prefill(counts)  # the new forwards only, the earlier ones decayed
    assert budget.node_cost == pytest.approx((0.8 * 2.0 + 1.5) / (0.8 * 40 + 10))
    budget.observe_verify(3.0, 10)  # a timed pass: its price from now on
    assert budget.node_cost == pytest.approx(0.3)
    untimed = TrieBudget()  # an engine that does not time its forwards
    counts = ForwardCounts()
    counts.record("prefill", rows=2, positions=40, kv_reads=40, attended=400)
    untimed.observe_prefill(counts)
    assert untimed.node_cost is None


def test_a_pass_prices_its_prompt_positions_beyond_what_decodings_prefill_spends_on_them():
    """prompt_cost = c_node − c_prefill per position, both as measured: nothing before both are,
    nothing where a pass computes a position more cheaply than the prefill."""
    budget = TrieBudget()
    assert budget.prompt_cost == 0.0
    budget.observe_verify(1.2, 100)  # c_node = 12 ms
    assert budget.prompt_cost == 0.0  # no prefill measured yet
    budget.observe_prefill(ForwardCounts(prefill_computed_positions=200, prefill_seconds=2.0))
    assert budget.prompt_cost == pytest.approx(0.002)
    budget.observe_verify(0.0, 400)  # passes now far cheaper per position than the prefill
    assert budget.prompt_cost == 0.0


def test_a_reused_token_saves_a_row_and_the_share_of_forwards_reuse_removes():
    """c_token = cs + (a − cs) · f: one row of decode forwards (cs, fitted to the forwards as
    c0 + cs · rows), and the share f of the rest of the average a that reuse removes from the
    loop (measured in hindsight; before that, the expected reuse)."""
    width = DraftWidth(4)
    for rows in range(2, 34, 4):
        width.observe_forward(rows, rows, 0.1 + 0.01 * rows)  # c0 = 0.1 s, cs = 0.01 s
    budget = TrieBudget(width=width)
    assert budget.token_cost(0.5) is None  # decoding not measured yet
    budget.observe_decode(5.0, 100)  # a = 0.05 s per token
    assert budget.row_cost == pytest.approx(0.01)
    assert budget.token_cost(0.0) == pytest.approx(0.01)
    assert budget.token_cost(1.0) == pytest.approx(0.05)
    assert budget.token_cost(0.5) == pytest.approx(0.03)
    assert TrieBudget().token_cost(0.0) is None


def test_where_a_response_lands_in_its_trie_as_the_step_found_it():
    """A walk of the whole trie in hindsight: the response's leading tokens on a path of the
    nodes that existed (ids below len(count)), and the moves the counts then predicted."""
    tree = trie_of([*RESPONSES, [3]])  # [3] stopped at its length: 1 of [3]'s 5 went no further

    def landed(response):
        moves = np.zeros((2, DRIFT_BUCKETS))
        return reachable(tree, seen, [response], moves)[0], moves

    seen = tree.snapshot()
    # predicted at the root 5/6 to [3] and 1/6 to [9], then 3/5 to [3, 4] and 1/5 to [3, 8],
    # 2/3 and 1/3 below [3, 4], 1/2 to each child of [3, 4, 5]: the moves taken along branches
    # more than one response took, and one down a branch only one took
    reached, moves = landed([3, 4, 5, EOS])
    assert reached == 4 and moves.sum(1).tolist() == pytest.approx([4, 1.0 + 4 / 5 + 1.0 + 1.0])
    assert moves[:, 5].tolist() == pytest.approx([3, 5 / 6 + 3 / 5 + 2 / 3])
    assert moves[:, 4].tolist() == pytest.approx([1, 1 / 6 + 1 / 5 + 1 / 3 + 1 / 2 + 1 / 2])
    reached, moves = landed([3, 8, 1])  # [3, 8] has no children
    assert reached == 2 and moves.sum(1).tolist() == pytest.approx([2, 1.0 + 4 / 5])
    reached, moves = landed([7, 3])
    assert reached == 0 and moves.sum(1).tolist() == pytest.approx([0, 1.0])
    tree.insert([3, 4, 5, 7, 7])  # a response of this step (online trees): not in the history
    tree.insert([3])  # and one that ends where history went on
    reached, moves = landed([3, 4, 5, 7, 7])
    assert reached == 3 and moves.sum(1).tolist() == pytest.approx([3, 1.0 + 4 / 5 + 1.0 + 1.0])
    reached, moves = landed([3, 4, 5, EOS])
    assert reached == 4 and moves.sum(1).tolist() == pytest.approx([4, 1.0 + 4 / 5 + 1.0 + 1.0])
    # a prompt's slots walked together (their shared nodes weighed once): what each walk adds
    responses = [[3, 4, 5, EOS], [3, 8, 1], [7, 3], [3, 4, 5, EOS], [3, 4, 5, 7, 7], []]
    together = np.zeros((2, DRIFT_BUCKETS))
    assert reachable(tree, seen, responses, together) == [4, 2, 0, 4, 3, 0]
    one_by_one = sum(landed(response)[1] for response in responses)
    assert together.tolist() == [pytest.approx(row) for row in one_by_one.tolist()]


def test_a_reused_token_is_priced_by_the_decode_forwards_its_reuse_removes():
    """f = ((F − F') / F) / (H / T) over a call's slots, had every node been verified: reuse
    that leaves one slot's whole response to decode removes no forward of the loop."""
    width = DraftWidth(4)
    for rows in range(2, 34, 4):
        width.observe_forward(rows, rows, 0.1 + 0.01 * rows)  # c0 = 0.1 s, cs = 0.01 s
    budget = TrieBudget(width=width)
    budget.observe_verify(0.03, 1)
    budget.observe_decode(5.0, 100)  # a = 0.05 s per token
    assert budget.loop_factor is None  # no evidence: f is the expected reuse r
    tree = trie_of([[3, 4, 5, 6]] * 4)
    assert len(budget.select(tree, 4).nodes) == 4  # f = r ≈ 0.77: 4 · 0.9^4 · 0.041 > 0.03
    budget.observe_loop([10, 10, 10, 10], [9, 9, 9, 0])  # one slot decodes all 10: F' = F
    assert budget.loop_factor == 0.0
    assert budget.select(tree, 4).nodes == [1, 2]  # a row: 4 · 0.9² · 0.01 > 0.03 > 4 · 0.9³ · 0.01
    budget = TrieBudget(width=width)
    budget.observe_loop([10, 8, 6, 4], [8, 8, 6, 0])  # F = 10, F' = 4: 0.6 of it, at 22/28
    assert budget.loop_factor == pytest.approx(0.6 / (22 / 28))
    budget = TrieBudget()
    budget.observe_loop([10, 10], [10, 10])  # everything reused: the loop is gone
    assert budget.loop_factor == 1.0
    budget = TrieBudget()
    budget.observe_loop([10, 2], [8, 0])  # reuse on the slowest slot: 0.8 at 8/12, at most 1
    assert budget.loop_factor == 1.0
    graphs = TrieBudget(width=width, rows_free=True)  # a bucket's graph computes all its rows
    graphs.observe_decode(5.0, 100)
    graphs.observe_loop([10, 8, 6, 4], [8, 8, 6, 0])
    assert graphs.row_cost == 0.0 and graphs.token_cost(0.5) == pytest.approx(0.025)
    assert graphs.hindsight_token_cost == pytest.approx(0.1 * 6 / 22)  # c0 per forward removed


def test_late_in_rl_a_reused_token_is_priced_by_the_forwards_it_removes_not_by_the_few_decoded():
    """Once most tokens are reused, the few slots that decode run nearly as many forwards as the
    longest tail, so decoding's seconds per token decoded grow far past what a reused token
    saves: c_token = cs + c0 · (F − F') / H, whatever decoding's average. Seven slots of eight
    reuse their whole 10 tokens and one reuses 5: the loop is 5 forwards shorter for 75 tokens
    reused, and a token is worth a row and a fifteenth of a forward's c0."""
    width = DraftWidth(4)
    for rows in range(2, 34, 4):
        width.observe_forward(rows, rows, 0.1 + 0.01 * rows)  # c0 = 0.1 s, cs = 0.01 s
    budget = TrieBudget(width=width)
    budget.observe_verify(0.03, 1)
    budget.observe_decode(5 * 0.11, 5)  # the 5 tokens decoded in 5 forwards of one row
    budget.observe_loop([10] * 8, [10] * 7 + [5])
    assert budget.average_token_cost == pytest.approx(0.11)
    assert budget.forwards_per_reused_token == pytest.approx(5 / 75)
    assert budget.hindsight_token_cost == pytest.approx(0.01 + 0.1 * 5 / 75)
    # the old price, cs + (a − cs) · f with f = (5 / 10) / (75 / 80), is 3.8 times that
    assert budget.token_cost(budget.loop_factor) == pytest.approx(0.01 + 0.1 * 0.5 / (75 / 80))
    tree = trie_of([[3, 4, 5, 6]] * 6 + [[3, 4, 7]] * 2)
    # 8 walkers, ρ 0.9 (the prior): the path six responses took pays (its last node: 3.9
    # expected walkers · 0.0167 s > 0.03 s); the branch two took, 6.48 · 0.9 · 2/8 = 1.46
    # walkers, saves 0.024 s, less than its 0.03 s (at the old price it saved 0.092 s)
    assert budget.select(tree, 8).nodes == [1, 2, 3, 4]
    assert TrieBudget(width=width).hindsight_token_cost is None  # no loop evidence yet


def test_a_fit_that_finds_rows_free_on_an_engine_that_computes_them_prices_a_token_as_decodings_average():
    """Forwards too alike in batch size can fit a row's cost at or below zero (the built-in run,
    step 100: a token priced at a tenth of a node, and the next step verified nothing). A row is
    never free where the engine computes each: the fit is no measurement of it, and c_token is
    decoding's average, as before a fit."""
    width = DraftWidth(4)
    for rows in range(2, 34, 4):
        width.observe_forward(rows, rows, 0.2 - 0.001 * rows)  # seconds fall as rows grow
    assert width.cost()[1] == width.least_cost
    budget = TrieBudget(width=width)
    budget.observe_verify(0.03, 1)
    budget.observe_decode(5.0, 100)  # a = 0.05 s per token
    budget.observe_loop([10, 10, 10, 10], [9, 9, 9, 0])  # reuse removes no forward of the loop
    assert budget.row_cost is None and budget.hindsight_token_cost is None
    assert budget.token_cost(0.0) == pytest.approx(0.05)
    assert budget.select(trie_of([[3, 4, 5, 6]] * 4), 4).nodes == [1, 2, 3, 4]


@pytest.mark.parametrize("token_cost", [0.4, 1e-6], ids=["pruned", "nothing-pays"])
def test_a_pruned_trie_keeps_the_rollouts_vanilla_token_for_token(toy_run, token_cost):
    """Where the budget verifies part of a trie (or none of it: then no trie pass runs at all),
    a walk leaves at the first pruned node and decoding draws the same token there."""
    prompts, weights, model, eos = toy_run
    engine = HFEngine(model, eos, PAD)
    stage = trie_stage(engine, RUN_SAMPLINGS["t1"], 72)
    stage.reuse.budget = TriePrices(node_cost=1.0, token_cost=token_cost)
    tokens = agree = reused = scored = stored = skipped = verify_forwards = reachable = 0
    for step, state in enumerate(weights, start=1):
        engine.load_weights(state)
        key = (1, step, 0)
        before = engine.counts.verify_forwards
        trie, stats = stage(prompts, 8, key, step)
        verify_forwards += engine.counts.verify_forwards - before
        vanilla = sample_rollouts(engine, prompts, 8, RUN_SAMPLINGS["t1"], 72, key, step)
        for a, b in zip(trie, vanilla, strict=True):
            tokens += max(len(a.token_ids), len(b.token_ids))
            agree += sum(x == y for x, y in zip(a.token_ids, b.token_ids, strict=False))
        reused, scored = reused + stats.reused_tokens, scored + stats.trie_nodes
        stored, skipped = stored + stats.trie_nodes_stored, skipped + stats.trie_prompts_skipped
        reachable += stats.trie_reachable_tokens
    assert agree >= 0.999 * tokens, (agree, tokens)
    assert reachable > reused  # the budget's evidence covers the nodes it did not verify
    if token_cost < 1e-3:
        assert (reused, scored, verify_forwards) == (0, 0, 0)
        assert skipped == 3 * len(prompts)  # every prompt of the three rounds with a history
    else:
        assert 0 < scored < 0.5 * stored and reused >= 0.2 * tokens


def test_a_pruned_trie_keeps_the_rollouts_distributed_as_the_policy():
    """The adversarial history of the test above, its rare nodes pruned: chi-square, p > 1e-3."""
    vocab, max_len, n = 5, 3, 20_000
    prompt = Prompt((2, 3), Example("p", "", "test"))
    target, drafter = target_and_drafter(vocab, n)
    stage = trie_stage(target, SAMPLING, max_len)
    # 20k walkers: a node pays when 20k · count / 64 > 1000, when 4 or more responses share it
    stage.reuse.budget = TriePrices(node_cost=1.0, token_cost=1e-3)
    history = sample_rollouts(drafter, [prompt], 64, SAMPLING, max_len, ("history",), 0)
    stage.tree.begin(prompt.prompt_id)
    stage.tree.insert_all((prompt.prompt_id, r.token_ids) for r in history)
    rollouts, stats = stage([prompt], n, ("trie",), 1)
    assert 0 < stats.trie_nodes < stats.trie_nodes_stored and stats.reused_tokens > 0
    assert distribution_pvalue(target, prompt, rollouts, vocab, max_len) > 1e-3


class PassPrices(TriePrices):
    """Fixed prices, and a fixed cost of a forward besides its rows (c0)."""

    def __init__(
        self, node_cost: float, token_cost: float, forward_cost: float, prompt_cost: float = 0.0
    ) -> None:
        super().__init__(node_cost, token_cost, prompt_cost)
        self.fixed_forward = forward_cost

    @property
    def forward_cost(self) -> float:
        return self.fixed_forward


def test_a_pass_runs_only_when_its_nodes_pay_for_what_it_costs_beyond_decodings_prefill():
    """Prompt a has a history, prompt b none, so decoding prefills b whatever happens and a pass
    over a's trie is a forward more: it runs only if its nodes are expected to save more than
    that forward's fixed cost c0. A pass over every prompt that decodes replaces the prefill; it
    still computes its prompt positions more dearly than the prefill would (`prompt_cost` each),
    and runs only if its nodes save more than that. Either way the rollouts are vanilla's, token
    for token."""
    engine = HFEngine(make_tiny_model(init=0.3), [EOS], PAD)
    sampling, max_len = SamplingParams(1.0), 6
    a, b = Prompt((2, 5, 7), Example("a", "", "test")), Prompt((4, 6), Example("b", "", "test"))
    history = sample_rollouts(engine, [a], 8, sampling, max_len, ("history",), 0)
    tree = trie_of([r.token_ids for r in history])
    saving = TriePrices(node_cost=0.1, token_cost=1.0).select(tree, 8).saving
    assert 0 < saving < math.inf
    per_position = saving / len(a.ids)  # a's prompt positions at this price: the saving
    for prompts, forward_cost, prompt_cost, runs in (
        ([a, b], 2 * saving, 0.0, False),  # the nodes save less than the forward the pass adds
        ([a, b], saving / 2, 0.0, True),
        ([a], 2 * saving, 0.0, True),  # no prefill beside it: the pass adds no forward
        ([a], 2 * saving, 2 * per_position, False),  # its prompt costs more than the nodes save
        ([a], 2 * saving, per_position / 2, True),
        ([a, b], 0.6 * saving, 0.6 * per_position, False),  # either alone would pay, not both
    ):
        stage = trie_stage(engine, sampling, max_len)
        stage.reuse.budget = PassPrices(0.1, 1.0, forward_cost, prompt_cost)
        stage.tree.begin(a.prompt_id)
        stage.tree.insert_all((a.prompt_id, r.token_ids) for r in history)
        before = engine.counts.verify_forwards
        rollouts, stats = stage(prompts, 8, ("now",), 1)
        assert (engine.counts.verify_forwards - before, stats.trie_passes_skipped) == (
            (1, 0) if runs else (0, 1)
        )
        assert stats.trie_prompts_skipped == (0 if runs else 1)
        assert (stats.trie_nodes > 0) == runs and (stats.reused_tokens > 0) == runs
        vanilla = sample_rollouts(engine, prompts, 8, sampling, max_len, ("now",), 1)
        assert [r.token_ids for r in rollouts] == [r.token_ids for r in vanilla]


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """Prompts of the built-in task and the shipped policy's weights after each of four steps
    of a training run (a high learning rate, so that they move)."""
    from specrl.data import load_prompts
    from specrl.models import eos_token_ids, load_policy
    from specrl.trainer import Trainer

    out = tmp_path_factory.mktemp("toy-run")
    cfg = load_config(
        None,
        [
            f"trainer.output_dir={out}", "trainer.logger=[jsonl]", "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=8", "data.val_size=8", "actor.optim.lr=1e-4",
        ],
    )  # fmt: skip
    trainer = Trainer(cfg)
    states = []
    for _ in range(4):
        states.append({k: v.clone() for k, v in trainer.run.actor.policy.state_dict().items()})
        trainer.run.global_step += 1
        trainer.train_step()
    policy, tokenizer = load_policy(trainer.run.model_dir, "float32")
    prompts, _ = load_prompts(cfg.data, tokenizer, 1, print)
    return prompts[:16], states, policy.eval(), eos_token_ids(policy, tokenizer)


def test_trie_rollouts_are_distributed_as_the_policy_with_an_adversarial_history():
    """20k slots of one prompt whose trie holds another policy's samples: trie rollouts must be
    distributed as the current policy's own samples (chi-square, p > 1e-3)."""
    vocab, max_len, n = 5, 3, 20_000
    prompt = Prompt((2, 3), Example("p", "", "test"))
    target, drafter = target_and_drafter(vocab, n)
    stage = trie_stage(target, SAMPLING, max_len)
    history = sample_rollouts(drafter, [prompt], 64, SAMPLING, max_len, ("history",), 0)
    stage.tree.begin(prompt.prompt_id)
    stage.tree.insert_all((prompt.prompt_id, r.token_ids) for r in history)
    rollouts, stats = stage([prompt], n, ("trie",), 1)
    assert 0 < stats.reused_tokens < stats.response_tokens  # the walk takes part of the tokens
    assert stats.trie_nodes == trie_of(r.token_ids for r in history).nodes  # one pass, each once
    assert distribution_pvalue(target, prompt, rollouts, vocab, max_len) > 1e-3


def test_trie_reuse_is_the_exact_rules_default_unless_drafts_are_verified_in_decoding():
    assert load_config(None, []).rollout.spec.reuse == "trie"
    assert load_config(None, ["rollout.spec.acceptance=specrl"]).rollout.spec.reuse == "slot"
    on_vllm = load_config(None, ["rollout.name=vllm"]).rollout.spec
    assert (on_vllm.reuse, on_vllm.verify_mode) == ("slot", "decoding")
    trie_on_vllm = load_config(None, ["rollout.name=vllm", "rollout.spec.reuse=trie"])
    assert trie_on_vllm.rollout.spec.verify_mode == "full"
    with pytest.raises(ConfigError, match="reuse=trie samples every token as vanilla"):
        load_config(None, ["rollout.spec.reuse=trie", "rollout.spec.acceptance=specrl"])
    with pytest.raises(ConfigError, match="verify_mode=decoding verifies each slot's stored"):
        load_config(
            None,
            ["rollout.spec.reuse=trie", "rollout.name=vllm", "rollout.spec.verify_mode=decoding"],
        )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_trie_rollouts_on_a_chat_like_policy_differ_only_at_float32_near_ties(dtype):
    """A tiny policy shaped like a real chat model (a vocabulary of 4096, pad == eos == the end
    of every turn inside the prompts, prompts of different lengths in one batch): in float64
    the trie arm is vanilla token for token; in float32 every slot that differs first differs
    where the uniform lies within float error of the boundary between the two tokens."""
    engine = HFEngine(make_chat_like_model().to(dtype), [CHAT_EOS], CHAT_EOS)
    prompts = chat_like_prompts(8)
    assert len({len(p.ids) for p in prompts}) > 4 and all(CHAT_EOS in p.ids for p in prompts)
    comparison = compare_trie_with_vanilla(engine, prompts, 8, SamplingParams(1.0), 24, 3)
    assert comparison.tokens >= 4000 and comparison.reused >= 0.1 * comparison.tokens
    for flip in comparison.flips:
        assert flip.margin <= flip.float_error, flip
    if dtype == torch.float64:
        assert not comparison.flips
