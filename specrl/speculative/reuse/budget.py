"""How much history is worth verifying: `TrieBudget`, the nodes of a prompt's history trie;
`DraftBudget`, the tokens of a slot's stored draft. Both weigh what verifying a token costs
against what reusing one saves (`VerifyCosts`).

**Tries.**
Verifying node v costs one position of a trie pass (c_node seconds); it saves one decoded token
(c_token seconds) for every slot whose walk reaches v. The walk follows the current policy, and the
trie already holds an estimate of where it goes: the responses of earlier rollouts, sampled by
earlier policies. A walker at node u moves to child c with probability ≈ ρ_k · count[c] / count[u]
(the share of u's earlier responses that went on to c), where ρ_k ≤ 1, the drift of that kind of
move (`drift_bucket`), is fitted online from where each call's responses landed in their tries as
the call found them (how often a response that stood at a node went on to each kind of child,
against what the counts predicted). The kinds: c is u's only way on so far, held by 1, 2, 3 or more
responses (a count of one is one sample of where the policy goes); or c is a branch one response
took, or more did. Rare branches need their own: of the branches a few samples show, the rare ones
were lucky to be seen (the shipped task: ρ 0.715 for branches one response took, 0.95-1.0 for the
only way on, `benchmarks/cpu-hf-noisy-facts-trie-drift-kinds`). A response is what its walk and
decoding drew, so this is a walk of the whole trie in hindsight: the evidence covers every node,
verified or not, and comes every call, also when nothing was verified. Down a path the factors
telescope:

    E[walkers reaching v] = W · Π ρ_k over the moves to v · count[v] / count[root]   (W: walkers)

and where the trie knows a move's drawn interval, each walker's own uniform predicts it
(`expected_walkers`, walkers.py), the interval widened by the sharpening δ (`sharpening`: RL
makes the tokens a policy sampled likelier), moved on every call until the walkers predicted
over the tries' nodes are as many as reached them in hindsight. v is verified when that times
c_token exceeds c_node. The rule keeps a subtree: no move's probability exceeds 1, so a node
that pays has parents that pay. A pruned child is where a walk leaves the trie, and decoding
goes on from there with the slot's own uniforms: the rollouts are the same tokens (or, off the
transformers engine, the same distribution) as without a budget.

A pass is a forward of its own, and it computes its prompts as decoding's prefill would: what a
pass costs beyond that prefill is its nodes' positions and two things no node's price holds. Where
some other prompt of the step is prefilled anyway (one with no history, or one with no node that
pays), the pass adds a forward to the step, and with it a forward's fixed cost, c0 (SmolLM2-135M on
2 CPU cores: a pass of one or two prompts and one or two nodes cost 0.17-0.40 s more than the
prefill it took them from, for two to four tokens reused). And a pass computes a position more
dearly than a prefill (the tree mask, logits at every node's column: on SmolLM2 early in RL a pass
of four prompts and 5-25 nodes cost 0.18 s more than vanilla's prefill of the same prompts, for
7-39 tokens reused), so its prompt positions cost it c_node − c_prefill each beyond the prefill
(`prompt_cost`; c_prefill the engine's prefill seconds per position, nothing where a pass is the
cheaper). So the step's selections must together save more than both: Σ over the nodes of
(E[walkers reaching v] · c_token − c_node) > P · (c_node − c_prefill) + c0 where the pass adds a
forward, P its prompt positions and c0 the decode forwards' fitted cost besides their rows
(`pays_a_pass`).

Both costs are measured on the engine's own calls, as wall seconds: c_node is a trie pass's seconds
per position it computed (prompt and nodes: a pass prefills its prompts, which decoding then
reuses). c_token is what a reused token saves decoding: one row of forwards that run anyway (cs,
`DraftWidth`'s per-sequence cost, fitted to every decode iteration of the engine as c0 + cs · rows
+ cd · drafts + cf), plus c0 for each forward of the loop it removes. The decode loop runs until
its slowest slot is done, so a reused token removes a forward only where it shortens the longest
tail. That is measured in hindsight on every call, over all its slots: F the longest response, F'
the longest that would have been left to decode after walks of the whole tries, H the tokens
reusable: c_token = cs + c0 · (F − F') / H, the sums decayed, (F − F') / H at most 1. Early in RL
a few slots reuse a little and F' = F: a node pays only the rows it saves (SmolLM2-135M on 2 CPU
cores: c0 ≈ 80 ms, cs ≈ 2.5 ms, c_node ≈ 2.5-3.5 ms, so only nodes most of a prompt's slots
reach). Late in RL most tokens are reused and a few slots decode a few tokens in as many forwards
as the longest tail: per token decoded the forwards cost many times c0 / tokens per forward, but
a reused token still removes only (F − F') / H of them. Before any evidence, or before the
forwards are fitted, c_token = cs + (a − cs) · f, a being decoding's average seconds per token (cs
plus c0 spread over the tokens it decoded) and f the share of the loop's forwards reuse removes per
share of the tokens it reuses, ((F − F') / F) / (H / T) of the T response tokens (at most 1), or
before any evidence r, the share of the prompt's tokens its walks are expected to reuse were every
node verified (Σ E[walkers reaching v] over W · Σ count[v] / count[root]); early in RL, when few
tokens are reused, the two prices agree. On an engine that decodes as CUDA graphs a row costs
nothing (`rows_free`: a bucket's graph computes all its rows), so cs = 0 and nothing is verified
until reuse shortens the loop; elsewhere, until cs is fitted (too little spread in the forwards'
batch sizes), and whenever the fit puts it at zero (the forwards too alike to tell a row from the
forward or its drafts: once in the built-in run's 128 steps, and that step priced a token at a
tenth of a node and verified nothing), c_token is a. Until a verification pass has been timed,
c_node is the engine's prefill seconds per position (a pass computes its positions as a prefill
does; decoding's prefills are timed from the first call on). All evidence decays by `decay` per
call. Each ρ_k has a prior of one predicted move, 0.9 of it taken: before any walk, the policy is
taken to have moved from its history, so the first pass verifies the nodes within a few tokens of
the roots and those many responses share, and the evidence decides how deep later passes go (on a
real model early in RL a first pass of every node cost half a step's decoding; on the shipped task
the first pass, at 0.9, still reuses about half of what the next ones do). Until both costs have
been measured (on an engine that does not time its prefills, until its first pass) every node is
verified. The budget is not checkpointed: a resumed run measures its machine again.

**Drafts** (`reuse=slot`, verified in one pass or in chunks). A slot's draft token j is reused only
when the rule accepts it and every token before it: with probability ≈ α^j, α the rule's per-token
accept rate, fitted from the cuts (tokens accepted against tokens accepted plus rejections,
decayed, with a prior like ρ's: one token decided, 0.9 of it accepted). Token j is verified
while α^j · c_token exceeds c_node, c_node being the verification passes' seconds per position
(context and draft) and c_token priced as for tries before their evidence, with r the share of
the drafts' tokens expected to be reused.
The verified part is a prefix of the draft; a draft all of whose verified prefix is accepted is
continued by decoding from there, as if the draft had ended there (nothing was rejected, so no
residual): under the exact rule the rollouts stay distributed as the policy's samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specrl.engines.accounting import ForwardCounts
from specrl.speculative.draft_width import DraftWidth
from specrl.speculative.reuse.walkers import DRIFT_BUCKETS, expected_walkers
from specrl.speculative.tree import ROOT, PromptTree


@dataclass
class Selection:
    """The nodes of one trie chosen for verification (tree ids, parents first, root excluded),
    the reused tokens their verification is expected to bring, and the seconds it is expected to
    save beyond its nodes' positions (inf: the costs are not known, or the budget is off)."""

    nodes: list[int]
    expected_tokens: float
    saving: float = math.inf
    reach: float = 0.0  # E[walkers reaching v] summed over every node of the trie


