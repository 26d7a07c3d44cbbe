"""How many draft tokens to verify per decode forward (`DraftWidth`): the K that maximises
expected tokens per second under the engine's own fitted forward costs (speculative/drafting.py
has where drafts come from)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from specrl.least_squares import solved


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

    Where a forward's cost also steps with the KV columns it attends (static decoding: a graph
    per column bucket), the engine gives that `span` with each forward and choice, and the costs
    are fitted per span, the fit of every forward standing in until a span's own forwards
    separate its costs: pooled, the draft forwards of reuse steps, which attend longer contexts,
    took the columns' cost for the drafts' (CPU, graphs emulated: the width near 0 for three
    reuse steps of one run of three, 0.3-1.4 in another). `cost()` without a span is the pooled
    fit (the verification budgets').
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
        # by span (None: every forward), weighted sums of x·[x, t] over forwards,
        # x = (1, B, E, [E > 0]), and weighted counts of the forwards that verified drafts
        self._sums: dict[int | None, np.ndarray] = {None: np.zeros((4, 5))}
        self._drafted: dict[int | None, float] = {None: 0.0}
        self._trials, self._accepted = 0.0, 0.0  # decayed evidence; α = (accepted+1)/(trials+2)
        # decayed [forwards removed, forwards assumed removed] of decode loops with accepted drafts
        self._loops = np.zeros(2)
        self.choices: Counter[int] = Counter()  # K chosen per forward, since the last reset
        # by span, the fit and the forwards of that span observed since it was fitted
        self._fits: dict[int | None, tuple[float, float, float | None, float | None] | None] = {}
        self._unfitted: Counter[int | None] = Counter()
        # by (batch size, span), under the fits and α as they are
        self._worthwhile: dict[tuple[int, int | None], bool] = {}

    @property
    def accept_rate(self) -> float:
        return (self._accepted + 1) / (self._trials + 2)

    @property
    def forward_share(self) -> float:
        """γ: the forwards accepted drafts removed per forward tokens per second assumed they
        would, at most 1."""
        removed, assumed = self._loops
        return min(1.0, (removed + 1.0) / (assumed + 1.0))

    def cost(
        self, span: int | None = None
    ) -> tuple[float, float, float | None, float | None] | None:
        """(c0, cs, cd, cf) of forwards attending `span` columns (None: of every forward): cd
        and cf are None until forwards with drafts measured them; None until the forwards seen
        differ enough in batch size to separate c0 from cs (a span's own fit until then is the
        pooled one). Fitted again after `refit_every` forwards, and after any forward while
        there is no fit or while whether drafts were verified lately (cd measured) has changed
        since the fit."""
        fit = self._fitted_for(span)
        if fit is None and span is not None:
            return self._fitted_for(None)
        return fit

    def _fitted_for(
        self, span: int | None
    ) -> tuple[float, float, float | None, float | None] | None:
        if span not in self._sums:
            return None
        fit, drafted = self._fits.get(span), self._drafted[span] >= 0.5
        unfitted = self._unfitted[span]
        if span not in self._fits or (
            unfitted
            and (unfitted >= self.refit_every or fit is None or drafted != (fit[2] is not None))
        ):
            fit = self._fits[span] = self._fitted(span)
            self._unfitted[span] = 0
            self._worthwhile.clear()
        return fit

    def _fitted(self, span: int | None) -> tuple[float, float, float | None, float | None] | None:
        sums = self._sums[span]
        xx, xt = sums[:, :4], sums[:, 4]
        if xx[0, 0] < 4:
            return None
        for measured in (4, 3) if self._drafted[span] >= 0.5 else (2,):
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

    def choose(self, lengths: Sequence[int], span: int | None = None) -> int:
        """K for a forward whose sequences were proposed `lengths` draft tokens (attending
        `span` columns, where given)."""
        k = self._best(lengths, span)
        self.choices[k] += 1
        return k

    def worthwhile(self, batch_size: int, span: int | None = None) -> bool:
        """Whether any K > 0 could pay off for this batch size, were every sequence proposed
        `max_tokens` drafts: when not, the engine skips asking for proposals. Asked before every
        forward: answered once per batch size and span until the fits or α move."""
        self.cost(span)  # refitted when due, which forgets the answers
        known = self._worthwhile.get((batch_size, span))
        if known is None:
            best = self._best([self.max_tokens] * batch_size, span)
            known = self._worthwhile[batch_size, span] = best > 0
        return known

    def _best(self, lengths: Sequence[int], span: int | None = None) -> int:
        longest = min(max(lengths, default=0), self.max_tokens)
        if not self.adaptive or longest == 0:
            return longest
        cost = self.cost(span)
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

    def observe_forward(
        self, sequences: int, fed_tokens: int, seconds: float, span: int | None = None
    ) -> None:
        """A decode forward over `sequences` sequences computed `fed_tokens` positions
        (attending `span` columns, where given). Every span's evidence fades per forward."""
        drafts = fed_tokens - sequences
        x = np.array([1.0, sequences, drafts, float(drafts > 0)])
        seen = np.outer(x, np.append(x, seconds))
        if span is not None and span not in self._sums:
            self._sums[span], self._drafted[span] = np.zeros((4, 5)), 0.0
        for key in self._sums:
            here = key is None or key == span
            self._sums[key] = self.cost_decay * self._sums[key] + (seen if here else 0.0)
            self._drafted[key] = self.cost_decay * self._drafted[key] + (here and drafts > 0)
        self._unfitted.update({None, span})

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
            "cost_sums": self._sums[None].copy(),
            "drafted": self._drafted[None],
            "span_sums": {k: v.copy() for k, v in self._sums.items() if k is not None},
            "span_drafted": {k: v for k, v in self._drafted.items() if k is not None},
            "trials": self._trials,
            "accepted": self._accepted,
            "loops": self._loops.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint from before the cost terms of now (c0 + c1·tokens, or without cf)
        restarts the cost fit: it is measured again within a few forwards."""
        sums = np.asarray(state.get("cost_sums", ()), dtype=np.float64)
        self._sums, self._drafted = {None: np.zeros((4, 5))}, {None: 0.0}
        if sums.shape == (4, 5):
            self._sums[None], self._drafted[None] = sums.copy(), float(state["drafted"])
            for span, span_sums in state.get("span_sums", {}).items():
                self._sums[span] = np.asarray(span_sums, dtype=np.float64).copy()
                self._drafted[span] = float(state["span_drafted"][span])
        self._fits.clear()
        self._unfitted = Counter()
        self._trials, self._accepted = float(state["trials"]), float(state["accepted"])
        self._loops = np.array(state.get("loops", (0.0, 0.0)), dtype=np.float64)
        self._worthwhile.clear()

    def reset_choices(self) -> Counter[int]:
        choices, self.choices = self.choices, Counter()
        return choices
