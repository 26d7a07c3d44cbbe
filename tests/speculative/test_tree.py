import math
import random

import numpy as np
import pytest

from specrl.config import SpecConfig, TreeConfig
from specrl.engines import SamplingParams
from specrl.engines.hf import HFEngine
from specrl.rollouts import sample_rollouts
from specrl.speculative.stage import SpeculativeStage
from specrl.speculative.token_trees import TokenTree
from specrl.speculative.tree import Cursor, PromptTree
from specrl.types import Example, Prompt
from tests.conftest import EOS, PAD, make_tiny_model
from tests.speculative.distributions import distribution_pvalue, target_and_drafter


class Reference:
    """Brute force over the stored responses: nodes are prefixes, created in insertion order."""

    def __init__(self):
        self.responses = []  # (round, tokens)
        self.round = 0

    def next_round(self, window):
        self.round += 1
        self.responses = [(r, t) for r, t in self.responses if r > self.round - window]

    def insert(self, tokens):
        self.responses.append((self.round, tuple(tokens)))

    def _nodes(self):
        ids, counts = {}, {}
        for _, seq in self.responses:
            for n in range(1, len(seq) + 1):
                ids.setdefault(seq[:n], len(ids) + 1)
                counts[seq[:n]] = counts.get(seq[:n], 0) + 1
        return ids, counts

    def propose(self, tokens, k):
        tokens = tuple(tokens)
        ids, counts = self._nodes()
        if not tokens or tokens in ids:
            context = tokens
        else:

            def match(p):
                m = 0
                while m < min(len(p), len(tokens)) and p[-1 - m] == tokens[-1 - m]:
                    m += 1
                return m

            longest = max((match(p) for p in ids), default=0)
            if longest == 0:
                return []
            context = min(
                (p for p in ids if match(p) == longest), key=lambda p: (-counts[p], ids[p])
            )
        out = []
        while len(out) < k:
            children = [p for p in ids if len(p) == len(context) + 1 and p[:-1] == context]
            if not children:
                break
            context = min(children, key=lambda p: (-counts[p], ids[p]))
            out.append(context[-1])
        return out

    def nodes(self):
        return len(self._nodes()[0])


def random_tokens(rng, n_max=8, vocab=4):
    return [rng.randrange(vocab) for _ in range(rng.randint(0, n_max))]


def test_insert_propose_evict_match_brute_force():
    rng = random.Random(0)
    for trial in range(60):
        tree, ref = PromptTree(), Reference()
        window = rng.randint(1, 3)
        cursor_tokens = random_tokens(rng, 3)
        cursor = Cursor(tree, cursor_tokens)
        for _ in range(40):
            op = rng.random()
            if op < 0.35:
                seq = random_tokens(rng)
                tree.insert(seq)
                ref.insert(seq)
            elif op < 0.45:
                tree.next_round(window)
                ref.next_round(window)
                cursor = Cursor(tree, cursor_tokens)  # node ids change on eviction
            elif op < 0.7:
                stored = [t for _, t in ref.responses]
                base = list(rng.choice(stored)) if stored and rng.random() < 0.6 else []
                query = base[: rng.randint(0, len(base))] + random_tokens(rng, 4)
                k = rng.randint(0, 6)
                expected = ref.propose(query, k)
                assert Cursor(tree, query).propose(k) == expected, (trial, query, k)
            else:
                token = rng.randrange(4)
                cursor.extend([token])
                cursor_tokens.append(token)
                assert cursor.propose(5) == ref.propose(cursor_tokens, 5), (trial, cursor_tokens)
            assert tree.nodes == ref.nodes()


def test_propose_follows_the_most_frequent_path_and_suffix_matches():
    tree = TokenTree()
    tree.begin("p")
    for seq in ([1, 2, 3, 9], [1, 2, 4, 9], [1, 2, 4, 8]):
        tree.insert("p", seq)
    assert tree.propose("p", [], 8) == [1, 2, 4, 9]  # 4 beats 3; 9 ties 8 and came first
    assert tree.propose("p", [1, 2, 3], 8) == [9]
    assert tree.propose("p", [7, 7, 2, 4], 8) == [9]  # left every path: suffix match on 2, 4
    assert tree.propose("p", [5], 8) == []
    assert tree.propose("unknown", [], 8) == []


def test_window_drops_old_rounds_and_max_nodes_evicts_least_recent_prompts():
    tree = TokenTree(window=2, max_nodes=6)
    tree.begin("a")
    tree.insert("a", [1, 2, 3])
    tree.begin("a")
    tree.insert("a", [4, 5])
    assert tree.nodes == 5 and tree.propose("a", [], 5) == [1, 2, 3]
    assert tree.begin("a") == 3  # round 1 fell out of the window
    assert tree.propose("a", [], 5) == [4, 5] and tree.nodes == 2
    tree.begin("b")
    tree.insert("b", [1, 2, 3, 4, 5])
    assert tree.evict() == 2  # 7 nodes > 6: "a" was rolled out least recently
    assert tree.nodes == 5 and len(tree) == 1 and tree.propose("a", [], 5) == []


