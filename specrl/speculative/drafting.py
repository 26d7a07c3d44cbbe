"""Model-free speculative decoding: where drafts come from and how many to verify per forward.

An engine with `draft_decoding` asks its `Drafter` for up to K draft tokens per sequence before
each decode forward, feeds them after the sequence's last token and keeps the longest prefix the
exact rule accepts. Here a `Drafting` is that drafter: a `DraftSource` proposes (the prompts'
token trees, `TreeDrafts`; each slot's stored draft first, then the trees, `StoredDrafts`) and a
`DraftWidth` (speculative/draft_width.py) chooses K (0 included) for every forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specrl.speculative.draft_width import DraftWidth
from specrl.speculative.token_trees import TokenTree
from specrl.speculative.tree import Cursor


class DraftSource(Protocol):
    def propose(self, request: int, new_tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens to follow request `request`'s new tokens so far."""
        ...

    def finished(self, request: int, new_tokens: Sequence[int]) -> None:
        """Request `request` finished with these new tokens (a source may learn from them)."""
        ...


@dataclass
class Drafting:
    """The engine's `Drafter`: proposals from `source`, K from `width`."""

    source: DraftSource
    width: DraftWidth

    @property
    def max_tokens(self) -> int:
        return self.width.max_tokens

    def worthwhile(self, batch_size: int, span: int | None = None) -> bool:
        return self.width.worthwhile(batch_size, span)

    def propose(self, request: int, new_tokens: Sequence[int], max_tokens: int) -> list[int]:
        return self.source.propose(request, new_tokens, max_tokens)

    def choose(self, lengths: Sequence[int], span: int | None = None) -> int:
        return self.width.choose(lengths, span)

    def observe(
        self,
        proposed: Sequence[int],
        accepted: Sequence[int],
        sequences: int,
        fed_tokens: int,
        seconds: float,
        span: int | None = None,
    ) -> None:
        self.width.observe_drafts(proposed, accepted)
        self.width.observe_forward(sequences, fed_tokens, seconds, span)

    def observe_loop(self, forwards: int, longest: int, accepted_per_sequence: float) -> None:
        self.width.observe_loop(forwards, longest, accepted_per_sequence)

    def finished(self, request: int, new_tokens: Sequence[int]) -> None:
        self.source.finished(request, new_tokens)


@dataclass
class TimedDecoding:
    """A `Drafter` that proposes nothing: decoding as without one, each forward's seconds fitted
    into `width`'s costs. Where no drafts are decoded, the verification budgets still price a
    reused token by those costs (what a row and a forward of the decode loop cost); without them
    they fall back to decoding's average seconds per token, which overprices a token whose reuse
    leaves the loop as long (SmolLM2 without tree drafts: every pass verified, 0.93x in the
    window where the budget with the fit skipped them,
    `benchmarks/cpu-hf-smollm2-chain-sum-40-paired-no-drafts-13f1768`)."""

    width: DraftWidth
    max_tokens: int = 0

    def worthwhile(self, batch_size: int, span: int | None = None) -> bool:
        return False

    def propose(self, request: int, new_tokens: Sequence[int], max_tokens: int) -> list[int]:
        return []

    def choose(self, lengths: Sequence[int], span: int | None = None) -> int:
        return 0

    def observe(
        self,
        proposed: Sequence[int],
        accepted: Sequence[int],
        sequences: int,
        fed_tokens: int,
        seconds: float,
        span: int | None = None,
    ) -> None:
        self.width.observe_forward(sequences, fed_tokens, seconds, span)

    def observe_loop(self, forwards: int, longest: int, accepted_per_sequence: float) -> None:
        """Nothing to learn from: no drafts."""

    def finished(self, request: int, new_tokens: Sequence[int]) -> None:
        """Nothing to learn from: no drafts."""


class TreeDrafts:
    """The draft source of one `generate_with_drafts` call: request i continues the response of
    prompt `prompt_ids[i]` after `prefixes[i]` (the draft prefix SPEC-RL kept, possibly empty).
    With `online`, a finished response joins its prompt's tree at once."""

    def __init__(
        self,
        tree: TokenTree,
        prompt_ids: Sequence[str],
        prefixes: Sequence[Sequence[int]],
        online: bool,
    ) -> None:
        self.tree = tree
        self.prompt_ids = list(prompt_ids)
        self.prefixes = [list(p) for p in prefixes]
        self.online = online
        self._cursors: list[Cursor | None] = [
            tree.cursor(pid, p) for pid, p in zip(prompt_ids, prefixes, strict=True)
        ]

    def propose(self, request: int, new_tokens: Sequence[int], max_tokens: int) -> list[int]:
        cursor = self._cursors[request]
        if cursor is None:
            return []
        cursor.extend(new_tokens[len(cursor.tokens) - len(self.prefixes[request]) :])
        return cursor.propose(max_tokens)

    def finished(self, request: int, new_tokens: Sequence[int]) -> None:
        if self.online:
            self.tree.insert(self.prompt_ids[request], self.prefixes[request] + list(new_tokens))


class StoredDrafts:
    """Drafts verified inside decoding (`rollout.spec.verify_mode=decoding`): request i is
    proposed its stored draft `drafts[i]` (SPEC-RL's previous response of its slot) while its
    new tokens follow it; once they leave it, or it runs out, `then` proposes (token trees) or
    nothing does."""

    def __init__(self, drafts: Sequence[np.ndarray | None], then: DraftSource | None) -> None:
        self.drafts = list(drafts)
        self.then = then
        self._matched = [0] * len(self.drafts)  # leading new tokens equal to the draft's
        self._left = [d is None for d in self.drafts]  # left the draft, or had none

    def propose(self, request: int, new_tokens: Sequence[int], max_tokens: int) -> list[int]:
        if not self._left[request]:
            draft, n = self.drafts[request], self._matched[request]
            while n < len(new_tokens) and n < len(draft) and new_tokens[n] == draft[n]:
                n += 1
            self._matched[request] = n
            if n == len(new_tokens) and n < len(draft):
                return draft[n : n + max_tokens].tolist()
            self._left[request] = True
        return [] if self.then is None else self.then.propose(request, new_tokens, max_tokens)

    def finished(self, request: int, new_tokens: Sequence[int]) -> None:
        if self.then is not None:
            self.then.finished(request, new_tokens)
