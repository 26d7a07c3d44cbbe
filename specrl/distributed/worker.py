"""A rollout worker: one engine and one speculative stage for the prompts this worker owns.

It runs as a Ray actor (`RolloutWorkers` places it) but imports nothing of Ray, so it is plain
Python to test. Drafts and token trees stay here, next to the engine that decodes with them;
what leaves per call is the rollouts, their counts and a delta: the state of the prompts the call
touched, which the controller keeps so that a restarted worker can be given its shard back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specrl.config import Config
from specrl.engines import GenRequest, GenResult, SamplingParams
from specrl.engines.build import build_worker_engine
from specrl.engines.protocol import WeightPhase
from specrl.speculative.stage import SpeculativeStage
from specrl.speculative.stats import RolloutStats
from specrl.tracking import quiet_libraries
from specrl.types import Prompt, Rollout


@dataclass
class WorkerResult:
    rollouts: list[Rollout]
    stats: RolloutStats
    delta: dict[str, Any]  # stage.export of the prompts rolled out
    draft_width: dict[str, Any]  # the stage's draft-width statistics after the call
    policy_version: int


class RolloutWorker:
    def __init__(
        self,
        cfg: Config,
        model_dir: Path,
        eos_ids: list[int],
        pad_id: int,
        sampling: SamplingParams,
        num_workers: int,
        weight_transfer: str = "local",
    ) -> None:
        torch.set_num_threads(cfg.rollout.num_cpus_per_worker)
        quiet_libraries()
        spec = cfg.rollout.spec
        # the trees' node budget is the run's: each of the workers holds a share of the prompts
        tree = spec.tree.model_copy(update={"max_nodes": -(-spec.tree.max_nodes // num_workers)})
        self.engine = build_worker_engine(cfg, eos_ids, pad_id, model_dir, weight_transfer)
        self.stage = SpeculativeStage(
            self.engine,
            sampling,
            cfg.data.max_response_length,
            spec.model_copy(update={"tree": tree}),
        )
        self.policy_version: int | None = None
        self._fault: str | None = None

    def pid(self) -> int:
        return os.getpid()

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> int:
        self.engine.load_weights(state)
        self.policy_version = version
        return version

    def transfer_weights(self, phase: WeightPhase, info: dict[str, Any] | None = None) -> None:
        """One phase of a weight transfer the trainer drives (engines with `nccl_weight_sync`)."""
        self.engine.transfer_weights(phase, info)

    def weights_received(self, version: int) -> int:
        """The transfer of step `version`'s weights is complete."""
        self.policy_version = version
        return version

    def rollout(
        self, prompts: Sequence[Prompt], n: int, seed_key: tuple, policy_version: int
    ) -> WorkerResult:
        rollouts, stats = self.stage(prompts, n, seed_key, policy_version)
        if self._fault == "exit":  # fault injection: die with the call in flight
            os._exit(1)
        if self._fault == "hang":
            time.sleep(3600)
        return WorkerResult(
            rollouts,
            stats,
            self.stage.export(dict.fromkeys(p.prompt_id for p in prompts)),
            self.draft_width(),
            self.policy_version,
        )

    def run_ahead(
        self, prompts: Sequence[Prompt], seed_key: tuple, policy_version: int
    ) -> dict[str, Any]:
        """Seed the trees of prompts this worker rolls out next (SRT run-ahead) while the trainer
        updates; → their state, for the controller."""
        self.stage.seed_trees(prompts, seed_key, policy_version)
        return self.stage.export(dict.fromkeys(p.prompt_id for p in prompts))

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        return self.engine.generate(requests)

    def import_(self, state: dict[str, Any]) -> None:
        self.stage.import_(state)

    def drop(self, prompt_ids: Iterable[str]) -> None:
        self.stage.drop(prompt_ids)

    def draft_width(self) -> dict[str, Any]:
        return self.stage.draft_width.state_dict()

    def load_draft_width(self, state: dict[str, Any]) -> None:
        self.stage.draft_width.load_state_dict(state)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def arm_fault(self, kind: str = "exit") -> None:
        """Fault injection (tests, drills): the next rollout call, its work done and before it
        returns, exits the process (`exit`, as a crash mid-call would) or hangs (`hang`)."""
        self._fault = kind
