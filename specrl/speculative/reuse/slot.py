"""Per-slot drafts (`rollout.spec.reuse=slot`, SPEC-RL): each slot's stored draft, its last
response, verified by the current policy, cut by the acceptance rule, continued from the cut.
`SlotReuse` verifies drafts in one pass before decoding (or in chunks), as far as its budget finds
it pays (`DraftBudget`, budget.py); `SlotReuseInDecoding` hands them to decoding, which verifies
them as it goes (`verify_mode=decoding`, exact rule)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from specrl.config import SpecConfig
from specrl.engines import (
    GenRequest,
    GenResult,
    LogprobRequest,
    Prefixes,
    RolloutEngine,
    SamplingParams,
)
from specrl.rollouts import rollout_seed
from specrl.speculative.acceptance import AcceptanceRule
from specrl.speculative.drafting import DraftSource, StoredDrafts
from specrl.speculative.reuse.base import Reuse
from specrl.speculative.reuse.budget import DraftBudget
from specrl.speculative.slots import Reused, Slot, common_prefix
from specrl.speculative.stats import RolloutStats
from specrl.speculative.store import RolloutStore, StoredRollout
from specrl.types import Rollout


class StoredDraftReuse(Reuse):
    """Reuse of each slot's stored draft: every rollout becomes its slot's next draft."""

    def __init__(self, store: RolloutStore) -> None:
        self.store = store

    def keep(self, rollouts: Sequence[Rollout]) -> None:
        for r in rollouts:
            self.store.put(r)


class SlotReuse(StoredDraftReuse):
    """Each slot's stored draft verified before decoding, up to the budget's limit: `full`
    verifies every such token in one pass; `chunked` verifies verify_chunk_size tokens per pass
    and drops each draft from later passes at its first rejection."""

    def __init__(
        self,
        engine: RolloutEngine,
        rule: AcceptanceRule,
        store: RolloutStore,
        sampling: SamplingParams,
        cfg: SpecConfig,
        budget: DraftBudget,
    ) -> None:
        super().__init__(store)
        self.engine = engine
        self.rule = rule
        self.sampling = sampling
        self.cfg = cfg
        self.budget = budget

    def before_decoding(
        self, slots: list[Slot], seed_key: tuple, prefixes: Prefixes | None, stats: RolloutStats
    ) -> None:
        """Find each slot's draft, verify the drafts, and set what each slot keeps of its own."""
        started = time.perf_counter()
        attach_drafts(slots, self.store)
        drafted = [i for i, s in enumerate(slots) if s.draft is not None]
        limit = self.budget.limit([min(len(slots[i].draft), slots[i].budget) for i in drafted])
        stats.draft_verify_limit = -1 if limit is None else limit
        if limit == 0:  # the evidence against verifying decays: later calls probe again
            self.budget.observe_cuts(0, 0)
            stats.drafts_skipped += len(drafted)
            stats.verify_s += time.perf_counter() - started
            return
        active = [
            (i, slots[i].draft.token_ids[: slots[i].budget][:limit].tolist()) for i in drafted
        ]
        whole = max((len(target) for _, target in active), default=0)
        chunk = self.cfg.verify_chunk_size if self.cfg.verify_mode == "chunked" else whole
        verified: dict[int, list[float]] = {}  # current logprobs of each draft's verified tokens
        offset = 0
        evidence = np.zeros(4)  # engine seconds, positions computed, tokens accepted, rejections
        while active:
            requests = [
                LogprobRequest(
                    [*slots[i].prompt.ids, *target[:offset]],
                    target[offset : offset + chunk],
                    self.sampling,
                )
                for i, target in active
            ]
            engine_s = stats.engine_s
            chunk_logprobs = stats.timed(self.engine.logprobs, requests, prefixes)
            evidence[0] += stats.engine_s - engine_s
            evidence[1] += sum(len(r.context_ids) + len(r.target_ids) for r in requests)
            for (i, _), logprobs in zip(active, chunk_logprobs, strict=True):
                old = slots[i].draft.current_logprobs[offset : offset + len(logprobs)]
                stats.logprob_drift_sum += float(np.abs(logprobs.numpy() - old).sum())
                verified.setdefault(i, []).extend(logprobs.tolist())
                stats.verified_tokens += len(logprobs)
            cuts = self.rule.cuts(
                [verified[i] for i, _ in active],
                [slots[i].draft.current_logprobs for i, _ in active],
                [rollout_seed(*seed_key, slots[i].prompt.prompt_id, slots[i].slot, "verify")
                 for i, _ in active],
            )  # fmt: skip
            still = []
            for (i, target), k in zip(active, cuts, strict=True):
                if k < len(verified[i]) or len(verified[i]) == len(target):
                    slots[i].reused = self._cut(slots[i], k, verified[i])
                    evidence[2:] += k, k < len(verified[i])
                else:
                    still.append((i, target))
            active, offset = still, offset + chunk
        self.budget.observe_verify(*evidence[:2])
        self.budget.observe_cuts(*evidence[2:])
        stats.verify_s += time.perf_counter() - started

    def _cut(self, s: Slot, k: int, verified: list[float]) -> Reused:
        """A slot's draft cut at k: reused whole when the cut is its end and the draft stopped
        there or filled the slot's budget; else decoding continues from the cut, excluding the
        rule's residual of the rejected token (none where every verified token was accepted: the
        draft, or the part of it the budget verified, ended there)."""
        draft = s.draft
        tokens = draft.token_ids[:k].tolist()
        if k == len(draft) and (draft.finish_reason == "stop" or k >= s.budget):
            return Reused(tokens, verified[:k], draft.finish_reason, checked=verified)
        rejected = k < len(verified) and k < s.budget
        excluded = self.rule.residual(int(draft.token_ids[k])) if rejected else ()
        return Reused(tokens, verified[:k], None, excluded, checked=verified)

    def after_decoding(
        self, slots: list[Slot], results: dict[int, GenResult], stats: RolloutStats
    ) -> None:
        """What decoding cost per token: the budget's price of a token not reused; what its
        prefills cost per position: the price of a verified one before any pass is timed."""
        self.budget.observe_decode(stats.gen_s, sum(len(r.token_ids) for r in results.values()))
        self.budget.observe_prefill(self.engine.counts)
        stats.draft_accept_rate = self.budget.accept_rate


