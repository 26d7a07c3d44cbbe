"""`Config`, the whole run configuration: its sections, and the checks across them (every invalid
combination of keys fails at load with one line)."""

from __future__ import annotations

from pydantic import Field, model_validator

from specrl.config.rollout import RolloutConfig
from specrl.config.run import DataConfig, ModelConfig, RayKwargsConfig, TrainerConfig
from specrl.config.section import Section
from specrl.config.training import (
    GROUP_BASELINES,
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    CustomRewardConfig,
    EnvConfig,
    RewardModelConfig,
)


class Config(Section):
    data: DataConfig = Field(
        default_factory=DataConfig, description="prompts: built-in task or files, lengths, batch"
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy to train")
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig,
        description="engine, sampling, slots per prompt, speculative rollouts (rollout.spec)",
    )
    actor: ActorConfig = Field(
        default_factory=ActorConfig, description="PPO update: batches, clipping, KL, optimizer"
    )
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig,
        description="advantage estimator, DAPO group filter, rollout correction",
    )
    critic: CriticConfig = Field(
        default_factory=CriticConfig,
        description="the value model of algorithm.adv_estimator=gae: model, optimizer, clipping",
    )
    reward_model: RewardModelConfig = Field(
        default_factory=RewardModelConfig,
        description="reward timeouts and failures, DAPO overlong penalty",
    )
    custom_reward_function: CustomRewardConfig | list[CustomRewardConfig] = Field(
        default_factory=CustomRewardConfig,
        description="your verl- or TRL-style reward function, or a list of them (path, name, "
        "weight): the score is their weighted sum",
    )
    env: EnvConfig = Field(
        default_factory=EnvConfig,
        description="multi-turn episodes: your environment class, its timeouts and failures",
    )
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig,
        description="run length, evaluation, checkpoints, resume, loggers, output directory",
    )
    ray_kwargs: RayKwargsConfig = Field(
        default_factory=RayKwargsConfig,
        description="Ray (rollout.num_workers > 0 or several learner ranks): the cluster to join "
        "or the local one's size",
    )

    @property
    def learner_ranks(self) -> int:
        """Ranks of the learner group: one per GPU (trainer.nnodes x n_gpus_per_node), else
        actor.num_workers (on CPUs)."""
        if self.trainer.n_gpus_per_node:
            return self.trainer.nnodes * self.trainer.n_gpus_per_node
        return self.actor.num_workers

    @property
    def episodes(self) -> bool:
        """Rollouts are multi-turn episodes: an environment is given, or the built-in task is."""
        builtin = self.data.train_files is None and self.data.task == "calculator"
        return self.env.path is not None or builtin

    @model_validator(mode="after")
    def _resolve_verify_mode(self) -> Config:
        spec = self.rollout.spec
        if spec.verify_mode == "auto":
            on_vllm = self.rollout.name == "vllm" and spec.acceptance == "exact"
            slot_drafts = spec.tree.method == "specrl" and spec.reuse != "trie"
            spec.verify_mode = "decoding" if on_vllm and slot_drafts else "full"
        if spec.reuse == "auto":  # both built-in engines verify tries
            spec.reuse = "trie" if spec.walks_tries(trie_verification=True) else "slot"
        return self

    @model_validator(mode="after")
    def _critic_batches_follow_the_actor(self) -> Config:
        """The critic's mini- and micro-batches are the actor's unless set (verl interpolates
        critic.ppo_mini_batch_size from the actor's)."""
        critic, actor = self.critic, self.actor
        if critic.ppo_mini_batch_size is None:
            critic.ppo_mini_batch_size = actor.ppo_mini_batch_size
        if critic.ppo_micro_batch_size is None:
            critic.ppo_micro_batch_size = actor.ppo_micro_batch_size
        return self

    @model_validator(mode="after")
    def _check_batch_sizes(self) -> Config:
        gae = self.algorithm.adv_estimator == "gae"
        if gae and self.critic.ppo_mini_batch_size > self.data.train_batch_size:
            raise ValueError(
                f"critic.ppo_mini_batch_size ({self.critic.ppo_mini_batch_size}) must not exceed "
                f"data.train_batch_size ({self.data.train_batch_size})"
            )
        if self.actor.ppo_mini_batch_size > self.data.train_batch_size:
            raise ValueError(
                f"actor.ppo_mini_batch_size ({self.actor.ppo_mini_batch_size}) must not exceed "
                f"data.train_batch_size ({self.data.train_batch_size})"
            )
        return self

    @model_validator(mode="after")
    def _check_groups(self) -> Config:
        if self.rollout.n < 2 and self.algorithm.adv_estimator in GROUP_BASELINES:
            raise ValueError(
                f"rollout.n=1 with algorithm.adv_estimator={self.algorithm.adv_estimator} gives "
                "every rollout an advantage of 0 (a group of one has no baseline to beat): "
                "nothing would be learned; set rollout.n >= 2, or use gae or reinforce_plus_plus"
            )
        if self.rollout.n < 2 and self.algorithm.filter_groups.enable:
            raise ValueError(
                "algorithm.filter_groups drops groups whose scores are all equal, and a group "
                "of one always is: set rollout.n >= 2"
            )
        return self

    @model_validator(mode="after")
    def _check_engine(self) -> Config:
        if self.rollout.enable_sleep_mode and self.rollout.name != "vllm":
            raise ValueError("rollout.enable_sleep_mode needs rollout.name=vllm")
        if self.rollout.static_decode and self.rollout.name != "hf":
            raise ValueError(
                "rollout.static_decode is the hf engine's; vllm captures its own CUDA graphs "
                "(rollout.enforce_eager=false)"
            )
        if self.rollout.verify_batching == "slack" and self.rollout.name != "hf":
            raise ValueError(
                "rollout.verify_batching is the hf engine's; vllm schedules its own forwards"
            )
        if self.rollout.block_size and self.rollout.name != "vllm":
            raise ValueError(
                "rollout.block_size is vllm's prefix-cache block; the hf engine keeps no blocks"
            )
        if self.rollout.run_ahead and not (
            self.rollout.num_workers and self.rollout.spec.uses_tree()
        ):
            raise ValueError(
                "rollout.run_ahead seeds token trees on rollout workers: it needs "
                "rollout.num_workers >= 1 and token-tree drafts (rollout.spec.tree.enabled "
                "auto with speculation on, or true)"
            )
        backend = self.rollout.checkpoint_engine.backend
        gpu_workers = self.rollout.name == "vllm" and self.rollout.num_gpus_per_worker > 0
        if backend == "nccl" and not (gpu_workers and self.learner_ranks == 1):
            raise ValueError(
                "rollout.checkpoint_engine.backend=nccl needs vLLM rollout workers on GPUs "
                "(rollout.name=vllm, rollout.num_gpus_per_worker >= 1) and the policy on a GPU in "
                "the trainer's process (one learner rank); use object_store (or auto) here"
            )
        return self

    @model_validator(mode="after")
    def _check_speculation(self) -> Config:
        spec = self.rollout.spec
        if spec.verify_mode == "decoding" and spec.acceptance != "exact":
            raise ValueError(
                "rollout.spec.verify_mode=decoding verifies drafts inside decoding, with the "
                "exact rule: set rollout.spec.acceptance=exact (the specrl rule needs the scoring "
                "pass of full or chunked verification)"
            )
        if spec.reuse == "trie" and spec.acceptance != "exact":
            raise ValueError(
                "rollout.spec.reuse=trie samples every token as vanilla decoding would (the "
                "exact rule): set rollout.spec.acceptance=exact, or reuse=slot for SPEC-RL's "
                "lenient rule"
            )
        if spec.reuse == "trie" and spec.verify_mode == "decoding":
            raise ValueError(
                "rollout.spec.verify_mode=decoding verifies each slot's stored draft inside "
                "decoding: set rollout.spec.reuse=slot with it (reuse=trie verifies the whole trie "
                "in one pass)"
            )
        if spec.tree.method == "suffix" and self.rollout.name != "vllm":
            raise ValueError(
                "rollout.spec.tree.method=suffix is vLLM's built-in suffix decoding: set "
                "rollout.name=vllm (tree.method=specrl drafts from specrl's trees on any engine)"
            )
        if spec.tree.method == "suffix" and spec.verify_mode == "decoding":
            raise ValueError(
                "rollout.spec.verify_mode=decoding hands the stored drafts to specrl's proposer, "
                "which rollout.spec.tree.method=suffix replaces with vLLM's: set "
                "rollout.spec.verify_mode=full, or tree.method=specrl"
            )
        return self

    @model_validator(mode="after")
    def _check_placement(self) -> Config:
        if self.trainer.n_gpus_per_node and self.actor.num_workers > 1:
            raise ValueError(
                "set either actor.num_workers (learner ranks on CPUs) or trainer.nnodes x "
                "trainer.n_gpus_per_node (one learner rank per GPU), not both"
            )
        if self.episodes and self.rollout.num_workers:
            raise ValueError(
                "multi-turn episodes (env.path or data.task=calculator) run in the trainer's "
                "process: set rollout.num_workers=0 (learner ranks, actor.num_workers, work)"
            )
        if self.trainer.nnodes > 1 and not self.trainer.n_gpus_per_node:
            raise ValueError(
                "trainer.nnodes counts GPU nodes: set trainer.n_gpus_per_node too (on CPUs, "
                "actor.num_workers sets the learner ranks)"
            )
        rewards = self.custom_reward_function
        rewards = rewards if isinstance(rewards, list) else [rewards]
        if self.episodes and any(r.path is not None for r in rewards):
            raise ValueError(
                "an episode's score is its environment's rewards: unset custom_reward_function "
                "with env.path or data.task=calculator (score inside the environment's step)"
            )
        return self
