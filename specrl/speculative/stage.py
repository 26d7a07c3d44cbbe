"""The speculative rollout stage: prompts → n rollouts per prompt (slots), grouped by prompt.

`SpeculativeStage` owns everything speculative: the `RolloutStore` of drafts, the token trees
and the draft-width statistics. Every call runs drafts → verify → cut → continue → assemble →
store (docs/design.md); with speculation off, or for a prompt seen for the first time, it is plain
sampling through the same code path. With `reuse=trie` (the exact rule's default) "drafts →
verify → cut" is: score each prompt's history trie (its token tree) in one pass, and walk every
slot down it with the uniforms vanilla decoding would use (`walk_trie`); the slot continues
from the node where it leaves the trie. It returns ordinary rollouts and a `RolloutStats` of
counts. A call takes prompts and a number of slots (`__call__`), or single slots with their own
token budgets and with or without their stored drafts (`rollout`: the turns of episodes). Its
state is saved whole (`state_dict`) or per prompt (`export` / `import_`: a prompt's
drafts and tree, what moves with a prompt between workers that own shards of prompts).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from specrl.config import SpecConfig
from specrl.engines import (
    GenRequest,
    GenResult,
    LogprobRequest,
    Prefixes,
    RolloutEngine,
    SamplingParams,
    TrieRequest,
)
from specrl.engines.sampling import seeded_uniform
from specrl.errors import UserError
from specrl.rollouts import SlotRequest, rollout_seed, sample_rollouts
from specrl.speculative.acceptance import acceptance_rule
from specrl.speculative.drafting import Drafting, DraftWidth, StoredDrafts, TreeDrafts
from specrl.speculative.prompt_state import PromptState
from specrl.speculative.slots import Slot, Verified, common_prefix, walk_trie
from specrl.speculative.stats import RolloutStats
from specrl.speculative.store import RolloutStore, StoredRollout
from specrl.speculative.tree import TokenTree
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
        self.rule = acceptance_rule(cfg)
        if cfg.enabled and self.rule.exact and not capabilities.residual_sampling:
            raise UserError(
                "rollout.spec.acceptance=exact needs an engine that samples from residuals; "
                "use rollout.spec.acceptance=specrl on this engine"
            )
        self.in_decoding = cfg.enabled and cfg.verify_mode == "decoding"
        specrl_trees = cfg.tree.enabled is True and cfg.tree.method == "specrl"
        if (specrl_trees or self.in_decoding) and not capabilities.draft_decoding:
            wanted = "verify_mode=decoding" if self.in_decoding else "tree.enabled=true"
            raise UserError(
                f"rollout.spec.{wanted} needs an engine that decodes with drafts (hf, or a vllm "
                "engine built with draft_tokens); use tree.enabled=auto and verify_mode=full"
            )
        self.engine = engine
        self.sampling = sampling
        self.max_response_length = max_response_length
        self.cfg = cfg
        if cfg.tree.method == "suffix" and cfg.uses_tree() and not capabilities.own_drafts:
            raise UserError(
                "rollout.spec.tree.method=suffix needs an engine that drafts with vLLM's suffix "
                "decoding (a vllm engine built with draft_method=suffix)"
            )
        self.walks = cfg.walks_tries(capabilities.trie_scoring)
        if self.walks and not capabilities.trie_scoring:
            raise UserError(
                "rollout.spec.reuse=trie needs an engine that scores tries (hf, vllm); "
                "use rollout.spec.reuse=slot on this engine"
            )
        self.tree_drafts = (
            cfg.uses_tree() and capabilities.draft_decoding and cfg.tree.method == "specrl"
        )
        # a prompt's trie of its last `window` rollouts: what slots walk, and drafts come from
        wants_tree = self.tree_drafts or self.walks
        self.prompts = PromptState(
            TokenTree(cfg.tree.window, cfg.tree.max_nodes) if wants_tree else None
        )
        # the engine's results count drafts: specrl's (trees, stored drafts) or the engine's own
        self.counts_drafts = self.tree_drafts or self.in_decoding or capabilities.own_drafts
        self.draft_width = DraftWidth(
            cfg.tree.max_draft_tokens, cfg.tree.adaptive, capabilities.ragged_drafts
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
            Slot(
                q.prompt,
                q.slot,
                rollout_seed(*seed_key, q.prompt.prompt_id, q.slot),
                q.max_tokens,
                q.use_draft,
                self._draft(q.prompt, q.slot) if q.use_draft and not self.walks else None,
            )
            for q in requests
        ]
        prefixes = self.engine.new_prefixes() if self.engine.capabilities.prefix_reuse else None
        if self.tree is not None:
            for pid in dict.fromkeys(s.prompt.prompt_id for s in slots):
                stats.tree_evicted_nodes += self.tree.begin(pid)
        if self.walks:
            self._walk(slots, prefixes, stats)
        elif not self.in_decoding:
            self._verify(slots, seed_key, prefixes, stats)
        requests = {i: r for i, s in enumerate(slots) if (r := self._continuation(s)) is not None}
        drafting = self._drafting(slots, requests, stats)
        gen_start = time.perf_counter()
        generated = self._generate(requests, drafting, prefixes, stats)
        results = dict(zip(requests, generated, strict=True))
        stats.gen_s += time.perf_counter() - gen_start
        if self.in_decoding:
            self._cut_in_decoding(slots, results)
        if self.tree is not None:
            if not self.cfg.tree.online:
                self.tree.insert_all(
                    (slots[i].prompt.prompt_id, [*slots[i].kept, *r.token_ids])
                    for i, r in results.items()
                )
            stats.tree_evicted_nodes += self.tree.evict()
        rollouts = [self._assemble(s, results.get(i), policy_version) for i, s in enumerate(slots)]
        if self.lenient:
            behaviour_start = time.perf_counter()
            logprob_of = functools.partial(self._logprobs_where_left, stats)
            rollouts = self.rule.behaviour(slots, rollouts, logprob_of, stats)
            stats.verify_s += time.perf_counter() - behaviour_start
        if self.cfg.enabled and not self.walks:
            for r in rollouts:
                self.store.put(r)
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

    # ---------------------------------------------------------------- drafts and verification
    def _draft(self, prompt: Prompt, slot: int) -> StoredRollout | None:
        if not self.cfg.enabled:
            return None
        draft = self.store.get(prompt.prompt_id, slot)
        return draft if draft is not None and len(draft) > 0 else None

    def _verify(
        self, slots: list[Slot], seed_key: tuple, prefixes: Prefixes | None, stats: RolloutStats
    ) -> None:
        """Set the cut index and current logprobs of every slot with a draft. `full` scores every
        draft token in one pass; `chunked` scores verify_chunk_size tokens per pass and drops each
        draft from later passes at its first rejection."""
        started = time.perf_counter()
        active = [
            (i, s.draft.token_ids[: s.budget].tolist())
            for i, s in enumerate(slots)
            if s.draft is not None
        ]
        whole = max((len(target) for _, target in active), default=0)
        chunk = self.cfg.verify_chunk_size if self.cfg.verify_mode == "chunked" else whole
        verified: dict[int, list[float]] = {}  # current logprobs of each draft's verified tokens
        offset = 0
        while active:
            requests = [
                LogprobRequest(
                    [*slots[i].prompt.ids, *target[:offset]],
                    target[offset : offset + chunk],
                    self.sampling,
                )
                for i, target in active
            ]
            chunk_scores = self._timed(stats, self.engine.logprobs, requests, prefixes)
            for (i, _), logprobs in zip(active, chunk_scores, strict=True):
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
                    slots[i].verified = Verified(k, verified[i])
                else:
                    still.append((i, target))
            active, offset = still, offset + chunk
        stats.verify_s += time.perf_counter() - started

    def _walk(self, slots: list[Slot], prefixes: Prefixes | None, stats: RolloutStats) -> None:
        """Score the history trie of every prompt (context) with slots that may reuse, in one
        pass, and walk each such slot down it (`walk_trie`), with the uniforms of its seed
        at its response positions: what vanilla decoding would draw there."""
        started = time.perf_counter()
        walkers = [
            i
            for i, s in enumerate(slots)
            if s.reuse and (tree := self.tree.get(s.prompt.prompt_id)) is not None and tree.nodes
        ]
        if not walkers:
            return
        groups: dict[tuple, list[int]] = {}  # (prompt id, context) → its walkers (rows below)
        for row, i in enumerate(walkers):
            groups.setdefault((slots[i].prompt.prompt_id, slots[i].prompt.ids), []).append(row)
        trees = [self.tree.get(prompt_id) for prompt_id, _ in groups]
        requests = [
            TrieRequest(ids, tree.parent[1:], tree.token[1:], self.sampling)
            for (_, ids), tree in zip(groups, trees, strict=True)
        ]
        scores = self._timed(stats, self.engine.score_tries, requests, prefixes)
        stats.trie_prompts += len(requests)
        stats.trie_nodes += sum(len(r.tokens) for r in requests)
        stats.verified_tokens += sum(len(r.tokens) for r in requests)
        seeds = torch.tensor([slots[i].seed for i in walkers])[:, None]
        first = torch.tensor([len(slots[i].prompt.ids) for i in walkers])[:, None]
        positions = first + torch.arange(max(slots[i].budget for i in walkers))[None, :]
        uniforms = seeded_uniform(seeds.expand_as(positions), positions).numpy()  # [S, R]
        eos = self.engine.eos_token_ids
        for rows, tree, trie in zip(groups.values(), trees, scores, strict=True):
            walking = [slots[walkers[row]] for row in rows]
            walks = walk_trie(tree, trie, uniforms[rows], [s.budget for s in walking], eos)
            for s, walked in zip(walking, walks, strict=True):
                s.walked = walked
        stats.verify_s += time.perf_counter() - started

    # ---------------------------------------------------------------- decoding
    def _continuation(self, s: Slot) -> GenRequest | None:
        """What is left to decode for a slot, or None when its draft is reused whole."""
        R = s.budget
        if s.walked is not None:  # decodes on from the node where it left the trie, if it did
            kept = s.walked.token_ids
            if s.walked.finish_reason is not None:
                return None
            return GenRequest(
                s.prompt.ids, R - len(kept), self.sampling, s.seed, kept, s.walked.excluded
            )
        if s.verified is None:
            return GenRequest(s.prompt.ids, R, self.sampling, s.seed)
        cut = s.verified.cut
        whole = cut == len(s.draft)
        if whole and (s.draft.finish_reason == "stop" or cut >= R):
            return None
        excluded = () if whole or cut >= R else self.rule.residual(int(s.draft.token_ids[cut]))
        return GenRequest(s.prompt.ids, R - cut, self.sampling, s.seed, s.kept, excluded)

    def _generate(
        self,
        requests: dict[int, GenRequest],
        drafting: Drafting | None,
        prefixes: Prefixes | None,
        stats: RolloutStats,
    ) -> list[GenResult]:
        if drafting is None:
            return self._timed(stats, self.engine.generate, list(requests.values()), prefixes)
        return self._timed(
            stats, self.engine.generate_with_drafts, list(requests.values()), drafting, prefixes
        )

    @staticmethod
    def _timed(stats: RolloutStats, call, *args):
        """`call(*args)`, its seconds counted as the engine's (`timing_s/engine`: the rest of the
        stage's time is host work, the walk, cuts and bookkeeping, that no forward pays)."""
        started = time.perf_counter()
        out = call(*args)
        stats.engine_s += time.perf_counter() - started
        return out

    def _drafting(
        self, slots: list[Slot], requests: dict[int, GenRequest], stats: RolloutStats
    ) -> Drafting | None:
        """The engine's drafter for this call: token trees for what is decoded, after each
        slot's stored draft when drafts are verified inside decoding; None when there is
        nothing to propose."""
        trees = self._tree_drafts(slots, requests)
        if not self.in_decoding:
            return None if trees is None else Drafting(trees, self.draft_width)
        drafts = [(slots[i].draft, slots[i].budget) for i in requests]
        if trees is None and all(d is None for d, _ in drafts):
            return None
        stored = [None if d is None else d.token_ids[:budget] for d, budget in drafts]
        return Drafting(StoredDrafts(stored, trees), self.draft_width)

    def _tree_drafts(self, slots: list[Slot], requests: dict[int, GenRequest]) -> TreeDrafts | None:
        """Add the responses reused whole to their trees (they are final already), and draft
        from the trees: none when every tree the requests would draft from is empty and stays
        so (prompts rolled out for the first time, without online trees)."""
        if self.tree is None:
            return None
        self.tree.insert_all(
            (s.prompt.prompt_id, s.kept) for i, s in enumerate(slots) if i not in requests
        )
        if not self.tree_drafts:
            return None
        prompt_ids = [slots[i].prompt.prompt_id for i in requests]
        if not self.cfg.tree.online and all(self.tree.get(p).nodes == 0 for p in prompt_ids):
            return None
        return TreeDrafts(
            self.tree, prompt_ids, [r.prefix_ids for r in requests.values()], self.cfg.tree.online
        )

    def _cut_in_decoding(self, slots: list[Slot], results: dict[int, GenResult]) -> None:
        """Drafts verified inside decoding: a slot keeps the longest prefix of its draft that
        its response starts with (under the exact rule a response leaves its draft exactly
        where a draft token is rejected), and its result is split there, as if it had been
        continued from that cut."""
        for i, r in results.items():
            s = slots[i]
            if s.draft is None:
                continue
            cut = common_prefix(r.token_ids, s.draft.token_ids[: s.budget])
            s.verified = Verified(cut, r.logprobs[:cut])
            results[i] = dataclasses.replace(
                r, token_ids=r.token_ids[cut:], logprobs=r.logprobs[cut:]
            )

    # ---------------------------------------------------------------- assemble
    def _assemble(self, s: Slot, result: GenResult | None, version: int) -> Rollout:
        kept_logprobs = s.kept_logprobs
        if result is None:  # reused whole
            if s.walked is not None:
                finish = s.walked.finish_reason
            else:
                finish = s.draft.finish_reason if s.verified.cut == len(s.draft) else "length"
            return Rollout(s.prompt, s.slot, s.kept, list(kept_logprobs), finish, version)
        return Rollout(
            s.prompt,
            s.slot,
            s.kept + result.token_ids,
            list(kept_logprobs) + result.logprobs,
            result.finish_reason,
            version,
        )

    def _logprobs_where_left(
        self, stats: RolloutStats, pairs: list[tuple[list[int], int]]
    ) -> list[float]:
        """The current logprob of each (context, token): where lenient responses left their
        drafts past what verification computed."""
        if not pairs:
            return []
        requests = [LogprobRequest(context, [token], self.sampling) for context, token in pairs]
        return [float(lp[0]) for lp in self._timed(stats, self.engine.logprobs, requests)]

    def _count(
        self,
        stats: RolloutStats,
        slots: list[Slot],
        rollouts: list[Rollout],
        results: dict[int, GenResult],
        version: int,
    ) -> None:
        stats.count(slots, rollouts, results, version, self.counts_drafts, self.in_decoding)
        stats.store_entries = len(self.store)
        stats.store_tokens = self.store.num_tokens
        stats.store_bytes = self.store.nbytes
        if self.tree_drafts or self.in_decoding:  # specrl's drafts: its width controller
            for k, forwards in self.draft_width.reset_choices().items():
                stats.width_forwards += forwards
                stats.width_sum += k * forwards
            stats.accept_rate_estimate = self.draft_width.accept_rate
        if self.tree is not None:
            stats.tree_nodes = self.tree.nodes
            stats.tree_prompts = len(self.tree)
