"""specrl's drafts inside vLLM: a proposer for vLLM's `custom_class` speculative method.

vLLM builds the proposer in its engine core (`speculative_config={"method": "custom_class",
"model": "specrl.engines.vllm.proposer.Proposer", "num_speculative_tokens": k}`) and asks it,
after every engine step, for up to k draft tokens per running request; its rejection sampler
verifies them against the target model as point masses: draft token d is accepted with
probability p(d), and on rejection the token is drawn from p without d, renormalised — specrl's
exact rule. The engine runs vLLM's core in its own process, so the proposer reads the stage's
drafts (token trees, stored rollouts) where they live: `VLLMEngine.generate_with_drafts` opens a
`DraftSession` over the call's `Drafter` for the length of the call, and the proposer maps each
running request of vLLM's input batch to the call's request (the request id the engine gave it)
and asks the drafter. The drafter's `DraftWidth` chooses k per step from the engine's own step
times, as it does on the transformers engine.

With vLLM's own suffix method in its place (`tree.method=suffix`, the anchor specrl's drafts are
measured against), `SuffixCounter` only counts, per request, the drafts that method proposed and
vLLM accepted.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from specrl.engines.protocol import Drafter, GenResult
from specrl.errors import UserError


def speculative_config(draft_tokens: int, draft_method: str) -> dict[str, Any]:
    """The `LLM` keyword that sets up drafts: specrl's proposer, vLLM's suffix decoding (which
    needs arctic-inference), or none when `draft_tokens` is 0."""
    if draft_tokens == 0:
        return {}
    if draft_method == "suffix":
        if importlib.util.find_spec("arctic_inference") is None:
            raise UserError(
                "rollout.spec.tree.method=suffix is vLLM's suffix decoding, which needs "
                "arctic-inference: pip install arctic-inference==0.1.1 (on a CPU it builds "
                "from source, see README), or set rollout.spec.tree.method=specrl"
            )
        return {"speculative_config": {"method": "suffix", "num_speculative_tokens": draft_tokens}}
    proposer = f"{Proposer.__module__}.{Proposer.__name__}"
    return {
        "speculative_config": {
            "method": "custom_class",
            "model": proposer,
            "num_speculative_tokens": draft_tokens,
        }
    }


class DraftCounts:
    """Per request of one engine call (numbered 0, 1, … in the order submitted; `rows_of` maps
    vLLM's request ids to them): the decode steps it took part in, the draft tokens verified
    for it and how many of those were accepted, read back from vLLM's steps: a row that was
    proposed k draft tokens at one step and produced m tokens at the next accepted m - 1."""

    def __init__(self, n: int) -> None:
        self.rows_of: dict[str, int] = {}
        self.forwards = [0] * n
        self.draft_tokens = [0] * n
        self.accepted_tokens = [0] * n
        self._proposed: dict[str, int] = {}  # vLLM id → draft tokens proposed at the last step

    def add(self, vllm_id: str, number: int) -> None:
        self.rows_of[vllm_id] = number

    def observe(
        self, req_ids: Sequence[str | None], sampled: Sequence[Sequence[int]]
    ) -> tuple[list[int], list[int]]:
        """Count the step that just produced `sampled[row]` for each row of vLLM's input batch
        (empty for a request still in a chunked prefill); return, over the rows that had been
        proposed drafts, how many each was proposed and accepted."""
        proposed, accepted = [], []
        for row, tokens in enumerate(sampled):
            k = self._proposed.pop(req_ids[row], 0)
            number = self.rows_of.get(req_ids[row])
            if number is None or not tokens:
                continue
            self.forwards[number] += 1
            if k:
                proposed.append(k)
                accepted.append(min(len(tokens) - 1, k))
                self.draft_tokens[number] += k
                self.accepted_tokens[number] += accepted[-1]
        self._proposed.clear()  # requests that finished or were preempted
        return proposed, accepted

    def proposing(self, req_ids: Sequence[str | None], drafts: Sequence[Sequence[int]]) -> None:
        """The drafts the next step verifies, per row."""
        for row, draft in enumerate(drafts):
            if draft and req_ids[row] in self.rows_of:
                self._proposed[req_ids[row]] = len(draft)

    def count(self, number: int, result: GenResult) -> None:
        """Add request `number`'s forwards and draft counts. vLLM asks for drafts after every
        step that sampled for a request, its prefill's included, so the steps it observed are
        all of the request's forwards."""
        result.forwards += self.forwards[number]
        result.draft_tokens += self.draft_tokens[number]
        result.accepted_tokens += self.accepted_tokens[number]


class DraftSession:
    """The drafts of one `generate_with_drafts` call. Each of its vLLM requests continues the
    drafter's request `index` (from the position `start` of its token ids on: the drafter's new
    tokens) and may decode up to `budget` new tokens; `counts` numbers them in the order
    submitted."""

    def __init__(
        self, drafter: Drafter, max_tokens: int, requests: Sequence[tuple[int, int, int]]
    ) -> None:
        """`requests`: (index, start, budget) per vLLM request."""
        self.drafter = drafter
        self.max_tokens = min(max_tokens, drafter.max_tokens)
        self.targets = list(requests)
        self.counts = DraftCounts(len(requests))
        self._rows, self._fed = 0, 0  # the next step's requests, and its tokens (plus drafts)
        self._last_call: float | None = None

    def finished(self, number: int, token_ids: Sequence[int]) -> None:
        """vLLM request `number` finished with these token ids (context included)."""
        index, start, _ = self.targets[number]
        self.drafter.finished(index, list(token_ids[start:]))

    def propose(
        self,
        req_ids: Sequence[str | None],
        sampled: Sequence[Sequence[int]],
        num_tokens: np.ndarray,
        token_ids: np.ndarray,
    ) -> list[list[int]]:
        """Drafts for the rows of vLLM's input batch. `sampled[row]` holds the tokens the step
        just produced for that row (empty for a request still in a chunked prefill);
        `token_ids[row, :num_tokens[row]]` is its whole sequence so far."""
        now = time.perf_counter()
        self._observe(req_ids, sampled, now)
        worthwhile = self.drafter.worthwhile(len(sampled))
        rows, proposals = [], []
        for row, tokens in enumerate(sampled):
            number = self.counts.rows_of.get(req_ids[row]) if tokens else None
            if number is None:
                continue
            index, start, budget = self.targets[number]
            new_tokens = token_ids[row, start : num_tokens[row]].tolist()
            room = min(self.max_tokens, budget - len(new_tokens) - 1)
            rows.append(row)
            proposals.append(
                self.drafter.propose(index, new_tokens, room) if room > 0 and worthwhile else []
            )
        k = self.drafter.choose([len(p) for p in proposals]) if proposals else 0
        drafts: list[list[int]] = [[] for _ in sampled]
        for row, proposal in zip(rows, proposals, strict=True):
            drafts[row] = proposal[:k]
        self.counts.proposing(req_ids, drafts)
        self._rows, self._fed = len(sampled), len(sampled) + sum(len(d) for d in drafts)
        self._last_call = now
        return drafts

    def _observe(self, req_ids: Sequence[str | None], sampled: Sequence[Sequence[int]], now: float):
        """What the last step did with the drafts it verified, and how long it took: from the
        start of the last call to this one, its proposals and one engine step (the first call
        follows the prefill, which is not a decode step: nothing to observe)."""
        proposed, accepted = self.counts.observe(req_ids, sampled)
        if self._last_call is not None:
            self.drafter.observe(proposed, accepted, self._rows, self._fed, now - self._last_call)


class Proposer:
    """vLLM's custom proposer. Without an open session (plain `generate`) it proposes nothing,
    and vLLM decodes one token per step."""

    def __init__(self, vllm_config: Any) -> None:
        self.max_tokens = vllm_config.speculative_config.num_speculative_tokens
        self.runner: Any = None  # vLLM's model runner, attached by the engine (`attach`)
        self.session: DraftSession | None = None

    def load_model(self, model: Any) -> None:
        """vLLM's CPU model runner hands every drafter the target model; these drafts need
        none."""

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        if self.session is None:
            return [[] for _ in sampled_token_ids]
        return self.session.propose(
            self.runner.input_batch.req_ids, sampled_token_ids, num_tokens_no_spec, token_ids_cpu
        )


def attach(worker: Any) -> Proposer:
    """Run in vLLM's worker (`LLM.collective_rpc`): give the proposer the model runner, whose
    input batch names the request of every row, and hand the proposer back (one process)."""
    runner = worker.model_runner
    runner.drafter.runner = runner
    return runner.drafter


class SuffixCounter:
    """Counts the drafts of vLLM's own suffix proposer (`speculative_config={"method":
    "suffix"}`) per request of an engine call, while `counts` is set. Its `propose` is wrapped,
    not changed: vLLM's method drafts as it would without specrl."""

    def __init__(self, drafter: Any) -> None:
        self.counts: DraftCounts | None = None
        self._propose = drafter.propose
        drafter.propose = self.propose

    def propose(
        self, num_speculative_tokens: int, input_batch: Any, sampled_token_ids: Any, **kwargs: Any
    ) -> list[list[int]]:
        if self.counts is not None:
            self.counts.observe(input_batch.req_ids, sampled_token_ids)
        drafts = self._propose(num_speculative_tokens, input_batch, sampled_token_ids, **kwargs)
        if self.counts is not None:
            self.counts.proposing(input_batch.req_ids, drafts)
        return drafts


def count_suffix_drafts(worker: Any) -> SuffixCounter:
    """Run in vLLM's worker (`LLM.collective_rpc`): wrap the suffix proposer of its model
    runner with a `SuffixCounter` and hand that back (one process)."""
    return SuffixCounter(worker.model_runner.drafter)
