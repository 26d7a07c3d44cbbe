"""DAPO's reward-side options (arXiv 2503.14476): soft overlong punishment and the group filter
behind dynamic sampling."""

from __future__ import annotations

import torch


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """Zero up to max_length - buffer_len tokens, then a linear ramp to -penalty_factor at
    max_length. lengths [N] → penalties [N] (≤ 0), added to the scores."""
    expected = max_length - buffer_len
    excess = (lengths.float() - expected).clamp(min=0)
    return -(excess / buffer_len).clamp(max=1.0) * penalty_factor


def groups_with_signal(scores: torch.Tensor) -> torch.Tensor:
    """Dynamic sampling keeps a group only if its scores differ (equal scores → zero advantage,
    no gradient). scores [G, n] → keep [G] bool."""
    return (scores.max(-1).values - scores.min(-1).values) > 0
