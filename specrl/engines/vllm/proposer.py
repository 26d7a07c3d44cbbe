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
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from specrl.engines.protocol import Drafter, GenResult


class DraftSession:
    """The drafts of one `generate_with_drafts` call. Its vLLM requests are numbered 0, 1, …
    in the order submitted; each continues the drafter's request `index` (from the position
    `start` of its token ids on: the drafter's new tokens) and may decode up to `budget` new
    tokens. The session keeps vLLM's request id of each, what each was proposed at the last
    step, and per request counts for its `GenResult`."""

    def __init__(
        self, drafter: Drafter, max_tokens: int, requests: Sequence[tuple[int, int, int]]
    ) -> None:
        """`requests`: (index, start, budget) per vLLM request."""
        self.drafter = drafter
        self.max_tokens = min(max_tokens, drafter.max_tokens)
        self.targets = list(requests)
        self.rows_of: dict[str, int] = {}  # vLLM request id → its number in this session
        self.forwards = [0] * len(requests)
        self.draft_tokens = [0] * len(requests)
        self.accepted_tokens = [0] * len(requests)
        self._proposed: dict[str, int] = {}  # vLLM id → draft tokens proposed at the last step
        self._fed = 0  # tokens the last step's forward computes: one per request, plus drafts
        self._last_call: float | None = None

    def add(self, vllm_id: str, number: int) -> None:
        self.rows_of[vllm_id] = number

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
            number = self.rows_of.get(req_ids[row]) if tokens else None
            if number is None:
                continue
            index, start, budget = self.targets[number]
            self.forwards[number] += 1
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
            if drafts[row]:
                self._proposed[req_ids[row]] = len(drafts[row])
        self._fed = len(sampled) + sum(len(d) for d in drafts)
        self._last_call = time.perf_counter()
        return drafts

    def _observe(self, req_ids: Sequence[str | None], sampled: Sequence[Sequence[int]], now: float):
        """What the last step did with the drafts it verified (a row that got k drafts and
        produced m tokens accepted m - 1 of them), and how long it took: from the end of the
        last call to this one, one engine step (the first call follows the prefill, which is
        not a decode step: nothing to observe)."""
        proposed, accepted = [], []
        for row, tokens in enumerate(sampled):
            k = self._proposed.pop(req_ids[row], 0)
            if k and tokens:
                number = self.rows_of[req_ids[row]]
                proposed.append(k)
                accepted.append(min(len(tokens) - 1, k))
                self.draft_tokens[number] += k
                self.accepted_tokens[number] += accepted[-1]
        self._proposed.clear()  # requests that finished or were preempted
        if self._last_call is not None:
            self.drafter.observe(proposed, accepted, self._fed, now - self._last_call)

    def count(self, number: int, result: GenResult) -> None:
        """Add vLLM request `number`'s forwards (its prefill included) and draft counts."""
        result.forwards += self.forwards[number] + 1
        result.draft_tokens += self.draft_tokens[number]
        result.accepted_tokens += self.accepted_tokens[number]


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