def test_state_dict_round_trip():
    rng = random.Random(1)
    tree = TokenTree(window=3)
    for step in range(5):
        for pid in ("x", "y"):
            tree.begin(pid)
            for _ in range(3):
                tree.insert(pid, random_tokens(rng))
        if step == 2:
            tree.begin("z")
    restored = TokenTree(window=3)
    restored.load_state_dict(tree.state_dict())
    assert restored.nodes == tree.nodes and len(restored) == len(tree)
    for pid in ("x", "y", "z"):
        for _ in range(20):
            query = random_tokens(rng)
            assert restored.propose(pid, query, 6) == tree.propose(pid, query, 6)
    tree.begin("x"), restored.begin("x")  # rounds survive: the same responses fall out
    assert restored.nodes == tree.nodes


def test_a_node_keeps_the_drawn_interval_of_the_last_response_through_it_that_knew_it():
    """Through the window's rebuild and a state dict's round trip: the latest response's
    interval wins along shared paths; a response that did not know its intervals (NaN, or
    none given) leaves the older ones."""
    tree = TokenTree(window=2)
    tree.begin("p")
    tree.insert("p", [1, 2], intervals=[(0.1, 0.2), (0.0, 0.5)])
    tree.insert("p", [1, 3])  # not known: [1] keeps (0.1, 0.2)
    tree.begin("p")
    tree.insert("p", [1, 2, 4], intervals=[(0.15, 0.25), (math.nan, math.nan), (0.3, 0.9)])

    def drawn(t: TokenTree) -> dict[tuple[int, ...], float]:
        """Each node's path → its interval's ends."""
        p, out = t.get("p"), {}
        for v in range(1, p.nodes + 1):
            path, u = [], v
            while u:
                path.append(p.token[u])
                u = p.parent[u]
            out[(*reversed(path), 0)], out[(*reversed(path), 1)] = p.lower[v], p.upper[v]
        return out

    expected = ends({(1,): (0.15, 0.25), (1, 2): (0.0, 0.5), (1, 3): (math.nan, math.nan),
                     (1, 2, 4): (0.3, 0.9)})  # fmt: skip
    assert drawn(tree) == pytest.approx(expected, nan_ok=True)
    restored = TokenTree(window=2)
    restored.load_state_dict(tree.state_dict())
    assert drawn(restored) == pytest.approx(expected, nan_ok=True)
    tree.begin("p")  # round 1 falls out: [1, 2] and [1, 3] go, [1]'s round 2 interval stays
    after = ends({(1,): (0.15, 0.25), (1, 2): (math.nan, math.nan), (1, 2, 4): (0.3, 0.9)})
    assert drawn(tree) == pytest.approx(after, nan_ok=True)


def ends(intervals: dict[tuple[int, ...], tuple[float, float]]) -> dict[tuple[int, ...], float]:
    return {(*path, end): x for path, pair in intervals.items() for end, x in enumerate(pair)}


PROMPTS = [Prompt(ids, Example(str(ids), "", "test")) for ids in [(3, 4, 5), (6, 7), (2, 8, 9, 10)]]
SAMPLING = SamplingParams(1.0)


def tree_stage(engine, spec=False, **tree):
    """Tree drafts in decoding; with `spec`, each slot's stored draft verified whole before it
    (the verification budget decides from timings: two stages' budgets would cut differently)."""
    tree = {"enabled": True, "adaptive": False, **tree}
    cfg = SpecConfig(enabled=spec, reuse="slot", verify_budget=False, tree=TreeConfig(**tree))
    return SpeculativeStage(engine, SAMPLING, 12, cfg)


@pytest.mark.parametrize("online", [True, False])
def test_tree_drafts_speed_decoding_without_changing_rollouts(online):
    engine = HFEngine(make_tiny_model(seed=0, init=1.0), [EOS], PAD)
    stage = tree_stage(engine, online=online)
    for step in range(3):
        rollouts, stats = stage(PROMPTS, 4, ("s", step), step)
        vanilla = sample_rollouts(engine, PROMPTS, 4, SAMPLING, 12, ("s", step), step)
        assert [r.token_ids for r in rollouts] == [r.token_ids for r in vanilla]
        assert stats.tree_nodes == stage.tree.nodes > 0
        assert stats.tree_prompts == 3
    # by now trees hold earlier responses: drafts are proposed, some accepted
    assert 0 < stats.accepted_draft_tokens < stats.drafted_tokens
    assert stats.ratios()["spec/decode_drafts/tokens_per_forward"] > 1
    assert stats.draft_forwards < stats.decoded_tokens
    assert stats.ratios()["spec/decode_drafts/mean_width"] > 0


