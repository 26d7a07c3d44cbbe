"""The environment protocol of multi-turn episodes, and guarded calls into it.

A user's environment is a class in a Python file (`env.path`, `env.name`), as reward functions
are loaded; one instance plays one episode:

    class Environment:
        def reset(self, row: dict) -> str | None:
            # row: the dataset row: prompt, ground_truth, data_source, extra_info and every
            # column. → text the policy sees before its first turn, or None
        def step(self, response: str) -> tuple[str, float, bool]:
            # response: the text of the turn just sampled (special tokens removed); a second
            # parameter, if step has one, receives its token ids.
            # → (observation appended before the next turn, reward, done); the reward is a
            # number or, as verl's reward functions, {"score": ..., "acc": ...} to state the
            # episode's accuracy (`val/acc/mean@1`)

The observation's tokens are forced into the episode's context with loss mask 0: the policy is
trained only on what it sampled. Every call runs under `env.timeout_s`; a call that raises, runs
past it or returns something else ends its episode with finish reason `env_error` and score 0,
and is counted (`episode/env_errors`), never silent.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from specrl.episodes.calculator import Calculator
from specrl.errors import UserError
from specrl.rewards import stated_acc
from specrl.types import Example
from specrl.user_code import call_with_timeout, load_from_file


class EnvError(UserError):
    """The configured environment cannot be loaded, or fails in too many episodes."""


class Environment(Protocol):
    def reset(self, row: dict[str, Any]) -> str | None: ...

    def step(self, response: str) -> tuple[str, float | dict[str, float], bool]: ...


@dataclass(frozen=True)
class StepResult:
    observation: str
    reward: float
    done: bool
    acc: float | None = None  # the accuracy the step states (a reward {"score", "acc"})


@dataclass
class EnvironmentFactory:
    """Makes one environment per episode and calls it under a timeout; `name` for messages."""

    cls: Callable[[], Any]
    name: str
    timeout_s: float

    def __post_init__(self) -> None:
        step = getattr(self.cls, "step", None)
        if not callable(getattr(self.cls, "reset", None)) or not callable(step):
            raise EnvError(f"environment {self.name} must define reset(row) and step(response)")
        params = [p for p in inspect.signature(step).parameters.values() if p.name != "self"]
        self.takes_token_ids = len(params) >= 2  # step(response, token_ids)

    def reset(self, example: Example) -> tuple[Environment | None, str | None, str | None]:
        """A new environment for `example`'s row → (environment, text before the first turn,
        error message or None)."""
        row = {
            **example.columns,
            "prompt": example.prompt,
            "ground_truth": example.ground_truth,
            "data_source": example.data_source,
            "extra_info": example.extra_info,
        }

        def start() -> tuple[Any, Any]:
            env = self.cls()
            return env, env.reset(row)

        value, error = call_with_timeout(start, (), self.timeout_s)
        if error is not None:
            return None, None, f"reset {error}"
        env, text = value
        if text is not None and not isinstance(text, str):
            return None, None, f"reset returned {type(text).__name__}, expected str or None"
        return env, text, None

    def step(
        self, env: Environment, response: str, token_ids: Sequence[int]
    ) -> tuple[StepResult | None, str | None]:
        """→ (the step's result, None), or (None, the error message)."""
        args = (response, list(token_ids)) if self.takes_token_ids else (response,)
        value, error = call_with_timeout(env.step, args, self.timeout_s)
        if error is not None:
            return None, f"step {error}"
        if not (isinstance(value, tuple | list) and len(value) == 3):
            return None, f"step returned {value!r}, expected (observation, reward, done)"
        observation, reward, done = value
        if not isinstance(observation, str):
            return None, f"step returned observation {observation!r}, expected str"
        score = reward.get("score") if isinstance(reward, dict) else reward
        if not isinstance(score, bool | int | float) or not math.isfinite(float(score)):
            return None, f"step returned reward {reward!r}, not a finite number"
        return StepResult(observation, float(score), bool(done), stated_acc(reward)), None


def load_environment(path: str | None, name: str, timeout_s: float) -> EnvironmentFactory:
    """The environment class at `path` (None: the built-in calculator task's)."""
    if path is None:
        return EnvironmentFactory(Calculator, "builtin calculator", timeout_s)
    cls = load_from_file(path, name, "env", "class", EnvError)
    if not isinstance(cls, type):
        raise EnvError(f"env.name {name!r} in {path!r} is not a class")
    return EnvironmentFactory(cls, f"{path}:{name}", timeout_s)
