"""What a rollout stage did, as counts; every `spec/*` ratio is derived from them in one place.

The stage returns one `RolloutStats` per call. Counts add up (over the rollout batches of a step
under DAPO dynamic sampling, over the steps of a run in `specrl bench`); gauges (sizes of the
store and the trees) keep the latest value. `metrics()` gives the logged names: the counts
themselves, so that any span of a run's metrics can be summed back into a `RolloutStats`
(`from_metrics`), and the ratios of `ratios()`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np

from specrl.engines.accounting import ForwardCounts

if TYPE_CHECKING:
    from specrl.engines import GenResult
    from specrl.speculative.slots import Slot
    from specrl.types import Rollout

GAUGE = {"gauge": True}


@dataclass
class RolloutStats:
    rollouts: int = 0
    drafts: int = 0  # rollouts that had a draft to verify
    fully_reused: int = 0  # rollouts reused whole: nothing decoded
    reused_tokens: int = 0  # draft tokens kept (the cut index k, summed)
    decoded_tokens: int = 0  # tokens decoded by the engine
    verified_tokens: int = 0  # draft tokens (or trie nodes) verification computed
    draft_age_sum: int = 0  # Σ over drafts of the updates since the draft was rolled out
    logprob_drift_sum: float = 0.0  # Σ over verified tokens of |log p_new − log p_old|
    response_tokens: int = 0
    behaviour_gap_sum: float = 0.0  # Σ |log q − log p| over the tokens of drafted rollouts
    behaviour_gap_tokens: int = 0  # (lenient specrl rule only)
    draft_forwards: int = 0  # decode forwards with drafts, summed over sequences
    draft_output_tokens: int = 0  # tokens those forwards produced
    drafted_tokens: int = 0  # draft tokens those forwards verified (trees, stored or vLLM's)
    accepted_draft_tokens: int = 0  # of which accepted
    width_forwards: int = 0  # forwards for which the draft width K was chosen
    width_sum: int = 0  # Σ K over them
    tree_evicted_nodes: int = 0
    trie_nodes: int = 0  # history-trie nodes verified (reuse=trie)
    trie_prompts: int = 0  # tries verified: prompts (or turn contexts) with a history
    trie_prompts_skipped: int = 0  # prompts with a history where no node paid its verification
    trie_passes_skipped: int = 0  # steps whose selected nodes did not pay the forward a pass adds
    trie_nodes_stored: int = 0  # nodes of the tries of prompts with walkers (verified or not)
    trie_expected_tokens: float = 0.0  # reused tokens the budget expected of the nodes verified
    trie_reachable_tokens: int = 0  # tokens a walk of the whole tries would have reused
    drafts_skipped: int = 0  # stored drafts not verified at all: no token of them paid (slot)
    slowest_forwards: int = 0  # Σ over calls of the most decode forwards one slot took
    verify_s: float = 0.0
    gen_s: float = 0.0
    rollout_s: float = 0.0
    engine_s: float = 0.0  # of rollout_s, inside the engine's calls
    migrated_prompts: int = 0  # rollout workers: prompts (with their state) moved to another
    worker_restarts: int = 0
    worker_busy_max_s: float = 0.0  # Σ over calls of the busiest worker's rollout seconds
    worker_busy_mean_s: float = 0.0  # Σ over calls of the mean worker's
    workers: int = field(default=0, metadata=GAUGE)  # live rollout workers (0: in-process)
    store_entries: int = field(default=0, metadata=GAUGE)
    store_tokens: int = field(default=0, metadata=GAUGE)
    store_bytes: int = field(default=0, metadata=GAUGE)
    speculative: bool = field(default=False, metadata=GAUGE)  # drafts reused (rollout.spec)
    # the engine decoded with drafts: token trees, or stored drafts verified in decoding
    decode_drafts: bool = field(default=False, metadata=GAUGE)
    lenient: bool = field(default=False, metadata=GAUGE)  # the lenient rule decided tokens
    tree_nodes: int = field(default=0, metadata=GAUGE)
    tree_prompts: int = field(default=0, metadata=GAUGE)
    accept_rate_estimate: float = field(default=0.0, metadata=GAUGE)
    # γ: the forwards accepted decode drafts removed per forward tokens per second assumed
    draft_forward_share: float = field(default=0.0, metadata=GAUGE)
    # the trie budget's fitted seconds per verified position, per decoded token (decoding's
    # average), per row of a decode forward, per forward besides its rows (c0) and per prompt
    # position of a pass beyond decoding's prefill, and its drift ρ
    trie_node_cost_s: float = field(default=0.0, metadata=GAUGE)
    trie_token_cost_s: float = field(default=0.0, metadata=GAUGE)
    trie_row_cost_s: float = field(default=0.0, metadata=GAUGE)
    trie_forward_cost_s: float = field(default=0.0, metadata=GAUGE)
    trie_prompt_cost_s: float = field(default=0.0, metadata=GAUGE)
    trie_drift: float = field(default=0.0, metadata=GAUGE)
    # σ: how far the ends of a drawn interval moved between its draw and the current policy
    trie_shift: float = field(default=0.0, metadata=GAUGE)
    # δ: how much the drawn intervals widened since, the policy sharpened on its own samples
    trie_sharpening: float = field(default=0.0, metadata=GAUGE)
    # the share of the decode loop's forwards reuse removes per share of the tokens it reuses
    trie_loop_factor: float = field(default=0.0, metadata=GAUGE)
    # per-slot drafts: the most draft tokens the budget verified (-1: all), the accept rate α
    draft_verify_limit: int = field(default=-1, metadata=GAUGE)
    draft_accept_rate: float = field(default=0.0, metadata=GAUGE)
    compute: ForwardCounts = field(default_factory=ForwardCounts)  # the engine's forwards

    def __add__(self, other: RolloutStats) -> RolloutStats:
        return RolloutStats(
            **{
                f.name: getattr(other, f.name)
                if f.metadata.get("gauge")
                else getattr(self, f.name) + getattr(other, f.name)
                for f in fields(self)
            }
        )

    def timed(self, call, *args):
        """`call(*args)`, its seconds counted as the engine's (`timing_s/engine`: the rest of the
        stage's time is host work, the walk, cuts and bookkeeping, that no forward pays)."""
        started = time.perf_counter()
        out = call(*args)
        self.engine_s += time.perf_counter() - started
        return out

    @classmethod
    def total(cls, stats: Iterable[RolloutStats]) -> RolloutStats:
        return sum(stats, cls())

    @classmethod
    def of_workers(cls, stats: Sequence[RolloutStats], wall_s: float) -> RolloutStats:
        """One call over several workers, each holding a shard: counts and the sizes of the
        shards add up; the timings and the slowest slot's forwards are the slowest worker's (they
        ran side by side), the rollout time the caller's `wall_s`; the draft-width estimates (α,
        γ) are the workers' means."""
        out = cls.total(stats)
        for name in GAUGE_SUMS:
            setattr(out, name, sum(getattr(s, name) for s in stats))
        for flag in ("speculative", "decode_drafts", "lenient"):
            setattr(out, flag, any(getattr(s, flag) for s in stats))
        out.verify_s = max((s.verify_s for s in stats), default=0.0)
        out.slowest_forwards = max((s.slowest_forwards for s in stats), default=0)
        out.gen_s = max((s.gen_s for s in stats), default=0.0)
        out.engine_s = max((s.engine_s for s in stats), default=0.0)
        out.rollout_s = wall_s
        out.compute = functools.reduce(
            ForwardCounts.side_by_side, (s.compute for s in stats), ForwardCounts()
        )
        for estimate in ("accept_rate_estimate", "draft_forward_share"):
            values = [getattr(s, estimate) for s in stats]
            setattr(out, estimate, float(np.mean(values)) if values else 0.0)
        return out

    @classmethod
    def of_steps(cls, history: Iterable[Mapping[str, float]]) -> RolloutStats:
        """The counts of a run's training steps (its logged metrics; evaluations skipped)."""
        return cls.total(cls.from_metrics(m) for m in history if m["training/global_step"] > 0)

    def count(
        self,
        slots: Sequence[Slot],
        rollouts: Sequence[Rollout],
        results: Mapping[int, GenResult],
        version: int,
        counts_drafts: bool,
        in_decoding: bool,
    ) -> None:
        """Add one stage call: its slots (what each kept of its draft or its trie), its
        rollouts, and the engine's results for the slots it decoded (by slot index). With
        `counts_drafts` the results count the drafts decoding verified; `in_decoding`: stored
        drafts were among them, their kept tokens decoded too."""
        self.rollouts += len(rollouts)
        reusing = [s for s in slots if s.reused is not None]
        self.drafts += len(reusing)
        self.draft_age_sum += sum(
            version - s.draft.policy_version for s in reusing if s.draft is not None
        )
        # reused whole: not decoded, or (verified in decoding) nothing decoded past the draft
        self.fully_reused += len(rollouts) - sum(bool(r.token_ids) for r in results.values())
        self.reused_tokens += sum(len(s.reused.tokens) for s in reusing)
        self.decoded_tokens += sum(len(r.token_ids) for r in results.values())
        self.slowest_forwards += max((r.forwards for r in results.values()), default=0)
        self.response_tokens += sum(len(r.token_ids) for r in rollouts)
        if counts_drafts:
            for i, r in results.items():
                self.draft_forwards += r.forwards
                self.draft_output_tokens += len(r.token_ids)
                self.drafted_tokens += r.draft_tokens
                self.accepted_draft_tokens += r.accepted_tokens
                if in_decoding and slots[i].reused is not None:
                    self.draft_output_tokens += len(slots[i].reused.tokens)  # decoded, then kept

    def ratios(self) -> dict[str, float]:
        """The derived quantities, with the names they are logged under."""
        out = {
            "spec/reused_token_ratio": self.reused_tokens / max(self.response_tokens, 1),
            "spec/full_reuse_ratio": self.fully_reused / max(self.rollouts, 1),
            "spec/draft_ratio": self.drafts / max(self.rollouts, 1),
            "spec/mean_cut_index": self.reused_tokens / max(self.drafts, 1),
            "spec/verified_token_ratio": self.verified_tokens / max(self.response_tokens, 1),
            # policy drift: why reuse is what it is
            "spec/draft_age_steps": self.draft_age_sum / max(self.drafts, 1),
            "spec/draft_logprob_drift": self.logprob_drift_sum / max(self.verified_tokens, 1),
            "spec/store_bytes_per_token": self.store_bytes / max(self.store_tokens, 1),
        }
        if self.lenient:
            out["spec/behaviour_logprob_gap"] = self.behaviour_gap_sum / max(
                self.behaviour_gap_tokens, 1
            )
        if self.decode_drafts:
            # tokens a sequence gains per decode forward: accepted draft tokens + the one sampled
            out["spec/decode_drafts/tokens_per_forward"] = self.draft_output_tokens / max(
                self.draft_forwards, 1
            )
            out["spec/decode_drafts/accept_rate"] = self.accepted_draft_tokens / max(
                self.drafted_tokens, 1
            )
            out["spec/decode_drafts/mean_width"] = self.width_sum / max(self.width_forwards, 1)
        if self.workers:
            out["perf/rollout_imbalance"] = self.worker_busy_max_s / max(
                self.worker_busy_mean_s, 1e-9
            )
        return out

    def metrics(self) -> dict[str, float]:
        """Counts, gauges and ratios under their logged names; the ratios of draft reuse only in
        speculative runs, decode-draft, tree and lenient-rule names only where those are in use."""
        out = {
            key: float(getattr(self, name))
            for name, key in METRIC_NAMES.items()
            if self._applies(name)
        }
        ratios = self.ratios()
        if not self.speculative:
            ratios = {k: v for k, v in ratios.items() if k not in REUSE_RATIOS}
        return {**out, **self.compute.metrics(), **ratios}

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float]) -> RolloutStats:
        """The counts and gauges back from one step's logged metrics."""
        values = {name: metrics[key] for name, key in METRIC_NAMES.items() if key in metrics}
        values["speculative"] = "spec/reused_token_ratio" in metrics
        values["decode_drafts"] = "spec/decode_drafts/forwards" in metrics
        values["lenient"] = "spec/behaviour_gap_sum" in metrics
        return cls(**values, compute=ForwardCounts.from_metrics(metrics))

    def _applies(self, name: str) -> bool:
        if name.startswith("tree_") or name in DECODE_DRAFT_COUNTS:
            return self.decode_drafts
        if name.startswith("trie_") or name in SLOT_BUDGET:
            return self.speculative
        if name in WORKER_COUNTS:
            return self.workers > 0
        return self.lenient or not name.startswith("behaviour_")


