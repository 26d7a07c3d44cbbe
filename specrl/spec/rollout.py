"""The rollout stage: prompts → n rollouts per prompt (slots), grouped by prompt.

Vanilla rollout is this path with no drafts; speculative rollouts (drafts → verify → cut →
continue) plug in here behind the same interface, so the trainer never changes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from specrl.engines import GenRequest, RolloutEngine, SamplingParams
from specrl.types import Prompt, Rollout


def rollout_seed(*key: object) -> int:
    """A 63-bit sampling seed from a key such as (run seed, step, prompt id, slot): fresh for
    every step, independent of batch composition and order."""
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
    """→ len(prompts) * n rollouts, prompt-major (the n slots of a prompt are contiguous)."""
    requests = [
        GenRequest(
            prompt.ids,
            max_response_length,
            sampling,
            rollout_seed(*seed_key, prompt.prompt_id, slot),
        )
        for prompt in prompts
        for slot in range(n)
    ]
    results = engine.generate(requests)
    return [
        Rollout(
            prompt, slot, result.token_ids, result.logprobs, result.finish_reason, policy_version
        )
        for (prompt, slot), result in zip(
            ((p, s) for p in prompts for s in range(n)), results, strict=True
        )
    ]
