"""History tries (`rollout.spec.reuse=trie`, the exact rule's default): each prompt's trie of
earlier responses verified in one pass (the engine's `verify_tries`), every slot walked down it
with the uniforms vanilla decoding would use (`walk_trie`); a slot decodes on from the node
where it leaves its trie."""

from __future__ import annotations

import time
from collections import Counter
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
from specrl.engines.sampling import uniform_table
from specrl.speculative.reuse.base import Reuse
from specrl.speculative.reuse.budget import TrieBudget
from specrl.speculative.reuse.walkers import DRIFT_BUCKETS, drift_bucket
from specrl.speculative.slots import Reused, Slot
from specrl.speculative.stats import RolloutStats
from specrl.speculative.token_trees import TokenTree
from specrl.speculative.tree import ROOT, PromptTree
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
        # this call's tries as they stood before it (`PromptTree.snapshot`), by prompt id, and
        # the walkers the budget expected over their nodes (None: with σ at its prior)
        self._snapshots: dict[str, tuple[list[int], list[int]]] = {}
        self._expected_reach: float | None = None

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
        uniforms = uniform_table(
            torch.tensor([slots[i].seed for i in walkers]),
            torch.tensor([len(slots[i].prompt.ids) for i in walkers]),
            max(slots[i].budget for i in walkers),
        ).numpy()  # [S, R]
        trees = [self.tree.get(prompt_id) for prompt_id, _ in groups]
        selections = self.budget.select_all(
            trees,
            [len(rows) for rows in groups.values()],
            [uniforms[rows] for rows in groups.values()],
        )
        # δ learns from predictions made with σ measured: before any pass, the prior's blur of
        # the intervals, not the policy, sets how far they reach
        self._expected_reach = (
            sum(selection.reach for selection in selections) if self.budget.shift_measured else None
        )
        tries = []  # (context, tree, its selection, rows) of the prompts verified
        for ((_, ids), rows), tree, selection in zip(
            groups.items(), trees, selections, strict=True
        ):
            stats.trie_nodes_stored += tree.nodes
            if selection.nodes:
                tries.append((ids, tree, selection, rows))
            else:
                stats.trie_prompts_skipped += 1
        # a pass that leaves some slot to decoding's prefill is a forward more for the step
        covered = {walkers[row] for *_, rows in tries for row in rows}
        prefilled = prefixes is None or any(
            i not in covered and s.budget > 0 for i, s in enumerate(slots)
        )
        prompt_positions = sum(len(ids) for ids, *_ in tries)
        selections = [sel for _, _, sel, _ in tries]
        if tries and not self.budget.pays_a_pass(selections, prompt_positions, prefilled):
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
        shifts = [
            drawn_shifts(tree, sel.nodes, request.parents, trie)
            for (_, tree, sel, _), request, trie in zip(tries, requests, verified, strict=True)
        ]
        self.budget.observe_shifts(*(np.concatenate(ends) for ends in zip(*shifts, strict=True)))
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
            responses = [
                [*s.kept, *(results[i].token_ids if i in results else ())]
                for i, s in enumerate(slots)
            ]
            reusable, moves = [0] * len(slots), np.zeros((2, DRIFT_BUCKETS))
            walked: dict[str, list[int]] = {}  # prompt id → its slots that walked a trie
            for i, s in enumerate(slots):
                if s.may_reuse and s.prompt.prompt_id in self._snapshots:
                    walked.setdefault(s.prompt.prompt_id, []).append(i)
            for prompt_id, group in walked.items():
                tree, seen = self.tree.get(prompt_id), self._snapshots[prompt_id]
                landed = reachable(tree, seen, [responses[i] for i in group], moves)
                for i, reached in zip(group, landed, strict=True):
                    reusable[i] = reached
            lengths = [len(r) for r in responses]
            self.budget.observe_walks(moves)
            if self._expected_reach is not None:
                self.budget.observe_reach(self._expected_reach, sum(reusable))
            self.budget.observe_loop(lengths, reusable)
            stats.trie_reachable_tokens += sum(reusable)
        stats.trie_node_cost_s = self.budget.node_cost or 0.0
        priced = self.budget.hindsight_token_cost
        stats.trie_token_cost_s = (
            priced if priced is not None else self.budget.average_token_cost or 0.0
        )
        stats.trie_row_cost_s = self.budget.row_cost or 0.0
        stats.trie_forward_cost_s = self.budget.forward_cost or 0.0
        stats.trie_prompt_cost_s = self.budget.prompt_cost
        stats.trie_drift = self.budget.drift
        stats.trie_shift = self.budget.shift
        stats.trie_sharpening = self.budget.sharpening
        stats.trie_loop_factor = self.budget.loop_factor or 0.0


