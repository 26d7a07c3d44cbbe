"""Where a run's rollouts come from: the protocol the training loop uses, and its in-process
backend (one engine and its speculative stage; in multi-turn runs, episodes whose turns that
stage rolls out). `distributed.rollout.RolloutWorkers` is the other backend: Ray workers, each
with an engine and a stage for the prompts it owns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from specrl.engines import GenRequest, GenResult, RolloutEngine
from specrl.episodes.runner import EpisodeLoop, EpisodeStage
from specrl.speculative.stage import SpeculativeStage
from specrl.speculative.stats import RolloutStats
from specrl.types import Prompt, Rollout


class RolloutBackend(Protocol):
    episodes: EpisodeLoop | None  # multi-turn runs: the episode loop (evaluation plays it too)

    def __call__(
        self, prompts: Sequence[Prompt], n: int, seed_key: tuple, policy_version: int
    ) -> tuple[list[Rollout], RolloutStats]:
        """n speculative rollouts (episodes, in multi-turn runs) per prompt, prompt-major, and
        their counts."""

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Plain decoding (evaluation)."""

    def run_ahead(self, prompts: Sequence[Prompt], seed_key: tuple, policy_version: int) -> None:
        """Seed these prompts' token trees ahead of their rollouts (SRT run-ahead)."""

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """The policy of `version` (its rollouts are sampled with these weights)."""

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def shutdown(self) -> None: ...


class InProcessRollouts:
    """The backend in the trainer's process: `engine` decodes and verifies, `stage` (over that
    engine) does everything speculative; with `episodes`, each rollout is an episode whose turns
    the stage rolls out. The checkpointed state is the stage's (and the episodes' record)."""

    def __init__(
        self, engine: RolloutEngine, stage: SpeculativeStage, episodes: EpisodeLoop | None = None
    ) -> None:
        self.engine = engine
        self.stage = stage
        self.episodes = episodes
        self._rollouts = stage if episodes is None else EpisodeStage(stage, episodes)

    def __call__(
        self, prompts: Sequence[Prompt], n: int, seed_key: tuple, policy_version: int
    ) -> tuple[list[Rollout], RolloutStats]:
        return self._rollouts(prompts, n, seed_key, policy_version)

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        return self.engine.generate(requests)

    def run_ahead(self, prompts: Sequence[Prompt], seed_key: tuple, policy_version: int) -> None:
        self.stage.seed_trees(prompts, seed_key, policy_version)

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.engine.load_weights(state)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def state_dict(self) -> dict[str, Any]:
        return self._rollouts.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rollouts.load_state_dict(state)

    def shutdown(self) -> None:
        """Nothing to stop: the engine lives as long as the process."""
