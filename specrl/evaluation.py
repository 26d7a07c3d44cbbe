"""Held-out evaluation: the reward of the current policy's greedy responses
(`val/reward/mean@1`) and, where the reward states what is correct, their accuracy
(`val/acc/mean@1`), as verl; in multi-turn runs, of greedy episodes (`val/num_turns/mean` too)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from transformers import PreTrainedTokenizerBase

from specrl.engines import GREEDY, RolloutEngine
from specrl.episodes.runner import EpisodeLoop, sampled_turns
from specrl.rewards import RewardFunction, score_rollouts
from specrl.rollouts import sample_rollouts
from specrl.types import Prompt, Rollout


@dataclass
class Evaluation:
    """An evaluation's `val/*` metrics and its first held-out prompts with what the policy wrote
    (`trainer.log_val_generations` of them: prompt, response, ground truth, score)."""

    metrics: dict[str, float]
    generations: list[dict[str, str | float]] = field(default_factory=list)


def evaluate(
    engine: RolloutEngine,
    prompts: Sequence[Prompt],
    reward_fn: RewardFunction,
    tokenizer: PreTrainedTokenizerBase,
    batch_size: int,
    max_response_length: int,
    policy_version: int,
    episodes: EpisodeLoop | None = None,
    generations: int = 0,
) -> Evaluation:
    """One greedy response (or episode, with `episodes`) per held-out prompt, scored by the
    reward function (by the environment); the first `generations` of them kept as text."""
    start = time.perf_counter()
    rollouts: list[Rollout] = []
    turns = 0
    turn = sampled_turns(engine, GREEDY, ("val",), policy_version)
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        if episodes is None:
            rollouts += sample_rollouts(
                engine, batch, 1, GREEDY, max_response_length, ("val",), policy_version
            )
            continue
        played, stats = episodes.run(batch, 1, turn, policy_version)
        rollouts += played
        turns += stats.turns
    scores = score_rollouts(reward_fn, tokenizer, rollouts)
    metrics = {
        "val/reward/mean@1": float(np.mean(scores.reward)),
        "val/response_length/mean": float(np.mean([len(r.token_ids) for r in rollouts])),
        "val/reward_errors": scores.errors,
        "timing_s/testing": time.perf_counter() - start,
    }
    if (acc := scores.stated_acc) is not None:
        metrics["val/acc/mean@1"] = float(np.mean(acc))
    if episodes is not None:
        metrics["val/num_turns/mean"] = turns / len(rollouts)
    shown = zip(rollouts[:generations], scores.texts, scores.reward, strict=False)
    samples = [
        {
            "prompt": tokenizer.decode(r.prompt.ids, skip_special_tokens=False),
            "response": text,
            "ground_truth": r.prompt.example.ground_truth,
            "score": score,
        }
        for r, text, score in shown
    ]
    return Evaluation(metrics, samples)
