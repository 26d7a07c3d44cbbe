"""Reward functions: the built-in checkers, and user functions in verl's or TRL's style.

verl:  compute_score(data_source, solution_str, ground_truth, extra_info)
       -> float | {"score": float, "acc": float | bool (optional), ...}
TRL:   reward(completions, **columns) -> list[float]
       (columns: every dataset column, and prompts, ground_truth, data_source, extra_info; one
       list entry per completion. With conversational prompts (chat messages) completions are
       messages too, [{"role": "assistant", "content": ...}], and prompts the message lists,
       as TRL passes them)

Several functions (`custom_reward_function` as a list, each with a `weight`, as TRL's
`reward_weights`) score the weighted sum; each one's mean is logged as `reward/<name>/mean`.

The score is what is trained on and logged as a reward; accuracy (`val/acc/mean@1`, DAPO's
`filter_groups.metric=acc`) is only what a reward states is correct, as in verl: the `acc` of
a dict it returns (the built-in checkers state it). Where several functions state one, a
rollout's accuracy is their mean; where none does, there is no accuracy, only the score.

A call that raises, runs past `reward_model.timeout_s`, or returns None / NaN is counted in
`reward/errors` and scored 0.0, and its first message is kept for the log.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import PreTrainedTokenizerBase

from specrl.algorithms.dapo import overlong_penalty
from specrl.config import CustomRewardConfig, OverlongBufferConfig
from specrl.data import arithmetic, prompt_text, reasoning_gym
from specrl.errors import UserError
from specrl.rewards import math_answer
from specrl.types import Example, Rollout
from specrl.user_code import call_with_timeout, load_from_file

BUILTIN_SCORERS: dict[str, Callable[..., float]] = {
    arithmetic.DATA_SOURCE: arithmetic.compute_score
}


class RewardFunctionError(UserError):
    """The configured reward function cannot be loaded or has an unusable signature."""


@dataclass
class RewardOutputs:
    scores: list[float]
    acc: list[float | None] = field(default_factory=list)  # stated accuracy, None: not stated
    errors: int = 0
    first_error: str | None = None
    components: dict[str, list[float]] = field(default_factory=dict)  # per function, unweighted


@dataclass
class RewardFunction:
    fn: Callable[..., Any]
    style: Literal["verl", "trl"]
    timeout_s: float = 10.0
    name: str = field(default="")

    @property
    def short_name(self) -> str:
        """The function's name, as in `reward/<name>/mean`."""
        return self.name.rsplit(":", 1)[-1]

    def __call__(
        self, solutions: Sequence[str], examples: Sequence[Example], prompts: Sequence[str]
    ) -> RewardOutputs:
        if self.style == "trl":
            return self._call_batched(solutions, examples, prompts)
        out = RewardOutputs([])
        for solution, example in zip(solutions, examples, strict=True):
            args = (example.data_source, solution, example.ground_truth, example.extra_info)
            value, error = call_with_timeout(self.fn, args, self.timeout_s)
            _append_checked(value, error, out)
        return out

    def _call_batched(
        self, solutions: Sequence[str], examples: Sequence[Example], prompts: Sequence[str]
    ) -> RewardOutputs:
        names = dict.fromkeys(k for e in examples for k in e.columns)
        columns = {name: [e.columns.get(name) for e in examples] for name in names}
        conversational = all(isinstance(e.prompt, list) for e in examples)
        columns.update(
            prompts=[e.prompt for e in examples] if conversational else list(prompts),
            ground_truth=[e.ground_truth for e in examples],
            data_source=[e.data_source for e in examples],
            extra_info=[e.extra_info for e in examples],
        )
        completions: list = list(solutions)
        if conversational:
            completions = [[{"role": "assistant", "content": text}] for text in solutions]
        out = RewardOutputs([])
        values, error = call_with_timeout(
            lambda: self.fn(completions, **columns), (), self.timeout_s * len(solutions)
        )
        if error is None and (not isinstance(values, Sequence) or len(values) != len(solutions)):
            error = f"{self.name} returned {type(values).__name__}, expected a list of {len(solutions)} floats"
        for value in [None] * len(solutions) if error is not None else values:
            _append_checked(value, error, out)
        return out


@dataclass(frozen=True)
class Scores:
    """The rewards of a batch of rollouts, kept beside them (rollouts are not changed): each
    response decoded, the reward's score (`reward`, what evaluation logs as the reward), the
    score trained on (`reward` plus DAPO's overlong penalty when on) and the accuracy the
    reward states (`acc`, None where it states none or the call failed)."""

    texts: list[str]
    reward: list[float]
    scores: list[float]
    acc: list[float | None]
    errors: int = 0
    first_error: str | None = None
    components: dict[str, list[float]] = field(default_factory=dict)  # per reward function

    @property
    def stated_acc(self) -> list[float] | None:
        """Every rollout's accuracy where the reward states accuracy (a rollout it stated none
        for, a failed call, is wrong); None where it states none at all."""
        if all(a is None for a in self.acc):
            return None
        return [0.0 if a is None else float(a) for a in self.acc]

    def rows(self, index: Sequence[int]) -> Scores:
        return Scores(
            [self.texts[i] for i in index],
            [self.reward[i] for i in index],
            [self.scores[i] for i in index],
            [self.acc[i] for i in index],
            self.errors,
            self.first_error,
            {name: [values[i] for i in index] for name, values in self.components.items()},
        )

    def __add__(self, other: Scores) -> Scores:
        names = dict.fromkeys([*self.components, *other.components])
        return Scores(
            self.texts + other.texts,
            self.reward + other.reward,
            self.scores + other.scores,
            self.acc + other.acc,
            self.errors + other.errors,
            self.first_error or other.first_error,
            {n: self.components.get(n, []) + other.components.get(n, []) for n in names},
        )


