"""Token trees of every prompt (`PromptTree`, speculative/tree.py), keyed by prompt id. Memory is
bounded twice: each tree keeps the responses of its prompt's last `window` rollouts, and
`max_nodes` over all prompts evicts the least recently rolled-out prompts' trees whole. The
trees move with their prompts between holders (`export` / `import_`) and into checkpoints.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from specrl.speculative.tree import Cursor, PromptTree


class TokenTree:
    """Token trees of every prompt, keyed by prompt id, least recently rolled out first."""

    def __init__(self, window: int = 2, max_nodes: int = 2_000_000) -> None:
        self.window = window
        self.max_nodes = max_nodes
        self._trees: OrderedDict[str, PromptTree] = OrderedDict()
        self.nodes = 0

    def __len__(self) -> int:
        return len(self._trees)

    def get(self, prompt_id: str) -> PromptTree | None:
        return self._trees.get(prompt_id)

    def _tree(self, prompt_id: str) -> PromptTree:
        if prompt_id not in self._trees:
            self._trees[prompt_id] = PromptTree()
        return self._trees[prompt_id]

    def begin(self, prompt_id: str) -> int:
        """The prompt is rolled out in this step: drop responses outside the window, mark it
        recently used. → nodes freed."""
        tree = self._tree(prompt_id)
        self._trees.move_to_end(prompt_id)
        freed = tree.next_round(self.window)
        self.nodes -= freed
        return freed

    def insert(
        self,
        prompt_id: str,
        tokens: Sequence[int],
        times: int = 1,
        intervals: Sequence[tuple[float, float]] | None = None,
    ) -> None:
        tree = self._tree(prompt_id)
        before = tree.nodes
        tree.insert(tokens, times, intervals)
        self.nodes += tree.nodes - before

    def insert_all(self, responses: Iterable[tuple]) -> None:
        """Add (prompt id, response) pairs, or (prompt id, response, its drawn intervals)
        triples: each distinct (prompt id, response) once with its multiplicity, with the
        intervals of its last copy (the same context draws the same intervals)."""
        for prompt_id, group in _distinct(responses).items():
            for tokens, times, intervals in group:
                self.insert(prompt_id, tokens, times, intervals)

    def close_round(self, prompt_ids: Iterable[str], responses: Iterable[tuple]) -> int:
        """End the round of these prompts (begun by `begin`) with their responses, as
        `insert_all` takes them: each prompt's tree adds them and drops now what its next
        `begin` would drop (`PromptTree.close_round`). → nodes freed."""
        grouped = dict.fromkeys(prompt_ids, ()) | _distinct(responses)
        freed = 0
        for prompt_id, group in grouped.items():
            tree = self._tree(prompt_id)
            before = tree.nodes
            freed += tree.close_round(group, self.window)
            self.nodes += tree.nodes - before
        return freed

    def cursor(self, prompt_id: str, tokens: Sequence[int] = ()) -> Cursor | None:
        tree = self._trees.get(prompt_id)
        return None if tree is None else Cursor(tree, tokens)

    def propose(self, prompt_id: str, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `tokens` (the response so far) for this prompt."""
        cursor = self.cursor(prompt_id, tokens)
        return [] if cursor is None else cursor.propose(k)

    def evict(self) -> int:
        """Drop the least recently rolled-out prompts' trees until at most max_nodes remain.
        → nodes freed."""
        freed = 0
        while self.nodes > self.max_nodes and self._trees:
            _, tree = self._trees.popitem(last=False)
            freed += tree.nodes
            self.nodes -= tree.nodes
        return freed

    def drop(self, prompt_ids: Iterable[str]) -> None:
        """Forget these prompts' trees: another stage owns them now."""
        for pid in prompt_ids:
            tree = self._trees.pop(pid, None)
            if tree is not None:
                self.nodes -= tree.nodes

    def state_dict(self) -> dict[str, Any]:
        return self.export(self._trees)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._trees, self.nodes = OrderedDict(), 0
        self.import_(state)

    def export(self, prompt_ids: Iterable[str]) -> dict[str, Any]:
        """The trees of these prompts (those that have one), as flat arrays."""
        prompt_ids = [p for p in prompt_ids if p in self._trees]
        rounds, lengths, tokens, owners, intervals = [], [], [], [], []
        for i, pid in enumerate(prompt_ids):
            tree = self._trees[pid]
            rounds.append(tree.round)
            for (r, response), drawn in zip(tree.responses, tree.drawn, strict=True):
                owners.append((i, r))
                lengths.append(len(response))
                tokens.extend(response)
                unknown = np.full((len(response), 2), np.nan, dtype=np.float32)
                intervals.append(unknown if drawn is None else drawn)
        return {
            "prompt_ids": prompt_ids,
            "rounds": np.array(rounds, dtype=np.int64),
            "owners": np.array(owners, dtype=np.int64).reshape(-1, 2),
            "lengths": np.array(lengths, dtype=np.int64),
            "tokens": np.array(tokens, dtype=np.int32),
            "intervals": np.concatenate(intervals or [np.zeros((0, 2), np.float32)]),
        }

    def import_(self, state: dict[str, Any]) -> None:
        """Add (or replace) the trees `export` gave, as the most recently rolled-out ones."""
        trees = [PromptTree() for _ in state["prompt_ids"]]
        offsets = np.concatenate([[0], np.cumsum(state["lengths"])])
        drawn = state.get("intervals")  # absent from checkpoints written before they were kept
        for j, (owner, r) in enumerate(state["owners"].tolist()):
            tree = trees[owner]
            tree.round = r
            span = slice(offsets[j], offsets[j + 1])
            tree.insert(state["tokens"][span].tolist(), 1, None if drawn is None else drawn[span])
        for pid, tree, r in zip(state["prompt_ids"], trees, state["rounds"].tolist(), strict=True):
            tree.round = r
            old = self._trees.pop(pid, None)
            self.nodes += tree.nodes - (old.nodes if old is not None else 0)
            self._trees[pid] = tree


def _distinct(responses: Iterable[tuple]) -> dict[str, list[tuple]]:
    """(prompt id, response[, drawn intervals]) tuples → by prompt id, each distinct response
    once: (tokens, its copies, the intervals of its last copy or None)."""
    times: Counter[tuple[str, tuple[int, ...]]] = Counter()
    drawn: dict[tuple[str, tuple[int, ...]], Sequence[tuple[float, float]] | None] = {}
    for prompt_id, tokens, *intervals in responses:
        key = (prompt_id, tuple(tokens))
        times[key] += 1
        drawn[key] = intervals[0] if intervals else None
    grouped: dict[str, list[tuple]] = {}
    for (prompt_id, tokens), n in times.items():
        grouped.setdefault(prompt_id, []).append((tokens, n, drawn[(prompt_id, tokens)]))
    return grouped