class SlotReuseInDecoding(StoredDraftReuse):
    """Each slot's stored draft proposed to decoding, which verifies it with the exact rule as it
    goes (then the token trees propose); a slot keeps the longest prefix of its draft its
    response starts with (under the exact rule a response leaves its draft exactly where a draft
    token is rejected), as if it had been continued from that cut."""

    drafts_in_decoding = True

    def before_decoding(
        self, slots: list[Slot], seed_key: tuple, prefixes: Prefixes | None, stats: RolloutStats
    ) -> None:
        attach_drafts(slots, self.store)

    def drafter(
        self, slots: Sequence[Slot], requests: dict[int, GenRequest], trees: DraftSource | None
    ) -> DraftSource | None:
        drafts = [(slots[i].draft, slots[i].budget) for i in requests]
        if trees is None and all(d is None for d, _ in drafts):
            return None
        return StoredDrafts([None if d is None else d.token_ids[:b] for d, b in drafts], trees)

    def after_decoding(
        self, slots: list[Slot], results: dict[int, GenResult], stats: RolloutStats
    ) -> None:
        """Split each drafted slot's result at the end of the draft prefix it kept."""
        for i, r in results.items():
            s = slots[i]
            if s.draft is None:
                continue
            cut = common_prefix(r.token_ids, s.draft.token_ids[: s.budget])
            s.reused = Reused(r.token_ids[:cut], r.logprobs[:cut], None)
            results[i] = dataclasses.replace(
                r, token_ids=r.token_ids[cut:], logprobs=r.logprobs[cut:]
            )


def attach_drafts(slots: Sequence[Slot], store: RolloutStore) -> None:
    """Each slot that may reuse gets its stored draft (the last rollout of its prompt and slot),
    if it has a non-empty one."""
    for s in slots:
        if s.may_reuse:
            s.draft = _draft(store.get(s.prompt.prompt_id, s.slot))


def _draft(draft: StoredRollout | None) -> StoredRollout | None:
    return draft if draft is not None and len(draft) > 0 else None
