"""A run assembled from its config: everything the training loop (trainer.py) works with.

`build_run` goes in the order that lets bad input stop before anything expensive: the process's
seed and device (a GPU asked for and missing stops here), the run directory, the checkpoint to
resume from and its config, the data, reward functions and environment (read without a model), the
base model's identity; then the actor (in this process or on learner ranks), the critic, the
tokenized prompts, the rollout engine and speculative stage (or the Ray rollout workers that hold
both), episodes around the stage; last the checkpoint's state and the first weight sync.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from specrl.actor.critic import Critic, load_critic
from specrl.actor.policy import load_actor
from specrl.actor.update import Actor
from specrl.backends import InProcessRollouts, RolloutBackend
from specrl.checkpoint import (
    check_resumed_config,
    load_trainer_state,
    resolve_resume,
    restore,
    save_checkpoint,
)
from specrl.config import Config
from specrl.data import PromptLoader, format_prompts, read_splits, tokenize_splits
from specrl.distributed.learner import CriticOnRanks, LearnerGroup
from specrl.distributed.rollout import RolloutWorkers
from specrl.engines import SamplingParams
from specrl.engines.build import (
    build_engine,
    engine_kind,
    largest_call,
    logprobs_are_the_trainers,
)
from specrl.episodes.env import load_environment
from specrl.episodes.runner import EpisodeLoop
from specrl.errors import UserError
from specrl.evaluation import evaluate
from specrl.lora import base_identity, check_base, rollout_weights, state_bytes
from specrl.metrics import SignalWatch
from specrl.models import eos_token_ids, load_tokenizer, resolve_model_path
from specrl.rewards import RewardFunctions, load_reward_functions
from specrl.run_dir import RunLock, open_run_dir
from specrl.speculative.stage import SpeculativeStage
from specrl.threads import run_threads
from specrl.toy_policy import ToyPolicySpec, ensure_toy_policy
from specrl.tracking import GENERATIONS, Tracker
from specrl.types import Prompt


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass(eq=False)
class Run:
    """The parts of a run and where it stands; the trainer's loop (trainer.py) works with them.
    `rollouts` is the one rollout handle: the in-process backend (in multi-turn runs, episodes
    whose turns its stage rolls out) or Ray workers."""

    cfg: Config
    run_dir: Path
    tracker: Tracker
    lock: RunLock
    resume_from: Path | None
    threads_note: str | None
    reward_fn: RewardFunctions
    model_dir: Path
    base_model: dict[str, str] | None  # with LoRA: the base's path and hash
    actor: Actor | LearnerGroup
    tokenizer: PreTrainedTokenizerBase
    critic: Critic | CriticOnRanks | None  # with algorithm.adv_estimator=gae
    loader: PromptLoader
    val_prompts: list[Prompt]
    rollouts: RolloutBackend  # training rollouts (episodes in multi-turn runs) and evaluation
    rollout_logprobs_are_old_logprobs: bool
    signal: SignalWatch  # says once when steps in a row give nothing to learn from
    total_steps: int
    global_step: int = 0

    def checkpointed(self) -> dict[str, Any]:
        """The parts whose state a checkpoint holds, by name."""
        parts = {"actor": self.actor, "loader": self.loader, "stage": self.rollouts}
        return parts if self.critic is None else {**parts, "critic": self.critic}

    def save(self) -> str:
        """A checkpoint of the run where it stands: → its directory."""
        path = save_checkpoint(
            self.run_dir,
            self.global_step,
            self.actor.policy,
            self.tokenizer,
            self.checkpointed(),
            self.cfg.trainer.max_ckpt_to_keep,
            self.base_model,
        )
        return str(path)

    def validate(self) -> dict[str, float]:
        """Held-out metrics of the current policy (`val/*`); the first held-out prompts with
        what the policy wrote go to the console and val_generations.jsonl."""
        evaluation = evaluate(
            self.rollouts,
            self.val_prompts,
            self.reward_fn,
            self.tokenizer,
            self.cfg.data.val_batch_size,
            self.cfg.data.max_response_length,
            self.global_step,
            self.rollouts.episodes,
            self.cfg.trainer.log_val_generations,
        )
        self.tracker.log_generations(self.global_step, evaluation.generations)
        return evaluation.metrics

    def sync_weights(self) -> int:
        """The policy's weights to the engine, for the rollouts of the next step: → the bytes
        that travel (in-process hf: 0, the model is shared; with LoRA the adapters, or for vLLM
        the merged weights)."""
        kind = engine_kind(self.cfg.rollout.name)
        weights = rollout_weights(self.actor.policy, kind.lora_adapters)
        self.rollouts.load_weights(weights, self.global_step + 1)
        shared = kind.shares_policy and not self.cfg.rollout.num_workers
        return 0 if shared else state_bytes(weights)


def trainer_device(cfg: Config) -> torch.device:
    """Where the trainer's process runs its models: its GPU when the run asks for GPUs and has
    one learner rank (`trainer.n_gpus_per_node=1`: the actor, the critic and the in-process
    engine, which follows the policy), else the CPU (several ranks place themselves). Checked
    before any model loads."""
    if not cfg.trainer.n_gpus_per_node or cfg.learner_ranks > 1:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(
            f"trainer.n_gpus_per_node={cfg.trainer.n_gpus_per_node} trains on a GPU, and torch "
            f"{torch.__version__} sees none; set trainer.n_gpus_per_node=0 to train on CPUs"
        )
    return torch.device("cuda")


def build_run(cfg: Config, tracker: Tracker | None = None) -> Run:
    """The `Run` that `cfg` describes (resumed from its checkpoint when there is one), built in
    the order of the module's docstring."""
    seed_everything(cfg.trainer.seed)
    device = trainer_device(cfg)
    run_dir = cfg.trainer.run_dir
    tracker = tracker or Tracker(
        cfg.trainer.logger,
        run_dir,
        project=cfg.trainer.project_name,
        experiment=cfg.trainer.experiment_name,
    )
    log = tracker.print
    lock = open_run_dir(run_dir, cfg.trainer.resume_mode == "disable", log)
    resume_from = resolve_resume(cfg.trainer.resume_mode, run_dir)
    state = load_trainer_state(resume_from) if resume_from else None
    if state is not None:  # before any model is loaded
        check_resumed_config(
            run_dir, cfg.model_dump(mode="json"), state["global_step"], tracker.warn
        )
    threads, threads_note = run_threads(
        cfg.trainer.num_threads, state and state.get("torch_threads")
    )
    torch.set_num_threads(threads)
    # what needs no model first: a bad file, function or environment stops before any load
    splits = read_splits(cfg.data, cfg.trainer.seed)
    reward_fn = load_reward_functions(cfg.custom_reward_function, cfg.reward_model.timeout_s)
    env = load_environment(cfg.env.path, cfg.env.name, cfg.env.timeout_s) if cfg.episodes else None
    initial = (
        resolve_model_path(cfg.model.path, log)
        if cfg.model.path
        else ensure_toy_policy(ToyPolicySpec(task=cfg.data.task), log=log)
    )
    # the prompts as the model will see them, against its tokenizer alone: still no model loaded
    template = load_tokenizer(initial).chat_template
    splits, format_note = format_prompts(splits, template, cfg.data.apply_chat_template)
    if format_note:
        log(format_note)
    lora = cfg.actor.lora.rank > 0
    base_model = base_identity(initial) if lora else None
    if lora and resume_from:  # the adapters fit only the base they were trained on
        check_base(resume_from, base_model)
    model_dir = resume_from or initial
    engine_dir = initial if lora else model_dir  # engines load the base; adapters follow
    if cfg.learner_ranks > 1:  # the update on a torch.distributed group of Ray actors
        actor = LearnerGroup(cfg, model_dir, initial, log)
        tokenizer = actor.tokenizer
    else:
        actor, tokenizer = load_actor(cfg, model_dir, initial, log, device=device)
    critic = None
    if cfg.algorithm.adv_estimator == "gae":  # on the learner ranks next to the actor, or here
        on_ranks = isinstance(actor, LearnerGroup)
        critic = actor.critic if on_ranks else load_critic(cfg, initial, device=device)
    eos_ids = eos_token_ids(actor.policy, tokenizer)
    train, val_prompts = tokenize_splits(splits, tokenizer, cfg.data, log)
    loader = PromptLoader(train, cfg.data.train_batch_size, cfg.data.shuffle, cfg.trainer.seed)
    sampling = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k)
    pad_id = tokenizer.pad_token_id
    episodes = None
    if env is not None:  # each rollout an episode, its turns rolled out by the in-process stage
        episodes = EpisodeLoop(
            env,
            tokenizer,
            cfg.rollout.multi_turn.max_turns,
            cfg.data.max_response_length,
            cfg.env.max_error_ratio,
            tracker.warn,
        )
    rollouts: RolloutBackend
    if cfg.rollout.num_workers:
        rollouts = RolloutWorkers(cfg, engine_dir, eos_ids, pad_id, sampling, log)
    else:
        largest = largest_call(cfg, train, val_prompts)
        engine = build_engine(cfg, actor.policy, eos_ids, pad_id, engine_dir, largest, log)
        R = cfg.data.max_response_length
        stage = SpeculativeStage(engine, sampling, R, cfg.rollout.spec)
        rollouts = InProcessRollouts(engine, stage, episodes)
    steps = cfg.trainer.total_epochs * loader.steps_per_epoch
    run = Run(
        cfg=cfg,
        run_dir=run_dir,
        tracker=tracker,
        lock=lock,
        resume_from=resume_from,
        threads_note=threads_note,
        reward_fn=reward_fn,
        model_dir=model_dir,
        base_model=base_model,
        actor=actor,
        tokenizer=tokenizer,
        critic=critic,
        loader=loader,
        val_prompts=val_prompts,
        rollouts=rollouts,
        rollout_logprobs_are_old_logprobs=logprobs_are_the_trainers(cfg, sampling),
        signal=SignalWatch(cfg.rollout.n, run_dir / GENERATIONS),
        total_steps=min(steps, cfg.trainer.total_training_steps or steps),
    )
    if state is not None:
        run.global_step = restore(resume_from, state, run.checkpointed())
    if cfg.rollout.num_workers:  # the workers' engines loaded the initial weights
        run.sync_weights()
    return run
