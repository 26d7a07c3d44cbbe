"""The training loop, top to bottom as in docs/design.md: rollout → rewards → advantages → update →
sync → log. Everything speculative happens inside the rollout stage; the policy and its update
live in actor/."""

from __future__ import annotations

import gc
import random
import time

import numpy as np
import torch

from specrl.actor.batch import TrainBatch
from specrl.actor.critic import load_critic
from specrl.actor.policy import load_actor
from specrl.actor.update import Actor
from specrl.algorithms.advantages import AdvantageInputs, compute_advantages
from specrl.algorithms.dapo import groups_with_signal
from specrl.algorithms.rollout_correction import correction_weights
from specrl.checkpoint import (
    check_resumed_config,
    load_trainer_state,
    resolve_resume,
    restore,
    save_checkpoint,
)
from specrl.config import Config, save_config
from specrl.data import PromptLoader, read_splits, tokenize_splits
from specrl.distributed.learner import LearnerGroup
from specrl.distributed.rollout import RolloutWorkers
from specrl.engines import SamplingParams
from specrl.engines.build import build_engine, logprobs_are_the_trainers
from specrl.episodes.env import load_environment
from specrl.episodes.runner import EpisodeLoop, EpisodeStage
from specrl.errors import UserError
from specrl.evaluation import evaluate
from specrl.lora import base_identity, check_base, rollout_weights, state_bytes
from specrl.metrics import data_metrics, logprob_mismatch, timed, value_metrics
from specrl.models import eos_token_ids, resolve_model_path
from specrl.rewards import RewardFunctionError, Scores, load_reward_functions, score_rollouts
from specrl.run_dir import RunInterrupted, StopSignals, open_run_dir
from specrl.speculative.stage import SpeculativeStage
from specrl.threads import run_threads
from specrl.toy_policy import ToyPolicySpec, ensure_toy_policy
from specrl.tracking import Tracker
from specrl.types import Rollout