SLOT_BUDGET = ("drafts_skipped", "draft_verify_limit", "draft_accept_rate")
DECODE_DRAFT_COUNTS = (
    "draft_forwards",
    "draft_output_tokens",
    "drafted_tokens",
    "accepted_draft_tokens",
    "width_forwards",
    "width_sum",
    "accept_rate_estimate",
    "draft_forward_share",
)

GAUGE_SUMS = ("store_entries", "store_tokens", "store_bytes", "tree_nodes", "tree_prompts")

REUSE_RATIOS = (
    "spec/reused_token_ratio",
    "spec/full_reuse_ratio",
    "spec/draft_ratio",
    "spec/mean_cut_index",
    "spec/verified_token_ratio",
    "spec/draft_age_steps",
    "spec/draft_logprob_drift",
)

WORKER_COUNTS = (
    "migrated_prompts",
    "worker_restarts",
    "worker_busy_max_s",
    "worker_busy_mean_s",
    "workers",
)

METRIC_NAMES = {
    "rollouts": "spec/rollouts",
    "drafts": "spec/drafts",
    "fully_reused": "spec/fully_reused",
    "reused_tokens": "spec/reused_tokens",
    "decoded_tokens": "spec/decoded_tokens",
    "verified_tokens": "spec/verified_tokens",
    "draft_age_sum": "spec/draft_age_sum",
    "logprob_drift_sum": "spec/logprob_drift_sum",
    "response_tokens": "spec/response_tokens",
    "behaviour_gap_sum": "spec/behaviour_gap_sum",
    "behaviour_gap_tokens": "spec/behaviour_gap_tokens",
    "draft_forwards": "spec/decode_drafts/forwards",
    "draft_output_tokens": "spec/decode_drafts/output_tokens",
    "drafted_tokens": "spec/decode_drafts/drafted_tokens",
    "accepted_draft_tokens": "spec/decode_drafts/accepted_tokens",
    "width_forwards": "spec/decode_drafts/width_forwards",
    "width_sum": "spec/decode_drafts/width_sum",
    "tree_evicted_nodes": "spec/tree/evicted_nodes",
    "trie_nodes": "spec/trie/nodes",
    "trie_prompts": "spec/trie/prompts",
    "trie_prompts_skipped": "spec/trie/prompts_skipped",
    "trie_passes_skipped": "spec/trie/passes_skipped",
    "trie_nodes_stored": "spec/trie/nodes_stored",
    "trie_expected_tokens": "spec/trie/expected_tokens",
    "trie_reachable_tokens": "spec/trie/reachable_tokens",
    "trie_node_cost_s": "timing_s/trie_node_cost",
    "trie_token_cost_s": "timing_s/trie_token_cost",
    "trie_row_cost_s": "timing_s/trie_row_cost",
    "trie_forward_cost_s": "timing_s/trie_forward_cost",
    "trie_prompt_cost_s": "timing_s/trie_prompt_cost",
    "trie_drift": "spec/trie/drift",
    "trie_shift": "spec/trie/shift",
    "trie_sharpening": "spec/trie/sharpening",
    "trie_loop_factor": "spec/trie/loop_factor",
    "drafts_skipped": "spec/slot/drafts_skipped",
    "draft_verify_limit": "spec/slot/verify_limit",
    "draft_accept_rate": "spec/slot/accept_rate",
    "slowest_forwards": "perf/slowest_slot_forwards",
    "verify_s": "timing_s/verify",
    "gen_s": "timing_s/gen",
    "rollout_s": "timing_s/rollout",
    "engine_s": "timing_s/engine",
    "migrated_prompts": "rollout/migrated_prompts",
    "worker_restarts": "rollout/worker_restarts",
    "worker_busy_max_s": "rollout/worker_busy_max_s",
    "worker_busy_mean_s": "rollout/worker_busy_mean_s",
    "workers": "rollout/num_workers",
    "store_entries": "spec/store_entries",
    "store_tokens": "spec/store_tokens",
    "store_bytes": "spec/store_bytes",
    "tree_nodes": "spec/tree/nodes",
    "tree_prompts": "spec/tree/prompts",
    "accept_rate_estimate": "spec/decode_drafts/accept_rate_estimate",
    "draft_forward_share": "spec/decode_drafts/forward_share",
}
