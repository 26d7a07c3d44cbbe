"""History tries (`rollout.spec.reuse=trie`, the exact rule's default): each prompt's trie of
earlier responses verified in one pass (the engine's `verify_tries`), every slot walked down it
with the uniforms vanilla decoding would use (`walk_trie`); a slot decodes on from the node
where it leaves its trie."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from specrl.engines import Prefixes, RolloutEngine, SamplingParams, TrieLogprobs, TrieRequest
from specrl.engines.sampling import seeded_uniform
from specrl.speculative.reuse.base import Reuse
from specrl.speculative.slots import Reused, Slot
from specrl.speculative.stats import RolloutStats
from specrl.speculative.tree import ROOT, PromptTree, TokenTree
from specrl.types import FinishReason


class TrieReuse(Reuse):
    """Slots walk their prompt's history trie (the stage's token trees)."""

    every_turn_reuses = True

    def __init__(self, engine: RolloutEngine, tree: TokenTree, sampling: SamplingParams) -> None:
        self.engine = engine
        self.tree = tree
        self.sampling = sampling

    def before_decoding(
        self, slots: list[Slot], seed_key: tuple, prefixes: Prefixes | None, stats: RolloutStats
    ) -> None:
        """Score the history trie of every prompt (context) with slots that may reuse, in one
        pass, and walk each such slot down it, with the uniforms of its seed at its response
        positions: what vanilla decoding would draw there."""
        started = time.perf_counter()
        walkers = [
            i
            for i, s in enumerate(slots)
            if s.may_reuse
            and (tree := self.tree.get(s.prompt.prompt_id)) is not None
            and tree.nodes
        ]
        if not walkers:
            return
        groups: dict[tuple, list[int]] = {}  # (prompt id, context) → its walkers (rows below)
        for row, i in enumerate(walkers):
            groups.setdefault((slots[i].prompt.prompt_id, slots[i].prompt.ids), []).append(row)
        trees = [self.tree.get(prompt_id) for prompt_id, _ in groups]
        requests = [
            TrieRequest(ids, tree.parent[1:], tree.token[1:], self.sampling)
            for (_, ids), tree in zip(groups, trees, strict=True)
        ]
        verified = stats.timed(self.engine.verify_tries, requests, prefixes)
        stats.trie_prompts += len(requests)
        stats.trie_nodes += sum(len(r.tokens) for r in requests)
        stats.verified_tokens += sum(len(r.tokens) for r in requests)
        seeds = torch.tensor([slots[i].seed for i in walkers])[:, None]
        first = torch.tensor([len(slots[i].prompt.ids) for i in walkers])[:, None]
        positions = first + torch.arange(max(slots[i].budget for i in walkers))[None, :]
        uniforms = seeded_uniform(seeds.expand_as(positions), positions).numpy()  # [S, R]
        eos = self.engine.eos_token_ids
        for rows, tree, trie in zip(groups.values(), trees, verified, strict=True):
            walking = [slots[walkers[row]] for row in rows]
            walks = walk_trie(tree, trie, uniforms[rows], [s.budget for s in walking], eos)
            for s, walked in zip(walking, walks, strict=True):
                s.reused = walked
        stats.verify_s += time.perf_counter() - started


def walk_trie(
    tree: PromptTree,
    trie: TrieLogprobs,
    uniforms: np.ndarray,
    budgets: Sequence[int],
    eos_token_ids: frozenset[int],
) -> list[Reused]:
    """The walks of a prompt's slots down its verified trie, one per row of `uniforms`
    [S, most budget] (a slot's uniforms at its response positions; `budgets`: its most tokens).
    At response position t a slot takes the child of its node whose interval holds its uniform
    for t, scaled by the node's total, and moves down; where no child's does it leaves the trie.
    With coupled logprobs that is the token vanilla decoding would draw there, and decoding draws
    that same token next; otherwise the next token is drawn from the residual without the
    node's children."""
    # Python floats: a walk indexes them token by token (the same float64 arithmetic)
    low, high, total = trie.low.tolist(), trie.high.tolist(), trie.total.tolist()
    current = trie.logprobs.tolist()
    walks = []
    for slot_uniforms, budget in zip(uniforms.tolist(), budgets, strict=True):
        node, tokens, logprobs = ROOT, [], []
        finish: FinishReason | None = "length"
        excluded: tuple[int, ...] = ()
        while len(tokens) < budget:
            target = slot_uniforms[len(tokens)] * total[node]
            children = tree.children[node]
            child = next((c for c in children.values() if low[c] < target <= high[c]), None)
            if child is None:
                finish, excluded = None, () if trie.coupled else tuple(children)
                break
            node = child
            tokens.append(tree.token[node])
            logprobs.append(current[node])
            if tree.token[node] in eos_token_ids:
                finish = "stop"
                break
        walks.append(Reused(tokens, logprobs, finish, excluded))
    return walks
