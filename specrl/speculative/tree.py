"""Token trees (SRT, arXiv 2601.09083): per prompt, a trie of earlier responses with counts, used
as a model-free draft source for the tokens that still have to be decoded, and as the history
trie that slots walk (speculative/reuse/trie.py); each node also keeps the drawn interval of the
move to it, where its response's draw reported one (the trie budget predicts walks by it).

A prompt's tree holds its responses from the last `window` times it was rolled out (all slots),
plus responses of the current step as they finish (online). A proposal for a sequence being
decoded starts from its *context node*:

- the node of the whole response so far, when some stored response starts with it (anchored);
- otherwise the nodes whose path ends with the longest suffix of the response so far (suffix
  match, unbounded length), the most frequent of them (ties: the earliest created).

From there it follows the most frequent child (ties: the earliest created) for up to K tokens.
`Cursor` tracks the context of one sequence incrementally: appending a token costs one dict
lookup while the sequence stays on a stored path or extends its suffix match; a full suffix
search runs only when the match breaks, or when the tree changed since the last lookup.

Responses older than `window` rollouts of their prompt are dropped when the prompt is rolled out
again (`next_round`), or ahead of it as its round closes (`close_round`); the trees of every
prompt are `token_trees.TokenTree`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

ROOT = 0


class PromptTree:
    """The trie of one prompt's stored responses. Node 0 is the root (the empty response)."""

    def __init__(self) -> None:
        self.responses: list[tuple[int, tuple[int, ...]]] = []  # (round, tokens), oldest first
        # each response's drawn intervals [len, 2] (None: not known), as `responses`
        self.drawn: list[np.ndarray | None] = []
        self.round = 0  # how many times the prompt has been rolled out
        self.version = 0  # bumped by every change; cursors recompute when it moves
        self._build()

    def _build(self, earlier: int = 0) -> int:
        """The tree of the stored responses. → how many nodes the first `earlier` of them hold
        (a distinct response goes in where its first copy stands)."""
        self.token = [-1]
        self.parent = [-1]
        self.depth = [0]
        self.count = [0]
        self.continued = [0]  # of a node's responses, those that go on to a child
        self.children: list[dict[int, int]] = [{}]
        self.best = [-1]  # most frequent child
        # the drawn interval (a, b] of the move to each node, as the last response through it
        # that knew it was drawn (NaN: none did): a walk with uniform u at its parent takes it
        # while the policy's interval still holds u
        self.lower, self.upper = [math.nan], [math.nan]
        self.by_token: dict[int, list[int]] = {}
        # a prompt's slots often hold the same response: each distinct one goes in once
        distinct = list(Counter(tokens for _, tokens in self.responses).items())
        first = len({tokens for _, tokens in self.responses[:earlier]})
        for tokens, times in distinct[:first]:
            self._add(tokens, times)
        held = self.nodes
        for tokens, times in distinct[first:]:
            self._add(tokens, times)
        # then each distinct response's intervals, in the order of its last copy that knew
        # them: the latest win along shared paths
        last: dict[tuple[int, ...], np.ndarray] = {}
        for (_, tokens), drawn in zip(self.responses, self.drawn, strict=True):
            if drawn is not None:
                last.pop(tokens, None)
                last[tokens] = drawn
        for tokens, drawn in last.items():
            self._draw(tokens, drawn)
        return held

    @property
    def nodes(self) -> int:
        return len(self.token) - 1

    def snapshot(self) -> tuple[list[int], list[int]]:
        """Every node's count and continued count as they stand now (`reachable` walks them)."""
        return list(self.count), list(self.continued)

    def insert(
        self,
        tokens: Sequence[int],
        times: int = 1,
        intervals: Sequence[tuple[float, float]] | None = None,
    ) -> None:
        """Add a response, `times` times (slots that hold the same response), with the drawn
        interval of each of its tokens where known (NaN: not)."""
        tokens, drawn = self._store(tokens, times, intervals)
        self._add(tokens, times)
        if drawn is not None:
            self._draw(tokens, drawn)
        self.version += 1

    def _store(
        self, tokens: Sequence[int], times: int, intervals: Sequence[tuple[float, float]] | None
    ) -> tuple[tuple[int, ...], np.ndarray | None]:
        """Append a response of this round to `responses` (`times` copies) and its drawn
        intervals to `drawn`. → the response and its intervals as stored."""
        tokens = tuple(map(int, tokens))
        drawn = None
        if intervals is not None and len(intervals) == len(tokens):
            drawn = np.asarray(intervals, dtype=np.float32).reshape(-1, 2)
            if np.isnan(drawn).all():
                drawn = None
        self.responses.extend([(self.round, tokens)] * times)
        self.drawn.extend([drawn] * times)
        return tokens, drawn

    def _add(self, tokens: tuple[int, ...], times: int = 1) -> None:
        children, count, continued, best = self.children, self.count, self.continued, self.best
        node = ROOT
        count[ROOT] += times
        for t in tokens:
            continued[node] += times
            child = children[node].get(t)
            if child is None:
                child = len(self.token)
                self.token.append(t)
                self.parent.append(node)
                self.depth.append(self.depth[node] + 1)
                count.append(0)
                continued.append(0)
                children.append({})
                best.append(-1)
                self.lower.append(math.nan)
                self.upper.append(math.nan)
                children[node][t] = child
                self.by_token.setdefault(t, []).append(child)
            count[child] += times
            b = best[node]
            if b < 0 or count[child] > count[b] or (count[child] == count[b] and child < b):
                best[node] = child
            node = child

    def _draw(self, tokens: tuple[int, ...], drawn: np.ndarray) -> None:
        """Set the drawn intervals along a stored response's path (NaN: left as they are)."""
        children, lower, upper, node = self.children, self.lower, self.upper, ROOT
        for t, (a, z) in zip(tokens, drawn.tolist(), strict=True):
            node = children[node][t]
            if a == a:  # not NaN
                lower[node], upper[node] = a, z

    def next_round(self, window: int) -> int:
        """The prompt is rolled out again: keep the responses of the last `window - 1` rounds
        (the current round adds its own). → nodes freed."""
        self.round += 1
        return self._keep_window(self.round - window, len(self.responses))

    def close_round(
        self,
        responses: Sequence[tuple[Sequence[int], int, Sequence[tuple[float, float]] | None]],
        window: int,
    ) -> int:
        """End this round with its `responses` ((tokens, times, drawn intervals), as `insert`
        takes them) and drop now the responses the next round will drop (`next_round`, which
        then has nothing to do): where any are, one build of the kept responses, instead of
        adding these to the tree now and building it again then. → nodes freed: the tree's
        nodes that no response it keeps from before holds."""
        stored = len(self.responses)
        oldest = self.round + 1 - window  # the next round keeps the rounds after this one
        if window > 1 and all(r > oldest for r, _ in self.responses):
            for tokens, times, intervals in responses:
                self.insert(tokens, times, intervals)
            return 0
        for tokens, times, intervals in responses:
            self._store(tokens, times, intervals)
        return self._keep_window(oldest, stored)

    def _keep_window(self, oldest: int, stored: int) -> int:
        """Keep the responses of rounds after `oldest`, rebuilding the tree when any other is
        stored. → nodes freed: those the kept ones of the first `stored` responses do not hold."""
        keep = [i for i, (r, _) in enumerate(self.responses) if r > oldest]
        if len(keep) == len(self.responses):
            return 0
        before = self.nodes
        self.responses = [self.responses[i] for i in keep]
        self.drawn = [self.drawn[i] for i in keep]
        held = self._build(sum(1 for i in keep if i < stored))
        self.version += 1
        return before - held

    def suffix_matches(self, tokens: Sequence[int]) -> list[int]:
        """Nodes whose path ends with the longest suffix of `tokens` found in the tree."""
        if not tokens:
            return []
        best_len, found = 0, []
        last = len(tokens) - 1
        for node in self.by_token.get(tokens[last], ()):
            length, up, i = 1, self.parent[node], last - 1
            while up != ROOT and i >= 0 and self.token[up] == tokens[i]:
                length, up, i = length + 1, self.parent[up], i - 1
            if length > best_len:
                best_len, found = length, [node]
            elif length == best_len:
                found.append(node)
        return found

    def continuation(self, node: int, k: int) -> list[int]:
        """Up to k tokens along the most frequent children from `node`."""
        out = []
        while len(out) < k and (node := self.best[node]) >= 0:
            out.append(self.token[node])
        return out


