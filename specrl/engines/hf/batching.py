"""How the transformers engine groups verification sequences into forwards.

A verification forward (a trie pass, or the draft verification of `logprobs`) pads its rows to
the widest: every row computes as many positions, attends over as many columns, and keeps as many
logits columns as the widest row's. Splitting a batch saves that padding and costs a forward:
what a forward costs besides its positions (on a GPU the kernel launches and the host work around
them, most of a small model's forward; on a CPU reading the weights once more). Which one weighs
more depends on the device and the model, so the engine measures it: `PassCost` fits the seconds
of its own verification batches (inputs built, the forward, results read back to the host) as

    a + b · rows · width + c · rows · width² + d · rows · kept

(a forward, its positions, its attention pairs, its logits columns), and `width_batches` groups
the sequences, widest first, into the forwards of least total cost under that fit. Until there is
a fit (too few batches, or batches too alike to tell a position's cost from the rest) a batch
takes the next sequence while its padding stays within a fixed share of its positions (`slack`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specrl.least_squares import solved


@dataclass(frozen=True)
class ForwardCost:
    """Seconds of a forward: `fixed` + `position` · rows · width + `pair` · rows · width² +
    `logit` · rows · kept."""

    fixed: float
    position: float
    pair: float
    logit: float

    def of(self, rows: np.ndarray, width: np.ndarray, kept: np.ndarray) -> np.ndarray:
        return self.fixed + rows * (
            self.position * width + self.pair * width**2 + self.logit * kept
        )


class PassCost:
    """A `ForwardCost` fitted to the verification batches an engine has run, each observed as its
    rows, padded width, logits columns kept per row and seconds: least squares, exponentially
    weighted, with no cost below zero. Of the fits over each set of the terms that includes the
    per-position one, those whose costs all come out positive, the one with the least error (the
    terms left out cost nothing). None until a fit exists: too few batches, or batches too alike
    to separate the costs."""

    decay = 0.98  # per batch: the costs drift slowly

    def __init__(self) -> None:
        # weighted sums of y·yᵀ, y = (1, rows·W, rows·W², rows·K, seconds)
        self._sums = np.zeros((5, 5))
        self._fit: ForwardCost | None = None
        self._unfitted = 0  # batches observed since _fit was fitted

    def observe(self, rows: int, width: int, kept: int, seconds: float) -> None:
        y = np.array([1.0, rows * width, rows * width**2, rows * kept, seconds])
        self._sums = self.decay * self._sums + np.outer(y, y)
        self._unfitted += 1

    def fit(self) -> ForwardCost | None:
        """The fitted costs (None: not separable yet)."""
        if self._unfitted:
            self._fit, self._unfitted = self._fitted(), 0
        return self._fit

    def _fitted(self) -> ForwardCost | None:
        xx, xt, tt = self._sums[:4, :4], self._sums[:4, 4], self._sums[4, 4]
        if xx[0, 0] < 4:
            return None
        best, least = None, np.inf
        for others in itertools.product([False, True], repeat=3):
            terms = np.flatnonzero([others[0], True, *others[1:]])
            c = solved(xx[np.ix_(terms, terms)], xt[terms])
            if c is None or (c <= 0).any():
                continue
            error = tt - 2 * c @ xt[terms] + c @ xx[np.ix_(terms, terms)] @ c
            if error < least:
                best, least = (terms, c), error
        if best is None:
            return None
        costs = np.zeros(4)
        costs[best[0]] = best[1]
        return ForwardCost(*map(float, costs))


def width_batches(
    widths: Sequence[int],
    keys: Sequence[tuple],
    max_rows: int,
    slack: float,
    max_positions: int | None = None,
    kept: Sequence[int] | None = None,
    cost: ForwardCost | None = None,
) -> list[list[int]]:
    """The indices of sequences `widths` positions wide grouped into forwards, each padded to
    its widest, of at most `max_rows` rows and `max_positions` positions (padding included).
    Widest first; with a `cost` (and the logits columns each sequence keeps, `kept`), the
    grouping of that order into consecutive forwards of least total cost; without, a batch takes
    the next sequence while its positions stay within `1 + slack` times its real ones. Equal
    widths are ordered by their `keys` (the sequences' tokens), so the batches, and the float
    rounding of what they compute, do not depend on the order the sequences come in."""
    order = sorted(range(len(widths)), key=lambda i: (-widths[i], keys[i]))
    if cost is None or not order:
        return _within_slack(order, widths, max_rows, slack, max_positions)
    width = np.array([widths[i] for i in order], dtype=np.float64)
    keep = np.array([(kept or widths)[i] for i in order], dtype=np.float64)
    n = len(order)
    best = np.zeros(n + 1)  # best[j]: the least cost of the first j sequences
    start = np.zeros(n + 1, dtype=np.int64)  # where the last forward of that grouping starts
    for j in range(1, n + 1):
        first = np.arange(max(0, j - max_rows), j)  # the candidate first rows of the last forward
        rows = j - first
        most_kept = np.maximum.accumulate(keep[first[0] : j][::-1])[::-1]
        total = best[first] + cost.of(rows, width[first], most_kept)
        if max_positions is not None:
            total[(rows > 1) & (rows * width[first] > max_positions)] = np.inf
        k = int(np.argmin(total))  # ties: the longest last forward
        best[j], start[j] = total[k], first[k]
    batches, j = [], n
    while j > 0:
        batches.append(order[start[j] : j])
        j = int(start[j])
    return batches[::-1]


def _within_slack(
    order: list[int],
    widths: Sequence[int],
    max_rows: int,
    slack: float,
    max_positions: int | None,
) -> list[list[int]]:
    batches: list[list[int]] = []
    real = 0  # the last batch's real positions
    for i in order:
        if batches:
            batch = batches[-1]
            padded = (len(batch) + 1) * widths[batch[0]]
            if (
                len(batch) < max_rows
                and padded <= (1 + slack) * (real + widths[i])
                and (max_positions is None or padded <= max_positions)
            ):
                batch.append(i)
                real += widths[i]
                continue
        batches.append([i])
        real = widths[i]
    return batches


def in_batches(
    requests: Sequence,
    batches: list[list[int]],
    compute: Callable[[list], list],
    cost: PassCost,
    widths: Sequence[int],
    kept: Sequence[int],
) -> list:
    """`compute` of each batch of `requests` (indices), its results back in the requests' order;
    each batch's seconds (its inputs built, its forward, its results read back to the host)
    observed by `cost` at its rows, padded width and logits columns."""
    out: list = [None] * len(requests)
    for batch in batches:
        started = time.perf_counter()
        results = compute([requests[i] for i in batch])
        width, most = max(widths[i] for i in batch), max(kept[i] for i in batch)
        cost.observe(len(batch), width, most, time.perf_counter() - started)
        for i, result in zip(batch, results, strict=True):
            out[i] = result
    return out
