"""The rollout stage: prompts → n rollouts per prompt (slots), grouped by prompt.

`generate_rollouts` is plain sampling. `RolloutStage` is what the trainer calls every step:
with speculation on it runs drafts → verify → cut → continue → assemble → store (DESIGN.md);
with it off, or for a prompt seen for the first time, it is plain sampling through the same
code path. Either way the trainer receives ordinary rollouts plus `spec/*` metrics.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specrl.config import SpecConfig
from specrl.engines import GenRequest, GenResult, RolloutEngine, SamplingParams, ScoreRequest
from specrl.engines.sampling import seeded_uniform
from specrl.engines.speculation import Drafting, DraftWidth
from specrl.spec.store import RolloutStore, StoredRollout
from specrl.spec.tree import TokenTree, TreeDrafts
from specrl.spec.verify import (
    accept_mask,
    cut_indices,
    log_acceptance,
    specrl_behaviour_logprobs,
)
from specrl.types import Prompt, Rollout


def rollout_seed(*key: object) -> int:
    """A 63-bit seed from a key such as (run seed, step, prompt id, slot): fresh for every step,
    independent of batch composition and order."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generate_rollouts(
    engine: RolloutEngine,
    prompts: Sequence[Prompt],
    n: int,
    sampling: SamplingParams,
    max_response_length: int,
    seed_key: tuple,
    policy_version: int,
) -> list[Rollout]:
    """Plain sampling → len(prompts) * n rollouts, prompt-major (a prompt's slots contiguous)."""
    slots = [(p, s) for p in prompts for s in range(n)]
    requests = [
        GenRequest(p.ids, max_response_length, sampling, rollout_seed(*seed_key, p.prompt_id, s))
        for p, s in slots
    ]
    results = engine.generate(requests)
    return [
        Rollout(p, s, r.token_ids, r.logprobs, r.finish_reason, policy_version)
        for (p, s), r in zip(slots, results, strict=True)
    ]


@dataclass
class Verified:
    """Outcome of verifying one draft: the cut index and the current logprobs of the draft tokens
    scored (all of them, or up to the cut's chunk in chunked verification)."""

    cut: int
    scored: list[float]

    @property
    def logprobs(self) -> list[float]:
        """Current logprobs of the kept tokens, draft[:cut]."""
        return self.scored[: self.cut]


