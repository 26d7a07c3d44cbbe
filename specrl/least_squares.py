"""Costs fitted online: the normal equations of exponentially weighted least squares, solved only
where the observations separate the costs."""

from __future__ import annotations

import numpy as np


def solved(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """The solution of the normal equations a c = b, or None where a is too ill-conditioned to
    separate the costs (after scaling its columns to unit diagonal)."""
    scale = np.sqrt(np.diag(a))
    if scale.min() <= 0 or np.linalg.cond(a / np.outer(scale, scale)) > 1e8:
        return None
    return np.linalg.solve(a, b)