class Cursor:
    """The context node of one sequence being decoded, kept up to date as tokens are appended."""

    def __init__(self, tree: PromptTree, tokens: Sequence[int] = ()) -> None:
        self.tree = tree
        self.tokens: list[int] = []
        self._version = -1  # stale: the first lookup computes from scratch
        self._anchored: int | None = ROOT
        self._matches: list[int] = []
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        tree = self.tree
        for t in tokens:
            self.tokens.append(int(t))
            if self._version != tree.version:
                continue
            if self._anchored is not None:
                child = tree.children[self._anchored].get(int(t))
                if child is not None:
                    self._anchored = child
                    continue
                self._anchored = None
                self._matches = tree.suffix_matches(self.tokens)
            else:
                extended = [c for n in self._matches if (c := tree.children[n].get(int(t)))]
                self._matches = extended or tree.suffix_matches(self.tokens)

    def _refresh(self) -> None:
        tree = self.tree
        node: int | None = ROOT
        for t in self.tokens:
            node = tree.children[node].get(t)
            if node is None:
                break
        self._anchored = node
        self._matches = [] if node is not None else tree.suffix_matches(self.tokens)
        self._version = tree.version

    def context(self) -> int | None:
        if self._version != self.tree.version:
            self._refresh()
        if self._anchored is not None:
            return self._anchored
        if not self._matches:
            return None
        count = self.tree.count
        return min(self._matches, key=lambda n: (-count[n], n))

    def propose(self, k: int) -> list[int]:
        node = self.context()
        return [] if node is None or k <= 0 else self.tree.continuation(node, k)
