"""Prompt lookup drafts (as vLLM's `ngram` speculative method, arXiv 2304.04487's copy drafts):
a sequence's next tokens are proposed as those that followed the latest earlier occurrence of its
last n tokens, n from `longest` down to 1, in its own context (the prompt, the forced prefix and
the tokens decoded so far). A response that restates its prompt (a sum's terms, a question's
entity) or repeats itself is drafted with no history at all: in a prompt's first rollout, where
its tree holds nothing, and in the parts of later ones its tree does not hold.
"""

from __future__ import annotations

from collections.abc import Sequence

from specrl.speculative.drafting import DraftSource


class PromptLookup:
    """The `DraftSource` of one `generate_with_drafts` call: request i decodes after
    `contexts[i]`. Each request's n-grams are indexed on its first proposal (the engine asks
    only where drafts can pay) and then as its tokens arrive."""

    def __init__(self, contexts: Sequence[Sequence[int]], longest: int = 3) -> None:
        self.longest = longest
        self._contexts = contexts
        self._tokens: list[list[int] | None] = [None] * len(contexts)
        # per request: n-gram → where the token after its latest occurrence (with one) stands
        self._follows: list[dict[tuple[int, ...], int]] = [{} for _ in contexts]

    def propose(self, request: int, new_tokens: Sequence[int], max_tokens: int) -> list[int]:
        tokens = self._tokens[request]
        if tokens is None:
            tokens = self._tokens[request] = [int(t) for t in self._contexts[request]]
            self._index(request, 1)
        known = len(tokens)
        tokens.extend(int(t) for t in new_tokens[known - len(self._contexts[request]) :])
        self._index(request, known)
        follows = self._follows[request]
        for n in range(min(self.longest, len(tokens) - 1), 0, -1):
            at = follows.get(tuple(tokens[-n:]))
            if at is not None:
                return tokens[at : at + max_tokens]
        return []

    def _index(self, request: int, start: int) -> None:
        """Index the n-grams followed by the tokens at `start` onwards."""
        tokens, follows = self._tokens[request], self._follows[request]
        for at in range(start, len(tokens)):
            for n in range(1, min(self.longest, at) + 1):
                follows[tuple(tokens[at - n : at])] = at

    def finished(self, request: int, new_tokens: Sequence[int]) -> None:
        """Nothing to learn from: each request drafts from its own context."""
        self._tokens[request] = None
        self._follows[request] = {}


class FirstProposal:
    """Proposals of the first source that proposes any; every source learns of what finished."""

    def __init__(self, *sources: DraftSource) -> None:
        self.sources = sources

    def propose(self, request: int, new_tokens: Sequence[int], max_tokens: int) -> list[int]:
        for source in self.sources:
            proposed = source.propose(request, new_tokens, max_tokens)
            if proposed:
                return proposed
        return []

    def finished(self, request: int, new_tokens: Sequence[int]) -> None:
        for source in self.sources:
            source.finished(request, new_tokens)
