"""Requests driven through vLLM's `LLMEngine` (add_request / step) rather than `LLM.generate`,
so that every request's id is the engine's own, a finished request reaches specrl's drafter
while the rest still decode, and every engine step is counted as a forward (`accounting`).
Imports nothing of vllm itself: the engine hands its module over."""

from __future__ import annotations

from typing import Any

from specrl.engines.accounting import ForwardCounts, causal_attended
from specrl.engines.vllm.proposer import DraftCounts, DraftSession, Proposer, SuffixCounter


class Driver:
    def __init__(
        self,
        vllm: Any,
        engine: Any,
        counts: ForwardCounts,
        proposer: Proposer | None,
        suffix: SuffixCounter | None,
    ) -> None:
        self._vllm = vllm
        self.engine = engine  # vLLM's LLMEngine
        self.counts = counts
        self.proposer = proposer  # specrl's drafts (draft decoding), else None
        self.suffix = suffix  # vLLM's suffix decoding drafts, counted, else None

    def run(
        self,
        contexts: list[list[int]],
        params: list,
        kind: str,
        session: DraftSession | None = None,
        counts: DraftCounts | None = None,
    ) -> list:
        """vLLM's outputs for these requests, in order. With `session`, the proposer drafts for
        them while they decode, and each finished request is handed to the drafter at once (an
        online tree learns from it for the requests still running). With `counts` (vLLM's
        suffix decoding), its drafts are counted per request. Its engine steps are counted as
        forwards of `kind` (decode, or verify for prompt logprobs), each context as a prefill."""
        index: dict[str, int] = {}
        for i, (context, p) in enumerate(zip(contexts, params, strict=True)):
            p.output_kind = self._vllm.sampling_params.RequestOutputKind.FINAL_ONLY
            prompt = self._vllm.inputs.TokensPrompt(prompt_token_ids=context)
            vllm_id = self.engine.add_request(f"specrl-{i}", prompt, p)
            index[vllm_id] = index[f"specrl-{i}"] = i
            if counts is not None:
                counts.add(vllm_id, i)
        outputs: list = [None] * len(contexts)
        if session is not None:
            self.proposer.session = session
        if self.suffix is not None:
            self.suffix.counts = counts
        try:
            while self.engine.has_unfinished_requests():
                self.counts.record(kind, self.engine.get_num_unfinished_requests(), 0, 0, 0)
                for out in self.engine.step():
                    if out.finished:
                        i = index[out.request_id]
                        outputs[i] = out
                        if session is not None:
                            session.finished(i, [*out.prompt_token_ids, *out.outputs[0].token_ids])
        finally:
            if session is not None:
                self.proposer.session = None
            if self.suffix is not None:
                self.suffix.counts = None
        for out in outputs:
            new = len(out.outputs[0].token_ids)
            self._count(kind, len(out.prompt_token_ids), out.num_cached_tokens or 0, new)
        return outputs

    def _count(self, kind: str, context: int, cached: int, new: int) -> None:
        """A request's work, from its lengths: its context prefilled but for the `cached`
        positions the prefix cache spared, then one position per new token, each reading the
        context so far (a verification request's one new token included)."""
        computed = context - cached
        attended = causal_attended(computed, cached)
        self.counts.record("prefill", 0, computed, computed, attended, forwards=0)
        decoded = causal_attended(new, context)  # one position per forward: pairs = KV read
        self.counts.record(kind, 0, new, decoded, decoded, forwards=0)
