"""A slot as it moves through the speculative stage (`Slot`), and what it reused of its history
(`Reused`: one result type for every reuse strategy of speculative/reuse.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specrl.engines import GenResult
from specrl.speculative.store import StoredRollout
from specrl.types import FinishReason, Prompt


@dataclass
class Reused:
    """What a slot took from its history before anything was decoded for it: the tokens its
    rollout starts with and their current logprobs; `finish_reason` when the rollout ends there
    (its history held the whole of it), None when decoding continues, then with `excluded`: the
    tokens its next one may not be (the exact rule's residual at a cut; the children of the node
    an uncoupled walk left at). `checked`: the current logprob of every draft token verification
    computed, past the cut too (a stored draft's; the lenient rule's behaviour logprobs read it).
    `intervals`: each token's drawn interval, where the walk of a trie knew it (empty otherwise)."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason | None
    excluded: tuple[int, ...] = ()
    checked: list[float] = field(default_factory=list)
    intervals: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class Slot:
    """One slot of a call as it moves through the stage."""

    prompt: Prompt
    slot: int
    seed: int
    budget: int  # most tokens of its rollout
    may_reuse: bool = True  # may reuse its history (its stored draft, or its prompt's trie)
    draft: StoredRollout | None = None  # its stored draft (per-slot reuse)
    reused: Reused | None = None

    @property
    def kept(self) -> list[int]:
        return [] if self.reused is None else self.reused.tokens

    @property
    def kept_logprobs(self) -> list[float]:
        return [] if self.reused is None else self.reused.logprobs

    def drawn(self, decoded: GenResult | None) -> list[tuple[float, float]]:
        """The drawn interval of every token of its response, what it kept and then what was
        `decoded` for it (NaN where the part's source did not say)."""
        parts = [(self.kept, [] if self.reused is None else self.reused.intervals)]
        if decoded is not None:
            parts.append((decoded.token_ids, decoded.intervals))
        unknown = (math.nan, math.nan)
        return [
            x for tokens, drawn in parts
            for x in (drawn if len(drawn) == len(tokens) else [unknown] * len(tokens))
        ]  # fmt: skip


def common_prefix(tokens: Sequence[int], draft: np.ndarray) -> int:
    """How many leading tokens of a response equal its draft's (a numpy array)."""
    n = min(len(tokens), len(draft))
    differ = (np.asarray(tokens[:n]) != draft[:n]).nonzero()[0]
    return int(differ[0]) if len(differ) else n
