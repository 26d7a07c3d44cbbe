"""The built-in multi-turn task's environment (`data.task=calculator`, data/arithmetic.py).

A turn that ends with a column's sum left open, `x+y+c=`, calls the calculator: the observation
is the true sum and the separator, `s;`, and the episode goes on. Any other turn ends the
episode, scored 1 when the answer after `#` is right (its stated accuracy too).
"""

from __future__ import annotations

import re
from typing import Any

from specrl.data import arithmetic

CALL = re.compile(r"(\d)\+(\d)\+(\d)=$")


class Calculator:
    def reset(self, row: dict[str, Any]) -> None:
        self.ground_truth = row["ground_truth"]

    def step(self, response: str) -> tuple[str, float | dict[str, float], bool]:
        call = CALL.search(response)
        if call is not None:
            return f"{sum(int(d) for d in call.groups())};", 0.0, False
        right = arithmetic.compute_score("", response, self.ground_truth)
        return "", {"score": right, "acc": right}, True
