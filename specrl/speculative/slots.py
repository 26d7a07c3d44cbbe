"""A slot as it moves through the speculative stage (`Slot`): its stored draft and how much of it
verification kept (`Verified`), or its walk down its prompt's history trie (`Walked`,
`walk_trie`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specrl.engines import TrieScores
from specrl.speculative.store import StoredRollout
from specrl.speculative.tree import ROOT, PromptTree
from specrl.types import FinishReason, Prompt


@dataclass
class Verified:
    """Outcome of verifying one draft: the cut index and the current logprobs of the draft tokens
    verified (all of them, or up to the cut's chunk in chunked verification)."""

    cut: int
    logprobs: list[float]

    @property
    def kept_logprobs(self) -> list[float]:
        """Current logprobs of the kept tokens, draft[:cut]."""
        return self.logprobs[: self.cut]


@dataclass
class Walked:
    """A slot's walk down its prompt's history trie: the tokens it took from the trie with their
    current logprobs, and its finish reason when the walk ended the rollout (it reached an
    end-of-sequence node, or its token budget); None when it left the trie and decodes on, then
    with `excluded`: the tokens its next one may not be (the children of the node it left at,
    when the engine's scores are not coupled with its decoding)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None
    excluded: tuple[int, ...] = ()


def walk_trie(
    tree: PromptTree,
    scores: TrieScores,
    uniforms: np.ndarray,
    budgets: Sequence[int],
    eos_token_ids: frozenset[int],
) -> list[Walked]:
    """The walks of a prompt's slots down its scored trie, one per row of `uniforms`
    [S, most budget] (a slot's uniforms at its response positions; `budgets`: its most tokens).
    At response position t a slot takes the child of its node whose interval holds its uniform
    for t, scaled by the node's total, and moves down; where no child's does it leaves the trie.
    With coupled scores that is the token vanilla decoding would draw there, and decoding draws
    that same token next; otherwise the next token is drawn from the residual without the
    node's children."""
    # Python floats: a walk indexes them token by token (the same float64 arithmetic)
    low, high, total = scores.low.tolist(), scores.high.tolist(), scores.total.tolist()
    current = scores.logprobs.tolist()
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
                finish, excluded = None, () if scores.coupled else tuple(children)
                break
            node = child
            tokens.append(tree.token[node])
            logprobs.append(current[node])
            if tree.token[node] in eos_token_ids:
                finish = "stop"
                break
        walks.append(Walked(tokens, logprobs, finish, excluded))
    return walks


@dataclass
class Slot:
    """One slot of a call as it moves through the stage."""

    prompt: Prompt
    slot: int
    seed: int
    budget: int  # most tokens of its rollout
    reuse: bool = True  # may reuse earlier responses (its stored draft, or its prompt's trie)
    draft: StoredRollout | None = None
    verified: Verified | None = None
    walked: Walked | None = None

    @property
    def kept(self) -> list[int]:
        if self.walked is not None:
            return self.walked.token_ids
        return [] if self.verified is None else self.draft.token_ids[: self.verified.cut].tolist()

    @property
    def kept_logprobs(self) -> list[float]:
        if self.walked is not None:
            return self.walked.logprobs
        return [] if self.verified is None else self.verified.kept_logprobs


def common_prefix(tokens: Sequence[int], draft: np.ndarray) -> int:
    """How many leading tokens of a response equal its draft's (a numpy array)."""
    n = min(len(tokens), len(draft))
    differ = (np.asarray(tokens[:n]) != draft[:n]).nonzero()[0]
    return int(differ[0]) if len(differ) else n