@dataclass
class RewardFunctions:
    """Several reward functions: the score is the weighted sum of theirs."""

    functions: list[tuple[RewardFunction, float]]

    @property
    def name(self) -> str:
        return " + ".join(f.name for f, _ in self.functions)

    def __call__(
        self, solutions: Sequence[str], examples: Sequence[Example], prompts: Sequence[str]
    ) -> RewardOutputs:
        total = RewardOutputs([0.0] * len(solutions))
        stated: list[list[float]] = [[] for _ in solutions]  # per rollout, the functions' accs
        for function, weight in self.functions:
            out = function(solutions, examples, prompts)
            total.scores = [t + weight * s for t, s in zip(total.scores, out.scores, strict=True)]
            for accs, a in zip(stated, out.acc, strict=True):
                if a is not None:
                    accs.append(a)
            total.errors += out.errors
            total.first_error = total.first_error or out.first_error
            total.components[function.short_name] = out.scores
        total.acc = [sum(a) / len(a) if a else None for a in stated]
        return total


def load_reward_functions(
    cfg: CustomRewardConfig | Sequence[CustomRewardConfig], timeout_s: float
) -> RewardFunctions:
    """The configured reward function(s), each with its weight."""
    configs = [cfg] if isinstance(cfg, CustomRewardConfig) else list(cfg)
    functions = [(load_reward_function(c.path, c.name, timeout_s), c.weight) for c in configs]
    short = [f.short_name for f, _ in functions]
    duplicate = next((n for n in short if short.count(n) > 1), None)
    if duplicate is not None:
        raise RewardFunctionError(
            f"custom_reward_function lists {duplicate!r} twice; give each function once"
        )
    return RewardFunctions(functions)


def score_rollouts(
    reward_fn: RewardFunction | RewardFunctions,
    tokenizer: PreTrainedTokenizerBase,
    rollouts: Sequence[Rollout],
    overlong: OverlongBufferConfig | None = None,
    max_response_length: int = 0,
) -> Scores:
    """Decode every response and run the reward function on the batch (episodes come scored by
    their environment: `Rollout.reward`); with `overlong` enabled, add DAPO's soft overlong
    penalty to the scores trained on."""
    texts = [tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in rollouts]
    if all(r.reward is not None for r in rollouts):
        out = RewardOutputs([r.reward for r in rollouts], [r.acc for r in rollouts])
    else:
        out = reward_fn(
            texts,
            [r.prompt.example for r in rollouts],
            [prompt_text(r.prompt.example, tokenizer) for r in rollouts],
        )
    scores = out.scores
    if overlong is not None and overlong.enable:
        lengths = torch.tensor([len(r.token_ids) for r in rollouts])
        penalty = overlong_penalty(
            lengths, max_response_length, overlong.len, overlong.penalty_factor
        )
        scores = (torch.tensor(scores) + penalty).tolist()
    return Scores(texts, out.scores, scores, out.acc, out.errors, out.first_error, out.components)


def builtin_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> dict[str, float]:
    """The built-in task's checker for its data source, a reasoning-gym task's own scorer for
    its data source; math-verify for everything else. The score is the checker's (reasoning-gym
    gives partial credit to some wrong answers); accuracy is 1 only for a full score."""
    if data_source.startswith(reasoning_gym.DATA_SOURCE):
        scorer = reasoning_gym.compute_score
    else:
        scorer = BUILTIN_SCORERS.get(data_source, math_answer.compute_score)
    score = scorer(data_source, solution_str, ground_truth, extra_info)
    return {"score": score, "acc": float(score >= 1.0)}


def load_reward_function(path: str | None, name: str, timeout_s: float) -> RewardFunction:
    if path is None:
        return RewardFunction(builtin_compute_score, "verl", timeout_s, "builtin")
    fn = load_from_file(path, name, "custom_reward_function", "function", RewardFunctionError)
    if not callable(fn):
        raise RewardFunctionError(
            f"{path!r} has no function {name!r} (set custom_reward_function.name)"
        )
    return RewardFunction(fn, _style(fn, f"{path}:{name}"), timeout_s, f"{path}:{name}")


def _style(fn: Callable[..., Any], label: str) -> Literal["verl", "trl"]:
    params = inspect.signature(fn).parameters
    if "solution_str" in params:
        return "verl"
    if "completions" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return "trl"
    raise RewardFunctionError(
        f"reward function {label} must take (data_source, solution_str, ground_truth, extra_info) "
        "like verl, or (completions, **columns) like TRL"
    )


def stated_acc(value: Any) -> float | None:
    """The accuracy a reward's value states: its dict's finite `acc`, else None."""
    acc = value.get("acc") if isinstance(value, dict) else None
    if isinstance(acc, bool | int | float) and math.isfinite(float(acc)):
        return float(acc)
    return None


def _append_checked(value: Any, error: str | None, out: RewardOutputs) -> None:
    """One call's score and the accuracy it states (None for a failed call: scored 0, and
    counted wrong where the batch states accuracy, see `Scores.stated_acc`)."""
    errors = out.errors
    out.scores.append(_check_score(value, error, out))
    out.acc.append(None if out.errors > errors else stated_acc(value))


def _check_score(value: Any, error: str | None, out: RewardOutputs) -> float:
    if error is None:
        if isinstance(value, dict):
            value = value.get("score")
        if value is None:
            error = "returned None"
        elif isinstance(value, bool | int | float) and math.isfinite(float(value)):
            return float(value)
        else:
            error = f"returned {value!r}, not a finite number"
    out.errors += 1
    out.first_error = out.first_error or error
    return 0.0
