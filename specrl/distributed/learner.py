"""The actor on K learner ranks: a torch.distributed group (gloo on CPUs, nccl on GPUs) of Ray
actors, as verl places its FSDP workers (`actor.num_workers`, or `trainer.nnodes` x
`trainer.n_gpus_per_node`; `actor.strategy` ddp | fsdp2).

`LearnerRank` is plain Python (placed as a Ray actor, it imports Ray only to name its node):
its own copy of the policy (and the KL reference), wrapped for its strategy, and the optimizer
of its parameters; the update itself is `specrl.actor`'s, on this rank's token-balanced part of
each mini-batch; with `algorithm.adv_estimator=gae` the critic runs next to it the same way.
`LearnerGroup`, on the trainer's side, stands where the in-process `Actor` stands: `logprobs`,
`update`, `state_dict` / `load_state_dict`, `critic` (where the in-process `Critic` stands), and
`policy`, a CPU copy of the weights refreshed after each update (for the in-process engine,
weight publishing and checkpoints). Checkpoints hold the full optimizer state keyed by parameter names, so a run
saved with K ranks resumes with any K. A rank that dies stops the run with a message: the
group's collectives cannot go on without it, and the last checkpoint resumes it.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from specrl.actor.batch import TrainBatch
from specrl.actor.critic import Critic, CriticStats, load_critic
from specrl.actor.data_parallel import Rank, balanced_split
from specrl.actor.policy import load_actor, load_trained_policy
from specrl.actor.update import Actor, ActorStats, UpdateShares
from specrl.config import Config
from specrl.distributed.ray_cluster import import_ray, require_cpus, start_ray
from specrl.errors import UserError
from specrl.lora import load_trained_weights
from specrl.tracking import quiet_libraries


class LearnerGroupError(UserError):
    """A learner rank died or failed: the group cannot go on."""


class LearnerRank:
    def __init__(self, cfg: Config, model_dir: Path, initial_dir: Path, index: int, world: int):
        torch.set_num_threads(cfg.actor.num_cpus_per_worker)
        quiet_libraries()
        self.cfg = cfg
        self.model_dir, self.initial_dir = model_dir, initial_dir
        self.rank = Rank(index, world)
        # placed on a GPU, Ray shows the rank only its own: cuda:0
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.actor: Actor | None = None
        self.critic: Critic | None = None

    def endpoint(self) -> tuple[str, int]:
        """This node's address and a free port on it: the group's rendezvous (rank 0's)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, host: str, port: int) -> None:
        """Join the group, then load the models and build the optimizer (FSDP2 shards the
        parameters before the optimizer sees them)."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=self.rank.index,
            world_size=self.rank.world,
        )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.actor = load_actor(
            self.cfg, self.model_dir, self.initial_dir, log=lambda _: None, rank=self.rank,
            device=self.device,
        )[0]  # fmt: skip
        if self.cfg.algorithm.adv_estimator == "gae":
            self.critic = load_critic(self.cfg, self.initial_dir, self.rank, self.device)

    def logprobs(
        self, batch: TrainBatch, parts: list[torch.Tensor], reference: bool
    ) -> torch.Tensor:
        return self.actor.logprobs(batch, reference, parts)

    def update(self, batch: TrainBatch, group_size: int, seed: int) -> UpdateShares:
        return self.actor.update_shares(batch, group_size, seed)

    def weights(self) -> dict[str, torch.Tensor]:
        return self.actor.weights()

    def state_dict(self) -> dict[str, Any]:
        return self.actor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.actor.load_state_dict(state)

    def values(self, batch: TrainBatch, parts: list[torch.Tensor]) -> torch.Tensor:
        return self.critic.values(batch, parts)

    def critic_update(self, batch: TrainBatch, group_size: int, seed: int) -> UpdateShares:
        return self.critic.update_shares(batch, group_size, seed)

    def critic_state_dict(self) -> dict[str, Any]:
        return self.critic.state_dict()

    def critic_load_state_dict(self, state: dict[str, Any]) -> None:
        self.critic.load_state_dict(state)


class LearnerGroup:
    def __init__(self, cfg: Config, model_dir: Path, initial_dir: Path, log=print) -> None:
        ray = import_ray(what="several learner ranks")
        start_ray(cfg.ray_kwargs.ray_init)
        self._ray = ray
        self.cfg = cfg
        world = cfg.learner_ranks
        gpus = 1 if cfg.trainer.n_gpus_per_node else 0
        require_cpus(ray, cfg)
        self.policy, self.tokenizer = load_trained_policy(cfg, model_dir, initial_dir, log)
        self.policy.eval()
        remote = ray.remote(LearnerRank).options(
            num_cpus=cfg.actor.num_cpus_per_worker, num_gpus=gpus, max_restarts=0
        )
        self.ranks = [remote.remote(cfg, model_dir, initial_dir, i, world) for i in range(world)]
        host, port = self._get(self.ranks[0].endpoint.remote())
        self._get([r.join.remote(host, port) for r in self.ranks])
        gae = cfg.algorithm.adv_estimator == "gae"
        self.critic = CriticOnRanks(self) if gae else None
        strategy = cfg.actor.strategy
        log(f"learner group: {world} ranks ({strategy}, {'nccl' if gpus else 'gloo'})")

    def call(self, method: str, *args) -> list[Any]:
        """`method(*args)` on every rank (a large argument goes once: pass `put(value)`): →
        the ranks' results."""
        return self._get([getattr(r, method).remote(*args) for r in self.ranks])

    def put(self, value: Any) -> Any:
        return self._ray.put(value)

    def _get(self, refs):
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayActorError as err:
            raise LearnerGroupError(
                f"a learner rank died ({type(err).__name__}); the group cannot go on without "
                "it: rerun the same command to resume from the last checkpoint"
            ) from None

    def per_token(self, method: str, batch: TrainBatch, *args) -> torch.Tensor:
        """A [B, R] quantity (logprobs, values) computed by every rank for its token-balanced
        part of `batch`, put back in batch order."""
        rows = torch.arange(len(batch))
        parts = balanced_split(rows, batch.attention_mask.sum(-1), len(self.ranks))
        outs = self.call(method, self.put(batch), parts, *args)
        out = torch.zeros(batch.response_mask.shape)
        for part, values in zip(parts, outs, strict=True):
            out[part] = values
        return out

    def logprobs(self, batch: TrainBatch, reference: bool = False) -> torch.Tensor:
        """Response logprobs [B, R] under the policy (or the reference)."""
        return self.per_token("logprobs", batch, reference)

    def update(self, batch: TrainBatch, group_size: int, seed: int) -> ActorStats:
        """The update on every rank; then the new weights, gathered by rank 0, into `policy`."""
        ref = self._ray.put(batch)
        shares = [r.update.remote(ref, group_size, seed) for r in self.ranks]
        weights = [r.weights.remote() for r in self.ranks]
        stats = ActorStats.of(self._get(shares))
        load_trained_weights(self.policy, self._get(weights)[0])
        return stats

    def state_dict(self) -> dict[str, Any]:
        return self.call("state_dict")[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.call("load_state_dict", self.put(state))

    def shutdown(self) -> None:
        for rank in self.ranks:
            self._ray.kill(rank, no_restart=True)


class CriticOnRanks:
    """The critic on the learner ranks (next to the actor, with its strategy): stands where the
    in-process `Critic` stands in the trainer."""

    def __init__(self, group: LearnerGroup) -> None:
        self.group = group

    def values(self, batch: TrainBatch) -> torch.Tensor:
        return self.group.per_token("values", batch)

    def update(self, batch: TrainBatch, group_size: int, seed: int) -> CriticStats:
        group = self.group
        return CriticStats.of(group.call("critic_update", group.put(batch), group_size, seed))

    def state_dict(self) -> dict[str, Any]:
        return self.group.call("critic_state_dict")[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.group.call("critic_load_state_dict", self.group.put(state))