class RolloutStage:
    def __init__(
        self,
        engine: RolloutEngine,
        sampling: SamplingParams,
        max_response_length: int,
        spec: SpecConfig,
        store: RolloutStore,
    ) -> None:
        self.engine = engine
        self.sampling = sampling
        self.max_response_length = max_response_length
        self.spec = spec
        self.store = store
        uses_tree = spec.uses_tree(engine.drafts)
        self.tree = TokenTree(spec.tree.window, spec.tree.max_nodes) if uses_tree else None
        self.draft_width = DraftWidth(spec.tree.max_draft_tokens, spec.tree.adaptive)

    def __call__(
        self,
        prompts: Sequence[Prompt],
        n: int,
        seed_key: tuple,
        policy_version: int,
        metrics: dict[str, float],
    ) -> list[Rollout]:
        start = time.perf_counter()
        slots = [(p, s) for p in prompts for s in range(n)]
        seeds = [rollout_seed(*seed_key, p.prompt_id, s) for p, s in slots]
        drafts = [self._draft(p, s) for p, s in slots]
        verify_start = time.perf_counter()
        verified, verified_tokens = self._verify(slots, drafts, seed_key)
        verify_time = time.perf_counter() - verify_start

        requests: dict[int, GenRequest] = {}
        for i, ((prompt, _), draft, check) in enumerate(zip(slots, drafts, verified, strict=True)):
            request = self._continuation(prompt, draft, check, seeds[i])
            if request is not None:
                requests[i] = request
        drafting, evicted = self._tree_drafting(slots, drafts, verified, requests)
        gen_start = time.perf_counter()
        generated = self.engine.generate(list(requests.values()), drafting)
        results = dict(zip(requests, generated, strict=True))
        gen_time = time.perf_counter() - gen_start
        if self.tree is not None and not self.spec.tree.online:
            self.tree.insert_all(
                (slots[i][0].prompt_id, [*requests[i].prefix_ids, *r.token_ids])
                for i, r in results.items()
            )
        if self.tree is not None:
            evicted += self.tree.evict()

        rollouts = [
            self._assemble(prompt, slot, draft, check, results.get(i), policy_version)
            for i, ((prompt, slot), draft, check) in enumerate(
                zip(slots, drafts, verified, strict=True)
            )
        ]
        if self.spec.enabled and self.spec.acceptance == "specrl":
            behaviour_start = time.perf_counter()
            self._lenient_behaviour(slots, drafts, verified, rollouts, metrics)
            verify_time += time.perf_counter() - behaviour_start
        if self.spec.enabled:
            for r in rollouts:
                self.store.put(
                    r.prompt.prompt_id,
                    r.slot,
                    r.token_ids,
                    r.logprobs,
                    r.finish_reason,
                    policy_version,
                )
        _accumulate(metrics, "timing_s/gen", gen_time)
        _accumulate(metrics, "timing_s/verify", verify_time)
        _accumulate(metrics, "timing_s/rollout", time.perf_counter() - start)
        self._metrics(metrics, rollouts, verified, results, verified_tokens)
        if self.tree is not None:
            self._tree_metrics(metrics, results.values(), evicted)
        return rollouts

    # ---------------------------------------------------------------- drafts and verification
    def _draft(self, prompt: Prompt, slot: int) -> StoredRollout | None:
        if not self.spec.enabled:
            return None
        return self.store.get(prompt.prompt_id, slot)

    def _verify(
        self, slots: list[tuple[Prompt, int]], drafts: list[StoredRollout | None], seed_key: tuple
    ) -> tuple[list[Verified | None], int]:
        """Cut index and current logprobs for every slot with a draft; → (per slot, tokens scored).
        `full` scores every draft token in one pass; `chunked` scores verify_chunk_size tokens per
        pass and drops each draft from later passes at its first rejection."""
        todo = [i for i, d in enumerate(drafts) if d is not None and len(d) > 0]
        out: list[Verified | None] = [None] * len(slots)
        targets = {i: drafts[i].token_ids[: self.max_response_length].tolist() for i in todo}
        seeds = {
            i: rollout_seed(*seed_key, slots[i][0].prompt_id, slots[i][1], "verify") for i in todo
        }
        chunk = (
            self.spec.verify_chunk_size
            if self.spec.verify_mode == "chunked"
            else self.max_response_length
        )
        new: dict[int, list[float]] = {i: [] for i in todo}
        active, offset, scored = todo, 0, 0
        while active:
            requests = [
                ScoreRequest(
                    list(slots[i][0].ids) + targets[i][:offset],
                    targets[i][offset : offset + chunk],
                    self.sampling,
                )
                for i in active
            ]
            for i, logprobs in zip(active, self.engine.score(requests), strict=True):
                new[i].extend(logprobs.tolist())
                scored += len(logprobs)
            cuts = self._cuts(
                [new[i] for i in active],
                [drafts[i].logprobs for i in active],
                [seeds[i] for i in active],
            )
            still = []
            for i, k in zip(active, cuts, strict=True):
                if k < len(new[i]) or len(new[i]) == len(targets[i]):
                    out[i] = Verified(k, new[i])
                else:
                    still.append(i)
            active, offset = still, offset + chunk
        return out, scored

    def _cuts(self, new: list[list[float]], old: list, seeds: list[int]) -> list[int]:
        """The acceptance rule over a batch of verified prefixes (ragged → padded [B, T])."""
        lengths = torch.tensor([len(x) for x in new])
        width = int(lengths.max())
        new_t = torch.zeros(len(new), width, dtype=torch.float64)
        old_t = torch.zeros(len(new), width, dtype=torch.float64)
        for row, (x, y) in enumerate(zip(new, old, strict=True)):
            new_t[row, : len(x)] = torch.tensor(x, dtype=torch.float64)
            old_t[row, : len(x)] = torch.from_numpy(y[: len(x)]).double()
        uniforms = seeded_uniform(
            torch.tensor(seeds)[:, None], torch.arange(width)[None, :]
        )  # [B, T]
        accepted = accept_mask(new_t, old_t, uniforms, self.spec.acceptance, self.spec.log_lenience)
        return cut_indices(accepted, lengths).tolist()

    # ---------------------------------------------------------------- token-tree drafts
    def _tree_drafting(
        self,
        slots: list[tuple[Prompt, int]],
        drafts: list[StoredRollout | None],
        verified: list[Verified | None],
        requests: dict[int, GenRequest],
    ) -> tuple[Drafting | None, int]:
        """Start a round for every prompt of the batch (dropping responses outside the window),
        add the drafts reused whole (they are final already), and give the engine a draft source
        over the trees: none when every tree the requests would draft from is empty and stays so
        (prompts rolled out for the first time, without online trees). → (drafting or None,
        nodes freed)."""
        if self.tree is None:
            return None, 0
        freed = sum(self.tree.begin(pid) for pid in dict.fromkeys(p.prompt_id for p, _ in slots))
        self.tree.insert_all(
            (prompt.prompt_id, draft.token_ids[: check.cut].tolist())
            for i, ((prompt, _), draft, check) in enumerate(
                zip(slots, drafts, verified, strict=True)
            )
            if i not in requests
        )
        prompt_ids = [slots[i][0].prompt_id for i in requests]
        if not self.spec.tree.online and all(self.tree.get(p).nodes == 0 for p in prompt_ids):
            return None, freed
        source = TreeDrafts(
            self.tree,
            prompt_ids,
            [r.prefix_ids for r in requests.values()],
            self.spec.tree.online,
        )
        return Drafting(source, self.draft_width), freed

    def _tree_metrics(
        self, metrics: dict[str, float], results: Iterable[GenResult], evicted: int
    ) -> None:
        counts = {
            "spec/tree/forwards": 0,
            "spec/tree/draft_tokens": 0,
            "spec/tree/accepted_tokens": 0,
        }
        for r in results:
            counts["spec/tree/forwards"] += r.forwards
            counts["spec/tree/draft_tokens"] += r.draft_tokens
            counts["spec/tree/accepted_tokens"] += r.accepted_tokens
        counts["spec/tree/evicted_nodes"] = evicted
        for key, value in counts.items():
            _accumulate(metrics, key, value)
        for k, forwards in self.draft_width.reset_choices().items():
            _accumulate(metrics, "spec/tree/width_forwards", forwards)
            _accumulate(metrics, "spec/tree/width_sum", k * forwards)
        # tokens a sequence gains per decode forward: accepted draft tokens + the one sampled
        metrics["spec/tree/mean_accepted_per_forward"] = metrics["spec/decoded_tokens"] / max(
            metrics["spec/tree/forwards"], 1
        )
        metrics["spec/tree/acceptance_rate"] = metrics["spec/tree/accepted_tokens"] / max(
            metrics["spec/tree/draft_tokens"], 1
        )
        metrics["spec/tree/mean_width"] = metrics.get("spec/tree/width_sum", 0.0) / max(
            metrics.get("spec/tree/width_forwards", 0.0), 1
        )
        metrics["spec/tree/acceptance_estimate"] = self.draft_width.acceptance
        metrics["spec/tree/nodes"] = self.tree.nodes
        metrics["spec/tree/prompts"] = len(self.tree)

    # ---------------------------------------------------------------- continue and assemble
    def _continuation(
        self, prompt: Prompt, draft: StoredRollout | None, check: Verified | None, seed: int
    ) -> GenRequest | None:
        """What is left to decode for a slot, or None when its draft is reused whole."""
        if check is None:
            return GenRequest(prompt.ids, self.max_response_length, self.sampling, seed)
        kept = draft.token_ids[: check.cut].tolist()
        whole = check.cut == len(draft)
        if whole and (draft.finish_reason == "stop" or check.cut >= self.max_response_length):
            return None
        reject = None
        if not whole and self.spec.acceptance == "exact" and check.cut < self.max_response_length:
            reject = int(draft.token_ids[check.cut])
        return GenRequest(
            prompt.ids, self.max_response_length - check.cut, self.sampling, seed, kept, reject
        )

    def _assemble(
        self,
        prompt: Prompt,
        slot: int,
        draft: StoredRollout | None,
        check: Verified | None,
        result: GenResult | None,
        version: int,
    ) -> Rollout:
        kept = draft.token_ids[: check.cut].tolist() if check is not None else []
        kept_logprobs = check.logprobs if check is not None else []
        if result is None:  # reused whole
            finish = draft.finish_reason if check.cut == len(draft) else "length"
            return Rollout(prompt, slot, kept, list(kept_logprobs), finish, version)
        return Rollout(
            prompt,
            slot,
            kept + result.token_ids,
            list(kept_logprobs) + result.logprobs,
            result.finish_reason,
            version,
        )

    def _lenient_behaviour(
        self,
        slots: list[tuple[Prompt, int]],
        drafts: list[StoredRollout | None],
        verified: list[Verified | None],
        rollouts: list[Rollout],
        metrics: dict[str, float],
    ) -> None:
        """Set the behaviour logprobs of every drafted rollout (`specrl_behaviour_logprobs`). The
        current logprob of the draft token where a response first leaves its draft is known from
        verification, except past the chunks chunked verification scored: those are scored
        here, in one batch."""
        drafted = [i for i, check in enumerate(verified) if check is not None]
        matched = {i: _common_prefix(rollouts[i].token_ids, drafts[i].token_ids) for i in drafted}
        leaves = [
            i for i in drafted if matched[i] < min(len(rollouts[i].token_ids), len(drafts[i]))
        ]
        mismatch = {
            i: verified[i].scored[matched[i]]
            for i in leaves
            if matched[i] < len(verified[i].scored)
        }
        unscored = [i for i in leaves if i not in mismatch]
        requests = [
            ScoreRequest(
                [*slots[i][0].ids, *rollouts[i].token_ids[: matched[i]]],
                [int(drafts[i].token_ids[matched[i]])],
                self.sampling,
            )
            for i in unscored
        ]
        extra = self.engine.score(requests) if requests else []
        mismatch.update({i: float(lp[0]) for i, lp in zip(unscored, extra, strict=True)})
        # α of the draft tokens each response follows, then of the one where it leaves its draft,
        # for all rollouts at once (flat)
        new = [
            [*rollouts[i].logprobs[: matched[i]], *([mismatch[i]] if i in mismatch else [])]
            for i in drafted
        ]
        old = [drafts[i].logprobs[: len(x)] for i, x in zip(drafted, new, strict=True)]
        log_alpha = log_acceptance(
            torch.tensor([p for x in new for p in x], dtype=torch.float64),
            torch.from_numpy(np.concatenate(old or [np.zeros(0)])).double(),
            "specrl",
            self.spec.log_lenience,
        ).tolist()
        gap, tokens, start = 0.0, 0, 0
        for i, x in zip(drafted, new, strict=True):
            r = rollouts[i]
            r.behaviour_logprobs = specrl_behaviour_logprobs(
                r.logprobs, matched[i], log_alpha[start : start + len(x)]
            )
            start += len(x)
            gap += sum(abs(q - p) for q, p in zip(r.behaviour_logprobs, r.logprobs, strict=True))
            tokens += len(r.logprobs)
        _accumulate(metrics, "spec/behaviour_gap_sum", gap)
        _accumulate(metrics, "spec/behaviour_gap_tokens", tokens)
        metrics["spec/behaviour_logprob_gap"] = metrics["spec/behaviour_gap_sum"] / max(
            metrics["spec/behaviour_gap_tokens"], 1
        )

    def _metrics(
        self,
        metrics: dict[str, float],
        rollouts: list[Rollout],
        verified: list[Verified | None],
        results: dict[int, GenResult],
        verified_tokens: int,
    ) -> None:
        """Counts add up over every rollout batch of a step (DAPO dynamic sampling may roll out
        several); the ratios are derived from the step's running counts."""
        cuts = [v.cut for v in verified if v is not None]
        counts = {
            "spec/reused_tokens": sum(cuts),
            "spec/decoded_tokens": sum(len(r.token_ids) for r in results.values()),
            "spec/verified_tokens": verified_tokens,
            "spec/response_tokens": sum(len(r.token_ids) for r in rollouts),
            "spec/rollouts": len(rollouts),
            "spec/drafts": len(cuts),
            "spec/fully_reused": len(rollouts) - len(results),
        }
        for key, value in counts.items():
            _accumulate(metrics, key, value)
        metrics["spec/reused_token_ratio"] = metrics["spec/reused_tokens"] / max(
            metrics["spec/response_tokens"], 1
        )
        metrics["spec/full_reuse_ratio"] = metrics["spec/fully_reused"] / metrics["spec/rollouts"]
        metrics["spec/draft_ratio"] = metrics["spec/drafts"] / metrics["spec/rollouts"]
        metrics["spec/mean_cut_index"] = metrics["spec/reused_tokens"] / max(
            metrics["spec/drafts"], 1
        )
        metrics["spec/store_entries"] = len(self.store)
        metrics["spec/store_bytes_per_token"] = self.store.nbytes / max(self.store.num_tokens, 1)


def _common_prefix(tokens: Sequence[int], draft: np.ndarray) -> int:
    """How many leading tokens of a response equal its draft's (a numpy array)."""
    n = min(len(tokens), len(draft))
    differ = (np.asarray(tokens[:n]) != draft[:n]).nonzero()[0]
    return int(differ[0]) if len(differ) else n


def _accumulate(metrics: dict[str, float], key: str, value: float) -> None:
    metrics[key] = metrics.get(key, 0.0) + value
