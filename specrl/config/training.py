"""The sections of the update and its inputs: `actor` (optimizer, loss, LoRA, learner ranks),
`critic`, `algorithm`, `reward_model`, `custom_reward_function`, `env`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from specrl.config.section import Section


class OptimConfig(Section):
    lr: float = Field(
        7e-6,
        gt=0.0,
        description="AdamW learning rate (the default task keeps learning for 128 steps with it)",
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas")
    lr_warmup_steps: int = Field(5, ge=0, description="linear warmup steps, then constant")


class PolicyLossConfig(Section):
    loss_mode: Literal["vanilla", "gspo"] = Field(
        "vanilla",
        description="policy loss (algorithms/losses.py registry): vanilla (PPO clip, token "
        "ratios) or gspo (sequence-level ratios, arXiv 2507.18071)",
    )
    gspo_clip_ratio_low: float = Field(
        3e-4, ge=0.0, le=1.0, description="gspo: clip of the sequence ratio below 1"
    )
    gspo_clip_ratio_high: float = Field(
        4e-4, ge=0.0, description="gspo: clip of the sequence ratio above 1"
    )


class LoraConfig(Section):
    rank: int = Field(
        0,
        ge=0,
        description="LoRA rank r (verl: lora_rank); 0 trains every weight. r > 0 trains adapters "
        "only (peft), the KL reference is the base model with adapters disabled, weight syncs "
        "and checkpoints carry the adapters",
    )
    alpha: float = Field(16.0, gt=0.0, description="LoRA alpha (verl: lora_alpha): scale alpha / r")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="modules that get adapters: all-linear (every linear layer but the output "
        "head) or a list of module names (e.g. [q_proj, v_proj])",
    )


class ActorConfig(Section):
    ppo_mini_batch_size: int = Field(16, ge=1, description="prompts per optimizer step")
    ppo_micro_batch_size: int = Field(64, ge=1, description="sequences per forward/backward")
    ppo_epochs: int = Field(1, ge=1, description="passes over each step's rollouts")
    clip_ratio_low: float = Field(0.2, ge=0.0, le=1.0, description="PPO clip below 1")
    clip_ratio_high: float = Field(0.28, ge=0.0, description="PPO clip above 1 (DAPO clip-higher)")
    clip_ratio_c: float = Field(3.0, gt=1.0, description="dual-clip bound for negative advantages")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="how token losses are averaged"
    )
    use_kl_loss: bool = Field(False, description="add a KL loss to the frozen reference policy")
    kl_loss_coef: float = Field(0.001, ge=0.0, description="weight of the KL loss")
    kl_loss_type: Literal["k1", "k2", "low_var_kl"] = Field(
        "low_var_kl", description="KL estimator"
    )
    entropy_coeff: float = Field(0.0, ge=0.0, description="entropy bonus weight")
    grad_clip: float = Field(1.0, gt=0.0, description="max global gradient norm")
    optim: OptimConfig = Field(default_factory=OptimConfig)
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    num_workers: int = Field(
        1,
        ge=1,
        description="learner ranks on CPUs: 1 updates in the trainer's process; K > 1 runs the "
        "update data-parallel on K Ray actors in a gloo group (needs specrl[ray]); on GPUs "
        "trainer.nnodes x trainer.n_gpus_per_node decides instead",
    )
    num_cpus_per_worker: int = Field(
        1, ge=1, description="Ray CPUs (and torch threads) of each learner rank"
    )
    strategy: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="with K > 1 learner ranks: ddp (a replica per rank, gradients all-reduced) "
        "or fsdp2 (parameters, gradients and optimizer state sharded across ranks)",
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass: less memory, more time"
    )
    autocast: Literal["none", "bfloat16"] = Field(
        "none",
        description="bfloat16 autocast of the actor's and critic's forward passes (for GPUs)",
    )
    lora: LoraConfig = Field(
        default_factory=LoraConfig, description="LoRA adapters for the policy (rank 0: off)"
    )


class CriticModelConfig(Section):
    path: str | None = Field(
        None,
        description="local Hugging Face model directory for the value model; None: the "
        "policy's initial weights with a fresh scalar head",
    )


class CriticOptimConfig(OptimConfig):
    lr: float = Field(1e-5, gt=0.0, description="AdamW learning rate of the value model")


class CriticConfig(Section):
    model: CriticModelConfig = Field(default_factory=CriticModelConfig)
    optim: CriticOptimConfig = Field(
        default_factory=CriticOptimConfig, description="AdamW of the value model"
    )
    cliprange_value: float = Field(
        0.5, gt=0.0, description="how far a value prediction may move from the one GAE used"
    )
    ppo_epochs: int = Field(1, ge=1, description="passes over each step's rollouts")
    ppo_mini_batch_size: int | None = Field(
        None,
        ge=1,
        description="prompts per optimizer step; None: actor.ppo_mini_batch_size (as verl)",
    )
    ppo_micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="sequences per forward/backward; None: actor.ppo_micro_batch_size",
    )
    grad_clip: float = Field(1.0, gt=0.0, description="max global gradient norm")
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="LoRA adapters for the value model's body (rank 0: off); its value head is "
        "trained fully",
    )


class FilterGroupsConfig(Section):
    enable: bool = Field(False, description="DAPO dynamic sampling: drop groups with equal scores")
    metric: Literal["acc", "score"] = Field(
        "acc",
        description="what must differ within a group: acc, the accuracy the reward states (its "
        "score where it states none); score, the score trained on, after the overlong penalty "
        "(DAPO filters on acc)",
    )
    max_num_gen_batches: int = Field(
        4, ge=1, description="most rollout batches per step while refilling dropped groups"
    )


class RolloutCorrectionConfig(Section):
    rollout_is: Literal["auto", "token", "sequence"] | None = Field(
        "auto",
        description="truncated importance sampling of the trainer's policy over what tokens were "
        "sampled with: the engine's logprobs, or the lenient specrl rule's own probabilities; "
        "auto: sequence when the rollouts carry behaviour logprobs of their own (the lenient "
        "specrl rule sampled them), else off (null)",
    )
    rollout_is_threshold: float = Field(
        2.0, gt=0.0, description="upper bound of the rollout importance weights"
    )

    def level(self, off_policy: bool) -> Literal["token", "sequence"] | None:
        """The weighting in effect for rollouts that carry behaviour logprobs of their own
        (`off_policy`: the lenient rule sampled them) or not: `auto` weighs whole sequences of
        the former and nothing otherwise."""
        if self.rollout_is != "auto":
            return self.rollout_is
        return "sequence" if off_policy else None


# the estimators whose baseline is the prompt's group: a group of one (rollout.n=1) learns nothing
GROUP_BASELINES = frozenset({"grpo", "rloo", "reinforce_plus_plus_baseline"})


class AlgorithmConfig(Section):
    adv_estimator: Literal[
        "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"
    ] = Field(
        "grpo",
        description="advantage estimator (algorithms/advantages.py registry): grpo, rloo, "
        "reinforce_plus_plus (discounted returns whitened over the batch), "
        "reinforce_plus_plus_baseline (group-mean baseline, then whitened), gae (PPO with a "
        "critic, see the critic section)",
    )
    gamma: float = Field(
        1.0, ge=0.0, le=1.0, description="discount over response tokens (reinforce_plus_plus, gae)"
    )
    lam: float = Field(1.0, ge=0.0, le=1.0, description="GAE's lambda")
    norm_adv_by_std_in_grpo: bool = Field(
        True, description="divide by the group's std; false gives Dr.GRPO"
    )
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)


class OverlongBufferConfig(Section):
    enable: bool = Field(False, description="DAPO soft overlong penalty")
    len: int = Field(16, ge=1, description="penalty ramps over the last `len` tokens of R")
    penalty_factor: float = Field(1.0, ge=0.0, description="penalty at the full length")


class RewardModelConfig(Section):
    overlong_buffer: OverlongBufferConfig = Field(default_factory=OverlongBufferConfig)
    timeout_s: float = Field(10.0, gt=0.0, description="per-response reward function timeout")
    max_error_ratio: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="stop the run when the reward function fails on more than this fraction of a "
        "step's responses (1.0: never; failed calls score 0)",
    )


class CustomRewardConfig(Section):
    path: str | None = Field(None, description="python file holding the reward function")
    name: str = Field("compute_score", description="function name in that file")
    weight: float = Field(
        1.0, description="its weight when several functions are given (TRL's reward_weights)"
    )


class EnvConfig(Section):
    path: str | None = Field(
        None,
        description="python file holding your environment class: rollouts become episodes "
        "(episodes/env.py); None: the built-in task's (data.task=calculator), else single turns",
    )
    name: str = Field("Environment", description="the environment class in that file")
    timeout_s: float = Field(10.0, gt=0.0, description="per call of reset or step")
    max_error_ratio: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="stop the run when the environment fails in more than this fraction of a "
        "step's episodes (1.0: never; a failed episode scores 0)",
    )