class TrainingDivergedError(UserError):
    """Training cannot continue: repeated non-finite losses or gradients."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: Config, tracker: Tracker | None = None) -> None:
        self.cfg = cfg
        self.run_dir = cfg.trainer.run_dir
        self.tracker = tracker or Tracker(
            cfg.trainer.logger,
            self.run_dir,
            project=cfg.trainer.project_name,
            experiment=cfg.trainer.experiment_name,
        )
        seed_everything(cfg.trainer.seed)
        log = self.tracker.print
        starting_over = cfg.trainer.resume_mode == "disable"
        self.lock = open_run_dir(self.run_dir, starting_over, log)
        self.resume_from = resolve_resume(cfg.trainer.resume_mode, self.run_dir)
        state = load_trainer_state(self.resume_from) if self.resume_from else None
        threads, self.threads_note = run_threads(
            cfg.trainer.num_threads, state and state.get("torch_threads")
        )
        torch.set_num_threads(threads)
        if state is not None:  # before any model is loaded
            config = cfg.model_dump(mode="json")
            check_resumed_config(self.run_dir, config, state["global_step"], self.tracker.warn)
        # what needs no model first: a bad file, function or environment stops before any load
        splits = read_splits(cfg.data, cfg.trainer.seed)
        self.reward_fn = load_reward_functions(
            cfg.custom_reward_function, cfg.reward_model.timeout_s
        )
        env = (
            load_environment(cfg.env.path, cfg.env.name, cfg.env.timeout_s)
            if cfg.episodes
            else None
        )
        initial = (
            resolve_model_path(cfg.model.path, log)
            if cfg.model.path
            else ensure_toy_policy(ToyPolicySpec(task=cfg.data.task), log=log)
        )
        lora = cfg.actor.lora.rank > 0
        self.base_model = base_identity(initial) if lora else None
        if lora and self.resume_from:  # the adapters fit only the base they were trained on
            check_base(self.resume_from, self.base_model)
        self.model_dir = model_dir = self.resume_from or initial
        engine_dir = initial if lora else model_dir  # engines load the base; adapters follow
        self.actor: Actor | LearnerGroup
        if cfg.learner_ranks > 1:  # the update on a torch.distributed group of Ray actors
            self.actor = LearnerGroup(cfg, model_dir, initial, log)
            self.tokenizer = self.actor.tokenizer
        else:
            self.actor, self.tokenizer = load_actor(cfg, model_dir, initial, log)
        gae = cfg.algorithm.adv_estimator == "gae"
        self.critic = None
        if gae:  # on the learner ranks next to the actor, or in this process
            grouped = isinstance(self.actor, LearnerGroup)
            self.critic = self.actor.critic if grouped else load_critic(cfg, initial)
        policy = self.actor.policy
        eos_ids = eos_token_ids(policy, self.tokenizer)
        train, self.val_prompts = tokenize_splits(splits, self.tokenizer, cfg.data, log)
        self.loader = PromptLoader(
            train, cfg.data.train_batch_size, cfg.data.shuffle, cfg.trainer.seed
        )
        sampling = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k)
        pad_id = self.tokenizer.pad_token_id
        self.workers: RolloutWorkers | None = None
        self.episodes: EpisodeLoop | None = None
        if cfg.rollout.num_workers:  # the workers are both the engine and the stage
            self.workers = RolloutWorkers(cfg, engine_dir, eos_ids, pad_id, sampling, log)
            self.engine, self.stage = self.workers, self.workers
        else:
            self.engine = build_engine(cfg, policy, eos_ids, pad_id, engine_dir)
            self.stage = SpeculativeStage(
                self.engine, sampling, cfg.data.max_response_length, cfg.rollout.spec
            )
        if env is not None:  # each rollout an episode, its turns rolled out by the stage
            self.episodes = EpisodeLoop(
                env,
                self.tokenizer,
                cfg.rollout.multi_turn.max_turns,
                cfg.data.max_response_length,
                cfg.env.max_error_ratio,
                self.tracker.warn,
            )
            self.stage = EpisodeStage(self.stage, self.episodes)
        self.rollout_logprobs_are_old_logprobs = logprobs_are_the_trainers(cfg, sampling)
        self.global_step = 0
        self.bad_steps = 0  # consecutive steps with skipped (non-finite) updates
        steps = cfg.trainer.total_epochs * self.loader.steps_per_epoch
        self.total_steps = min(steps, cfg.trainer.total_training_steps or steps)
        if state is not None:
            self.global_step = restore(self.resume_from, state, self._checkpointed())
        if self.workers is not None:
            self.sync_weights()

    def _checkpointed(self) -> dict:
        parts = {"actor": self.actor, "loader": self.loader, "stage": self.stage}
        return parts if self.critic is None else {**parts, "critic": self.critic}

    def save(self) -> str:
        path = save_checkpoint(
            self.run_dir,
            self.global_step,
            self.actor.policy,
            self.tokenizer,
            self._checkpointed(),
            self.cfg.trainer.max_ckpt_to_keep,
            self.base_model,
        )
        return str(path)

    # ---------------------------------------------------------------- loop
    def fit(self) -> dict[str, float]:
        save_config(self.cfg, self.run_dir / "config.yaml")
        if self.threads_note:  # after every check of the input: bad input gets one line
            self.tracker.print(self.threads_note)
        if self.resume_from is not None:
            self.tracker.print(
                f"resuming from {self.resume_from} at step {self.global_step} "
                "(trainer.resume_mode=disable starts over)"
            )
            self.tracker.start(keep_through_step=self.global_step, config=self.cfg.model_dump())
        else:
            self.tracker.start(config=self.cfg.model_dump())
            if self.cfg.trainer.val_before_train:
                self.tracker.log({"training/global_step": 0, **self.validate()})
        # Everything alive now (model, data, library objects: ~400k) lives through the run; frozen,
        # the garbage collector stops scanning it (as vLLM does after start-up): a full collection
        # took ~0.1 s here, several times per epoch.
        gc.collect()
        gc.freeze()
        try:
            with (
                self.tracker.progress(self.total_steps, self.global_step) as advance,
                StopSignals() as stop,
            ):
                while self.global_step < self.total_steps:
                    self.global_step += 1
                    metrics = self.train_step()
                    self._check_finite(metrics)
                    if self.cfg.trainer.test_freq > 0 and self._due(self.cfg.trainer.test_freq):
                        metrics.update(self.validate())
                    if self._due(self.cfg.trainer.save_freq) or stop.received:
                        path = self.save()
                    self.tracker.log(metrics)
                    advance(metrics)
                    if stop.received:
                        raise RunInterrupted(
                            f"interrupted at step {self.global_step}; saved {path}; rerun the "
                            "same command to resume",
                            stop.received,
                        )
        finally:
            gc.unfreeze()
            if self.workers is not None:
                self.workers.shutdown()
            if isinstance(self.actor, LearnerGroup):
                self.actor.shutdown()
            self.tracker.close()
            self.lock.release()
        return self.tracker.summary(self.run_dir)

    def _check_finite(self, metrics: dict[str, float]) -> None:
        """Skipped updates are reported every step; trainer.max_bad_steps in a row stop the run
        after saving a checkpoint (of the last good weights: bad updates are never applied)."""
        skipped = metrics["actor/skipped_updates"]
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        if skipped:
            self.tracker.warn(
                f"step {self.global_step}: {skipped} updates skipped (non-finite loss or gradient)"
            )
        if self.bad_steps >= self.cfg.trainer.max_bad_steps:
            self.tracker.log(metrics)
            path = self.save()
            raise TrainingDivergedError(
                f"{self.bad_steps} steps in a row had non-finite losses or gradients; stopped after "
                f"saving {path}. Lower actor.optim.lr or actor.grad_clip, or check the reward scale"
            )

    def _due(self, freq: int) -> bool:
        return self.global_step == self.total_steps or (freq > 0 and self.global_step % freq == 0)

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        metrics: dict[str, float] = {"training/global_step": self.global_step}
        step_start = time.perf_counter()
        rollouts, scores = self.collect_rollouts(metrics)
        if cfg.rollout.run_ahead:  # workers seed the next batch's trees during the update
            next_key = (cfg.trainer.seed, self.global_step + 1, "run-ahead")
            self.workers.run_ahead(self.loader.peek(), next_key, self.global_step)
        batch = self.train_batch(rollouts, scores, metrics)
        if cfg.rollout.enable_sleep_mode:  # the trainer gets the GPU memory during the update
            self.engine.sleep()
        with timed(metrics, "update_actor"):
            seed = cfg.trainer.seed * 1_000_003 + self.global_step
            metrics.update(self.actor.update(batch, cfg.rollout.n, seed).metrics())
        if self.critic is not None:
            with timed(metrics, "update_critic"):
                metrics.update(self.critic.update(batch, cfg.rollout.n, seed).metrics())
        if cfg.rollout.enable_sleep_mode:
            self.engine.wake_up()
        with timed(metrics, "sync"):
            metrics["sync/weight_bytes"] = self.sync_weights()
        metrics["timing_s/step"] = time.perf_counter() - step_start
        step_scores = torch.tensor(scores.scores)
        metrics.update(
            data_metrics(
                rollouts,
                step_scores,
                batch.advantages,
                batch.response_mask,
                metrics["timing_s/step"],
            )
        )
        metrics["training/epoch"] = self.loader.epoch
        return metrics

    def sync_weights(self) -> int:
        """The policy's weights to the engine, for the rollouts of the next step: → the bytes
        that travel (in-process hf: 0, the model is shared; with LoRA the adapters, or for vLLM
        the merged weights)."""
        weights = rollout_weights(self.actor.policy, self.cfg.rollout.name)
        if self.workers is None:
            self.engine.load_weights(weights)
            if self.cfg.rollout.name == "hf":
                return 0
        else:
            self.workers.load_weights(weights, self.global_step + 1)
        return state_bytes(weights)

    # ---------------------------------------------------------------- rollout + rewards
    def collect_rollouts(self, metrics: dict[str, float]) -> tuple[list[Rollout], Scores]:
        """Rollouts and their scores for data.train_batch_size prompts. With DAPO dynamic
        sampling, groups whose `filter_groups.metric` is the same for every slot are dropped and
        more prompts are rolled out, up to algorithm.filter_groups.max_num_gen_batches batches."""
        cfg = self.cfg
        n, want = cfg.rollout.n, cfg.data.train_batch_size
        filtering = cfg.algorithm.filter_groups
        kept: list[Rollout] = []
        kept_scores = Scores([], [], [], [])
        stats = None  # RolloutStats, or EpisodeStats in multi-turn runs: they add up
        for gen_batch in range(filtering.max_num_gen_batches if filtering.enable else 1):
            seed_key = (cfg.trainer.seed, self.global_step, gen_batch)
            rollouts, batch_stats = self.stage(
                self.loader.next_batch(), n, seed_key, self.global_step
            )
            stats = batch_stats if stats is None else stats + batch_stats
            with timed(metrics, "reward"):
                scores = self.score(rollouts)
            signal = scores.scores
            if filtering.metric == "acc":
                signal = scores.stated_acc or scores.reward
            keep = groups_with_signal(torch.tensor(signal).view(-1, n))  # [G]
            if not filtering.enable:
                keep = torch.ones_like(keep)
            rows = [g * n + s for g in keep.nonzero().flatten().tolist() for s in range(n)]
            kept += [rollouts[i] for i in rows]
            kept_scores = kept_scores + scores.rows(rows)
            metrics["train/num_gen_batches"] = gen_batch + 1
            if len(kept) >= want * n:
                break
        if not kept:  # every group was filtered: train on the last batch (zero advantages)
            kept, kept_scores = rollouts, scores
        kept_scores = kept_scores.rows(range(min(len(kept), want * n)))
        metrics.update(stats.metrics())
        metrics["reward/errors"] = kept_scores.errors
        for name, values in kept_scores.components.items():
            metrics[f"reward/{name}/mean"] = float(np.mean(values))
        return kept[: len(kept_scores.scores)], kept_scores

    def score(self, rollouts: list[Rollout]) -> Scores:
        overlong, R = self.cfg.reward_model.overlong_buffer, self.cfg.data.max_response_length
        scores = score_rollouts(self.reward_fn, self.tokenizer, rollouts, overlong, R)
        if scores.errors > self.cfg.reward_model.max_error_ratio * len(rollouts):
            raise RewardFunctionError(
                f"reward function {self.reward_fn.name} failed on {scores.errors} of "
                f"{len(rollouts)} responses at step {self.global_step} (first: "
                f"{scores.first_error}); fix it, or raise reward_model.max_error_ratio"
            )
        if scores.first_error:
            self.tracker.warn(
                f"reward function {self.reward_fn.name}: {scores.errors} failed calls, "
                f"first: {scores.first_error}"
            )
        return scores

    # ---------------------------------------------------------------- learner inputs
    def train_batch(
        self, rollouts: list[Rollout], scores: Scores, metrics: dict[str, float]
    ) -> TrainBatch:
        """Rollouts as tensors with what the update needs: old logprobs, rollout importance
        weights, reference logprobs and advantages."""
        cfg = self.cfg
        batch = TrainBatch.collate(rollouts, self.tokenizer.pad_token_id)
        rollout_logprobs = batch.pad_responses([r.current_logprobs for r in rollouts])
        with timed(metrics, "old_log_prob"):
            if self.rollout_logprobs_are_old_logprobs:
                batch.old_logprobs = rollout_logprobs
            else:
                batch.old_logprobs = self.actor.logprobs(batch)
        metrics.update(logprob_mismatch(batch.old_logprobs, rollout_logprobs, batch.response_mask))
        behaviour = batch.pad_responses(  # what each token was sampled with
            [
                r.current_logprobs if r.behaviour_logprobs is None else r.behaviour_logprobs
                for r in rollouts
            ]
        )
        batch.is_weights, corrected = correction_weights(
            batch.old_logprobs,
            behaviour,
            batch.response_mask,
            cfg.algorithm.rollout_correction,
            cfg.rollout.spec,
        )
        metrics.update(corrected)
        if cfg.actor.use_kl_loss:
            with timed(metrics, "ref"):
                batch.ref_logprobs = self.actor.logprobs(batch, reference=True)
        if self.critic is not None:
            with timed(metrics, "values"):
                batch.values = self.critic.values(batch)
        with timed(metrics, "adv"):
            inputs = AdvantageInputs(
                torch.tensor(scores.scores).view(-1, cfg.rollout.n),
                batch.response_mask,
                cfg.algorithm.gamma,
                cfg.algorithm.norm_adv_by_std_in_grpo,
                batch.values,
                cfg.algorithm.lam,
            )
            batch.advantages, batch.returns = compute_advantages(
                cfg.algorithm.adv_estimator, inputs
            )
        if self.critic is not None:
            metrics.update(value_metrics(batch.values, batch.returns, batch.response_mask))
        return batch

    def validate(self) -> dict[str, float]:
        return evaluate(
            self.engine,
            self.val_prompts,
            self.reward_fn,
            self.tokenizer,
            self.cfg.data.val_batch_size,
            self.cfg.data.max_response_length,
            self.global_step,
            self.episodes,
        )
