"""Plain sampling of rollouts, without speculation: the seed of every (step, prompt, slot), the
request for one slot, and `sample_rollouts` / `sample_slots` (evaluation, greedy episodes, the
built-in policies' warm start, seeding trees ahead). The speculative stage decodes with the same
seeds, so where it decodes it draws what these would."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from specrl.engines import GenRequest, RolloutEngine, SamplingParams
from specrl.types import Prompt, Rollout


def rollout_seed(*key: object) -> int:
    """A 63-bit seed from a key such as (run seed, step, prompt id, slot): fresh for every step,
    independent of batch composition and order."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class SlotRequest:
    """One slot to roll out: at most `max_tokens` tokens, reusing its history (its stored draft,
    or its prompt's trie) when `may_reuse` and speculation is on."""

    prompt: Prompt
    slot: int
    max_tokens: int
    may_reuse: bool = True


def sample_rollouts(
    engine: RolloutEngine,
    prompts: Sequence[Prompt],
    n: int,
    sampling: SamplingParams,
    max_response_length: int,
    seed_key: tuple,
    policy_version: int,
) -> list[Rollout]:
    """Plain sampling → len(prompts) * n rollouts, prompt-major (a prompt's slots contiguous)."""
    slots = [SlotRequest(p, s, max_response_length) for p in prompts for s in range(n)]
    return sample_slots(engine, slots, sampling, seed_key, policy_version)


def sample_slots(
    engine: RolloutEngine,
    slots: Sequence[SlotRequest],
    sampling: SamplingParams,
    seed_key: tuple,
    policy_version: int,
) -> list[Rollout]:
    """Plain sampling of single slots (no drafts) → one rollout per slot, in order."""
    requests = [
        GenRequest(
            q.prompt.ids,
            q.max_tokens,
            sampling,
            rollout_seed(*seed_key, q.prompt.prompt_id, q.slot),
        )
        for q in slots
    ]
    results = engine.generate(requests)
    return [
        Rollout(q.prompt, q.slot, r.token_ids, r.logprobs, r.finish_reason, policy_version)
        for q, r in zip(slots, results, strict=True)
    ]