class VerifyCosts:
    """c_node and c_token, measured on the engine's calls; `width`: the stage's draft-width
    controller, whose fit of decode forwards prices a token (None: decoding's average seconds
    per token). `enabled` false: everything is verified."""

    def __init__(
        self,
        enabled: bool = True,
        width: DraftWidth | None = None,
        decay: float = 0.8,
        rows_free: bool = False,
    ) -> None:
        self.enabled = enabled
        self.width = width
        self.rows_free = rows_free
        self.decay = decay
        # decayed sums: [seconds, positions] of verification passes and of the engine's prefill
        # forwards, [seconds, tokens] of decoding
        self._verify = np.zeros(2)
        self._prefill = np.zeros(2)
        self._decode = np.zeros(2)
        self._prefilled = (0.0, 0)  # the engine's prefill counts when last observed

    @property
    def node_cost(self) -> float | None:
        """Seconds a verification pass spends per position: as measured, or before any pass as a
        prefill's (None: neither measured yet)."""
        seconds, positions = self._verify if self._verify[1] > 0 else self._prefill
        return seconds / positions if positions > 0 else None

    @property
    def prompt_cost(self) -> float:
        """What a verification pass spends on a prompt position beyond what decoding's prefill
        does: its seconds per position less the prefill's, none below zero (0: either not
        measured yet)."""
        if self._verify[1] <= 0 or self._prefill[1] <= 0:
            return 0.0
        return max(0.0, self._verify[0] / self._verify[1] - self._prefill[0] / self._prefill[1])

    @property
    def average_token_cost(self) -> float | None:
        """Decoding's seconds per token produced (None: not measured yet)."""
        return self._decode[0] / self._decode[1] if self._decode[1] > 0 else None

    @property
    def forward_cost(self) -> float | None:
        """c0: what a decode iteration costs besides its rows, as fitted (None: not yet)."""
        fit = self.width.cost() if self.width is not None else None
        return None if fit is None else fit[0]

    @property
    def row_cost(self) -> float | None:
        """What one more row costs a decode forward: nothing on an engine that decodes as CUDA
        graphs (a bucket's graph computes all its rows), else as fitted (None: not yet, or a fit
        that found rows free on an engine that computes each: forwards too alike in batch size
        to tell a row's cost from the forward's or the drafts')."""
        if self.rows_free:
            return 0.0
        fit = self.width.cost() if self.width is not None else None
        return None if fit is None or fit[1] <= self.width.least_cost else fit[1]

    def token_cost(self, reuse: float) -> float | None:
        """What one reused token saves where a share `reuse` of the tokens is expected to be
        reused: one row of the forwards, and the share of the forwards' fixed cost that many
        fewer rows save (None: not measured yet)."""
        average, row = self.average_token_cost, self.row_cost
        if average is None or row is None or row >= average:
            return average
        return row + (average - row) * reuse

    def observe_verify(self, seconds: float, positions: int) -> None:
        self._verify = self.decay * self._verify + (seconds, positions)

    def observe_decode(self, seconds: float, tokens: int) -> None:
        if tokens:
            self._decode = self.decay * self._decode + (seconds, tokens)

    def observe_prefill(self, counts: ForwardCounts) -> None:
        """The engine's prefill forwards since the last call, from its running `counts` (none
        where the engine does not time its forwards)."""
        seconds = counts.prefill_seconds - self._prefilled[0]
        positions = counts.prefill_computed_positions - self._prefilled[1]
        self._prefilled = (counts.prefill_seconds, counts.prefill_computed_positions)
        if seconds > 0 and positions > 0:
            self._prefill = self.decay * self._prefill + (seconds, positions)


