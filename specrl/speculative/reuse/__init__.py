"""The ways a slot reuses history, one class each, chosen once per stage from the config and the
engine's capabilities (`reuse_strategy`):

- `trie` (`TrieReuse`, trie.py): each prompt's history trie verified in one pass, as far as it
  pays (`TrieBudget`, budget.py; where its walkers go: walkers.py), every slot walked down it
  with vanilla decoding's uniforms (the exact rule's default);
- `slot` (`SlotReuse`, slot.py): each slot's stored draft verified in one pass (or in chunks), as
  far as it pays (`DraftBudget`, budget.py), and cut by the acceptance rule (SPEC-RL);
- `slot-in-decoding` (`SlotReuseInDecoding`, slot.py): each slot's stored draft verified inside
  decoding (`verify_mode=decoding`, the exact rule);
- `none` (`Reuse`, base.py): speculation off.

A new strategy is a subclass of `Reuse` in its own file and one line of `reuse_strategy`.
"""

from __future__ import annotations

from specrl.config import SpecConfig
from specrl.engines import RolloutEngine, SamplingParams
from specrl.errors import UserError
from specrl.speculative.acceptance import AcceptanceRule
from specrl.speculative.draft_width import DraftWidth
from specrl.speculative.prompt_state import PromptState
from specrl.speculative.reuse.base import Reuse
from specrl.speculative.reuse.budget import DraftBudget, TrieBudget
from specrl.speculative.reuse.slot import SlotReuse, SlotReuseInDecoding
from specrl.speculative.reuse.trie import TrieReuse

__all__ = ["Reuse", "SlotReuse", "SlotReuseInDecoding", "TrieReuse", "reuse_strategy"]


def reuse_strategy(
    cfg: SpecConfig,
    engine: RolloutEngine,
    rule: AcceptanceRule,
    prompts: PromptState,
    sampling: SamplingParams,
    width: DraftWidth,
) -> Reuse:
    """The strategy `rollout.spec` asks for, checked against what `engine` can do (`width`: the
    stage's fit of decode forwards, which prices a decoded token for the budgets)."""
    capabilities = engine.capabilities
    if not cfg.enabled:
        return Reuse()
    if rule.exact and not capabilities.residual_sampling:
        raise UserError(
            "rollout.spec.acceptance=exact needs an engine that samples from residuals; "
            "use rollout.spec.acceptance=specrl on this engine"
        )
    if cfg.walks_tries(capabilities.trie_verification):
        if not capabilities.trie_verification:
            raise UserError(
                "rollout.spec.reuse=trie needs an engine that verifies tries (hf, vllm); "
                "use rollout.spec.reuse=slot on this engine"
            )
        budget = TrieBudget(cfg.verify_budget, width, rows_free=capabilities.graph_decoding)
        return TrieReuse(engine, prompts.tree, sampling, budget)
    if cfg.verify_mode == "decoding":
        if not capabilities.draft_decoding:
            raise UserError(
                "rollout.spec.verify_mode=decoding needs an engine that decodes with drafts (hf, "
                "or a vllm engine built with draft_tokens); use verify_mode=full"
            )
        return SlotReuseInDecoding(prompts.store)
    budget = DraftBudget(cfg.verify_budget, width, rows_free=capabilities.graph_decoding)
    return SlotReuse(engine, rule, prompts.store, sampling, cfg, budget)
