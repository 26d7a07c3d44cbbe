"""History tries (`rollout.spec.reuse=trie`, the exact rule's default): each prompt's trie of
earlier responses verified in one pass (the engine's `verify_tries`), every slot walked down it
with the uniforms vanilla decoding would use (`walk_trie`); a slot decodes on from the node
where it leaves its trie."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from specrl.engines import (
    GenResult,
    Prefixes,
    RolloutEngine,
    SamplingParams,
    TrieLogprobs,
    TrieRequest,
)
from specrl.engines.sampling import seeded_uniform
from specrl.speculative.reuse.base import Reuse
from specrl.speculative.reuse.budget import DRIFT_BUCKETS, TrieBudget, drift_bucket
from specrl.speculative.slots import Reused, Slot
from specrl.speculative.stats import RolloutStats
from specrl.speculative.tree import ROOT, PromptTree, TokenTree
from specrl.types import FinishReason


class TrieReuse(Reuse):
    """Slots walk their prompt's history trie (the stage's token trees), verified as far as
    `budget` finds it pays."""

    every_turn_reuses = True

    def __init__(
        self,
        engine: RolloutEngine,
        tree: TokenTree,
        sampling: SamplingParams,
        budget: TrieBudget,
    ) -> None:
        self.engine = engine
        self.tree = tree
        self.sampling = sampling
        self.budget = budget
        # this call's tries as they stood before it (`PromptTree.snapshot`), by prompt id
        self._snapshots: dict[str, tuple[list[int], list[int]]] = {}

    def before_decoding(
        self, slots: list[Slot], seed_key: tuple, prefixes: Prefixes | None, stats: RolloutStats
    ) -> None:
        """Verify the part of the history trie that pays of every prompt (context) with slots
        that may reuse, in one pass, and walk each such slot down it, with the uniforms of its
        seed at its response positions: what vanilla decoding would draw there."""
        started = time.perf_counter()
        walkers = [
            i
            for i, s in enumerate(slots)
            if s.may_reuse
            and (tree := self.tree.get(s.prompt.prompt_id)) is not None
            and tree.nodes
        ]
        # each walker's trie as it stands now: where its response lands in it tells, after
        # decoding, what a walk of the whole trie would have reused (`reachable`)
        self._snapshots = {
            slots[i].prompt.prompt_id: self.tree.get(slots[i].prompt.prompt_id).snapshot()
            for i in walkers
        }
        if not walkers:
            return
        groups: dict[tuple, list[int]] = {}  # (prompt id, context) → its walkers (rows below)
        for row, i in enumerate(walkers):
            groups.setdefault((slots[i].prompt.prompt_id, slots[i].prompt.ids), []).append(row)
        tries = []  # (context, tree, its selection, rows) of the prompts verified
        for (prompt_id, ids), rows in groups.items():
            tree = self.tree.get(prompt_id)
            stats.trie_nodes_stored += tree.nodes
            selection = self.budget.select(tree, len(rows))
            if selection.nodes:
                tries.append((ids, tree, selection, rows))
            else:
                stats.trie_prompts_skipped += 1
        # a pass that leaves some slot to decoding's prefill is a forward more for the step
        covered = {walkers[row] for *_, rows in tries for row in rows}
        prefilled = prefixes is None or any(
            i not in covered and s.budget > 0 for i, s in enumerate(slots)
        )
        if tries and not self.budget.pays_a_pass([sel for _, _, sel, _ in tries], prefilled):
            stats.trie_passes_skipped += 1
            stats.trie_prompts_skipped += len(tries)
            tries = []
        if not tries:
            stats.verify_s += time.perf_counter() - started
            return
        requests = [_request(ids, tree, sel.nodes, self.sampling) for ids, tree, sel, _ in tries]
        engine_s = stats.engine_s
        verified = stats.timed(self.engine.verify_tries, requests, prefixes)
        computed = sum(len(r.prompt_ids) + len(r.tokens) for r in requests)
        self.budget.observe_verify(stats.engine_s - engine_s, computed)
        verified_nodes = sum(len(r.tokens) for r in requests)
        stats.trie_prompts += len(requests)
        stats.trie_nodes += verified_nodes
        stats.verified_tokens += verified_nodes
        stats.trie_expected_tokens += sum(sel.expected_tokens for _, _, sel, _ in tries)
        seeds = torch.tensor([slots[i].seed for i in walkers])[:, None]
        first = torch.tensor([len(slots[i].prompt.ids) for i in walkers])[:, None]
        positions = first + torch.arange(max(slots[i].budget for i in walkers))[None, :]
        uniforms = seeded_uniform(seeds.expand_as(positions), positions).numpy()  # [S, R]
        eos = self.engine.eos_token_ids
        for (_, tree, selection, rows), trie in zip(tries, verified, strict=True):
            walking = [slots[walkers[row]] for row in rows]
            budgets = [s.budget for s in walking]
            walks = walk_trie(tree, selection.nodes, trie, uniforms[rows], budgets, eos)
            for s, walked in zip(walking, walks, strict=True):
                s.reused = walked
        stats.verify_s += time.perf_counter() - started

    def after_decoding(
        self, slots: list[Slot], results: dict[int, GenResult], stats: RolloutStats
    ) -> None:
        """What decoding cost per token: the budget's price of a token not reused; what its
        prefills cost per position: the price of a node before any pass is timed. Where each
        response lands in its trie as the call found it: the budget's evidence on the walks
        (ρ) and on how much of the decode loop reuse removes, whatever it verified."""
        self.budget.observe_decode(stats.gen_s, sum(len(r.token_ids) for r in results.values()))
        self.budget.observe_prefill(self.engine.counts)
        if self._snapshots:
            lengths, reusable, moves = [], [], np.zeros((2, DRIFT_BUCKETS))
            for i, s in enumerate(slots):
                response = [*s.kept, *(results[i].token_ids if i in results else ())]
                seen = self._snapshots.get(s.prompt.prompt_id) if s.may_reuse else None
                reached = 0
                if seen is not None:
                    tree = self.tree.get(s.prompt.prompt_id)
                    reached = reachable(tree, seen, response, moves)
                lengths.append(len(response))
                reusable.append(reached)
            self.budget.observe_walks(moves)
            self.budget.observe_loop(lengths, reusable)
            stats.trie_reachable_tokens += sum(reusable)
        stats.trie_node_cost_s = self.budget.node_cost or 0.0
        priced = self.budget.hindsight_token_cost
        stats.trie_token_cost_s = (
            priced if priced is not None else self.budget.average_token_cost or 0.0
        )
        stats.trie_row_cost_s = self.budget.row_cost or 0.0
        stats.trie_forward_cost_s = self.budget.forward_cost or 0.0
        stats.trie_drift = self.budget.drift
        stats.trie_loop_factor = self.budget.loop_factor or 0.0


def _request(
    prompt_ids: tuple[int, ...], tree: PromptTree, nodes: list[int], sampling: SamplingParams
) -> TrieRequest:
    """The trie of `nodes` (tree ids, parents first; their ancestors among them) as the engine
    takes it: node i of the request is nodes[i - 1]."""
    index = {ROOT: 0} | {v: i for i, v in enumerate(nodes, start=1)}
    parents = [index[tree.parent[v]] for v in nodes]
    return TrieRequest(prompt_ids, parents, [tree.token[v] for v in nodes], sampling)


def walk_trie(
    tree: PromptTree,
    nodes: Sequence[int],
    trie: TrieLogprobs,
    uniforms: np.ndarray,
    budgets: Sequence[int],
    eos_token_ids: frozenset[int],
) -> list[Reused]:
    """The walks of a prompt's slots down its trie, verified at `nodes` (tree ids: `trie`'s
    node i is nodes[i - 1]), one per row of `uniforms` [S, most budget] (a slot's uniforms at its
    response positions; `budgets`: its most tokens). At response position t a slot takes the
    verified child of its node whose interval holds its uniform for t, scaled by the node's total,
    and moves down; where no verified child's does it leaves the trie. With coupled logprobs that
    is the token vanilla decoding would draw there, and decoding draws that same token next;
    otherwise the next token is drawn from the residual without the node's verified children."""
    # Python floats: a walk indexes them token by token (the same float64 arithmetic)
    low, high, total = trie.low.tolist(), trie.high.tolist(), trie.total.tolist()
    current = trie.logprobs.tolist()
    kids: list[list[tuple[int, int]]] = [[] for _ in range(len(nodes) + 1)]  # (token, row)
    row_of = {ROOT: 0}
    for row, v in enumerate(nodes, start=1):
        row_of[v] = row
        kids[row_of[tree.parent[v]]].append((tree.token[v], row))
    walks = []
    for slot_uniforms, budget in zip(uniforms.tolist(), budgets, strict=True):
        at, tokens, logprobs = 0, [], []
        finish: FinishReason | None = "length"
        excluded: tuple[int, ...] = ()
        while len(tokens) < budget:
            children = kids[at]
            target = slot_uniforms[len(tokens)] * total[at]
            for step in children:  # (token, row)
                if low[step[1]] < target <= high[step[1]]:
                    break
            else:
                finish = None
                excluded = () if trie.coupled else tuple(t for t, _ in children)
                break
            token, at = step
            tokens.append(token)
            logprobs.append(current[at])
            if token in eos_token_ids:
                finish = "stop"
                break
        walks.append(Reused(tokens, logprobs, finish, excluded))
    return walks


def reachable(
    tree: PromptTree,
    seen: tuple[list[int], list[int]],
    response: Sequence[int],
    moves: np.ndarray,
) -> int:
    """How many leading tokens of `response` are a path of the trie as it stood when the step
    began (`seen`: its `snapshot` then, the nodes that existed with their counts). Adds to
    `moves` [taken, predicted] by kind of move (`drift_bucket`) the moves along that path and
    the moves the counts predicted (at each node passed that had children, to each child the
    share of the node's earlier responses that went on to it). With every node verified
    a walk reuses exactly those tokens: the response is what the walk and decoding drew, so this
    is a walk of the whole trie in hindsight, whatever the budget verified."""
    count, continued = seen
    node, size = ROOT, len(count)
    for depth, token in enumerate(response):
        if not continued[node]:
            return depth
        here = count[node]
        for c in tree.children[node].values():
            if c < size:
                moves[1, drift_bucket(here, count[c])] += count[c] / here
        child = tree.children[node].get(token)
        if child is None or child >= size:
            return depth
        moves[0, drift_bucket(here, count[child])] += 1
        node = child
    return len(response)