class TrieBudget(VerifyCosts):
    shift_prior = 0.05  # σ before any pass: an interval's end moves by 0.05
    sharpening_rate = 1.0  # δ's step per log of the realised over the predicted walkers
    sharpening_range = (-1.0, 3.0)  # δ = 3: an interval of width 0.05 has widened to 0.51

    def __init__(
        self,
        enabled: bool = True,
        width: DraftWidth | None = None,
        decay: float = 0.8,
        rows_free: bool = False,
    ) -> None:
        super().__init__(enabled, width, decay, rows_free)
        # decayed [moves taken, moves predicted] of whole-trie walks, by kind (`drift_bucket`)
        self._moves = np.zeros((2, DRIFT_BUCKETS))
        # decayed [forwards removed, forwards, tokens reused, tokens] of the calls' decode
        # loops, had every node been verified
        self._loop = np.zeros(4)
        # decayed [distance moved, ends] of verified nodes' drawn intervals (`observe_shifts`)
        self._shifts = np.zeros(2)
        self.sharpening = 0.0  # δ (`observe_reach`)

    @property
    def drift(self) -> float:
        """ρ over all nodes: the walks' moves taken per move the trie's counts predicted (at
        most 1), from a prior of one predicted move, 0.9 of it taken."""
        taken, predicted = self._moves.sum(1)
        return min(1.0, (taken + 0.9) / (predicted + 1.0))

    @property
    def drifts(self) -> np.ndarray:
        """ρ of each kind of move (`drift_bucket`), each from the same prior."""
        taken, predicted = self._moves
        return np.minimum(1.0, (taken + 0.9) / (predicted + 1.0))

    @property
    def forwards_per_reused_token(self) -> float | None:
        """The decode forwards a reused token removes, in hindsight: forwards removed over tokens
        reusable, at most 1 (None: nothing was reusable lately)."""
        removed, _, reused, _ = self._loop
        return min(1.0, removed / reused) if reused > 0 else None

    @property
    def hindsight_token_cost(self) -> float | None:
        """c_token once the loop's evidence is in: one row of the forwards that run anyway and c0
        for every forward it removes (None: no evidence, or the forwards not fitted yet)."""
        per_token, forward, row = self.forwards_per_reused_token, self.forward_cost, self.row_cost
        if per_token is None or forward is None or row is None:
            return None
        return row + forward * per_token

    @property
    def loop_factor(self) -> float | None:
        """The share of the decode loop's forwards reuse removes per share of the tokens it
        reuses, at most 1 (None: nothing was reusable lately)."""
        removed, forwards, reused, tokens = self._loop
        if reused <= 0 or forwards <= 0:
            return None
        return min(1.0, (removed / forwards) / (reused / tokens))

    @property
    def shift_measured(self) -> bool:  # a pass has measured σ (else it is its prior)
        return self._shifts[1] > 0

    @property
    def shift(self) -> float:
        """σ: the scale of how far a drawn interval's ends move between the policy that drew a
        token and the current one (Laplace: the mean distance moved), from a prior of one end
        moved by `shift_prior`."""
        moved, ends = self._shifts
        return (moved + self.shift_prior) / (ends + 1.0)

    def select(
        self, tree: PromptTree, walkers: int, uniforms: np.ndarray | None = None
    ) -> Selection:
        """The nodes of `tree` worth verifying for `walkers` slots (`select_all` of one)."""
        return self.select_all([tree], [walkers], [uniforms])[0]

    def select_all(
        self,
        trees: Sequence[PromptTree],
        walkers: Sequence[int],
        uniforms: Sequence[np.ndarray | None],
    ) -> list[Selection]:
        """The nodes of each of `trees` worth verifying for its `walkers` slots (with their
        uniforms, where known: `expected_walkers`), all of them while the costs are unknown, or
        with the budget off."""
        reach = expected_walkers(trees, walkers, uniforms, self.drifts, self.shift, self.sharpening)
        return [self._selection(*args) for args in zip(trees, walkers, reach, strict=True)]

    def _selection(self, tree: PromptTree, walkers: int, reach: np.ndarray) -> Selection:
        counts = tree.count
        # the share of the prompt's tokens the walks are expected to reuse, were all verified
        reuse = (
            float(reach.sum() / (walkers * sum(counts[1:]) / counts[ROOT]))
            if len(counts) > 1
            else 0.0
        )
        node_cost = self.node_cost
        token_cost = self.hindsight_token_cost
        if token_cost is None:
            factor = self.loop_factor
            token_cost = self.token_cost(reuse if factor is None else factor)
        total = float(reach.sum())
        if not self.enabled or node_cost is None or token_cost is None:
            nodes = np.arange(1, len(counts))
            return Selection(nodes.tolist(), float(reach[nodes].sum()), reach=total)
        nodes = np.flatnonzero(reach * token_cost > node_cost)
        expected = float(reach[nodes].sum())
        saving = expected * token_cost - len(nodes) * node_cost
        return Selection(nodes.tolist(), expected, saving, total)

    def pays_a_pass(
        self, selections: Sequence[Selection], prompt_positions: int, adds_forward: bool
    ) -> bool:
        """Whether a trie pass of these selections pays: their savings beyond their nodes'
        positions exceed what the pass costs beyond decoding's prefill of its prompts: its
        `prompt_positions` at `prompt_cost` each, and where it adds a forward to the step
        (`adds_forward`: decoding prefills some other prompt anyway) that forward's fixed cost,
        c0 as fitted (nothing until it is)."""
        cost = prompt_positions * self.prompt_cost
        forward = self.forward_cost
        if adds_forward and forward is not None:
            cost += forward
        return sum(s.saving for s in selections) > cost

    def observe_walks(self, moves: np.ndarray) -> None:
        """One call's whole-trie walks (`reachable`): [moves taken, moves predicted] by kind
        (`drift_bucket`)."""
        self._moves = self.decay * self._moves + moves

    def observe_shifts(self, old: np.ndarray, new: np.ndarray) -> None:
        """One pass's verified nodes whose drawn intervals the trie knew: their ends as drawn
        (`old` [M, 2]) and under the current policy (`new` [M, 2])."""
        moved = np.abs(new - old)
        self._shifts = self.decay * self._shifts + (float(moved.sum()), moved.size)

    def observe_reach(self, predicted: float, realised: float) -> None:
        """One call's walkers over its tries' nodes as predicted at δ and as reached in hindsight
        (`reachable`): δ moves by `sharpening_rate` · log((realised + 1) / (predicted + 1)),
        within `sharpening_range`, until the predictions reach as far as the walks do."""
        step = self.sharpening_rate * math.log((realised + 1.0) / (predicted + 1.0))
        low, high = self.sharpening_range
        self.sharpening = min(high, max(low, self.sharpening + step))

    def observe_loop(self, lengths: Sequence[int], reusable: Sequence[int]) -> None:
        """One call's slots (all of them: they share the decode loop): each response's length,
        and how many of its leading tokens its trie held."""
        if not lengths:
            return
        longest = max(lengths)
        tail = max(n - h for n, h in zip(lengths, reusable, strict=True))
        seen = (longest - tail, longest, sum(reusable), sum(lengths))
        self._loop = self.decay * self._loop + seen


