"""Where a prompt's walkers are expected to go in its history trie: E[walkers reaching v] for
every node v, what the trie budget (budget.py) weighs a node's verification by.

**From the counts.** A walker at node u moves to child v with probability ≈ ρ_k · count[v] /
count[u]: the share of u's earlier responses that went on to v, times the drift of that kind of
move (`drift_bucket`), the same for every walker.

**From the walker's own uniforms.** A walker's uniforms are known before the pass (the seeded
uniforms of its response positions), and a trie keeps, for each node, the drawn interval (a, b]
of the move to it: the uniforms that drew its token there under the policy of its last draw
(`sampling.draw`, kept from the walks' and decoding's draws by `PromptTree`). The current policy
has moved those ends a little; with the move Laplace-distributed of scale σ (the budget's `shift`:
the mean distance the ends of verified nodes moved from what the trie held), a walker with uniform
u at the move takes it with P = F(u − a) − F(u − b). Where the trie knows the intervals, the
expected walkers at v are the sum over the walkers of the product of their own P along the path:
each walker's path predicted, not the average walker's. The counts price the moves whose intervals
the trie does not know (tokens of an engine whose sampler is not specrl's, run-ahead responses).

**Sharpened.** RL moves the policy towards what it sampled: early in a real model's run the
tokens its history drew have grown likelier since (SmolLM2 chain_sum, steps 9-34: the held
intervals predicted 0.43 of the walkers that reached the tries' nodes in hindsight,
`benchmarks/cpu-hf-smollm2-trie-calibration`). So an interval is taken to have widened about its
middle, its width w now logistic(logit w + δ) (`widened`), δ the budget's `sharpening`: moved on
every call until the walkers predicted over the tries' nodes are as many as reached them in
hindsight (negative where the policy moved away from its history).

Every move's probability is at most 1, so along a path the expected walkers never grow.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from specrl.speculative.tree import PromptTree

DRIFT_BUCKETS = 6  # the kinds of move ρ is fitted apart for (`drift_bucket`)


def drift_bucket(parent_count: int, count: int) -> int:
    """What kind of move a walker makes from a node `parent_count` earlier responses passed
    through to a child `count` of them went on to: 0-3, the only way on so far, its count 1, 2,
    3 or more (one earlier response is one sample of where the policy goes); 4, a branch one
    response took; 5, a branch more took (a branch seen once among many was likelier than its
    share to be seen at all)."""
    if count == parent_count:
        return min(count, 4) - 1
    return 4 if count == 1 else 5


def expected_walkers(
    trees: Sequence[PromptTree],
    walkers: Sequence[int],
    uniforms: Sequence[np.ndarray | None],
    drifts: np.ndarray,
    shift: float,
    sharpening: float = 0.0,
) -> list[np.ndarray]:
    """E[walkers reaching each node] [N + 1] (0 at the root) of each of `trees`, walked by
    `walkers[i]` slots whose uniforms at response positions 0, 1, ... are `uniforms[i]`
    [walkers[i], R] (None: not known; then nodes deeper than R are never reached), with drifts ρ_k
    per kind of move (`drifts` [DRIFT_BUCKETS]), the intervals' shift σ (`shift`) and their
    sharpening δ (`sharpening`). The trees are walked together, depth by depth, as one forest of
    `max(walkers)` walkers (those a tree lacks reach nothing)."""
    sizes = [len(tree.count) for tree in trees]
    offsets = np.cumsum([0, *sizes])
    roots = offsets[:-1]
    count = np.concatenate([np.asarray(t.count, dtype=np.float64) for t in trees])
    # a root's parent (-1) becomes a node of the tree before: never read (depth 0)
    parent = np.concatenate([np.asarray(t.parent) + r for t, r in zip(trees, roots, strict=True)])
    depth = np.concatenate([np.asarray(t.depth) for t in trees])
    lower = np.concatenate([np.asarray(t.lower) for t in trees])
    upper = np.concatenate([np.asarray(t.upper) for t in trees])
    nodes = np.flatnonzero(depth > 0)
    up = parent[nodes]
    held = count.astype(np.int64)
    kinds = [
        drift_bucket(*move) for move in zip(held[up].tolist(), held[nodes].tolist(), strict=True)
    ]
    width = max(walkers)
    move = np.zeros((len(count), width))  # [N + 1 over all trees, W]
    move[nodes] = (drifts[kinds] * count[nodes] / count[up])[:, None]
    horizon = np.repeat([len(count) if u is None else u.shape[1] for u in uniforms], sizes)
    # each node's walkers' uniforms at its move (NaN: not known, or no such walker)
    at = np.full((len(count), width), np.nan)
    for tree_uniforms, first, size in zip(uniforms, roots, sizes, strict=True):
        if tree_uniforms is not None:
            moves = np.arange(first + 1, first + size)
            position = np.minimum(depth[moves], tree_uniforms.shape[1]) - 1  # deeper: below
            at[moves, : len(tree_uniforms)] = tree_uniforms[:, position].T
    predicted = move_probability(at, lower[:, None], upper[:, None], shift, sharpening)
    known = ~np.isnan(lower)[:, None] & ~np.isnan(at)
    move[known] = predicted[known]
    move[depth > horizon] = 0.0
    move[np.arange(width)[None, :] >= np.repeat(walkers, sizes)[:, None]] = 0.0
    reach = np.ones((len(count), width))  # [N + 1 over all trees, W]
    order = np.argsort(depth, kind="stable")
    ends = np.cumsum(np.bincount(depth))
    for start, end in itertools.pairwise(ends.tolist()):  # depth by depth
        level = order[start:end]
        reach[level] = reach[parent[level]] * move[level]
    expected = reach.sum(1)
    expected[roots] = 0.0
    return np.split(expected, offsets[1:-1])


def move_probability(
    at: np.ndarray, lower: np.ndarray, upper: np.ndarray, shift: float, sharpening: float
) -> np.ndarray:
    """P(a walker with uniform `at` takes a move whose drawn interval was (`lower`, `upper`]):
    the interval `widened` by δ (`sharpening`), its ends then moved by a Laplace shift of scale
    σ (`shift`)."""
    lower, upper = widened(lower, upper, sharpening)
    return _laplace_cdf(at - lower, shift) - _laplace_cdf(at - upper, shift)


def widened(
    lower: np.ndarray, upper: np.ndarray, sharpening: float
) -> tuple[np.ndarray, np.ndarray]:
    """Drawn intervals (a, b] as a policy sharpened by δ draws them: each width w taken to
    logistic(logit w + δ) about the same middle, moved back inside [0, 1] where it would cross
    an end (δ < 0 narrows them)."""
    if sharpening == 0.0:
        return lower, upper
    width = np.clip(upper - lower, 1e-12, 1.0 - 1e-12)
    width = 1.0 / (1.0 + (1.0 / width - 1.0) * np.exp(-sharpening))
    start = np.clip((lower + upper - width) / 2, 0.0, 1.0 - width)
    return start, start + width


def _laplace_cdf(x: np.ndarray, scale: float) -> np.ndarray:
    """P(X ≤ x) for X ~ Laplace(0, scale)."""
    half = 0.5 * np.exp(-np.abs(x) / scale)
    return np.where(x < 0, half, 1.0 - half)
