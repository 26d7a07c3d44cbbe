"""The built-in verifiable tasks: multi-digit addition with a written-out scratchpad.

Prompt `4738+95=`; the solution works column by column from the right, writing digit + digit +
incoming carry = column sum, then the answer after `#`:

    8+5+0=13;3+9+1=13;7+0+1=8;4+0+0=4;#4833

The checker reads the answer after the last `#`. Warm-start traces come from an imperfect
`Teacher`, which then computes consistently from its mistakes, so RL has verifiable things to
learn. Two tasks (`TASKS`, `data.task`):

- `addition`: the teacher forgets an incoming carry (writes +0 where +1 is due) 60% of the time.
  One skill: RL learns it within a few steps, then the policy barely moves.
- `noisy_facts` (the default): the teacher knows carries but gets a fifth of the 200 column facts
  (digit, digit, carry) wrong, each with its own probability between 0.5 and 0.95 and its own
  wrong sum. A greedy policy gets every such fact wrong; RL has to flip them one by one, the
  rarely and the confidently wrong ones last, so held-out accuracy keeps rising over the run.
- `calculator` (multi-turn, episodes/calculator.py): the noisy-facts teacher, who also calls a
  calculator for a quarter of the columns: it writes `x+y+c=` and ends its turn, and the
  calculator's observation is the true sum `s;`. A policy that called it for every column would
  never get a fact wrong; RL can learn that, or the facts themselves.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import cached_property

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


@dataclass(frozen=True)
class Teacher:
    """How warm-start traces go wrong. `p_forget_carry`: an incoming carry is dropped with this
    probability. `noisy_facts`: this fraction of the column facts (x, y, carry) are written with
    a wrong sum (the true one ± 1, fixed per fact) with a probability drawn per fact, uniform in
    `p_wrong`; which facts, how often and how, are fixed by `seed`. `p_call`: the probability
    of calling the calculator for a column instead of writing its sum."""

    p_forget_carry: float = 0.0
    noisy_facts: float = 0.0
    p_wrong: tuple[float, float] = (0.5, 0.95)
    seed: int = 0
    p_call: float = 0.0

    @cached_property
    def fact_errors(self) -> dict[tuple[int, int, int], tuple[float, int]]:
        """(x, y, carry) → (probability of writing the wrong sum, the wrong sum)."""
        rng = random.Random(f"teacher-facts-{self.seed}")
        facts = [(x, y, c) for x in range(10) for y in range(10) for c in (0, 1)]
        noisy = rng.sample(facts, round(self.noisy_facts * len(facts)))
        errors = {}
        for x, y, c in noisy:
            total = x + y + c
            wrong = total + rng.choice([-1, 1]) if 0 < total < 19 else (1 if total == 0 else 18)
            errors[(x, y, c)] = (rng.uniform(*self.p_wrong), wrong)
        return errors


@dataclass(frozen=True)
class Task:
    """A built-in task: its problems (operand digits) and the teacher of its warm start."""

    min_digits: int
    max_digits: int
    teacher: Teacher = field(default_factory=Teacher)


TASKS = {
    "addition": Task(2, 6, Teacher(p_forget_carry=0.6)),
    "noisy_facts": Task(2, 6, Teacher(noisy_facts=0.2)),
    "calculator": Task(2, 6, Teacher(noisy_facts=0.2, p_call=0.25)),
}
MULTI_TURN_TASKS = ("calculator",)  # episodes with the calculator environment


def solution_trace(
    problem: Problem, rng: random.Random | None = None, teacher: Teacher | None = None
) -> str:
    """The scratchpad and answer: correct, or as `teacher` writes it (with `rng`); the
    calculator's answers written in."""
    return "".join(
        turn + observation for turn, observation in solution_turns(problem, rng, teacher)
    )


def solution_turns(
    problem: Problem, rng: random.Random | None = None, teacher: Teacher | None = None
) -> list[tuple[str, str]]:
    """The scratchpad and answer as (turn, observation) pairs: a turn that calls the calculator
    ends with `x+y+c=` and its observation is the true sum `s;`; the last turn ends with the
    answer, and its observation is empty."""
    a_digits, b_digits = str(problem.a)[::-1], str(problem.b)[::-1]
    carry, turns, text, digits = 0, [], "", []
    errs = teacher is not None and rng is not None
    for i in range(max(len(a_digits), len(b_digits))):
        x = int(a_digits[i]) if i < len(a_digits) else 0
        y = int(b_digits[i]) if i < len(b_digits) else 0
        if errs and carry and rng.random() < teacher.p_forget_carry:
            carry = 0
        total = x + y + carry
        text += f"{x}+{y}+{carry}="
        if errs and teacher.p_call and rng.random() < teacher.p_call:
            turns.append((text, f"{total};"))
            text = ""
        else:
            if errs and (x, y, carry) in teacher.fact_errors:
                p, wrong = teacher.fact_errors[(x, y, carry)]
                if rng.random() < p:
                    total = wrong
            text += f"{total};"
        digits.append(total % 10)
        carry = total // 10
    if carry:
        digits.append(carry)
    turns.append((text + "#" + "".join(str(d) for d in reversed(digits)), ""))
    return turns


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
