"""The built-in verifiable task: multi-digit addition with a written-out scratchpad.

Prompt `4738+95=`; the solution works column by column from the right, writing digit + digit +
incoming carry = column sum, then the answer after `#`:

    8+5+0=13;3+9+1=13;7+0+1=8;4+0+0=4;#4833

The checker reads the answer after the last `#`. Warm-start traces are *imperfect*: the teacher
forgets an incoming carry (writes +0 where +1 is due) with probability `p_forget_carry`, and then
computes consistently from its mistake, so a policy trained on them carries correctly only some
of the time, leaving RL a clear, verifiable thing to learn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from specrl.types import Example

DATA_SOURCE = "specrl/arithmetic"
ALPHABET = "0123456789+=;#"


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    def example(self) -> Example:
        return Example(prompt=self.prompt, ground_truth=self.answer, data_source=DATA_SOURCE)


def sample_problem(rng: random.Random, min_digits: int = 2, max_digits: int = 6) -> Problem:
    """Each operand gets its own number of digits, uniform in [min_digits, max_digits]."""
    a_digits, b_digits = rng.randint(min_digits, max_digits), rng.randint(min_digits, max_digits)
    return Problem(
        rng.randint(10 ** (a_digits - 1), 10**a_digits - 1),
        rng.randint(10 ** (b_digits - 1), 10**b_digits - 1),
    )


def solution_trace(
    problem: Problem, rng: random.Random | None = None, p_forget_carry: float = 0.0
) -> str:
    """The scratchpad and answer; with `p_forget_carry > 0` (and an rng) carries may be dropped."""
    a_digits, b_digits = str(problem.a)[::-1], str(problem.b)[::-1]
    carry, columns, digits = 0, [], []
    for i in range(max(len(a_digits), len(b_digits))):
        x = int(a_digits[i]) if i < len(a_digits) else 0
        y = int(b_digits[i]) if i < len(b_digits) else 0
        if carry and rng is not None and rng.random() < p_forget_carry:
            carry = 0
        total = x + y + carry
        columns.append(f"{x}+{y}+{carry}={total}")
        digits.append(total % 10)
        carry = total // 10
    if carry:
        digits.append(carry)
    return ";".join(columns) + ";#" + "".join(str(d) for d in reversed(digits))


def extract_answer(solution: str) -> str | None:
    """The text after the last `#`, or None when the response never reached an answer."""
    if "#" not in solution:
        return None
    return solution.rsplit("#", 1)[1].strip()


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> float:
    """1.0 when the answer after `#` equals the ground truth, else 0.0 (verl signature)."""
    return float(extract_answer(solution_str) == str(ground_truth).strip())


def make_split(
    seed: int, train_size: int, test_size: int, min_digits: int = 2, max_digits: int = 6
) -> tuple[list[Problem], list[Problem]]:
    """Deterministic, disjoint train and test problems for a seed (no duplicates within either)."""
    rng = random.Random(f"arithmetic-split-{seed}")
    test: list[Problem] = _unique(rng, test_size, set(), min_digits, max_digits)
    train: list[Problem] = _unique(rng, train_size, set(test), min_digits, max_digits)
    return train, test


def _unique(
    rng: random.Random, size: int, exclude: set[Problem], min_digits: int, max_digits: int
) -> list[Problem]:
    seen, out = set(exclude), []
    while len(out) < size:
        problem = sample_problem(rng, min_digits, max_digits)
        if problem not in seen:
            seen.add(problem)
            out.append(problem)
    return out