class DraftBudget(VerifyCosts):
    def __init__(
        self,
        enabled: bool = True,
        width: DraftWidth | None = None,
        decay: float = 0.8,
        rows_free: bool = False,
    ) -> None:
        super().__init__(enabled, width, decay, rows_free)
        self._cuts = np.zeros(2)  # decayed [tokens accepted, rejections] of verified drafts

    @property
    def accept_rate(self) -> float:
        """α: the rule's accepted tokens per token it decided on, from a prior of one token
        decided, 0.9 of it accepted."""
        accepted, rejected = self._cuts
        return (accepted + 0.9) / (accepted + rejected + 1.0)

    def limit(self, lengths: list[int]) -> int | None:
        """The most tokens of a draft worth verifying, for drafts of these lengths (None: all of
        them, while the costs are unknown or with the budget off)."""
        alpha = self.accept_rate
        if alpha >= 1.0 or sum(lengths) == 0:
            return None
        # the share of the drafts' tokens expected to be reused, were all verified
        expected = sum(alpha * (1 - alpha**n) / (1 - alpha) for n in lengths)
        node_cost, token_cost = self.node_cost, self.token_cost(expected / sum(lengths))
        if not self.enabled or node_cost is None or token_cost is None:
            return None
        if token_cost * alpha <= node_cost:
            return 0
        # α^j · c_token > c_node  ⟺  j < log(c_node / c_token) / log α
        bound = math.log(node_cost / token_cost) / math.log(alpha)
        return math.ceil(bound) - 1 if bound == math.ceil(bound) else math.floor(bound)

    def observe_cuts(self, accepted: int, rejected: int) -> None:
        self._cuts = self.decay * self._cuts + (accepted, rejected)
