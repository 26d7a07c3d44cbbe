"""Per-step metrics of the data a step trained on, under verl's names."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specrl.algorithms.dapo import groups_with_signal
from specrl.algorithms.losses import masked_mean
from specrl.types import Rollout


@dataclass
class SignalWatch:
    """Watches for a run that learns nothing: `steps` steps in a row whose every group's scores
    were equal (every advantage 0). Says so once per run."""

    group_size: int
    generations: Path  # where the run keeps what the policy writes
    steps: int = 3
    flat: int = 0  # steps in a row without a group whose scores differ
    warned: bool = False

    def check(self, step: int, scores: Sequence[float]) -> str | None:
        """The warning to give after `step`'s scores, or None."""
        groups = torch.tensor(scores).view(-1, self.group_size)  # [G, n]
        self.flat = 0 if bool(groups_with_signal(groups).any()) else self.flat + 1
        if self.flat < self.steps or self.warned:
            return None
        self.warned = True
        values = sorted({round(s, 4) for s in scores})
        shown = ", ".join(map(str, values[:3])) + (", ..." if len(values) > 3 else "")
        return (
            f"steps {step - self.steps + 1}-{step}: every group's scores were equal (scores "
            f"{shown}), so every advantage is 0 and nothing is learned. Likely causes: the prompt "
            "format (a chat model untemplated: data.apply_chat_template), the reward function or "
            "its ground truth column (custom_reward_function, data.answer_key), or a task the "
            f"policy never (or always) solves; what the policy writes is in {self.generations}"
        )


@contextmanager
def timed(metrics: dict[str, float], name: str) -> Iterator[None]:
    """Add the seconds the block takes to metrics['timing_s/<name>']."""
    start = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


def logprob_mismatch(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout engine's logprobs are from the trainer's (0 when they are the same
    numbers, as with the transformers engine over the trainer's own model). All [B, R]."""
    diff = (old_logprobs - rollout_logprobs).abs()[mask.bool()]
    if diff.numel() == 0:
        return {}
    return {
        "rollout_corr/logprob_abs_diff_mean": float(diff.mean()),
        "rollout_corr/logprob_abs_diff_max": float(diff.max()),
    }


def data_metrics(
    rollouts: Sequence[Rollout],
    scores: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    step_time: float,
) -> dict[str, float]:
    """scores [N]: one per rollout; advantages [N, T] over its response tokens (the statistics
    are over the tokens, as verl's)."""
    valid = advantages[response_mask.bool()]
    lengths = torch.tensor([len(r.token_ids) for r in rollouts], dtype=torch.float32)
    prompt_lengths = torch.tensor([len(r.prompt.ids) for r in rollouts], dtype=torch.float32)
    total_tokens = float(lengths.sum() + prompt_lengths.sum())
    return {
        "critic/score/mean": scores.mean().item(),
        "critic/rewards/mean": scores.mean().item(),
        "critic/score/max": scores.max().item(),
        "critic/score/min": scores.min().item(),
        "critic/advantages/mean": valid.mean().item(),
        "critic/advantages/max": valid.max().item(),
        "critic/advantages/min": valid.min().item(),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/min": lengths.min().item(),
        "response_length/clip_ratio": float(
            np.mean([r.finish_reason == "length" for r in rollouts])
        ),
        "prompt_length/mean": prompt_lengths.mean().item(),
        "perf/total_num_tokens": total_tokens,
        "perf/throughput": total_tokens / step_time,
    }


def value_metrics(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """verl's critic data metrics: mean value and return over the response tokens, and the
    fraction of the returns' variance the values explain."""
    valid = mask.bool()
    residual = (returns - values)[valid]
    return {
        "critic/values/mean": masked_mean(values, mask).item(),
        "critic/returns/mean": masked_mean(returns, mask).item(),
        "critic/vf_explained_var": (1 - residual.var() / (returns[valid].var() + 1e-5)).item(),
    }
