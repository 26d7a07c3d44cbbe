"""Model-free speculative decoding: where drafts come from and how many to verify per forward.

An engine with `draft_decoding` asks its `Drafter` for up to K draft tokens per sequence before
each decode forward, feeds them after the sequence's last token and keeps the longest prefix the
exact rule accepts. Here a `Drafting` is that drafter: a `DraftSource` proposes (the prompts'
token trees, `TreeDrafts`; each slot's stored draft first, then the trees, `StoredDrafts`) and a
`DraftWidth` chooses K (0 included) for every forward.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from specrl.least_squares import solved
from specrl.speculative.token_trees import TokenTree
from specrl.speculative.tree import Cursor


class DraftSource(Protocol):
    def propose(self, request: int, new_tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens to follow request `request`'s new tokens so far."""
        ...

    def finished(self, request: int, new_tokens: Sequence[int]) -> None:
        """Request `request` finished with these new tokens (a source may learn from them)."""
        ...


class DraftWidth:
    """Chooses K, the draft tokens verified per sequence in a decode forward, to maximise expected
    tokens per second.

    A forward over B sequences that computes E draft positions besides their B next tokens costs
    c0 + cs·B + cd·E + cf·[E > 0] seconds: a cost per forward, one per sequence (its token, its
    sampling, the engine's bookkeeping: most of a vLLM step on a CPU), one per draft position,
    and one of verifying drafts at all (proposing them, feeding them, accepting them: host work
    that outweighs the draft positions when forwards are host-bound, as a small model's). E is
    B·K on an engine that pads every sequence to K drafts, the drafts themselves on a `ragged`
    one. The four are fitted (exponentially weighted least squares) to the engine's own decode
    iterations (the whole loop around a forward, drafting included), every `refit_every`
    forwards (a fit costs more host time than a small model's forward; the costs drift slowly).
    A sequence whose source proposed L tokens produces 1 + α + … + α^min(L, K) tokens in
    expectation, α being the measured per-token accept rate over the last `accept_rate_memory`
    draft tokens decided (older ones fade per token decided, not per forward: a stretch without
    drafts leaves α where it was). With a large batch and drafts that cost as much as sequences
    the best K is 0; in the long tail of a batch, where c0 dominates, it is large. cd and cf are
    only measured by forwards that verify drafts (cf once those differ enough in width to tell
    it from cd; 0 until then): while none has been seen lately (their weight decays with the
    cost), the next forward with proposals verifies one draft token per sequence to measure
    them and α afresh. `adaptive=False` always takes every proposed token up to `max_tokens`.

    Tokens per second prices a token of a forward over B sequences at cs plus c0 / B: each
    accepted draft removes 1/B of a forward. In a decode loop whose sequences started together
    (the transformers engine) that holds in the tail, but a token accepted in a sequence that
    finishes before the longest one removes no forward, only the sequence's row from one: on
    SmolLM2 early in RL, where the longest sequences run to the response limit, 135 tokens
    accepted in one step removed 4 of 48 forwards and the drafts cost more than they saved. So
    c0 is weighed by γ, the forwards accepted drafts removed in hindsight (the longest sequence's
    new tokens, as many forwards as decoding without drafts runs, less the forwards run) per
    forward tokens per second assumed they would (Σ over the forwards of the tokens accepted per
    sequence), at most 1, from a prior of one forward assumed and removed, decayed by
    `loop_decay` per loop with accepted drafts (`observe_loop`). An engine that does not report
    its loops (vLLM, whose scheduler decides what runs together) keeps γ = 1.
    """

    refit_every = 8
    least_cost = 1e-12  # a per-sequence or per-draft cost fitted at or below zero is clamped here

    def __init__(
        self,
        max_tokens: int,
        adaptive: bool = True,
        ragged: bool = False,
        cost_decay: float = 0.98,
        accept_rate_memory: float = 64.0,
        loop_decay: float = 0.8,
    ) -> None:
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self.ragged = ragged
        self.cost_decay = cost_decay  # the cost of a forward drifts slowly
        self.accept_rate_memory = accept_rate_memory
        self.loop_decay = loop_decay
        # weighted sums of x·[x, t] over forwards, x = (1, B, E, [E > 0])
        self._sums = np.zeros((4, 5))
        self._drafted = 0.0  # weighted count of forwards that verified drafts
        self._trials, self._accepted = 0.0, 0.0  # decayed evidence; α = (accepted+1)/(trials+2)
        # decayed [forwards removed, forwards assumed removed] of decode loops with accepted drafts
        self._loops = np.zeros(2)
        self.choices: Counter[int] = Counter()  # K chosen per forward, since the last reset
        self._fit: tuple[float, float, float | None, float | None] | None = None
        self._unfitted = 0  # forwards observed since _fit was fitted
        self._worthwhile: dict[int, bool] = {}  # by batch size, under _fit and α as they are

    @property
    def accept_rate(self) -> float:
        return (self._accepted + 1) / (self._trials + 2)

    @property
    def forward_share(self) -> float:
        """γ: the forwards accepted drafts removed per forward tokens per second assumed they
        would, at most 1."""
        removed, assumed = self._loops
        return min(1.0, (removed + 1.0) / (assumed + 1.0))

    def cost(self) -> tuple[float, float, float | None, float | None] | None:
        """(c0, cs, cd, cf): cd and cf are None until forwards with drafts measured them; None
        until the forwards seen differ enough in batch size to separate c0 from cs. Fitted again
        after `refit_every` forwards, and after any forward while there is no fit or while
        whether drafts were verified lately (cd measured) has changed since the fit."""
        fit, drafted = self._fit, self._drafted >= 0.5
        if self._unfitted and (
            self._unfitted >= self.refit_every or fit is None or drafted != (fit[2] is not None)
        ):
            self._fit, self._unfitted = self._fitted(), 0
            self._worthwhile.clear()
        return self._fit

    def _fitted(self) -> tuple[float, float, float | None, float | None] | None:
        xx, xt = self._sums[:, :4], self._sums[:, 4]
        if xx[0, 0] < 4:
            return None
        for measured in (4, 3) if self._drafted >= 0.5 else (2,):
            c = solved(xx[:measured, :measured], xt[:measured])
            if c is not None:
                break
        else:
            return None
        if measured == 2:
            return max(c[0], 0.0), max(c[1], self.least_cost), None, None
        least = self.least_cost
        return (
            max(c[0], 0.0), max(c[1], least), max(c[2], least),
            max(c[3], 0.0) if measured == 4 else 0.0,
        )  # fmt: skip

    def choose(self, lengths: Sequence[int]) -> int:
        """K for a forward whose sequences were proposed `lengths` draft tokens."""
        k = self._best(lengths)
        self.choices[k] += 1
        return k

    def worthwhile(self, batch_size: int) -> bool:
        """Whether any K > 0 could pay off for this batch size, were every sequence proposed
        `max_tokens` drafts: when not, the engine skips asking for proposals. Asked before every
        forward: answered once per batch size until the fit or α move."""
        self.cost()  # refitted when due, which forgets the answers
        known = self._worthwhile.get(batch_size)
        if known is None:
            known = self._worthwhile[batch_size] = self._best([self.max_tokens] * batch_size) > 0
        return known

    def _best(self, lengths: Sequence[int]) -> int:
        longest = min(max(lengths, default=0), self.max_tokens)
        if not self.adaptive or longest == 0:
            return longest
        cost = self.cost()
        if cost is None:  # not measured yet: decode plainly (the forwards it sees fit the model)
            return 0
        c0, cs, cd, cf = cost
        if cd is None:  # drafts not measured lately: verify one per sequence
            return 1
        alpha = min(self.accept_rate, 0.999)
        caps = np.minimum(np.asarray(lengths), longest)[None, :]
        widths = np.arange(longest + 1)[:, None]
        expected = (1 - alpha ** (np.minimum(caps, widths) + 1)) / (1 - alpha)  # [K+1, B]
        drafts = np.minimum(caps, widths).sum(1) if self.ragged else widths[:, 0] * len(lengths)
        seconds = self.forward_share * c0 + cs * len(lengths) + cd * drafts + cf * (drafts > 0)
        return int(np.argmax(expected.sum(1) / seconds))

    def observe_forward(self, sequences: int, fed_tokens: int, seconds: float) -> None:
        """A decode forward over `sequences` sequences computed `fed_tokens` positions."""
        drafts = fed_tokens - sequences
        x = np.array([1.0, sequences, drafts, float(drafts > 0)])
        self._sums = self.cost_decay * self._sums + np.outer(x, np.append(x, seconds))
        self._drafted = self.cost_decay * self._drafted + (fed_tokens > sequences)
        self._unfitted += 1

    def observe_drafts(self, proposed: Sequence[int], accepted: Sequence[int]) -> None:
        """Per sequence of one forward: draft tokens verified and how many of them were accepted.
        Each accepted token is a success, the first rejected one (if any) a failure. Earlier
        evidence fades by 1 - 1 / accept_rate_memory per token decided now, so forwards without
        drafts do not pull α back towards the prior."""
        trials = sum(a + (a < p) for p, a in zip(proposed, accepted, strict=True) if p > 0)
        if trials:
            keep = (1.0 - 1.0 / self.accept_rate_memory) ** trials
            self._trials = keep * self._trials + trials
            self._accepted = keep * self._accepted + sum(accepted)
            self._worthwhile.clear()

    def observe_loop(self, forwards: int, longest: int, accepted_per_sequence: float) -> None:
        """One decode loop over sequences that started together: the forwards it ran, its
        longest sequence's new tokens (the forwards it would have run without drafts) and, summed
        over its forwards, the draft tokens each accepted per sequence it decoded. A loop that
        accepted none says nothing about γ."""
        if accepted_per_sequence > 0:
            removed = max(longest - forwards, 0)
            self._loops = self.loop_decay * self._loops + (removed, accepted_per_sequence)
            self._worthwhile.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            "cost_sums": self._sums.copy(),
            "drafted": self._drafted,
            "trials": self._trials,
            "accepted": self._accepted,
            "loops": self._loops.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint from before the cost terms of now (c0 + c1·tokens, or without cf)
        restarts the cost fit: it is measured again within a few forwards."""
        sums = np.asarray(state.get("cost_sums", ()), dtype=np.float64)
        if sums.shape == (4, 5):
            self._sums, self._drafted = sums.copy(), float(state["drafted"])
        else:
            self._sums, self._drafted = np.zeros((4, 5)), 0.0
        self._fit, self._unfitted = None, 1
        self._trials, self._accepted = float(state["trials"]), float(state["accepted"])
        self._loops = np.array(state.get("loops", (0.0, 0.0)), dtype=np.float64)
        self._worthwhile.clear()

    def reset_choices(self) -> Counter[int]:
        choices, self.choices = self.choices, Counter()
        return choices


@dataclass
class Drafting:
    """The engine's `Drafter`: proposals from `source`, K from `width`."""

    source: DraftSource
    width: DraftWidth

    @property
    def max_tokens(self) -> int:
        return self.width.max_tokens

    def worthwhile(self, batch_size: int) -> bool:
        return self.width.worthwhile(batch_size)

    def propose(self, request: int, new_tokens: Sequence[int], max_tokens: int) -> list[int]:
        return self.source.propose(request, new_tokens, max_tokens)

    def choose(self, lengths: Sequence[int]) -> int:
        return self.width.choose(lengths)

    def observe(
        self,
        proposed: Sequence[int],
        accepted: Sequence[int],
        sequences: int,
        fed_tokens: int,
        seconds: float,
    ) -> None:
        self.width.observe_drafts(proposed, accepted)
        self.width.observe_forward(sequences, fed_tokens, seconds)

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

    def worthwhile(self, batch_size: int) -> bool:
        return False

    def propose(self, request: int, new_tokens: Sequence[int], max_tokens: int) -> list[int]:
        return []

    def choose(self, lengths: Sequence[int]) -> int:
        return 0

    def observe(
        self,
        proposed: Sequence[int],
        accepted: Sequence[int],
        sequences: int,
        fed_tokens: int,
        seconds: float,
    ) -> None:
        self.width.observe_forward(sequences, fed_tokens, seconds)

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
