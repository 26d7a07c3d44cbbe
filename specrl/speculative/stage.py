"""The speculative rollout stage: prompts → n rollouts per prompt (slots), grouped by prompt.

`SpeculativeStage` owns everything speculative: the `RolloutStore` of drafts, the token trees
and the draft-width statistics. Every call runs reuse → continue → assemble → store
(docs/design.md), the reuse by one strategy of speculative/reuse/ chosen at construction (history
tries walked, per-slot drafts verified and cut, or nothing); with speculation off, or for a prompt
seen for the first time, it is plain sampling through the same code path. It returns ordinary
rollouts and a `RolloutStats` of counts. A call takes prompts and a number of slots (`__call__`), or single slots with their own
token budgets and with or without their stored drafts (`rollout`: the turns of episodes). Its
state is saved whole (`state_dict`) or per prompt (`export` / `import_`: a prompt's
drafts and tree, what moves with a prompt between workers that own shards of prompts).
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Iterable, Sequence
from typing import Any

from specrl.config import SpecConfig
from specrl.engines import (
    GenRequest,
    GenResult,
    LogprobRequest,
    Prefixes,
    RolloutEngine,
    SamplingParams,
)
from specrl.errors import UserError
from specrl.rollouts import SlotRequest, rollout_seed, sample_rollouts
from specrl.speculative.acceptance import acceptance_rule
from specrl.speculative.draft_width import DraftWidth
from specrl.speculative.drafting import Drafting, DraftSource, TimedDecoding, TreeDrafts
from specrl.speculative.lookup import FirstProposal, PromptLookup
from specrl.speculative.prompt_state import PromptState
from specrl.speculative.reuse import reuse_strategy
from specrl.speculative.slots import Slot
from specrl.speculative.stats import RolloutStats
from specrl.speculative.store import RolloutStore
from specrl.speculative.token_trees import TokenTree
from specrl.types import Prompt, Rollout


class SpeculativeStage:
    def __init__(
        self,
        engine: RolloutEngine,
        sampling: SamplingParams,
        max_response_length: int,
        cfg: SpecConfig,
    ) -> None:
        capabilities = engine.capabilities
        specrl_trees = cfg.tree.enabled is True and cfg.tree.method == "specrl"
        if specrl_trees and not capabilities.draft_decoding:
            raise UserError(
                "rollout.spec.tree.enabled=true needs an engine that decodes with drafts (hf, or "
                "a vllm engine built with draft_tokens); use tree.enabled=auto"
            )
        uses_tree = cfg.uses_tree()
        if cfg.tree.method == "suffix" and uses_tree and not capabilities.own_drafts:
            raise UserError(
                "rollout.spec.tree.method=suffix needs an engine that drafts with vLLM's suffix "
                "decoding (a vllm engine built with draft_method=suffix)"
            )
        self.engine = engine
        self.sampling = sampling
        self.max_response_length = max_response_length
        self.cfg = cfg
        self.rule = acceptance_rule(cfg)
        self.tree_drafts = uses_tree and capabilities.draft_decoding and cfg.tree.method == "specrl"
        # a prompt's trie of its last `window` rollouts: what slots walk, and drafts come from
        wants_tree = self.tree_drafts or cfg.walks_tries(capabilities.trie_verification)
        self.prompts = PromptState(
            TokenTree(cfg.tree.window, cfg.tree.max_nodes) if wants_tree else None
        )
        self.draft_width = DraftWidth(
            cfg.tree.max_draft_tokens, cfg.tree.adaptive, capabilities.ragged_drafts
        )
        self.reuse = reuse_strategy(
            cfg, engine, self.rule, self.prompts, sampling, self.draft_width
        )
        # the budgets (tries, drafts verified before decoding) price a reused token by the decode
        # forwards' fitted costs: where no drafts are decoded, the forwards are timed all the
        # same (`TimedDecoding`)
        self.times_decoding = (
            cfg.enabled and cfg.verify_budget and capabilities.draft_decoding
            and not self.tree_drafts and not self.reuse.drafts_in_decoding
        )  # fmt: skip
        # the engine's results count drafts: specrl's (trees, stored drafts) or the engine's own
        self.counts_drafts = (
            self.tree_drafts or self.reuse.drafts_in_decoding or capabilities.own_drafts
        )

    @property
    def store(self) -> RolloutStore:
        """Every prompt's drafts."""
        return self.prompts.store

    @property
    def tree(self) -> TokenTree | None:
        """Every prompt's token tree (None without trees)."""
        return self.prompts.tree

    @property
    def lenient(self) -> bool:
        """Whether the lenient rule decides tokens (its rollouts carry behaviour logprobs)."""
        return self.cfg.enabled and not self.rule.exact

    def __call__(
        self, prompts: Sequence[Prompt], n: int, seed_key: tuple, policy_version: int
    ) -> tuple[list[Rollout], RolloutStats]:
        """n rollouts per prompt (prompt-major), of up to max_response_length tokens."""
        R = self.max_response_length
        requests = [SlotRequest(p, s, R) for p in prompts for s in range(n)]
        return self.rollout(requests, seed_key, policy_version)

    def rollout(
        self, requests: Sequence[SlotRequest], seed_key: tuple, policy_version: int
    ) -> tuple[list[Rollout], RolloutStats]:
        """One rollout per request, in order."""
        start = time.perf_counter()
        computed = copy.copy(self.engine.counts)
        stats = RolloutStats(
            speculative=self.cfg.enabled,
            decode_drafts=self.counts_drafts,
            lenient=self.lenient,
        )
        slots = [
            Slot(q.prompt, q.slot, rollout_seed(*seed_key, q.prompt.prompt_id, q.slot),
                 q.max_tokens, q.may_reuse)
            for q in requests
        ]  # fmt: skip
        prefixes = self.engine.new_prefixes() if self.engine.capabilities.prefix_reuse else None
        prompt_ids = list(dict.fromkeys(s.prompt.prompt_id for s in slots))
        if self.tree is not None:
            for pid in prompt_ids:
                stats.tree_evicted_nodes += self.tree.begin(pid)
        self.reuse.before_decoding(slots, seed_key, prefixes, stats)
        requests = {i: r for i, s in enumerate(slots) if (r := self._continuation(s)) is not None}
        gen_start = time.perf_counter()
        generated = self._generate(requests, self._drafting(slots, requests), prefixes, stats)
        results = dict(zip(requests, generated, strict=True))
        stats.gen_s += time.perf_counter() - gen_start
        self.reuse.after_decoding(slots, results, stats)
        if self.tree is not None:
            # decoded responses join their trees now (online: as they finished), and what the
            # prompts' next rollouts would drop from the trees goes now, in the same rebuild
            decoded = () if self.cfg.tree.online else (
                (slots[i].prompt.prompt_id, [*slots[i].kept, *r.token_ids], slots[i].drawn(r))
                for i, r in results.items()
            )  # fmt: skip
            stats.tree_evicted_nodes += self.tree.close_round(prompt_ids, decoded)
            stats.tree_evicted_nodes += self.tree.evict()
        rollouts = [_assemble(s, results.get(i), policy_version) for i, s in enumerate(slots)]
        if self.lenient:
            behaviour_start = time.perf_counter()
            logprob_of = functools.partial(self._logprobs_where_left, stats)
            rollouts = self.rule.behaviour(slots, rollouts, logprob_of, stats)
            stats.verify_s += time.perf_counter() - behaviour_start
        self.reuse.keep(rollouts)
        stats.rollout_s += time.perf_counter() - start
        stats.compute = self.engine.counts - computed
        self._count(stats, slots, rollouts, results, policy_version)
        return rollouts, stats

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {**self.prompts.state_dict(), "draft_width": self.draft_width.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state)
        self.draft_width.load_state_dict(state["draft_width"])

    def export(self, prompt_ids: Iterable[str]) -> dict[str, Any]:
        """The per-prompt state of these prompts: their drafts (every slot) and token trees."""
        return self.prompts.export(prompt_ids)

    def import_(self, state: dict[str, Any]) -> None:
        """Take over prompts `export` gave (replacing what this stage held for them)."""
        self.prompts.import_(state)

    def seed_trees(self, prompts: Sequence[Prompt], seed_key: tuple, policy_version: int) -> None:
        """Run-ahead (SRT): one response per prompt, sampled now, added to the prompts' token
        trees ahead of their rollouts, where it can only propose drafts (tree drafts are
        verified with the exact rule; it never becomes a stored draft)."""
        rollouts = sample_rollouts(
            self.engine, prompts, 1, self.sampling, self.max_response_length, seed_key,
            policy_version,
        )  # fmt: skip
        self.tree.insert_all((r.prompt.prompt_id, r.token_ids) for r in rollouts)

    def drop(self, prompt_ids: Iterable[str]) -> None:
        """Forget these prompts' drafts and trees (they moved to another stage)."""
        self.prompts.drop(prompt_ids)

    # ---------------------------------------------------------------- decoding
    def _continuation(self, s: Slot) -> GenRequest | None:
        """What is left to decode for a slot after what it reused, or None when that is all."""
        if s.reused is None:
            return GenRequest(s.prompt.ids, s.budget, self.sampling, s.seed)
        if s.reused.finish_reason is not None:
            return None
        kept = s.reused.tokens
        return GenRequest(
            s.prompt.ids, s.budget - len(kept), self.sampling, s.seed, kept, s.reused.excluded
        )

    def _generate(
        self,
        requests: dict[int, GenRequest],
        drafting: Drafting | TimedDecoding | None,
        prefixes: Prefixes | None,
        stats: RolloutStats,
    ) -> list[GenResult]:
        if drafting is None:
            return stats.timed(self.engine.generate, list(requests.values()), prefixes)
        return stats.timed(
            self.engine.generate_with_drafts, list(requests.values()), drafting, prefixes
        )

    def _drafting(
        self, slots: list[Slot], requests: dict[int, GenRequest]
    ) -> Drafting | TimedDecoding | None:
        """The engine's drafter for this call: the reuse strategy's drafts (stored drafts
        verified in decoding) before the token trees' for what is decoded; when nothing proposes,
        one that times the forwards for the budgets (`times_decoding`), or None."""
        source = self.reuse.drafter(slots, requests, self._decode_drafts(slots, requests))
        if source is not None:
            return Drafting(source, self.draft_width)
        return TimedDecoding(self.draft_width) if self.times_decoding else None

    def _decode_drafts(
        self, slots: list[Slot], requests: dict[int, GenRequest]
    ) -> DraftSource | None:
        """Add the responses reused whole to their trees (they are final already), and draft
        from the trees, then by prompt lookup (`tree.prompt_lookup`): no tree drafts when every
        tree the requests would draft from is empty and stays so (prompts rolled out for the
        first time, without online trees)."""
        if self.tree is None:
            return None
        self.tree.insert_all(
            (s.prompt.prompt_id, s.kept, s.drawn(None))
            for i, s in enumerate(slots)
            if i not in requests
        )
        if not self.tree_drafts:
            return None
        prompt_ids = [slots[i].prompt.prompt_id for i in requests]
        sources: list[DraftSource] = []
        if self.cfg.tree.online or any(self.tree.get(p).nodes for p in prompt_ids):
            prefixes = [r.prefix_ids for r in requests.values()]
            sources.append(TreeDrafts(self.tree, prompt_ids, prefixes, self.cfg.tree.online))
        if self.cfg.tree.prompt_lookup:
            contexts = [[*r.prompt_ids, *r.prefix_ids] for r in requests.values()]
            sources.append(PromptLookup(contexts, self.cfg.tree.prompt_lookup))
        return FirstProposal(*sources) if len(sources) > 1 else next(iter(sources), None)

    def _logprobs_where_left(
        self, stats: RolloutStats, pairs: list[tuple[list[int], int]]
    ) -> list[float]:
        """The current logprob of each (context, token): where lenient responses left their
        drafts past what verification computed."""
        if not pairs:
            return []
        requests = [LogprobRequest(context, [token], self.sampling) for context, token in pairs]
        return [float(lp[0]) for lp in stats.timed(self.engine.logprobs, requests)]

    def _count(
        self,
        stats: RolloutStats,
        slots: list[Slot],
        rollouts: list[Rollout],
        results: dict[int, GenResult],
        version: int,
    ) -> None:
        in_decoding = self.reuse.drafts_in_decoding
        stats.count(slots, rollouts, results, version, self.counts_drafts, in_decoding)
        stats.store_entries = len(self.store)
        stats.store_tokens = self.store.num_tokens
        stats.store_bytes = self.store.nbytes
        if self.tree_drafts or in_decoding:  # specrl's drafts: its width controller
            for k, forwards in self.draft_width.reset_choices().items():
                stats.width_forwards += forwards
                stats.width_sum += k * forwards
            stats.accept_rate_estimate = self.draft_width.accept_rate
            stats.draft_forward_share = self.draft_width.forward_share
        if self.tree is not None:
            stats.tree_nodes = self.tree.nodes
            stats.tree_prompts = len(self.tree)


def _assemble(s: Slot, result: GenResult | None, version: int) -> Rollout:
    """A slot's rollout: what it reused, then what was decoded for it (None: nothing was)."""
    if result is None:
        return Rollout(
            s.prompt, s.slot, s.kept, list(s.kept_logprobs), s.reused.finish_reason, version
        )
    return Rollout(
        s.prompt,
        s.slot,
        s.kept + result.token_ids,
        list(s.kept_logprobs) + result.logprobs,
        result.finish_reason,
        version,
    )