def _request(
    prompt_ids: tuple[int, ...], tree: PromptTree, nodes: list[int], sampling: SamplingParams
) -> TrieRequest:
    """The trie of `nodes` (tree ids, parents first; their ancestors among them) as the engine
    takes it: node i of the request is nodes[i - 1]."""
    index = {ROOT: 0} | {v: i for i, v in enumerate(nodes, start=1)}
    parents = [index[tree.parent[v]] for v in nodes]
    return TrieRequest(prompt_ids, parents, [tree.token[v] for v in nodes], sampling)


def drawn_shifts(
    tree: PromptTree, nodes: Sequence[int], parents: Sequence[int], trie: TrieLogprobs
) -> tuple[np.ndarray, np.ndarray]:
    """Of the verified `nodes` (tree ids; `parents`: their parents' rows in `trie`, 0 the
    root) whose drawn intervals `tree` knows: those intervals [M, 2], and the intervals the
    current policy gives the same moves [M, 2]."""
    index = np.asarray(nodes, dtype=np.int64)
    old = np.stack([np.asarray(tree.lower)[index], np.asarray(tree.upper)[index]], 1)
    new = trie_intervals(trie, parents)[1:]
    known = ~np.isnan(old[:, 0])
    return old[known], new[known]


def trie_intervals(trie: TrieLogprobs, parents: Sequence[int]) -> np.ndarray:
    """The drawn interval (a, b] of the move to each node of a verified trie (`parents`: each
    node's parent's row, 0 the root): its interval scaled by its parent's total, [N + 1, 2]
    (NaN at the root, which no move reaches)."""
    scale = trie.total[np.asarray(parents, dtype=np.int64)]
    moves = np.stack([trie.low[1:] / scale, trie.high[1:] / scale], 1)
    return np.concatenate([np.full((1, 2), np.nan), moves])


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
    up = [0] * (len(nodes) + 1)  # each row's parent's row
    for row, v in enumerate(nodes, start=1):
        row_of[v] = row
        up[row] = row_of[tree.parent[v]]
        kids[up[row]].append((tree.token[v], row))
    drawn = list(map(tuple, trie_intervals(trie, up[1:]).tolist()))
    walks = []
    for slot_uniforms, budget in zip(uniforms.tolist(), budgets, strict=True):
        at, tokens, rows = 0, [], []
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
            rows.append(at)
            if token in eos_token_ids:
                finish = "stop"
                break
        logprobs, intervals = [current[r] for r in rows], [drawn[r] for r in rows]
        walks.append(Reused(tokens, logprobs, finish, excluded, intervals=intervals))
    return walks


def reachable(
    tree: PromptTree,
    seen: tuple[list[int], list[int]],
    responses: Sequence[Sequence[int]],
    moves: np.ndarray,
) -> list[int]:
    """How many leading tokens of each of a prompt's `responses` are a path of its trie as it
    stood when the step began (`seen`: its `snapshot` then, the nodes that existed with their
    counts). Adds to `moves` [taken, predicted] by kind of move (`drift_bucket`) the moves along
    those paths and the moves the counts predicted (at each node passed that had children, to
    each child the share of the node's earlier responses that went on to it), node by node: a
    prompt's slots mostly share their paths (and often their whole responses), so each distinct
    response is walked once and a node's children are weighed once for all that passed it. With
    every node verified a walk reuses exactly those tokens: a response is what its walk and
    decoding drew, so this is a walk of the whole trie in hindsight, whatever the budget
    verified."""
    count, continued = seen
    size, children = len(count), tree.children
    stood: Counter[int] = Counter()  # nodes a response stood at with a token to go on with
    went: Counter[int] = Counter()  # the children responses went on to
    reached: dict[tuple[int, ...], int] = {}  # each distinct response walked once
    for response, times in Counter(map(tuple, responses)).items():
        node, depth = ROOT, 0
        for token in response:
            if not continued[node]:
                break
            stood[node] += times
            child = children[node].get(token)
            if child is None or child >= size:
                break
            went[child] += times
            node, depth = child, depth + 1
        reached[response] = depth
    taken, predicted = moves
    for node, times in stood.items():
        here = count[node]
        for c in children[node].values():
            if c < size:
                predicted[drift_bucket(here, count[c])] += times * count[c] / here
    for child, times in went.items():
        taken[drift_bucket(count[tree.parent[child]], count[child])] += times
    return [reached[tuple(response)] for response in responses]
