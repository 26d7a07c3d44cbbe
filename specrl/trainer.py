"""The training loop, top to bottom as in docs/design.md: rollout → rewards → advantages → update →
sync → log. A `Trainer` holds the run that assemble.py builds from the config and runs this loop.
Everything speculative happens inside the rollout stage; the learner's inputs are built in
learner_inputs.py; the policy and its update live in actor/."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from specrl.algorithms.dapo import groups_with_signal
from specrl.assemble import Run, build_run
from specrl.config import Config, save_config
from specrl.errors import UserError
from specrl.learner_inputs import learner_batch
from specrl.metrics import data_metrics, timed
from specrl.rewards import RewardFunctionError, Scores, score_rollouts
from specrl.run_dir import RunInterrupted, StopSignals
from specrl.tracking import Tracker
from specrl.types import Rollout


class TrainingDivergedError(UserError):
    """Training cannot continue: repeated non-finite losses or gradients."""


@dataclass
class Collected:
    """A step's rollouts and their scores, with the step's metrics so far and the seconds they
    took."""

    metrics: dict[str, float]
    rollouts: list[Rollout]
    scores: Scores
    seconds: float


class Trainer:
    def __init__(self, cfg: Config, tracker: Tracker | None = None) -> None:
        self.run: Run = build_run(cfg, tracker)
        self.bad_steps = 0  # consecutive steps with skipped (non-finite) updates

    # ---------------------------------------------------------------- loop
    def fit(self) -> dict[str, float]:
        with self.running():
            while not self.finished:
                self.step()
        return self.run.tracker.summary(self.run.run_dir)

    finished = property(lambda self: self.run.global_step >= self.run.total_steps)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The run started (config saved, tracker started, evaluated before training), and shut
        down on leaving; `step` runs a step inside (the bench steps several runs in turn)."""
        run = self.run
        save_config(run.cfg, run.run_dir / "config.yaml")
        if run.threads_note:  # after every check of the input: bad input gets one line
            run.tracker.print(run.threads_note)
        if run.resume_from is not None:
            run.tracker.print(f"resuming from {run.resume_from} at step {run.global_step} "
                              "(trainer.resume_mode=disable starts over)")  # fmt: skip
            run.tracker.start(keep_through_step=run.global_step, config=run.cfg.model_dump())
        else:
            run.tracker.start(config=run.cfg.model_dump())
            if run.cfg.trainer.val_before_train:
                run.tracker.log({"training/global_step": 0, **run.validate()})
        # Everything alive now (model, data, library objects: ~400k) lives through the run; frozen,
        # the collector stops scanning it (as vLLM's does): a full collection took ~0.1 s here.
        gc.collect()
        gc.freeze()
        try:
            with (
                run.tracker.progress(run.total_steps, run.global_step) as self._advance,
                StopSignals() as self._stop,
            ):
                yield
        finally:
            gc.unfreeze()
            run.rollouts.shutdown()
            run.actor.shutdown()
            run.tracker.close()
            run.lock.release()

    def step(self) -> dict[str, float]:
        """One step of the run (inside `running`): train, evaluate and save when due, log."""
        return self.finish_step(self.begin_step())

    def begin_step(self) -> Collected:
        """A step's first half, its rollouts (`finish_step` is the rest): the bench rolls out
        several runs' steps back to back, then updates them."""
        self.run.global_step += 1
        return self.roll_out()

    def finish_step(
        self, collected: Collected, after_update: Callable[[], None] | None = None
    ) -> dict[str, float]:
        """The rest of the step: learn, evaluate and save when due, log. `after_update` runs
        between the update and the evaluation (the bench's paired arms take another run's weights
        there)."""
        run = self.run
        metrics = self.learn(collected)
        self._check_finite(metrics)
        if after_update is not None:
            after_update()
        if run.cfg.trainer.test_freq > 0 and self._due(run.cfg.trainer.test_freq):
            metrics.update(run.validate())
        stop = self._stop.received  # read once: a signal arriving later stops the next step
        if self._due(run.cfg.trainer.save_freq) or stop:
            path = run.save()
        run.tracker.log(metrics)
        self._advance(metrics)
        if stop:
            raise RunInterrupted(
                f"interrupted at step {run.global_step}; saved {path}; rerun the same command to "
                "resume", stop,
            )  # fmt: skip
        return metrics

    def _check_finite(self, metrics: dict[str, float]) -> None:
        """Skipped updates are reported every step; trainer.max_bad_steps in a row stop the run
        after saving a checkpoint (of the last good weights: bad updates are never applied)."""
        run = self.run
        skipped = metrics["actor/skipped_updates"]
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        if skipped:
            run.tracker.warn(
                f"step {run.global_step}: {skipped} updates skipped (non-finite loss or gradient)"
            )
        if self.bad_steps >= run.cfg.trainer.max_bad_steps:
            run.tracker.log(metrics)
            path = run.save()
            raise TrainingDivergedError(
                f"{self.bad_steps} steps in a row had non-finite losses or gradients; stopped after "
                f"saving {path}. Lower actor.optim.lr or actor.grad_clip, or check the reward scale"
            )

    def _due(self, freq: int) -> bool:
        step = self.run.global_step
        return step == self.run.total_steps or (freq > 0 and step % freq == 0)

    def train_step(self) -> dict[str, float]:
        return self.learn(self.roll_out())

    def roll_out(self) -> Collected:
        """The step's rollouts and their scores (`collect_rollouts`), the next batch's trees
        seeded ahead where configured."""
        run, cfg = self.run, self.run.cfg
        metrics: dict[str, float] = {"training/global_step": run.global_step}
        started = time.perf_counter()
        rollouts, scores = self.collect_rollouts(metrics)
        if (warning := run.signal.check(run.global_step, scores.scores)) is not None:
            run.tracker.warn(warning)
        if cfg.rollout.run_ahead:  # workers seed the next batch's trees during the update
            next_key = (cfg.trainer.seed, run.global_step + 1, "run-ahead")
            run.rollouts.run_ahead(run.loader.peek(), next_key, run.global_step)
        return Collected(metrics, rollouts, scores, time.perf_counter() - started)

    def learn(self, collected: Collected) -> dict[str, float]:
        """The update on a step's rollouts, and the weights synced to the rollout engine."""
        run, cfg = self.run, self.run.cfg
        metrics, rollouts, scores = collected.metrics, collected.rollouts, collected.scores
        started = time.perf_counter()
        batch = learner_batch(run, rollouts, scores, metrics)
        if cfg.rollout.enable_sleep_mode:  # the trainer gets the GPU memory during the update
            run.rollouts.sleep()
        with timed(metrics, "update_actor"):
            seed = cfg.trainer.seed * 1_000_003 + run.global_step
            metrics.update(run.actor.update(batch, cfg.rollout.n, seed).metrics())
        if run.critic is not None:
            with timed(metrics, "update_critic"):
                metrics.update(run.critic.update(batch, cfg.rollout.n, seed).metrics())
        if cfg.rollout.enable_sleep_mode:
            run.rollouts.wake_up()
        with timed(metrics, "sync"):
            metrics["sync/weight_bytes"] = run.sync_weights()
        metrics["timing_s/step"] = collected.seconds + time.perf_counter() - started
        metrics.update(data_metrics(
            rollouts, torch.tensor(scores.scores), batch.advantages, batch.response_mask,
            metrics["timing_s/step"],
        ))  # fmt: skip
        metrics["training/epoch"] = run.loader.epoch
        return metrics

    # ---------------------------------------------------------------- rollout + rewards
    def collect_rollouts(self, metrics: dict[str, float]) -> tuple[list[Rollout], Scores]:
        """Rollouts and their scores for data.train_batch_size prompts. With DAPO dynamic
        sampling, groups whose `filter_groups.metric` is the same for every slot are dropped and
        more prompts are rolled out, up to algorithm.filter_groups.max_num_gen_batches batches."""
        run, cfg = self.run, self.run.cfg
        n, want = cfg.rollout.n, cfg.data.train_batch_size
        filtering = cfg.algorithm.filter_groups
        kept: list[Rollout] = []
        kept_scores = Scores([], [], [], [])
        stats = None  # RolloutStats, or EpisodeStats in multi-turn runs: they add up
        for gen_batch in range(filtering.max_num_gen_batches if filtering.enable else 1):
            seed_key = (cfg.trainer.seed, run.global_step, gen_batch)
            prompts = run.loader.next_batch()
            rollouts, batch_stats = run.rollouts(prompts, n, seed_key, run.global_step)
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
        run = self.run
        overlong, R = run.cfg.reward_model.overlong_buffer, run.cfg.data.max_response_length
        scores = score_rollouts(run.reward_fn, run.tokenizer, rollouts, overlong, R)
        if scores.errors > run.cfg.reward_model.max_error_ratio * len(rollouts):
            raise RewardFunctionError(
                f"reward function {run.reward_fn.name} failed on {scores.errors} of "
                f"{len(rollouts)} responses at step {run.global_step} (first: "
                f"{scores.first_error}); fix it, or raise reward_model.max_error_ratio"
            )
        if scores.first_error:
            run.tracker.warn(
                f"reward function {run.reward_fn.name}: {scores.errors} failed calls, "
                f"first: {scores.first_error}"
            )
        return scores