def test_spec_rl_plus_tree_equals_spec_rl_alone(engine):
    runs = [
        SpeculativeStage(
            engine,
            SAMPLING,
            12,
            SpecConfig(
                enabled=True, reuse="slot", verify_budget=False, tree=TreeConfig(enabled=False)
            ),
        ),
        tree_stage(engine, spec=True),
    ]
    for step in range(3):
        engine.model = make_tiny_model(seed=step)  # the policy changes: drafts get cut
        (a, _), (b, _) = (run(PROMPTS, 4, ("s", step), step) for run in runs)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
    # fully reused drafts and continuations after a cut enter the tree as whole responses
    for r in b:
        stored = [t for _, t in runs[1].tree.get(r.prompt.prompt_id).responses]
        assert tuple(r.token_ids) in stored


def test_window_and_node_limit_are_reported():
    engine = HFEngine(make_tiny_model(seed=0, init=1.0), [EOS], PAD)
    stage = tree_stage(engine, window=2, max_nodes=30)
    for step in range(2):
        _, stats = stage(PROMPTS, 4, ("s", step), step)
    assert stats.tree_evicted_nodes > 0  # step 0's responses left the window
    assert stats.tree_nodes == stage.tree.nodes <= 30


def snapshot(tree: PromptTree) -> tuple:
    """Everything a round reads of a prompt's tree, node by node."""
    fields = ("token", "parent", "count", "continued", "best")
    arrays = tuple(tuple(getattr(tree, name)) for name in fields)
    return (*arrays, np.array([tree.lower, tree.upper]).tobytes(), tuple(tree.responses))


def test_closing_a_round_leaves_the_next_round_the_tree_insert_and_begin_would():
    """`close_round` (a call's responses in, the next round's drops made now, in one rebuild)
    leaves each round the tree that inserting the responses and rebuilding at `begin` did, node
    ids, counts and drawn intervals included; it frees the nodes no kept earlier response holds,
    and the next `begin` has nothing left to drop."""
    rng = random.Random(3)
    for trial in range(40):
        window = rng.randint(1, 3)
        closed, inserted = TokenTree(window), TokenTree(window)
        for _ in range(6):
            prompt_ids = rng.sample(["a", "b", "c"], rng.randint(1, 3))
            for pid in prompt_ids:
                assert closed.begin(pid) == 0
                inserted.begin(pid)
                assert snapshot(closed.get(pid)) == snapshot(inserted.get(pid)), trial
            early = [(pid, random_tokens(rng)) for pid in prompt_ids if rng.random() < 0.3]
            closed.insert_all(early)  # responses reused whole go in before decoding
            inserted.insert_all(early)
            decoded = [
                (pid, tokens, intervals(rng, len(tokens)))
                for pid in prompt_ids
                for tokens in [random_tokens(rng) for _ in range(rng.randint(0, 4))]
            ]
            decoded += decoded[: rng.randint(0, len(decoded))]  # slots that drew alike
            before = {pid: closed.get(pid) for pid in prompt_ids}
            held_before = {pid: list(tree.responses) for pid, tree in before.items()}
            nodes_before = {pid: tree.nodes for pid, tree in before.items()}
            freed = closed.close_round(prompt_ids, decoded)
            inserted.insert_all(decoded)
            expected = 0
            for pid in prompt_ids:
                kept = [(r, t) for r, t in held_before[pid] if (r, t) in closed.get(pid).responses]
                expected += nodes_before[pid] - tree_of(kept).nodes
            assert freed == expected, trial
            assert closed.nodes == sum(closed.get(pid).nodes for pid in "abc" if closed.get(pid))


def intervals(rng: random.Random, n: int) -> list[tuple[float, float]] | None:
    """Drawn intervals for n tokens, some unknown (NaN), or None."""
    if rng.random() < 0.2:
        return None
    pairs = [(rng.random() / 2, 0.5 + rng.random() / 2) for _ in range(n)]
    return [(math.nan, math.nan) if rng.random() < 0.2 else pair for pair in pairs]


def tree_of(responses: list[tuple[int, tuple[int, ...]]]) -> PromptTree:
    tree = PromptTree()
    for _, tokens in responses:
        tree.insert(tokens)
    return tree


def test_exact_with_adversarial_tree_drafts_matches_the_target_distribution():
    """20k slots decoded with tree drafts built from another policy's samples: complete responses
    are distributed as the current policy's own samples (chi-square, p > 1e-3)."""
    vocab, max_len, n = 5, 3, 20_000
    prompt = Prompt((2, 3), Example("p", "", "test"))
    target, drafter = target_and_drafter(vocab, n)
    stage = SpeculativeStage(
        target,
        SAMPLING,
        max_len,
        SpecConfig(enabled=False, tree=TreeConfig(enabled=True, adaptive=False, online=False)),
    )
    stage.tree.begin(prompt.prompt_id)
    for r in sample_rollouts(drafter, [prompt], 64, SAMPLING, max_len, ("draft",), 0):
        stage.tree.insert(prompt.prompt_id, r.token_ids)
    rollouts, stats = stage([prompt], n, ("spec",), 1)
    assert 0 < stats.accepted_draft_tokens < stats.drafted_tokens

    assert distribution_pvalue(target, prompt, rollouts, vocab, max_len) > 1e-3
